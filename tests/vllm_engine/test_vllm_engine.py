"""``pagekeeper_client.vllm`` without vLLM (always run), and the proof with a real vLLM
engine (only under ``make test-vllm``, which sets ``PAGEKEEPER_VLLM_ENGINE=1``).

The engine proof runs ``run_vllm_engine.py`` with the vLLM side virtualenv's interpreter
(``$PAGEKEEPER_VLLM_VENV``, default ``/opt/vllm-engine``, built by
``scripts/vllm_engine_venv.sh``): the same prompts through vLLM's own KV-cache manager and
through pagekeeper's, compared token for token, cached-token count for cached-token count,
prefix-cache statistic for statistic and page id for page id.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekeeper.core.pool import PagePool
from pagekeeper_client.vllm import PrefixMirror, unsupported

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 1800


# -- without vLLM ----------------------------------------------------------------------------


def test_module_imports_without_vllm() -> None:
    # The client package never depends on vLLM: importing the adapter pulls none of it.
    code = (
        "import sys, pagekeeper_client.vllm as v; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
        "print(v.make_scheduler_class.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "make_scheduler_class"


def test_scheduler_class_needs_vllm() -> None:
    import importlib.util

    import pagekeeper_client.vllm as adapter

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")
    with pytest.raises(ImportError):
        adapter.PagekeeperScheduler  # noqa: B018 - the lazy attribute imports vLLM
    with pytest.raises(AttributeError):
        adapter.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


def test_unsupported_names_the_feature() -> None:
    err = unsupported("speculative decoding")
    assert isinstance(err, NotImplementedError)
    assert "speculative decoding" in str(err)


def test_mirror_keeps_duplicates_in_insertion_order() -> None:
    mirror = PrefixMirror()
    mirror.insert(5, b"a")
    mirror.insert(6, b"b")
    mirror.insert(7, b"a")  # a duplicate waits behind page 5
    mirror.insert(8, b"a")
    assert mirror.lookup([b"a", b"b"], 2) == [5, 6]
    assert mirror.lookup([b"a", b"b"], 1) == [5]
    assert mirror.lookup([b"b", b"a"], 5) == [6, 5]
    assert mirror.evict(5)
    assert mirror.lookup([b"a"], 1) == [7]  # the oldest duplicate takes over
    assert mirror.evict(8) and not mirror.evict(8)
    assert mirror.lookup([b"a"], 1) == [7]
    mirror.forget_key(b"a")
    assert mirror.lookup([b"a"], 1) == [] and len(mirror) == 1
    mirror.clear()
    assert len(mirror) == 0 and mirror.key_of(6) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_mirror_matches_the_service_pool(seed: int) -> None:
    """The mirror sees what the engine sees (pages handed out, pages it fills) and must
    answer every lookup as the service's own index does, duplicates and evictions included."""
    rng = random.Random(seed)
    pool = PagePool(24, enable_caching=True)
    pool.ensure_groups(1)
    mirror = PrefixMirror()
    held: list[list[int]] = []
    hashes = [bytes([i]) * 8 for i in range(6)]
    for _ in range(120):
        op = rng.random()
        if op < 0.45 and pool.num_free_pages:
            pages = pool.allocate(rng.randint(1, min(3, pool.num_free_pages)))
            for page in pages:
                mirror.evict(page)  # what the engine does with every new page id
            held.append(pages)
        elif op < 0.75 and held:
            pages = rng.choice(held)
            uncached = [p for p in pages if not pool.is_cached(p)]
            if uncached:
                page = uncached[0]
                key = rng.choice(hashes)
                pool.cache(
                    0, [page], [key], parent_hash=None, token_ids=[1], page_size=1, lora_name=None
                )
                mirror.insert(page, key)
        elif held:
            pages = held.pop(rng.randrange(len(held)))
            pool.free(pages[::-1])
        for key in hashes:
            assert mirror.lookup([key], 1) == (
                [] if pool.lookup(0, key) is None else [pool.lookup(0, key)]
            )


# -- with a real vLLM engine -----------------------------------------------------------------


def _vllm_python() -> Path:
    return Path(os.environ.get("PAGEKEEPER_VLLM_VENV", "/opt/vllm-engine")) / "bin" / "python"


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
@pytest.mark.skipif(
    os.environ.get("PAGEKEEPER_VLLM_ENGINE") != "1",
    reason="the real-vLLM proof runs under `make test-vllm` (PAGEKEEPER_VLLM_ENGINE=1)",
)
def test_vllm_engine_runs_on_pagekeeper(tmp_path: Path) -> None:
    python = _vllm_python()
    if not python.exists():
        pytest.skip(
            f"no vLLM side virtualenv at {python.parent.parent} "
            "(scripts/vllm_engine_venv.sh builds it)"
        )
    results = tmp_path / "results.json"
    command = [str(python), str(HERE / "run_vllm_engine.py"), "--json", str(results)]
    if os.environ.get("PAGEKEEPER_VLLM_CONFIGS"):
        command += ["--configs", os.environ["PAGEKEEPER_VLLM_CONFIGS"]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    report = "\n".join(
        line for line in out.stdout.splitlines() if not line.startswith("(") and line.strip()
    )
    print(report)
    assert out.returncode == 0, f"{report}\n--- stderr (tail) ---\n{out.stderr[-4000:]}"


def _stub_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few vLLM classes the connector touches, as stand-ins (restored after the test)."""
    import types

    class KVCacheBlock:
        def __init__(self, block_id: int) -> None:
            self.block_id = block_id
            self._block_hash = None
            self._block_hash_num_tokens = None

    class KVCacheBlocks:
        def __init__(self, blocks: object) -> None:
            self.blocks = blocks

        def get_block_ids(self) -> tuple[list[int], ...]:
            return tuple([b.block_id for b in g] for g in self.blocks)  # type: ignore[attr-defined]

    class PrefixCacheStats:
        pass

    modules = {
        name: types.ModuleType(name)
        for name in (
            "vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_manager",
            "vllm.v1.core.kv_cache_utils", "vllm.v1.metrics", "vllm.v1.metrics.stats",
        )
    }  # fmt: skip
    modules["vllm.v1.core.kv_cache_manager"].KVCacheBlocks = KVCacheBlocks  # type: ignore[attr-defined]
    modules["vllm.v1.core.kv_cache_utils"].KVCacheBlock = KVCacheBlock  # type: ignore[attr-defined]
    modules["vllm.v1.metrics.stats"].PrefixCacheStats = PrefixCacheStats  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


class _Request:
    """What the connector reads of a vLLM request (its own page hashes: sha256 chained)."""

    def __init__(self, request_id: str, prompt: range) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.cache_salt = None
        self.lora_request = None
        self.mm_features: list[object] = []
        self.skip_reading_prefix_cache = False
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        import hashlib

        out, parent = [], b""
        for i in range(self.num_tokens // 16):
            page = repr(self.all_token_ids[i * 16 : (i + 1) * 16]).encode()
            parent = hashlib.sha256(parent + page).digest()
            out.append(parent)
        return out


def test_connector_after_an_admin_freed_its_request(server_factory, monkeypatch) -> None:
    """Decodes filled a page here (mirrored, not yet reported) when an admin freed the
    request: the connector answers its next growth None (the engine preempts it), forgets
    the page the service never cached, and the request admitted again hits what the service
    holds (it predicted a page the service did not have, and raised, before)."""
    import types

    from pagekeeper_client import PagekeeperClient

    _stub_vllm(monkeypatch)
    from pagekeeper_client.vllm import PagekeeperKVCacheManager

    server = server_factory("--num-pages", "64", admin_token="adm")
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler", name="engine")
        manager = PagekeeperKVCacheManager(
            client,
            kv_cache_config=types.SimpleNamespace(num_blocks=64),
            original=types.SimpleNamespace(
                coordinator=types.SimpleNamespace(single_type_managers=())
            ),
            block_size=16,
            max_model_len=client.pool.max_model_len,
            enable_caching=True,
            log_stats=False,
            hash_algorithm="sha256",
        )
        request = _Request("r", range(1000, 1040))  # pages 0, 1 full, 2 partial
        manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, 40) is not None
        request.num_computed_tokens = 40
        for t in range(8):  # page 2 fills here: mirrored, its report waits
            request.all_token_ids.append(5000 + t)
            assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
        http = server.http()
        assert http.delete("/v1/requests/r", headers={"Authorization": "Bearer adm"}).is_success
        request.all_token_ids.append(6000)
        assert manager.allocate_slots(request, 1) is None  # preempt it
        assert client.is_revoked("r")
        manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        manager.end_step()
        blocks, hit = manager.get_computed_blocks(request)[:2]
        assert hit == 32  # pages 0 and 1: the ones the service cached
        assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
        manager.flush()
        assert [r["request_id"] for r in http.get("/v1/requests").json()["items"]] == ["r"]


def _manager(client, monkeypatch: pytest.MonkeyPatch):
    """A manager over ``client`` with 16-token pages and the engine hashing with its own
    algorithm (the stub request's, as vLLM's default pickle-based "sha256" differs from
    the service's sha256_cbor): the service cannot hash generated pages like the engine."""
    import types

    _stub_vllm(monkeypatch)
    from pagekeeper_client.vllm import PagekeeperKVCacheManager

    return PagekeeperKVCacheManager(
        client,
        kv_cache_config=types.SimpleNamespace(num_blocks=64),
        original=types.SimpleNamespace(coordinator=types.SimpleNamespace(single_type_managers=())),
        block_size=16,
        max_model_len=client.pool.max_model_len,
        enable_caching=True,
        log_stats=False,
        hash_algorithm="sha256",
    )


def _generate(manager, request: _Request, num_tokens: int) -> None:
    """Admit ``request`` and decode until it holds ``num_tokens`` tokens."""
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    while request.num_tokens < num_tokens:
        request.all_token_ids.append(7000 + request.num_tokens)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


@pytest.mark.parametrize("takes_growth_hashes", [True, False], ids=["service", "older-service"])
def test_a_chats_next_turn_hits_the_pages_the_answer_filled(
    server_factory, monkeypatch, takes_growth_hashes
) -> None:
    """A request's generated tokens fill page 1; a new prompt containing them (a chat's next
    turn) hits it when the service takes a growth's page hashes: the growth that carried
    those tokens named the page by the engine's hash, as the new prompt's admission does.
    An older service hashes the page itself, and the new prompt hits the prompt's page
    only. Either way the mirror predicted what the service answered (else RuntimeError)."""
    import dataclasses

    from pagekeeper_client import PagekeeperClient

    server = server_factory("--num-pages", "64")
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler", name="engine")
        assert client.pool.accepts_growth_page_hashes
        if not takes_growth_hashes:  # what an older service registers
            registration = client._registration
            client._registration = dataclasses.replace(
                registration,
                pool=dataclasses.replace(registration.pool, accepts_growth_page_hashes=False),
            )
        manager = _manager(client, monkeypatch)
        first = _Request("turn-1", range(1000, 1020))  # page 0 full, page 1 partial
        _generate(manager, first, 44)  # generated tokens fill page 1 (16..31)
        manager.free(first)
        manager.end_step()
        follow_up = _Request("turn-2", [*first.all_token_ids, *range(9000, 9010)])
        expected = 32 if takes_growth_hashes else 16
        service = client.lookup(follow_up.all_token_ids, page_hashes=follow_up.block_hashes)
        assert service.num_hit_tokens == expected
        blocks, hit = manager.get_computed_blocks(follow_up)[:2]
        assert hit == expected
        assert (
            manager.allocate_slots(follow_up, follow_up.num_tokens - hit, hit, blocks) is not None
        )
        assert manager.stats.num_mispredicted == 0
        manager.flush()


class _LaggingRequest(_Request):
    """A request whose engine hashed its prompt's pages only (vLLM does not lag so)."""

    @property
    def block_hashes(self) -> list[bytes]:
        return super().block_hashes[: self.num_prompt_tokens // 16]


def test_pages_the_engine_did_not_hash_are_the_services_to_hash(server_factory, monkeypatch):
    """Where the engine has no hash for a page its generated tokens fill, the growth sends
    none and the mirror keys the page (and every later one) as the service hashes it: a new
    prompt with the same text hits the prompt's page only, as the service answers."""
    from pagekeeper_client import PagekeeperClient

    server = server_factory("--num-pages", "64")
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler", name="engine")
        manager = _manager(client, monkeypatch)
        first = _LaggingRequest("lagging", range(1000, 1020))
        _generate(manager, first, 60)  # fills pages 1 and 2
        assert manager._requests["lagging"].num_client_hashed_pages == 1
        manager.free(first)
        follow_up = _Request("next", [*first.all_token_ids, *range(9000, 9010)])
        blocks, hit = manager.get_computed_blocks(follow_up)[:2]
        assert hit == 16
        assert (
            manager.allocate_slots(follow_up, follow_up.num_tokens - hit, hit, blocks) is not None
        )
        assert manager.stats.num_mispredicted == 0
        manager.flush()
