"""A rank whose contribution is refused in its own process (past what a collective carries)
withdraws from the collective: the peer already waiting in it gets, at once and not after
CLUSTER_COLLECTIVE_TIMEOUT_S, a CollectiveError that names that rank and the size, and the
next collective completes for both (a real scheduler, real worker processes)."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import re
from pathlib import Path

from cluster.api.collective import MAX_COLLECTIVE_BYTES
from cluster.protocol.config import Limits
from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.rounds import Rounds
from tests.aio import eventually
from tests.integration.scripts.withdrawn_collective import BIG
from tests.integration.test_api import settings
from tests.procs import ROOT, Procs, job_env

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "withdrawn_collective.py"
# Far longer than the test waits for the job: a peer that waited a round out fails the test.
TIMEOUT_S = 600.0
# What the waiting rank may take to hear of the withdrawal (the other rank pickles 65 MiB).
QUICK_S = 30.0
# Per step of the script: the collective's number, the rank that waits in it, the rank refused.
STEPS = [(1, 1, 0), (3, 0, 1), (5, 0, 1)]


def waits_in(rounds: Rounds, seq: int, rank: int) -> bool:
    """Whether `rank`'s contribution to collective #`seq` waits in an open round."""
    return any(key[1] == seq and rank in rnd.values for key, rnd in rounds.open.items())


async def test_a_rank_refused_for_its_payload_fails_at_once_the_collective_its_peer_is_in(
    processes: Procs, tmp_path: Path
) -> None:
    """Rank 0's broadcast_object, then rank 1's allgather_object and allreduce, each past what
    a collective carries, each made once the other rank waits in that collective."""
    job = dataclasses.replace(settings(2), limits=Limits(collective_timeout_s=TIMEOUT_S))
    async with SchedulerServer(job) as srv:
        env = job_env(2, srv.port, WITHDRAWN_GO=str(tmp_path / "go"))
        workers = [
            processes.start_role(f"w{i}", "MS_WORKER", [str(SCRIPT)], {**env, "MS_NODE_ID": str(i)})
            for i in range(2)
        ]
        rounds = srv.core.exchanges.rounds
        for step, (seq, waiting, _) in enumerate(STEPS, start=1):
            await eventually(
                lambda seq=seq, rank=waiting: waits_in(rounds, seq, rank),  # type: ignore[misc]
                f"rank {waiting} waiting in collective #{seq}",
                QUICK_S,
            )
            (tmp_path / f"go.{step}").touch()
            heard = workers[waiting].wait_for_output
            await asyncio.to_thread(heard, f"step {step} waited", QUICK_S)
        codes = await asyncio.to_thread(lambda: [w.wait(QUICK_S * 2) for w in workers])
    logs = [w.output for w in workers]
    assert codes == [0, 0], logs
    pickled = len(pickle.dumps(b"z" * BIG))
    sizes = {1: ("broadcast_object", pickled), 2: ("allgather_object", pickled)}
    for step, (_, waiting, refused) in enumerate(STEPS, start=1):
        here, there = logs[refused], logs[waiting]
        said = re.search(rf"^step {step} waited ([0-9.]+) s: (\w+): (.*)$", there, re.M)
        assert said is not None, there
        assert float(said[1]) < QUICK_S, said[0]
        assert said[2] == "CollectiveError", said[0]
        assert f"failed for every rank: rank {refused} withdrew from it, as its " in said[3]
        if step in sizes:
            what, size = sizes[step]
            assert f"its {what} payload of {size} bytes (65.0 MiB) is over the " in said[3]
            assert f"step {step} refused here: CapacityError: {what}: " in here, here
        else:
            assert f"its allreduce array of {BIG} bytes, from each of 2 workers" in said[3]
            assert f"step {step} refused here: ClusterError: allreduce of {BIG} bytes" in here
        assert f"{MAX_COLLECTIVE_BYTES} bytes a control-plane collective carries" in said[3]
    for rank, log in enumerate(logs):
        assert "step 1 after: 'after, from rank 0'" in log, log
        assert "step 2 after: [0, 1]" in log, log
        assert "step 3 after: [3.0, 3.0, 3.0, 3.0]" in log, log
        assert f"barrier passed rank={rank}" in log, log
