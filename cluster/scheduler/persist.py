"""Write-ahead saving in the scheduler's state store (MS_RECOVERY_PATH, etcd): one saver for the
job's state and its key-value store.

The state machine bumps its revision on every change a restarted scheduler must know. The core
asks for that revision to be saved and holds back what it would tell the nodes until the save
is done, so no node ever hears of a topology that a crash could forget. Saves run on a worker
thread (an fsync must not stall heartbeats) and are coalesced: while one write is on disk, any
number of further changes wait for the next, which takes the newest snapshot. A 1024-node job
finishing therefore costs a few writes, not 1024.

A save that fails (the disk full or read-only, an I/O error) releases nothing: it is tried
again with backoff (SAVE_RETRY: 0.1 s doubling to 5 s), each attempt with the newest
snapshot, until one lands; only then does what was held back go out, in order. A key-value
batch that fails is a failed save as well: saving fails while either part fails, and works
again once both land. The failure of each part is logged once when it starts and once when it
ends, and `failing_since`, `error`, `failures` and the unsaved changes (decided revisions and
key sets) tell `Status`, and through `observer` the event log and the metrics, meanwhile.

Every save is a compare-and-set on the token of the last save (`StateStore.save`). A save that
is refused because this scheduler no longer holds the store, or because the stored state is not
the one it saved last, is not retried: the persister stops for good (`fenced`), nothing held
back is ever told, and `on_fenced` tells the scheduler to stop serving.

The key-value store is saved by the same saver (`keep_kv`, `write_kv`), in the same rounds, with
the same retries and the same fence: a key set (or add) is staged in the `KvStore`, handed to
`write_kv`, and answered once the batch holding it is saved (`StateStore.save_kv`: the changed
keys only); only then is it committed, visible to `get` and `wait`. Sets that arrive while a
round is saving go in the next one, so a burst of sets costs a few saves, not one each. What
waits for a round holds one value per key, the newest (a key set again replaces it), so what
the saver holds is bounded by the store's caps, however many calls set a key and give up while
saves fail. A failed batch waits for the next round with the newer sets joined to it, and
nothing is answered meanwhile; a fence fails every waiting set with NotLeaderError (the node
asks the leader). Stopping the saver (`stop`, as the scheduler steps down) ends every wait as a
fence does. The calls are numbered as they come: a call waits until a batch holding its number
(and every one before it) is saved, and a call given up holds nothing.

A set may bring a record that rests on it (an add's, `machine.adds`: its answer, kept so that the
add made again is not counted again): a batch holds its sets first, then its records, and the
stores write a batch in its order (one append to the key-value log, whose torn tail is dropped;
etcd transactions one after another), so a batch cut short keeps no record without its set.
`kv_saved` waits until everything handed over so far is saved: the answer to an add made again
is given once its record is saved, as the first answer was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from cluster.protocol.backoff import RetryPolicy
from cluster.protocol.errors import FencedError, NotLeaderError, StateFileError
from cluster.protocol.value import frozen
from cluster.storage.state_store import SCHEDULER_KIND, StateStore, Stored, Written

log = logging.getLogger("cluster.scheduler")

STATE_KIND = SCHEDULER_KIND
__all__ = ["STATE_KIND", "WriteAheadSaver"]
# A failed save is tried again after 0.1 s, doubling up to 5 s: soon after the disk has room
# again, without spinning on a disk that stays full.
SAVE_RETRY = RetryPolicy(first_s=0.1, max_s=5.0)
# Failed saves remembered as perhaps landed (see `_landed_unanswered`): far more than fail in a
# row before one lands, as every retry saves the newest state.
UNANSWERED_KEPT = 1024
# The two parts a saver saves, each failing on its own: the job's state, the key-value store.
STATE, KV = "state", "kv"


@frozen
class Saving:
    """How saving goes: the last error ("" while saves land), for how long saves have failed,
    how many attempts failed in all (the state's and the key-value store's), and how many
    changes are not saved yet (decided revisions, and keys set)."""

    error: str
    failing_for_s: float
    failures: int
    unsaved_changes: int


class WriteAheadSaver:
    """Saves `snapshot()` whenever a newer revision is requested, and the key-value store's sets
    as they come (`keep_kv`); `on_saved(revision)` follows each state save that landed, never a
    failed one."""

    def __init__(
        self,
        store: StateStore,
        snapshot: Callable[[], dict[str, Any]],
        on_saved: Callable[[int], None],
        *,
        token: str = "",
        on_fenced: Callable[[str], None] = lambda why: None,
        clock: Callable[[], float] = time.monotonic,
        retry: RetryPolicy = SAVE_RETRY,
    ) -> None:
        """Nothing is saved by it yet: `save_first` saves the first snapshot, `request` asks
        for newer ones. `token` names what `store` holds now."""
        self.store = store
        self.where = store.where
        self.token = token  # of what is stored, as this scheduler saved or read it
        # The saves since the last one answered that failed without saying whether they landed.
        self._unanswered: set[tuple[object, object]] = set()
        self._on_fenced = on_fenced
        self.fenced: str | None = None  # why saves stopped for good
        self._snapshot = snapshot
        self._on_saved = on_saved
        self._clock = clock
        self._retry = retry
        self.requested = self.saved = -1  # revisions
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        # Each part (STATE, KV) while its saves fail: the last error (it names the file and the
        # cause) and since when (clock); why saves were refused for good, once they were.
        self._failing: dict[str, tuple[str, float]] = {}
        self._refused: str | None = None
        # Failed attempts since the start, of either part: a counter (never reset).
        self.failures = 0
        # Told how each save ended, its seconds, its error (None: it landed) and its part: the
        # scheduler's event log and metrics (cluster.scheduler.observe).
        self.observer: Callable[[float, str | None, str], None] | None = None
        # The key-value store (`keep_kv`): the job it is saved under and what commits a saved
        # set; the sets not yet in a batch being saved, the newest value of each key with how
        # many calls set it (each is committed once); how many calls were handed over, and how
        # many of them are saved (calls land in order); how many keys the batch being saved
        # holds.
        self._kv: tuple[str, Callable[[str, bytes], None]] | None = None
        self._kv_pending: dict[str, tuple[bytes, int]] = {}
        self._kv_records: dict[str, bytes] = {}  # saved after the sets of their batch
        self._kv_handed = self._kv_landed = 0
        self._kv_progress = asyncio.Condition()
        self._kv_flying = 0

    def keep_kv(self, job: str, commit: Callable[[str, bytes], None]) -> None:
        """Save the key-value store of `job` too; `commit(key, value)` once a set is saved."""
        self._kv = (job, commit)

    async def write_kv(
        self, key: str, value: bytes, *, record: tuple[str, bytes] | None = None
    ) -> None:
        """Return once `key` = `value` is saved (and committed), with `record` (a key and
        value of the scheduler's own) saved after it, never before. The save goes on when the
        caller gives up waiting: what was staged is committed all the same."""
        if self.fenced is not None:
            raise NotLeaderError(self.fenced)
        sets = self._kv_pending.get(key, (b"", 0))[1]
        self._kv_pending[key] = (value, sets + 1)  # the older value is never saved now
        if record is not None:
            self._kv_records[record[0]] = record[1]
        self._kv_handed += 1
        self._wake.set()
        await self._kv_answer(self._kv_handed)

    async def kv_saved(self) -> None:
        """Return once every key-value change handed to `write_kv` so far is saved;
        NotLeaderError when it never will be. (Batches land in order, and a failed one is
        saved again with those after it.)"""
        if self.fenced is not None:
            raise NotLeaderError(self.fenced)
        await self._kv_answer(self._kv_handed)

    async def _kv_answer(self, number: int) -> None:
        """Return once the key-value calls up to `number` are saved; NotLeaderError when they
        never will be."""
        if not await self._kv_landed_through(number):
            raise NotLeaderError(self.fenced or "saving has stopped")

    async def _kv_landed_through(self, number: int) -> bool:
        """Wait until the key-value calls up to `number` are saved (True) or never will be."""
        if self._kv_landed < number and self.fenced is None:
            async with self._kv_progress:
                await self._kv_progress.wait_for(
                    lambda: self._kv_landed >= number or self.fenced is not None
                )
        return self._kv_landed >= number

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-state-persister")

    async def save_first(self) -> None:
        """Save the current snapshot once, now; StateFileError when that fails (at start-up, a
        store that cannot take the state is an error to report, not to wait out)."""
        snapshot = self._snapshot()
        self._check(await self.store.save(snapshot, self.token))
        self.requested = self.saved = max(self.saved, int(snapshot["revision"]))

    def _check(self, written: Written) -> None:
        """Take the token of a save that landed; FencedError for one that did not."""
        if not written.ok:
            theirs = written.current.snapshot or {}
            raise FencedError(
                f"the state in {self.where} is not the one this scheduler saved last (it holds "
                f"job {theirs.get('cluster_id')!r} at revision {theirs.get('revision')!r}): "
                "another scheduler has written it"
            )
        self.token = written.current.token

    async def stop(self, timeout_s: float | None = None) -> bool:
        """Save what is still pending, state and key-value sets (trying for up to `timeout_s`
        while saves fail), then stop for good: the waits for what is not saved end as a
        fence ends them (`flushed` raises FencedError, `write_kv` NotLeaderError); True when
        everything asked for is on disk."""
        if self._task is None:
            return not self.pending and self._kv_landed >= self._kv_handed
        with contextlib.suppress(asyncio.TimeoutError, FencedError):
            await asyncio.wait_for(self._drained(), timeout_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        kv_waiting = self._kv_landed < self._kv_handed
        # What is not saved now never is by this saver: every wait for it ends.
        await self._halt(self.fenced or "this scheduler has stopped saving the job")
        return not self.pending and not kv_waiting

    async def _drained(self) -> None:
        await self.flushed(self.requested)
        await self._kv_landed_through(self._kv_handed)

    def request(self, revision: int) -> None:
        """Save the state up to `revision` (the newest snapshot, when the round comes)."""
        if revision > self.requested:
            self.requested = revision
            self._wake.set()

    @property
    def pending(self) -> bool:
        return self.saved < self.requested

    @property
    def error(self) -> str | None:
        """While saves fail, the last error (the state's before the key-value store's); why
        saves were refused for good, once they were; None while saves land."""
        failing = self._failing.get(STATE) or self._failing.get(KV)
        return self._refused or (None if failing is None else failing[0])

    @property
    def kv_error(self) -> str | None:
        """The last key-value batch's error, while batches fail."""
        failing = self._failing.get(KV)
        return None if failing is None else failing[0]

    @property
    def failing_since(self) -> float | None:
        """Since when (clock) saves have failed, of either part; None while they land."""
        return min((since for _, since in self._failing.values()), default=None)

    def failing_for_s(self) -> float:
        """Seconds since saves started failing; 0 while they succeed."""
        since = self.failing_since
        return 0.0 if since is None else self._clock() - since

    def status(self, revision: int) -> Saving:
        """How saving goes, for Status and the metrics; `revision`: the newest decided."""
        kv_unsaved = len(self._kv_pending) + len(self._kv_records) + self._kv_flying
        return Saving(
            error=self.error or "",
            failing_for_s=self.failing_for_s(),
            failures=self.failures,
            unsaved_changes=max(revision - self.saved, 0) + kv_unsaved,
        )

    async def flushed(self, revision: int) -> None:
        """Wait until `revision` (or a newer one) is on disk: however long the disk fails.
        FencedError when it never will be (another scheduler holds the job)."""
        if self.saved >= revision:
            return
        async with self._progress:
            await self._progress.wait_for(lambda: self.saved >= revision or bool(self.fenced))
        if self.saved < revision:
            raise FencedError(self.fenced or "saving has stopped")

    async def _run(self) -> None:
        backoff = self._retry.backoff()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not (self.pending or self._kv_pending or self._kv_records):
                continue
            # One round: the key-value sets that came, then the newest snapshot; each is tried
            # whether the other landed or not.
            kv_saved = await self._save_kv()
            if self.fenced is not None:
                return  # for good: another scheduler holds the job
            state_saved = not self.pending or await self._save()
            if kv_saved and state_saved:
                backoff.reset()
                continue
            if self.fenced is not None:
                return
            # The next attempt takes the newest snapshot and every set that came meanwhile.
            await asyncio.sleep(backoff.next_s())
            self._wake.set()

    async def _save_kv(self) -> bool:
        """Save the key-value sets waiting, as one batch (True when there were none); a failed
        batch waits for the next round, the newer sets joined to it."""
        if not (self._kv_pending or self._kv_records) or self._kv is None:
            return True
        job, commit = self._kv
        changes, records, through = self._kv_pending, self._kv_records, self._kv_handed
        self._kv_pending, self._kv_records = {}, {}
        self._kv_flying = len(changes) + len(records)
        started = time.perf_counter()
        try:
            await self.store.save_kv(job, _in_order(changes, records))
        except FencedError as exc:
            await self._fence(str(exc))  # fails the batch's calls and those queued after it
            return False
        except StateFileError as exc:
            self._kv_pending = _joined(changes, self._kv_pending)
            self._kv_records = {**records, **self._kv_records}
            self._failed(KV, str(exc), started)
            return False
        finally:
            self._kv_flying = 0
        self._landed(KV, started)
        for key, (value, sets) in changes.items():
            for _ in range(sets):  # each set staged is committed (`KvTable.commit`)
                commit(key, value)
        self._kv_landed = max(self._kv_landed, through)
        async with self._kv_progress:
            self._kv_progress.notify_all()
        return True

    async def _save(self) -> bool:
        snapshot = self._snapshot()  # on the loop: consistent with what was decided
        revision = int(snapshot["revision"])
        started = time.perf_counter()
        try:
            written = await self.store.save(snapshot, self.token)
            if not written.ok and self._landed_unanswered(written.current):
                self.token = written.current.token  # ours: save over it
                written = await self.store.save(snapshot, self.token)
            self._unanswered.clear()
            self._check(written)
        except FencedError as exc:
            await self._fence(str(exc))
            return False
        except (StateFileError, OSError) as exc:
            # Its outcome is unknown: an etcd transaction whose answer timed out may have landed.
            if len(self._unanswered) < UNANSWERED_KEPT:
                self._unanswered.add(_identity(snapshot))
            self._failed(STATE, str(exc), started)
            return False
        self._landed(STATE, started)
        self.saved = max(self.saved, revision)
        self._on_saved(self.saved)
        async with self._progress:
            self._progress.notify_all()
        return True

    def _landed_unanswered(self, stored: Stored) -> bool:
        """Whether `stored`, which replaced the state this scheduler last knew of, is its own
        save whose answer was lost (a timeout after the write landed), not another scheduler's:
        the same job at the same revision. Another scheduler cannot have written meanwhile, or
        the store would have said this one is fenced."""
        return stored.snapshot is not None and _identity(stored.snapshot) in self._unanswered

    async def _fence(self, why: str) -> None:
        """Saves are refused for good: another scheduler holds the job. Every waiting key-value
        set fails with NotLeaderError (the node asks the leader again)."""
        self.fenced = self._refused = why
        log.error("%s; nothing more is saved or told by this scheduler", why)
        self._on_fenced(why)
        await self._halt(why)

    async def _halt(self, why: str) -> None:
        """Nothing more is saved (`why`): every waiting key-value set fails with
        NotLeaderError, and every `flushed` wait ends."""
        self.fenced = why
        self._kv_pending, self._kv_records = {}, {}
        for progress in (self._progress, self._kv_progress):
            async with progress:
                progress.notify_all()

    def _failed(self, part: str, why: str, started: float) -> None:
        """A save of `part` (STATE, KV) begun at `started` failed with `why` (it names the
        file and the cause): counted, told, and logged when saves of `part` start failing."""
        self.failures += 1
        failing = self._failing.get(part)
        self._failing[part] = (why, self._clock() if failing is None else failing[1])
        self._observe(started, why, part)
        if failing is not None:
            return
        # One line: the error names the file and the cause; a traceback adds nothing.
        if part == KV:
            log.error("%s; retrying, and the key-value calls wait meanwhile", why)
            return
        log.error(
            "%s; retrying every %g s at most. Until a save lands, the nodes are not told of "
            "changes (a new generation, a registration, the job's end); the job goes on as it "
            "was",
            why,
            self._retry.max_s,
        )

    def _landed(self, part: str, started: float) -> None:
        """A save of `part` begun at `started` landed: told, and logged when it had failed."""
        failing = self._failing.pop(part, None)
        self._observe(started, None, part)
        if failing is None:
            return
        failed_s = self._clock() - failing[1]
        if part == KV:
            log.info(
                "the key-value store is saved again after %.1f s of failed saves; the waiting "
                "calls are answered",
                failed_s,
            )
            return
        log.info(
            "recovery state saved again to %s after %.1f s of failed saves; what was held "
            "back goes out now",
            self.where,
            failed_s,
        )

    def _observe(self, started: float, error: str | None, part: str) -> None:
        if self.observer is not None:
            self.observer(time.perf_counter() - started, error, part)


def _in_order(sets: dict[str, tuple[bytes, int]], records: dict[str, bytes]) -> dict[str, bytes]:
    """One batch: the newest value of each key set, then the records that rest on them."""
    batch = {key: value for key, (value, _) in sets.items()}
    for key, value in records.items():
        batch.pop(key, None)
        batch[key] = value
    return batch


def _joined(
    older: dict[str, tuple[bytes, int]], newer: dict[str, tuple[bytes, int]]
) -> dict[str, tuple[bytes, int]]:
    """The sets of a failed batch with those that came meanwhile: the newest value of each key,
    and how many calls set it in all."""
    joined = dict(older)
    for key, (value, sets) in newer.items():
        joined[key] = (value, joined.get(key, (b"", 0))[1] + sets)
    return joined


def _identity(snapshot: dict[str, Any]) -> tuple[object, object]:
    """What tells one saved state from another: its job and its revision."""
    return snapshot.get("cluster_id"), snapshot.get("revision")
