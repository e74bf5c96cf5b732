"""`mscluster run`, `mscluster status`: real launcher processes, real signals, no orphans."""

from __future__ import annotations

import functools
import json
import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from tests.netns import two_hosts
from tests.procs import (
    MSCLUSTER,
    PYTHON,
    ROOT,
    Procs,
    job_env,
    launched,
    mscluster,
    private_copy,
    processes_running,
    run_args,
)

EXAMPLE = ROOT / "examples" / "allgather_check.py"


def test_run_four_workers_writes_the_logs(tmp_path: Path) -> None:
    script = private_copy(tmp_path)
    port = free_port()
    logs = tmp_path / "logs"
    args = run_args(script, worker_num=4, local_worker_num=4, master_port=port, log_dir=logs)
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in logs.iterdir()) == [
        "events.jsonl",  # the scheduler's event log
        "events.jsonl.lock",  # held by the scheduler that writes it: one at a time
        "job.secret",
        "launcher.lock",  # held while the launcher runs: no other launcher in this directory
        "pids",  # what the launcher started
        "relay.log",  # the relay its four workers share
        "scheduler.log",
        "worker_0.log",
        "worker_1.log",
        "worker_2.log",
        "worker_3.log",
    ]
    # The job's own secret, readable by its owner only, and in no log.
    secret = logs / "job.secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    token = secret.read_text().strip()
    assert len(token) == 64
    for i in range(4):
        text = (logs / f"worker_{i}.log").read_text()
        assert f"allgather rank={i} size=4 result=[0, 1, 2, 3]" in text
        assert token not in text
    scheduler_log = (logs / "scheduler.log").read_text()
    assert "job finished" in scheduler_log
    assert "nodes join with proof of the job secret" in scheduler_log
    assert token not in scheduler_log + result.stderr
    assert "job finished: 4 local workers exited 0" in result.stderr
    assert not processes_running(str(script))


def test_a_worker_dying_of_an_error_is_named_with_the_error(
    processes: Procs, tmp_path: Path
) -> None:
    """The scheduler sees only rank 1's connection break; the launcher names the cause, the
    first line of the error in the worker's log (a data-plane error, NCCL's, looks like this),
    though the scheduler and rank 0 (told of the failure, it raises JobFailedError) may exit
    before the launcher sees rank 1's exit."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import cluster\n"
        "cluster.init()\n"
        "if cluster.get_rank() == 1:\n"
        "    raise RuntimeError('NCCL error: Duplicate GPU detected\\nLast error: more')\n"
        "cluster.barrier()\n"
    )
    args = run_args(script, worker_num=2, master_port=free_port(), log_dir=tmp_path / "logs")
    run = processes.start("run", args, os.environ)
    assert run.wait(60) == 1, run.output
    assert (
        "worker 1 (rank 1, node id '1') exited with code 1: RuntimeError: NCCL error: Duplicate "
        "GPU detected\n" in run.output
    ), run.output
    # The worker told the scheduler what it died of, before its connection broke.
    scheduler = (tmp_path / "logs" / "scheduler.log").read_text()
    assert (
        "node '1' (rank 1) failed: its process died of an error: RuntimeError: NCCL error: "
        "Duplicate GPU detected" in scheduler
    ), scheduler


def test_sigkill_of_a_worker_fails_the_run_naming_the_rank(
    processes: Procs, tmp_path: Path
) -> None:
    script = private_copy(tmp_path)
    port = free_port()
    logs = tmp_path / "logs"
    args = run_args(script, "--hold", "60", worker_num=4, master_port=port, log_dir=logs)
    run = processes.start("run", args, os.environ)
    wait_until(
        lambda: (
            all(
                "allgather" in (logs / f"worker_{i}.log").read_text()
                for i in range(4)
                if (logs / f"worker_{i}.log").exists()
            )
            and len(list(logs.glob("worker_*.log"))) == 4
        ),
        30,
        "every worker's allgather line",
    )
    os.kill(launched(logs, "worker_2"), signal.SIGKILL)
    killed = time.monotonic()
    assert run.wait(15) == 1, run.output
    took = time.monotonic() - killed
    assert "worker 2 (rank 2, node id '2') was killed by SIGKILL" in run.output, run.output
    assert "last lines of" in run.output
    assert "allgather rank=2" in run.output  # the tail of the dead worker's log
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")
    print(f"mscluster run exited {took:.2f} s after the SIGKILL")
    # A job failing without recovery: each process says so in one line, and nothing else.
    assert "job failed: rank 2" in (logs / "scheduler.log").read_text()
    for name in ("scheduler", "worker_0", "worker_1", "worker_3"):
        text = (logs / f"{name}.log").read_text()
        for unwanted in ("Traceback", "CancelledError", "never awaited"):
            assert unwanted not in text, f"{name}.log:\n{text}"


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_every_process(processes: Procs, tmp_path: Path, sig: int, code: int) -> None:
    script, logs = private_copy(tmp_path), tmp_path / "logs"
    args = run_args(script, "--hold", "60", worker_num=3, master_port=free_port(), log_dir=logs)
    run = processes.start("run", args, os.environ)
    run.wait_for_output("3/3 registered (ready)", 30)
    run.popen.send_signal(sig)
    assert run.wait(10) == code, run.output
    assert f"{signal.Signals(sig).name} received" in run.output
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


def test_join_streams_output_prefixed_by_rank(tmp_path: Path) -> None:
    script, logs = private_copy(tmp_path), tmp_path / "logs"
    args = run_args("--join", script, worker_num=2, master_port=free_port(), log_dir=logs)
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "[rank 0] allgather rank=0 size=2 result=[0, 1]" in result.stderr
    assert "[rank 1] allgather rank=1 size=2 result=[0, 1]" in result.stderr
    assert "allgather rank=1" in (tmp_path / "logs" / "worker_1.log").read_text()


def test_with_recovery_its_killed_scheduler_is_started_again_by_default(
    processes: Procs, tmp_path: Path
) -> None:
    """No --max-restarts: with recovery on, a scheduler killed once is started again and the
    job goes on (without recovery the default stays 0)."""
    script, logs = private_copy(tmp_path), tmp_path / "logs"
    args = run_args(
        "--enable-recovery", script, worker_num=2, master_port=free_port(), log_dir=logs
    )
    run = processes.start("run", [*args, "--hold", "6"], {**os.environ, "MS_NODE_TIMEOUT": "5"})
    run.wait_for_output("2/2 registered (ready)", 30)
    os.kill(launched(tmp_path / "logs", "scheduler"), signal.SIGKILL)
    run.wait_for_output("scheduler restart 1 of 1", 15)
    assert run.wait(60) == 0, run.output
    assert "after 1 scheduler restart" in run.output


def test_an_msrun_launch_line_runs_with_msrun_replaced(tmp_path: Path) -> None:
    """The tutorial's 8-worker AllGather started by a MindSpore 2.x msrun line, word for word
    but for `msrun` -> `mscluster run` (and a free port)."""
    script = private_copy(tmp_path)
    logs = tmp_path / "logs"
    line = (
        "--worker_num=8 --local_worker_num=8 --master_addr=127.0.0.1 "
        f"--master_port={free_port()} --node_rank=0 --log_dir={logs} --join=True "
        f"--cluster_time_out=300 {script}"
    )
    args = [*MSCLUSTER, "run", *line.split()]
    result = subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr
    expected = list(range(8))
    for rank in range(8):
        found = f"allgather rank={rank} size=8 result={expected}"
        assert found in (logs / f"worker_{rank}.log").read_text()
        assert f"[rank {rank}] {found}" in result.stderr  # --join=True: streamed
    assert "job finished: 8 local workers exited 0" in result.stderr
    assert not processes_running(str(script))


@pytest.mark.parametrize("shared_secret", [False, True], ids=["open", "shared-secret"])
def test_two_invocations_form_one_job(
    processes: Procs, tmp_path: Path, shared_secret: bool
) -> None:
    """Launchers of a job across hosts share the secret they are given; without one, each says
    that the job is open, and neither invents one the other could not know."""
    script = private_copy(tmp_path)
    port = free_port()
    env = dict(os.environ)
    if shared_secret:
        secret = tmp_path / "shared.secret"
        secret.write_text("a secret both hosts hold\n")
        secret.chmod(0o600)
        env["CLUSTER_JOB_SECRET_FILE"] = str(secret)
    node_args = functools.partial(run_args, worker_num=4, local_worker_num=2, master_port=port)
    runs = [
        processes.start(
            f"node{rank}",
            node_args("--node-rank", str(rank), script, log_dir=tmp_path / f"node{rank}"),
            env,
        )
        for rank in (0, 1)
    ]
    for run in runs:
        assert run.wait(60) == 0, run.output
        says_open = "the job spans hosts and has no job secret" in run.output
        assert says_open is not shared_secret, run.output
    assert (tmp_path / "node0" / "scheduler.log").exists()
    assert not (tmp_path / "node1" / "scheduler.log").exists()
    assert not list(tmp_path.glob("node*/job.secret"))
    joining = (
        "nodes join with proof of the job secret"
        in (tmp_path / "node0" / "scheduler.log").read_text()
    )
    assert joining is shared_secret
    # Each worker's log is named by its rank, as msrun names it: the two hosts' logs gathered in
    # one place do not collide.
    logs = [sorted(p.name for p in (tmp_path / f"node{n}").glob("worker_*.log")) for n in (0, 1)]
    assert logs == [["worker_0.log", "worker_1.log"], ["worker_2.log", "worker_3.log"]]
    lines = [
        (tmp_path / f"node{rank // 2}" / f"worker_{rank}.log").read_text().strip()
        for rank in range(4)
    ]
    assert lines == [f"allgather rank={r} size=4 result=[0, 1, 2, 3]" for r in range(4)]


FLAKY = """
import os, sys
from pathlib import Path
marker = Path(os.environ["FLAKY_DIR"]) / ("started-" + os.environ["MS_NODE_ID"])
if os.environ["MS_NODE_ID"] == "1" and not marker.exists():
    marker.write_text("once")
    sys.exit(3)  # fails once, before joining the job
import cluster
cluster.init()
print("joined", cluster.get_rank(), flush=True)
"""


@pytest.mark.parametrize(("restarts", "expected"), [(1, 0), (0, 1)])
def test_max_restarts_restarts_a_worker_that_failed_before_the_job_formed(
    tmp_path: Path, restarts: int, expected: int
) -> None:
    script = tmp_path / "job" / "flaky.py"
    script.parent.mkdir()
    script.write_text(FLAKY)
    logs = tmp_path / "logs"
    args = run_args(
        "--max-restarts", str(restarts), script, worker_num=2, master_port=free_port(), log_dir=logs
    )
    env = {**os.environ, "FLAKY_DIR": str(tmp_path)}
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == expected, result.stderr
    if restarts:
        assert (
            "worker 1 (rank 1, node id '1') exited with code 3; restarting it (restart 1 of 1)"
            in (result.stderr)
        )
        assert "after 1 restart" in result.stderr
        assert "joined 1" in (tmp_path / "logs" / "worker_1.log").read_text()
    else:
        assert "worker 1 (rank 1, node id '1') exited with code 3" in result.stderr
        assert "restarting" not in result.stderr
    assert not processes_running(str(script))


def test_no_restart_once_the_job_has_failed_without_recovery(
    processes: Procs, tmp_path: Path
) -> None:
    script, logs = private_copy(tmp_path), tmp_path / "logs"
    args = run_args(
        "--max-restarts", "2", script, worker_num=2, master_port=free_port(), log_dir=logs
    )
    run = processes.start("run", [*args, "--hold", "60"], os.environ)
    run.wait_for_output("2/2 registered (ready)", 30)
    os.kill(launched(tmp_path / "logs", "worker_0"), signal.SIGKILL)
    assert run.wait(15) == 1, run.output
    assert "not restarting it" in run.output
    assert "recovery is off" in run.output
    wait_until(lambda: not processes_running(str(script)), 10, "no process of the job left")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--master-addr", "no-such-host.invalid"],
            "--master-addr 'no-such-host.invalid' does not resolve",
        ),
        (
            ["--worker-num", "2", "--local-worker-num", "3"],
            "--local-worker-num 3 must be between 1",
        ),
        (["--worker-num", "0"], "--worker-num 0 must be between 1 and 1000000"),
        (["--master-addr", "a\x1b[2J"], "is not a host name or IP address"),
        (["--node-rank", "2", "--worker-num", "4", "--local-worker-num", "2"], "--node-rank 2"),
        (["--node-rank", "-2"], "--node-rank -2 must be >= 0"),
    ],
)
def test_bad_run_options_are_one_clear_line(
    tmp_path: Path, extra: list[str], expected: str
) -> None:
    script = private_copy(tmp_path)
    args = run_args(*extra, script, master_port=free_port(), log_dir=tmp_path / "logs")
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert not processes_running(str(script))


ETCD = "etcd://127.0.0.1:2379/job"


@pytest.mark.parametrize(
    ("extra", "env", "expected"),
    [
        (["--node-timeout", "0"], {}, "--node-timeout='0' is out of range"),
        (["--node-timeout", "inf"], {}, "--node-timeout='inf' is out of range"),
        (["--cluster-time-out", "0"], {}, "--cluster-time-out='0' is out of range"),
        (["--cluster-time-out", "nan"], {}, "--cluster-time-out='nan' is out of range"),
        (["--state-url", ETCD, "--lease", "0"], {}, "--lease='0' must be between 2 and 3600"),
        (["--state-url", ETCD, "--lease", "-3"], {}, "--lease='-3' must be between 2 and 3600"),
        (["--state-url", "bogus"], {}, "--state-url='bogus' is no URL"),
        (["--enable-recovery", "--recovery-path", "{file}/state"], {}, "--recovery-path: "),
        ([], {"CLUSTER_LOG_KEEP": "many"}, "the scheduler would refuse its settings: "),
        (["--node-timeout", "4"], {"CLUSTER_HEARTBEAT_INTERVAL": "9"}, "shorter than MS_NODE"),
    ],
)
def test_bad_job_settings_are_refused_before_anything_starts(
    tmp_path: Path, extra: list[str], env: dict[str, str], expected: str
) -> None:
    # What the scheduler or a worker would refuse once started (exit 2, the job failing with
    # "the scheduler exited with code 2") is one line, exit 2, with --dry-run too.
    script = private_copy(tmp_path)
    (tmp_path / "file").write_text("a file where a directory would go")
    extra = [arg.replace("{file}", str(tmp_path / "file")) for arg in extra]
    logs = tmp_path / "logs"
    for dry_run in (["--dry-run"], []):
        args = run_args(
            *extra, *dry_run, script, worker_num=2, master_port=free_port(), log_dir=logs
        )
        result = subprocess.run(
            args, env={**os.environ, **env}, capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode == 2, (dry_run, result.stdout, result.stderr)
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("mscluster: ConfigError: ")
        assert expected in line
        assert not processes_running(str(script))
        assert not (tmp_path / "logs").exists()  # nothing made: checked before


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("CLUSTER_JOB_SECRET", " ", "CLUSTER_JOB_SECRET is set but empty"),
        ("CLUSTER_JOB_SECRET_FILE", "readable", "chmod 600"),
        ("CLUSTER_JOB_SECRET_FILE", "missing", "cannot be read"),
    ],
)
def test_a_bad_job_secret_is_one_clear_line(
    tmp_path: Path, variable: str, value: str, expected: str
) -> None:
    script = private_copy(tmp_path)
    if variable.endswith("_FILE"):
        path = tmp_path / value
        if value == "readable":
            path.write_text("secret")
            path.chmod(0o644)
        value = str(path)
    result = subprocess.run(
        run_args(script, master_port=free_port(), log_dir=tmp_path / "logs"),
        env={**os.environ, variable: value},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("mscluster: ConfigError: ")
    assert expected in line
    assert "secret\n" not in line
    assert not processes_running(str(script))


def test_a_job_secret_that_is_not_utf8_is_proved_by_every_process(tmp_path: Path) -> None:
    """CLUSTER_JOB_SECRET of bytes that are not UTF-8 was a UnicodeEncodeError traceback in the
    launcher; the scheduler and each worker read the same bytes, so the job forms."""
    script = private_copy(tmp_path)
    env = {**os.environ, "CLUSTER_JOB_SECRET": os.fsdecode(b"\xff secret \xfe\x80")}
    logs = tmp_path / "logs"
    for dry_run in (["--dry-run"], []):
        args = run_args(*dry_run, script, worker_num=2, master_port=free_port(), log_dir=logs)
        result = subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, (dry_run, result.stderr)
        assert "Traceback" not in result.stderr
    assert "nodes join with proof of the job secret" in (logs / "scheduler.log").read_text()
    assert not (logs / "job.secret").exists()  # the given one, not one made here
    assert not processes_running(str(script))


def test_missing_script_is_one_clear_line(tmp_path: Path) -> None:
    result = subprocess.run(
        run_args(tmp_path / "nope.py", master_port=free_port(), log_dir=tmp_path / "logs"),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    missing = str(tmp_path / "nope.py")
    assert result.stderr.strip().splitlines() == [
        f"mscluster: ConfigError: script {missing!r} does not exist (or is not a file)"
    ]


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    script = private_copy(tmp_path)
    port = free_port()
    logs = tmp_path / "logs"
    args = run_args(
        "--dry-run", "--enable-recovery", script, worker_num=3, master_port=port, log_dir=logs
    )
    env = {**os.environ, "CLUSTER_JOB_SECRET": "hunter2", "MS_ROLE": "MS_SCHED"}
    result = subprocess.run(
        [*args, "--hold", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "placement: the options given" in text
    assert f"scheduler: 127.0.0.1:{port} (--master-addr 127.0.0.1), started here" in text
    # The table: process, role, node id, rank, log, command.
    table = [line for line in text.splitlines() if line.startswith(("scheduler ", "worker "))]
    rows = [line.split() for line in table]
    assert rows[0][1:5] == ["MS_SCHED", "-", "-", str(tmp_path / "logs" / "scheduler.log")]
    assert rows[0][5:] == [PYTHON, "-m", "cluster", "scheduler"]
    for i, row in enumerate(rows[1:]):
        log = str(tmp_path / "logs" / f"worker_{i}.log")
        assert row[:6] == ["worker", str(i), "MS_WORKER", str(i), str(i), log]
        assert row[6:] == [PYTHON, str(script), "--hold", "5"]
    assert len(rows) == 4
    assert "restarts up to 1 each; recovery on" in text  # --max-restarts' default with recovery
    assert "MS_ENABLE_RECOVERY=1" in text
    assert f"MS_RECOVERY_PATH={tmp_path / 'logs' / 'recovery'}" in text
    assert "CLUSTER_JOB_SECRET=<hidden>" in text
    assert "hunter2" not in text + result.stderr
    assert "not passed on (mscluster run sets its own): MS_ROLE" in text
    assert not (tmp_path / "logs").exists()
    assert not processes_running(str(script))


def test_port_in_use_is_one_clear_line(processes: Procs, tmp_path: Path) -> None:
    port = free_port()
    holder = processes.start(
        "holder", [*MSCLUSTER, "scheduler", "--port", str(port), "--worker-num", "1"], os.environ
    )
    holder.wait_for_output("listening on", 20)
    script = private_copy(tmp_path)
    result = subprocess.run(
        run_args(script, worker_num=1, master_port=port, log_dir=tmp_path / "logs"),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"--master-port {port} is already in use" in lines[0]
    assert not processes_running(str(script))


def test_status_lists_every_worker(processes: Procs, tmp_path: Path) -> None:
    script, logs, port = private_copy(tmp_path), tmp_path / "logs", free_port()
    args = run_args(script, "--hold", "60", worker_num=3, master_port=port, log_dir=logs)
    run = processes.start("run", args, os.environ)
    run.wait_for_output("3/3 registered (ready)", 30)
    secret_file = tmp_path / "logs" / "job.secret"
    shown = mscluster("status", "--addr", f"127.0.0.1:{port}", secret_file=secret_file)
    assert shown.returncode == 0, shown.stderr
    table = shown.stdout
    assert re.search(r"ready, generation 1, 3/3 registered, recovery off", table), table
    for rank in range(3):
        assert re.search(rf"^{rank}\s+{rank}\s+worker\s+127\.0\.0\.1:\d+\s+alive\s", table, re.M), (
            table
        )
    as_json = mscluster("status", "--addr", f"127.0.0.1:{port}", "--json", secret_file=secret_file)
    data = json.loads(as_json.stdout)
    assert data["phase"] == "ready"
    assert [(n["rank"], n["state"]) for n in data["nodes"]] == [
        (0, "alive"),
        (1, "alive"),
        (2, "alive"),
    ]
    run.popen.send_signal(signal.SIGINT)
    assert run.wait(15) == 130


def test_status_and_events_find_the_launchers_secret_or_say_what_to_pass(
    processes: Procs, tmp_path: Path
) -> None:
    """A launched job has a secret, and shows itself only to readers that prove it: `mscluster
    status` and `events --addr` find it in --secret-file, --log-dir, CLUSTER_JOB_SECRET_FILE,
    or logs/ of the working directory (the launcher's default); without it, one line."""
    script, logs, port = private_copy(tmp_path), tmp_path / "logs", free_port()
    args = run_args(script, "--hold", "60", worker_num=2, master_port=port, log_dir=logs)
    run = processes.start("run", args, os.environ)
    run.wait_for_output("2/2 registered (ready)", 30)
    addr = f"127.0.0.1:{port}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args, secret_file, cwd in (
        (["--secret-file", str(logs / "job.secret")], None, elsewhere),
        (["--log-dir", str(logs)], None, elsewhere),
        ([], logs / "job.secret", elsewhere),
        ([], None, tmp_path),  # logs/job.secret where the user ran `mscluster run`
    ):
        shown = mscluster("status", "--addr", addr, *args, secret_file=secret_file, cwd=cwd)
        assert shown.returncode == 0, (args, shown.stderr)
        assert "2/2 registered" in shown.stdout, shown.stdout
    followed = mscluster("events", "--addr", addr, "--log-dir", str(logs), secret_file=None)
    assert followed.returncode == 0, followed.stderr
    assert " formed " in followed.stdout, followed.stdout
    from_file = mscluster("events", "--log-dir", str(logs), secret_file=None, cwd=elsewhere)
    assert " formed " in from_file.stdout, from_file.stderr
    for command in ("status", "events"):
        refused = mscluster(command, "--addr", addr, secret_file=None, cwd=elsewhere)
        assert refused.returncode == 2
        assert refused.stderr.splitlines() == [
            f"mscluster: the scheduler at {addr} shows the job only to holders of its secret: "
            "this job has a job secret: pass --secret-file <log-dir>/job.secret or set "
            "CLUSTER_JOB_SECRET_FILE"
        ], refused.stderr
    run.popen.send_signal(signal.SIGINT)
    assert run.wait(15) == 130


@pytest.mark.parametrize("given", [True, False], ids=["addr", "environment"])
def test_status_of_a_dead_address_is_one_clear_line(given: bool) -> None:
    """Nothing listens there: one line that names the address and the refusal (not gRPC's
    account of it), and how to point `mscluster status` at the job's scheduler."""
    port = free_port()
    result = subprocess.run(
        [*MSCLUSTER, "status", *(["--addr", f"127.0.0.1:{port}"] if given else [])],
        env=job_env(1, port),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    said = f"mscluster: no scheduler answers at 127.0.0.1:{port}: connection refused: "
    assert lines[0].startswith(said), lines[0]
    assert "failed to connect to all addresses" not in lines[0], lines[0]
    if given:
        assert lines[0].endswith("is the job running, with a scheduler at that --addr?")
    else:
        assert "Without --addr this asks MS_SCHED_HOST:MS_SCHED_PORT" in lines[0], lines[0]
        assert "with --addr HOST:PORT, or set those variables" in lines[0], lines[0]


def test_two_hosts_in_network_namespaces_form_one_job(processes: Procs, tmp_path: Path) -> None:
    script = private_copy(tmp_path)
    port = 8118  # each namespace has its own ports: the default works
    with two_hosts() as (a, b):
        node_args = functools.partial(
            run_args, "--master-addr", a.ip, worker_num=4, local_worker_num=2, master_port=port
        )
        runs = [
            processes.start(
                f"host{rank}",
                host.command(
                    node_args("--node-rank", str(rank), script, log_dir=tmp_path / f"host{rank}")
                ),
                os.environ,
            )
            for rank, host in enumerate((a, b))
        ]
        for run in runs:
            assert run.wait(60) == 0, run.output
    # A worker of host 1 may start before host 0's scheduler listens: it says so while it waits
    # (a "waiting for the scheduler" line), then joins.
    lines = [
        [
            line
            for line in (tmp_path / f"host{rank // 2}" / f"worker_{rank}.log")
            .read_text()
            .splitlines()
            if "waiting for the scheduler" not in line
        ]
        for rank in range(4)
    ]
    assert lines == [[f"allgather rank={r} size=4 result=[0, 1, 2, 3]"] for r in range(4)]
    status_note = (tmp_path / "host0" / "scheduler.log").read_text()
    assert f"listening on {a.ip}:{port}" in status_note


def test_progress_is_one_live_line_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal the progress line is rewritten in place (carriage return + clear line)."""
    script, logs = private_copy(tmp_path), tmp_path / "logs"
    args = run_args(script, "--hold", "3", worker_num=2, master_port=free_port(), log_dir=logs)
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=terminal,
        )
        os.close(terminal)
        output = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(controller, 4096)
                except OSError:  # the terminal closed: every writer exited
                    break
                if not chunk:
                    break
                output += chunk
        assert proc.wait(10) == 0
    finally:
        os.close(controller)
    text = output.decode(errors="replace")
    assert "\r\x1b[Kmscluster: 2/2 registered (ready) | local workers running 2/2" in text, text
    assert "job finished" in text


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_launcher_leaves_no_process(processes: Procs, tmp_path: Path) -> None:
    script, logs = private_copy(tmp_path), tmp_path / "logs"
    args = run_args(script, "--hold", "60", worker_num=2, master_port=free_port(), log_dir=logs)
    run = processes.start("run", args, os.environ)
    run.wait_for_output("2/2 registered (ready)", 30)
    children = children_of(run.pid)
    assert len(children) == 5  # the scheduler, the relay, two workers and the guard
    run.popen.send_signal(signal.SIGKILL)
    run.wait(10)
    wait_until(lambda: not any(alive(p) for p in children), 15, "the orphans to stop")
