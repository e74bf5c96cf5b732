"""A worker whose Finish fails inside `agent.finish()` with a RuntimeError while its agent's
loop runs on. `bug` (the first argument): one planted (what a bug, or a failed call that
surfaces as one, raises there), in `cluster.finalize()`; it then says what the finalize left of
the session (the agent's threads). `exit`: the program returns without finalizing, and the
finish, made by the finalize at exit, hands work to the executor that the interpreter's exit
has shut (the RuntimeError is the interpreter's own); `exit-loaded`: the same with the
executors' module loaded before the exit (its RuntimeError says another thing). `report`: the
program dies of an error, and the report of it to the scheduler fails with a planted
RuntimeError."""

from __future__ import annotations

import asyncio
import importlib
import sys
import threading

import cluster
from cluster.api import runtime

cluster.init()
print(f"in rank={cluster.get_rank()}", flush=True)
agent = runtime.session().agent


async def planted() -> bool:
    raise RuntimeError("planted: agent.finish failed")


async def report_fails(timeout_s: float, failure: str = "") -> None:
    raise RuntimeError("planted: the report failed")


async def at_exit() -> bool:
    await asyncio.to_thread(print, "the executor took it")
    return True


if sys.argv[1] == "report":
    agent.send_finish = report_fails  # type: ignore[method-assign]  # the planted failure
    raise ValueError("the program's own error")
if sys.argv[1] == "exit-loaded":
    importlib.import_module("concurrent.futures.thread")
agent.finish = planted if sys.argv[1] == "bug" else at_exit  # type: ignore[method-assign]
if sys.argv[1] == "bug":
    cluster.finalize()
    print("finalized", flush=True)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("cluster-agent"))
    print(f"agent threads: {names}", flush=True)
