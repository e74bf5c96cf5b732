"""`mscluster status --watch` and `mscluster events --follow --file` end when the scheduler is
gone: a real scheduler of a job without recovery, SIGKILLed while both follow it. Each says so
in one line and exits 1 within a bound (RECONNECT_S shortened in their processes: the watch
asks the scheduler that long, the file's follower waits that long for a writer), as `mscluster
events --follow --addr` does; a watch of a job that finishes still exits 0."""

from __future__ import annotations

import signal
from pathlib import Path

from cluster.testing import Process, free_port, wait_until
from tests.procs import MSCLUSTER, PYTHON, ROOT, Procs, job_env, mscluster, reader_env

GIVE_UP_S = 3.0
BOUND_S = 30.0
# `mscluster ARGS` with events.RECONNECT_S = argv[1]: the give-up time of a real command, short.
SHORT = (
    "import sys; from cluster.tools import events; events.RECONNECT_S = float(sys.argv[1]); "
    "from cluster.tools.cli import main; sys.exit(main(sys.argv[2:]))"
)
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py")


def short(*args: str) -> list[str]:
    return [PYTHON, "-c", SHORT, str(GIVE_UP_S), *args]


def said(process: Process) -> list[str]:
    """The lines `mscluster` said of itself (the watch's own lines have a time first)."""
    return [line for line in process.output.splitlines() if line.startswith("mscluster:")]


def test_a_watch_and_a_file_follower_end_when_the_scheduler_is_killed(
    processes: Procs, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "events.jsonl"
    sched = processes.start(
        "scheduler",
        [
            *MSCLUSTER,
            "scheduler",
            "--port",
            str(port),
            "--worker-num",
            "2",
            "--event-log",
            str(log),
        ],
        job_env(2, port),
    )
    sched.wait_for_output("listening on", BOUND_S)
    address = f"127.0.0.1:{port}"
    watch = processes.start(
        "watch",
        short("status", "--watch", "--addr", address, "--interval", "0.2"),
        reader_env(None),
    )
    follow = processes.start(
        "follow", short("events", "--follow", "--file", str(log)), reader_env(None)
    )
    watch.wait_for_output("rank  node id", BOUND_S)
    follow.wait_for_output("started", BOUND_S)

    sched.signal(signal.SIGKILL)

    assert watch.wait(GIVE_UP_S + BOUND_S) == 1, watch.output
    assert follow.wait(GIVE_UP_S + BOUND_S) == 1, follow.output
    for ended in (watch, follow):
        assert "Traceback" not in ended.output, ended.output
        assert len(said(ended)) == 1, ended.output
    assert "the scheduler has not answered for" in said(watch)[0], watch.output
    assert "the job's end is unknown" in said(watch)[0]
    assert f"the event log {log} has no writer" in said(follow)[0], follow.output


def stream_held(address: str) -> bool:
    """Whether the scheduler's one reader of its events (CLUSTER_MAX_FOLLOWERS=1) is connected:
    another is refused."""
    listing = mscluster("events", "--addr", address, secret_file=None)
    return "readers of this job's events are connected already" in listing.stderr


def test_a_watch_of_a_job_that_finishes_exits_0(processes: Procs, tmp_path: Path) -> None:
    """The job ends once the watch's event stream is open: the scheduler, exiting right after
    the end, may be gone before the next poll, and the stream tells the end."""
    port, go = free_port(), tmp_path / "go"
    env = job_env(1, port, CLUSTER_MAX_FOLLOWERS="1")
    sched = processes.start_role("scheduler", "MS_SCHED", [SCRIPT, str(go)], env)
    worker = processes.start_role("w0", "MS_WORKER", [SCRIPT, str(go)], env)
    worker.wait_for_output("in rank=0", BOUND_S)
    watch = processes.start(
        "watch",
        short("status", "--watch", "--addr", f"127.0.0.1:{port}", "--interval", "0.2"),
        reader_env(None),
    )
    watch.wait_for_output("rank  node id", BOUND_S)
    address = f"127.0.0.1:{port}"
    wait_until(lambda: stream_held(address), BOUND_S, "the watch's event stream")
    go.write_text("")
    assert worker.wait(BOUND_S) == 0, worker.output
    assert sched.wait(BOUND_S) == 0, sched.output
    assert watch.wait(BOUND_S) == 0, watch.output
    assert "the job finished" in watch.output
    assert said(watch) == []


def test_a_follow_where_no_job_is_ends_in_one_line(processes: Procs, tmp_path: Path) -> None:
    """`mscluster events --follow` in a directory where no job ran (no logs/events.jsonl,
    nothing holds a lock there): after the bound, one line that says so and what to give,
    exit 2 (before: it waited forever)."""
    env = {**reader_env(None), "PYTHONPATH": str(ROOT)}  # run from elsewhere than the checkout
    follow = processes.start("follow", short("events", "--follow"), env, cwd=tmp_path)
    assert follow.wait(GIVE_UP_S + BOUND_S) == 2, follow.output
    assert "Traceback" not in follow.output, follow.output
    waited, gave_up = said(follow)
    assert waited.startswith("mscluster: waiting for logs/events.jsonl"), follow.output
    assert "no event log appeared at logs/events.jsonl in 3 s" in gave_up, follow.output
    assert "no `mscluster run` or scheduler holds launcher.lock" in gave_up
    assert not (tmp_path / "logs").exists()  # a reader makes nothing
