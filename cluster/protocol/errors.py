"""Every failure of `cluster` is a ClusterError: the one error tree of the package.

Messages say what was wrong, with the value and the rule, and what to do. An uncaught
ClusterError is printed as one line without a traceback (see `cluster.api.excepthook`).

    ClusterError
      ConfigError                 a setting has a bad value
        TLSConfigError
      NotInitializedError         an API call before cluster.init()
      RegistrationRefused         the scheduler refused this node for good
      TopologyTimeoutError        the job did not form within MS_TOPO_TIMEOUT
      SchedulerUnreachableError   the scheduler is gone, or silent, for too long
      ReadRefusedError            a reader of the job did not prove its secret
      NotLeaderError              this scheduler is a standby; the leader is elsewhere
      JobFailedError              the job was stopped
      CollectiveError             a collective or key-value call could not complete
        CollectiveMismatchError   ranks called different collectives as the same one
        PeerFailedError
        AccessDeniedError         the caller is not (or no longer) the member it speaks for
          NotAuthenticatedError
          UnknownNodeError
          EvictedError
        CapacityError             over a cap of what the scheduler holds
      BadRequestError             a request without what its call needs
      StateFileError              the recovery state cannot be used
        SnapshotError
      CheckpointError             a checkpoint cannot be saved or loaded
        CorruptCheckpointError
      JobTimeoutError             cluster.testing waited in vain
      NetemUnavailableError       cluster.testing: no delay or loss injection here

The scheduler sends each failure of a call as a gRPC status code with the class's name in the
trailing metadata; `cluster.transport.status` holds both directions of that table.
"""

from __future__ import annotations


class ClusterError(Exception):
    """Base of all errors raised by `cluster`."""


class ConfigError(ClusterError):
    """A setting (environment variable, file, argument) has a bad value."""


class EventFieldError(ClusterError, ValueError):
    """A line of the event log whose field holds what its kind does not allow (a ValueError,
    as a line that is no event at all)."""


class TLSConfigError(ConfigError):
    """The TLS configuration or one of its files is unusable."""


class NotInitializedError(ClusterError):
    """An API call that needs `cluster.init()` came before it."""


class RegistrationRefused(ClusterError):
    """The scheduler refused this node for a reason that waiting cannot clear."""


class TopologyTimeoutError(ClusterError):
    """Not every node registered within MS_TOPO_TIMEOUT."""


class CrowdedError(ClusterError):
    """The scheduler turned a call away for now: too many calls of its peer (or of everyone)
    were waiting for their request. Not an answer: the caller tries again."""


class SchedulerUnreachableError(ClusterError):
    """The scheduler could not be reached, or stopped answering, for too long."""


class ReadRefusedError(ClusterError):
    """The scheduler refused to show the job (Status, WatchEvents) to a reader that did not
    prove the job secret (docs/design/security.md): the reader needs the job's secret file."""


class NotLeaderError(ClusterError):
    """The scheduler that answered is a standby: the job's leader is at `leader` ("host:port",
    empty while none leads). A worker follows it at once; nothing is wrong."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class JobFailedError(ClusterError):
    """The job was stopped: a node died, or the scheduler gave up."""


class ReleasedError(ClusterError):
    """The job ended well while this process waited for a rank (a spare, or a restarted node
    waiting out its guard): it has nothing left to do, and exits 0."""


class CollectiveError(ClusterError):
    """A control-plane collective or key-value operation could not complete."""


class CollectiveMismatchError(CollectiveError):
    """Two ranks called different collectives (or broadcasts from different roots) as the same
    one: every rank must call the same collectives in the same order. The scheduler's refusal
    says so by its reason (`ExchangeRefusal` on the wire), not by its words."""


class PeerFinishedError(CollectiveError):
    """A collective refused because a rank of the generation has finished (called
    cluster.finalize()): no round of the generation completes any more. The scheduler's refusal
    says so by its reason (`ExchangeRefusal` on the wire); a worker that reads no reason raises
    a CollectiveError, as it always did."""


class PeerFailedError(CollectiveError):
    """A collective could not complete because a peer died; with recovery on, the job goes on
    and the peer's rank comes back in a new generation."""


class AccessDeniedError(CollectiveError):
    """The scheduler refused a call of this process: it did not prove that it is the member it
    speaks for (node credential, job secret, certificate), or it is no longer a member."""


class NotAuthenticatedError(AccessDeniedError):
    """A call speaks for a member without that member's node credential."""


class RegistrationPendingError(ClusterError):
    """A call proof of a node that has not registered with this scheduler yet (it restarted or
    took over): not an answer about the call; the node registers again and repeats it."""


class UnknownNodeError(AccessDeniedError):
    """A stream or call named a node id / incarnation that is not a current member."""


class EvictedError(AccessDeniedError):
    """This node's stream was ended by the scheduler: the node was removed from the job
    (replaced by a new process, silent while the job formed, or failed with recovery on) and
    must register again to come back."""


class CapacityError(CollectiveError):
    """The scheduler refused a call that would make it hold more than a cap allows (the key-value
    store's CLUSTER_KV_MAX_BYTES / CLUSTER_KV_MAX_KEYS, open collectives'
    CLUSTER_COLLECTIVE_MAX_BYTES); the job goes on."""


class FellBehindError(ClusterError):
    """A WatchEvents stream did not read its events fast enough (over the backlog's cap)."""


class BadRequestError(ClusterError):
    """A request lacks what its call needs (not sent by this package's own workers)."""


class StateFileError(ClusterError):
    """A recovery state file is torn, truncated, foreign or of a newer format."""


class SnapshotError(StateFileError):
    """A saved snapshot cannot be restored into this scheduler (the message says why and what
    to do). Never transient: read again, the same state is refused the same way."""


class CheckpointError(ClusterError):
    """A checkpoint could not be saved, or a checkpoint file is missing, torn or corrupt."""


class CorruptCheckpointError(CheckpointError):
    """What is wrong with a checkpoint's content; the reader names the file."""


class PeerStateError(CheckpointError):
    """One live peer could not give a checkpoint (killed, cut off, no such step, a bad
    checksum); the fetcher asks the next one. The message says why."""


class NoPeerStateError(CheckpointError):
    """No live peer gave the checkpoint; `failures` holds each peer's answer, `message` (when
    given) says it for the user."""

    def __init__(self, failures: list[str], message: str = "") -> None:
        super().__init__(message or "; ".join(failures) or "no live peer serves checkpoints")
        self.failures = failures


class JobTimeoutError(ClusterError):
    """A `cluster.testing` action (a LocalJob's, or `wait_until`) did not see its effect in
    time."""


class NetemUnavailableError(ClusterError):
    """The kernel has no netem queueing discipline: no delay or loss injection."""


class FencedError(StateFileError):
    """A write to the state store refused because this process no longer holds the store (its
    lease ended, another scheduler leads), or because what is stored is not what it last read:
    it must stop acting on its view of the job."""


class EtcdUnavailable(StateFileError):
    """No member of the etcd cluster answered."""


class EtcdRefused(StateFileError):
    """etcd answered but refused this client: authentication required, a wrong user or password,
    or no permission on the job's prefix. Retrying cannot help; the operator must."""


class NotLeaderAnswer(SchedulerUnreachableError):
    """The scheduler asked for the job's status stands by: it has no job of its own; `leader`
    has ("" none leads right now)."""

    def __init__(self, message: str, leader: str) -> None:
        super().__init__(message)
        self.leader = leader


class MissedTableChange(ClusterError):
    """A change of the peer table (a delta) that does not follow the table this node holds: it
    reconnects, and gets the whole table."""


class SharedTableError(MissedTableChange):
    """A host's shared peer table file (`cluster.transport.table_file`) that is not the table
    asked for: another table's, short, or garbled. The node asks for the table's bytes."""
