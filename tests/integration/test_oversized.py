"""A payload no collective carries is refused at once, in the caller, naming the limit; that
collective fails for its peers too (the rank withdraws from it: test_withdrawn.py), the rank's
next collective is its peers' next, and the job goes on (real worker processes, and agents
against a real scheduler)."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest

from cluster.api.collective import MAX_COLLECTIVE_BYTES, MAX_KV_VALUE_BYTES
from cluster.protocol.errors import CapacityError
from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.kv import MAX_VALUE_BYTES
from cluster.scheduler.machine.rounds import MAX_ANSWER_BYTES
from cluster.testing import LocalJob, LocalJobOptions
from cluster.transport import edge
from tests.integration.scripts.oversized_payload import BIG
from tests.integration.test_api import make_agent, settings
from tests.procs import PYTHON, ROOT

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "oversized_payload.py"


def test_the_callers_limits_are_the_schedulers() -> None:
    assert (MAX_KV_VALUE_BYTES, MAX_COLLECTIVE_BYTES) == (MAX_VALUE_BYTES, MAX_ANSWER_BYTES)


def test_a_broadcast_refused_for_its_size_leaves_the_job_going(tmp_path: Path) -> None:
    """Rank 0's broadcast of 65 MiB is refused before it is sent, and rank 1's call of that
    broadcast fails naming rank 0; its smaller broadcast after it is the one rank 1 makes next,
    and the barrier after passes (a collective's timeout, were the numbers apart, would fail
    rank 1 within 10 s: the job would not exit 0)."""
    job = LocalJob(
        SCRIPT,
        workers=2,
        workdir=tmp_path / "job",
        timeout_s=60,
        options=LocalJobOptions(
            recovery=False, env={"CLUSTER_COLLECTIVE_TIMEOUT_S": "10"}, python=PYTHON
        ),
    )
    with job:
        assert job.wait(60) == 0, job.log(0) + job.log(1)
    root, other = job.log(0), job.log(1)
    pickled = len(pickle.dumps(b"z" * BIG))
    assert (
        f"refused: CapacityError: broadcast_object: rank 0's object pickles to {pickled} bytes, "
        f"more than the {MAX_COLLECTIVE_BYTES} a control-plane collective carries"
    ) in root, root
    assert "it was not sent, this collective failed for every rank" in root, root
    assert (
        "withdrawn: CollectiveError: broadcast failed: broadcast(root=0) #1 of generation 1 "
        "failed for every rank: rank 0 withdrew from it, as its broadcast_object payload of "
        f"{pickled} bytes (65.0 MiB) is over the {MAX_COLLECTIVE_BYTES} bytes"
    ) in other, other
    assert "rank=1 got='a smaller one'" in other, other
    assert (
        "kv refused: CapacityError: kv_store().set: the value for key 'big' has 4194305 bytes, "
        "more than the 4194304 (4 MiB) the store takes a value; nothing was sent"
    ) in other, other
    for rank, log in enumerate((root, other)):
        assert f"barrier passed rank={rank}" in log, log


async def test_a_call_too_large_to_send_gives_its_collective_number_back() -> None:
    """A collective larger than any call carries (an agent's caller that checked nothing) is
    refused unsent and reached no round: the agent's next collective has its number, and
    completes with the peers'."""
    async with SchedulerServer(settings(2)) as server:
        a, b = make_agent(server.port, 2, "a"), make_agent(server.port, 2, "b")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        with pytest.raises(CapacityError, match=r"broadcast carries 67,108,865 bytes, and a "):
            await a.exchange("broadcast", b"z" * (edge.MAX_VALUE_BYTES + 1))
        got = await asyncio.wait_for(
            asyncio.gather(a.exchange("broadcast", b"small"), b.exchange("broadcast", b"")), 10
        )
        assert got == [[b"small"], [b"small"]]
        await asyncio.gather(a.close(), b.close())
