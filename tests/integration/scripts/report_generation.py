"""Checkpoint reports under way when the worker puts back a new generation's rollback step:
which generation each report says it comes from.

    MS_ROLE=MS_WORKER ... python report_generation.py CKPT_DIR STEP

Saves steps 1 to 3 while the scheduler's answers are held back: the report of step 1 is under
way and the list of steps 1 to 3 waits behind it. Then it does what a TrainingLoop does when it
resumes generation 2 from STEP (2 or 3): lets the reports go and puts that step back, discarding
the steps past it (`discard_newer(STEP, put_back=2)`). Prints one line per report sent, as it
goes on the wire, `report steps=<steps> generation=<generation>`, and `done` once flushed.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import numpy as np

import cluster
from cluster.api import runtime
from cluster.worker import convert

cluster.init()
agent = runtime.session().agent
gate = threading.Event()
report = agent.report_checkpoints
request = convert.checkpoints_request


async def held_back(*args: Any, **kwargs: Any) -> int:
    await asyncio.to_thread(gate.wait, 120)
    return await report(*args, **kwargs)


def logged(*args: Any) -> Any:
    made = request(*args)
    print(f"report steps={list(made.steps)} generation={made.generation}", flush=True)
    return made


agent.report_checkpoints = held_back  # type: ignore[method-assign]
convert.checkpoints_request = logged
checkpoints = cluster.CheckpointManager(
    sys.argv[1], "p", cluster.CheckpointConfig(keep_checkpoint_max=5)
)
for step in (1, 2, 3):
    checkpoints.save(step, {"w": np.full(1, step)})
assert checkpoints.steps() == [1, 2, 3]  # written: every list of steps is taken
gate.set()
checkpoints.discard_newer(int(sys.argv[2]), put_back=runtime.get_generation() + 1)
checkpoints.flush()
print("done", flush=True)
cluster.finalize()
