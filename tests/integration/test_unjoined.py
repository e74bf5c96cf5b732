"""Workers that exit without joining the job (a script that never calls `cluster.init()`), as
a user meets them: `mscluster run` and `mscluster chaos` fail the job at once, saying which
workers, their exit codes and what to do; neither waits for a job that cannot form."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cluster.testing import free_port
from tests.procs import MSCLUSTER, processes_running, run_args

# Never joins: the job's scheduler would wait for its workers until MS_TOPO_TIMEOUT (1800 s).
NO_INIT = 'print("hi")\n'
# Worker 1 never joins; worker 0 does, and blocks in init() until the job forms (never).
ONE_NO_INIT = """
import os

import cluster

if os.environ.get("MS_NODE_ID") == "1":
    print("worker 1 forgot cluster.init()")
    raise SystemExit(0)
cluster.init()
cluster.finalize()
"""
REMEDY = "without joining the job: the script must call cluster.init()"
# Far below MS_TOPO_TIMEOUT: the job's end comes from the launcher, not from its scheduler.
BOUND_S = 45


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job" / "noinit.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`mscluster run --worker-num 2 --log-dir LOGS SCRIPT`, bounded."""
    args = run_args(
        script(tmp_path, text), worker_num=2, master_port=free_port(), log_dir=tmp_path / "logs"
    )
    return subprocess.run(args, capture_output=True, text=True, timeout=BOUND_S, check=False)


def chaos(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`mscluster chaos --duration 1 -- --worker-num 2 --log-dir LOGS SCRIPT`, bounded."""
    logs = str(tmp_path / "logs")
    args = [*MSCLUSTER, "chaos", "--duration", "1", "--", "--worker-num", "2", "--log-dir", logs]
    return subprocess.run(
        [*args, str(script(tmp_path, text))],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=False,
    )


@pytest.mark.parametrize("command", [run, chaos])
def test_workers_that_never_join_fail_the_job_naming_them_and_the_remedy(
    tmp_path: Path, command: object
) -> None:
    assert callable(command)
    result = command(tmp_path, NO_INIT)
    logs = tmp_path / "logs"
    assert result.returncode == 1, result.stderr
    said = (
        "worker 0 (rank 0, node id '0') and worker 1 (rank 1, node id '1') exited with code 0 "
        if command is run
        else "worker 0 (node id '0') and worker 1 (node id '1') exited with code 0 "
    )
    assert said + REMEDY in result.stderr, result.stderr
    assert f"see {logs}/worker_0.log, {logs}/worker_1.log" in result.stderr, result.stderr
    assert "did not exit" not in result.stderr
    assert "finished correctly" not in result.stderr
    if command is chaos:
        assert "the job FAILED (worker 0" in result.stderr, result.stderr
    else:
        assert result.stderr.rstrip().endswith("mscluster: job failed"), result.stderr
    assert not processes_running(str(tmp_path / "job"))


@pytest.mark.parametrize("command", [run, chaos])
def test_one_worker_that_never_joins_ends_the_job_its_peer_waits_in(
    tmp_path: Path, command: object
) -> None:
    """Worker 0 blocks in init() for a job that cannot form: the job ends at once with worker
    1 named, rather than when the scheduler gives up (MS_TOPO_TIMEOUT)."""
    assert callable(command)
    result = command(tmp_path, ONE_NO_INIT)
    assert result.returncode == 1, result.stderr
    who = "worker 1 (rank 1, node id '1')" if command is run else "worker 1 (node id '1')"
    assert f"{who} exited with code 0 {REMEDY}" in result.stderr, result.stderr
    assert f"see {tmp_path / 'logs'}/worker_1.log" in result.stderr, result.stderr
    assert "worker 0" not in result.stderr.split("without joining")[0], result.stderr
    assert not processes_running(str(tmp_path / "job"))
