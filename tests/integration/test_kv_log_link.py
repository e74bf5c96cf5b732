"""A symbolic link put in `kv.log`'s place while the scheduler runs stops the scheduler, as a
log replaced by another file does: its key-value saves are refused as fenced, never retried
with the system's words, and nothing is written through the link."""

from __future__ import annotations

from pathlib import Path

from cluster.storage.kv_log import FILE_NAME
from cluster.tools.testing import LocalJob, LocalJobOptions, wait_until
from tests.procs import PYTHON, ROOT

SETS_ON_CUE = ROOT / "tests" / "integration" / "scripts" / "sets_on_cue.py"
OUTSIDE = b"a file outside the recovery path\n"


def test_a_link_in_the_key_value_logs_place_stops_the_scheduler_with_one_line(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "recovery"
    cue = tmp_path / "cue"
    elsewhere = tmp_path / "elsewhere.log"
    elsewhere.write_bytes(OUTSIDE)
    job = LocalJob(
        SETS_ON_CUE,
        [str(cue)],
        workers=1,
        node_timeout_s=3.0,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(env={"MS_RECOVERY_PATH": str(directory)}, python=PYTHON),
    )
    log = directory / FILE_NAME
    with job:
        wait_until(lambda: "ready rank=0" in job.log(0), 30, "the worker ready")
        log.unlink(missing_ok=True)
        log.symlink_to(elsewhere)
        cue.touch()  # the worker sets its key: the scheduler saves it to the log
        scheduler = job.scheduler
        assert scheduler is not None
        assert scheduler.wait(30) == 1, job.log(None)
    said = job.log(None)
    stops = [line for line in said.splitlines() if "the scheduler stops" in line]
    assert len(stops) == 1, said
    assert f"cannot save the key-value store to {log}: it is not the log" in stops[0]
    assert "(a symbolic link is there)" in stops[0]
    assert "To resume the job" in stops[0]
    assert "retrying" not in said
    assert "Traceback" not in said
    assert log.is_symlink()
    assert elsewhere.read_bytes() == OUTSIDE
