"""Write-ahead saving in the scheduler core: what a node is told is already on disk."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import ConfigError, EtcdUnavailable, StateFileError
from cluster.protocol.settings import JobSettings
from cluster.scheduler import convert
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.machine.state import Accepted, Refused
from cluster.scheduler.persist import STATE_KIND
from cluster.scheduler.server import JobStore, SchedulerServer
from cluster.storage import atomic, store
from cluster.storage.directory_store import STATE_FILE, DirectoryStore
from cluster.storage.state_store import Written
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import BOUND_S, eventually, settle
from tests.conftest import FakeClock
from tests.credentials import caller, registration

SETTINGS = JobSettings(
    worker_num=2,
    server_num=0,
    node_timeout_s=5.0,
    topo_timeout_s=60.0,
    heartbeat_interval_s=1.0,
    recovery=True,
)


def status_of(core: SchedulerCore) -> pb.StatusResponse:
    """What Status answers (the servicer's conversion)."""
    return convert.status_to_pb(core.state, core.now(), core.told(), core.saving())


async def held(directory: Path) -> DirectoryStore:
    state_store = DirectoryStore(directory)
    await state_store.acquire()
    return state_store


async def started(directory: Path) -> SchedulerCore:
    core = await SchedulerCore.resume(SETTINGS, await held(directory))
    assert core.persister is not None
    await core.save_first()
    core.start_saving()
    return core


def saved(directory: Path) -> dict[str, object]:
    payload = store.load(directory / STATE_FILE, STATE_KIND)
    assert payload is not None
    return payload


async def test_the_job_id_is_saved_before_anyone_registers(tmp_path: Path) -> None:
    core = await started(tmp_path)
    assert saved(tmp_path)["cluster_id"] == core.state.cluster_id
    assert core.persister is not None
    await core.persister.stop()


async def test_answers_and_events_wait_for_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = await started(tmp_path)
    first = await asyncio.wait_for(core.register(registration("0")), BOUND_S)
    assert isinstance(first, Accepted)
    assert saved(tmp_path)["phase"] == "waiting"  # forming: nothing more to save
    # Hold the next save on its thread until the test lets it go.
    gate = threading.Event()
    real_save = store.save

    def held_save(*args: Any) -> None:
        assert gate.wait(BOUND_S)
        real_save(*args)

    monkeypatch.setattr(store, "save", held_save)
    stream = core.watch("0", 1)
    event = asyncio.ensure_future(anext(stream))
    answer = asyncio.ensure_future(core.register(registration("1")))
    await settle(lambda: core.persister is not None and core.persister.pending)
    for _ in range(20):
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    # The job has formed in memory, but nobody has been told: the save is not done.
    assert core.state.generation == 1
    assert not answer.done()
    assert not event.done()
    assert saved(tmp_path)["phase"] == "waiting"
    gate.set()
    assert isinstance(await asyncio.wait_for(answer, BOUND_S), Accepted)
    sent = await asyncio.wait_for(event, BOUND_S)
    if isinstance(sent, bytes):  # broadcasts go out serialized once
        sent = pb.Event.FromString(sent)
    assert sent.topology_ready.generation == 1
    assert saved(tmp_path)["phase"] == "ready"
    await asyncio.wait_for(core.finish("0", 1, caller("0", 1)), BOUND_S)
    members = saved(tmp_path)["members"]
    assert isinstance(members, list)
    assert {m["node_id"]: m["state"] for m in members} == {"0": "finished", "1": "alive"}
    await stream.aclose()
    assert core.persister is not None
    await core.persister.stop()


async def test_a_restarted_core_resumes_the_saved_job(tmp_path: Path) -> None:
    core = await started(tmp_path)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    assert core.persister is not None
    await core.persister.stop()
    await core.persister.store.close()  # the lock goes, as with the process
    again = await started(tmp_path)
    assert (again.state.cluster_id, again.state.generation) == (core.state.cluster_id, 1)
    outcome = await asyncio.wait_for(
        again.register(registration("1", cluster_id=core.state.cluster_id)), BOUND_S
    )
    assert isinstance(outcome, Accepted)
    assert not outcome.rejoined
    assert again.persister is not None
    await again.persister.stop()


def break_saves(directory: Path) -> Path:
    """Make every save fail as a full disk would (a directory where the file is renamed to)."""
    path = directory / STATE_FILE
    path.unlink()
    path.mkdir()
    return path


def as_event(item: object) -> pb.Event:
    return pb.Event.FromString(item) if isinstance(item, bytes) else item  # type: ignore[return-value]


async def test_a_failing_save_releases_nothing_until_a_save_lands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Write-ahead is absolute: a failed save tells nobody anything; the retry that lands does."""
    caplog.set_level(logging.INFO, logger="cluster")
    core = await started(tmp_path)
    persister = core.persister
    assert persister is not None
    await asyncio.wait_for(core.register(registration("0")), BOUND_S)
    stream = core.watch("0", 1)
    event = asyncio.ensure_future(anext(stream))
    fault = break_saves(tmp_path)
    answer = asyncio.ensure_future(core.register(registration("1")))
    await eventually(lambda: persister.failures >= 3, "three failed saves")
    assert core.state.generation == 1  # formed in memory...
    assert not answer.done()  # ...but neither the answer
    assert not event.done()  # nor the topology went out
    status = status_of(core)
    assert (status.phase, status.generation) == (pb.PHASE_WAITING, 0)  # as told, as on disk
    assert "(Is a directory)" in status.saving.error
    assert str(tmp_path / STATE_FILE) in status.saving.error
    assert status.saving.failing_for_s >= 0
    assert status.saving.unsaved_changes >= 1
    assert caplog.text.count("cannot save the recovery state") == 1  # once, not per attempt
    fault.rmdir()
    assert isinstance(await asyncio.wait_for(answer, BOUND_S), Accepted)
    assert as_event(await asyncio.wait_for(event, BOUND_S)).topology_ready.generation == 1
    assert saved(tmp_path)["phase"] == "ready"
    status = status_of(core)
    assert (status.phase, status.generation, status.saving.error) == (pb.PHASE_READY, 1, "")
    assert status.saving.failures >= 3  # a counter: it stays
    assert caplog.text.count("recovery state saved again") == 1
    await stream.aclose()
    await persister.stop()


async def test_held_events_go_out_in_order_once_saved_and_the_rejoining_node_stays_alive(
    tmp_path: Path,
) -> None:
    clock = FakeClock(100.0)
    settings = dataclasses.replace(SETTINGS, heartbeat_interval_s=0.02)
    core = await SchedulerCore.resume(settings, await held(tmp_path), clock)
    persister = core.persister
    assert persister is not None
    await core.save_first()
    persister.start()
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    streams = [core.watch(node_id, 1) for node_id in ("0", "1")]
    for stream in streams:  # the welcome: generation 1
        assert as_event(await asyncio.wait_for(anext(stream), BOUND_S)).topology_ready.generation
    fault = break_saves(tmp_path)
    await streams[1].aclose()  # node 1's process died: a failure, to be saved
    survivor = asyncio.ensure_future(anext(streams[0]))
    # The guard's refusal says nothing the disk must know: it is answered at once.
    refused = await asyncio.wait_for(core.register(registration("1", 2)), BOUND_S)
    assert isinstance(refused, Refused)
    clock.now += SETTINGS.node_timeout_s + 1  # the guard is over
    cluster_id = core.state.cluster_id
    answer = asyncio.ensure_future(core.register(registration("1", 2, cluster_id)))
    await eventually(lambda: core.state.generation == 2, "the rejoin decided")
    clock.now += SETTINGS.node_timeout_s + 1  # longer than a silent node may live
    member = core.state.members["1"]
    await eventually(lambda: member.last_seen == clock.now, "the waiting node counted alive")
    core.heartbeat("0", 1, caller("0", 1))
    assert core.state.tick() == []  # nobody failed for the wait
    assert not survivor.done()
    assert not answer.done()
    assert status_of(core).generation == 1
    fault.rmdir()
    failed = as_event(await asyncio.wait_for(survivor, BOUND_S))
    assert failed.node_failed.node_id == "1"
    ready = as_event(await asyncio.wait_for(anext(streams[0]), BOUND_S))
    assert ready.topology_ready.generation == 2
    outcome = await asyncio.wait_for(answer, BOUND_S)
    assert isinstance(outcome, Accepted)
    assert outcome.rejoined
    assert status_of(core).generation == 2
    assert saved(tmp_path)["generation"] == 2
    await streams[0].aclose()
    await persister.stop()


async def test_stopping_while_saves_fail_is_bounded_and_says_so(tmp_path: Path) -> None:
    core = await started(tmp_path)
    persister = core.persister
    assert persister is not None
    break_saves(tmp_path)
    answers = [asyncio.ensure_future(core.register(registration(n))) for n in ("0", "1")]
    await eventually(lambda: persister.failures >= 1, "a failed save")
    assert not await asyncio.wait_for(persister.stop(0.2), BOUND_S)
    assert persister.pending
    assert not answers[1].done()  # nobody was told of the formed job
    for answer in answers:
        answer.cancel()


async def test_an_unusable_state_file_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{ torn")
    with pytest.raises(StateFileError, match="truncated or corrupt"):
        await SchedulerCore.resume(SETTINGS, await held(tmp_path))
    assert (tmp_path / STATE_FILE).read_text() == "{ torn"


async def test_a_scheduler_on_a_directory_that_cannot_take_its_state_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every save fails: its temporary file cannot be created, as on a full disk.
    def full(path: Path) -> tuple[int, Path]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(atomic, "create_temporary", full)
    server = SchedulerServer(SETTINGS, store=JobStore.directory(tmp_path))
    with pytest.raises(ConfigError) as caught:
        await asyncio.wait_for(server.start(), BOUND_S)
    assert "MS_RECOVERY_PATH is not usable: cannot save the recovery state to" in str(caught.value)
    assert "(No space left on device)" in str(caught.value)
    # Nothing left behind: the lock is free for the next try.
    with store.RecoveryLock(tmp_path):
        pass


class AnswerLost(DirectoryStore):
    """The real directory store, whose next `lose` saves land on disk but answer as an etcd
    transaction whose answer timed out does: an error, though the state was written."""

    lose = 0

    async def save(self, snapshot: dict[str, Any], token: str) -> Written:
        written = await super().save(snapshot, token)
        if self.lose > 0:
            self.lose -= 1
            raise EtcdUnavailable("no etcd member answered within 5 s (DEADLINE_EXCEEDED)")
        return written


async def test_a_save_that_landed_though_its_answer_was_lost_is_not_taken_for_a_rival(
    tmp_path: Path,
) -> None:
    """The saves after it find the state moved on, and it is this scheduler's own: they save
    over it, and the scheduler goes on leading (it used to step down, taking it for another's)."""
    state_store = AnswerLost(tmp_path)
    await state_store.acquire()
    core = await SchedulerCore.resume(SETTINGS, state_store)
    persister = core.persister
    assert persister is not None
    await core.save_first()
    core.start_saving()
    state_store.lose = 2  # two in a row: the first to land is not the last one tried
    await asyncio.wait_for(core.register(registration("0")), BOUND_S)
    await asyncio.wait_for(core.register(registration("1")), BOUND_S)
    assert persister.fenced is None
    assert persister.failures >= 2
    assert saved(tmp_path)["phase"] == "ready"
    await persister.stop()
