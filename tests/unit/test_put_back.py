"""What a worker's checkpoint reports say while it puts back a generation's rollback step, with
its `TrainingLoop` or by hand (`discard_newer`): the scheduler counts a list for the new
generation only when it was taken after the steps of the abandoned run were discarded
(`RollbackPlanner.holdings`). The rules are `cluster.protocol.put_back`'s."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from cluster.api import peer_state, runtime, training, worker_metrics
from cluster.api.checkpoint import CheckpointManager
from cluster.api.checkpoint_config import CheckpointConfig
from cluster.protocol import resume
from cluster.protocol.put_back import (
    put_back_at_start,
    put_back_by_discarding,
    saved_before_put_back,
)
from cluster.storage import checkpoint_files

WAIT_S = 30.0


class Agent:
    """The part of a worker's agent the reports read (`WorkerAgent.report_generation`)."""

    def __init__(self, topology: SimpleNamespace) -> None:
        self.topology = topology
        self.resumed_in: int | None = None
        self.cluster_id = ""  # no seat in a job for the manager's lock (test_checkpoint_lock)

    @property
    def report_generation(self) -> int:
        return self.resumed_in or self.topology.generation


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> tuple[SimpleNamespace, list[tuple[list[int], int]]]:
    """A worker of rank 0 in generation 2 of a job with recovery (faked: no network), and the
    reports it sends, as (steps, generation said)."""
    topology = SimpleNamespace(generation=2, rank=0, rollback_step=1, reason="rank 1 rejoined")
    recovery = SimpleNamespace(path=Path("recovery"))
    session = SimpleNamespace(
        config=SimpleNamespace(recovery=recovery), topology=topology, say=print, generation_pin=None
    )
    session.agent = Agent(topology)
    sent: list[tuple[list[int], int]] = []

    def report(steps: list[int], generation: int = 0) -> int:
        sent.append((list(steps), generation or session.agent.report_generation))
        return 0

    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "session", lambda: session)
    monkeypatch.setattr(runtime, "report_checkpoints", report)
    monkeypatch.setattr(runtime, "report_memory_resume", lambda *args: None)
    monkeypatch.setattr(worker_metrics, "start", lambda: None)
    monkeypatch.setattr(peer_state, "serve", lambda served: None)  # no state server started
    return session, sent


def test_a_list_the_writer_takes_while_the_loop_puts_a_step_back_says_the_generation_before(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    job: tuple[SimpleNamespace, list[tuple[list[int], int]]],
) -> None:
    """Steps 1 to 3 are saved in generation 1; the write of step 3 ends only while the loop,
    resuming generation 2 from step 1, waits for its writer to discard the steps past 1. The
    list taken then (step 3 of the abandoned run among them) says generation 1; only the list
    left once the newer steps are gone says generation 2. (The loop said it put generation 2
    back before it discarded: that list said 2, and a generation decided while the worker
    removed step 3 could roll back to it.)"""
    session, sent = job
    gate = threading.Event()
    write = checkpoint_files.write

    def held(path: Path, step: int, *args: Any, **kwargs: Any) -> None:
        if step == 3:
            assert gate.wait(WAIT_S)
        write(path, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "write", held)
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=5), recovery=True)
    state = {"w": np.zeros(2)}
    loop = training.TrainingLoop(4, ckpt, lambda: state, state.update, say=lambda line: None)
    session.agent.resumed_in = 1  # generation 1 was put back (the job's first start)
    for step in (1, 2):
        ckpt.save(step, {"w": np.full(2, step)})
    ckpt.flush()
    loop.memory.keep(1, {"w": np.full(2, 1)}, saved=False)  # resumed from this, in memory
    ckpt.save(3, {"w": np.full(2, 3)})  # its write ends while the loop puts step 1 back
    writer = ckpt._writes.writer
    wait = writer.wait

    def waited() -> None:
        gate.set()
        wait()

    monkeypatch.setattr(writer, "wait", waited)
    where = resume.Resume(1, True, (0,), "every worker holds step 1")
    assert loop._restore(where, session.topology) == 1
    assert sent == [([1], 1), ([1, 2], 1), ([1, 2, 3], 1), ([1], 2)]
    assert ckpt.steps() == [1]
    ckpt.close()


def test_a_fresh_process_says_the_generation_before_until_it_puts_a_step_back(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    job: tuple[SimpleNamespace, list[tuple[list[int], int]]],
) -> None:
    """A restarted worker (or a promoted spare) starts its loop in generation 2: the rank's
    files (step 3 of the abandoned run among them) are listed before it puts step 1 back, and
    say generation 1 (the generation it is in said 2); what is left once step 3 is gone says
    2."""
    session, sent = job
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=5))
    for step in (1, 3):
        ckpt.save(step, {"w": np.full(2, step)})
    ckpt.flush()
    sent.clear()
    state = {"w": np.zeros(2)}
    loop = training.TrainingLoop(4, ckpt, lambda: state, state.update, say=lambda line: None)
    monkeypatch.setattr(runtime, "topology", lambda: session.topology)
    monkeypatch.setattr(runtime, "is_rejoin", lambda: True)
    monkeypatch.setattr(training, "allgather_bytes", lambda value: [resume.encode(None)])

    def load(self: CheckpointManager, step: int) -> dict[str, Any]:
        self._writes.report_now()  # the rank's files listed: a damaged file moved aside, ...
        return {"w": np.full(2, step)}

    monkeypatch.setattr(CheckpointManager, "load", load)
    assert loop._start() == 1
    assert sent == [([1, 3], 1), ([1], 2)]
    ckpt.close()


@pytest.mark.parametrize(
    ("step", "put_back", "said"),
    [(1, None, 2), (0, None, 2), (2, None, 1), (1, 0, 1), (2, 2, 2)],
    ids=["the-rollback-step", "before-it", "past-it", "none-given", "given"],
)
def test_a_discard_by_hand_puts_the_generation_back_when_nothing_past_its_step_is_left(
    tmp_path: Path,
    job: tuple[SimpleNamespace, list[tuple[list[int], int]]],
    step: int,
    put_back: int | None,
    said: int,
) -> None:
    """A worker that rolls back without a TrainingLoop, in generation 2 (rollback step 1),
    calls `discard_newer(step)` with no generation: at or before the rollback step it puts
    generation 2 back, and the list left says so; past it, a step of the run the job abandoned
    may be left, and its reports still say the generation it had put back (1). A `put_back`
    given wins, 0 included. (A worker that put back without a TrainingLoop never said so: its
    reports said the generation it was in from the moment it heard it, the abandoned run's
    steps included.)"""
    session, sent = job
    session.agent.resumed_in = 1  # as it took generation 2 (`resume.put_back_at_start`)
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=5))
    for saved in (1, 2, 3):
        ckpt.save(saved, {"w": np.full(2, saved)})
    ckpt.flush()
    sent.clear()
    ckpt.discard_newer(step, put_back=put_back)
    assert sent == [([s for s in (1, 2, 3) if s <= step], said)]
    assert session.agent.resumed_in == said
    ckpt.close()


def test_a_process_has_put_back_its_first_generation_only_on_the_jobs_first_start() -> None:
    """What a worker's reports say it put back when its process takes its first generation:
    that one for the job's first start (generation 1 from step 0), else the one before (a
    restarted worker, a promoted spare, a process of a job re-formed since)."""
    assert put_back_at_start(1, 0, rejoined=False) == 1
    assert put_back_at_start(3, 20, rejoined=True) == 2
    assert put_back_at_start(4, 0, rejoined=False) == 3  # a spare promoted before any save


def test_a_discard_puts_back_only_what_leaves_no_step_past_the_rollback_step() -> None:
    assert put_back_by_discarding(20, 3, rollback_step=20) == 3
    assert put_back_by_discarding(10, 3, rollback_step=20) == 3  # further back: none past 20
    assert put_back_by_discarding(30, 3, rollback_step=20) == 0  # step 30 may be abandoned


def test_a_save_before_the_generation_is_put_back_is_said_once_with_what_to_do(
    tmp_path: Path, job: tuple[SimpleNamespace, list[tuple[list[int], int]]]
) -> None:
    """A worker that rolled back by hand to step 1 in generation 2 and saves past it without
    `discard_newer` is told, once for the generation, that the scheduler counts none of its
    steps past 1 and what to call; a save at or before the rollback step, or after the put-back,
    says nothing."""
    session, _ = job
    lines: list[str] = []
    session.say = lines.append
    session.agent.resumed_in = 1  # as it took generation 2 (`put_back_at_start`)
    ckpt = CheckpointManager(tmp_path, "p", CheckpointConfig(keep_checkpoint_max=5))
    ckpt.save(1, {"w": np.full(2, 1)})
    assert lines == []
    for step in (2, 3):
        ckpt.save(step, {"w": np.full(2, step)})
    assert len(lines) == 1
    assert "saving step 2 of generation 2" in lines[0]
    assert "discard_newer(1)" in lines[0]
    ckpt.discard_newer(1)
    ckpt.save(2, {"w": np.full(2, 2)})
    assert len(lines) == 1
    ckpt.close()


def test_only_a_save_past_the_rollback_step_before_the_put_back_is_early() -> None:
    assert saved_before_put_back(30, 3, rollback_step=20, reported=2)
    assert not saved_before_put_back(20, 3, rollback_step=20, reported=2)
    assert not saved_before_put_back(30, 3, rollback_step=20, reported=3)
