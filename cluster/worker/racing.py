"""A call for the user races against the job's failure, so that no caller waits on a job that
is already over: whichever comes first decides what the caller gets (`WorkerAgent`'s calls)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from cluster.protocol.errors import ClusterError

T = TypeVar("T")


async def unless_failed(awaitable: Awaitable[T], failed: asyncio.Future[ClusterError]) -> T:
    """Await `awaitable` unless the job fails first (`failed` is settled with its error); then
    raise that failure."""
    if failed.done():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()  # never started: no "was never awaited" warning at exit
        raise failed.result()
    task = asyncio.ensure_future(awaitable)
    racers: list[asyncio.Future[Any]] = [task, failed]
    try:
        await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller gave up (a timeout): so does the awaitable
        task.cancel()
        raise
    # An answer wins; a call that failed as the job did (its channel closed by the job's
    # end: CANCELLED) reports the job's failure, which is the cause.
    done_badly = task.done() and (task.cancelled() or task.exception() is not None)
    if task.done() and not (done_badly and failed.done()):
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise failed.result()
