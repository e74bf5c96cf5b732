"""`mscluster run` at its edges: a terminal that goes away, options it cannot use, signals."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from cluster.tools import launch_setup
from cluster.tools.processes import launched_pid
from tests import tmpfs
from tests.procs import (
    MSCLUSTER,
    ROOT,
    Process,
    Procs,
    launched,
    private_copy,
    processes_running,
    reader_env,
    run_args,
)

# A worker that prints far more than a pipe holds (64 KiB) once it is in the job.
CHATTY = """
import cluster

cluster.init()
for line in range({lines}):
    print(f"line {{line}} " + "x" * 90, flush=True)
cluster.finalize()
"""
CHATTY_LINES = 3000


def chatty_script(tmp_path: Path) -> Path:
    script = tmp_path / "job" / "chatty.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(CHATTY.format(lines=CHATTY_LINES))
    return script


def test_join_whose_reader_went_away_finishes_the_job_with_whole_logs(tmp_path: Path) -> None:
    """`mscluster run --join train.py 2>&1 | head -1`: the echo stops, the job does not."""
    script = chatty_script(tmp_path)
    logs = tmp_path / "logs"
    run = subprocess.Popen(
        run_args("--join", script, worker_num=2, master_port=free_port(), log_dir=logs),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert run.stdout is not None
        assert run.stdout.readline()
        run.stdout.close()  # the reader goes away
        code = run.wait(60)
    finally:
        run.kill()
        run.wait(10)
    assert code == 0
    for worker in ("worker_0", "worker_1"):
        text = (logs / f"{worker}.log").read_text()
        assert f"line {CHATTY_LINES - 1} " in text, text[-300:]
    assert not processes_running(str(script))


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a usage error gives (exit 2, no traceback)."""
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


def run_in(tmp_path: Path, log_dir: Path) -> subprocess.CompletedProcess[str]:
    script = chatty_script(tmp_path)
    args = ["run", "--master-port", str(free_port()), "--log-dir", str(log_dir), str(script)]
    return subprocess.run(
        [*MSCLUSTER, *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_a_log_dir_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    line = one_line(run_in(tmp_path, tmp_path / "file" / "sub"))
    assert line.startswith("mscluster: ConfigError: --log-dir: cannot write in ")
    assert "Not a directory" in line


def test_an_unwritable_log_dir_is_one_line(tmp_path: Path) -> None:
    with tmpfs.mounted(read_only=True) as read_only:
        line = one_line(run_in(tmp_path, read_only))
    assert line.startswith("mscluster: ConfigError: --log-dir: cannot write in ")
    assert "Read-only file system" in line


def slurm_step_env(rank: int, nodelist: str) -> dict[str, str]:
    """This environment as srun gives it to node `rank`'s task of step 31.2 over the two nodes
    of `nodelist`, with no job secret given: the nodes share one that node 0 makes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "CLUSTER_JOB"))}
    step = {
        "SLURM_JOB_ID": "31",
        "SLURM_STEP_ID": "2",
        "SLURM_NODEID": str(rank),
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": nodelist,
    }
    return {**env, **step, "PYTHONPATH": str(ROOT)}


def test_a_full_log_dir_is_one_line_and_leaves_nothing_made(tmp_path: Path) -> None:
    """The directories made, the lock taken, then the job secret refused (ENOSPC): the run is
    refused as if it had not begun, with no directory, lock or empty job.secret left."""
    with tmpfs.mounted("256k") as disk:
        tmpfs.fill(disk)
        line = one_line(run_in(tmp_path, disk / "a" / "b" / "logs"))
        left = sorted(p.name for p in disk.iterdir())
    assert line == (
        f"mscluster: ConfigError: --log-dir: cannot write the job secret in "
        f"{str(disk / 'a' / 'b' / 'logs')!r} (No space left on device)"
    )
    assert left == ["filler"]


def test_a_slurm_node_whose_log_dir_is_full_leaves_nothing_made(tmp_path: Path) -> None:
    """Node 0 of a Slurm step shares the secret through the working directory, then cannot copy
    it into its full log directory: one line; the log directories, its copy and the shared
    file are gone."""
    env = slurm_step_env(0, "localhost,127.0.0.2")
    script = chatty_script(tmp_path)
    with tmpfs.mounted("256k") as disk:
        tmpfs.fill(disk)
        args = ["run", "--master-port", str(free_port()), "--log-dir", str(disk / "logs")]
        result = subprocess.run(
            [*MSCLUSTER, *args, str(script)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=env,
            cwd=tmp_path,
        )
        line = one_line(result)
        left = sorted(p.name for p in disk.iterdir())
    assert line.startswith("mscluster: ConfigError: cannot write the job secret to ")
    assert "node0/job.secret (No space left on device)" in line
    assert left == ["filler"]
    assert list((tmp_path / ".mscluster").iterdir()) == []


def test_a_refused_recovery_path_leaves_no_new_directory(tmp_path: Path) -> None:
    """Refused once made (a parent others may write without the sticky bit): the log and
    recovery directories made for the run are removed, as if it had not begun."""
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    script = chatty_script(tmp_path)
    logs = tmp_path / "logs" / "deep"
    args = ["run", "--master-port", str(free_port()), "--log-dir", str(logs), "--enable-recovery"]
    args += ["--recovery-path", str(open_to_all / "job" / "state"), str(script)]
    result = subprocess.run(
        [*MSCLUSTER, *args], capture_output=True, text=True, timeout=30, check=False
    )
    line = one_line(result)
    assert line.startswith("mscluster: ConfigError: --recovery-path: ")
    assert "can be written by others without the sticky bit" in line
    assert not (tmp_path / "logs").exists()
    assert list(open_to_all.iterdir()) == []


def chaos(tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    script = chatty_script(tmp_path)
    logs = str(tmp_path / "logs")
    run_options = ["--worker-num", "2", "--local-worker-num", "2", "--log-dir", logs]
    return subprocess.run(
        [*MSCLUSTER, "chaos", *options, "--", *run_options, str(script)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_chaos_report_in_a_missing_directory_is_one_line_before_the_run(
    tmp_path: Path,
) -> None:
    report = tmp_path / "missing" / "r.json"
    line = one_line(chaos(tmp_path, "--report", str(report), "--count", "1"))
    assert line.startswith(f"mscluster: ConfigError: --report {str(report)!r}: cannot write")
    assert "No such file or directory" in line
    assert not (tmp_path / "logs" / "job.secret").exists()  # no job was started


def test_bad_chaos_options_touch_nothing_of_the_previous_run(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    kept = {logs / "events.jsonl": "the previous run's events\n", logs / "job.secret": "s\n"}
    for path, text in kept.items():
        path.write_text(text)
    line = one_line(chaos(tmp_path, "--every", "0"))
    assert "--every must be > 0" in line
    for path, text in kept.items():
        assert path.read_text() == text


def hold_args(tmp_path: Path, script: Path, *extra: str) -> list[str]:
    logs = tmp_path / "logs"
    return run_args(
        *extra, script, "--hold", "60", worker_num=2, master_port=free_port(), log_dir=logs
    )


def held_job_and_its_relay_directory(
    processes: Procs, tmp_path: Path, script: Path
) -> tuple[Process, Path]:
    """`mscluster run` of `script` holding its 2 workers, once they are registered, and the
    directory of its relay's socket (from the relay's command line)."""
    run = processes.start("run", hold_args(tmp_path, script), os.environ)
    run.wait_for_output("2/2 registered (ready)", 30)
    relay = Path(f"/proc/{launched(tmp_path / 'logs', 'relay')}/cmdline").read_bytes()
    (socket,) = [arg for arg in relay.decode().split("\0") if arg.startswith("unix:")]
    return run, Path(socket.removeprefix("unix:")).parent


def test_sighup_stops_every_child_and_removes_the_relay_directory(
    processes: Procs, tmp_path: Path
) -> None:
    """The terminal of `mscluster run` closes: as SIGTERM, its children stopped, its files gone."""
    script = private_copy(tmp_path)
    run, directory = held_job_and_its_relay_directory(processes, tmp_path, script)
    assert directory.is_dir()
    run.popen.send_signal(signal.SIGHUP)
    assert run.wait(15) == 128 + signal.SIGHUP, run.output
    assert "SIGHUP received; stopping every process of the job" in run.output
    assert not directory.exists()
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


def test_a_launcher_killed_leaves_no_relay_directory_behind(
    processes: Procs, tmp_path: Path
) -> None:
    """SIGKILL of `mscluster run` (the OOM killer, a preempted node): it removes nothing, but
    its relay, which stops once its launcher is gone, takes its socket, its lock file and their
    directory with it."""
    script = private_copy(tmp_path)
    run, directory = held_job_and_its_relay_directory(processes, tmp_path, script)
    assert sorted(p.name for p in directory.iterdir()) == ["relay.sock", "relay.sock.lock"]
    run.popen.kill()
    run.wait(15)
    wait_until(lambda: not processes_running(str(script)), 30, "no process of the job left")
    wait_until(lambda: not directory.exists(), 30, f"{directory} to be removed by the relay")


def ignores_sighup(pid: int) -> bool:
    """Whether process `pid` ignores SIGHUP (its SigIgn mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")]
    return bool(int(mask, 16) & 1 << (signal.SIGHUP - 1))


def test_under_nohup_sighup_leaves_the_job_running(processes: Procs, tmp_path: Path) -> None:
    """`nohup mscluster run ... &` and the ssh session closes: SIGHUP, ignored as nohup set it,
    stops nothing, before the launcher watches its children or after; the job ends as it would."""
    script = private_copy(tmp_path)
    args = hold_args(tmp_path, script)
    args[-1] = "3"  # --hold 3: the job ends by itself
    run = processes.start("run", ["nohup", *args], os.environ)
    wait_until(lambda: ignores_sighup(run.pid), 10, "nohup to ignore SIGHUP")

    def hung_up_and_over() -> bool:
        run.signal(signal.SIGHUP)  # the launcher itself: nohup execs it
        return not run.running

    wait_until(hung_up_and_over, 60, "the job to end while SIGHUP comes again and again")
    assert run.wait(1) == 0, run.output
    assert "SIGHUP" not in run.output
    assert "job finished: 2 local workers exited 0" in run.output
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


# Imported first by every Python the test starts: the relay (a launcher's child without MS_ROLE)
# never gets to take connections.
STALLED_RELAY = """
import contextlib
import json
import os
import time

if "CLUSTER_LAUNCHER_PID" in os.environ and "MS_ROLE" not in os.environ:
    time.sleep(120)  # sleep-ok: the fault itself, a relay that never serves (killed sooner)
"""


def test_a_stop_signal_while_the_relay_starts_is_acted_on_at_once(
    processes: Procs, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALLED_RELAY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    run = processes.start("run", hold_args(tmp_path, script), env)
    wait_until(lambda: launched_pid(logs, "relay") is not None, 30, "the relay started")
    assert launched_pid(logs, "worker_0") is None  # the launcher waits for the relay
    run.popen.send_signal(signal.SIGTERM)
    assert run.wait(10) == 128 + signal.SIGTERM, run.output
    assert launched_pid(logs, "worker_0") is None
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_before_the_launcher_watches_is_one_line(
    processes: Procs, tmp_path: Path, sig: signal.Signals
) -> None:
    """Node 1 of a Slurm step waits for the secret node 0 makes; Ctrl-C there (or its terminal
    closing): one line, 128 + the signal."""
    env = slurm_step_env(1, "n[1-2]")
    logs = tmp_path / "logs"
    args = ["--master-addr", "127.0.0.1", "--worker-num", "2", "--local-worker-num", "1"]
    run = processes.start(
        "run", [*hold_args(tmp_path, private_copy(tmp_path), *args)], env, cwd=tmp_path
    )
    wait_until(logs.exists, 30, "the launcher's log directory (then it awaits the secret)")
    run.popen.send_signal(sig)
    assert run.wait(10) == 128 + sig, run.output
    assert run.output.strip().splitlines()[-1] == f"mscluster: {sig.name} received; stopped"
    assert "Traceback" not in run.output
    assert not logs.exists()  # made for the run, removed with it


def test_a_stop_signal_while_the_launcher_awaits_its_scheduler_is_acted_on_at_once(
    processes: Procs, tmp_path: Path
) -> None:
    """Node 0's worker finished; the scheduler serves node 1's, which holds: node 0's launcher
    awaits its scheduler's exit (up to 30 s), and a SIGTERM then ends it at once."""
    script = private_copy(tmp_path)
    node_args = functools.partial(
        run_args, worker_num=2, local_worker_num=1, master_port=free_port()
    )
    runs = [
        processes.start(
            f"node{rank}",
            node_args("--node-rank", str(rank), script, *hold, log_dir=tmp_path / f"node{rank}"),
            os.environ,
        )
        for rank, hold in ((0, []), (1, ["--hold", "60"]))
    ]
    done = tmp_path / "node0" / "worker_0.log"
    wait_until(
        lambda: done.exists() and "allgather rank=0" in done.read_text(), 30, "its worker done"
    )
    wait_until(
        lambda: launched_pid(tmp_path / "node0", "worker_0") is None, 10, "its worker exited"
    )
    runs[0].popen.send_signal(signal.SIGTERM)
    assert runs[0].wait(10) == 128 + signal.SIGTERM, runs[0].output
    assert "SIGTERM received" in runs[0].output


def test_a_scheduler_stopped_by_sigterm_alone_is_started_again_and_ends_the_job(
    processes: Procs, tmp_path: Path
) -> None:
    """With recovery, SIGTERM alone (`kill PID`) leaves the job to resume and the scheduler
    exits 0 before the job's end: the launcher starts it again, and the job ends through it."""
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    args = run_args(
        "--enable-recovery", script, worker_num=2, master_port=free_port(), log_dir=logs
    )
    run = processes.start("run", [*args, "--hold", "6"], {**os.environ, "MS_NODE_TIMEOUT": "5"})
    run.wait_for_output("2/2 registered (ready)", 30)
    os.kill(launched(logs, "scheduler"), signal.SIGTERM)
    run.wait_for_output("scheduler restart 1 of 1", 15)
    assert run.wait(60) == 0, run.output
    assert "exited with code 0 before the job's end (it left the job to resume)" in run.output
    assert "after 1 scheduler restart" in run.output
    kinds = [json.loads(line)["event"] for line in (logs / "events.jsonl").read_text().splitlines()]
    assert kinds.index("resumed") < kinds.index("finished"), kinds  # the job ends through it
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


def test_no_progress_line_pairs_an_answer_older_than_a_workers_exit(
    processes: Procs, tmp_path: Path
) -> None:
    """Output not a terminal: a progress line comes from an answer asked after the last exit.
    The scheduler stopped (SIGSTOP) answers no more; a worker killed then is no line beside
    the job as the scheduler last showed it ("2/2 registered (ready) | ... running 1/2")."""
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    run = processes.start("run", hold_args(tmp_path, script, "--no-relay"), os.environ)
    run.wait_for_output("2/2 registered (ready) | local workers running 2/2", 30)
    scheduler = launched(logs, "scheduler")
    os.kill(scheduler, signal.SIGSTOP)
    try:
        os.kill(launched(logs, "worker_1"), signal.SIGKILL)
        assert run.wait(30) == 1, run.output
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(scheduler, signal.SIGCONT)
    assert "worker 1 (rank 1, node id '1') was killed by SIGKILL" in run.output
    assert "running 1/2" not in run.output, run.output
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


@pytest.mark.parametrize("master", ["[::1]", "::1"])
def test_an_ipv6_master_address_runs_the_job_with_or_without_brackets(
    tmp_path: Path, master: str
) -> None:
    if not launch_setup.is_local_address("::1"):
        pytest.skip("no IPv6 loopback on this machine")
    script = private_copy(tmp_path)
    port = free_port()
    logs = tmp_path / "logs"
    args = run_args("--master-addr", master, script, worker_num=2, master_port=port, log_dir=logs)
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert f"with the scheduler at [::1]:{port}" in result.stderr
    assert "job finished: 2 local workers exited 0" in result.stderr


def test_a_follow_of_a_failed_job_exits_1_from_the_file_and_from_the_leader(
    processes: Procs, tmp_path: Path
) -> None:
    """`mscluster events --follow` ends at the job's last event: `job_failed` is exit 1. With
    --addr naming several schedulers (one gone here), the one that answers is followed."""
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    args = hold_args(tmp_path, script)
    port = args[args.index("--master-port") + 1]
    run = processes.start("run", args, os.environ)
    run.wait_for_output("2/2 registered (ready)", 30)
    operator = reader_env(logs / "job.secret")
    addrs = f"127.0.0.1:{free_port()},127.0.0.1:{port}"
    followers = [
        processes.start(name, [*MSCLUSTER, "events", *where, "--follow"], operator)
        for name, where in (
            ("from-addr", ["--addr", addrs]),
            ("from-file", ["--log-dir", str(logs)]),
        )
    ]
    for follower in followers:
        wait_until(lambda f=follower: " formed " in f.output, 30, f"{follower.name} at formed")
    os.kill(launched(logs, "worker_1"), signal.SIGKILL)
    assert run.wait(30) == 1, run.output
    for follower in followers:
        assert follower.wait(30) == 1, follower.output
        assert "job_failed" in follower.output.splitlines()[-1], follower.output
