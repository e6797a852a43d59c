"""A deliberately naive model of DESIGN §2 (vLLM v1 semantics, one full-attention group).

Python lists and dicts, no cleverness: the free queue is a list, the prefix index maps a
page's whole token prefix to the pages holding it. Tests run the real core and this model
side by side and compare every answer.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RefModel:
    def __init__(self, num_pages: int, page_size: int, *, caching: bool, max_model_len: int):
        self.page_size = page_size
        self.caching = caching
        self.max_model_len = max_model_len
        self.queue = list(range(1, num_pages))
        self.ref = [0] * num_pages
        self.key_of: dict[int, tuple[int, ...]] = {}
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.reqs: dict[str, dict] = {}
        self.evicted: list[int] = []

    # pool
    def _take(self, n: int) -> list[int]:
        pages, self.queue = self.queue[:n], self.queue[n:]
        for p in pages:
            key = self.key_of.pop(p, None)
            if key is not None:
                self.index[key].remove(p)
                if not self.index[key]:
                    del self.index[key]
                self.evicted.append(p)
            self.ref[p] = 1
        return pages

    def _touch(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref[p] == 0:
                self.queue.remove(p)
            self.ref[p] += 1

    def _free_pages(self, order: list[int]) -> None:
        head, tail = [], []
        for p in order:
            if p == 0:
                continue
            self.ref[p] -= 1
            if self.ref[p] == 0:
                (tail if p in self.key_of else head).append(p)
        self.queue = head + self.queue + tail

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[: (i + 1) * ps]) for i in range(len(tokens) // ps)]

    def _hits(self, tokens: list[int], max_len: int) -> list[int]:
        hits = []
        for key in self._keys(tokens)[: max_len // self.page_size]:
            if key not in self.index:
                break
            hits.append(self.index[key][0])
        return hits

    def _cache(self, rid: str, num_tokens: int) -> None:
        req = self.reqs[rid]
        n_full = min(num_tokens, len(req["tokens"])) // self.page_size
        keys = self._keys(req["tokens"])
        for i in range(req["cached"], n_full):
            page = req["pages"][i]
            self.key_of[page] = keys[i]
            self.index.setdefault(keys[i], []).append(page)
        req["cached"] = max(req["cached"], n_full)

    # manager
    def num_free(self) -> int:
        return len(self.queue)

    def lookup(self, tokens: list[int]) -> int:
        if not self.caching:
            return 0
        return len(self._hits(tokens, len(tokens))) * self.page_size

    def admit(self, rid, tokens, num_new=None, lookahead=0):
        hits = self._hits(tokens, len(tokens) - 1) if self.caching else []
        num_hit = len(hits) * self.page_size
        if num_new is None:
            num_new = len(tokens) - num_hit
        slots = min(num_hit + num_new + lookahead, self.max_model_len)
        new = max(cdiv(slots, self.page_size) - len(hits), 0)
        evictable = sum(1 for p in hits if self.ref[p] == 0)
        if new + evictable > len(self.queue):
            return None
        self._touch(hits)
        pages = self._take(new)
        self.reqs[rid] = {
            "tokens": list(tokens),
            "pages": hits + pages,
            "cached": len(hits),
            "computed": num_hit + num_new,
        }
        if self.caching:
            self._cache(rid, num_hit + num_new)
        return num_hit, pages, hits

    def grow(self, rid, new_tokens, num_new, lookahead=0):
        req = self.reqs[rid]
        computed = req["computed"]
        slots = min(computed + num_new + lookahead, self.max_model_len)
        new = max(cdiv(slots, self.page_size) - len(req["pages"]), 0)
        if new > len(self.queue):
            return None
        req["tokens"].extend(new_tokens)
        pages = self._take(new)
        req["pages"].extend(pages)
        if self.caching:
            self._cache(rid, computed + num_new)
        req["computed"] = computed + num_new
        return pages

    def free(self, rid):
        req = self.reqs.pop(rid)
        self._free_pages(list(reversed(req["pages"])))

    def reset(self) -> bool:
        if self.reqs:
            return False
        self.forget()
        return True

    def forget(self) -> int:
        """Every page forgets its key, held or not; returns how many had one."""
        num = len(self.key_of)
        self.key_of.clear()
        self.index.clear()
        return num
