"""A level-triggered wake-up for asyncio waiters (event and table streams)."""

from __future__ import annotations

import asyncio


class ChangeNotifier:
    """``notify()`` wakes every coroutine blocked in :meth:`wait`; cheap when nobody waits.

    Waiters re-check their condition after waking (the notifier carries no data), so a
    notification that lands between a check and the wait is never lost: :meth:`wait` takes
    the version seen at the check.
    """

    def __init__(self) -> None:
        self._version = 0
        self._waiter: asyncio.Future[None] | None = None

    @property
    def version(self) -> int:
        return self._version

    def notify(self) -> None:
        self._version += 1
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, seen_version: int, timeout: float | None = None) -> bool:
        """Wait until the version moves past ``seen_version``; False on timeout."""
        if self._version != seen_version:
            return True
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
        except TimeoutError:
            return False
        return True
