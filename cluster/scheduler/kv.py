"""The job's key-value store: set, get, wait with a timeout, and atomic add.

It lives in the scheduler's event loop, so no locks are needed; waiters are futures resolved
when their last key arrives. Counters are stored as decimal ASCII, as in torch's TCPStore, so a
counter can be read with get like any other key.
"""

from __future__ import annotations

import asyncio

from cluster.protocol.errors import CollectiveError

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 4 * 1024 * 1024


class KvStore:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._data)

    def set(self, key: str, value: bytes) -> None:
        _check_key(key)
        if len(value) > MAX_VALUE_BYTES:
            raise CollectiveError(
                f"value for key {key!r} has {len(value)} bytes; the store takes at most "
                f"{MAX_VALUE_BYTES} (it is for control data, not tensors)"
            )
        self._data[key] = value
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

    async def wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        """Wait until every key is set; its values in request order."""
        for key in keys:
            _check_key(key)
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
