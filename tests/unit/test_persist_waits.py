"""Write-ahead saving, the waits on a save: each ends with what is saved, or with the refusal
of a scheduler that no longer leads; none answers with what is not saved yet."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.errors import CollectiveError, NotLeaderError, PeerFailedError
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.machine.admission import ALLGATHER, BARRIER
from cluster.scheduler.persist import WriteAheadSaver
from cluster.scheduler.server import JobStore, SchedulerServer
from cluster.storage import store
from cluster.storage.kv_log import FILE_NAME
from cluster.transport.membership import call_metadata
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S, eventually, settle
from tests.credentials import caller, credential, registration
from tests.unit.test_persist import SETTINGS, as_event, break_saves, started


async def formed(directory: Path) -> SchedulerCore:
    core = await started(directory)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    return core


async def formed_saving(directory: Path) -> tuple[SchedulerCore, WriteAheadSaver]:
    """A formed job and its saver."""
    core = await formed(directory)
    assert core.persister is not None
    return core, core.persister


async def test_a_step_down_ends_the_calls_waiting_on_a_failing_save(tmp_path: Path) -> None:
    """The saver stops as the scheduler steps down (`uninstall`): a key set and a report that
    wait on a save that fails end at once with the refusal of a scheduler that does not lead."""
    async with SchedulerServer(SETTINGS, store=JobStore.directory(tmp_path)) as server:
        core = server.gate.core
        assert core is not None
        assert core.persister is not None
        persister = core.persister
        for node_id in ("0", "1"):
            await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
        break_saves(tmp_path)
        kv_log = tmp_path / FILE_NAME
        kv_log.unlink(missing_ok=True)
        kv_log.mkdir()  # every key-value save fails too
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            kv_set = asyncio.ensure_future(
                pb_grpc.SchedulerStub(channel).KvSet(
                    iter([pb.KvSetRequest(key="plan", value=b"v1")]),
                    metadata=call_metadata("0", 1, credential("0", 1)),
                )
            )
            report = asyncio.ensure_future(core.report_checkpoints("1", 1, [5], caller("1", 1)))
            await eventually(lambda: persister.failures >= 2, "saves failing")
            await eventually(lambda: persister.kv_error is not None, "key-value saves failing")
            assert not kv_set.done()
            assert not report.done()
            await asyncio.wait_for(server.uninstall(server.gate.not_leader()), BOUND_S)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(kv_set, BOUND_S)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(NotLeaderError):
                await asyncio.wait_for(report, BOUND_S)


async def test_a_barrier_after_a_peer_failed_is_refused_once_the_failure_is_saved(
    tmp_path: Path,
) -> None:
    core, persister = await formed_saving(tmp_path)
    streams = [core.watch(node_id, 1) for node_id in ("0", "1")]
    for stream in streams:  # the welcome: generation 1
        assert as_event(await asyncio.wait_for(anext(stream), BOUND_S)).topology_ready.generation
    fault = break_saves(tmp_path)
    await streams[1].aclose()  # rank 1's process died: a failure, to be saved
    barrier = asyncio.ensure_future(
        core.exchange("0", caller("0", 1), generation=1, seq=1, op=BARRIER, root=0, value=b"")
    )
    failures = persister.failures
    await eventually(lambda: persister.failures >= failures + 2, "saves failing")
    assert not barrier.done()  # the failure is not saved: nothing tells of it
    fault.rmdir()
    with pytest.raises(PeerFailedError, match="has failed"):
        await asyncio.wait_for(barrier, BOUND_S)
    assert not persister.pending
    await streams[0].aclose()
    await persister.stop()


async def test_a_report_is_answered_with_the_steps_its_save_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's report comes while rank 0's is being saved: rank 0's answer, given once its
    own save lands, does not count rank 1's step, which that save does not hold."""
    core, persister = await formed_saving(tmp_path)
    let_go = threading.Semaphore(0)  # one save on disk per release
    entered: list[None] = []  # one per save begun
    real_save = store.save

    def held_save(*args: Any) -> None:
        entered.append(None)
        assert let_go.acquire(timeout=BOUND_S)
        real_save(*args)

    monkeypatch.setattr(store, "save", held_save)
    first = asyncio.ensure_future(core.report_checkpoints("0", 1, [5], caller("0", 1)))
    await eventually(lambda: len(entered) == 1, "rank 0's report being saved")
    second = asyncio.ensure_future(core.report_checkpoints("1", 1, [5], caller("1", 1)))
    revision = core.state.revision
    await eventually(lambda: persister.requested == revision, "rank 1's report decided")
    let_go.release()
    assert await asyncio.wait_for(first, BOUND_S) == 0  # rank 1's step is not saved yet
    assert not second.done()
    let_go.release()
    await asyncio.wait_for(second, BOUND_S)
    await persister.stop()


async def test_a_finish_fails_the_others_collectives_once_it_is_saved(tmp_path: Path) -> None:
    """Rank 0 finishes while rank 1 waits in an allgather and saves fail: rank 1 hears of the
    finish (its round fails) only once the finish is saved, as rank 0 is answered."""
    core, persister = await formed_saving(tmp_path)
    gather = asyncio.ensure_future(
        core.exchange("1", caller("1", 1), generation=1, seq=1, op=ALLGATHER, root=0, value=b"1")
    )
    await settle(lambda: len(core.exchanges) == 1)  # rank 1 waits in round 1
    fault = break_saves(tmp_path)
    finish = asyncio.ensure_future(core.finish("0", 1, caller("0", 1)))
    failures = persister.failures
    await eventually(lambda: persister.failures >= failures + 2, "saves failing")
    assert not finish.done()
    assert not gather.done()  # the finish is not saved: nothing tells of it
    fault.rmdir()
    with pytest.raises(CollectiveError, match="has finished"):
        await asyncio.wait_for(gather, BOUND_S)
    await asyncio.wait_for(finish, BOUND_S)
    assert not persister.pending
    await persister.stop()


async def test_a_collective_after_a_finish_is_refused_once_the_finish_is_saved(
    tmp_path: Path,
) -> None:
    core, persister = await formed_saving(tmp_path)
    fault = break_saves(tmp_path)
    finish = asyncio.ensure_future(core.finish("0", 1, caller("0", 1)))
    await eventually(lambda: persister.failures >= 1, "saves failing")
    gather = asyncio.ensure_future(
        core.exchange("1", caller("1", 1), generation=1, seq=1, op=ALLGATHER, root=0, value=b"1")
    )
    failures = persister.failures
    await eventually(lambda: persister.failures >= failures + 2, "saves failing still")
    assert not gather.done()  # its refusal tells of rank 0's finish, which is not saved
    fault.rmdir()
    with pytest.raises(CollectiveError, match="has already finished"):
        await asyncio.wait_for(gather, BOUND_S)
    await asyncio.wait_for(finish, BOUND_S)
    await persister.stop()
