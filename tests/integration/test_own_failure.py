"""A worker whose process dies of its own error tells the scheduler which, and then says nothing
of what the scheduler does about it. Real in-process scheduler and agents (recovery on)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.state import NodeState
from cluster.worker.agent import WorkerAgent
from tests.aio import eventually
from tests.integration.test_api import settings
from tests.integration.test_relay import make_agent

BOUND_S = 20.0


def agent(port: int, node_id: str, recovery: Path, said: list[str]) -> WorkerAgent:
    env = {"MS_NODE_ID": node_id, "MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": str(recovery)}
    return make_agent(port, 2, node_id, said, **env)


async def test_a_worker_reporting_its_own_error_does_not_say_training_goes_on(
    tmp_path: Path,
) -> None:
    """The report (a Finish with the error) has the scheduler remove the node, which ends its
    event stream. The agent took that for a lost scheduler and said, as its process exited of
    its own error, "lost the scheduler ... (node '1' was removed from the job: ...); training
    goes on (recovery is on), reconnecting for up to 1800 s". Once its failure is reported, the
    node is closed: the stream's end is not acted on, or said (the node registered again and
    rejoined the job, for the moment its process had left)."""
    async with SchedulerServer(dataclasses.replace(settings(2), recovery=True)) as srv:
        said: list[str] = []
        survivor = agent(srv.port, "0", tmp_path / "r0", [])
        dying = agent(srv.port, "1", tmp_path / "r1", said)
        await asyncio.wait_for(asyncio.gather(survivor.start(), dying.start()), BOUND_S)
        reported = await dying.send_finish(2.0, "ZeroDivisionError: division by zero")
        assert reported.__class__.__name__ == "FinishAnswered", reported
        member = srv.core.state.members["1"]
        await eventually(lambda: member.state is NodeState.FAILED, "node 1 failed", BOUND_S)
        watch = dying._watch_task
        assert watch is not None
        # Its stream's end taken for a lost scheduler (said), or read to its end.
        await eventually(
            lambda: watch.done() or bool(said), "the dying node's stream to end", BOUND_S
        )
        assert not [line for line in said if "lost the scheduler" in line], said
        assert watch.done(), said
        assert srv.core.state.members["1"].state is NodeState.FAILED  # not registered again
        await asyncio.gather(survivor.close(), dying.close())
