"""Write-ahead saving in the scheduler core: what a node is told is already on disk."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import StateFileError
from cluster.protocol.state import Accepted, NodeRole, Registration
from cluster.scheduler.core import CoreSettings, SchedulerCore
from cluster.scheduler.persist import STATE_FILE, STATE_KIND
from cluster.storage import store
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import BOUND_S, settle

SETTINGS = CoreSettings(
    worker_num=2,
    server_num=0,
    node_timeout_s=5.0,
    topo_timeout_s=60.0,
    heartbeat_interval_s=1.0,
    recovery=True,
)


def registration(node_id: str, incarnation: int = 1, cluster_id: str = "") -> Registration:
    return Registration(node_id, NodeRole.WORKER, "127.0.0.1", 6000, incarnation, 2, 0, cluster_id)


async def started(directory: Path) -> SchedulerCore:
    core = SchedulerCore.recovering(SETTINGS, directory)
    assert core.persister is not None
    core.persister.start()
    core.persister.request(core.state.revision)
    await asyncio.wait_for(core.durable(), BOUND_S)
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
    await asyncio.wait_for(core.finish("0", 1), BOUND_S)
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
    again = await started(tmp_path)
    assert (again.state.cluster_id, again.state.generation) == (core.state.cluster_id, 1)
    outcome = await asyncio.wait_for(
        again.register(registration("1", cluster_id=core.state.cluster_id)), BOUND_S
    )
    assert isinstance(outcome, Accepted)
    assert not outcome.rejoined
    assert again.persister is not None
    await again.persister.stop()


async def test_a_failing_save_is_reported_and_does_not_stall_the_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    core = await started(tmp_path)
    (tmp_path / STATE_FILE).unlink()
    (tmp_path / STATE_FILE).mkdir()  # os.replace onto a directory fails
    for node_id in ("0", "1"):
        outcome = await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
        assert isinstance(outcome, Accepted)
    assert core.persister is not None
    assert core.persister.error is not None
    assert "cannot save the recovery state" in caplog.text
    await core.persister.stop()


def test_an_unusable_state_file_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{ torn")
    with pytest.raises(StateFileError, match="truncated or corrupt"):
        SchedulerCore.recovering(SETTINGS, tmp_path)
    assert (tmp_path / STATE_FILE).read_text() == "{ torn"
