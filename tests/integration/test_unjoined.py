"""Workers that exit without joining the job (a script that never calls `cluster.init()`), as
a user meets them: `mscluster run` and `mscluster chaos` fail the job at once, saying which
workers, their exit codes and what to do; neither waits for a job that cannot form."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import IO

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
# Worker 0 registers, and once the scheduler's event log says so, ends before the job formed
# (os._exit: no cluster.finalize(); init() goes on in a thread); worker 1 is slow to start.
LEAVES = """
import json
import os
import threading
import time
from pathlib import Path

import cluster

if os.environ.get("MS_NODE_ID") == "1":
    time.sleep(60)  # sleep-ok: slow to start, the launcher ends the job long before
    cluster.init()
    raise SystemExit(0)
threading.Thread(target=cluster.init, daemon=True).start()
events = Path(__file__).parent.parent / "logs" / "events.jsonl"
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    lines = events.read_text().splitlines() if events.exists() else []
    if any(json.loads(line).get("node_id") == "0" for line in lines if line.strip()):
        break
    time.sleep(0.05)  # sleep-ok: a poll of the scheduler's event log, bounded
print("worker 0 registered; leaving")
os._exit(0)
"""
# As LEAVES, but worker 0 leaves once the launcher has shown it registered (the test touches
# job/go then): the launcher has listed it.
LEAVES_WHEN_TOLD = LEAVES.replace(
    'any(json.loads(line).get("node_id") == "0" for line in lines if line.strip())',
    '(Path(__file__).parent / "go").exists()',
)
# Worker 1 dies of an error before cluster.init(); worker 0 waits in init() for it.
FAILS_FIRST = """
import os

import cluster

if os.environ.get("MS_NODE_ID") == "1":
    raise ValueError("bad --data path")
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


# As NO_INIT, but the workers end well after the scheduler (which runs the script too, under
# chaos): the job has ended (its scheduler is gone) before any worker's exit is known.
NO_INIT_SLOW = """
import os
import time

if os.environ.get("MS_ROLE") != "MS_SCHED":
    time.sleep(1.5)  # sleep-ok: the workers end after the scheduler did
"""


def test_chaos_names_workers_that_never_join_when_they_end_after_the_scheduler(
    tmp_path: Path,
) -> None:
    """Under load the scheduler's process (the script, which never serves) may end first: the
    job is over before any worker's exit is known, and chaos reported it finished correctly."""
    result = chaos(tmp_path, NO_INIT_SLOW)
    assert result.returncode == 1, result.stderr
    said = "worker 0 (node id '0') and worker 1 (node id '1') exited with code 0 "
    assert said + REMEDY in result.stderr, result.stderr
    assert "finished correctly" not in result.stderr
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


def test_a_worker_that_registered_and_left_before_the_job_formed_ends_it(
    tmp_path: Path,
) -> None:
    """Worker 0 registered, then exited 0 while worker 1 was still starting: the scheduler
    forgot it (the job has not formed), and nothing will take its place, so the job ends at
    once with worker 0 named, rather than when the scheduler gives up (MS_TOPO_TIMEOUT)."""
    result = run(tmp_path, LEAVES)
    assert result.returncode == 1, result.stderr
    said = (
        "worker 0 (rank 0, node id '0') exited with code 0 after it registered, leaving the "
        "job before it formed: the script must wait for cluster.init() to return and call "
        "cluster.finalize() before it ends"
    )
    assert said in result.stderr, result.stderr
    assert f"see {tmp_path / 'logs'}/worker_0.log" in result.stderr, result.stderr
    assert "worker 1" not in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("mscluster: job failed"), result.stderr
    assert "worker 0 registered; leaving" in (tmp_path / "logs" / "worker_0.log").read_text()
    assert not processes_running(str(tmp_path / "job"))


def test_a_worker_the_launcher_saw_registered_that_left_before_the_job_formed_ends_it(
    tmp_path: Path,
) -> None:
    """As above, once the launcher's progress line showed worker 0 registered (the launcher
    had listed it: it counted it in the job, and waited for MS_TOPO_TIMEOUT)."""
    args = run_args(
        script(tmp_path, LEAVES_WHEN_TOLD),
        worker_num=2,
        master_port=free_port(),
        log_dir=tmp_path / "logs",
    )
    lines: list[str] = []
    shown = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            lines.append(line)
            if "1/2 registered" in line:
                shown.set()

    with subprocess.Popen(args, stderr=subprocess.PIPE, text=True) as launcher:
        assert launcher.stderr is not None
        reader = threading.Thread(target=read, args=(launcher.stderr,), daemon=True)
        reader.start()
        try:
            assert shown.wait(BOUND_S), "".join(lines)
            (tmp_path / "job" / "go").touch()
            assert launcher.wait(BOUND_S) == 1, "".join(lines)
        finally:
            launcher.kill()
        reader.join(BOUND_S)
    said = "".join(lines)
    assert (
        "worker 0 (rank 0, node id '0') exited with code 0 after it registered, leaving the "
        "job before it formed: " in said
    ), said
    assert said.rstrip().endswith("mscluster: job failed"), said
    assert not processes_running(str(tmp_path / "job"))


def test_a_worker_that_failed_before_it_joined_the_job_says_so(tmp_path: Path) -> None:
    """Its failure report says it had not joined: the job never formed with it."""
    result = run(tmp_path, FAILS_FIRST)
    assert result.returncode == 1, result.stderr
    said = (
        "worker 1 (rank 1, node id '1') exited with code 1 before it joined the job: "
        "ValueError: bad --data path"
    )
    assert said in result.stderr, result.stderr
    assert not processes_running(str(tmp_path / "job"))
