"""`mscluster run` where msrun ran: the variables msrun's users export reach the job as msrun
passes them (MindSpore's own, MS_ALLOC_CONF, ...), or become the options they are
(`export MS_ENABLE_RECOVERY=1; msrun ...` turns recovery on)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.procs import ROOT, private_copy, run_args

LAUNCH_ENV = ROOT / "tests" / "integration" / "scripts" / "launch_env.py"


def launch(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`mscluster run ARGS` (the script and its arguments last) in this environment without its
    MS_* and CLUSTER_*, and with `env`; to its end."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    return subprocess.run(
        run_args(*args, master_port=free_port(), log_dir=tmp_path / "logs"),
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def seen_by(log: Path) -> dict[str, object]:
    """What `launch_env.py` printed in `log`."""
    line = next(x for x in log.read_text().splitlines() if x.startswith("launch_env "))
    seen: dict[str, object] = json.loads(line.removeprefix("launch_env "))
    return seen


def test_exported_recovery_variables_turn_recovery_on(tmp_path: Path) -> None:
    # MindSpore's way under msrun: `export MS_ENABLE_RECOVERY=1 MS_RECOVERY_PATH=...`. The
    # launcher dropped both and ran the job without recovery, saying nothing.
    recovery = tmp_path / "state"
    env = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(recovery)}
    script = str(private_copy(tmp_path))
    shown = launch(tmp_path, env, "--worker-num", "2", "--dry-run", script)
    assert shown.returncode == 0, shown.stderr
    assert "restarts up to 1 each; recovery on" in shown.stdout
    assert "note: --enable-recovery: MS_ENABLE_RECOVERY=1 of this environment" in shown.stdout
    result = launch(tmp_path, env, "--worker-num", "2", script)
    assert result.returncode == 0, result.stderr
    assert (recovery / "scheduler.json").is_file()
    assert {p.name for p in recovery.glob("worker-*.json")} == {"worker-0.json", "worker-1.json"}


def test_mindspores_own_variables_reach_the_script(tmp_path: Path) -> None:
    env = {"MS_ALLOC_CONF": "enable_vmm:true", "MS_DEV_SAVE_GRAPHS": "1", "MS_ROLE": "MS_SCHED"}
    names = ("MS_ALLOC_CONF", "MS_DEV_SAVE_GRAPHS", "MS_ROLE")
    result = launch(tmp_path, env, "--worker-num", "1", str(LAUNCH_ENV), *names)
    assert result.returncode == 0, result.stderr
    seen = seen_by(tmp_path / "logs" / "worker_0.log")
    assert seen["env"] == {
        "MS_ALLOC_CONF": "enable_vmm:true",
        "MS_DEV_SAVE_GRAPHS": "1",
        "MS_ROLE": "MS_WORKER",  # the launcher's own, per process
    }


def test_each_worker_gets_msruns_rank_variables(tmp_path: Path) -> None:
    # msrun documents RANK_ID and RANK_SIZE for user scripts; without them every worker's
    # `os.getenv("RANK_ID", "0")` was 0: the same data shard and checkpoint directory for all.
    # One exported for a single-process run is replaced, not passed on.
    names = ("RANK_ID", "RANK", "RANK_SIZE", "LOCAL_RANK", "DEVICE_ID")
    env = {"RANK_ID": "0", "DEVICE_ID": "7"}
    result = launch(tmp_path, env, "--worker-num", "2", str(LAUNCH_ENV), *names)
    assert result.returncode == 0, result.stderr
    for i in range(2):
        seen = seen_by(tmp_path / "logs" / f"worker_{i}.log")
        assert seen == {"rank": i, "env": dict.fromkeys(names, str(i)) | {"RANK_SIZE": "2"}}


def test_msruns_single_host_node_rank_and_endless_time_out_run(tmp_path: Path) -> None:
    # An msrun line: the node rank is ignored when every worker runs here, and a negative
    # --cluster_time_out waits without end. Both were refused (exit 2).
    script = str(private_copy(tmp_path))
    line = ["--worker_num=2", "--local_worker_num=2", "--node_rank=1", "--cluster_time_out=-1"]
    shown = launch(tmp_path, {}, *line, "--dry-run", script)
    assert shown.returncode == 0, shown.stderr
    assert "  MS_TOPO_TIMEOUT=2000000" in shown.stdout
    assert "scheduler: 127.0.0.1:" in shown.stdout
    assert "started here" in shown.stdout
    result = launch(tmp_path, {}, *line, script)
    assert result.returncode == 0, result.stderr
    said = [x for x in result.stderr.splitlines() if x.startswith("mscluster: --")]
    assert said == [
        "mscluster: --node-rank 1 is ignored, as msrun ignores it: every worker of the job runs "
        "on this host (--local-worker-num = --worker-num = 2)",
        "mscluster: --cluster-time-out -1 is msrun's 'wait without end': taken as 2000000 s "
        "(23 days), the longest a scheduler waits",
    ]
    for rank in range(2):
        text = (tmp_path / "logs" / f"worker_{rank}.log").read_text()
        assert f"allgather rank={rank} size=2 result=[0, 1]" in text
