"""Network partitions (as root): each worker in its own network namespace, its link cut and
healed. A partition shorter than MS_NODE_TIMEOUT is tolerated; a longer one is detected, and when
the link returns the worker rejoins, everyone rolls back, and the job finishes with the
parameters of the run without faults."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.protocol.errors import ClusterError
from cluster.tools.testing import (
    LocalJob,
    LocalJobOptions,
    NetemUnavailableError,
    NetworkLab,
    wait_until,
)
from tests.procs import PYTHON, ROOT

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

TRAIN = ROOT / "examples" / "train_mlp.py"
WORKER = ROOT / "tests" / "integration" / "scripts" / "recovery_worker.py"
NODE_TIMEOUT_S = 3.0
ARGS = ["--steps", "150", "--save-every", "10", "--step-delay", "0.03"]


@pytest.fixture
def network_or_skip() -> None:
    why = NetworkLab.why_not_available()
    if why:
        pytest.skip(why)


def steps_done(job: LocalJob, i: int) -> int:
    return job.log(i).count("loss is")


def test_short_partition_is_tolerated_and_long_one_recovered(
    network_or_skip: None,
    local_job: Callable[..., LocalJob],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    clean_out = tmp_path_factory.mktemp("clean")
    clean = local_job(
        TRAIN, [*ARGS, "--out", str(clean_out)], workers=4, node_timeout_s=NODE_TIMEOUT_S
    )
    assert clean.wait(120) == 0
    out = tmp_path_factory.mktemp("partitioned")
    job = local_job(
        TRAIN,
        [*ARGS, "--out", str(out)],
        workers=4,
        node_timeout_s=NODE_TIMEOUT_S,
        options=LocalJobOptions(network=NetworkLab(4)),
        workdir=out / "logs",  # kept, for a failure's post-mortem
    )
    job.wait_formed()
    wait_until(lambda: steps_done(job, 1) >= 10, 60, "step 10")

    job.partition(1)  # shorter than MS_NODE_TIMEOUT: nobody fails
    cut = time.monotonic()
    wait_until(lambda: time.monotonic() - cut > NODE_TIMEOUT_S / 3, 5, "a short partition")
    job.heal(1)
    wait_until(lambda: steps_done(job, 0) >= 40, 60, "step 40")
    assert job.status().generation == 1

    job.partition(2)  # longer: detected, then back in a new generation
    job.wait_status(lambda v: job.node(v, 2).state == "failed", "worker 2 marked failed")
    job.heal(2)
    job.wait_status(lambda v: v.generation == 2 and job.everyone_back(v), "worker 2 back")
    assert job.wait(150) == 0, "\n".join(job.log(i)[-2000:] for i in range(4))
    assert "rolled back from step" in job.log(0)
    assert (out / "final.sha256").read_text() == (clean_out / "final.sha256").read_text()


def test_delay_and_loss_below_the_timeout_do_not_fail_the_job(
    network_or_skip: None,
    local_job: Callable[..., LocalJob],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    out = tmp_path_factory.mktemp("impaired")
    job = local_job(
        TRAIN,
        [*ARGS, "--out", str(out)],
        workers=2,
        node_timeout_s=NODE_TIMEOUT_S,
        options=LocalJobOptions(network=NetworkLab(2)),
    )
    job.wait_formed()
    try:
        job.impair(0, delay_ms=50, loss_percent=10)
    except NetemUnavailableError as exc:
        pytest.skip(str(exc))
    wait_until(lambda: steps_done(job, 0) >= 30, 60, "step 30 under delay and loss")
    job.impair(0)
    assert job.wait(120) == 0
    assert job.status() is None or job.status().generation == 1
    assert "rolled back" not in job.log(0)


def test_chaos_partitions_leave_the_result_exact(
    network_or_skip: None, tmp_path: Path, local_job: Callable[..., LocalJob]
) -> None:
    args = ["--steps", "400", "--save-every", "10", "--step-delay", "0.03"]
    clean_out = tmp_path / "clean"
    clean = local_job(TRAIN, [*args, "--out", str(clean_out)], workers=4, node_timeout_s=3)
    assert clean.wait(120) == 0
    result = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "chaos", "--faults", "partition", "--seed", "2"),
            *("--every", "1.5", "--count", "2", "--report", str(tmp_path / "report.json")),
            *("--", "--worker-num", "4", "--log-dir", str(tmp_path / "logs")),
            *(str(TRAIN), *args, "--out", str(tmp_path / "out")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    faults = json.loads((tmp_path / "report.json").read_text())["faults"]
    assert [f["kind"] for f in faults] == ["partition", "partition"]
    assert (tmp_path / "out" / "final.sha256").read_text() == (
        clean_out / "final.sha256"
    ).read_text()


def test_spares_get_namespaces_of_their_own(
    network_or_skip: None, local_job: Callable[..., LocalJob], tmp_path: Path
) -> None:
    """A lab of one namespace per worker and spare: the spare runs in the one after the
    workers', and the job forms."""
    lab = NetworkLab(3)
    job = local_job(
        WORKER,
        ["--release", str(tmp_path / "release")],
        workers=2,
        node_timeout_s=NODE_TIMEOUT_S,
        options=LocalJobOptions(network=lab, spares=1),
    )
    job.wait_formed()
    assert job.spares[0].popen.args[:4] == ["ip", "netns", "exec", lab.namespace(2)]
    wait_until(lambda: any(n.spare for n in job.status().nodes), 30, "the spare in the job")
    (tmp_path / "release").touch()
    assert job.wait() == 0


def test_a_lab_without_a_namespace_for_each_spare_is_refused(network_or_skip: None) -> None:
    lab = NetworkLab(2)
    try:
        with pytest.raises(ClusterError, match=r"needs a namespace for each: NetworkLab\(3\)"):
            LocalJob(TRAIN, workers=2, options=LocalJobOptions(network=lab, spares=1))
    finally:
        lab.teardown()
