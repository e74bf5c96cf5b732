"""A healthy worker whose main thread holds Python's GIL longer than MS_NODE_TIMEOUT in one C
call is taken for a hung one (its heartbeats come from a Python thread): the failure says that
this may be why, and what to do; with recovery, the worker rejoins once the call returns, names
its own stall, and the job finishes (real processes)."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.testing import LocalJob, LocalJobOptions
from tests.procs import PYTHON, ROOT

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "gil_holder.py"
REASON = (
    r"no heartbeat for \d+\.\d s \(hung, cut off, or holding Python's GIL in a long call: "
    r"raise MS_NODE_TIMEOUT\)"
)


def gil_job(tmp_path: Path, options: LocalJobOptions) -> LocalJob:
    """Two workers of SCRIPT, rank 0 holding the GIL for 3 s, with MS_NODE_TIMEOUT=1."""
    return LocalJob(
        SCRIPT,
        ["3"],
        workers=2,
        node_timeout_s=1,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=options,
    )


def test_a_worker_holding_the_gil_past_the_node_timeout_is_failed_naming_the_gil(
    tmp_path: Path,
) -> None:
    job = gil_job(tmp_path, LocalJobOptions(recovery=False, python=PYTHON))
    with job:
        assert job.wait(60) == 1, job.log(None)
    assert re.search(rf"node '0' \(rank 0\) failed: {REASON}", job.log(None)), job.log(None)
    assert re.search(rf"rank 0 \(node '0'[^)]*\) died: {REASON}", job.log(1)), job.log(1)


def test_with_recovery_a_worker_that_held_the_gil_rejoins_and_the_job_finishes(
    tmp_path: Path,
) -> None:
    """The scheduler fails rank 0 for its silence and waits for it (recovery is on); rank 0,
    its call returned, finds its stream ended, says that it was the one that did not run, and
    registers again; the job re-forms in generation 2, where both ranks pass the barrier that
    generation 1 could not complete. (The script catches the PeerFailedError of that barrier,
    as a recovery-aware loop does: a script that lets it end its process leaves the job
    waiting for that rank to rejoin, up to MS_TOPO_TIMEOUT.)"""
    options = LocalJobOptions(recovery=True, python=PYTHON, env={"MS_TOPO_TIMEOUT": "20"})
    job = gil_job(tmp_path, options)
    with job:
        assert job.wait(60) == 0, job.log(None)
    assert re.search(rf"node '0' \(rank 0\) failed: {REASON}", job.log(None)), job.log(None)
    assert "node '0' rejoined: generation 2" in job.log(None), job.log(None)
    assert "this process was stopped or starved for " in job.log(0), job.log(0)
    for i in (0, 1):
        assert f"rank {i} passed the barrier in generation 2" in job.log(i), job.log(i)
