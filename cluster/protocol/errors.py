"""Every user-facing failure of `cluster` is a ClusterError.

Messages say what was wrong, with the value and the rule, and what to do. An uncaught
ClusterError is printed as one line without a traceback (see `cluster._excepthook`).
"""

from __future__ import annotations


class ClusterError(Exception):
    """Base of all errors raised by `cluster`."""


class ConfigError(ClusterError):
    """A setting (environment variable, file, argument) has a bad value."""


class TLSConfigError(ConfigError):
    """The TLS configuration or one of its files is unusable."""


class NotInitializedError(ClusterError):
    """An API call that needs `cluster.init()` came before it."""


class RegistrationRefused(ClusterError):
    """The scheduler refused this node for a reason that waiting cannot clear."""


class TopologyTimeoutError(ClusterError):
    """Not every node registered within MS_TOPO_TIMEOUT."""


class SchedulerUnreachableError(ClusterError):
    """The scheduler could not be reached, or stopped answering, for too long."""


class JobFailedError(ClusterError):
    """The job was stopped: a node died, or the scheduler gave up."""


class CollectiveError(ClusterError):
    """A control-plane collective or key-value operation could not complete."""


class PeerFailedError(CollectiveError):
    """A collective could not complete because a peer died; with recovery on, the job goes on
    and the peer's rank comes back in a new generation."""


class AccessDeniedError(CollectiveError):
    """The scheduler refused a call of this process: it did not prove that it is the member it
    speaks for (node credential, job secret, certificate), or it is no longer a member."""


class CapacityError(CollectiveError):
    """The scheduler refused a call that would make it hold more than a cap allows (the key-value
    store's CLUSTER_KV_MAX_BYTES / CLUSTER_KV_MAX_KEYS, open collectives'
    CLUSTER_COLLECTIVE_MAX_BYTES); the job goes on."""


class StateFileError(ClusterError):
    """A recovery state file is torn, truncated, foreign or of a newer format."""


class CheckpointError(ClusterError):
    """A checkpoint could not be saved, or a checkpoint file is missing, torn or corrupt."""


class NotLeaderError(ClusterError):
    """This scheduler does not lead the job (a standby, or a leader that lost its lease): ask
    the leader, whose address `leader` names ("" while none leads)."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader
