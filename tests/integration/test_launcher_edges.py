"""`mscluster run` at its edges: a terminal that goes away, options it cannot use, signals."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests import tmpfs
from tests.procs import MSCLUSTER, processes_running

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
    args = [*MSCLUSTER, "run", "--join", "--worker-num", "2", "--master-port", str(free_port())]
    run = subprocess.Popen(
        [*args, "--log-dir", str(logs), str(script)],
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
