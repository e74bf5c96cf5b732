"""What SIGTERM and SIGINT do to a scheduler with a recovery directory and no standby
(`serve` maps them to `request_handover` and `request_stop`): SIGTERM leaves the job saved for
the scheduler started next, SIGINT ends it, also when it follows a SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import NotLeaderError
from cluster.scheduler.server import JobStore, SchedulerServer
from cluster.storage.directory_store import DirectoryStore
from cluster.storage.state_store import Written
from tests.aio import BOUND_S
from tests.credentials import caller, registration
from tests.unit.test_persist import SETTINGS, saved


async def formed(tmp_path: Path) -> SchedulerServer:
    server = SchedulerServer(SETTINGS, store=JobStore.directory(tmp_path))
    await server.start()
    core = server.gate.core
    assert core is not None
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    return server


async def test_sigterm_leaves_the_job_saved_as_it_runs(tmp_path: Path) -> None:
    server = await formed(tmp_path)
    try:
        server.request_handover("scheduler stopped by SIGTERM")
        assert await asyncio.wait_for(server.wait_done(), BOUND_S) is True
        assert server.gate.core is None  # it answers nothing more for the job
    finally:
        await server.stop(drain_s=0)
    assert server.unsaved is None
    assert saved(tmp_path)["phase"] == "ready"
    resumed = SchedulerServer(SETTINGS, store=JobStore.directory(tmp_path))
    await resumed.start()  # the directory's lock was let go
    try:
        assert resumed.core.state.generation == 1
    finally:
        await resumed.stop(drain_s=0)


async def test_sigint_after_a_sigterm_not_yet_under_way_ends_the_job(tmp_path: Path) -> None:
    server = await formed(tmp_path)
    try:
        server.request_handover("scheduler stopped by SIGTERM")
        server.request_stop("scheduler stopped by SIGINT")
        assert await asyncio.wait_for(server.wait_done(), BOUND_S) is False
    finally:
        await server.stop(drain_s=0)
    assert saved(tmp_path)["phase"] == "failed"


@pytest.fixture
def slow_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save of the state takes SLOW_SAVE_S (a slow disk: an NFS fsync)."""
    real = DirectoryStore._save

    def slow(self: DirectoryStore, snapshot: dict[str, Any], token: str) -> Written:
        time.sleep(SLOW_SAVE_S)  # sleep-ok: the fault, on the store's worker thread
        return real(self, snapshot, token)

    monkeypatch.setattr(DirectoryStore, "_save", slow)


SLOW_SAVE_S = 0.5


def resume_told(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "left to resume" in r.getMessage()]


@pytest.mark.usefixtures("slow_saves")
async def test_sigterm_while_the_jobs_end_is_saved_ends_it_as_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The job failed, and its end is told once saved; SIGTERM meanwhile: nothing is left to
    resume, the scheduler waits for that save and ends as the job did (exit 1), never saying
    "left to resume" about a job that is over."""
    caplog.set_level(logging.INFO, logger="cluster.scheduler")
    server = await formed(tmp_path)
    core = server.core
    try:
        core.abort("a server died")
        assert not core.done.is_set()  # its save is on the way
        server.request_handover("scheduler stopped by SIGTERM")
        assert await asyncio.wait_for(server.wait_done(), BOUND_S) is False
        assert core.done.is_set()
        assert server.gate.core is core  # the end is drained to the nodes as any end is
    finally:
        await server.stop(drain_s=0)
    assert saved(tmp_path)["phase"] == "failed"
    assert resume_told(caplog) == []


@pytest.mark.usefixtures("slow_saves")
async def test_an_end_that_lands_while_the_job_is_left_to_resume_is_the_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call under way ends the job while the scheduler leaves it to resume: the end lands
    in the save that leaving waits for, and the nodes are told. The job is over: its result
    (False), and no "left to resume"."""
    caplog.set_level(logging.INFO, logger="cluster.scheduler")
    server = await formed(tmp_path)
    core = server.core
    try:
        core.abort("a server died")
        left = await asyncio.wait_for(server._leave_to_resume("stopped by SIGTERM"), BOUND_S)
        assert left is False
        assert core.done.is_set()
    finally:
        await server.stop(drain_s=0)
    assert saved(tmp_path)["phase"] == "failed"
    assert resume_told(caplog) == []


async def ended_with(
    awaitable: Awaitable[object], error: type[BaseException]
) -> BaseException | None:
    """What `awaitable` ended with, within BOUND_S (None: it returned)."""
    try:
        await asyncio.wait_for(awaitable, BOUND_S)
    except error as exc:
        return exc
    return None


async def test_a_scheduler_whose_directory_was_replaced_stands_down_and_exits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MS_RECOVERY_PATH removed and made again under a running scheduler without standbys: its
    next save is refused (another scheduler may hold the new directory). It answers nothing
    more: a node's stream, a key-value wait and an event follower end at once with "not the
    leader", and `wait_done` returns False, so the process exits 1 and frees the port for a
    scheduler started again, with one line saying why and what to do."""
    caplog.set_level(logging.INFO, logger="cluster.scheduler")
    directory = tmp_path / "recovery"
    directory.mkdir(mode=0o700)
    server = await formed(directory)
    core = server.core
    try:
        watch = core.watch("1", 1)
        await asyncio.wait_for(anext(watch), BOUND_S)  # the topology: the stream is open
        streamed = asyncio.ensure_future(anext(watch))
        waiting = asyncio.ensure_future(core.kv_wait(caller("0", 1), ["never"], 600.0))
        following = asyncio.ensure_future(anext(core.journal.follow(core.journal.seq)))
        shutil.rmtree(directory)
        directory.mkdir(mode=0o700)
        refused = await ended_with(core.kv_set(caller("1", 1), "k", b"v"), NotLeaderError)
        assert "was removed or replaced" in str(refused)
        for ended in (streamed, waiting, following):
            assert isinstance(await ended_with(ended, NotLeaderError), NotLeaderError)
        assert await asyncio.wait_for(server.wait_done(), BOUND_S) is False
        assert server.gate.core is None
        with pytest.raises(NotLeaderError):
            server.gate.current()
    finally:
        await server.stop(drain_s=0)
    (said,) = [r.getMessage() for r in caplog.records if "the scheduler stops" in r.getMessage()]
    assert f"MS_RECOVERY_PATH={str(directory)!r} was removed or replaced" in said
    assert "put its directory back at MS_RECOVERY_PATH and start the scheduler again" in said
    assert list(directory.iterdir()) == []  # nothing written to the directory made again
