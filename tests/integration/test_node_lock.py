"""One live process per node id on a worker's MS_RECOVERY_PATH: two jobs whose workers share a
recovery path (a workers-only host, where no scheduler's lock covers the directory) must not
take each other's node file. Real processes; the lock's edges in one process."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.testing import free_port
from cluster.worker import node_file
from tests.procs import ROOT, Procs, job_env

WORKER = [str(ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py")]
NODE_TIMEOUT_S = 3
BOUND_S = 30.0


def recovery_env(port: int, path: Path, node_id: str | None = None) -> dict[str, str]:
    extra = {"MS_NODE_ID": node_id} if node_id is not None else {}
    return job_env(
        2,
        port,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(path),
        MS_NODE_TIMEOUT=str(NODE_TIMEOUT_S),
        MS_TOPO_TIMEOUT="60",
        **extra,
    )


def test_a_second_job_on_a_shared_workers_path_is_refused_and_the_first_survives(
    processes: Procs, tmp_path: Path
) -> None:
    """Job A's worker 1 and job B's worker 1 share one MS_RECOVERY_PATH (their schedulers and
    workers 0 each have their own). B's worker 1 is refused at init() with one line naming the
    path, the lock and A's process, even once A's record is gone (as the scheduler's foreign-job
    refusal used to advise); A's worker 1, killed, rejoins with its rank and A finishes. (B's
    worker 1 read A's live record and was refused by B's scheduler; with the record removed, it
    wrote its own, and A's restarted worker 1 presented job B and was refused: A failed.)"""
    shared, release = tmp_path / "shared", tmp_path / "release"
    args = [*WORKER, "--release", str(release)]
    port_a, port_b = free_port(), free_port()
    a_env = recovery_env(port_a, tmp_path / "a")
    a_sched = processes.start_role("a-scheduler", "MS_SCHED", args, a_env)
    a0 = processes.start_role("a-worker0", "MS_WORKER", args, {**a_env, "MS_NODE_ID": "0"})
    a1_env = recovery_env(port_a, shared, "1")
    a1 = processes.start_role("a-worker1", "MS_WORKER", args, a1_env)
    for worker in (a0, a1):
        worker.wait_for_output("allgather rank=", BOUND_S)
    job_a = json.loads((shared / "worker-1.json").read_text())["payload"]["cluster_id"]
    (shared / "worker-1.json").unlink()

    b_env = recovery_env(port_b, tmp_path / "b")
    processes.start_role("b-scheduler", "MS_SCHED", args, b_env)
    b1 = processes.start_role("b-worker1", "MS_WORKER", args, recovery_env(port_b, shared, "1"))
    assert b1.wait(BOUND_S) != 0, b1.output
    [line] = [line for line in b1.output.splitlines() if line.startswith("cluster: ")]
    assert f"MS_RECOVERY_PATH={str(shared)!r}" in line, line
    assert f"pid {a1.pid} on this host, job {job_a} holds worker-1.lock" in line, line
    assert "give each job its own MS_RECOVERY_PATH (mscluster run --recovery-path)" in line
    assert "Traceback" not in b1.output
    assert not (shared / "worker-1.json").exists()  # B's worker wrote nothing there

    a1.popen.send_signal(signal.SIGKILL)
    a1.wait(10)
    restarted = processes.start_role("a-worker1-restarted", "MS_WORKER", args, a1_env)
    restarted.wait_for_output("rejoined rank=1 size=2", NODE_TIMEOUT_S + BOUND_S)
    release.touch()
    for worker in (a0, restarted):
        assert worker.wait(BOUND_S) == 0, worker.output
    assert a_sched.wait(BOUND_S) == 0, a_sched.output
    assert re.search(r"after rank=1 generation=\d+ result=\[0, 1\]", restarted.output)


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = node_file.NodeLock(tmp_path, "7")
    assert first.take() == ""
    first.tell("job-a")
    second = node_file.NodeLock(tmp_path, "7")
    with pytest.raises(ConfigError) as refused:
        second.take()
    message = str(refused.value)
    assert f"pid {os.getpid()} on this host, job job-a holds worker-7.lock" in message
    assert f"MS_RECOVERY_PATH={str(tmp_path)!r}" in message
    first.release()
    assert second.take() == ""  # the lock goes with its holder
    second.release()
    assert (tmp_path / "worker-7.lock").exists()  # the file stays


def test_a_file_system_without_locks_is_said_and_the_worker_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    opened = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    line = node_file.NodeLock(tmp_path, "0").take()
    assert line.startswith(f"cannot lock {tmp_path / 'worker-0.lock'} (No locks available)")
    assert "give each job its own MS_RECOVERY_PATH" in line
    assert len(os.listdir("/proc/self/fd")) == opened  # nothing left open


def test_a_link_in_the_lock_s_place_is_refused_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("kept\n")
    (tmp_path / "worker-0.lock").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=r"worker-0\.lock is a symbolic link"):
        node_file.NodeLock(tmp_path, "0").take()
    assert elsewhere.read_text() == "kept\n"


def test_a_child_the_holder_forked_never_keeps_the_lock(tmp_path: Path) -> None:
    """A child forked by the worker (a data loader's) that outlives its lock does not hold it:
    it closed its copy of the descriptor at the fork."""
    held = node_file.NodeLock(tmp_path, "3")
    assert held.take() == ""
    go_read, go_write = os.pipe()
    up_read, up_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child says it runs, waits for the word, exits
        try:
            os.close(go_write)
            os.close(up_read)
            os.write(up_write, b"1")  # the fork's handlers in the child have run
            os.read(go_read, 1)  # until the parent closes its end (or ends)
        finally:
            os._exit(0)
    os.close(up_write)
    os.close(go_read)
    try:
        assert os.read(up_read, 1) == b"1"
        held.release()
        again = node_file.NodeLock(tmp_path, "3")
        assert again.take() == ""  # the child, still alive, holds nothing
        again.release()
    finally:
        os.close(go_write)  # the child's read returns: it exits
        os.close(up_read)
        os.waitpid(child, 0)


def test_a_worker_whose_lock_file_was_removed_locks_it_anew_or_writes_no_record(
    processes: Procs, tmp_path: Path
) -> None:
    """Both workers' lock files removed while they run (by hand, with the directory's other
    files); node 1's made anew and locked by another process of that node id before its worker
    looked. Each finds out before it writes its record at the end: worker 0 says so, locks the
    file there anew and writes its record; worker 1 writes none (the record is the other's now),
    saying in one line who holds it, and the job finishes."""
    release = tmp_path / "release"
    args = [*WORKER, "--release", str(release)]
    env = recovery_env(free_port(), tmp_path / "sched")
    sched = processes.start_role("scheduler", "MS_SCHED", args, env)
    paths = {node: tmp_path / f"w{node}" for node in ("0", "1")}
    workers = {
        node: processes.start_role(
            f"worker{node}", "MS_WORKER", args, recovery_env(int(env["MS_SCHED_PORT"]), path, node)
        )
        for node, path in paths.items()
    }
    for worker in workers.values():
        worker.wait_for_output("allgather rank=", BOUND_S)
    for node, path in paths.items():
        node_file.lock_path_for(path, node).unlink()
    other = node_file.NodeLock(paths["1"], "1")
    try:
        assert other.take() == ""  # nothing of worker 1's to see
        release.touch()
        for worker in (*workers.values(), sched):
            assert worker.wait(BOUND_S) == 0, worker.output
    finally:
        other.release()
    assert (
        f"{paths['0'] / 'worker-0.lock'} was removed or replaced while this worker held it, so "
        "it kept no other process of this node id out: locked the file there anew"
    ) in workers["0"].output
    records = {node: node_file.load(path, node) for node, path in paths.items()}
    assert records["0"] is not None
    assert records["0"].finished
    assert (
        f"{paths['1'] / 'worker-1.lock'} was removed or replaced while this worker held it, and "
        f"node '1' is already running on MS_RECOVERY_PATH={str(paths['1'])!r} (pid "
        f"{os.getpid()} on this host holds worker-1.lock)"
    ) in workers["1"].output
    assert records["1"] is not None
    assert not records["1"].finished  # its record at the start, none written since
    assert "Traceback" not in workers["1"].output
