"""The job's key-value store: set, get, wait with a timeout, and atomic add.

It lives in the scheduler's event loop, so no locks are needed; waiters are futures resolved
when their last key arrives. Counters are stored as decimal ASCII, as in torch's TCPStore, so a
counter can be read with get like any other key.

What it holds is capped (CLUSTER_KV_MAX_BYTES of keys and values, CLUSTER_KV_MAX_KEYS keys, a
number of pending waits), counted as it changes: a set past a cap is refused with a
`CapacityError` that names the cap, and nothing else changes.
"""

from __future__ import annotations

import asyncio
import math

from cluster.protocol.config import DEFAULT_KV_MAX_BYTES, DEFAULT_KV_MAX_KEYS
from cluster.protocol.errors import CapacityError, CollectiveError

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 4 * 1024 * 1024
# Pending waits: a node waits on a few keys at a time (its threads' rendezvous).
WAITS_PER_NODE = 16
MIN_MAX_WAITS = 1024


class KvStore:
    def __init__(
        self,
        max_bytes: int = DEFAULT_KV_MAX_BYTES,
        max_keys: int = DEFAULT_KV_MAX_KEYS,
        *,
        nodes: int = 1,
        max_waits: int | None = None,
    ) -> None:
        """`nodes`: the job's, which sizes the pending waits kept (unless `max_waits` says)."""
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.max_waits = (
            max(MIN_MAX_WAITS, WAITS_PER_NODE * nodes) if max_waits is None else max_waits
        )
        self.held_bytes = 0  # keys and values, in bytes
        self.pending_waits = 0

    def __len__(self) -> int:
        return len(self._data)

    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        if len(value) > MAX_VALUE_BYTES:
            raise CollectiveError(
                f"value for key {key!r} has {len(value)} bytes; the store takes at most "
                f"{MAX_VALUE_BYTES} (it is for control data, not tensors)"
            )
        old = self._data.get(key)
        grows = len(value) + (len(key.encode()) if old is None else -len(old))
        self._check_room(key, new_key=old is None, grows=grows)
        self._data[key] = value
        self.held_bytes += grows
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)

    def get(self, keys: list[str]) -> tuple[list[bytes], list[str]]:
        """Values of the present keys in request order, and the missing keys."""
        values = [self._data[k] for k in keys if k in self._data]
        missing = [k for k in keys if k not in self._data]
        return values, missing

    def add(self, key: str, amount: int) -> int:
        current = self._data.get(key, b"0")
        try:
            number = int(current.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise CollectiveError(
                f"key {key!r} holds a value that is not a counter; add works on counters only"
            ) from None
        number += amount
        self.set(key, str(number).encode("ascii"))
        return number

    def _check_room(self, key: str, *, new_key: bool, grows: int) -> None:
        if new_key and len(self._data) >= self.max_keys:
            raise CapacityError(
                f"the key-value store is full: it holds {len(self._data)} keys, its cap "
                f"(CLUSTER_KV_MAX_KEYS={self.max_keys}), so key {key[:40]!r} cannot be added; "
                "it is for coordination, not data: reuse keys, or start the scheduler with a "
                "larger CLUSTER_KV_MAX_KEYS"
            )
        if self.held_bytes + grows > self.max_bytes:
            raise CapacityError(
                f"the key-value store is full: it holds {self.held_bytes} bytes of keys and "
                f"values, and key {key[:40]!r} would add {grows} more, past its cap "
                f"(CLUSTER_KV_MAX_BYTES={self.max_bytes}); it is for coordination, not data: "
                "store less, or start the scheduler with a larger CLUSTER_KV_MAX_BYTES"
            )

    async def wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        """Wait until every key is set; its values in request order."""
        for key in keys:
            _check_key(key)
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise CollectiveError(
                f"key-value wait timeout {timeout_s!r} is not a number of seconds"
            )
        if self.pending_waits >= self.max_waits and any(k not in self._data for k in keys):
            raise CapacityError(
                f"{self.pending_waits} key-value waits are pending, the most the scheduler keeps "
                f"for this job (at least {MIN_MAX_WAITS}, {WAITS_PER_NODE} per node): wait for "
                "fewer keys at a time"
            )
        self.pending_waits += 1
        try:
            return await self._wait(keys, timeout_s)
        finally:
            self.pending_waits -= 1

    async def _wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return [self._data[k] for k in keys]
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(missing[0], []).append(waiter)
            remaining = deadline - loop.time()
            try:
                await asyncio.wait_for(waiter, max(remaining, 0.0))
            except asyncio.TimeoutError:  # not builtin TimeoutError before 3.11
                shown = ", ".join(repr(k) for k in missing[:5])
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise CollectiveError(
                    f"key-value wait timed out after {timeout_s:g} s; still missing {shown}{more}"
                ) from None
            finally:
                self._discard(missing[0], waiter)

    def _discard(self, key: str, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]


def _check_key(key: str) -> None:
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise CollectiveError(f"key {key[:40]!r} must be 1-{MAX_KEY_BYTES} bytes long")
