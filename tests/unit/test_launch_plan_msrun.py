"""msrun's variables in `mscluster run`'s environment: those that are options here are those
options' values unless the option is given (`launch_setup.settle`), and --dry-run says where
each came from."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from cluster.protocol.config import MAX_SECONDS
from cluster.protocol.errors import ConfigError
from cluster.tools import launch_plan, launch_setup, slurm
from cluster.tools.launch_plan import LaunchOptions


def options(**changes: object) -> LaunchOptions:
    base: dict[str, object] = {
        "script": Path("train.py"),
        "script_args": (),
        "worker_num": 2,
        "local_worker_num": 2,
        "master_addr": "127.0.0.1",
        "master_port": 8118,
        "python": "/usr/bin/python3",
    }
    return LaunchOptions(**{**base, **changes})  # type: ignore[arg-type]


def settle(
    opts: LaunchOptions, env: dict[str, str], max_restarts: int | None = None
) -> tuple[LaunchOptions, str]:
    out = io.StringIO()
    return launch_setup.settle(opts, env, out, max_restarts=max_restarts), out.getvalue()


def test_exported_recovery_is_the_options_default() -> None:
    env = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": "/data/job1", "MS_NODE_TIMEOUT": "60"}
    settled, said = settle(options(), env)
    assert said == ""
    assert settled.enable_recovery
    assert settled.recovery_path == Path("/data/job1")
    assert settled.node_timeout == 60
    assert settled.max_restarts == launch_plan.RESTARTS_WITH_RECOVERY  # as --enable-recovery's
    assert settled.notes == (
        "--node-timeout 60: MS_NODE_TIMEOUT=60 of this environment",
        "--enable-recovery: MS_ENABLE_RECOVERY=1 of this environment",
        "--recovery-path /data/job1: MS_RECOVERY_PATH=/data/job1 of this environment",
    )
    made = launch_plan.make_plan(
        settled, ip="127.0.0.1", with_scheduler=True, hostname="h", launcher_pid=1, tls_env={}
    )
    env_of_worker = launch_plan.child_environment(env, made.workers[0])
    assert env_of_worker["MS_ENABLE_RECOVERY"] == "1"
    assert env_of_worker["MS_RECOVERY_PATH"] == "/data/job1"
    assert env_of_worker["MS_NODE_TIMEOUT"] == "60"
    # --max-restarts given stays as given.
    assert settle(options(), env, max_restarts=0)[0].max_restarts == 0


def test_an_option_given_wins_and_is_said() -> None:
    env = {"MS_NODE_TIMEOUT": "60", "MS_RECOVERY_PATH": "/data/old", "MS_ENABLE_RECOVERY": "0"}
    given = options(node_timeout=45.0, recovery_path=Path("/data/new"), enable_recovery=True)
    settled, said = settle(given, env)
    assert (settled.node_timeout, settled.recovery_path) == (45, Path("/data/new"))
    assert settled.enable_recovery
    lines = [
        "MS_NODE_TIMEOUT=60 of this environment is not used: --node-timeout 45 was given",
        "MS_ENABLE_RECOVERY=0 of this environment is not used: --enable-recovery was given",
        "MS_RECOVERY_PATH=/data/old of this environment is not used: --recovery-path /data/new "
        "was given",
    ]
    assert said.splitlines() == [f"mscluster: {line}" for line in lines]
    assert settled.notes == tuple(lines)
    # The same value given twice is no conflict.
    assert settle(options(node_timeout=60.0), {"MS_NODE_TIMEOUT": "60"}) == (
        options(node_timeout=60.0),
        "",
    )


def test_a_bad_exported_value_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="MS_ENABLE_RECOVERY='maybe' is not a boolean"):
        settle(options(), {"MS_ENABLE_RECOVERY": "maybe"})
    with pytest.raises(ConfigError, match=re.escape("MS_NODE_TIMEOUT='0.5' is out of range")):
        settle(options(), {"MS_NODE_TIMEOUT": "0.5"})


def test_a_node_rank_where_every_worker_runs_here_is_ignored_as_msrun_does() -> None:
    # `--worker_num=2 --local_worker_num=2 --node_rank=1` was refused: "would start ranks up
    # to 3". msrun ignores the node rank when every worker runs on this host.
    settled, said = settle(options(node_rank=1), {})
    assert settled.node_rank == -1
    line = (
        "--node-rank 1 is ignored, as msrun ignores it: every worker of the job runs on this "
        "host (--local-worker-num = --worker-num = 2)"
    )
    assert said == f"mscluster: {line}\n"
    assert settled.notes == (line,)
    made = launch_plan.make_plan(
        settled, ip="127.0.0.1", with_scheduler=True, hostname="h", launcher_pid=1, tls_env={}
    )
    assert [p.rank for p in made.workers] == [0, 1]
    # Node rank 0 and a host of part of the job are as before.
    assert settle(options(node_rank=0), {}) == (options(node_rank=0), "")
    part = options(node_rank=1, worker_num=4)
    assert settle(part, {})[0].node_rank == 1


def test_a_node_rank_of_a_slurm_node_of_several_is_still_refused() -> None:
    # There the node rank is this node's, and node 0's launcher starts the same ranks.
    step = slurm.allocation_from_env(
        {
            "SLURM_JOB_ID": "9",
            "SLURM_STEP_ID": "0",
            "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_NUM_TASKS": "2",
        }
    )
    assert step is not None
    settled, said = settle(options(node_rank=1, allocation=step, script=Path(__file__)), {})
    assert (settled.node_rank, said) == (1, "")
    with pytest.raises(ConfigError, match="would start ranks up to 3"):
        launch_setup.validate(settled)


def test_a_negative_cluster_time_out_is_the_longest_wait() -> None:
    # msrun: a negative --cluster_time_out waits without end; it was refused as out of range.
    line = (
        "--cluster-time-out -1 is msrun's 'wait without end': taken as 2000000 s (23 days), the "
        "longest a scheduler waits"
    )
    for given, env in (
        (options(cluster_time_out=-1.0), {}),
        (options(), {"MS_TOPO_TIMEOUT": "-1"}),
    ):
        settled, said = settle(given, env)
        assert settled.cluster_time_out == MAX_SECONDS
        assert said == f"mscluster: {line}\n"
        launch_setup.check_job_settings(settled)  # what the scheduler takes
    with pytest.raises(ConfigError, match=re.escape("--cluster-time-out='0' is out of range")):
        launch_setup.check_job_settings(settle(options(cluster_time_out=0.0), {})[0])
