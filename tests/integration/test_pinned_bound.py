"""The pinned-memory bound of a worker is its job's configuration, not its environment: a
config given to `cluster.init()` bounds the pinned host buffers of its snapshots."""

from __future__ import annotations

from cluster.testing import free_port
from tests.procs import PYTHON, ROOT, Procs, job_env

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "pinned_bound.py"
ENV_BOUND = 1 << 20
CONFIG_BOUND = 4096


def test_a_config_given_to_init_bounds_pinned_memory_not_the_environment(
    processes: Procs,
) -> None:
    """The environment says 1 MiB, the config given to init() 4096 bytes: the process's buffers,
    made before init with the environment's bound, take the config's at init, and a buffer one
    byte over it is refused by the bound (before any page-locking: no CUDA needed), with the
    one warning that names it. Before, the environment's 1 MiB stayed the bound."""
    env = job_env(1, free_port(), CLUSTER_PINNED_MAX_BYTES=str(ENV_BOUND))
    processes.start("sched", [PYTHON, "-m", "cluster", "scheduler"], {**env, "MS_ROLE": "MS_SCHED"})
    worker = processes.start_role(
        "w0", "MS_WORKER", [str(SCRIPT), str(CONFIG_BOUND)], {**env, "MS_NODE_ID": "0"}
    )
    assert worker.wait(60) == 0, worker.output
    assert f"before init: bound {ENV_BOUND}" in worker.output
    assert f"after init: bound {CONFIG_BOUND}" in worker.output
    assert "over the bound: pinned=False pinned_bytes=0" in worker.output
    assert f"than the bound of {CONFIG_BOUND} bytes allows" in worker.output
    assert "cannot pin host memory" not in worker.output
