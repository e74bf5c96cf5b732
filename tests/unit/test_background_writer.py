"""`BackgroundWriter` made `newest_only` (a checkpoint manager's reporter): a job posted while
another is under way waits, and a newer one replaces it; `flush_all` waits for the jobs that a
writer's jobs post to it, and at interpreter exit a job posted still runs."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from cluster.storage import background
from cluster.storage.background import BackgroundWriter
from cluster.testing import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_a_job_posted_while_one_waits_replaces_it() -> None:
    reporter = BackgroundWriter("test-reporter", newest_only=True)
    go = threading.Event()
    ran: list[int] = []

    def job(n: int) -> None:
        ran.append(n)
        assert go.wait(30), "the test never let the first job end"

    try:
        reporter.post(lambda: job(1))
        wait_until(lambda: ran == [1], 10, "the first job to start", poll_s=0.001)
        for n in (2, 3, 4):
            reporter.post(lambda n=n: job(n))  # type: ignore[misc]
        assert not reporter.idle()
    finally:
        go.set()
    reporter.flush()
    assert ran == [1, 4]
    reporter.close()


def test_flush_all_waits_for_what_a_writers_job_posts_to_another() -> None:
    """The writer's last job posts a report to a reporter that had none before: `flush_all`
    returns once that report is done too, whichever it looked at first."""
    writer = BackgroundWriter("test-writer")
    reporter = BackgroundWriter("test-reporter", newest_only=True)
    wrote, report = threading.Event(), threading.Event()
    reported: list[str] = []

    def write() -> None:
        assert wrote.wait(30), "the test never let the write end"
        reporter.post(lambda: (report.wait(30), reported.append("reported")))

    writer.submit(write)
    flusher = threading.Thread(target=background.flush_all)
    flusher.start()
    try:
        wrote.set()
        wait_until(writer.idle, 10, "the write to end", poll_s=0.001)
        assert not reporter.idle()
        assert flusher.is_alive()  # the report is under way
    finally:
        report.set()
        flusher.join(30)
    assert not flusher.is_alive()
    assert reported == ["reported"]
    writer.close()
    reporter.close()


POSTED_AT_EXIT = """
import sys
from concurrent.futures import thread
from cluster.storage.background import BackgroundWriter
from cluster.testing import wait_until

writer = BackgroundWriter("writer")
reporter = BackgroundWriter("reporter", newest_only=True)
reporter.post(lambda: None)  # its thread is up
reporter.wait()


def write():
    # Runs while the interpreter exits (its executors take no new job) and posts a report.
    wait_until(lambda: thread._shutdown, 30, "the interpreter to exit", poll_s=0.001)
    reporter.post(lambda: open(sys.argv[1], "w").write("reported"))


writer.submit(write)
"""


def test_a_job_posted_at_interpreter_exit_runs_in_the_posters_thread(tmp_path: Path) -> None:
    out = tmp_path / "reported"
    result = subprocess.run(
        [sys.executable, "-c", POSTED_AT_EXIT, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "reported"
