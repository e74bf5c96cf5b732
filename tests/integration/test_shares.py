"""Issue 25: a collective waits a bounded time (CLUSTER_COLLECTIVE_TIMEOUT_S) for a rank that
never comes, then fails on every rank with an error that names it; the job goes on. (A runaway
member's key-value and collective floods, refused at its share while the others go on, are in
test_hostile.py.)"""

from __future__ import annotations

import time
from pathlib import Path

from cluster.testing import LocalJob, wait_until
from tests.procs import PYTHON, ROOT

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "absent_rank.py"
TIMEOUT_S = 2.0


def test_a_collective_missing_a_rank_fails_on_every_rank_within_its_bound(
    tmp_path: Path,
) -> None:
    go = tmp_path / "go"
    job = LocalJob(
        SCRIPT,
        [str(go)],
        workers=3,
        recovery=False,
        env={"CLUSTER_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)},
        python=PYTHON,
        workdir=tmp_path / "job",
        timeout_s=60,
    )
    with job:
        job.wait_formed()
        formed = time.monotonic()
        for rank in (0, 1):
            wait_until(lambda r=rank: "barrier failed" in job.log(r), 30, f"rank {rank} failed")
        waited = time.monotonic() - formed
        go.touch()
        assert job.wait(60) == 0, job.log(None)
    assert waited >= TIMEOUT_S * 0.9  # not before its bound
    for rank in range(3):
        log = job.log(rank)
        assert f"barrier failed rank={rank}: barrier failed: barrier #1" in log, log
        assert "waited 2 s for rank(s) 2, which never called it" in log, log
        assert "CLUSTER_COLLECTIVE_TIMEOUT_S" in log
        assert f"done rank={rank}" in log
