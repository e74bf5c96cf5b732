"""What `mscluster chaos` says of a fault is what the scheduler did with it, on a real job."""

from __future__ import annotations

import io
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from cluster.tools.chaos import Chaos
from cluster.tools.testing import LocalJob
from tests.procs import ROOT

WORKER = ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py"
NODE_TIMEOUT_S = 1.0
# Stops a little shorter than MS_NODE_TIMEOUT: with the silence before the stop (up to a
# heartbeat interval) some are failures, seen only after SIGCONT: the worker, its scheduler
# silent as long, reconnects and rejoins.
NEAR_TIMEOUT = (0.9, 0.93, 0.95, 0.97, 0.99, 0.92, 0.96, 0.98)
# How long a scheduler stalls: past the status' deadline (1 s), well within MS_NODE_TIMEOUT.
STALL_S = 1.5


def generation(job: LocalJob) -> int:
    """The job's generation, once its scheduler answers (a loaded machine may keep it from
    answering a status within its deadline)."""
    return int(job.wait_status(lambda view: True, "the scheduler's status").generation)


def test_a_stop_just_shorter_than_the_guard_is_labelled_by_what_the_job_did(
    local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    """Each stop the report calls tolerated leaves the generation alone; each it calls
    detected began exactly one new generation, which it waited for."""
    release = tmp_path / "release"
    job = local_job(WORKER, ["--release", str(release)], workers=2, node_timeout_s=NODE_TIMEOUT_S)
    first = job.wait_formed().generation
    chaos = Chaos(job, faults=["stop"], out=io.StringIO())
    detected = 0
    for share in NEAR_TIMEOUT:
        before = generation(job)
        fault = chaos._interrupt_for("stop", 1, 0.0, share * NODE_TIMEOUT_S)
        after = generation(job)
        if fault.detected_after_s is None:
            assert after == before, fault  # tolerated: nothing began meanwhile
            assert fault.recovered_after_s == 0.0
        else:
            detected += 1
            assert after == before + 1, fault  # recovered: back in the next generation
            assert job.everyone_back(job.wait_status(lambda view: True, "the status"))
    release.touch()
    assert job.wait() == 0
    # Nothing the report missed began a generation of its own.
    assert job.status() is None or job.status().generation == first + detected
    for i in range(2):
        assert f"generation={first + detected}" in job.log(i)


def test_a_stop_begun_while_the_scheduler_is_slow_to_answer_is_labelled_by_what_the_job_did(
    local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    """The generation a fault is judged against is read as the fault begins: a scheduler that
    does not answer that status within its deadline (busy, or starved on a loaded machine; here
    stopped for STALL_S) is waited for. (It was read as generation 0, so the job's first answer
    after the stop was taken for a newer generation: a stop the job tolerated was labelled
    detected, and recovered at once.)"""
    release = tmp_path / "release"
    job = local_job(WORKER, ["--release", str(release)], workers=2, node_timeout_s=5.0)
    first = job.wait_formed().generation
    chaos = Chaos(job, faults=["stop"], out=io.StringIO())
    scheduler = job.scheduler
    assert scheduler is not None
    scheduler.popen.send_signal(signal.SIGSTOP)
    # sleep-ok: the scheduler's stall is the condition under test
    resume = threading.Timer(STALL_S, scheduler.popen.send_signal, (signal.SIGCONT,))
    resume.start()
    try:
        fault = chaos._interrupt_for("stop", 1, 0.0, 0.5)
    finally:
        resume.cancel()
        scheduler.popen.send_signal(signal.SIGCONT)
    assert fault.detected_after_s is None, fault
    assert generation(job) == first
    release.touch()
    assert job.wait() == 0
