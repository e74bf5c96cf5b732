"""What the scheduler hears of a worker's checkpoints, in a real job (a scheduler and a worker
process): every save reported by the end, a finalize that comes before the writes are done."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize("recovery", [False, True], ids=["no-recovery", "recovery"])
def test_saves_faster_than_the_scheduler_takes_reports_are_coalesced(
    tmp_path: Path, recovery: bool
) -> None:
    """The scheduler takes a worker's changing reports at most once per 0.1 s: 50 saves of a
    tiny state send far fewer reports (the newest list follows the one under way; with
    recovery, once the first answer named a step every rank holds), and once `flush()`
    returned the scheduler holds the last step."""
    ckpt, go = tmp_path / "ckpt", tmp_path / "go"
    args = [str(ckpt), "--saves", "50", "--flush", "--hold", str(go)]
    options = LocalJobOptions(recovery=recovery)
    with LocalJob(SCRIPT, args, workers=1, options=options) as job:
        job.worker(0).wait_for_output("flushed", job.timeout_s)
        flushed = re.search(
            r"flushed reports=(\d+) waits=\d+ persisted=(\d+) newest=(\d+)", job.log(0)
        )
        assert flushed is not None, job.log(0)
        reports, persisted, newest = map(int, flushed.groups())
        assert (persisted, newest) == (50, 50)
        assert reports < 25, f"{reports} reports for 50 saves: not coalesced"
        node = job.node(job.status(), 0)
        assert node is not None
        assert 50 in node.checkpoints, node
        go.touch()
        assert job.wait() == 0, f"{job.log(0)}\n{job.log()}"
        assert "finalized" in job.log(0)


GENERATION_SCRIPT = ROOT / "tests" / "integration" / "scripts" / "report_generation.py"
REPORT_LINE = re.compile(r"^report steps=\[([\d, ]*)\] generation=(\d+)$", re.MULTILINE)


@pytest.mark.parametrize(
    ("step", "last"), [(2, "1, 2"), (3, "1, 2, 3")], ids=["step-3-discarded", "none-newer"]
)
def test_a_report_under_way_at_a_rollback_says_the_generation_its_steps_were_listed_in(
    tmp_path: Path, step: int, last: str
) -> None:
    """Steps 1 to 3 are listed in generation 1, the report of step 1 held up, then the worker
    puts back `step` for generation 2 (as a TrainingLoop does) and the reports go. The lists
    taken before say generation 1, so the scheduler still takes this worker as holding
    nothing past `step` (for the step every rank keeps, and for a next generation's rollback
    step) until it reports from generation 2; the list left once the newer steps are discarded
    (none, from step 3) says generation 2. (A report said
    the generation of the moment it was sent: all said 2, step 3 of the abandoned run among
    them, and with none discarded generation 2 was not told apart.)"""
    args = [str(tmp_path / "ckpt"), str(step)]
    with LocalJob(GENERATION_SCRIPT, args, workers=1, options=NO_RECOVERY) as job:
        code = job.wait()
        log = job.log(0)
        assert code == 0, f"{log}\n{job.log()}"
    assert "done" in log
    reports = [(steps, int(generation)) for steps, generation in REPORT_LINE.findall(log)]
    assert reports == [("1", 1), ("1, 2, 3", 1), (last, 2)], log
