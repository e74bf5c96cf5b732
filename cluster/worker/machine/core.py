"""The worker's decisions, pure: what happened in, what to do out (etcd's raft/RawNode split).

`WorkerCore` is stepped with the events of `cluster.worker.machine.steps` (an answer to a
registration, an event of the scheduler's stream, the stream lost, a deadline passed, this node's
Finish heard, closing) and returns the actions the agent must carry out (register now, pause, follow
the leader, read the stream, deliver this topology, report this peer's failure, fail with this
error, say this line). It holds the worker's one lifecycle, an injected clock, and no grpc, asyncio
or protobuf (an import-linter contract keeps it so), so it is tested without a network.

The rules it keeps:
- Registration is retried until a deadline (MS_TOPO_TIMEOUT at the start; the reconnect window
  after the stream is lost: MS_NODE_TIMEOUT, with recovery the longer of it and MS_TOPO_TIMEOUT);
  no attempt starts after it, and passing it fails the node, naming the scheduler's last
  refusal or held answer (`answers`), or, when nothing answered, why it could not be reached.
- With recovery off, a silent scheduler fails a formed job's node at once; a broken stream is
  reconnected within MS_NODE_TIMEOUT (a restarted scheduler refuses the old job, and says so).
- A failure is reported once and is final. A node whose Finish the scheduler heard, or whose job
  finished, reports no failure: what happens to the others is theirs to report. While its Finish
  is on its way, a failure waits for the answer, so the order in which the answer and the
  job's end arrive does not matter.
- A Finish is sent again only when it never reached the scheduler (FINISH_RETRIED), and never
  past `finish_wait_s` after it was first sent: while the node's stream is up, after a pause
  that doubles; with recovery, while the node registers again with a scheduler that may come
  back (restarting, or a standby taking over), it is held until the node is accepted again, and
  sent then. A held Finish ends with the node's failure (it is reported), or with the job's end
  (every finish, this one too, was heard). A call for the user cut off by the scheduler is made
  again with recovery; without, it waits a moment for the reason the stream is about to give.
  The Finish's state and timing are `cluster.worker.machine.finishing.Finish`'s.
- A "not the leader" answer is followed at once, to the leader it names. With several scheduler
  addresses (MS_SCHED_HOST=h1,h2 or CLUSTER_SCHED_ADDRS), a scheduler found down, or a standby
  that names no leader, or names one found down a moment ago, sends the node to the next address
  in turn. Only an address of the configuration or one a scheduler named is ever followed.
  These rules are `cluster.protocol.leader_search`'s, shared with `mscluster status`.
- Behind a host's relay: a registration the relay took and answered nothing, with the scheduler
  answering a probe a moment later, is the relay lost (stopped or hung, though its socket takes
  connections): the node leaves it (`LeaveRelay`), naming it, and goes on directly. A stream
  silent while the relay answers (`StreamLost.relay`) is the scheduler's silence: it stays.
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

import enum
from collections.abc import Callable

from cluster.protocol.backoff import Draws
from cluster.protocol.config import ClusterConfig
from cluster.protocol.errors import (
    ClusterError,
    JobFailedError,
    RegistrationRefused,
    ReleasedError,
    SchedulerUnreachableError,
    TopologyTimeoutError,
)
from cluster.protocol.exhaustive import assert_never
from cluster.protocol.leader_search import DOWN_FOR_S, leader_to_follow, next_in_turn
from cluster.protocol.topology import Topology
from cluster.worker.machine import steps
from cluster.worker.machine.answers import Answers
from cluster.worker.machine.finishing import Finish, Unheard
from cluster.worker.machine.pacing import ATTEMPT_TIMEOUT_S, FAILOVER_ATTEMPT_S, RETRY_PAUSE_S, Pace

# Once registered, a worker waits this much longer than MS_TOPO_TIMEOUT for the topology, so
# that the scheduler's own timeout, which names the missing nodes, is what the user sees.
TOPOLOGY_MARGIN_S = 3.0
# Progress lines while waiting: the first after this long, then at this interval.
FIRST_REPORT_AFTER_S = 2.0
REPORT_EVERY_S = 5.0
# How long a call that the scheduler cut off waits for the reason to arrive on the stream.
FATAL_WAIT_S = 2.0
# A spare has no topology deadline: it waits until it is promoted or the job ends (both come on
# its stream, whose loss it notices); this only keeps the wait a finite number.
SPARE_WAIT_S = 365 * 24 * 3600.0


class Lifecycle(enum.Enum):
    JOINING = "joining"  # registering for the first time
    FORMING = "forming"  # accepted; the job has not formed yet
    SPARE = "spare"  # accepted as a spare: waiting for a topology that names this node
    READY = "ready"  # the topology is here
    RECONNECTING = "reconnecting"  # the stream was lost; registering again
    FINISHED = "finished"  # this node's Finish was heard, or the job finished
    FAILED = "failed"  # the job is over for this node with an error (final)
    CLOSED = "closed"  # closed by its owner (final)


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
        self.addresses = config.addresses
        self.address = self.addresses[0]
        # When each address was last found down (since the last acceptance).
        self._down: dict[str, float] = {}
        self._announced = ""  # the leader last said to be followed
        self.recovery = config.recovery is not None
        self.lifecycle = Lifecycle.JOINING
        self.cluster_id = cluster_id
        self.rejoined = False
        self.topology: Topology | None = None
        self.progress = (0, config.expected_nodes)
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.error: ClusterError | None = None  # the failure, once FAILED
        # Why the scheduler could not be reached at the last check ("" when it could).
        self.unreachable = ""
        self.answers = Answers()  # its last refusal or hold, for a deadline passed
        self.deadline = 0.0  # no registration attempt starts after it
        self.ready_by = 0.0  # the topology must have arrived by then
        self._topo_deadline = 0.0
        self._verified = True
        self._relay_unanswered = ""  # a relay that took the last registration, and answered none
        self.pace = Pace(config.expected_nodes, config.node_id, draws)  # between its tries
        self._lost = ""  # why the stream was lost, while it is
        self._window_s = 0.0  # the length of the last reconnect window
        self._finish = Finish(config, clock)  # this node's (`finishing`)
        self.released = False  # let go by a job that ended well without it (`Released`)
        self._guard_said = False  # the first guard refusal is said; the next ones now and then
        self._report_since = self._report_next = 0.0
        # Collectives are numbered per generation: a call made for an old generation (by a
        # step that began before the job moved on) must not shift the new one's numbers.
        self._seqs: dict[int, int] = {}
        # The last collective answered, (generation, number): said when registering again.
        self.answered: tuple[int, int] = (0, 0)

    # -- queries -------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        return f"the scheduler at {self.address}"

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
        return self._finish.heard

    @property
    def finish_wait_s(self) -> float:
        """The longest a Finish is kept asking, from its first send."""
        return self._finish.wait_s

    @property
    def reconnect_window_s(self) -> float:
        """How long a formed job's worker tries to get its scheduler back."""
        if self.recovery:
            return max(self.config.node_timeout_s, self.config.topo_timeout_s)
        return self.config.node_timeout_s

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
        self.answers.note(event, self.clock())
        match event:
            case steps.Start():
                return self._start(event)
            case steps.ListeningAwaited():
                return self._listening_awaited(event)
            case steps.Checked():
                return self._checked(event)
            case steps.PauseOver():
                return self._next_attempt()
            case steps.Accepted():
                return self._accepted(event)
            case steps.Refused():
                return self._refused(event)
            case steps.Unanswered():
                return self._unanswered(event)
            case steps.AnswerLate():
                return self._answer_late(event)
            case steps.NotLeader():
                return self._not_leader(event)
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
                return self._fail(event.error)
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
            case steps.CallCutOff():
                return self._call_cut_off()
            case steps.Close():
                self.lifecycle = Lifecycle.CLOSED
                return []
            case _:  # mypy checks that no event is left out
                return assert_never(event)

    # -- registering ---------------------------------------------------------------------------

    def _start(self, event: steps.Start) -> Actions:
        now = self.clock()
        self.deadline = self._topo_deadline = now + self.config.topo_timeout_s
        self.ready_by = self.deadline + TOPOLOGY_MARGIN_S
        self.pace.direct = event.direct  # it waits for the scheduler's port
        self._begin_attempts(now, event.verified)
        return self._await_listening()

    def _await_listening(self) -> Actions:
        """Before the registration attempts begin: wait for a scheduler that is not listening
        yet (workers often start before it, and a restarted one takes a moment). Only for a node
        that connects to it directly, and with one scheduler address (with several, a down one
        is passed over at once)."""
        now = self.clock()
        remaining = self.deadline - now
        if not self.pace.direct or len(self.addresses) > 1 or remaining <= 0:
            return self._next_attempt()
        every_s, for_s = self.pace.listening(now - self._report_since)  # since attempts began
        # A refused wait ends a pace after its last try: the last wait before the deadline
        # keeps within it.
        return [steps.AwaitListening(min(remaining, for_s), min(remaining, every_s))]

    def _listening_awaited(self, event: steps.ListeningAwaited) -> Actions:
        if not event.refused:
            return self._next_attempt()
        self.unreachable = event.why
        return self._report(f"waiting for {self.where}: {event.why}") + self._await_listening()

    def _begin_attempts(self, now: float, verified: bool) -> None:
        self._verified = verified
        self.unreachable = ""
        self._report_since, self._report_next = now, now + FIRST_REPORT_AFTER_S

    def _next_attempt(self) -> Actions:
        if self.over:
            return []  # finished while registering again: nothing left to join
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            return self._fail(self._registration_timeout())
        attempt = ATTEMPT_TIMEOUT_S if len(self.addresses) == 1 else FAILOVER_ATTEMPT_S
        if not self._verified:
            return [steps.CheckScheduler(min(remaining, attempt))]
        return [steps.Register(min(remaining, attempt), remaining)]

    def _pause(self, seconds: float) -> Actions:
        return [steps.Pause(min(seconds, max(self.deadline - self.clock(), 0.0)))]

    def _checked(self, event: steps.Checked) -> Actions:
        self.unreachable = event.unreachable
        relay, self._relay_unanswered = self._relay_unanswered, ""
        if event.ok and relay:
            # The scheduler answers, the relay that the registration went through did not: the
            # relay is lost (gone, stopped or hung, however its socket takes connections).
            self._verified = True
            why = f"it did not answer this node's registration, while {self.where} answers"
            return [steps.LeaveRelay(why), *self._next_attempt()]
        said = self._report(
            f"waiting for {self.where}: {event.unreachable}"
            if event.unreachable
            else f"waiting for {self.where} to answer: it takes connections, but this node's "
            "last attempt got no answer in time (busy or overloaded? see its log)"
        )
        if not event.ok:
            self._down[self.address] = self.clock()
            return said + self._next_address() + self._retry_pause()
        self._verified = True
        return said + self._next_attempt()

    def _unanswered(self, event: steps.Unanswered) -> Actions:
        if event.relay_cut_off:
            # The relay could not reach the scheduler; it waits for the port for this host, at
            # the host's share of the job's tries: ask it again, probe nothing.
            self.unreachable = f"the relay cannot reach it ({event.relay_cut_off})"
            said = self._report(f"waiting for {self.where}: {self.unreachable}")
            return said + self._pause(RETRY_PAUSE_S)
        # Down, overloaded, or speaking TLS to our plaintext, or the relay gone: the check tells.
        self._verified = False
        self._relay_unanswered = event.relay
        return self._retry_pause()

    def _retry_pause(self) -> Actions:
        """The pause after an attempt that got no answer, or a probe that found no scheduler."""
        return self._pause(self.pace.retry_s())

    def _answer_late(self, event: steps.AnswerLate) -> Actions:
        return [
            steps.Say(
                f"{self.where} has not answered this node's registration for "
                f"{event.waited_s:.0f} s; it answers once it has saved what the registration "
                "changes (see its log if this lasts)"
            )
        ]

    def _refused(self, event: steps.Refused) -> Actions:
        if event.finished and self.topology is None and (self.cluster_id or self.config.spare):
            return self._release(
                f"the job finished while this node waited to rejoin it ({event.message})"
            )
        if event.finished and self._finish.out:
            # The job finished: every node's finish was heard, this one's too (it reached the
            # scheduler before the connection to it broke).
            self._finish_heard()
            return [steps.Say(f"the job finished: {event.message}"), steps.Done()]
        if not event.transient:
            return self._fail(
                RegistrationRefused(f"{self.where} refused this node: {event.message}")
            )
        said: Actions = [steps.Say(f"registration refused for now: {event.message}")]
        if self._guard_said:
            said = self._report(f"waiting out the guard: {event.message}")
        self._guard_said = True
        return said + self._pause(self.pace.guard_s(event.retry_after_s))

    def _accepted(self, event: steps.Accepted) -> Actions:
        if self.over:
            return []  # finished meanwhile: the accepted stream is not read
        said: Actions = []
        if self.lifecycle is Lifecycle.JOINING:
            self.rejoined = event.rejoined
        elif self.topology is not None:
            said.append(
                steps.Say(
                    f"back with {self.where}, which had given this node up: it rejoins the job "
                    f"in generation {event.generation}"
                    if event.rejoined
                    else f"back with {self.where}"
                )
            )
        self.cluster_id = event.cluster_id
        self._down.clear()
        self.progress = (event.registered, event.expected)
        self.heartbeat_interval_s = event.heartbeat_interval_s or self.heartbeat_interval_s
        self.lifecycle = Lifecycle.FORMING if self.topology is None else Lifecycle.READY
        if event.spare and self.topology is None:
            self.lifecycle = Lifecycle.SPARE
            self.ready_by = self._topo_deadline = self.clock() + SPARE_WAIT_S
            said.append(
                steps.Say(
                    f"accepted by {self.where} as a spare: this node waits, without a rank, to "
                    "take a failed worker's"
                )
            )
        return [*said, steps.Watch(self.heartbeat_interval_s)]

    def _not_leader(self, event: steps.NotLeader) -> Actions:
        now = self.clock()
        if self.lifecycle in (Lifecycle.FORMING, Lifecycle.SPARE, Lifecycle.READY):
            # The stream ended with it (the leader handed over, or stepped down): registering
            # again, within a reconnect window from now (a spare waited longer than its start's
            # deadline, as it may), to the new leader; a spare as a spare again.
            self._lost = "the scheduler became a standby"
            self._reconnect_window(now)
            self.lifecycle = Lifecycle.RECONNECTING
        lately_down = {a for a, when in self._down.items() if now - when < DOWN_FOR_S}
        leader = leader_to_follow(self.address, event.leader, lately_down)
        if leader is None:
            # No leader yet (an election under way), or one just found down (its lease has not
            # ended yet): ask again shortly, the next scheduler when there are several.
            moved = self._next_address() if not event.leader else []
            return moved + self._pause(max(event.retry_after_s, RETRY_PAUSE_S))
        said: Actions = []
        if leader != self._announced:
            self._announced = leader
            said.append(steps.Say(f"{self.where} is a standby; following the leader at {leader}"))
        self.address = leader
        # A leader found down before is probed before it is registered with.
        self._verified = event.verified and leader not in self._down
        return [*said, steps.Follow(leader), *self._next_attempt()]

    def _next_address(self) -> Actions:
        """Follow the next scheduler address in turn (none with only one)."""
        if len(self.addresses) == 1:
            return []
        self.address = next_in_turn(self.addresses, self.address)
        self._verified = False  # probed first: a down one is passed over at once
        return [steps.Follow(self.address)]

    def _registration_timeout(self) -> ClusterError:
        """The error of a registration deadline passed: the scheduler's last refusal or hold, or
        why it could not be reached; the address is doubted only when nothing answered."""
        told = self.answers.why(self.clock())
        if self.lifecycle is Lifecycle.JOINING:
            hint = (
                told
                or self.unreachable
                or "is it running, and are MS_SCHED_HOST / MS_SCHED_PORT right?"
            )
            return TopologyTimeoutError(f"{self.where} did not accept this node in time: {hint}")
        why = f" ({self.unreachable})" if self.unreachable else ""
        lost = self._lost or "it did not take this node back"
        if told:  # it answers: not unreachable
            within = "" if self.topology is None else f" within {self._window()}"
            return SchedulerUnreachableError(
                f"{self.where} did not take this node back{within} ({lost}): {told}"
            )
        if self.topology is None:
            return SchedulerUnreachableError(f"{self.where} is unreachable: {lost}{why}")
        return SchedulerUnreachableError(
            f"{self.where} is unreachable: {lost}, and it did not come back within "
            f"{self._window()}{why}{self._bring_back(late=True)}"
        )

    def _window(self) -> str:
        """The reconnect window of a formed job's node, as a sentence names it."""
        if self.recovery:
            return (
                f"{self._window_s:g} s (the longer of MS_NODE_TIMEOUT and MS_TOPO_TIMEOUT, "
                "recovery on)"
            )
        return f"MS_NODE_TIMEOUT={self._window_s:g} s"

    def _bring_back(self, *, late: bool = False) -> str:
        """What brings the scheduler back for a formed job's node (with recovery), or, `late`,
        the job once this node has given the scheduler up."""
        if not self.recovery:
            return ""
        state = "the job's saved state (the same MS_RECOVERY_PATH or CLUSTER_STATE_URL)"
        if late:
            return (
                f": to go on, start the scheduler again on {state} and this worker with it; a "
                "larger MS_TOPO_TIMEOUT waits longer"
            )
        return f": start it again on {state} within that time, and the workers go on"

    def away(self) -> str:
        """While a formed job's node registers again: where its scheduler went, how much longer
        it is waited for, and what brings it back; "" otherwise."""
        if self.lifecycle is not Lifecycle.RECONNECTING or self.topology is None:
            return ""
        left = max(self.deadline - self.clock(), 0.0)
        return (
            f"{self.where} is away ({self._lost or 'it did not take this node back'}), and this "
            f"node waits {left:.0f} s more for it, {self._window()} in all{self._bring_back()}"
        )

    # -- the stream ----------------------------------------------------------------------------

    def _progress(self, event: steps.Progress) -> Actions:
        self.progress = (event.registered, event.expected)
        if self.topology is not None:
            return []
        return self._report(
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
        return self._fail(
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
            return self._release(f"the job finished while this node was a spare: {event.reason}")
        if event.ok and self.topology is None:
            # Not this node's job that finished: it never had its topology.
            error = JobFailedError(f"the job finished before this node joined it: {event.reason}")
            return [*self._fail(error), steps.Done()]
        if event.ok:
            self.lifecycle = Lifecycle.FINISHED
            return [steps.Done()]
        return [*self._fail(JobFailedError(f"job failed: {event.reason}")), steps.Done()]

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
        via = " through the relay" if event.relay else ""
        self._lost = reason
        if self.topology is not None and event.silent_s is not None and not self.recovery:
            return self._fail(SchedulerUnreachableError(f"{self.where} is unreachable: {reason}"))
        window = self._reconnect_window(now)
        said: Actions = []
        if self.topology is not None:
            said.append(
                steps.Say(
                    f"lost {self.where} ({reason}); training goes on (recovery is on), "
                    f"reconnecting{via} for up to {window:g} s"
                    if self.recovery
                    else f"lost {self.where} ({reason}); reconnecting for up to "
                    f"MS_NODE_TIMEOUT={self.config.node_timeout_s:g} s"
                )
            )
        self.lifecycle = Lifecycle.RECONNECTING
        # With several schedulers, probe first: a dead leader is passed over at once.
        self._begin_attempts(now, event.verified and len(self.addresses) == 1)
        return said + self._await_listening()

    def _reconnect_window(self, now: float) -> float:
        """Set the deadline of registering again from `now`; the window's length."""
        if self.topology is None:
            # Still forming: MS_TOPO_TIMEOUT bounds everything, and a scheduler that accepted us
            # and then vanished gets MS_NODE_TIMEOUT to come back, like a formed job's.
            self.deadline = min(self._topo_deadline, now + self.config.node_timeout_s)
        else:
            self.deadline = now + self.reconnect_window_s
        self._window_s = self.deadline - now
        return self._window_s

    def _deadline_passed(self) -> Actions:
        if self.topology is not None or self.over or self.clock() < self.ready_by:
            return []
        registered, expected = self.progress
        return self._fail(
            TopologyTimeoutError(
                f"the job did not form within MS_TOPO_TIMEOUT={self.config.topo_timeout_s:g} s: "
                f"{registered} of {expected} nodes had registered with {self.where}"
            )
        )

    # -- the end -------------------------------------------------------------------------------

    def _fail(self, error: ClusterError) -> Actions:
        if self.over:
            # After this node's Finish was heard, what happens to the others is theirs to
            # report: this process did its part and exits as it means to.
            return []
        taken = self._finish.takes(error)  # kept for the Finish's answer, or its end
        if taken is not False:
            return [] if taken is True else self._finish_unheard(taken)
        self.lifecycle = Lifecycle.FAILED
        self.error = error
        return [steps.Fail(error)]

    def _release(self, why: str) -> Actions:
        """The job ended well without needing this node: nothing to report, exit 0."""
        self.lifecycle = Lifecycle.FINISHED
        self.released = True
        return [steps.Released(ReleasedError(why)), steps.Done()]

    def _finish_sent(self) -> Actions:
        return self._finish.send() if self.may_finish else []

    def _finish_failed(self, event: steps.FinishFailed) -> Actions:
        away = self._lost if self.lifecycle is Lifecycle.RECONNECTING else None
        decided = self._finish.failed(event, away=away, released=self.released, where=self.where)
        return self._finish_unheard(decided)

    def _finish_retry_due(self) -> Actions:
        finished = self.lifecycle is Lifecycle.FINISHED
        reconnecting = self.lifecycle is Lifecycle.RECONNECTING
        decided = self._finish.retry_due(finished=finished, reconnecting=reconnecting)
        return self._finish_unheard(decided)

    def _finish_answered(self, event: steps.FinishAnswered) -> Actions:
        decided = self._finish.answered(event)
        if self._finish.heard:
            self.lifecycle = Lifecycle.FINISHED
        return self._finish_unheard(decided)

    def _finish_heard(self) -> None:
        self._finish.hear()
        self.lifecycle = Lifecycle.FINISHED

    def _finish_unheard(self, decided: Actions | Unheard) -> Actions:
        """What the Finish decided; unheard, said, and the failure held meanwhile reported."""
        if not isinstance(decided, Unheard):
            return decided
        said, held = self._finish.unheard(decided, self.where)
        return [said, *([] if held is None else self._fail(held))]

    def _call_cut_off(self) -> Actions:
        if self.recovery and not self.over:
            # The scheduler went away mid-call. Ask again, paced: a relay that cannot reach it
            # and a standby that does not lead answer at once. The reconnect window ends the
            # retries (as a failure they race against).
            return [steps.RetryCall(self.pace.call_retry_s())]
        # The scheduler stopping mid-call: its reason is on the event stream, an instant
        # behind; report that rather than a bare "CANCELLED".
        return [steps.AwaitFatal(FATAL_WAIT_S)]

    # -- helpers -------------------------------------------------------------------------------

    def _report(self, message: str) -> Actions:
        """A waiting message now and then, not on every poll."""
        now = self.clock()
        if now < self._report_next:
            return []
        self._report_next = now + REPORT_EVERY_S
        return [steps.Say(f"{message} ({now - self._report_since:.0f} s)")]


def _who(rank: int | None, node_id: str) -> str:
    """A failed node as a sentence names it: by its rank when it held one."""
    return f"node {node_id!r}" if rank is None else f"rank {rank} (node {node_id!r})"
