"""Where this host's part of a job comes from: the options as typed, else the allocation a
workload manager made (Slurm), else the defaults. Explicit options always win.

Pure: `place` takes what the user typed (`Requested`, None for what was not given) and the Slurm
allocation read by `cluster.tools.slurm`, and returns the values `mscluster run` uses.

Under Slurm (one `mscluster run` per node, started by srun):

| value | from |
|---|---|
| node rank | SLURM_NODEID |
| local workers | --worker-num / nodes when given, else SLURM_GPUS_ON_NODE, else 1 |
| workers | nodes x local workers |
| master address | the first node of the step's node list |
| master port | 10000 + (job id + 7919 x step id) % 20000 (`Allocation.default_port`) |
| log dir | logs/<job>.<step>/ (`logs/12.0/`, `logs/12.batch/` outside srun): every job step its
  own logs, pids, job secret and recovery state, which the same step of a requeued job (same ids)
  takes up again; a --log-dir given is used as it is. Then node<rank>/ under it when the step
  spans several nodes (the working directory, where the logs go, is usually shared by them) |

Outside Slurm, a job whose workers are not all on this host (--local-worker-num under
--worker-num) keeps this host's part in logs/node<rank>/ (logs/<host>/ without --node-rank)
unless --log-dir is given, for the same reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cluster.protocol.errors import ConfigError
from cluster.tools.slurm import Allocation

DEFAULT_WORKER_NUM = 8
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 8118
DEFAULT_LOG_DIR = Path("logs")

_T = TypeVar("_T")


@dataclass(frozen=True)
class Requested:
    """`mscluster run`'s placement options as typed; None: not given."""

    worker_num: int | None = None
    local_worker_num: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    node_rank: int | None = None
    log_dir: Path | None = None


@dataclass(frozen=True)
class Placement:
    worker_num: int
    local_worker_num: int
    master_addr: str
    master_port: int
    node_rank: int  # -1: node ids are assigned (no rank known in advance)
    log_dir: Path
    allocation: Allocation | None = None
    # The master address is a Slurm node name (its NodeAddr may be needed to reach it).
    master_is_node: bool = False


def place(requested: Requested, allocation: Allocation | None, host: str = "") -> Placement:
    """The values to run with. ConfigError when the allocation cannot give what is missing.
    `host`: this host's name, which names its log directory in a job that spans hosts started
    without --node-rank (`host_log_dir`)."""
    log_dir = _given(requested.log_dir, DEFAULT_LOG_DIR)
    if allocation is None:
        worker_num = _given(requested.worker_num, DEFAULT_WORKER_NUM)
        local = _given(requested.local_worker_num, worker_num)
        node_rank = _given(requested.node_rank, -1)
        if requested.log_dir is None and local < worker_num:
            log_dir = host_log_dir(node_rank, host)
        return Placement(
            worker_num=worker_num,
            local_worker_num=local,
            master_addr=_given(requested.master_addr, DEFAULT_MASTER_ADDR),
            master_port=_given(requested.master_port, DEFAULT_MASTER_PORT),
            node_rank=node_rank,
            log_dir=log_dir,
        )
    node_rank = _node_rank(requested, allocation)
    if allocation.node_rank is None:  # outside srun: the rank given is this node's
        allocation = dataclasses.replace(allocation, node_rank=node_rank)
    local = _local_workers(requested, allocation)
    if requested.log_dir is None:
        log_dir = DEFAULT_LOG_DIR / allocation.step_name
    if allocation.node_count > 1:
        log_dir = log_dir / f"node{node_rank}"
    return Placement(
        worker_num=_given(requested.worker_num, allocation.node_count * local),
        local_worker_num=local,
        master_addr=_given(requested.master_addr, allocation.first_node),
        master_port=_given(requested.master_port, allocation.default_port),
        node_rank=node_rank,
        log_dir=log_dir,
        allocation=allocation,
        master_is_node=requested.master_addr is None,
    )


def host_log_dir(node_rank: int, host: str) -> Path:
    """The default log directory of one host's part of a job that spans hosts: `logs/node<R>`
    (`--node-rank R`), else `logs/<host>`, so that hosts sharing a working directory (a shared
    home, NFS) never share one: each writes its own job secret, pids and logs there, and holds
    it (`launcher.lock`). `logs/` where the host's name is not known or is not one name."""
    if node_rank >= 0:
        return DEFAULT_LOG_DIR / f"node{node_rank}"
    if not host or "/" in host or host in (".", ".."):
        return DEFAULT_LOG_DIR
    return DEFAULT_LOG_DIR / host


def _node_rank(requested: Requested, allocation: Allocation) -> int:
    """--node-rank, else SLURM_NODEID; a ConfigError when there is neither (an salloc shell:
    not started by srun, it runs on none of the job's nodes)."""
    if requested.node_rank is not None:
        return requested.node_rank
    if allocation.node_rank is None:
        raise ConfigError(
            f"SLURM_NODEID is not set although SLURM_JOB_ID={allocation.job_id} is (an salloc "
            "shell?), so this is on none of the job's nodes: start mscluster run under srun "
            "(`srun --ntasks-per-node=1 mscluster run ...`), or give --node-rank and the other "
            "placement options yourself"
        )
    return allocation.node_rank


def _local_workers(requested: Requested, allocation: Allocation) -> int:
    """--local-worker-num; else --worker-num spread over the nodes; else one per GPU; else 1."""
    nodes = allocation.node_count
    if allocation.step_id is None and nodes > 1 and requested.worker_num is None:
        raise ConfigError(
            f"mscluster run is running in the batch script of a {nodes}-node Slurm job, "
            "outside srun, so it would start only this node's workers: start it on every "
            "node with `srun --ntasks-per-node=1 mscluster run ...` (or give --worker-num "
            "for a job of this node alone)"
        )
    if requested.local_worker_num is not None:
        return requested.local_worker_num
    if requested.worker_num is None:
        return allocation.gpus_on_node or 1
    if allocation.step_id is None:
        return requested.worker_num  # the batch script: a job of this node alone
    if requested.worker_num % nodes:
        raise ConfigError(
            f"--worker-num {requested.worker_num} does not divide among the {nodes} nodes of "
            f"{allocation.describe()}: give --local-worker-num too"
        )
    return requested.worker_num // nodes


def _given(value: _T | None, default: _T) -> _T:
    return default if value is None else value
