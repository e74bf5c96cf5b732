"""Which rank a CheckpointManager writes as: one made before `cluster.init()` takes the job's
rank when connected, and a file of another rank is never loaded as this rank's own state."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.api import runtime
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError, ConfigError
from cluster.storage import checkpoint_files


def per_rank(tmp_path: Path, rank: int, *, replicated: bool) -> CheckpointManager:
    config = CheckpointConfig(replicated=replicated)
    return CheckpointManager(tmp_path, "net", config, rank=rank, recovery=False)


def test_a_file_of_another_rank_is_refused_by_its_header(tmp_path: Path) -> None:
    """States differ per rank: rank 0's file found in rank 1's directory is not rank 1's."""
    with per_rank(tmp_path, 0, replicated=False) as zero:
        zero.save(1, {"shard": 0})
    with per_rank(tmp_path, 1, replicated=False) as one:
        shutil.copy(zero.path(1), one.path(1))
        with pytest.raises(CheckpointError, match=r"rank_1/net-00000001\.ckpt holds the state"):
            checkpoint_files.read(one.path(1), 1, rank=1)
        assert checkpoint_files.read(one.path(1), 1, rank=0) == {"shard": 0}
        with pytest.raises(CheckpointError, match="holds the state of rank 0, not of rank 1"):
            one.load(1)  # and moved aside: not this rank's, never reported as held
        assert one.steps() == []
        assert one.latest() is None
        assert (one.directory / "net-00000001.ckpt.damaged").read_bytes() == (
            zero.path(1).read_bytes()
        )
    shutil.copy(zero.path(1), one.path(1))
    with per_rank(tmp_path, 1, replicated=True) as replica:  # any rank's state will do
        assert replica.load(1) == {"shard": 0}


class FakeJob:
    """cluster.init() as far as a manager sees it (no network): off until `join(rank)`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.rank: int | None = None
        self.reported: list[list[int]] = []
        self.said: list[str] = []
        # No topology: no seat in a job for the manager's lock (tests/unit/test_checkpoint_lock).
        session = SimpleNamespace(
            config=SimpleNamespace(recovery=None),
            topology=None,
            say=self.said.append,
            agent=SimpleNamespace(report_generation=1),
        )
        monkeypatch.setattr(runtime, "is_initialized", lambda: self.rank is not None)
        monkeypatch.setattr(runtime, "get_rank", lambda: self.rank)
        monkeypatch.setattr(runtime, "session", lambda: session)
        monkeypatch.setattr(runtime, "report_checkpoints", self.report)
        monkeypatch.delenv("MS_ENABLE_RECOVERY", raising=False)

    def report(self, steps: list[int], generation: int = 0) -> int:
        self.reported.append(steps)
        return 0

    def join(self, rank: int) -> None:
        self.rank = rank


@pytest.mark.parametrize("connect", [True, False], ids=["connected", "first-save"])
def test_a_manager_made_before_init_takes_the_jobs_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, connect: bool
) -> None:
    job = FakeJob(monkeypatch, tmp_path)
    ckpt = CheckpointManager(tmp_path, "net", CheckpointConfig())
    assert (ckpt.rank, ckpt.report) == (0, None)
    job.join(2)
    if connect:
        ckpt.connect()  # as a TrainingLoop does
        assert (ckpt.rank, ckpt.directory) == (2, tmp_path / "rank_2")
    with ckpt:
        ckpt.save(1, {"rank": 2})
    assert ckpt.rank == 2
    assert checkpoint_files.read(tmp_path / "rank_2" / "net-00000001.ckpt", 1, rank=2) == {
        "rank": 2
    }
    assert not any((tmp_path / "rank_0").iterdir())
    assert job.reported == [[1]]


def test_a_given_rank_or_report_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    job = FakeJob(monkeypatch, tmp_path)
    mine: list[list[int]] = []

    def report(steps: list[int]) -> None:
        mine.append(steps)

    ckpt = CheckpointManager(tmp_path, "net", CheckpointConfig(), rank=5, report=report)
    job.join(1)
    ckpt.connect()
    with ckpt:
        ckpt.save(1, {})
    assert (ckpt.rank, mine, job.reported) == (5, [[1]], [])


@pytest.mark.parametrize("use", ["save", "latest"])
def test_a_manager_used_as_rank_0_before_init_is_refused_as_another_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, use: str
) -> None:
    job = FakeJob(monkeypatch, tmp_path)
    ckpt = CheckpointManager(tmp_path, "net", CheckpointConfig())
    calls: dict[str, Any] = {"save": lambda: ckpt.save(1, {}), "latest": ckpt.latest}
    calls[use]()
    ckpt.flush()
    job.join(1)
    with pytest.raises(ConfigError, match=r"as rank 0 before cluster\.init\(\), but this worker"):
        ckpt.connect()
    with pytest.raises(ConfigError, match=r"make the manager after cluster\.init\(\), or pass"):
        ckpt.save(2, {})
    ckpt.close()


def test_a_manager_used_before_init_goes_on_as_rank_0_in_the_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    job = FakeJob(monkeypatch, tmp_path)
    with CheckpointManager(tmp_path, "net", CheckpointConfig()) as ckpt:
        ckpt.save(1, {})
        ckpt.flush()
        job.join(0)
        ckpt.save(2, {})
    assert ckpt.steps() == [1, 2]
    assert job.reported == [[1, 2]]
