"""Whether a TrainingLoop runs with recovery: the job's, as it was launched (MS_ENABLE_RECOVERY
with MS_RECOVERY_PATH, as `cluster.init()` took them), one source that the loop reads from its
`CheckpointManager`. A manager's `recovery=` (for one used outside a job) that contradicts the
job's is refused in words; one made before `cluster.init()` takes the job's when connected. A
faked job: no network (`runtime` patched, as in test_put_back)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.api import peer_state, runtime, worker_metrics
from cluster.api.checkpoint import CheckpointManager
from cluster.api.checkpoint_config import CheckpointConfig
from cluster.api.training import TrainingLoop
from cluster.protocol.errors import ConfigError

CONFIG = CheckpointConfig(keep_checkpoint_max=3)


class Job:
    """A worker of rank 0 in generation 1 of a faked job, with recovery or without (`recovery`);
    `joined` False until `cluster.init()` (faked) has run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.joined = False
        self.recovery: SimpleNamespace | None = None
        topology = SimpleNamespace(generation=1, rank=0, rollback_step=0, reason="")
        agent = SimpleNamespace(cluster_id="", report_generation=1)
        self.session = SimpleNamespace(
            config=SimpleNamespace(recovery=None), topology=topology, agent=agent, say=print
        )
        monkeypatch.delenv("MS_ENABLE_RECOVERY", raising=False)
        monkeypatch.setattr(runtime, "is_initialized", lambda: self.joined)
        monkeypatch.setattr(runtime, "session", lambda: self.session)
        monkeypatch.setattr(runtime, "get_rank", lambda: 0)
        monkeypatch.setattr(runtime, "report_checkpoints", lambda steps, generation=0: 0)
        monkeypatch.setattr(worker_metrics, "start", lambda: None)
        monkeypatch.setattr(peer_state, "serve", lambda served: None)  # no state server
        self.directory = tmp_path / "ckpt"

    def init(self, *, recovery: bool) -> None:
        """`cluster.init()` joins a job that runs with recovery or without."""
        path = SimpleNamespace(path=self.directory.parent / "recovery")
        self.session.config.recovery = path if recovery else None
        self.joined = True

    def manager(self, **kwargs: bool) -> CheckpointManager:
        return CheckpointManager(self.directory, "p", CONFIG, **kwargs)


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Job:
    return Job(monkeypatch, tmp_path)


def loop_of(checkpoints: CheckpointManager) -> TrainingLoop:
    state = {"w": np.zeros(4)}
    return TrainingLoop(4, checkpoints, lambda: state, state.update, say=lambda line: None)


@pytest.mark.parametrize(
    ("given", "runs", "said"),
    [
        (False, True, "which runs with recovery (MS_ENABLE_RECOVERY=1)"),
        (True, False, "which runs without recovery (MS_ENABLE_RECOVERY is off)"),
    ],
)
def test_a_managers_recovery_that_contradicts_the_jobs_is_refused_in_words(
    job: Job, given: bool, runs: bool, said: str
) -> None:
    """The launch decides. (A manager told recovery=False in a job with recovery kept no state
    of step 0, no copy of its steps and served no peer: a failure in step 1 stopped the worker
    with a CheckpointError saying it had let the state of step 0 go once every rank held a
    checkpoint, which none did. Told recovery=True in a job without, it copied every step for
    a rollback that never comes, and started a state server.)"""
    job.init(recovery=runs)
    with pytest.raises(ConfigError) as refused:
        job.manager(recovery=given)
    message = str(refused.value)
    assert message.startswith(f"CheckpointManager(recovery={given}) contradicts this job, {said}")
    assert "leave recovery= out" in message


@pytest.mark.parametrize("runs", [True, False])
def test_a_manager_in_a_job_runs_as_the_job_does(job: Job, runs: bool) -> None:
    job.init(recovery=runs)
    for kwargs in ({}, {"recovery": runs}):
        checkpoints = job.manager(**kwargs)
        loop = loop_of(checkpoints)
        assert checkpoints.recovery is runs
        assert (loop._initial.state() is not None) is runs  # the state of step 0, for a rollback
        checkpoints.close()


def test_a_manager_made_before_init_takes_the_jobs_recovery_when_connected(job: Job) -> None:
    """MS_ENABLE_RECOVERY is unset as the manager is made, and `cluster.init()` joins a job with
    recovery (its config given, not read from the environment): the loop, which connects the
    manager, runs with recovery, and keeps the state of step 0. (The manager kept the guess it
    was made with.)"""
    checkpoints = job.manager()
    assert checkpoints.recovery is False
    job.init(recovery=True)
    loop = loop_of(checkpoints)
    assert checkpoints.recovery is True
    assert loop._initial.state() is not None
    checkpoints.close()


def test_a_manager_made_before_init_told_otherwise_than_the_job_is_refused_when_connected(
    job: Job,
) -> None:
    checkpoints = job.manager(recovery=False)
    job.init(recovery=True)
    with pytest.raises(ConfigError, match=r"CheckpointManager\(recovery=False\) contradicts"):
        loop_of(checkpoints)
    checkpoints.close()


def test_a_loop_made_before_init_for_another_recovery_is_refused_as_it_starts(job: Job) -> None:
    """A loop made before `cluster.init()` keeps the copies of the recovery it was made for: in
    a job that runs otherwise it stops as it starts, saying to make it after `cluster.init()`."""
    checkpoints = job.manager()
    loop = loop_of(checkpoints)
    job.init(recovery=True)
    with pytest.raises(ConfigError) as refused:
        next(iter(loop))
    assert str(refused.value) == (
        "this TrainingLoop was made before cluster.init() for a job without recovery "
        "(MS_ENABLE_RECOVERY as it was then), but the job that cluster.init() joined runs with "
        "it: make the TrainingLoop after cluster.init()"
    )
    checkpoints.close()
