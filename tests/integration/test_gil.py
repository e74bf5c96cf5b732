"""A healthy worker whose main thread holds Python's GIL longer than MS_NODE_TIMEOUT in one C
call is taken for a hung one (its heartbeats come from a Python thread): the failure says that
this may be why, and what to do (real processes)."""

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


def test_a_worker_holding_the_gil_past_the_node_timeout_is_failed_naming_the_gil(
    tmp_path: Path,
) -> None:
    job = LocalJob(
        SCRIPT,
        ["3"],
        workers=2,
        node_timeout_s=1,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(recovery=False, python=PYTHON),
    )
    with job:
        assert job.wait(60) == 1, job.log(None)
    assert re.search(rf"node '0' \(rank 0\) failed: {REASON}", job.log(None)), job.log(None)
    assert re.search(rf"rank 0 \(node '0'[^)]*\) died: {REASON}", job.log(1)), job.log(1)
