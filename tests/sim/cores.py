"""Workers run by the real worker core in the simulation (`--worker-cores`): each process holds a
`cluster.worker.machine.core.WorkerCore`, and what the scheduler says to it travels as the wire
says it: through the scheduler's converters to `cluster.v1` messages and through the worker's
back (`cluster.scheduler.convert`, `cluster.worker.convert`). The core decides what the process
does: register (each attempt bounded, an answer to an abandoned attempt cancels its stream),
probe the scheduler, pause, follow a standby's "not the leader", read its stream, take a
topology or wait as a spare, hear a failure, fail or be released. Its timers (an attempt's
bound, a pause, the deadline for the first topology) run on the simulation's clock.

Past its end (`finishing`), the core is told `FinishSent` and drives its Finish as the agent
does (`Finishes.step_core`). A core that fails its node (its reconnect window passed, a
topology without it) ends the process as `cluster.init()` would; the launcher starts it again
(`Sim.heal`), unless the scheduler refused it for good. A failure says why (its message never
ends in nothing), and a spare fails for a registration deadline only MS_NODE_TIMEOUT after its
stream ended, never for one set before it was accepted.

With standbys, a stream the scheduler's end cut (it died, or stepped down) ends now and then
with "not the leader" naming none yet, as a stepping-down leader's streams do, instead of
breaking: the core follows no one and asks again after a pause.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.protocol.backoff import Spread
from cluster.protocol.environment import from_env
from cluster.protocol.errors import RegistrationRefused, SchedulerUnreachableError
from cluster.protocol.records import (
    Accepted,
    Effect,
    Refused,
    ShutdownEvent,
    TopologyReadyEvent,
)
from cluster.scheduler import convert as scheduler_convert
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert as worker_convert
from cluster.worker.machine import steps
from cluster.worker.machine.core import Lifecycle, WorkerCore
from tests.sim.finishing import FINISH_EVENTS
from tests.sim.plants import GiveUpFinish

if TYPE_CHECKING:
    from tests.sim.control_plane import Process, Sim

TOPO_TIMEOUT_S = 120.0
STREAMING = (Lifecycle.FORMING, Lifecycle.SPARE, Lifecycle.READY)  # accepted: reads its stream


@dataclass(order=True)
class Timer:
    at: float
    seq: int
    node_id: str = field(compare=False)
    incarnation: int = field(compare=False)
    event: steps.Event = field(compare=False)
    attempt: int = field(compare=False, default=0)  # a registration attempt's bound: its number
    finish: int = field(compare=False, default=0)  # a Finish call's deadline or hold: its number


@dataclass
class Cores:
    sim: Sim
    cores: dict[str, WorkerCore] = field(default_factory=dict)
    timers: list[Timer] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)  # the attempt awaiting its answer
    # An attempt that reached the scheduler waits for its answer until then (`AnswerLimit`:
    # reaching the scheduler is bounded by the attempt's time, its answer by the deadline).
    answer_by: dict[tuple[str, int], float] = field(default_factory=dict)
    windows: dict[tuple[str, int], float] = field(default_factory=dict)  # attempt -> answer_s
    numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    failures: list[str] = field(default_factory=list)  # what the cores failed with
    ready: TopologyReadyEvent | None = None  # the topology being stepped, for its checks
    streams: dict[str, int] = field(default_factory=dict)  # the number of the stream it reads
    answered: int = 0  # the stream of the answer being stepped
    spares: set[str] = field(default_factory=set)  # accepted as spares, not promoted since
    ended_at: dict[str, float] = field(default_factory=dict)  # when its stream last ended
    # Whether a stream the scheduler's end cut ends with "not the leader": its own stream of
    # draws, so that the schedule's other choices stay as they were.
    handovers: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.handovers = random.Random(self.sim.seed * 6007 + 11)

    def config(self, proc: Process) -> Any:
        env = {
            "MS_ROLE": "MS_WORKER",
            "MS_WORKER_NUM": str(self.sim.workers),
            "MS_SCHED_HOST": "127.0.0.1",
            "MS_SCHED_PORT": "8118",
            "MS_NODE_ID": proc.node_id,
            "MS_NODE_TIMEOUT": f"{self.sim.node_timeout_s:g}",
            "MS_TOPO_TIMEOUT": f"{TOPO_TIMEOUT_S:g}",
            "MS_ENABLE_RECOVERY": "1",
            "MS_RECOVERY_PATH": "/tmp/cluster-sim-unused",
        }
        if proc.spare:
            env["CLUSTER_SPARE"] = "1"
        return from_env(env)

    # -- the process's life -------------------------------------------------------------------

    def start(self, proc: Process) -> None:
        """A new process: a new core, which remembers the job of the node's state file."""
        # Its pauses jittered as a real process's, from its own seed: the schedule's, the node's
        # and its incarnation's.
        draws = Spread(self.sim.seed * 1_000_003 + proc.port * 101 + proc.incarnation)
        core = WorkerCore(self.config(proc), self.sim.clock, cluster_id=proc.job, draws=draws)
        if self.sim.plant == "finish-give-up":
            core.finish = GiveUpFinish(core.config, self.sim.clock)
        self.cores[proc.node_id] = core
        self.attempts.pop(proc.node_id, None)
        self.spares.discard(proc.node_id)
        self.ended_at.pop(proc.node_id, None)
        # Direct: a scheduler of the simulation comes back at once, so its port always listens.
        self.carry(proc, core.step(steps.Start(verified=True, direct=True)))
        self.after(proc, core.ready_by - self.sim.clock.now, steps.DeadlinePassed())

    def after(
        self, proc: Process, seconds: float, event: steps.Event, attempt: int = 0, finish: int = 0
    ) -> None:
        at = self.sim.clock.now + max(seconds, 0.0)
        timer = Timer(
            at, next(self.numbers), proc.node_id, proc.incarnation, event, attempt, finish
        )
        heapq.heappush(self.timers, timer)

    def next_at(self) -> float:
        return self.timers[0].at if self.timers else float("inf")

    def fire(self) -> None:  # noqa: PLR0911 - one return per timer that no longer counts
        """The earliest timer is due: its event, unless it is for a process gone, or a
        registration attempt already answered, or a topology already held."""
        timer = heapq.heappop(self.timers)
        proc = self.sim.processes[timer.node_id]
        core = self.cores.get(proc.node_id)
        if core is None or not proc.running or proc.incarnation != timer.incarnation:
            return
        if proc.stopped:  # it runs again once continued
            self.after(proc, 0.5, timer.event, timer.attempt, timer.finish)
            return
        if timer.attempt and self.attempts.get(proc.node_id) != timer.attempt:
            return
        if timer.finish and not self.sim.finishes.due(proc, timer.finish):
            return  # the call was answered, or the hold ended, before
        if isinstance(timer.event, FINISH_EVENTS):
            self.sim.finishes.step_core(proc, timer.event)
            return
        by = self.answer_by.pop((proc.node_id, timer.attempt), None)
        if by is not None and by > self.sim.clock.now:  # connected: its answer is awaited
            self.after(proc, by - self.sim.clock.now, timer.event, timer.attempt)
            return
        if isinstance(timer.event, steps.DeadlinePassed) and core.topology is not None:
            return
        if timer.attempt:
            del self.attempts[proc.node_id]
        self.carry(proc, core.step(timer.event))

    # -- what the core decided ----------------------------------------------------------------

    def carry(self, proc: Process, actions: list[steps.Action]) -> None:
        queue = list(actions)
        while queue and proc.running:
            action = queue.pop(0)
            core = self.cores[proc.node_id]
            match action:
                case steps.Register(attempt_s=attempt_s, answer_s=answer_s):
                    number = next(self.numbers)
                    self.attempts[proc.node_id] = number
                    self.windows[(proc.node_id, number)] = self.sim.clock.now + answer_s
                    reg = self.sim.registration(proc, core.cluster_id)
                    self.sim.send(proc, ("register", reg, number))
                    self.after(proc, attempt_s, steps.Unanswered(), attempt=number)
                case steps.AwaitListening():  # listening, or cut off: the wait cannot tell
                    queue.extend(core.step(steps.ListeningAwaited()))
                case steps.CheckScheduler():
                    ok = proc.node_id not in self.sim.net.cut
                    why = "" if ok else "connection timed out (cut off)"
                    queue.extend(core.step(steps.Checked(ok, why)))
                case steps.Pause(seconds=seconds):
                    self.after(proc, seconds, steps.PauseOver())
                case steps.Watch():
                    if core.lifecycle is Lifecycle.SPARE:
                        self.spares.add(proc.node_id)
                    if core.cluster_id != proc.job:  # a new job (its scheduler started anew)
                        proc.job, proc.rank, proc.paused = core.cluster_id, None, False
                    proc.member = True
                    self.streams[proc.node_id] = self.answered
                    self.sim.collectives.send(proc)
                    self.sim.kv.send(proc)
                    self.sim.finishes.back(proc)  # a held Finish goes on
                case steps.Deliver(topology=topology):
                    ready = self.ready
                    assert ready is not None
                    assert ready.generation == topology.generation
                    self.spares.discard(proc.node_id)
                    self.sim.delivered(proc, ready)
                case steps.PeerFailed():
                    proc.paused = True
                case steps.Fail(error=error) | steps.Released(error=error):
                    self.exit(proc, action, error)
                case steps.Done():
                    self.sim.finishes.back(proc)  # over: a held Finish goes on
                case steps.SendFinish(timeout_s=timeout_s):
                    self.sim.finishes.send_core(proc, timeout_s)
                case steps.RetryFinish(after_s=after_s):
                    self.after(proc, after_s, steps.FinishRetryDue())
                case steps.HoldFinish(timeout_s=timeout_s):
                    self.sim.finishes.hold(proc, timeout_s)
                case _:  # Say, Follow, RetryCall
                    pass

    def reached(self, node_id: str, attempt: int) -> None:
        """Registration attempt `attempt` reached the scheduler (so its connection is up)."""
        by = self.windows.pop((node_id, attempt), None)
        if by is not None and self.attempts.get(node_id) == attempt:
            self.answer_by[(node_id, attempt)] = by

    def exit(self, proc: Process, action: steps.Action, error: Exception) -> None:
        """The core failed its node, or let it go: the process exits."""
        self.sim.finishes.check_quiet(proc)
        self.check_failure(proc, error)
        self.failures.append(f"{proc.node_id}: {error}")
        self.sim.note(f"{proc.node_id} exits: {error}")
        self.sim.kill(proc)
        if isinstance(action, steps.Released):
            proc.ended = "released"
        elif isinstance(error, RegistrationRefused):
            proc.ended = "refused"  # for good: its launcher does not start it again

    def check_failure(self, proc: Process, error: Exception) -> None:
        """A failure says why; a spare's registration deadline is set when its stream ends."""
        said = str(error).rstrip()
        if not said or said.endswith(":"):
            raise self.sim.violation("failure-says-why", f"{proc.node_id}: {str(error)!r}")
        ended = self.ended_at.get(proc.node_id, -self.sim.node_timeout_s)
        early = self.sim.clock.now - ended < self.sim.node_timeout_s
        if proc.node_id in self.spares and isinstance(error, SchedulerUnreachableError) and early:
            raise self.sim.violation(
                "spare-deadline",
                f"spare {proc.node_id} failed {self.sim.clock.now - ended:g} s after its stream "
                f"ended, before MS_NODE_TIMEOUT: {error}",
            )

    # -- what reaches the process -------------------------------------------------------------

    def answer(
        self, proc: Process, outcome: Accepted | Refused | None, number: int, stream: int
    ) -> None:
        """The answer to registration attempt `number` (None: a standby's "not the leader"),
        on the scheduler's stream number `stream` when accepted."""
        if self.attempts.get(proc.node_id) != number:
            if isinstance(outcome, Accepted):  # a call given up on (or a retry's): cancelled
                self.sim.send(proc, ("closed", proc.incarnation, stream))
            return
        del self.attempts[proc.node_id]
        core = self.cores[proc.node_id]
        self.answered = stream
        if outcome is None:
            refused = pb.Refusal(reason=pb.REFUSAL_NOT_LEADER, message="not the leader")
            first = pb.Event(refused=refused)
        else:
            settings = self.sim.settings
            response = scheduler_convert.register_response(
                outcome, settings.heartbeat_interval_s, settings.node_timeout_s
            )
            kind = response.WhichOneof("result")
            first = pb.Event(**{kind: getattr(response, kind)})
        self.carry(proc, core.step(worker_convert.answer(first)))

    def event(self, proc: Process, effect: Effect) -> None:
        core = self.cores[proc.node_id]
        message = scheduler_convert.event_to_pb(effect)
        event = worker_convert.stream_event(message, core.config, proc.node_id, host="h0")
        if event is not None:
            self.ready = effect if isinstance(effect, TopologyReadyEvent) else None
            self.carry(proc, core.step(event))
            self.ready = None
        if isinstance(effect, ShutdownEvent) and proc.running:  # the script ends with the job
            proc.running, proc.member, proc.ended = False, False, "shutdown"
            self.sim.finishes.forget(proc)

    def lost(self, proc: Process, why: str, *, cut: bool = False) -> None:
        """Its stream broke (evicted, the scheduler gone or not knowing it; `cut`: by the end
        of the scheduler that held it): heard by a core that reads one."""
        proc.member = False
        self.streams.pop(proc.node_id, None)
        core = self.cores[proc.node_id]
        if core.lifecycle not in STREAMING:
            return
        self.ended_at[proc.node_id] = self.sim.clock.now
        lost: steps.Event = steps.StreamLost(why)
        if cut and self.sim.ha is not None and self.handovers.random() < 0.5:
            lost = steps.NotLeader("", retry_after_s=worker_convert.NOT_LEADER_RETRY_S)
        self.carry(proc, core.step(lost))


__all__ = ["Cores"]
