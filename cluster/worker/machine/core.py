"""The worker's decisions, pure: what happened in, what to do out (etcd's raft/RawNode split).

`WorkerCore` is stepped with the events of `cluster.worker.machine.steps` (an answer to a
registration, an event of the scheduler's stream, the stream lost, a deadline passed, this node's
Finish heard, closing) and returns the actions the agent must carry out (register now, pause, follow
the leader, read the stream, deliver this topology, report this peer's failure, fail with this
error, say this line). It holds the worker's one lifecycle, an injected clock, and no grpc, asyncio
or protobuf (an import-linter contract keeps it so), so it is tested without a network. Its parts:
`joining` (the registration attempts, at the start and after the stream was lost: their
deadlines, the leader followed, the relay left), `finishing` (this node's Finish), `answers` (what
the scheduler last answered the attempts), `pacing` (how long each wait is), `stalls` (when this
process itself did not run).

The rules it keeps:
- Registering, and registering again, is `joining`'s (see there): retried until a deadline, whose
  passing fails the node, following the leader a standby names, leaving a relay that answers
  nothing, or whose scheduler runs another job.
- With recovery off, a silent scheduler fails a formed job's node at once; a broken stream is
  reconnected within MS_NODE_TIMEOUT (a restarted scheduler refuses the old job, and says so).
  Behind a host's relay, a stream silent while the relay answers (`StreamLost.relay`) is the
  scheduler's silence: the node stays on the relay.
- This process's own stalls (stopped, starved of CPU, or holding the GIL: `steps.Stalled`) are
  never the scheduler's silence (`silence_left`), and a loss of the stream, or the job's
  failure, that follows one long enough for the scheduler to fail this node names it, not the
  scheduler (`stalls`).
- A failure is reported once and is final. A node whose Finish the scheduler heard, or whose job
  finished, reports no failure: what happens to the others is theirs to report. While its Finish
  is on its way, a failure waits for the answer, so the order in which the answer and the
  job's end arrive does not matter. A Finish that came after the job failed is refused with
  that failure (the scheduler counts no finish of a failed job), and the node fails with it.
- A Finish is sent again only when it never reached the scheduler (FINISH_RETRIED): while the
  node's stream is up, after a pause that doubles, within its give-up time; while the node
  registers again, it is held until the node is accepted again, as long as a training node
  waits for its scheduler (the reconnect window), and sent then, with its give-up time afresh:
  with recovery the scheduler may come back (restarting, or a standby taking over); without,
  the registration learns whether the job failed as the node lost its stream. A held Finish
  ends with the node's failure (it is reported: a refusal is one, and so is the window's end,
  said as what it is: the scheduler did not answer whether it counted the finish), or with the
  job's end (every finish, this one too, was heard), or with the scheduler's saved state
  showing it counted (`steps.FinishCounted`). The job's end heard on the stream makes a Finish
  whose answer is lost heard too. A call for the user cut off by the scheduler is made again
  with recovery; without, it waits a moment for the reason the stream is about to give.
  The Finish's state and timing are `cluster.worker.machine.finishing.Finish`'s.
- Spares: a node accepted as a spare (CLUSTER_SPARE=1, or a restarted node whose
  rank a spare took meanwhile) waits, heartbeating, without a deadline, until a topology names
  it (it is promoted: `start` returns with its rank) or the job ends (it is released and exits
  0); a spare whose stream ends (lost, or a leader handing over) registers again, as a spare,
  within a reconnect window counted from then. A node waiting out its guard asks again at
  least every `guard_poll_s` (GUARD_POLL_S up to 750 nodes), so that it hears of the job's end
  at once. A ranked node left out of a new topology (its rank went to a spare while it was cut
  off) fails.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.protocol.backoff import Draws
from cluster.protocol.config import ClusterConfig, silence_limit
from cluster.protocol.errors import (
    ClusterError,
    JobFailedError,
    ReleasedError,
    SchedulerUnreachableError,
    TopologyTimeoutError,
)
from cluster.protocol.exhaustive import assert_never
from cluster.protocol.topology import Topology
from cluster.worker.machine import steps
from cluster.worker.machine.answers import Answers
from cluster.worker.machine.finishing import Away, Finish, Unheard
from cluster.worker.machine.joining import TOPOLOGY_MARGIN_S, Joining
from cluster.worker.machine.lifecycle import Lifecycle
from cluster.worker.machine.pacing import Pace
from cluster.worker.machine.stalls import Stalls

# The core's names, with the part's that its callers and tests use.
__all__ = ["FATAL_WAIT_S", "TOPOLOGY_MARGIN_S", "Lifecycle", "WorkerCore"]

# How long a call that the scheduler cut off waits for the reason to arrive on the stream.
FATAL_WAIT_S = 2.0

Actions = list[steps.Action]


class WorkerCore:
    """One worker's view of its membership, stepped by events; see the module docstring."""

    def __init__(
        self,
        config: ClusterConfig,
        clock: Callable[[], float],
        *,
        cluster_id: str = "",
        draws: Draws | None = None,
    ) -> None:
        """`cluster_id`: the job this node belonged to before its process restarted. `draws`:
        what its pauses are jittered with (`Pace`)."""
        self.config = config
        self.clock = clock
        self.recovery = config.recovery is not None
        self.lifecycle = Lifecycle.JOINING
        self.cluster_id = cluster_id
        self.rejoined = False
        self.topology: Topology | None = None
        self.progress = (0, config.expected_nodes)
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.error: ClusterError | None = None  # the failure, once FAILED
        self.answers = Answers()  # its last refusal or hold, for a deadline passed
        self.deadline = 0.0  # no registration attempt starts after it
        self.ready_by = 0.0  # the topology must have arrived by then
        self.topo_deadline = 0.0  # MS_TOPO_TIMEOUT from the start (a spare's: none to speak of)
        self.pace = Pace(config.expected_nodes, config.node_id, draws)  # between its tries
        self.finish = Finish(config, clock)  # this node's (`finishing`)
        self.released = False  # let go by a job that ended well without it (`Released`)
        # Collectives are numbered per generation: a call made for an old generation (by a
        # step that began before the job moved on) must not shift the new one's numbers.
        self._seqs: dict[int, int] = {}
        # The last collective answered, (generation, number): said when registering again.
        self.answered: tuple[int, int] = (0, 0)
        self.joining = Joining(self)  # its registration attempts, and whom they go to
        self.stalls = Stalls()  # when this process itself did not run (`stalls`)

    # -- queries -------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The scheduler this node registers with (`Joining`)."""
        return self.joining.address

    @property
    def where(self) -> str:
        return self.joining.where

    @property
    def over(self) -> bool:
        """Nothing more happens for this node (failed, closed, or finished)."""
        return self.lifecycle in (Lifecycle.FAILED, Lifecycle.CLOSED, Lifecycle.FINISHED)

    @property
    def may_finish(self) -> bool:
        """Whether a Finish is worth sending: the node joined, has not failed, and was not let
        go (`Released`)."""
        return (
            bool(self.cluster_id)
            and self.lifecycle not in (Lifecycle.FAILED, Lifecycle.CLOSED)
            and not self.released
        )

    @property
    def finish_heard(self) -> bool:
        """Whether the scheduler heard this node's Finish."""
        return self.finish.heard

    @property
    def finish_wait_s(self) -> float:
        """A Finish's give-up time, from its send (or from the node's return, after a hold)."""
        return self.finish.wait_s

    @property
    def finish_bound_s(self) -> float:
        """The longest a Finish is kept asking, from its first send: its give-up time, a hold
        for the node's reconnect window and a give-up time afresh after it."""
        return 2 * self.finish.wait_s + self.joining.reconnect_window_s

    def away(self) -> str:
        """While a formed job's node registers again: where its scheduler went, how much longer
        it is waited for, and what brings it back; "" otherwise (`Joining.away`)."""
        return self.joining.away()

    def silence_left(self, heard_at: float, limit_s: float) -> float:
        """How much longer the stream last heard at `heard_at` may stay silent before the
        scheduler's silence reaches `limit_s` (none left: the stream is given up). This
        process's own stalls since do not count (it could not hear anything while it did not
        run), and a job that has not formed yet is not held to it (`limit_s` from now)."""
        if self.topology is None:
            return limit_s
        now = self.clock()
        return limit_s - (now - heard_at - self.stalls.within(heard_at, now))

    def next_seq(self, generation: int) -> int:
        """The number of this node's next collective of `generation`."""
        self._seqs[generation] = self._seqs.get(generation, 0) + 1
        return self._seqs[generation]

    def collective_unsent(self, generation: int, seq: int) -> None:
        """Collective #`seq` of `generation` never reached the scheduler (refused on its way):
        its number is this node's next collective's, so that its numbers stay its peers' (unless
        a later one was taken meanwhile)."""
        if self._seqs.get(generation) == seq:
            self._seqs[generation] = seq - 1

    def collective_answered(self, generation: int, seq: int) -> None:
        """Collective #`seq` of `generation` got its answer: a scheduler restarted since then
        learns, from the node's next registration, which rounds its predecessor answered."""
        self.answered = max(self.answered, (generation, seq))

    # -- the one input -------------------------------------------------------------------------

    def step(self, event: steps.Event) -> Actions:  # noqa: PLR0911, PLR0912 - a case an event
        """What to do now that `event` happened. A failed or closed node does nothing more."""
        if self.lifecycle in (Lifecycle.FAILED, Lifecycle.CLOSED):
            return []
        if isinstance(event, steps.Stalled):  # says nothing of the scheduler's answers
            self.stalls.add(event.seconds, self.clock())
            return []
        self.answers.note(event, self.clock())
        match event:
            case steps.Start():
                return self.joining.start(event)
            case steps.ListeningAwaited():
                return self.joining.listening_awaited(event)
            case steps.Checked():
                return self.joining.checked(event)
            case steps.PauseOver():
                return self.joining.next_attempt()
            case steps.Accepted():
                return self.joining.accepted(event)
            case steps.Refused():
                return self.joining.refused(event)
            case steps.Unanswered():
                return self.joining.unanswered(event)
            case steps.AnswerLate():
                return self.joining.answer_late(event)
            case steps.NotLeader():
                return self.joining.not_leader(event)
            case steps.Progress():
                return self._progress(event)
            case steps.TopologyReady():
                return self._topology_ready(event)
            case steps.Unplaced():
                return self._unplaced(event)
            case steps.NodeFailed():
                return self._node_failed(event)
            case steps.Shutdown():
                return self._shutdown(event)
            case steps.StreamLost():
                return self._stream_lost(event)
            case steps.Fatal():
                return self.fail(event.error)
            case steps.DeadlinePassed():
                return self._deadline_passed()
            case steps.FinishSent():
                return self._finish_sent()
            case steps.FinishAnswered():
                return self._finish_answered(event)
            case steps.FinishFailed():
                return self._finish_failed(event)
            case steps.FinishRetryDue():
                return self._finish_retry_due()
            case steps.FinishCounted():
                return self._finish_counted(event)
            case steps.CallCutOff():
                return self._call_cut_off()
            case steps.Close():
                self.lifecycle = Lifecycle.CLOSED
                return []
            case _:  # mypy checks that no event is left out
                return assert_never(event)

    # -- the stream ----------------------------------------------------------------------------

    def _progress(self, event: steps.Progress) -> Actions:
        self.progress = (event.registered, event.expected)
        if self.topology is not None:
            return []
        return self.joining.report(
            f"waiting for the job to form: {event.registered} of {event.expected} nodes registered"
        )

    def _topology_ready(self, event: steps.TopologyReady) -> Actions:
        previous, self.topology = self.topology, event.topology
        said: Actions = []
        if self.lifecycle is Lifecycle.SPARE:
            said.append(
                steps.Say(
                    f"promoted: this spare takes rank {event.topology.rank} in generation "
                    f"{event.topology.generation} ({event.topology.reason}); the newest "
                    f"checkpoint every rank holds is step {event.topology.rollback_step}"
                )
            )
        if self.lifecycle is not Lifecycle.FINISHED:
            self.lifecycle = Lifecycle.READY
        new = previous is not None and event.topology.generation != previous.generation
        if new:
            said.append(
                steps.Say(
                    f"the job is now at generation {event.topology.generation} "
                    f"({event.topology.reason}); its rollback step on disk is "
                    f"{event.topology.rollback_step}"
                )
            )
        return [*said, steps.Deliver(event.topology, new_generation=new)]

    def _unplaced(self, event: steps.Unplaced) -> Actions:
        if self.topology is None:
            return []  # a spare, not promoted in this generation
        return self.fail(
            JobFailedError(
                f"generation {event.generation} of the job does not name this node: its rank "
                "went to a spare while it was cut off; start it again to join as a spare"
            )
        )

    def _node_failed(self, event: steps.NodeFailed) -> Actions:
        actions: Actions = []
        if self.topology is not None and event.generation == self.topology.generation:
            actions.append(steps.PeerFailed(event.generation))
        if self.recovery and event.node_id != self.config.node_id:
            actions.append(
                steps.Say(
                    f"{_who(event.rank, event.node_id)} failed: {event.reason}; the job "
                    "waits for it to rejoin (recovery is on)"
                )
            )
        return actions

    def _shutdown(self, event: steps.Shutdown) -> Actions:
        if event.ok and self.topology is None and self.lifecycle is Lifecycle.SPARE:
            return self.release(f"the job finished while this node was a spare: {event.reason}")
        if event.ok and self.topology is None:
            # Not this node's job that finished: it never had its topology.
            error = JobFailedError(f"the job finished before this node joined it: {event.reason}")
            return [*self.fail(error), steps.Done()]
        if event.ok:
            self.lifecycle = Lifecycle.FINISHED
            return [steps.Done()]
        stall = self._own_stall(self.clock())  # this node's stall may be why: said with it
        reason = f"{event.reason}; {stall}" if stall else event.reason
        return [*self.fail(JobFailedError(f"job failed: {reason}")), steps.Done()]

    def _stream_lost(self, event: steps.StreamLost) -> Actions:
        if self.lifecycle is Lifecycle.FINISHED:
            return [steps.Done()]
        now = self.clock()
        reason = event.reason
        if event.silent_s is not None:
            silence = f"no heartbeat from {self.where} for {event.silent_s:g} s"
            reason = f"{silence} (hung or cut off?)"
            if event.relay:  # the node stays on it
                reason = (
                    f"{silence} through the relay at {event.relay}, which answers: the scheduler "
                    "hung, or the relay's link to it is cut"
                )
        stall = self._own_stall(now)
        if stall:  # what the scheduler took this node for hung for: said before the loss
            reason = f"{stall}; then its event stream ended: {reason}"
        self.joining.lost = reason
        if self.topology is not None and event.silent_s is not None and not self.recovery:
            return self.fail(SchedulerUnreachableError(f"{self.where} is unreachable: {reason}"))
        window = self.joining.reconnect_window(now)
        said: Actions = []
        if self.topology is not None:
            said.append(steps.Say(self._reconnecting(reason, stall, event.relay, window)))
        self.lifecycle = Lifecycle.RECONNECTING
        # With several schedulers, probe first: a dead leader is passed over at once.
        self.joining.begin_attempts(now, event.verified and len(self.joining.addresses) == 1)
        return said + self.joining.await_listening()

    def _reconnecting(self, reason: str, stall: str, relay: str, window: float) -> str:
        """What this node says as it reconnects after losing its stream (`reason`)."""
        lost = reason if stall else f"lost {self.where} ({reason})"
        to = f" to {self.where}" if stall else ""
        via = " through the relay" if relay else ""
        if self.finish.out:  # its training is over: what it waits for is the Finish's answer
            bound = f"{window:g} s" if self.recovery else self._node_timeout()
            return (
                f"{lost}; this node finished: reconnecting{to}{via} for up to {bound} to hear "
                "whether the scheduler counted its finish"
            )
        if self.recovery:
            return (
                f"{lost}; training goes on (recovery is on), reconnecting{to}{via} for up to "
                f"{window:g} s"
            )
        return f"{lost}; reconnecting{to} for up to {self._node_timeout()}"

    def _node_timeout(self) -> str:
        return f"MS_NODE_TIMEOUT={self.config.node_timeout_s:g} s"

    def _own_stall(self, now: float) -> str:
        """A stall of this process that ended a moment ago, long enough for the scheduler to
        have failed this node, as a sentence ("" when there is none, or no heartbeats)."""
        if not self.config.heartbeat_enabled:
            return ""
        limit_s = silence_limit(self.config.node_timeout_s, self.heartbeat_interval_s)
        return self.stalls.named(now, limit_s, self.heartbeat_interval_s)

    def _deadline_passed(self) -> Actions:
        if self.topology is not None or self.over or self.clock() < self.ready_by:
            return []
        registered, expected = self.progress
        return self.fail(
            TopologyTimeoutError(
                f"the job did not form within MS_TOPO_TIMEOUT={self.config.topo_timeout_s:g} s: "
                f"{registered} of {expected} nodes had registered with {self.where}"
            )
        )

    # -- the end -------------------------------------------------------------------------------

    def fail(self, error: ClusterError) -> Actions:
        """Fail this node with `error`, once; held while its Finish is on its way."""
        if self.over:
            # After this node's Finish was heard, what happens to the others is theirs to
            # report: this process did its part and exits as it means to.
            return []
        taken = self.finish.takes(error)  # kept for the Finish's answer, or its end
        if taken is not False:
            return [] if taken is True else self._finish_unheard(taken)
        self.lifecycle = Lifecycle.FAILED
        self.error = error
        return [steps.Fail(error)]

    def release(self, why: str) -> Actions:
        """The job ended well without needing this node: nothing to report, exit 0."""
        self.lifecycle = Lifecycle.FINISHED
        self.released = True
        return [steps.Released(ReleasedError(why)), steps.Done()]

    def _finish_sent(self) -> Actions:
        return self.finish.send() if self.may_finish else []

    def _away(self) -> Away | None:
        """While the node registers again: why its scheduler is away, and until when."""
        if self.lifecycle is not Lifecycle.RECONNECTING:
            return None
        return Away(self.joining.lost, self.deadline)

    def _finish_failed(self, event: steps.FinishFailed) -> Actions:
        decided = self.finish.failed(
            event,
            away=self._away(),
            released=self.released,
            finished=self.lifecycle is Lifecycle.FINISHED,
            where=self.where,
        )
        return self._finish_unheard(decided)

    def _finish_retry_due(self) -> Actions:
        finished = self.lifecycle is Lifecycle.FINISHED
        decided = self.finish.retry_due(finished=finished, away=self._away())
        return self._finish_unheard(decided)

    def _finish_counted(self, event: steps.FinishCounted) -> Actions:
        if not self.finish.counted():
            return []
        self.lifecycle = Lifecycle.FINISHED
        said = steps.Say(
            f"{self.where} went away without answering this node's finish, but {event.evidence} "
            "(it saves a finish before it answers): this node is done"
        )
        return [said, steps.Done()]

    def _finish_answered(self, event: steps.FinishAnswered) -> Actions:
        decided = self.finish.answered(event)
        if self.finish.heard:
            self.lifecycle = Lifecycle.FINISHED
        return self._finish_unheard(decided)

    def _finish_unheard(self, decided: Actions | Unheard) -> Actions:
        """What the Finish decided; unheard, said, and the failure held meanwhile reported."""
        if not isinstance(decided, Unheard):
            return decided
        said, held = self.finish.unheard(decided, self.where)
        return [*said, *([] if held is None else self.fail(held))]

    def _call_cut_off(self) -> Actions:
        if self.recovery and not self.over:
            # The scheduler went away mid-call. Ask again, paced: a relay that cannot reach it
            # and a standby that does not lead answer at once. The reconnect window ends the
            # retries (as a failure they race against).
            return [steps.RetryCall(self.pace.call_retry_s())]
        # The scheduler stopping mid-call: its reason is on the event stream, an instant
        # behind; report that rather than a bare "CANCELLED".
        return [steps.AwaitFatal(FATAL_WAIT_S)]


def _who(rank: int | None, node_id: str) -> str:
    """A failed node as a sentence names it: by its rank when it held one."""
    return f"node {node_id!r}" if rank is None else f"rank {rank} (node {node_id!r})"
