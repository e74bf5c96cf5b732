"""`cluster`: scheduler/worker networking for distributed training without OpenMPI.

The public API. Start every process of a job with the MS_* launch environment and call
`cluster.init()`; see the README.
"""

from cluster import _excepthook
from cluster._runtime import (
    finalize,
    get_generation,
    get_group_size,
    get_local_rank,
    get_local_size,
    get_node_id,
    get_peers,
    get_rank,
    init,
    is_initialized,
    is_rejoin,
    set_ps_context,
)
from cluster.collective import (
    KeyValueStore,
    allgather_object,
    barrier,
    broadcast_object,
    kv_store,
)
from cluster.errors import (
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
from cluster.topology import Peer

_excepthook.install()

__all__ = [
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
    "allgather_object",
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
    "init",
    "is_initialized",
    "is_rejoin",
    "kv_store",
    "set_ps_context",
]
