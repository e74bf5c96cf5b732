"""What SIGTERM and SIGINT do to a scheduler with a recovery directory and no standby
(`serve` maps them to `request_handover` and `request_stop`): SIGTERM leaves the job saved for
the scheduler started next, SIGINT ends it, also when it follows a SIGTERM."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster.scheduler.server import JobStore, SchedulerServer
from tests.aio import BOUND_S
from tests.credentials import registration
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
