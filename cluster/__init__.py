"""`cluster`: scheduler/worker networking for distributed training without OpenMPI.

The public API. Start every process of a job with the MS_* launch environment and call
`cluster.init()`; see docs/guide/training-script.md.
"""

import importlib
from typing import TYPE_CHECKING

from cluster.api import excepthook as _excepthook
from cluster.protocol import version as _version
from cluster.protocol.errors import (
    AccessDeniedError,
    CapacityError,
    CheckpointError,
    ClusterError,
    CollectiveError,
    CollectiveMismatchError,
    ConfigError,
    JobFailedError,
    NotInitializedError,
    PeerFailedError,
    PeerFinishedError,
    RegistrationRefused,
    SchedulerUnreachableError,
    TLSConfigError,
    TopologyTimeoutError,
)
from cluster.transport import grpc_log as _grpc_log
from cluster.transport.lazy_protobuf import defer_pure_python_messages as _defer_protobuf

# The release, kept in `cluster.protocol.version` beside the protocol's revision (pyproject.toml
# reads it there; `mscluster --version` shows the installed one).
__version__ = _version.VERSION

if TYPE_CHECKING:
    from cluster.api.checkpoint import CheckpointManager
    from cluster.api.checkpoint_config import CheckpointConfig
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
    from cluster.protocol.topology import Peer

_defer_protobuf()  # before anything imports protobuf: see cluster.transport.lazy_protobuf
_excepthook.install()
# Before anything imports grpc (nothing above does): its log lines are errors only, unless the
# user chose otherwise.
_grpc_log.quiet_by_default()

# Where the rest of the API lives, imported on first use (PEP 562): a process imports only what
# its role touches. The scheduler (`python -m cluster scheduler`, or a script's cluster.init() as
# MS_SCHED) never imports the collectives or the training loop, a worker never numpy unless it
# checkpoints (issue 26, "Cheap to start"; tests/unit/test_import_budget.py holds it to that).
_LAZY_FROM = {
    "cluster.api.runtime": (
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
        "set_ps_context",
        "wait_for_generation",
    ),
    "cluster.api.collective": (
        "KeyValueStore",
        "allgather_object",
        "allreduce",
        "barrier",
        "broadcast_object",
        "kv_store",
    ),
    "cluster.api.training": ("TrainingLoop",),
    "cluster.api.checkpoint": ("CheckpointManager",),
    "cluster.api.checkpoint_config": ("CheckpointConfig",),
    "cluster.protocol.topology": ("Peer",),
}
_LAZY = {name: module for module, names in _LAZY_FROM.items() for name in names}


def __getattr__(name: str) -> object:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AccessDeniedError",
    "CapacityError",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "ClusterError",
    "CollectiveError",
    "CollectiveMismatchError",
    "ConfigError",
    "JobFailedError",
    "KeyValueStore",
    "NotInitializedError",
    "Peer",
    "PeerFailedError",
    "PeerFinishedError",
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
