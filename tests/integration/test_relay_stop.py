"""A scheduler stops cleanly with a host's relay connected. The relay's host calls (HostBeats,
HostWatch) last as long as the relay, past the end of the job: the scheduler ends them before
its server stops, in every stop path, and its log holds what it says and no traceback (gRPC logs
one for each handler its server's stop has to cancel)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.test_relay import start_relayed_job
from tests.procs import Procs


def test_a_job_through_a_relay_ends_with_no_traceback_and_the_relay_exits_with_it(
    processes: Procs, short_dir: Path
) -> None:
    """The relay, started by hand, exits 0 once the job finished and its workers closed,
    saying so, and leaves no socket behind."""
    sched, relay, workers = start_relayed_job(processes, short_dir / "r.sock", 2, hold_s=0)
    for proc in [*workers, sched]:
        assert proc.wait(60) == 0, proc.output
    assert "job finished: all 2 nodes finished" in sched.output, sched.output
    assert "Traceback" not in sched.output, sched.output
    assert relay.wait(30) == 0, relay.output
    said = "the job finished: all 2 nodes finished; every worker it carried has closed: exiting"
    assert said in relay.output, relay.output
    assert "Traceback" not in relay.output, relay.output
    assert not (short_dir / "r.sock").exists()


@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [
        (signal.SIGINT, 1, "job failed: scheduler stopped by SIGINT"),
        (signal.SIGTERM, 0, "the job is left to resume (scheduler stopped by SIGTERM)"),
    ],
    ids=["sigint-ends-the-job", "sigterm-leaves-it-to-resume"],
)
def test_a_scheduler_stopped_by_a_signal_with_a_relay_connected_logs_no_traceback(
    processes: Procs, short_dir: Path, signum: signal.Signals, code: int, said: str
) -> None:
    """Stopped mid-job, the relay's links carrying its workers' streams: SIGINT ends the job,
    SIGTERM (a state store, no standby) leaves it to resume; either way the scheduler's log
    ends with what it said."""
    recovery = {"MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(short_dir / "state")}
    sched, relay, workers = start_relayed_job(processes, short_dir / "r.sock", 2, **recovery)
    for w in workers:
        w.wait_for_output("allgather rank=", 30)
    sched.popen.send_signal(signum)
    assert sched.wait(15) == code, sched.output
    assert said in sched.output, sched.output
    assert "Traceback" not in sched.output, sched.output
    if signum == signal.SIGINT:  # the job over, its workers gone: the relay ends with them
        assert relay.wait(30) == 0, relay.output
    else:  # the job left to resume: the relay waits for it
        assert relay.running, relay.output
    assert "Traceback" not in relay.output, relay.output
