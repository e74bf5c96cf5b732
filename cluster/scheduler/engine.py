"""The scheduler's engine: the state machine plus everything that waits, and the carrying out of
what the machine decides.

`Engine` owns the `SchedulerState`, the open Watch streams, the key-value store and the
collective rounds, all on one asyncio loop (so none of it needs a lock). It resumes a saved job
(`resume`), lets time pass for the state machine (`monitor`), and applies the effects the machine
returns: events fan out to every stream, an eviction ends one stream, a shutdown fails open
collectives and marks the job done. The nodes' calls are served on it by
`cluster.scheduler.core.SchedulerCore`, which extends it.

With recovery on, effects that follow a change of the saved state wait until the change is saved in
the state store (see `cluster.scheduler.persist`), and so do the answers to Register and Finish that
made it, and to a key set (the same saver): what a node has been told, a restarted
scheduler (or a standby taking over) knows. The order is decided by a pure machine,
`cluster.scheduler.machine.ready.Outbox` (raft's Ready/Advance): `step` says what to save and what
may be told now, `advance` what a landed save releases, with what each effect does to the
collectives in progress; this engine only carries it out (`_carry_out`). An engine whose saves are
refused because another scheduler holds the store (fenced) answers nothing more: NotLeaderError."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cluster.protocol.errors import FencedError, NotLeaderError, SnapshotError
from cluster.protocol.settings import JobSettings
from cluster.protocol.state_url import STATE_URL_ENV
from cluster.scheduler import convert
from cluster.scheduler.effect_log import EffectLog
from cluster.scheduler.events import EventJournal
from cluster.scheduler.exchange import ExchangeTable
from cluster.scheduler.kv import KvStore
from cluster.scheduler.kv_calls import KvCalls
from cluster.scheduler.machine import ready as ready_
from cluster.scheduler.machine import snapshot as snapshot_
from cluster.scheduler.machine import state
from cluster.scheduler.member_limits import MemberLimits, ReportTurns
from cluster.scheduler.persist import Saving, WriteAheadSaver
from cluster.scheduler.refusals import RefusalLimiter
from cluster.scheduler.streams import Streams
from cluster.scheduler.tables import EventWire
from cluster.storage.state_store import StateStore

if TYPE_CHECKING:
    from typing_extensions import Self

# A checkpoint report: node id, incarnation, steps, (generation, number).
Report = tuple[str, int, list[int], tuple[int, int]]

log = logging.getLogger("cluster.scheduler")

# How often the monitor lets time pass for the state machine (heartbeat silence, topology
# timeout). Detection of a dead process does not depend on it: a broken stream is seen at once.
TICK_S = 0.1
# Registration progress is coalesced: at most one broadcast per interval (not one per
# registration, which would be N^2 messages for N nodes).
PROGRESS_BROADCAST_EVERY_S = 2.0
# ... and at most this many progress messages a second in all: a broadcast is one write per open
# stream, and a job forms in a time that grows with its size, so at a fixed interval the
# broadcasts of a forming job cost N x T writes. At 8,192 nodes they filled the scheduler's loop,
# which takes up one new call per turn, and registrations waited behind them for minutes.
PROGRESS_WRITES_PER_S = 1000.0
# While the job waits for a node that does not come, the count it has is told again at this
# interval (or the one above, if longer): a worker says how long it has waited only when told,
# and one told the count before it had waited long enough to say it would hear nothing more.
PROGRESS_REPEAT_EVERY_S = 5.0
# A monitor tick this much later than due means the scheduler itself did not run (its process
# stopped, or starved of CPU, or a burst it had to work through): the nodes' silence meanwhile
# is not held against them (`SchedulerState.discount_stall`). One this long is logged (a burst of a
# large job's registrations on a busy machine makes shorter ones).
STALL_S = 1.0
STALL_LOG_S = 5.0


def new_cluster_id() -> str:
    """12 random hex digits (what uuid4().hex[:12] was, without importing uuid and platform)."""
    return os.urandom(6).hex()


def _beside(job: str, state_store: StateStore, left: tuple[str, ...]) -> str:
    """The line of a new job `job` started with no saved state, beside what another job left in
    `state_store` (`Stored.left`). What becomes of it: the key-value store is claimed for this
    job (`save_first` empties it); the workers' records are left as they are, and a worker that
    reads one presents the other job, which admission refuses (`Refusal.FOREIGN_JOB`)."""
    return (
        f"starting a new job {job}: there is no {state_store.where}, but {state_store.name} "
        f"holds what another job left there: {'; '.join(left)}; the key-value store there is "
        "this job's now (empty: the other job's keys are gone), and a worker that reads one of "
        "those records presents that job and is refused: move them away to let their workers "
        "join this job (or stop this scheduler and put that job's state back to resume it)"
    )


def new_job_advice(name: str) -> str:
    """How to start a new job where the state store `name` (MS_RECOVERY_PATH,
    CLUSTER_STATE_URL) holds a job that cannot be resumed: on a state of its own, and with none
    of the workers' records (worker-<id>.json) that name the saved job, whose workers a new
    job's scheduler refuses (`Refusal.FOREIGN_JOB`)."""
    if name == "MS_RECOVERY_PATH":
        from cluster.storage import store  # noqa: PLC0415 - a directory store has it loaded

        return store.NEW_JOB_ADVICE
    return (
        f"to start a new job, give it a prefix of its own in {name}, and "
        "move away the workers' records, worker-<id>.json, from the MS_RECOVERY_PATH of every "
        "host that keeps them: they name the saved job, and a new job's scheduler refuses the "
        "workers that read them"
    )


class Engine:
    """The scheduler's engine under `core.SchedulerCore`: what it owns, and how what the state
    machine decides is saved, then told."""

    def __init__(
        self,
        settings: JobSettings,
        clock: Callable[[], float] = time.monotonic,
        *,
        restored: state.SchedulerState | None = None,
        state_store: StateStore | None = None,
        token: str = "",
        kv: dict[str, bytes] | None = None,
    ) -> None:
        """`restored`: the job as loaded from `state_store` (named there by `token`), with its
        key-value store `kv`; `state_store`: where to save it (None: nothing is saved)."""
        self.settings = settings
        self._clock = clock
        self.state = restored or state.SchedulerState(new_cluster_id(), settings, clock)
        # Set by `resume` when it resumed a saved job, or started a new one beside what another
        # job left in the store: what to log once it is saved.
        self.restored_note = ""
        # Set by `resume` when the saved job had ended: its id, and whether it finished.
        self.ended_job: tuple[str, bool] | None = None
        # The write-ahead order: effects wait until the state they follow from is saved.
        self.outbox = ready_.Outbox(
            write_ahead=state_store is not None, saved=-1, recovery=self.state.recovery
        )
        # The store's key-value part is another job's (or none): `save_first` claims it.
        self._kv_to_claim = False
        # Set when saves were refused because another scheduler holds the store: why.
        self.fenced: str | None = None
        self.on_fenced: Callable[[str], None] = lambda why: None
        # What the nodes have been told (the topology, the job's end): with recovery, what is
        # on disk. A stream opened now starts with it, and Status shows it.
        self._catch_up: list[state.Event] = self.state.catch_up()
        self._topology_told = next(
            (e for e in self._catch_up if isinstance(e, state.TopologyReadyEvent)), None
        )
        self.journal = EventJournal(self.state)  # the job's events: log, WatchEvents, metrics
        # Refused calls: all counted, a bounded number told (`cluster.scheduler.refusals`).
        self.refusals = RefusalLimiter(clock)
        # What one member may make this core hold or do (`cluster.scheduler.member_limits`).
        self.bounds = MemberLimits(self.state.expected, settings.heartbeat_interval_s, clock)
        self.reports: ReportTurns[Report] = ReportTurns(self.bounds, self._take_report, clock)
        limits = settings.limits
        self.kv = KvStore(limits.kv_max_bytes, limits.kv_max_keys, nodes=self.state.expected)
        if kv:
            self.kv.restore(kv)
        # The one write-ahead saver: the state and the key-value store (None: nothing saved).
        self.persister: WriteAheadSaver | None = None
        if state_store is not None:
            self._save_in(state_store, token)
        # The members' key-value calls (`cluster.scheduler.kv_calls`), saved by the same saver.
        self.kv_calls = KvCalls(self.kv, self.state, self.persister)
        self.exchanges = ExchangeTable(
            limits.collective_max_bytes, limits.collective_timeout_s, self.durable
        )
        self._init_delivery(settings, clock)

    def _init_delivery(self, settings: JobSettings, clock: Callable[[], float]) -> None:
        """What carries the job's events to the nodes: streams, beats, progress, the loop's lag."""
        self._streams = Streams(clock)
        self.done = asyncio.Event()
        # Set at every registration answered (the end waits for nodes refused by the guard).
        self.registrations = asyncio.Event()
        self.streams_closed = asyncio.Event()
        self.streams_closed.set()
        # The nodes' Heartbeat calls in progress, and an event set while there are none.
        self._beating = 0
        self.beats_closed = asyncio.Event()
        self.beats_closed.set()
        self._effect_log = EffectLog(self.state, clock)
        self._pending_progress: state.ProgressEvent | None = None
        # The events on the wire, each serialized once for every stream; the whole tables.
        self._wire = EventWire()
        # The first progress broadcast comes one interval after the start: a worker learns the
        # count when it is accepted, and reports progress only after waiting a while itself.
        self._last_progress_broadcast = clock()
        nodes = settings.worker_num + settings.server_num
        self._progress_every_s = max(PROGRESS_BROADCAST_EVERY_S, nodes / PROGRESS_WRITES_PER_S)
        self._progress_repeat_s = max(PROGRESS_REPEAT_EVERY_S, self._progress_every_s)
        self._progress_told: state.ProgressEvent | None = None
        # The event loop's lag as the monitor saw it: the largest, and stalls past STALL_S.
        self.loop_lag_max_s = 0.0
        self.stalls = 0

    def _save_in(self, state_store: StateStore, token: str) -> None:
        """Save the state (write-ahead) and the key-value store in `state_store`, whose
        current content `token` names."""
        self.persister = WriteAheadSaver(
            state_store,
            self.state.snapshot,
            self._release,
            token=token,
            on_fenced=self._fence,
            clock=self._clock,
        )
        self.persister.keep_kv(self.state.cluster_id, self.kv.commit)

    @classmethod
    async def resume(
        cls,
        settings: JobSettings,
        state_store: StateStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> Self:
        """A core that saves its job in `state_store` (held by this process), resuming the job
        saved there if any, with its key-value store.

        A state that cannot be used is left as it is: one this scheduler can never resume
        (saved under another protocol revision, worker or server count, or job secret) raises
        SnapshotError, raised from the state machine's own, which says why alone; one that
        cannot be read (etcd away, a torn or foreign state) raises StateFileError.
        """
        stored = await state_store.load()
        snapshot = stored.snapshot
        restored = None
        where = state_store.where
        if snapshot is not None:
            try:
                restored = state.SchedulerState.restore(
                    snapshot, settings, clock, new_cluster_id=new_cluster_id()
                )
            except SnapshotError as exc:
                raise SnapshotError(
                    f"the recovery state {where} cannot be resumed: {exc}; "
                    f"{new_job_advice(state_store.name)}"
                ) from exc
        job = restored.cluster_id if restored is not None else ""
        kv = await state_store.load_kv(job) if job else {}
        core = cls(
            settings, clock, restored=restored, state_store=state_store, token=stored.token, kv=kv
        )
        core._kv_to_claim = not kv
        if restored is None and stored.left:
            core.restored_note = _beside(core.state.cluster_id, state_store, stored.left)
        elif restored is None and state_store.name == STATE_URL_ENV:
            core.state.started_anew_under = where
            core.restored_note = (
                f"starting a new job {core.state.cluster_id}: nothing is saved under {where} "
                f"(a scheduler meant to stand by for a running job names that job's prefix in "
                f"{STATE_URL_ENV}: this one leads a job of its own)"
            )
        if restored is not None and snapshot is not None:
            core.restored_note = snapshot_.restored_note(restored, snapshot, where)
            if restored.previous_cluster_id == snapshot["cluster_id"]:
                ended = str(snapshot["cluster_id"])
                core.ended_job = (ended, snapshot["phase"] == state.Phase.FINISHED.value)
        return core

    @property
    def ok(self) -> bool:
        return self.state.phase is state.Phase.FINISHED

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- lifecycle -----------------------------------------------------------------------------

    async def monitor(self) -> None:
        """Let time pass for the state machine until the job is over (or this scheduler no
        longer answers for it)."""
        due = self._clock() + TICK_S
        while not self.done.is_set() and self.fenced is None:
            self._stalled(self._clock() - due)
            self._apply(self.state.tick())
            self._flush_progress()
            self._streams.idle(self.settings.heartbeat_interval_s, convert.HEARTBEAT)
            due = self._clock() + TICK_S
            try:
                await asyncio.wait_for(self.done.wait(), TICK_S)
            except asyncio.TimeoutError:  # not builtin TimeoutError before 3.11
                continue

    def _stalled(self, late_s: float) -> None:
        """The monitor ran `late_s` after it was due: the event loop's lag."""
        self.loop_lag_max_s = max(self.loop_lag_max_s, late_s)
        if late_s < STALL_S:
            return
        self.stalls += 1
        self.state.discount_stall(late_s)
        if late_s < STALL_LOG_S:
            return
        log.warning(
            "the scheduler did not run for %.1f s (its process was stopped, or the machine is "
            "overloaded); the nodes' silence meanwhile is not counted against them",
            late_s,
        )

    def abort(self, reason: str) -> None:
        self._apply(self.state.abort(reason))

    async def save_first(self) -> None:
        """Save the job once, now, and claim the key-value store for it when it is new (a new
        job, or a store another job left): before any node hears of the job. StateFileError
        when that fails."""
        if self.persister is None:
            return
        await self.persister.save_first()
        self._release(self.persister.saved)
        if self._kv_to_claim:
            await self.persister.store.clear_kv(self.state.cluster_id)
            self._kv_to_claim = False

    def start_saving(self) -> None:
        """Save from now on, in the background (after the first save, `persister.save_first`)."""
        if self.persister is not None:
            self.persister.start()

    async def stop_saving(self, timeout_s: float | None) -> bool:
        """Save what is decided (trying for up to `timeout_s` while saves fail), then stop;
        True when everything decided is saved."""
        return self.persister is None or await self.persister.stop(timeout_s)

    def _fence(self, why: str) -> None:
        """Another scheduler holds the store: this core tells nothing more."""
        self.outbox.fence()
        if self.fenced is None:
            self.fenced = why
            self.on_fenced(why)

    def stand_down(self, error: NotLeaderError) -> None:
        """Answer nothing more for the job (this scheduler no longer leads it): every open
        stream, collective and key-value wait ends with `error`, which names the leader."""
        self.outbox.fence()
        if self.fenced is None:
            self.fenced = str(error)
        self._streams.broadcast(error)
        self.exchanges.fail_all(error)  # the leader it names goes to every caller
        self.kv.abandon(error)

    async def durable(self) -> None:
        """Wait until everything decided so far is saved (at once without recovery);
        NotLeaderError when it never will be (another scheduler holds the job)."""
        if self.persister is not None and self.persister.saved < self.state.revision:
            try:
                await self.persister.flushed(self.state.revision)
            except FencedError as exc:
                raise NotLeaderError(f"this scheduler no longer leads the job: {exc}") from None

    # -- queries -------------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock()

    def told(self) -> state.Told:
        """Phase, generation and rollback step as the nodes were told them (with recovery: as
        on disk): what a stream opened now starts with."""
        last = self._catch_up[0] if self._catch_up else None
        phase = state.Phase.WAITING if last is None else state.Phase.READY
        if isinstance(last, state.ShutdownEvent):
            phase = state.Phase.FINISHED if last.ok else state.Phase.FAILED
        topology = self._topology_told
        if topology is None:
            return state.Told(phase, 0, 0)
        return state.Told(phase, topology.generation, topology.rollback_step)

    def saving(self) -> Saving | None:
        """How saving goes (None: nothing is saved)."""
        return None if self.persister is None else self.persister.status(self.state.revision)

    # -- effects -------------------------------------------------------------------------------

    def _take_report(self, report: Report) -> None:
        """Record a checkpoint report and save the new holdings (nothing to tell anyone)."""
        node_id, incarnation, steps, numbered = report
        self.state.report_checkpoints(node_id, incarnation, steps, *numbered)
        self._apply([])

    def _apply(self, effects: Sequence[ready_.Decision]) -> None:
        """The state machine decided `effects`: save, then tell (`machine.ready`)."""
        self._carry_out(self.outbox.step(self.state.revision, effects))
        persister = self.persister
        ended = next((e for e in effects if isinstance(e, state.ShutdownEvent)), None)
        if ended and self.outbox.waiting and persister is not None and persister.error:
            log.error(
                "the job has ended (%s), but its state cannot be saved: the nodes are told and "
                "this scheduler exits once a save lands (SIGTERM stops it sooner)",
                ended.reason,
            )

    def _release(self, saved_revision: int) -> None:
        """The state up to `saved_revision` is stored: tell what waited for it."""
        self._carry_out(self.outbox.advance(saved_revision))

    def _carry_out(self, ready: ready_.Ready) -> None:
        if ready.save is not None and self.persister is not None:
            self.persister.request(ready.save)
        for tell in ready.tell:
            self._tell(tell)

    def _tell(self, tell: ready_.Tell) -> None:
        effect, fail = tell.effect, tell.fail
        if isinstance(effect, state.Evict):
            self._streams.put((effect.node_id, effect.incarnation), effect)
            return
        if effect is not None:
            self._effect_log.told(effect)
            self.journal.effect(effect)
        if fail is not None:
            self.exchanges.fail_all(fail.error(fail.reason), keep_answer=fail.keep_answer)
        if effect is None:
            return
        if isinstance(effect, state.ProgressEvent):
            self._pending_progress = effect
            return
        previous = self._topology_told
        if isinstance(effect, state.TopologyReadyEvent | state.ShutdownEvent):
            self._catch_up = [effect]
        if isinstance(effect, state.TopologyReadyEvent):
            self._topology_told = effect
            self._pending_progress = self._progress_told = None
            self._streams.broadcast(self._wire.topology_change(effect, previous))
        else:
            self._broadcast(effect)
        if isinstance(effect, state.ShutdownEvent):
            self.done.set()

    def _broadcast(self, event: state.Event) -> None:
        self._streams.broadcast(self._wire.serialized(event))

    def _flush_progress(self) -> None:
        """Tell the newest registration count, at most once an interval; while the job waits,
        tell it again now and then."""
        now = self._clock()
        since = now - self._last_progress_broadcast
        if self._pending_progress is None:
            if self._progress_told is None or since < self._progress_repeat_s:
                return
            self._pending_progress = self._progress_told
        elif since < self._progress_every_s:
            return
        if self.state.phase is state.Phase.WAITING:
            self._broadcast(self._pending_progress)
            self._progress_told = self._pending_progress
        else:
            self._progress_told = None
        self._pending_progress = None
        self._last_progress_broadcast = now
