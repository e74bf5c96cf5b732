"""What `mscluster chaos` says of a fault is what the scheduler did with it, on a real job."""

from __future__ import annotations

import io
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
        before = job.status().generation
        fault = chaos._interrupt_for("stop", 1, 0.0, share * NODE_TIMEOUT_S)
        after = job.status().generation
        if fault.detected_after_s is None:
            assert after == before, fault  # tolerated: nothing began meanwhile
            assert fault.recovered_after_s == 0.0
        else:
            detected += 1
            assert after == before + 1, fault  # recovered: back in the next generation
            assert job.everyone_back(job.status())
    release.touch()
    assert job.wait() == 0
    # Nothing the report missed began a generation of its own.
    assert job.status() is None or job.status().generation == first + detected
    for i in range(2):
        assert f"generation={first + detected}" in job.log(i)
