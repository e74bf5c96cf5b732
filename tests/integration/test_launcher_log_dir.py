"""One `mscluster run` per log directory: real launchers, one holding the directory, another
refused with nothing of the first's changed; readers never kept out; a SIGKILLed launcher (and
its orphaned children) keeps no one out."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from cluster.storage import holder_lock
from cluster.testing import free_port, wait_until
from cluster.tools.launch_lock import LOCK_FILE
from cluster.tools.processes import alive, launched_pids
from tests.procs import ROOT, Procs, launched, mscluster, private_copy, run_args

LATE_INIT = ROOT / "tests" / "integration" / "scripts" / "late_init.py"


def run_to_end(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def snapshot(logs: Path) -> dict[str, bytes]:
    """What a second launcher would replace: the names in the directory, the job secret, the
    pids and worker 0's first line."""
    return {
        "names": "\n".join(sorted(p.name for p in logs.iterdir())).encode(),
        "job.secret": (logs / "job.secret").read_bytes(),
        "pids": (logs / "pids").read_bytes(),
        "worker_0.log": (logs / "worker_0.log").read_bytes().split(b"\n")[0],
    }


def test_a_second_launcher_on_a_held_log_dir_is_refused_and_the_job_goes_on(
    processes: Procs, tmp_path: Path
) -> None:
    """The review's two jobs in one directory: the second is one line and exit 2, naming the
    directory and the first launcher; the first job's secret, pids and logs are its own still,
    so `mscluster status` reads it and its restarted worker is taken back."""
    script, logs, port = private_copy(tmp_path), tmp_path / "logs", free_port()
    recovering = ["--enable-recovery", "--node-timeout", "2"]
    args = run_args(
        *recovering, script, "--hold", "8", worker_num=2, master_port=port, log_dir=logs
    )
    first = processes.start("first", args, os.environ)
    first.wait_for_output("2/2 registered (ready)", 30)
    wait_until(lambda: b"allgather" in (logs / "worker_0.log").read_bytes(), 15, "the gather")
    before = snapshot(logs)

    second = run_to_end(run_args(script, worker_num=1, master_port=free_port(), log_dir=logs))
    assert second.returncode == 2, second.stderr
    assert second.stderr.splitlines() == [
        f"mscluster: ConfigError: --log-dir {str(logs)!r} is in use by another mscluster run "
        f"(pid {first.pid} on this host, --master-port {port}), whose job secret, pids and logs "
        "this run would replace: give this job another --log-dir, or stop that job first"
    ]
    assert snapshot(logs) == before

    # The lock keeps launchers out, not readers.
    shown = mscluster(
        "status", "--addr", f"127.0.0.1:{port}", "--log-dir", str(logs), secret_file=None
    )
    assert shown.returncode == 0, shown.stderr
    os.kill(launched(logs, "worker_0"), signal.SIGKILL)
    first.wait_for_output("restarting it (restart 1 of 1)", 15)
    assert first.wait(60) == 0, first.output
    assert "rejoined rank=0 size=2" in (logs / "worker_0.log").read_text()


def test_a_sigkilled_launcher_keeps_no_one_out_of_its_log_dir(
    processes: Procs, tmp_path: Path
) -> None:
    """The kernel drops the lock with the launcher; its children, orphaned and still running,
    never held it: the next launcher in the directory runs its job."""
    started, go, logs = tmp_path / "started", tmp_path / "go", tmp_path / "logs"
    crashed = processes.start(
        "crashed",
        run_args(LATE_INIT, started, go, worker_num=1, master_port=free_port(), log_dir=logs),
        os.environ,
    )
    wait_until(started.exists, 30, "the worker to start")
    children = {name: pid for name, pid in launched_pids(logs).items() if name != "launcher"}
    orphans = list(children.values())
    crashed.popen.send_signal(signal.SIGKILL)
    crashed.wait(10)
    try:
        assert (logs / LOCK_FILE).exists()  # left behind, naming a launcher gone
        assert alive(children["worker_0"])  # waits for `go`, orphaned, holding no lock
        script = private_copy(tmp_path)
        after = run_to_end(run_args(script, worker_num=1, master_port=free_port(), log_dir=logs))
        assert after.returncode == 0, after.stderr
        assert "job finished: 1 local worker exited 0" in after.stderr
    finally:
        for pid in orphans:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(pid) for pid in orphans), 10, "the orphans to end")


def test_a_recovering_job_killed_whole_resumes_when_run_again_in_its_log_dir(
    processes: Procs, tmp_path: Path
) -> None:
    """The recovery guide's "the scheduler and every worker die: start them all again": the same
    `mscluster run --enable-recovery` in the same log directory keeps the job's secret, under
    which the scheduler takes its saved state back (a new secret would be another job's)."""
    script, logs, port = private_copy(tmp_path), tmp_path / "logs", free_port()
    recovering = ["--enable-recovery", "--node-timeout", "2"]
    args = run_args(
        *recovering, script, "--hold", "30", worker_num=2, master_port=port, log_dir=logs
    )
    first = processes.start("first", args, os.environ)
    first.wait_for_output("2/2 registered (ready)", 30)
    secret = (logs / "job.secret").read_bytes()
    everyone = list(launched_pids(logs).values())
    for pid in everyone:
        os.kill(pid, signal.SIGKILL)
    first.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in everyone), 10, "the job to be gone")

    again = run_to_end(run_args(*recovering, script, worker_num=2, master_port=port, log_dir=logs))
    assert again.returncode == 0, again.stderr
    assert (logs / "job.secret").read_bytes() == secret
    assert "resuming job" in (logs / "scheduler.log").read_text()


def test_a_launcher_whose_lock_file_was_removed_locks_a_new_one_that_keeps_others_out(
    processes: Procs, tmp_path: Path
) -> None:
    """`launcher.lock` removed while the job runs (by hand, with the directory's other files):
    within a check the launcher says so and locks the file there anew, and a second launcher
    is refused, naming it, as before; the first job finishes."""
    started, go, logs = tmp_path / "started", tmp_path / "go", tmp_path / "logs"
    late = run_args(LATE_INIT, started, go, worker_num=1, master_port=free_port(), log_dir=logs)
    first = processes.start("first", late, os.environ)
    wait_until(started.exists, 30, "the worker to start")
    (logs / LOCK_FILE).unlink()
    first.wait_for_output("was removed or replaced while this run held it, so it kept", 15)
    assert "locked the file there anew" in first.output

    second = run_to_end(run_args(private_copy(tmp_path), master_port=free_port(), log_dir=logs))
    assert second.returncode == 2, second.stderr
    assert f"in use by another mscluster run (pid {first.pid} on this host" in second.stderr
    go.touch()
    assert first.wait(60) == 0, first.output
    assert "job finished: 1 local worker exited 0" in first.output


def test_a_launcher_whose_lock_file_another_took_says_so_and_its_job_goes_on(
    processes: Procs, tmp_path: Path
) -> None:
    """The file removed while the launcher was stopped, and locked anew by another run before
    it looked (one that locks the file alone: a launcher does not get past the directory's
    lock): it says in one line who holds the file now, and its job goes on (it is not stopped
    for a lock file); once the other lets go, it holds the file again."""
    started, go, logs = tmp_path / "started", tmp_path / "go", tmp_path / "logs"
    late = run_args(LATE_INIT, started, go, worker_num=1, master_port=free_port(), log_dir=logs)
    first = processes.start("first", late, os.environ)
    wait_until(started.exists, 30, "the worker to start")
    first.signal(signal.SIGSTOP)
    wait_until(first.stopped, 10, "the launcher to stop")
    (logs / LOCK_FILE).unlink()
    # A run that locks the file alone (a launcher whose file system locks no directory).
    other = holder_lock.Hold(logs / LOCK_FILE, port=8118)
    try:
        assert other.open_and_lock() is None  # nothing of the first's to see
        first.signal(signal.SIGCONT)
        first.wait_for_output("has locked the file there since", 15)
        assert (
            f"another mscluster run (pid {os.getpid()} on this host, --master-port 8118) has "
            "locked the file there since: this job goes on"
        ) in first.output
        assert first.running
    finally:
        other.release()
    first.wait_for_output(f"this run holds {str(logs / LOCK_FILE)!r} again", 15)
    go.touch()
    assert first.wait(60) == 0, first.output
    assert "job finished: 1 local worker exited 0" in first.output
    assert first.output.count("has locked the file there since") == 1


def whole(logs: Path, *, skip: tuple[str, ...] = ()) -> dict[str, object]:
    """Everything of `logs` a newcomer could change: each name with its inode, mode, mtime and
    bytes (those of `skip`, written by the running job meanwhile, their names and inodes only),
    and the directory's own mtime."""
    found: dict[str, object] = {".": logs.stat().st_mtime_ns}
    for path in sorted(logs.iterdir()):
        st = path.lstat()
        written = path.name not in skip and path.is_file()
        found[path.name] = (
            st.st_ino,
            st.st_mode,
            st.st_mtime_ns if written else 0,
            path.read_bytes() if written else b"",
        )
    return found


def test_a_launcher_started_while_the_lock_file_is_gone_changes_nothing_there(
    processes: Procs, tmp_path: Path
) -> None:
    """`launcher.lock` removed, then replaced by an old run's copy, behind a running launcher
    (stopped, so that it cannot lock the file anew first): a second `mscluster run` in the
    directory is refused all the same, by the directory's own lock, before it makes or writes
    anything: the directory is exactly as it was. The first then locks its file anew, and the
    next newcomer's refusal names it; its job finishes."""
    started, go, logs = tmp_path / "started", tmp_path / "go", tmp_path / "logs"
    late = run_args(LATE_INIT, started, go, worker_num=1, master_port=free_port(), log_dir=logs)
    first = processes.start("first", late, os.environ)
    wait_until(started.exists, 30, "the worker to start")
    events = logs / "events.jsonl"
    wait_until(lambda: events.exists() and events.stat().st_size > 0, 30, "the scheduler's start")
    first.signal(signal.SIGSTOP)
    wait_until(first.stopped, 10, "the launcher to stop")
    script = private_copy(tmp_path)
    (logs / LOCK_FILE).unlink()
    for stale in (None, '{"pid": 1, "host": "gone", "port": 1}\n'):
        if stale is not None:  # replaced: a copy of another run's, made beside and moved in
            (tmp_path / "copy").write_text(stale)
            os.replace(tmp_path / "copy", logs / LOCK_FILE)
        before = whole(logs, skip=("scheduler.log", "events.jsonl"))
        second = run_to_end(run_args(script, worker_num=1, master_port=free_port(), log_dir=logs))
        assert second.returncode == 2, second.stderr
        named = (
            "(pid 1 on host gone, --master-port 1)"
            if stale
            else (
                f"(which holds the directory; its {LOCK_FILE} was removed or replaced since and "
                "names no one)"
            )
        )
        assert second.stderr.splitlines() == [
            f"mscluster: ConfigError: --log-dir {str(logs)!r} is in use by another mscluster "
            f"run {named}, whose job secret, pids and logs this run would replace: give this "
            "job another --log-dir, or stop that job first"
        ]
        assert whole(logs, skip=("scheduler.log", "events.jsonl")) == before

    first.signal(signal.SIGCONT)
    first.wait_for_output("so it kept no other launcher out: locked the file there anew", 15)
    third = run_to_end(run_args(script, worker_num=1, master_port=free_port(), log_dir=logs))
    assert third.returncode == 2, third.stderr
    assert f"in use by another mscluster run (pid {first.pid} on this host" in third.stderr
    go.touch()
    assert first.wait(60) == 0, first.output
    assert "job finished: 1 local worker exited 0" in first.output
