"""Write-ahead saving of the job's key-value store: batched, incremental, retried.

A key set (or add) is staged in the `KvStore`, handed to `write`, and answered once the batch
holding it is saved (`StateStore.save_kv`: the changed keys only, never the whole store); only
then is it committed, visible to `get` and `wait`. Sets that arrive while a batch is being saved
go in the next one, so a burst of sets costs a few saves, not one each.

A save that fails (the disk full, etcd unreachable) is retried with backoff, the newer sets
joining the batch, and nothing is answered meanwhile. A save refused because this scheduler no
longer holds the store (`FencedError`) ends the journal: every waiting set fails with
NotLeaderError (the node asks the leader again), and `on_fenced` tells the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from cluster.protocol.backoff import RetryPolicy
from cluster.protocol.errors import FencedError, NotLeaderError, StateFileError
from cluster.scheduler.persist import SAVE_RETRY
from cluster.storage.state_store import StateStore

log = logging.getLogger("cluster.scheduler")


class KvJournal:
    def __init__(
        self,
        store: StateStore,
        job: str,
        commit: Callable[[str, bytes], None],
        on_fenced: Callable[[str], None],
        *,
        retry: RetryPolicy = SAVE_RETRY,
    ) -> None:
        self._store = store
        self._job = job
        self._commit = commit
        self._on_fenced = on_fenced
        self._retry = retry
        # Sets not yet in a batch being saved, in order, and who waits for them.
        self._pending: list[tuple[str, bytes]] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._in_flight: list[asyncio.Future[None]] = []  # of the batch being saved
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.fenced: str | None = None
        self.error: str | None = None  # the last failed save's, while saves fail

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-kv-journal")

    async def write(self, key: str, value: bytes) -> None:
        """Return once `key` = `value` is saved (and committed). The save goes on when the
        caller gives up waiting: what was staged is committed all the same."""
        if self.fenced is not None:
            raise NotLeaderError(self.fenced)
        waiter = asyncio.get_running_loop().create_future()
        self._pending.append((key, value))
        self._waiters.append(waiter)
        self._wake.set()
        await asyncio.shield(waiter)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            changes, waiters = self._pending, self._waiters
            self._pending, self._waiters, self._in_flight = [], [], waiters
            if not await self._save(changes, waiters):
                return
            self._in_flight = []
            for key, value in changes:
                self._commit(key, value)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _save(
        self, changes: list[tuple[str, bytes]], waiters: list[asyncio.Future[None]]
    ) -> bool:
        """Save `changes` (joined by what arrives while saves fail); False when fenced."""
        backoff = self._retry.backoff()
        while True:
            try:
                await self._store.save_kv(self._job, dict(changes))
            except FencedError as exc:
                self._fence(str(exc), waiters + self._waiters)
                return False
            except StateFileError as exc:
                self._failed(str(exc))
                await asyncio.sleep(backoff.next_s())
                changes.extend(self._pending)
                waiters.extend(self._waiters)
                self._pending, self._waiters = [], []
                continue
            if self.error is not None:
                log.info("the key-value store is saved again; the waiting calls are answered")
                self.error = None
            return True

    def _failed(self, why: str) -> None:
        if self.error is None:
            log.error("%s; retrying, and the key-value calls wait meanwhile", why)
        self.error = why

    def _fence(self, why: str, waiters: list[asyncio.Future[None]]) -> None:
        self.fenced = why
        self._pending, self._waiters = [], []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(NotLeaderError(why))
                waiter.exception()  # retrieved: its caller may be gone
        self._on_fenced(why)

    async def stop(self, timeout_s: float | None = None) -> bool:
        """Save what is pending (for up to `timeout_s`), then stop; True when nothing is left."""
        if self._task is None:
            return not self._pending
        waiting = [*self._in_flight, *self._waiters]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        return not any(not w.done() for w in [*self._in_flight, *self._waiters])
