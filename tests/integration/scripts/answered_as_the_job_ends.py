"""A call of the main thread whose answer comes as the job ends (argument `survivor`): the
barrier's answer is in, and before the call returns (held there until the agent has taken the
job's failure as one the waiting call raises) its peer dies. The call must raise the job's
JobFailedError in the main thread, whose `finally` runs, rather than return while the failure
is left to the last resort. Argument `peer`: joins, takes the barrier's answer, and dies once
the survivor has its own (the file named by the second argument exists)."""

from __future__ import annotations

import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import cluster
from cluster.api import runtime
from cluster.testing import wait_until

BOUND_S = 60.0
role, answered = sys.argv[1], Path(sys.argv[2])
cluster.init()
session = runtime.session()
if role == "peer":
    cluster.barrier()
    wait_until(answered.exists, BOUND_S, "the survivor's answer")
    os._exit(1)
run = session._background.run


def answered_late(coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
    result = run(coro, timeout_s)
    answered.touch()
    # The agent has heard the failure, with this call still waiting for all it knows.
    wait_until(lambda: session._ending._error is not None, BOUND_S, "the job's failure")
    return result


session._background.run = answered_late  # type: ignore[method-assign]
try:
    cluster.barrier()
    print("barrier returned", flush=True)
    wait_until(lambda: False, BOUND_S, "the job's failure to be raised")
finally:
    print("finally ran", flush=True)
