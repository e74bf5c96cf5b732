"""`mscluster status` while a scheduler without standbys stops: it leaves the job to resume
(SIGTERM: `uninstall`, which saves what is pending for up to STOP_SAVE_WAIT_S while saves fail)
or stands down after its saves were refused. It answers for no job then, and says so: Status
ends with NotLeaderError, and the status line says the scheduler is stopping and what to do,
not that it may be a newer version."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.errors import NotLeaderError, SchedulerUnreachableError
from cluster.scheduler.server import JobStore, SchedulerServer
from cluster.tools import status
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S
from tests.procs import ROOT
from tests.unit.test_persist import SETTINGS

STOPPING = "is stopping (or has yet to start) and answers for no job now: wait a moment and try"


async def mscluster_status(address: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`mscluster status --addr ADDRESS` in a process of its own, run to its end (bounded)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cluster",
        "status",
        "--addr",
        address,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 12 * BOUND_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return subprocess.CompletedProcess([], process.returncode, out.decode(), err.decode())


async def test_a_scheduler_that_leaves_the_job_to_resume_is_said_to_be_stopping(
    tmp_path: Path,
) -> None:
    async with SchedulerServer(SETTINGS, store=JobStore.directory(tmp_path / "state")) as server:
        address = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            assert (await status.fetch(channel, address, secret=None)).cluster_id
            leaving = NotLeaderError("not the leader: the scheduler is stopping (SIGTERM)")
            assert await asyncio.wait_for(server.uninstall(leaving, save_s=BOUND_S), BOUND_S)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=BOUND_S)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "this scheduler is stopping" in (refused.value.details() or "")
            with pytest.raises(SchedulerUnreachableError, match=re.escape(STOPPING)) as said:
                await status.fetch(channel, address, secret=None)
            assert "newer version" not in str(said.value)
        ran = await mscluster_status(address, tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.splitlines() == [
        f"mscluster: the scheduler at {address} {STOPPING} again; "
        "with recovery, the job resumes once a scheduler is started again on its state "
        "(MS_RECOVERY_PATH or CLUSTER_STATE_URL)"
    ]


class _Earlier(pb_grpc.SchedulerServicer):  # type: ignore[misc]  # untyped base
    """A scheduler of an earlier version as it stops: an empty answer (no phase, no leader)."""

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        return pb.StatusResponse()


async def test_an_earlier_schedulers_empty_answer_is_said_to_be_stopping() -> None:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(_Earlier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(SchedulerUnreachableError, match=re.escape(STOPPING)):
                await status.fetch(channel, address, secret=None)
    finally:
        await server.stop(None)
