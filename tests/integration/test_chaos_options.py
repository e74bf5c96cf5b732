"""`mscluster chaos` and its options: what it cannot use is one line (exit 2) with nothing
started; what it takes reaches the job."""

from __future__ import annotations

import io
import json
import socket
import subprocess
from pathlib import Path

import pytest

from cluster.testing import free_port
from cluster.tools import chaos_run
from cluster.tools.chaos import ChaosReport
from cluster.tools.launch_lock import LogDirLock
from tests import tmpfs
from tests.procs import MSCLUSTER, ROOT

# A job that forms and ends at once.
QUICK = """
import cluster

cluster.init()
cluster.finalize()
"""


def quick_script(tmp_path: Path, text: str = QUICK) -> Path:
    script = tmp_path / "job" / "quick.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    return script


def chaos(
    tmp_path: Path,
    *options: str,
    run_options: tuple[str, ...] = (),
    script: Path | None = None,
    script_args: tuple[str, ...] = (),
    timeout_s: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`mscluster chaos OPTIONS -- --worker-num 2 --local-worker-num 2 --log-dir LOGS
    RUN_OPTIONS SCRIPT SCRIPT_ARGS`."""
    script = script or quick_script(tmp_path)
    logs = str(tmp_path / "logs")
    base = ["--worker-num", "2", "--local-worker-num", "2", "--log-dir", logs]
    return subprocess.run(
        [*MSCLUSTER, "chaos", *options, "--", *base, *run_options, str(script), *script_args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def refused(tmp_path: Path, result: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refusal (exit 2, no traceback), with no job started."""
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert not (tmp_path / "logs" / "job.secret").exists()  # no job was started
    return line


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (("--every", "nan"), "--every nan: --every must be > 0"),
        (("--every", "inf"), "--every inf: --every must be > 0"),
        (("--every", "-1"), "--every -1: --every must be > 0"),
        (("--duration", "nan"), "--duration nan: --duration must be >= 0"),
        (("--duration", "inf"), "--duration inf: --duration must be >= 0"),
        (("--count", "-2"), "--count -2: --count must be >= 1"),
        (("--count", "0"), "--count 0: --count must be >= 1"),
    ],
)
def test_a_pace_that_is_no_number_of_seconds_or_faults_is_refused(
    tmp_path: Path, options: tuple[str, ...], named: str
) -> None:
    line = refused(tmp_path, chaos(tmp_path, *options))
    assert named in line, line


def test_a_job_that_forms_and_ends_at_once_passes_without_waiting(tmp_path: Path) -> None:
    """Formed and finished between two looks at the status: its exit codes decide, at once
    (the wait for the job to form is 60 s here)."""
    result = chaos(tmp_path, "--duration", "0", timeout_s=45)
    assert result.returncode == 0, result.stderr
    assert "the job finished correctly, exit code 0" in result.stderr


def test_a_script_that_dies_at_once_fails_with_its_error(tmp_path: Path) -> None:
    script = quick_script(tmp_path, 'raise SystemExit("boom: the script died")\n')
    result = chaos(tmp_path, script=script, timeout_s=45)
    assert result.returncode == 1, result.stderr
    assert "exited 1: boom: the script died), exit code 1" in result.stderr, result.stderr


@pytest.mark.parametrize("seconds", ["1e999", "nan", "0", "-1"])
def test_a_node_timeout_that_is_no_positive_number_is_refused(tmp_path: Path, seconds: str) -> None:
    line = refused(tmp_path, chaos(tmp_path, run_options=("--node-timeout", seconds)))
    assert f"--node-timeout={seconds!r}" in line or "--node-timeout='inf'" in line, line
    assert "it must be a positive number of seconds" in line, line


def test_the_fault_the_job_failed_after_is_not_recovered(tmp_path: Path) -> None:
    """A killed worker that does not come back: the job fails after that fault, and the
    report says so instead of a recovery time."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = ROOT / "tests" / "integration" / "scripts" / "no_comeback.py"
    result = chaos(
        tmp_path,
        *("--faults", "kill", "--count", "1", "--every", "1"),
        run_options=("--node-timeout", "1"),
        script=script,
        script_args=(str(marks),),
        timeout_s=90,
    )
    assert result.returncode == 1, result.stderr
    report = json.loads((tmp_path / "logs" / "chaos-report.json").read_text())
    (fault,) = report["faults"]
    assert fault["kind"] == "kill"
    assert fault["detected_after_s"] is not None
    assert fault["recovered_after_s"] is None
    assert fault["job_failed"] is True
    assert "recovered after -" in result.stderr, result.stderr
    assert "the job failed after it" in result.stderr
    assert "the job FAILED after fault #1 (" in result.stderr
    page = (tmp_path / "logs" / "chaos-report.html").read_text()
    assert "the job failed after it" in page


@pytest.mark.parametrize("name", ["r.json", "r.html"])
def test_a_report_path_that_is_a_directory_is_refused_before_the_run(
    tmp_path: Path, name: str
) -> None:
    """--report r.json is refused when r.json, or the page r.html beside it, is a directory."""
    (tmp_path / name).mkdir()
    report = tmp_path / "r.json"
    line = refused(tmp_path, chaos(tmp_path, "--report", str(report)))
    assert line.startswith(f"mscluster: ConfigError: --report '{report}': "), line
    assert f"'{tmp_path / name}' is a directory" in line


def test_a_report_that_cannot_be_written_after_the_run_is_one_line(tmp_path: Path) -> None:
    out = io.StringIO()
    with tmpfs.mounted(read_only=True) as disk:
        chaos_run._write_report(ChaosReport(seed=0), disk / "r.json", out)
    (line,) = out.getvalue().splitlines()
    assert line.startswith(f"mscluster chaos: cannot write the report to {disk / 'r.json'} (")
    assert "Read-only file system" in line


def test_partitions_with_spares_are_refused_before_the_run(tmp_path: Path) -> None:
    result = chaos(tmp_path, "--faults", "partition", run_options=("--spares", "1"))
    line = refused(tmp_path, result)
    assert line.startswith("mscluster: ConfigError: --faults partition with --spares 1: "), line


# A job that says what its workers were given, then forms and ends.
SAYS = """
import os

import cluster

NAMES = ("CLUSTER_RELAY", "CLUSTER_TLS_CONFIG", "MS_RECOVERY_PATH", "MS_TOPO_TIMEOUT",
         "CLUSTER_METRICS_PORT", "MS_SCHED_PORT")
print("given " + " ".join(f"{n}={os.environ.get(n, '')}" for n in NAMES), flush=True)
cluster.init()
cluster.finalize()
"""


def given(log: Path) -> dict[str, str]:
    (line,) = [line for line in log.read_text().splitlines() if line.startswith("given ")]
    return dict(word.split("=", 1) for word in line.split()[1:])


def test_the_run_options_chaos_takes_reach_the_job(tmp_path: Path) -> None:
    """TLS, the scheduler's port, the recovery path, the cluster time-out, the metrics port,
    and a relay for the workers as `mscluster run` starts for 2 or more."""
    pki = tmp_path / "pki"
    subprocess.run([*MSCLUSTER, "certs", "--out", str(pki)], check=True, capture_output=True)
    port, metrics, recovery = free_port(), free_port(), tmp_path / "recovery"
    result = chaos(
        tmp_path,
        "--duration",
        "0",
        run_options=(
            *("--tls-config", str(pki / "ssl.json"), "--master-port", str(port)),
            *("--recovery-path", str(recovery), "--cluster-time-out", "77"),
            *("--metrics-port", str(metrics)),
        ),
        script=quick_script(tmp_path, SAYS),
    )
    assert result.returncode == 0, result.stderr
    logs = tmp_path / "logs"
    scheduler = (logs / "scheduler.log").read_text()
    assert f"listening on 127.0.0.1:{port} for 2 workers (mutual TLS" in scheduler
    assert f"metrics at http://127.0.0.1:{metrics}/metrics" in scheduler
    assert (recovery / "scheduler.json").is_file()
    worker = given(logs / "worker_0.log")
    assert worker["CLUSTER_TLS_CONFIG"] == str((pki / "ssl.json").resolve())
    assert worker["MS_RECOVERY_PATH"] == str(recovery.resolve())
    assert worker["MS_TOPO_TIMEOUT"] == "77"
    assert worker["MS_SCHED_PORT"] == str(port)
    assert worker["CLUSTER_RELAY"].startswith("unix:")
    assert "mscluster relay: serving " + worker["CLUSTER_RELAY"] in (logs / "relay.log").read_text()
    assert not Path(worker["CLUSTER_RELAY"].removeprefix("unix:")).parent.exists()  # removed


def test_no_relay_is_taken(tmp_path: Path) -> None:
    result = chaos(
        tmp_path,
        "--duration",
        "0",
        run_options=("--no-relay",),
        script=quick_script(tmp_path, SAYS),
    )
    assert result.returncode == 0, result.stderr
    assert given(tmp_path / "logs" / "worker_0.log")["CLUSTER_RELAY"] == ""
    assert not (tmp_path / "logs" / "relay.log").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [("--master-addr", "127.0.0.1"), ("--max-restarts", "2"), ("--join", None)],
)
def test_a_run_option_chaos_cannot_honour_is_refused(
    tmp_path: Path, option: str, value: str | None
) -> None:
    run_options = (option,) if value is None else (option, value)
    line = refused(tmp_path, chaos(tmp_path, run_options=run_options))
    assert line.startswith(f"mscluster: ConfigError: mscluster chaos does not take {option} "), line


def test_a_tls_config_that_is_not_there_is_refused_before_the_run(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "ssl.json"
    line = refused(tmp_path, chaos(tmp_path, run_options=("--tls-config", str(missing))))
    assert line.startswith("mscluster: TLSConfigError: "), line
    assert str(missing) in line


def test_a_master_port_in_use_is_refused_before_the_run(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(tmp_path, chaos(tmp_path, run_options=("--master-port", str(port))))
    assert f"port {port} is not free" in line, line


def test_a_log_dir_another_run_holds_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """`mscluster chaos` locks its --log-dir as `mscluster run` does: a chaos run given the
    directory of a running launcher would write its job secret and clear its event log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "job.secret").write_text("the running job's\n")
    (logs / "events.jsonl").write_text('{"kind": "the running job\'s"}\n')
    holder = LogDirLock(logs)
    assert holder.take(29611) == ""
    try:
        before = {p.name: p.read_bytes() for p in logs.iterdir()}
        result = chaos(tmp_path, "--duration", "0")
        after = {p.name: p.read_bytes() for p in logs.iterdir()}
    finally:
        holder.release()
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "is in use by another mscluster run" in line, line
    assert "--master-port 29611" in line, line
    assert after == before
