"""The launch contract with real processes: MindSpore-style launch loops, failures, timeouts."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from tests.procs import PYTHON, ROOT, Procs, example_error_line, job_env

EXAMPLE = [str(ROOT / "examples" / "allgather_check.py")]
LINE = re.compile(r"^allgather rank=(\d+) size=(\d+) result=(\[.*\])$", re.MULTILINE)


def start_job(
    processes: Procs, n: int, *, hold: float = 0.0, workers: int | None = None, **env: str
) -> tuple[object, list]:
    port = free_port()
    base = job_env(n, port, **env)
    args = [*EXAMPLE, "--hold", str(hold)] if hold else EXAMPLE
    sched = processes.start_role("scheduler", "MS_SCHED", args, base)
    started = [
        processes.start_role(f"worker{i}", "MS_WORKER", args, base)
        for i in range(n if workers is None else workers)
    ]
    return sched, started


def test_tutorial_shell_loop_runs_unchanged(tmp_path: Path) -> None:
    """The tutorial's loop: N workers and a scheduler of one script, only MS_ROLE differs."""
    script = ROOT / "examples" / "run_allgather.sh"
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(script)],
        env={**job_env(8, free_port()), "LOG_DIR": str(tmp_path), "PYTHON": PYTHON},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    lines = []
    for i in range(8):
        lines += LINE.findall((tmp_path / f"worker_{i}.log").read_text())
    ranks = sorted(int(rank) for rank, _, _ in lines)
    assert ranks == list(range(8)), lines
    assert {(size, res) for _, size, res in lines} == {("8", str(list(range(8))))}
    print(f"8-worker tutorial launch took {elapsed:.2f} s")


def test_every_worker_prints_one_line_and_all_exit_zero(processes: Procs) -> None:
    sched, workers = start_job(processes, 4)
    for w in workers:
        assert w.wait(30) == 0, w.output
    assert sched.wait(30) == 0, sched.output
    outputs = [LINE.findall(w.output) for w in workers]
    assert all(len(found) == 1 for found in outputs), [w.output for w in workers]
    assert sorted(int(found[0][0]) for found in outputs) == [0, 1, 2, 3]
    assert "Traceback" not in "".join(w.output for w in [sched, *workers])


def test_workers_started_before_the_scheduler_wait_for_it(processes: Procs) -> None:
    port = free_port()
    base = job_env(2, port)
    workers = [processes.start_role(f"w{i}", "MS_WORKER", EXAMPLE, base) for i in range(2)]
    workers[0].wait_for_output("waiting for the scheduler at 127.0.0.1", 20)
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, base)
    for w in workers:
        assert w.wait(30) == 0, w.output
    assert sched.wait(30) == 0, sched.output


def test_a_worker_of_a_large_job_waits_idle_for_a_late_scheduler(processes: Procs) -> None:
    """A worker of a 32,768-node job started before its scheduler tries the scheduler's port at
    its share of the job's 10,000 tries a second, every 3.3 s, and costs nothing meanwhile. Its
    waits of 3 s (1 s at first) are shorter than that pace: they once ended at once and began
    again at once, about 15,000 tries a second, a core's worth of CPU from the first second on
    (until a try failed otherwise than refused). Two reports in (a report comes as a wait
    ends), the whole process has used less CPU than one busy second."""
    worker = processes.start_role("w0", "MS_WORKER", EXAMPLE, job_env(32_768, free_port()))
    waiting = "waiting for the scheduler at 127.0.0.1"
    wait_until(lambda: worker.output.count(waiting) >= 2, 30, "the worker's second report")
    assert worker.cpu_s() < 0.75, worker.output


def test_sigkill_of_a_worker_stops_every_process_naming_the_rank(processes: Procs) -> None:
    sched, workers = start_job(processes, 4, hold=60)
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    victim = workers[2]
    rank = LINE.search(victim.output).group(1)  # type: ignore[union-attr]
    victim.popen.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivors = [w for w in workers if w is not victim]
    for proc in [*survivors, sched]:
        assert proc.wait(10) != 0, proc.output
    took = time.monotonic() - killed_at
    for proc in [*survivors, sched]:
        assert f"rank {rank} (node" in proc.output, proc.output
        assert "died" in proc.output
        assert "Traceback" not in proc.output
    print(f"all processes exited {took:.2f} s after the SIGKILL")


# A hung process is found by the heartbeats' silence (MS_NODE_TIMEOUT=2, beats 0.4 s apart), or,
# with beats 1.9 s apart (3 silent intervals, 5.7 s, would be needed, as in a large job), by
# gRPC's pings of its connection first (within 4/3 of MS_NODE_TIMEOUT and a second).
HUNG = pytest.mark.parametrize(
    ("beats", "found", "not_found"),
    [
        ({}, "no heartbeat", "connection to the scheduler broke"),
        ({"CLUSTER_HEARTBEAT_INTERVAL": "1.9"}, "connection", "no heartbeat"),  # either end's
    ],
    ids=["heartbeats", "grpc-pings"],
)


@HUNG
def test_hung_worker_is_detected(
    processes: Procs, beats: dict[str, str], found: str, not_found: str
) -> None:
    sched, workers = start_job(processes, 3, hold=60, MS_NODE_TIMEOUT="2", **beats)
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    victim = workers[0]
    victim.popen.send_signal(signal.SIGSTOP)
    try:
        for proc in [workers[1], workers[2], sched]:
            assert proc.wait(20) != 0, proc.output
            assert found in proc.output, proc.output
            assert not_found not in proc.output, proc.output
    finally:
        victim.popen.send_signal(signal.SIGKILL)


def test_dead_scheduler_makes_workers_exit_naming_its_address(processes: Procs) -> None:
    sched, workers = start_job(processes, 2, hold=60, MS_NODE_TIMEOUT="2")
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    sched.popen.send_signal(signal.SIGKILL)
    for w in workers:
        assert w.wait(20) != 0, w.output
        assert "the scheduler at 127.0.0.1:" in w.output
        assert "unreachable" in w.output, w.output
        assert "Traceback" not in w.output


@HUNG
def test_hung_scheduler_makes_workers_exit(
    processes: Procs, beats: dict[str, str], found: str, not_found: str
) -> None:
    sched, workers = start_job(processes, 2, hold=60, MS_NODE_TIMEOUT="2", **beats)
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    sched.popen.send_signal(signal.SIGSTOP)
    try:
        for w in workers:
            assert w.wait(20) != 0, w.output
            assert "unreachable" in w.output, w.output
            assert found in w.output, w.output
            assert not_found not in w.output, w.output
    finally:
        sched.popen.send_signal(signal.SIGKILL)


def test_topology_timeout_names_what_is_missing(processes: Procs) -> None:
    sched, workers = start_job(processes, 4, workers=3, MS_TOPO_TIMEOUT="4")
    for proc in [sched, *workers]:
        assert proc.wait(15) != 0, proc.output
        assert "Traceback" not in proc.output, proc.output
        assert "3 of 4 workers registered after" in proc.output, proc.output
    # Each worker says it in one line (progress lines before it are "k of 4 nodes registered").
    for w in workers:
        said = [ln for ln in w.output.splitlines() if "registered after" in ln]
        assert len(said) == 1, w.output
        assert said[0].startswith("cluster: JobFailedError: job failed: 3 of 4 workers"), said


def test_numeric_node_ids_are_the_ranks_and_missing_ranks_are_named(processes: Procs) -> None:
    port = free_port()
    base = job_env(3, port, MS_TOPO_TIMEOUT="3")
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, base)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", EXAMPLE, {**base, "MS_NODE_ID": str(i)})
        for i in (0, 2)
    ]
    assert sched.wait(15) != 0
    assert "missing: rank 1" in sched.output, sched.output
    for w in workers:
        assert w.wait(15) != 0


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MS_ROLE": ""}, "MS_ROLE is not set"),
        ({"MS_ROLE": "MS_BOSS"}, "MS_ROLE='MS_BOSS'"),
        ({"MS_SCHED_PORT": "abc"}, "MS_SCHED_PORT='abc' is not an integer"),
        ({"MS_SCHED_PORT": "70000"}, "MS_SCHED_PORT='70000' is out of range"),
        ({"MS_WORKER_NUM": "0"}, "MS_WORKER_NUM='0' is out of range"),
        ({"MS_TOPO_TIMEOUT": "-5"}, "MS_TOPO_TIMEOUT='-5' is out of range"),
        ({"MS_NODE_TIMEOUT": "soon"}, "MS_NODE_TIMEOUT='soon' is not a number"),
        ({"MS_ENABLE_RECOVERY": "1"}, "MS_ENABLE_RECOVERY=1 needs MS_RECOVERY_PATH"),
        (
            {
                "MS_ENABLE_RECOVERY": "1",
                "MS_RECOVERY_PATH": "/proc/cluster-no-such-dir",
                "MS_NODE_ID": "0",
            },
            "MS_RECOVERY_PATH='/proc/cluster-no-such-dir' is not a writable directory",
        ),
        ({"MS_SCHED_HOST": "no-such-host.invalid"}, "does not resolve"),
    ],
)
@pytest.mark.parametrize("role", ["MS_WORKER", "MS_SCHED"])
def test_bad_environment_is_one_clear_line(role: str, env: dict[str, str], expected: str) -> None:
    line = example_error_line({**job_env(2, free_port(), MS_ROLE=role), **env})
    assert expected in line, line
    assert line.startswith("cluster: ConfigError: ")


def test_scheduler_port_in_use_is_one_clear_line(processes: Procs) -> None:
    port = free_port()
    base = job_env(1, port)
    first = processes.start_role("first", "MS_SCHED", EXAMPLE, base)
    first.wait_for_output("listening on", 20)
    line = example_error_line({**base, "MS_ROLE": "MS_SCHED"})
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in line, line


def test_a_crashed_worker_fails_the_job_instead_of_finishing_it(processes: Procs) -> None:
    script = [str(ROOT / "tests" / "integration" / "scripts" / "crash_or_leave.py"), "crash"]
    port = free_port()
    base = job_env(3, port)
    sched = processes.start_role("scheduler", "MS_SCHED", script, base)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", script, {**base, "MS_NODE_ID": str(i)})
        for i in range(3)
    ]
    assert workers[0].wait(30) == 1
    assert "RuntimeError: boom" in workers[0].output
    for proc in [*workers[1:], sched]:
        assert proc.wait(30) != 0, proc.output
        assert "rank 0" in proc.output, proc.output
    # It told the scheduler what it died of: the scheduler says so, not a broken connection.
    assert "failed: its process died of an error: RuntimeError: boom" in sched.output
    assert "RuntimeError: boom" in workers[1].output  # the peers' error says it too


def test_a_rank_that_leaves_early_fails_the_collective_it_skips(processes: Procs) -> None:
    script = [str(ROOT / "tests" / "integration" / "scripts" / "crash_or_leave.py"), "leave"]
    port = free_port()
    base = job_env(2, port)
    sched = processes.start_role("scheduler", "MS_SCHED", script, base)
    workers = [
        processes.start_role(f"w{i}", "MS_WORKER", script, {**base, "MS_NODE_ID": str(i)})
        for i in range(2)
    ]
    assert workers[0].wait(30) == 0, workers[0].output
    assert workers[1].wait(30) != 0, workers[1].output
    assert "rank 0" in workers[1].output, workers[1].output
    assert "finished" in workers[1].output, workers[1].output
    assert "Traceback" not in workers[1].output
    assert sched.wait(30) != 0


def test_restarted_scheduler_without_recovery_refuses_the_old_job(processes: Procs) -> None:
    port = free_port()
    base = job_env(2, port, MS_NODE_TIMEOUT="10")
    args = [*EXAMPLE, "--hold", "60"]
    sched = processes.start_role("scheduler", "MS_SCHED", args, base)
    workers = [processes.start_role(f"w{i}", "MS_WORKER", args, base) for i in range(2)]
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    sched.popen.send_signal(signal.SIGKILL)
    sched.wait(10)
    workers[0].wait_for_output("reconnecting", 10)
    second = processes.start_role("scheduler2", "MS_SCHED", args, base)
    for w in workers:
        assert w.wait(20) != 0, w.output
        assert "recovery is off" in w.output, w.output
    second.popen.send_signal(signal.SIGTERM)
    assert second.wait(20) != 0
