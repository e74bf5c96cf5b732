"""`cluster`: scheduler/worker networking for distributed training without OpenMPI.

The public API. Start every process of a job with the MS_* launch environment and call
`cluster.init()`; see the README.
"""

# The release; pyproject.toml reads it from here (`mscluster --version` shows the installed one).
__version__ = "0.1.0"

from cluster.api import excepthook as _excepthook
from cluster.api.collective import (
    KeyValueStore,
    allgather_object,
    allreduce,
    barrier,
    broadcast_object,
    kv_store,
)
from cluster.api.runtime import (
    finalize,
    get_generation,
    get_group_size,
    get_local_rank,
    get_local_size,
    get_node_id,
    get_peers,
    get_rank,
    get_rollback_step,
    init,
    is_initialized,
    is_rejoin,
    set_ps_context,
    wait_for_generation,
)
from cluster.api.training import TrainingLoop
from cluster.protocol.errors import (
    AccessDeniedError,
    CapacityError,
    CheckpointError,
    ClusterError,
    CollectiveError,
    ConfigError,
    JobFailedError,
    NotInitializedError,
    PeerFailedError,
    RegistrationRefused,
    SchedulerUnreachableError,
    TLSConfigError,
    TopologyTimeoutError,
)
from cluster.protocol.topology import Peer
from cluster.transport import grpc_log as _grpc_log

_excepthook.install()
# Before anything imports grpc (nothing above does): its log lines are errors only, unless the
# user chose otherwise.
_grpc_log.quiet_by_default()


def __getattr__(name: str) -> object:
    # The checkpoint classes import numpy: only for the programs that use them, so that
    # `import cluster` stays quick for those that do not.
    if name in ("CheckpointConfig", "CheckpointManager"):
        from cluster.api import checkpoint  # noqa: PLC0415

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")


__all__ = [
    "AccessDeniedError",
    "CapacityError",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "ClusterError",
    "CollectiveError",
    "ConfigError",
    "JobFailedError",
    "KeyValueStore",
    "NotInitializedError",
    "Peer",
    "PeerFailedError",
    "RegistrationRefused",
    "SchedulerUnreachableError",
    "TLSConfigError",
    "TopologyTimeoutError",
    "TrainingLoop",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast_object",
    "finalize",
    "get_generation",
    "get_group_size",
    "get_local_rank",
    "get_local_size",
    "get_node_id",
    "get_peers",
    "get_rank",
    "get_rollback_step",
    "init",
    "is_initialized",
    "is_rejoin",
    "kv_store",
    "set_ps_context",
    "wait_for_generation",
]
