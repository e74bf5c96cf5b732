"""The process-wide job membership behind `cluster.init()` and friends."""

from __future__ import annotations

import atexit
import logging
import sys
import threading

from cluster import _excepthook
from cluster import config as config_module
from cluster.config import ClusterConfig, Role
from cluster.errors import ClusterError, NotInitializedError
from cluster.scheduler import server as scheduler_server
from cluster.topology import Peer, Topology
from cluster.worker.identity import make_identity
from cluster.worker.session import WorkerSession

_lock = threading.Lock()
_session: WorkerSession | None = None


def session() -> WorkerSession:
    if _session is None or _session.topology is None:
        raise NotInitializedError(
            "this needs the job to be formed: call cluster.init() first (in every worker)"
        )
    return _session


def topology() -> Topology:
    topo = session().topology
    assert topo is not None
    return topo


def init(config: ClusterConfig | None = None) -> None:
    """Join the job described by the MS_* environment.

    Worker (MS_WORKER, MS_PSERVER): returns once every node has registered and this process has
    its rank and the peer table. Scheduler (MS_SCHED): serves the job until it ends and then
    exits the process, 0 when every worker finished, 1 otherwise.
    """
    global _session
    cfg = config if config is not None else config_module.from_env()
    if cfg.role is Role.SCHEDULER:
        _run_scheduler(cfg)
    with _lock:
        if _session is not None:
            raise ClusterError("cluster.init() was already called in this process")
        identity = make_identity(cfg.node_id, cfg.sched_host, cfg.sched_port)
        _session = WorkerSession(cfg, identity)
        atexit.register(_finalize_at_exit)
    _session.start()


def _run_scheduler(cfg: ClusterConfig) -> None:
    configure_logging("scheduler")
    sys.exit(scheduler_server.run(cfg))


def configure_logging(who: str) -> None:
    """Log `cluster` messages to stderr, unless the program configured logging itself."""
    logger = logging.getLogger("cluster")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"cluster[{who}]: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def finalize() -> None:
    """Tell the scheduler this worker is done and close the connection. Safe to call twice."""
    _close(finished=True)


def _finalize_at_exit() -> None:
    # A program that dies of an uncaught exception has not finished its part of the job: close
    # without Finish, so the scheduler sees a failure instead of a success.
    _close(finished=not _excepthook.crashed)


def _close(*, finished: bool) -> None:
    global _session
    with _lock:
        current, _session = _session, None
    if current is not None:
        current.finalize(finished=finished)


def is_initialized() -> bool:
    return _session is not None and _session.topology is not None


def get_rank() -> int:
    return topology().rank


def get_group_size() -> int:
    return topology().size


def get_local_rank() -> int:
    return topology().local_rank


def get_local_size() -> int:
    return topology().local_size


def get_peers() -> list[Peer]:
    return list(topology().peers)


def get_generation() -> int:
    return topology().generation


def get_node_id() -> str:
    return session().identity.node_id


def is_rejoin() -> bool:
    """True when this process took the place of a failed one in a running job."""
    return session().agent.rejoined
