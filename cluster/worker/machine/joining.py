"""Registering, a part of the worker's core: how a node gets a scheduler to accept it, at the
start and again after its stream was lost, and what it says while it tries and once it gives up.

Pure, like `core`, which owns it (`WorkerCore.joining`) and steps it with the events of a
registration (started, the port awaited, the scheduler probed, a pause over, accepted, refused,
unanswered, answered late, not the leader). It holds which scheduler the node registers with,
and the waiting lines' pace; the node's deadlines, lifecycle and failure are the core's
(`JoiningHost`).

The rules it keeps:
- Registration is retried until a deadline (MS_TOPO_TIMEOUT at the start; the reconnect window
  after the stream is lost: MS_NODE_TIMEOUT, with recovery the longer of it and MS_TOPO_TIMEOUT);
  no attempt starts after it, and passing it fails the node, naming the scheduler's last
  refusal or held answer (`answers`), or, when nothing answered, why it could not be reached.
- A "not the leader" answer is followed at once, to the leader it names. With several scheduler
  addresses (MS_SCHED_HOST=h1,h2 or CLUSTER_SCHED_ADDRS), a scheduler found down, or a standby
  that names no leader, or names one found down a moment ago, sends the node to the next address
  in turn. Only an address of the configuration or one a scheduler named is ever followed.
  These rules are `cluster.protocol.leader_search`'s, shared with `mscluster status`.
- A node of a job (it has the job's cluster id) that knows several schedulers, refused by one
  as a node of another job, takes that one for a scheduler that is not its job's (a standby
  started on another job's state, which leads a job of its own), like a standby that names no
  leader: it says so once, tries the others in turn, and fails only at its deadline, naming
  that refusal, or at once when every scheduler it knows has refused it so (its record names
  a job none of them runs). With one scheduler the refusal fails the node at once.
  Behind a host's relay such a refusal is the relay's scheduler's, whichever address the node
  asked (the relay forwards to the one it follows, and moves on no refusal: the others of the
  host may be its job's): the node leaves the relay (`LeaveRelay`, refused) and asks the same
  address directly, where the rule above applies; it goes back through the relay only once its
  stream runs again.
- Behind a host's relay: a registration the relay took and answered nothing, with the scheduler
  answering a probe a moment later, is the relay lost (stopped or hung, though its socket takes
  connections): the node leaves it (`LeaveRelay`), naming it, and goes on directly.
- A node accepted as a spare waits without a deadline (`SPARE_WAIT_S`); a node waiting out the
  scheduler's guard asks again at least every `guard_poll_s` (`Pace.guard_s`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cluster.protocol.config import ClusterConfig
from cluster.protocol.errors import (
    ClusterError,
    RegistrationRefused,
    SchedulerUnreachableError,
    TopologyTimeoutError,
)
from cluster.protocol.leader_search import DOWN_FOR_S, leader_to_follow, next_in_turn
from cluster.protocol.topology import Topology
from cluster.worker.machine import steps
from cluster.worker.machine.answers import Answers, held
from cluster.worker.machine.finishing import Finish
from cluster.worker.machine.lifecycle import Lifecycle
from cluster.worker.machine.pacing import ATTEMPT_TIMEOUT_S, FAILOVER_ATTEMPT_S, RETRY_PAUSE_S, Pace

# Once registered, a worker waits this much longer than MS_TOPO_TIMEOUT for the topology, so
# that the scheduler's own timeout, which names the missing nodes, is what the user sees.
TOPOLOGY_MARGIN_S = 3.0
# Progress lines while waiting: the first after this long, then at this interval.
FIRST_REPORT_AFTER_S = 2.0
REPORT_EVERY_S = 5.0
# A spare has no topology deadline: it waits until it is promoted or the job ends (both come on
# its stream, whose loss it notices); this only keeps the wait a finite number.
SPARE_WAIT_S = 365 * 24 * 3600.0

Actions = list[steps.Action]


class JoiningHost(Protocol):
    """What registering reads and changes of the node (`WorkerCore`)."""

    config: ClusterConfig
    clock: Callable[[], float]
    recovery: bool
    lifecycle: Lifecycle
    cluster_id: str
    rejoined: bool
    topology: Topology | None
    progress: tuple[int, int]
    heartbeat_interval_s: float
    answers: Answers
    deadline: float
    ready_by: float
    topo_deadline: float
    pace: Pace
    finish: Finish

    @property
    def over(self) -> bool: ...

    def fail(self, error: ClusterError) -> Actions: ...

    def release(self, why: str) -> Actions: ...


class Joining:
    """The registration attempts of `WorkerCore`, a part it owns (see the module docstring)."""

    def __init__(self, node: JoiningHost) -> None:
        self.node = node
        self.addresses = node.config.addresses
        self.address = self.addresses[0]
        # When each address was last found down (since the last acceptance).
        self._down: dict[str, float] = {}
        # What each scheduler that runs another job said (since the last acceptance).
        self._foreign: dict[str, str] = {}
        # Of those, each one a standby then named as its leader: that standby (it is asked again,
        # since it may have been started again with this job's prefix since).
        self._named_by: dict[str, str] = {}
        self._announced = ""  # the leader last said to be followed
        # Why the scheduler could not be reached at the last check ("" when it could).
        self.unreachable = ""
        self._verified = True
        self._relay_unanswered = ""  # a relay that took the last registration, and answered none
        self.lost = ""  # why the stream was lost, while it is
        self._window_s = 0.0  # the length of the last reconnect window
        self._guard_said = False  # the first guard refusal is said; the next ones now and then
        self._report_since = self._report_next = 0.0

    @property
    def where(self) -> str:
        return f"the scheduler at {self.address}"

    @property
    def reconnect_window_s(self) -> float:
        """How long a formed job's worker tries to get its scheduler back."""
        if self.node.recovery:
            return max(self.node.config.node_timeout_s, self.node.config.topo_timeout_s)
        return self.node.config.node_timeout_s

    def start(self, event: steps.Start) -> Actions:
        now = self.node.clock()
        self.node.deadline = self.node.topo_deadline = now + self.node.config.topo_timeout_s
        self.node.ready_by = self.node.deadline + TOPOLOGY_MARGIN_S
        self.node.pace.direct = event.direct  # it waits for the scheduler's port
        self.begin_attempts(now, event.verified)
        return self.await_listening()

    def await_listening(self) -> Actions:
        """Before the registration attempts begin: wait for a scheduler that is not listening
        yet (workers often start before it, and a restarted one takes a moment). Only for a node
        that connects to it directly, and with one scheduler address (with several, a down one
        is passed over at once)."""
        now = self.node.clock()
        remaining = self.node.deadline - now
        if not self.node.pace.direct or len(self.addresses) > 1 or remaining <= 0:
            return self.next_attempt()
        every_s, for_s = self.node.pace.listening(now - self._report_since)  # since attempts began
        # A refused wait ends a pace after its last try: the last wait before the deadline
        # keeps within it.
        return [steps.AwaitListening(min(remaining, for_s), min(remaining, every_s))]

    def listening_awaited(self, event: steps.ListeningAwaited) -> Actions:
        if self.node.over:
            return []  # finished while registering again (its Finish counted): nothing to join
        if not event.refused:
            return self.next_attempt()
        self.unreachable = event.why
        return self.report(f"waiting for {self.where}: {event.why}") + self.await_listening()

    def begin_attempts(self, now: float, verified: bool) -> None:
        self._verified = verified
        self.unreachable = ""
        self._report_since, self._report_next = now, now + FIRST_REPORT_AFTER_S

    def next_attempt(self) -> Actions:
        if self.node.over:
            return []  # finished while registering again: nothing left to join
        remaining = self.node.deadline - self.node.clock()
        if remaining <= 0:
            return self.node.fail(self._registration_timeout())
        attempt = ATTEMPT_TIMEOUT_S if len(self.addresses) == 1 else FAILOVER_ATTEMPT_S
        if not self._verified:
            return [steps.CheckScheduler(min(remaining, attempt))]
        return [steps.Register(min(remaining, attempt), remaining)]

    def _pause(self, seconds: float) -> Actions:
        return [steps.Pause(min(seconds, max(self.node.deadline - self.node.clock(), 0.0)))]

    def checked(self, event: steps.Checked) -> Actions:
        if self.node.over:
            return []
        self.unreachable = event.unreachable
        relay, self._relay_unanswered = self._relay_unanswered, ""
        if event.ok and relay:
            # The scheduler answers, the relay that the registration went through did not: the
            # relay is lost (gone, stopped or hung, however its socket takes connections).
            self._verified = True
            why = f"it did not answer this node's registration, while {self.where} answers"
            return [steps.LeaveRelay(why), *self.next_attempt()]
        said = self.report(
            f"waiting for {self.where}: {event.unreachable}"
            if event.unreachable
            else f"waiting for {self.where} to answer: it takes connections, but this node's "
            "last attempt got no answer in time (busy or overloaded? see its log)"
        )
        if not event.ok:
            self._down[self.address] = self.node.clock()
            return said + self._next_address() + self._retry_pause()
        self._verified = True
        return said + self.next_attempt()

    def unanswered(self, event: steps.Unanswered) -> Actions:
        if self.node.over:
            return []
        if event.relay_cut_off:
            # The relay could not reach the scheduler; it waits for the port for this host, at
            # the host's share of the job's tries: ask it again, probe nothing.
            self.unreachable = f"the relay cannot reach it ({event.relay_cut_off})"
            said = self.report(f"waiting for {self.where}: {self.unreachable}")
            return said + self._pause(RETRY_PAUSE_S)
        # Down, overloaded, or speaking TLS to our plaintext, or the relay gone: the check tells.
        self._verified = False
        self._relay_unanswered = event.relay
        return self._retry_pause()

    def _retry_pause(self) -> Actions:
        """The pause after an attempt that got no answer, or a probe that found no scheduler."""
        return self._pause(self.node.pace.retry_s())

    def answer_late(self, event: steps.AnswerLate) -> Actions:
        if not held(event):
            return []  # a call the deadline cut off on its way
        return [
            steps.Say(
                f"{self.where} has not answered this node's registration for "
                f"{event.waited_s:.0f} s; it answers once it has saved what the registration "
                "changes (see its log if this lasts)"
            )
        ]

    def refused(self, event: steps.Refused) -> Actions:
        if (
            event.finished
            and self.node.topology is None
            and (self.node.cluster_id or self.node.config.spare)
        ):
            return self.node.release(
                f"the job finished while this node waited to rejoin it ({event.message})"
            )
        if event.finished and self.node.finish.out:
            # The job finished: every node's finish was heard, this one's too (it reached the
            # scheduler before the connection to it broke).
            self._finish_heard()
            return [steps.Say(f"the job finished: {event.message}"), steps.Done()]
        if event.foreign and self.node.cluster_id and len(self.addresses) > 1:
            if event.relay:  # the relay's scheduler refused it: asked again directly
                why = f"the scheduler it forwards to runs another job: {event.message}"
                return [steps.LeaveRelay(why, refused=True), *self.next_attempt()]
            return self._another_job(event.message)
        if not event.transient:
            return self.node.fail(
                RegistrationRefused(f"{self.where} refused this node: {event.message}")
            )
        said: Actions = [steps.Say(f"registration refused for now: {event.message}")]
        if self._guard_said:
            said = self.report(f"waiting out the guard: {event.message}")
        self._guard_said = True
        return said + self._pause(self.node.pace.guard_s(event.retry_after_s))

    def _another_job(self, message: str) -> Actions:
        """The scheduler asked runs another job: passed over for the next in turn, said once.
        One that a standby named as its leader after it refused this node so, and refuses it
        again, leads the standby's job: no scheduler of theirs runs this node's job."""
        standby = self._named_by.pop(self.address, None)
        if standby is not None:
            return self.node.fail(
                RegistrationRefused(
                    f"the scheduler at {standby} is a standby of {self.where}, which runs another "
                    f"job, and refused this node again: {message}; no scheduler of theirs runs "
                    "this node's job"
                )
            )
        said: Actions = []
        if self.address not in self._foreign:
            left = max(self.node.deadline - self.node.clock(), 0.0)
            said.append(
                steps.Say(
                    f"{self.where} runs another job, and refused this node: {message}; this "
                    "node passes it over and tries its job's other schedulers, for up to "
                    f"{left:.0f} s more"
                )
            )
        self._foreign[self.address] = message
        if set(self.addresses) <= set(self._foreign):  # none of them runs this node's job
            refused = "; ".join(f"{address}: {why}" for address, why in self._foreign.items())
            return self.node.fail(
                RegistrationRefused(
                    f"every scheduler this node knows runs another job, and refused it ({refused})"
                )
            )
        return said + self._next_address() + self._retry_pause()

    def _finish_heard(self) -> None:
        self.node.finish.hear()
        self.node.lifecycle = Lifecycle.FINISHED

    def accepted(self, event: steps.Accepted) -> Actions:
        if self.node.over:
            return []  # finished meanwhile: the accepted stream is not read
        said: Actions = []
        if self.node.lifecycle is Lifecycle.JOINING:
            self.node.rejoined = event.rejoined
        elif self.node.topology is not None:
            said.append(
                steps.Say(
                    f"back with {self.where}, which had given this node up: it rejoins the job "
                    f"in generation {event.generation}"
                    if event.rejoined
                    else f"back with {self.where}"
                )
            )
        self.node.cluster_id = event.cluster_id
        self._down.clear()
        self._foreign.clear()
        self._named_by.clear()
        self.node.progress = (event.registered, event.expected)
        self.node.heartbeat_interval_s = (
            event.heartbeat_interval_s or self.node.heartbeat_interval_s
        )
        self.node.lifecycle = Lifecycle.FORMING if self.node.topology is None else Lifecycle.READY
        if event.spare and self.node.topology is None:
            self.node.lifecycle = Lifecycle.SPARE
            self.node.ready_by = self.node.topo_deadline = self.node.clock() + SPARE_WAIT_S
            said.append(
                steps.Say(
                    f"accepted by {self.where} as a spare: this node waits, without a rank, to "
                    "take a failed worker's"
                )
            )
        return [*said, steps.Watch(self.node.heartbeat_interval_s)]

    def not_leader(self, event: steps.NotLeader) -> Actions:
        now = self.node.clock()
        if self.node.lifecycle in (Lifecycle.FORMING, Lifecycle.SPARE, Lifecycle.READY):
            # The stream ended with it (the leader handed over, or stepped down): registering
            # again, within a reconnect window from now (a spare waited longer than its start's
            # deadline, as it may), to the new leader; a spare as a spare again.
            self.lost = "the scheduler became a standby"
            self.reconnect_window(now)
            self.node.lifecycle = Lifecycle.RECONNECTING
        lately_down = {a for a, when in self._down.items() if now - when < DOWN_FOR_S}
        leader = leader_to_follow(self.address, event.leader, lately_down)
        if leader is None:
            # No leader yet (an election under way), or one just found down (its lease has not
            # ended yet): ask again shortly, the next scheduler when there are several.
            moved = self._next_address() if not event.leader else []
            return moved + self._pause(max(event.retry_after_s, RETRY_PAUSE_S))
        if leader in self._foreign:
            self._named_by[leader] = self.address
        said: Actions = []
        if leader != self._announced:
            self._announced = leader
            said.append(steps.Say(f"{self.where} is a standby; following the leader at {leader}"))
        self.address = leader
        # A leader found down before is probed before it is registered with.
        self._verified = event.verified and leader not in self._down
        return [*said, steps.Follow(leader), *self.next_attempt()]

    def _next_address(self) -> Actions:
        """Follow the next scheduler address in turn (none with only one)."""
        if len(self.addresses) == 1:
            return []
        self.address = next_in_turn(self.addresses, self.address)
        self._verified = False  # probed first: a down one is passed over at once
        return [steps.Follow(self.address)]

    def _registration_timeout(self) -> ClusterError:
        """The error of a registration deadline passed (`_timeout_error`), and what each
        scheduler passed over as another job's said."""
        error = self._timeout_error()
        if not self._foreign:
            return error
        refused = "; ".join(
            f"the scheduler at {address} runs another job, and refused this node: {message}"
            for address, message in self._foreign.items()
        )
        return type(error)(f"{error}; {refused}")

    def _timeout_error(self) -> ClusterError:
        """The error of a registration deadline passed: the scheduler's last refusal or hold, or
        why it could not be reached; the address is doubted only when nothing answered."""
        told = self.node.answers.why(self.node.clock())
        if self.node.lifecycle is Lifecycle.JOINING:
            hint = (
                told
                or self.unreachable
                or "is it running, and are MS_SCHED_HOST / MS_SCHED_PORT right?"
            )
            return TopologyTimeoutError(f"{self.where} did not accept this node in time: {hint}")
        why = f" ({self.unreachable})" if self.unreachable else ""
        lost = self.lost or "it did not take this node back"
        if told:  # it answers: not unreachable
            within = "" if self.node.topology is None else f" within {self._window()}"
            return SchedulerUnreachableError(
                f"{self.where} did not take this node back{within} ({lost}): {told}"
            )
        if self.node.topology is None:
            return SchedulerUnreachableError(f"{self.where} is unreachable: {lost}{why}")
        return SchedulerUnreachableError(
            f"{self.where} is unreachable: {lost}, and it did not come back within "
            f"{self._window()}{why}{self._bring_back(late=True)}"
        )

    def _window(self) -> str:
        """The reconnect window of a formed job's node, as a sentence names it."""
        if self.node.recovery:
            return (
                f"{self._window_s:g} s (the longer of MS_NODE_TIMEOUT and MS_TOPO_TIMEOUT, "
                "recovery on)"
            )
        return f"MS_NODE_TIMEOUT={self._window_s:g} s"

    def _bring_back(self, *, late: bool = False) -> str:
        """What brings the scheduler back for a formed job's node (with recovery), or, `late`,
        the job once this node has given the scheduler up."""
        if not self.node.recovery:
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
        if self.node.lifecycle is not Lifecycle.RECONNECTING or self.node.topology is None:
            return ""
        left = max(self.node.deadline - self.node.clock(), 0.0)
        return (
            f"{self.where} is away ({self.lost or 'it did not take this node back'}), and this "
            f"node waits {left:.0f} s more for it, {self._window()} in all{self._bring_back()}"
        )

    def reconnect_window(self, now: float) -> float:
        """Set the deadline of registering again from `now`; the window's length."""
        if self.node.topology is None:
            # Still forming: MS_TOPO_TIMEOUT bounds everything, and a scheduler that accepted us
            # and then vanished gets MS_NODE_TIMEOUT to come back, like a formed job's.
            self.node.deadline = min(self.node.topo_deadline, now + self.node.config.node_timeout_s)
        else:
            self.node.deadline = now + self.reconnect_window_s
        self._window_s = self.node.deadline - now
        return self._window_s

    def report(self, message: str) -> Actions:
        """A waiting message now and then, not on every poll."""
        now = self.node.clock()
        if now < self._report_next:
            return []
        self._report_next = now + REPORT_EVERY_S
        return [steps.Say(f"{message} ({now - self._report_since:.0f} s)")]
