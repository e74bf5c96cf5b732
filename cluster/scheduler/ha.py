"""A scheduler among standbys (the etcd store): lead the job while the election says so.

The server serves its port from the start; what answers there is decided by the election
(`cluster.scheduler.leading`, with the pure rules of `cluster.protocol.leadership`):

- leading: the job is loaded from etcd as a restarted scheduler loads it (every known node
  awaits its reconnection, with its rank and generation), its first save (fenced by the new
  leader key) lands, and only then does the gate let calls through;
- standing by, or stepped down: every call is answered with the leader's address;
- the job is over: the leader ends as a single scheduler does; a standby that takes over and
  finds the job it stood by for ended (not one that had ended before it started) exits with
  that job's result instead of starting a new one, so every scheduler of a job ends with it;
- the job can never be led here: a state saved after this scheduler started that it can never
  resume (by a leader of another protocol revision, counts or job secret), found when it takes
  over, ends it as the same state found at start does (a ConfigError, exit 2), its leader key
  given back at once for a scheduler that can lead the job. A state that cannot be read (etcd
  away, a torn read) steps it down to campaign again (`cluster.scheduler.leading`: after a
  pause that grows while the same state stays unreadable, said once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from cluster.protocol.errors import (
    ConfigError,
    FencedError,
    NotLeaderError,
    SnapshotError,
    StateFileError,
)
from cluster.protocol.leadership import Leadership
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.engine import new_job_advice
from cluster.scheduler.leading import Leading
from cluster.scheduler.machine import events
from cluster.scheduler.machine.state import Phase, SchedulerState

if TYPE_CHECKING:
    from cluster.scheduler.etcd_election import EtcdElection
    from cluster.scheduler.server import SchedulerServer

log = logging.getLogger("cluster.scheduler")

# A leader stopped by a signal: how long it waits for the job's end to be saved.
STOP_SAVE_WAIT_S = 3.0
# A new leader: how long it spends removing the chunks no key names, before it serves (the
# nodes wait meanwhile): this share of its lease, at most GARBAGE_WAIT_S; what is left then is
# removed by the next leader.
GARBAGE_LEASE_SHARE = 0.5
GARBAGE_WAIT_S = 10.0
_ENDED = (Phase.FINISHED.value, Phase.FAILED.value)


class HighAvailability:
    def __init__(self, server: SchedulerServer, election: EtcdElection) -> None:
        self.server = server
        self.election = election
        self.leadership = Leadership(float(election.lease_s), time.monotonic)
        self.leading = Leading(election, self.leadership, self._lead, self._step_down)
        self._task: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._finished: asyncio.Future[bool] | None = None
        # The job whose end was saved when this scheduler started (a new job may replace it).
        self._ended_at_start: str | None = None

    async def start(self) -> None:
        """After the server listens: publish its address, read the state once, elect."""
        server = self.server
        store = server.store
        assert store is not None
        self.election.address = _advertised(server.host, server.port)
        self._finished = asyncio.get_running_loop().create_future()
        try:
            stored = await store.load()
        except StateFileError as exc:
            raise ConfigError(f"{store.name}={store.where!r} is not usable: {exc}") from None
        if stored.snapshot is not None:
            _check_resumable(stored.snapshot, server, store.name, store.where)
            if stored.snapshot.get("phase") in _ENDED:
                self._ended_at_start = str(stored.snapshot.get("cluster_id"))
        gate = server.gate
        gate.leadership, gate.address, gate.state_store = (
            self.leadership,
            self.election.address,
            store.where,
        )
        gate.schedulers = self.leading.schedulers  # kept current by the election
        self._task = asyncio.create_task(self._run(), name="cluster-election")

    async def _run(self) -> None:
        try:
            await self.leading.run()
        except Exception as exc:  # a bug: say it and end, rather than serve half
            log.exception("the election stopped")
            self._finish(exc)

    def _finish(self, result: bool | BaseException) -> None:
        finished = self._finished
        if finished is None or finished.done():
            return
        if isinstance(result, BaseException):
            finished.set_exception(result)
        else:
            finished.set_result(result)

    async def _lead(self) -> None:
        server = self.server
        assert server.store is not None
        try:
            core = await SchedulerCore.resume(server.settings, server.store)
        except SnapshotError as exc:  # never resumable here; its cause says why alone
            await self._give_back(exc.__cause__ or exc)
            return
        ended = core.ended_job
        if ended is not None and ended[0] != self._ended_at_start:
            log.info(
                "the job %s has %s (as saved in %s): this scheduler's part is over",
                ended[0],
                "finished" if ended[1] else "failed",
                server.store.where,
            )
            self._finish(ended[1])
            return
        await core.save_first()  # fenced: lands only while our leader key stands
        # Before saves run in the background.
        await _collect_garbage(server.store, _garbage_wait_s(self.election.lease_s))
        core.on_fenced = self._on_fenced
        await server.install(core)
        term = self.leadership.terms
        core.journal.emit(events.of_leader_change(True, self.election.address, term))
        await self._unwatch()
        self._watching = asyncio.create_task(self._watch(core))

    async def _give_back(self, why: BaseException) -> None:
        """The job saved in the store is one this scheduler can never lead (`why`): it never
        campaigns again, deletes its leader key, so that a scheduler that can lead the job
        wins without waiting out this one's lease, and ends with the start-time refusal."""
        store = self.server.store
        assert store is not None
        refusal = _refusal(store.name, store.where, why)
        self.leadership.resign(str(refusal))
        log.info(
            "giving the leader key back, and stopping: the job saved in %s is one this "
            "scheduler can never lead",
            store.where,
        )
        try:
            await self.election.resign()
        finally:  # cancelled too: the process ends, and its lease with it
            self._finish(refusal)

    async def _watch(self, core: SchedulerCore) -> None:
        await core.done.wait()
        self._finish(core.ok)

    async def _unwatch(self) -> None:
        task, self._watching = self._watching, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _step_down(self, why: str) -> None:
        await self._unwatch()
        core = self.server.gate.core
        if core is not None:
            change = events.of_leader_change(
                False, self.election.address, self.leadership.terms, why
            )
            core.journal.emit(change)
        await self.server.uninstall(self.server.gate.not_leader())

    def _on_fenced(self, why: str) -> None:
        """A save of the leading core was refused: our leader key is gone."""
        asyncio.ensure_future(self.leading.fenced(why))  # noqa: RUF006 - awaited by no one

    async def wait_done(self, stop_requested: asyncio.Event) -> bool:
        """Until the job is over here (led to its end, or found ended), or a stop: when the
        server is handing over (SIGTERM), the job goes to a standby (`hand_over`); otherwise a
        leader waits for the end it saves, a standby just goes."""
        finished = self._finished
        assert finished is not None
        stop = asyncio.ensure_future(stop_requested.wait())
        try:
            await asyncio.wait((finished, stop), return_when=asyncio.FIRST_COMPLETED)
            core = self.server.gate.core
            # A job whose end is decided (its save on the way) is not handed over: it ends.
            ended = core is not None and core.state.phase.value in _ENDED
            if not finished.done() and self.server.handing_over is not None and not ended:
                await self.hand_over(self.server.handing_over)
            elif not finished.done() and core is not None:
                await asyncio.wait((finished,), timeout=STOP_SAVE_WAIT_S)
        finally:
            stop.cancel()
        return finished.done() and finished.result()

    async def hand_over(self, why: str) -> None:
        """The operator stops this scheduler (SIGTERM) and the job goes on: a leader stops
        answering, saves what it decided, then deletes its leader key and revokes its lease, so
        that a standby leads at once, not after the lease; a standby revokes its lease. A job
        whose end lands in that save (a call under way ended it) is over: its result."""
        task, self._task = self._task, None
        if task is not None:  # no campaign, no keepalive from now on
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.leadership.resign(why)
        core = self.server.gate.core
        if core is not None:
            await self._unwatch()
            term = self.leadership.terms
            core.journal.emit(events.of_leader_change(False, self.election.address, term, why))
            error = NotLeaderError(
                f"not the leader: the scheduler at {self.election.address} is stopping ({why}); "
                "a standby takes the job over at once",
            )
            saved = await self.server.uninstall(error, save_s=STOP_SAVE_WAIT_S)
            if core.done.is_set():
                # A call under way ended the job, and its end landed in that save: it is over.
                self._finish(core.ok)
            else:
                self._say_handed_over(why, saved)
        await self.election.close()
        self._finish(True)

    def _say_handed_over(self, why: str, saved: bool) -> None:
        """The one line of a hand-over: what is saved, and who may lead now."""
        standbys = [a for a in self.leading.schedulers if a != self.election.address]
        where = self.server.store.where if self.server.store is not None else "etcd"
        log.info(
            "handing the job over (%s): %s; releasing the leader key and the lease: %s",
            why,
            f"everything decided is saved in {where}"
            if saved
            else "saves failed, the newest saved state is what the next leader resumes",
            f"{', '.join(standbys)} may lead at once"
            if standbys
            else "no standby is registered: the job waits (the workers keep training) "
            "until a scheduler is started on this state URL",
        )

    async def stop(self) -> None:
        await self._unwatch()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _check_resumable(
    snapshot: dict[str, Any], server: SchedulerServer, name: str, where: str
) -> None:
    """A ConfigError at start when this scheduler could never lead the job saved there (its
    worker or server count, or the protocol revision it was saved under, differs; an ended
    job's counts do not matter), rather than campaigning, failing and campaigning again."""
    try:
        SchedulerState.restore(snapshot, server.settings, time.monotonic, new_cluster_id="")
    except SnapshotError as exc:
        raise _refusal(name, where, exc) from None


def _refusal(name: str, where: str, why: BaseException) -> ConfigError:
    """The refusal of the state store `name` at `where`, whose job this scheduler can never
    lead (`why`, the state machine's SnapshotError): at start, and when it takes over."""
    return ConfigError(f"{name}={where!r} cannot be used: {why}; {new_job_advice(name)}")


def _garbage_wait_s(lease_s: float) -> float:
    return min(GARBAGE_WAIT_S, lease_s * GARBAGE_LEASE_SHARE)


async def _collect_garbage(store: object, wait_s: float) -> None:
    """Remove the chunks in etcd that no key names (best effort, for `wait_s` at most: what
    stays is removed by the next leader); FencedError when this scheduler no longer leads."""
    from cluster.scheduler.etcd_client import within  # noqa: PLC0415 - etcd stores only
    from cluster.scheduler.etcd_store import EtcdStore  # noqa: PLC0415 - etcd stores only

    if not isinstance(store, EtcdStore):
        return
    try:
        removed = await within(store.collect_garbage(), wait_s)
    except FencedError:
        raise
    except (StateFileError, TimeoutError, asyncio.TimeoutError) as exc:  # two before 3.11
        log.warning(
            "cannot remove the chunks no key names in %s: %s", store.where, str(exc) or "timed out"
        )
        return
    if removed:
        log.info("removed %d chunk sets no key names in %s", removed, store.where)


def _advertised(host: str, port: int) -> str:
    from cluster.scheduler.stores import advertised  # noqa: PLC0415 - one helper, no cycle

    return advertised(host, port)
