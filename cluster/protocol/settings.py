"""The job's parameters as the scheduler uses them: one frozen object, built once.

`cluster.protocol.environment.job_settings` turns the launch environment (`ClusterConfig`) into it;
the state machine, the scheduler's core, its server and the restore of a saved job all take this one
object, so a parameter is added in one place and cannot be copied wrongly on the way."""

from __future__ import annotations

from dataclasses import field

from cluster.protocol.config import Limits, silence_limit
from cluster.protocol.records import NodeRole
from cluster.protocol.value import frozen


@frozen
class JobSettings:
    """What the scheduler of one job must know: the job's size, its timeouts, and its bounds."""

    worker_num: int  # MS_WORKER_NUM
    server_num: int  # MS_SERVER_NUM
    node_timeout_s: float  # MS_NODE_TIMEOUT: heartbeat silence, and the re-registration guard
    topo_timeout_s: float  # MS_TOPO_TIMEOUT: forming, and a failed node's rejoin window
    heartbeat_interval_s: float  # told to every node when it registers
    heartbeat_enabled: bool = True  # MS_DISABLE_HEARTBEAT unset
    recovery: bool = False  # MS_ENABLE_RECOVERY
    # With a job secret, registrations must prove it (CLUSTER_JOB_SECRET[_FILE]).
    job_secret: bytes | None = field(default=None, repr=False)
    limits: Limits = field(default_factory=Limits)

    @property
    def silence_limit_s(self) -> float:
        """How long a live node may go unheard before it is taken for hung (`silence_limit`)."""
        return silence_limit(self.node_timeout_s, self.heartbeat_interval_s)

    @property
    def expected(self) -> int:
        """Every node of the job: workers and parameter servers."""
        return self.worker_num + self.server_num

    def space(self, role: NodeRole) -> int:
        """How many ranks `role` has (its nodes' number)."""
        return self.server_num if role is NodeRole.SERVER else self.worker_num

    def describe_counts(self) -> str:
        return f"MS_WORKER_NUM={self.worker_num}, MS_SERVER_NUM={self.server_num}"
