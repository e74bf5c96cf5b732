"""A spare takes the rank of a worker that went silent but lives on, whose checkpoint lock lives
on with it (issue: the checkpoint lock and hot spares).

A real job of examples/train_mlp.py, 2 workers and a spare, MS_NODE_TIMEOUT=3: worker 1 is
SIGSTOPped (chaos's `stop` fault; a partition or a paused host look the same to the job), the
scheduler gives its rank to the spare, and the spare's CheckpointManager finds the lock of
rank_1 still held by the stopped process of the same job. It goes on without it after a moment,
saying so; once worker 1 is continued, hears that its rank went to the spare and ends, the spare
takes the lock at a later save; the job ends 0.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.tools.testing import LocalJob, LocalJobOptions, wait_until
from tests.procs import ROOT

pytest.importorskip("numpy")
pytestmark = pytest.mark.timeout(240)

TRAIN = ROOT / "examples" / "train_mlp.py"
STEPPED_IN = "this CheckpointManager goes on without the lock"
TAKEN = "is gone: this manager holds the lock now"


def test_a_spare_takes_the_rank_of_a_stopped_worker_that_holds_the_lock(
    local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job = local_job(
        TRAIN,
        ["--steps", "400", "--step-delay", "0.05", "--save-every", "10", "--out", str(out)],
        workers=2,
        node_timeout_s=3.0,
        workdir=tmp_path / "job",  # kept, for a failure's post-mortem
        timeout_s=90,
        options=LocalJobOptions(spares=1),
    )
    spare = job.spares[0]
    stopped = job.worker(1)
    wait_until(lambda: job.log(1).count("loss is") >= 20, 60, "worker 1 to train")
    job.stop_worker(1)
    try:
        lock = out / "checkpoints" / "rank_1" / ".mlp.lock"

        def decided() -> bool:
            return STEPPED_IN in spare.output or spare.popen.poll() is not None

        wait_until(decided, 60, "the promoted spare to go on without the lock, or to exit")
        assert spare.popen.poll() is None, spare.output[-2000:]
        assert "in use by another CheckpointManager" not in spare.output
        line = next(x for x in spare.output.splitlines() if STEPPED_IN in x)
        assert f"(pid {stopped.pid} on host " in line
        assert "node '1' of job " in line
        assert "which the scheduler replaced by this process in generation 2" in line
        assert json.loads(lock.read_text())["node"] == "spare-0"  # the spare's claim
        wait_until(lambda: "loss is" in spare.output, 60, "the spare to train as rank 1")
    finally:
        stopped.signal(signal.SIGCONT)
    assert stopped.popen.wait(30) != 0  # its rank went to the spare: it ends
    scheduler = job.scheduler
    assert scheduler is not None
    assert scheduler.popen.wait(90) == 0, scheduler.output[-2000:]
    assert job.worker(0).popen.wait(30) == 0
    assert spare.popen.wait(30) == 0, spare.output[-2000:]
    assert TAKEN in spare.output  # at a save after worker 1 ended
    assert json.loads(lock.read_text())["node"] == "spare-0"
    assert (out / "final.sha256").exists()
