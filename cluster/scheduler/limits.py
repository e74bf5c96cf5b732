"""Open files: the scheduler holds one connection, so one file descriptor, per node.

Many systems start processes with a soft limit of 1,024 open files and a far higher hard limit
that any process may raise itself to. A scheduler left at 1,024 cannot hold a job of 1,024 nodes,
and a few hundred stray connections are enough to keep the real nodes out. So the scheduler
raises its soft limit to the hard one at start and says how many nodes that leaves room for.
"""

from __future__ import annotations

import resource
from pathlib import Path

from cluster.protocol.value import frozen

# Descriptors that are not node connections: grpc's own (epoll, wakeup fds, the listener), the
# recovery files and lock, logs, the launcher's and `mscluster status`'s connections.
HEADROOM = 100
_NR_OPEN = Path("/proc/sys/fs/nr_open")  # Linux's ceiling for RLIMIT_NOFILE


@frozen
class OpenFiles:
    before: int  # the soft limit the process started with
    limit: int  # the soft limit now
    hard: int
    error: str = ""  # why it could not be raised, if it could not

    @property
    def nodes(self) -> int:
        """About how many node connections the limit leaves room for."""
        return max(self.limit - HEADROOM, 0)

    def describe(self) -> str:
        raised = f" (raised from {self.before})" if self.limit > self.before else ""
        line = f"open-files limit {self.limit}{raised}: room for about {self.nodes} nodes"
        if self.error:
            line += f"; it could not be raised to the hard limit {self.hard}: {self.error}"
        return line

    def too_low(self, expected_nodes: int) -> str | None:
        """A warning when the job needs more connections than the limit allows."""
        if expected_nodes <= self.nodes:
            return None
        return (
            f"this job has {expected_nodes} nodes, but the open-files limit of {self.limit} "
            f"(hard limit {self.hard}) leaves room for about {self.nodes} connections: start "
            "the workers behind a relay per host (`mscluster run` does for 2 or more a host; "
            "`mscluster relay` and CLUSTER_RELAY otherwise), which holds one connection for "
            "all of them, or raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, "
            "Kubernetes/docker --ulimit nofile=), or a job of direct workers may never form"
        )


def raise_open_files() -> OpenFiles:
    """Raise the soft RLIMIT_NOFILE to the hard limit (Linux's nr_open when unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(_NR_OPEN.read_text())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and soft >= target:
        return OpenFiles(soft, soft, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        return OpenFiles(soft, soft, hard, str(exc))
    return OpenFiles(soft, target, hard)
