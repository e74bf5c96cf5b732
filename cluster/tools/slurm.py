"""What a Slurm allocation tells `mscluster run`, read from the environment Slurm gives a task.

Pure: it reads a mapping and text, never the process's environment, a file or scontrol
(`cluster.tools.slurm_io` does that).

Started by `srun` (one task per node), a launcher finds its node's index in SLURM_NODEID, the
number of nodes in SLURM_STEP_NUM_NODES and the nodes in SLURM_STEP_NODELIST (the step's: an
`srun -N1` inside a two-node allocation makes a one-node job); run straight from a batch script,
outside srun, in SLURM_NODEID, SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cluster.protocol.config import parse_int
from cluster.protocol.errors import ConfigError
from cluster.tools import hostlist

# Where the first node's launcher leaves the job secret for the others (under the job's working
# directory, which the nodes of a Slurm cluster share).
SECRET_DIR = Path(".mscluster")
# A default scheduler port per job step (10000-29999, below Linux's ephemeral ports), so that two
# jobs, or two steps of one job, sharing a node do not both ask for 8118: 10000 + (job id +
# STEP_STRIDE x step id) mod 20000, the batch script counting as step -1. The stride is prime
# and far from 0 mod 20000, so the steps of one job and the neighbouring job ids a node runs
# at the same time fall on different ports.
PORT_BASE = 10000
PORT_SPAN = 20000
STEP_STRIDE = 7919


@dataclass(frozen=True)
class Allocation:
    job_id: int
    step_id: int | None  # None: the batch script itself, outside srun
    # SLURM_NODEID: this node's index among the step's (the job's) nodes; None where Slurm sets
    # none: an salloc shell, which runs outside srun and on no particular node of the job.
    node_rank: int | None
    node_count: int
    nodelist: str  # Slurm's compact form, e.g. node[01-04]
    nodelist_var: str  # the variable it came from, for messages
    tasks: int | None  # the step's tasks (srun), None outside srun
    gpus_on_node: int | None  # SLURM_GPUS_ON_NODE, when the job asked for GPUs
    node_name: str = ""  # SLURMD_NODENAME
    # SLURM_RESTART_COUNT: how often the job was requeued (it keeps its id and step ids).
    restart_count: int = 0

    @property
    def first_node(self) -> str:
        """The step's first node: where node 0's launcher runs the scheduler."""
        return hostlist.first(self.nodelist, self.nodelist_var)

    @property
    def default_port(self) -> int:
        step = -1 if self.step_id is None else self.step_id
        return PORT_BASE + (self.job_id + STEP_STRIDE * step) % PORT_SPAN

    @property
    def step_name(self) -> str:
        """Slurm's name of the step: '12.0', '12.batch' outside srun."""
        return f"{self.job_id}.{'batch' if self.step_id is None else self.step_id}"

    @property
    def secret_path(self) -> Path:
        """The shared job secret's file, relative to the job's working directory: one per step
        and run, so that a requeued job's nodes never read the secret of its run before."""
        return SECRET_DIR / secret_name(self.step_name, self.restart_count)

    def describe(self) -> str:
        """'Slurm job 12 step 0, node 1 of 2 (node[1-2])'."""
        step = "batch script" if self.step_id is None else f"step {self.step_id}"
        node = "" if self.node_rank is None else f"node {self.node_rank} of "
        return f"Slurm job {self.job_id} {step}, {node}{self.node_count} ({self.nodelist})"


def allocation_from_env(env: Mapping[str, str]) -> Allocation | None:
    """The allocation this process runs in, or None outside Slurm (no SLURM_JOB_ID).
    ConfigError for a variable that is missing or not a number, a node id out of range, or
    several tasks per node."""
    raw_job = env.get("SLURM_JOB_ID", "").strip()
    if not raw_job:
        return None
    restarts = env.get("SLURM_RESTART_COUNT", "").strip()
    in_step = bool(env.get("SLURM_STEP_NUM_NODES", "").strip())
    prefix = "SLURM_STEP" if in_step else "SLURM_JOB"
    count_var, list_var = f"{prefix}_NUM_NODES", f"{prefix}_NODELIST"
    node_count = _number(env, count_var, minimum=1)
    nodelist = env.get(list_var, "").strip()
    if not nodelist:
        raise ConfigError(f"{list_var} is not set although SLURM_JOB_ID={raw_job!r} is")
    allocation = Allocation(
        job_id=_number(env, "SLURM_JOB_ID", minimum=0),
        step_id=_number(env, "SLURM_STEP_ID", minimum=0) if in_step else None,
        node_rank=_node_rank(env, in_step),
        node_count=node_count,
        nodelist=nodelist,
        nodelist_var=list_var,
        tasks=_number(env, "SLURM_STEP_NUM_TASKS", minimum=1) if in_step else None,
        gpus_on_node=_gpus(env),
        node_name=env.get("SLURMD_NODENAME", ""),
        restart_count=parse_int("SLURM_RESTART_COUNT", restarts or "0", minimum=0),
    )
    _check(allocation)
    return allocation


def _node_rank(env: Mapping[str, str], in_step: bool) -> int | None:
    """SLURM_NODEID, which every srun task and batch script has; None outside both."""
    if not in_step and not env.get("SLURM_NODEID", "").strip():
        return None
    return _number(env, "SLURM_NODEID", minimum=0)


def _check(allocation: Allocation) -> None:
    if allocation.node_rank is not None and allocation.node_rank >= allocation.node_count:
        raise ConfigError(
            f"SLURM_NODEID={allocation.node_rank} is not below the node count "
            f"({allocation.node_count})"
        )
    if allocation.tasks is not None and allocation.tasks != allocation.node_count:
        raise ConfigError(
            f"srun started {allocation.tasks} tasks on {allocation.node_count} nodes "
            f"(SLURM_STEP_NUM_TASKS): mscluster run wants one task per node, and starts that "
            "node's workers itself: `srun --ntasks-per-node=1 mscluster run ...`"
        )


def _number(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        raise ConfigError(f"{name} is not set although SLURM_JOB_ID is: is this a Slurm task?")
    return parse_int(name, raw, minimum=minimum)


def _gpus(env: Mapping[str, str]) -> int | None:
    raw = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if not raw:
        return None
    count = parse_int("SLURM_GPUS_ON_NODE", raw, minimum=0)
    return count or None


# A shared secret's file name, or its temporary's ('.NAME.<hex digits>.tmp', as
# `cluster.storage.atomic` names them).
_SECRET_NAME = re.compile(
    r"\.?slurm-(?P<job>\d+)\.(?:\d+|batch)\.r(?P<restart>\d+)\.secret(?:\.[0-9a-f]+\.tmp)?"
)


def secret_name(step_name: str, restart_count: int) -> str:
    """'slurm-12.0.r1.secret': the shared secret of step 12.0 in the job's run after 1 requeue."""
    return f"slurm-{step_name}.r{restart_count}.secret"


def earlier_run(name: str, job_id: int, restart_count: int) -> bool:
    """Whether file `name` in SECRET_DIR is a shared secret (or its temporary) of
    job `job_id` from a run before this one (restart count below `restart_count`)."""
    match = _SECRET_NAME.fullmatch(name)
    return (
        match is not None and int(match["job"]) == job_id and int(match["restart"]) < restart_count
    )


def node_addr(scontrol_show_node: str) -> str | None:
    """NodeAddr from the output of `scontrol show node -o NAME`; None when it has none."""
    for field in scontrol_show_node.split():
        key, sep, value = field.partition("=")
        if sep and key == "NodeAddr" and value and value != "(null)":
            return value
    return None
