"""What the worker core is told, and what it answers: plain data, no grpc, no asyncio.

The agent (`cluster.worker.agent`) turns what happened on the wire into an event below, steps
the core with it (`WorkerCore.step`), and carries out the actions it gets back, in order. The
events from the scheduler's stream arrive converted from protobuf (`cluster.worker.convert`).
"""

from __future__ import annotations

from dataclasses import field

from cluster.protocol.errors import ClusterError
from cluster.protocol.records import NodeFailedEvent, ProgressEvent, ShutdownEvent
from cluster.protocol.topology import Topology
from cluster.protocol.value import frozen

# -- events: what happened ---------------------------------------------------------------------


@frozen
class Start:
    """Join the job. `verified`: the scheduler's certificate need not be checked before the first
    attempt (no TLS, no CRL, or checked a moment ago). `direct`: this node connects to the
    scheduler itself (no relay between), so it waits for the scheduler's port to take
    connections before it registers (`AwaitListening`)."""

    verified: bool = True
    direct: bool = False


@frozen
class ListeningAwaited:
    """`AwaitListening` is over. `refused`: every connection was refused for all of its time
    (nothing listens there yet), and `why`, in words; not refused: the port took one, or the
    wait could not tell (a timeout, no route), for the registration to find out."""

    refused: bool = False
    why: str = ""


@frozen
class Checked:
    """The scheduler was probed (`CheckScheduler`): whether it answers in this node's protocol,
    and why it cannot be reached ("" when it can)."""

    ok: bool
    unreachable: str = ""


@frozen
class PauseOver:
    """The pause of a `Pause` action has passed."""


@frozen
class Accepted:
    """The scheduler accepted the registration; its stream is open."""

    cluster_id: str
    rejoined: bool
    generation: int
    registered: int
    expected: int
    heartbeat_interval_s: float = 0.0  # 0: keep the one this node has
    spare: bool = False  # accepted as a spare: no rank until a topology names this node


@frozen
class Refused:
    """The scheduler refused the registration; `transient` ones (the guard) clear in
    `retry_after_s`."""

    message: str
    transient: bool = False
    retry_after_s: float = 0.0
    finished: bool = False  # the job finished well (REFUSAL_JOB_FINISHED)
    # The registration's challenge was stale (REFUSAL_STALE_CHALLENGE): ask for a new one.
    stale_challenge: bool = False
    # The scheduler runs another job than the one this node's cluster id names
    # (REFUSAL_FOREIGN_JOB).
    foreign: bool = False
    # The host's relay the refusal came through: the scheduler that refused is the one the
    # relay forwards to, whichever address this node asked.
    relay: str = ""


@frozen
class Unanswered:
    """A registration attempt got no answer: the scheduler is down, busy, or speaks another
    protocol; or the attempt was cut off. `relay_cut_off`: the host's relay ended it, unable
    to reach the scheduler, and why (it waits for the scheduler's port for its host). `relay`:
    the host's relay it went through, which neither answered nor cut it off, and went silent
    (or its connection down) too."""

    relay_cut_off: str = ""
    relay: str = ""


@frozen
class AnswerLate:
    """The scheduler took the connection and has not answered the registration for a while."""

    waited_s: float


@frozen
class NotLeader:
    """The scheduler that answered is a standby; the job's leader is at `leader` ("host:port",
    "" while none leads)."""

    leader: str
    verified: bool = True  # as in Start, for the leader's address
    retry_after_s: float = 0.0  # with no leader named: ask a scheduler again after this long


# The scheduler's own events, as its state machine makes them, reach the core unchanged:
# Progress(registered, expected), NodeFailed(rank, node_id, reason, generation) and
# Shutdown(ok, reason) are the records of cluster.protocol.records.
Progress = ProgressEvent
NodeFailed = NodeFailedEvent
Shutdown = ShutdownEvent


@frozen
class TopologyReady:
    topology: Topology


@frozen
class Unplaced:
    """A topology that does not name this node: what a spare hears until it is promoted."""

    generation: int


@frozen
class StreamLost:
    """The event stream ended or broke; `silent_s`: nothing had arrived on it for that long (the
    scheduler hung, or the network is cut), None: it broke or closed. `relay`: the host's relay
    the stream went through, which answers all the same (the silence is beyond it), and through
    which the node registers again."""

    reason: str
    silent_s: float | None = None
    verified: bool = True  # as in Start, for the registration that follows
    relay: str = ""


@frozen
class Stalled:
    """This process did not run for `seconds`, up to now (stopped, starved of CPU, or its main
    thread holding Python's GIL): its event loop's timer ran that late."""

    seconds: float


@frozen
class Fatal:
    """Something the shell found ends the job for this node (a registration rejected by a status
    code, a malformed answer, a topology without this node)."""

    error: ClusterError


@frozen
class DeadlinePassed:
    """The time the core gave for the topology to arrive (`WorkerCore.ready_by`) has passed."""


@frozen
class FinishSent:
    """The owner tells the scheduler this node is done: the core answers `SendFinish` when a
    Finish is worth sending, and nothing when it is not (the node never joined, or failed)."""


@frozen
class FinishAnswered:
    """The answer to this node's Finish: `heard`, or not (`timed_out`: no answer within
    `waited_s`; a Finish cancelled by its owner is not heard either)."""

    heard: bool
    timed_out: bool = False
    waited_s: float = 0.0
    details: str = ""


@frozen
class FinishFailed:
    """This node's Finish call failed with the status `code` (its name: "UNAVAILABLE",
    "DEADLINE_EXCEEDED", ...) and `details`; `stream_up`: this node's event stream was being
    read when it did."""

    code: str
    details: str = ""
    stream_up: bool = False


@frozen
class FinishRetryDue:
    """The pause of a `RetryFinish` has passed, or the wait of a `HoldFinish` is over."""


@frozen
class FinishCounted:
    """While this node's Finish was held, the scheduler's saved state, where this node can read
    it, showed the Finish counted (`evidence`, in words): the scheduler saves a finish before it
    answers it, so it was heard though its answer was lost."""

    evidence: str


@frozen
class CallCutOff:
    """A call for the user was cut off by the scheduler or the connection going away."""


@frozen
class Close:
    """The owner closes the agent."""


Event = (
    Start
    | ListeningAwaited
    | Checked
    | PauseOver
    | Accepted
    | Refused
    | Unanswered
    | AnswerLate
    | NotLeader
    | Progress
    | TopologyReady
    | Unplaced
    | NodeFailed
    | Shutdown
    | StreamLost
    | Stalled
    | Fatal
    | DeadlinePassed
    | FinishSent
    | FinishAnswered
    | FinishFailed
    | FinishRetryDue
    | FinishCounted
    | CallCutOff
    | Close
)

# -- actions: what to do -----------------------------------------------------------------------


@frozen
class Say:
    """Print this line for the user."""

    text: str


@frozen
class CheckScheduler:
    """Probe whether the scheduler answers in this node's protocol; then step `Checked`."""

    timeout_s: float


@frozen
class AwaitListening:
    """Wait about `timeout_s` until the scheduler's port takes a TCP connection, trying it
    every `every_s` as long as it refuses them; then step `ListeningAwaited`. A refused wait
    ends `every_s` after its last try (up to `every_s` past `timeout_s`), so that waits one
    after another keep the pace. Cheap on both ends (a refused connection is the kernel's
    answer), and it finds a scheduler that starts listening within milliseconds, where gRPC's
    reconnect backoff, 100 ms at least, would find it up to 100 ms late."""

    timeout_s: float
    every_s: float


@frozen
class Register:
    """Send a registration now: give up on reaching the scheduler after `attempt_s`, and on its
    answer, once connected, after `answer_s`; then step its outcome."""

    attempt_s: float
    answer_s: float


@frozen
class LeaveRelay:
    """The host's relay took this node's calls and answered none (`why`): talk to the scheduler
    directly from now on, naming the relay in one line. `refused`: the relay answers, and the
    scheduler it forwards to refused this node as another job's: the node goes back through
    the relay only once its stream runs again (`cluster.worker.scheduler_link.Route`)."""

    why: str
    refused: bool = False


@frozen
class Pause:
    """Wait this long, then step `PauseOver`."""

    seconds: float


@frozen
class Follow:
    """Talk to the scheduler at `address` from now on (the leader)."""

    address: str


@frozen
class Watch:
    """Read the accepted stream, sending heartbeats every `heartbeat_interval_s`."""

    heartbeat_interval_s: float


@frozen
class Deliver:
    """The job's topology is this (`new_generation`: a new one, after a rejoin)."""

    topology: Topology = field(repr=False)
    new_generation: bool = False


@frozen
class PeerFailed:
    """A peer of `generation` failed: collectives of that generation cannot complete."""

    generation: int


@frozen
class Fail:
    """The job is over for this node with `error`: report it (once, ever)."""

    error: ClusterError


@frozen
class Released:
    """The job ended well while this node waited for a rank: it exits 0 (a `ReleasedError`
    from `start`)."""

    error: ClusterError


@frozen
class Done:
    """The stream has said its last word: stop reading it."""


@frozen
class SendFinish:
    """Send this node's Finish and wait up to `timeout_s` for the answer; then step
    `FinishAnswered(heard=True)` or `FinishFailed`."""

    timeout_s: float


@frozen
class RetryFinish:
    """Wait `after_s`, then step `FinishRetryDue` (the Finish is sent again)."""

    after_s: float


@frozen
class HoldFinish:
    """Wait until this node is accepted again (a `Watch`) or the job is over for it (a `Fail`,
    `Released` or `Done`), at most `timeout_s`; then step `FinishRetryDue` (the Finish held
    meanwhile is sent, or held on, or given up). Meanwhile, with recovery, look at the
    scheduler's saved state where this node can read it (beside its own record in
    MS_RECOVERY_PATH): once it shows the Finish counted, step `FinishCounted` instead."""

    timeout_s: float


@frozen
class RetryCall:
    """Make the cut-off call again after this pause (the caller's outcome: the agent's
    interpreter hands it back to the call)."""

    pause_s: float


@frozen
class AwaitFatal:
    """The cut-off call fails: wait up to `wait_s` for the failure the stream is about to
    report, and raise that (or the call's own error)."""

    wait_s: float


Action = (
    Say
    | AwaitListening
    | CheckScheduler
    | Register
    | LeaveRelay
    | Pause
    | Follow
    | Watch
    | Deliver
    | PeerFailed
    | Fail
    | Released
    | Done
    | SendFinish
    | RetryFinish
    | HoldFinish
    | RetryCall
    | AwaitFatal
)
