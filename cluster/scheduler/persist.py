"""Write-ahead saving of the scheduler's state under MS_RECOVERY_PATH.

The state machine bumps its revision on every change a restarted scheduler must know. The core
asks for that revision to be saved and holds back what it would tell the nodes until the save
is done, so no node ever hears of a topology that a crash could forget. Saves run on a worker
thread (an fsync must not stall heartbeats) and are coalesced: while one write is on disk, any
number of further changes wait for the next, which takes the newest snapshot. A 1024-node job
finishing therefore costs a few writes, not 1024.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.protocol.errors import StateFileError
from cluster.storage import store

log = logging.getLogger("cluster.scheduler")

STATE_FILE = "scheduler.json"
STATE_KIND = "scheduler"


def state_path(directory: Path) -> Path:
    return directory / STATE_FILE


class StatePersister:
    """Saves `snapshot()` whenever a newer revision is requested; `on_saved(revision)` follows."""

    def __init__(
        self,
        path: Path,
        snapshot: Callable[[], dict[str, Any]],
        on_saved: Callable[[int], None],
        saved_revision: int,
    ) -> None:
        self.path = path
        self._snapshot = snapshot
        self._on_saved = on_saved
        self.requested = saved_revision
        self.saved = saved_revision
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        # The last save failed: its error, until one succeeds.
        self.error: str | None = None
        # Told how each save ended, its seconds and error (None: it landed): the scheduler's
        # event log and metrics (cluster.scheduler.observe).
        self.observer: Callable[[float, str | None], None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-state-persister")

    async def stop(self) -> None:
        """Save what is still pending, then stop."""
        if self._task is None:
            return
        await self.flushed(self.requested)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    def request(self, revision: int) -> None:
        if revision > self.requested:
            self.requested = revision
            self._wake.set()

    @property
    def pending(self) -> bool:
        return self.saved < self.requested

    async def flushed(self, revision: int) -> None:
        """Wait until `revision` (or a newer one) is on disk, or its save has failed."""
        if self.saved >= revision:
            return
        async with self._progress:
            await self._progress.wait_for(lambda: self.saved >= revision)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.pending:
                continue
            snapshot = self._snapshot()  # on the loop: consistent with what was decided
            revision = int(snapshot["revision"])
            started = time.perf_counter()
            try:
                await asyncio.to_thread(store.save, self.path, STATE_KIND, snapshot)
            except StateFileError as exc:
                # The job goes on; only a scheduler restart would need the lost state. Say so
                # loudly, once per run of failures.
                if self.error is None:
                    # One line: the error names the file and the cause; a traceback adds nothing.
                    log.error("%s; a restarted scheduler would not know this change", exc)  # noqa: TRY400
                self.error = str(exc)
            else:
                if self.error is not None:
                    log.info("recovery state saved again to %s", self.path)
                self.error = None
            if self.observer is not None:
                self.observer(time.perf_counter() - started, self.error)
            self.saved = max(self.saved, revision)
            self._on_saved(self.saved)
            async with self._progress:
                self._progress.notify_all()
