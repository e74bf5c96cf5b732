"""The job's key-value store on the scheduler's loop: the waits, for `cluster.scheduler.machine.kv`.

The rules (the caps and shares, staging and committing, counters, which waits are admitted) are
the pure table `KvTable`'s; this shell holds the futures of the pending waits, each with its
timeout, and wakes those of a key when a commit makes it visible.
"""

from __future__ import annotations

import asyncio

from cluster.protocol.config import DEFAULT_KV_MAX_BYTES, DEFAULT_KV_MAX_KEYS
from cluster.protocol.display import listed
from cluster.protocol.errors import CollectiveError
from cluster.scheduler.machine.kv import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MIN_MAX_WAITS,
    SHARE_FLOOR_BYTES,
    SHARE_FLOOR_KEYS,
    WAITS_PER_NODE,
    KvTable,
)

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MIN_MAX_WAITS",
    "SHARE_FLOOR_BYTES",
    "SHARE_FLOOR_KEYS",
    "WAITS_PER_NODE",
    "KvStore",
]


class KvStore(KvTable):
    """`KvTable` with its waits: a wait is a future per missing key, resolved at its commit."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_KV_MAX_BYTES,
        max_keys: int = DEFAULT_KV_MAX_KEYS,
        *,
        nodes: int = 1,
        max_waits: int | None = None,
    ) -> None:
        super().__init__(max_bytes, max_keys, nodes=nodes, max_waits=max_waits)
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def commit(self, key: str, value: bytes) -> None:
        """A staged `value` of `key` is saved: visible from now on, its waiters woken."""
        super().commit(key, value)
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, keys: list[str], timeout_s: float, owner: str = "") -> list[bytes]:
        """Wait until every key is set; its values in request order. Member `owner` waits
        within its share of the pending waits."""
        self.admit_wait(keys, timeout_s, owner)
        try:
            return await self._wait(keys, timeout_s)
        finally:
            self.wait_ended(owner)

    async def _wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            missing = self.missing(keys)
            if not missing:
                return self.answer("a wait", keys)
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(missing[0], []).append(waiter)
            remaining = deadline - loop.time()
            try:
                await asyncio.wait_for(waiter, max(remaining, 0.0))
            except asyncio.TimeoutError:  # not builtin TimeoutError before 3.11
                raise CollectiveError(
                    f"key-value wait timed out after {timeout_s:g} s; still missing "
                    f"{listed(map(repr, missing), 5)}"
                ) from None
            finally:
                self._discard(missing[0], waiter)

    def abandon(self, error: Exception) -> None:
        """End every pending wait with `error` (this scheduler stops answering for the job)."""
        waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            for waiter in futures:
                if not waiter.done():
                    waiter.set_exception(error)
                    waiter.exception()  # retrieved: its call may be gone

    def _discard(self, key: str, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]
