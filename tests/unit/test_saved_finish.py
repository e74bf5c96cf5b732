"""What a worker whose Finish got no answer reads of the scheduler's saved state
(`cluster.worker.saved_finish`): evidence only for this very process of this node, in this job,
saved as finished; nothing from another job, another process, a state it cannot read, or none.
The states are the scheduler machine's own snapshots, saved as the scheduler saves them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.scheduler.machine.state import SchedulerState
from cluster.storage import store
from cluster.storage.directory_store import STATE_FILE
from cluster.storage.state_store import SCHEDULER_KIND
from cluster.worker import saved_finish
from cluster.worker.saved_finish import counted
from tests.conftest import FakeClock
from tests.unit.test_state import JOB, accept, make_state, reg


def formed(workers: int = 2) -> SchedulerState:
    """A formed job of JOB with recovery: nodes "0", "1", ..., each of incarnation 1."""
    state = make_state(FakeClock(), worker_num=workers, recovery=True)
    for i in range(workers):
        accept(state, reg(state, str(i)))
        state.connect(str(i), 1)
    return state


def saved(directory: Path, state: SchedulerState) -> Path:
    path = directory / STATE_FILE
    store.save(path, SCHEDULER_KIND, state.snapshot())
    return path


def test_a_finish_saved_as_the_job_ended_is_evidence(tmp_path: Path) -> None:
    state = formed()
    for node_id in ("0", "1"):
        state.finish(node_id, 1)
    path = saved(tmp_path, state)
    assert counted(tmp_path, JOB, "1", 1) == (
        f"its saved state ({path}) lists this node's finish as counted and the job as finished"
    )
    assert counted(tmp_path, JOB, "01", 1)  # a numeric node id is its rank


def test_a_finish_saved_while_others_work_is_evidence_of_that_finish_only(tmp_path: Path) -> None:
    state = formed()
    state.finish("1", 1)
    path = saved(tmp_path, state)
    assert counted(tmp_path, JOB, "1", 1) == (
        f"its saved state ({path}) lists this node's finish as counted"
    )
    assert counted(tmp_path, JOB, "0", 1) == ""  # still at work


def test_a_state_of_another_job_or_process_or_none_shows_nothing(tmp_path: Path) -> None:
    assert counted(tmp_path, JOB, "1", 1) == ""  # no state here (another host)
    state = formed()
    for node_id in ("0", "1"):
        state.finish(node_id, 1)
    saved(tmp_path, state)
    assert counted(tmp_path, "job-2", "1", 1) == ""
    assert counted(tmp_path, "", "1", 1) == ""  # a node that never joined knows no job
    assert counted(tmp_path, JOB, "1", 2) == ""  # another process of the node
    assert counted(tmp_path, JOB, "2", 1) == ""  # not a member


def test_a_state_that_cannot_be_read_shows_nothing(tmp_path: Path) -> None:
    state = formed()
    for node_id in ("0", "1"):
        state.finish(node_id, 1)
    path = saved(tmp_path, state)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # torn
    assert counted(tmp_path, JOB, "1", 1) == ""
    path.write_bytes(whole.replace(b'"finished"', b'"alive"', 1))  # edited: fails its checksum
    assert counted(tmp_path, JOB, "1", 1) == ""


def test_a_state_that_showed_nothing_is_read_again_only_once_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held Finish looks every second for as long as its reconnect window, and the file is
    the whole job's state: one that showed nothing (the scheduler went away before it counted
    the finish, or for good) is only stat'ed until the scheduler saves again."""
    reads: list[Path] = []
    read = saved_finish.counted

    def counting(directory: Path, *whose: str | int) -> str:
        reads.append(directory)
        return read(directory, *whose)  # type: ignore[arg-type]

    monkeypatch.setattr(saved_finish, "counted", counting)
    looks = saved_finish.SavedFinish(tmp_path, JOB, "1", 1)
    assert looks.look() == ""  # no state here yet: nothing to read
    assert reads == []
    state = formed()
    saved(tmp_path, state)
    for _ in range(3):
        assert looks.look() == ""  # still at work
    assert len(reads) == 1
    state.finish("1", 1)
    path = saved(tmp_path, state)  # saved again: another file in its place
    assert looks.look() == f"its saved state ({path}) lists this node's finish as counted"
    assert len(reads) == 2
