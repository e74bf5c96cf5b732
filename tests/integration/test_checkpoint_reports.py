"""What the scheduler hears of a worker's checkpoints, in a real job (a scheduler and a worker
process): every save reported by the end, a finalize that comes before the writes are done."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.tools.testing import LocalJob, LocalJobOptions
from tests.procs import ROOT

pytest.importorskip("numpy")

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "checkpoint_reports.py"
NO_RECOVERY = LocalJobOptions(recovery=False)


@pytest.mark.parametrize("ending", ["finalize", "return"])
def test_a_save_then_finalize_without_flush_finishes_the_job(tmp_path: Path, ending: str) -> None:
    """`cluster.finalize()`, or the finalize at exit of a program that returns, waits for the
    write and for its report before it lets go of the job."""
    ckpt = tmp_path / "ckpt"
    args = [str(ckpt)] + (["--return"] if ending == "return" else [])
    with LocalJob(SCRIPT, args, workers=1, options=NO_RECOVERY) as job:
        code = job.wait()
        log = job.log(0)
        assert code == 0, f"{log}\n{job.log()}"
    assert ("finalized" in log) is (ending == "finalize")
    assert "Error" not in log
    assert (ckpt / "rank_0" / "p-00000001.ckpt").is_file()
