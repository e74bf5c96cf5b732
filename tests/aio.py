"""Waiting in asyncio tests without the clock: yield to the loop until a condition holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

BOUND_S = 5.0  # upper bound on any await that could hang if the code under test is wrong


async def settle(condition: Callable[[], bool], rounds: int = 100) -> None:
    """Let other tasks run until `condition` holds, without sleeping on the clock."""
    for _ in range(rounds):
        if condition():
            return
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    raise AssertionError("condition not reached after yielding to the event loop")


async def eventually(condition: Callable[[], bool], what: str, bound_s: float = BOUND_S) -> None:
    """Poll `condition` (for effects of other threads, e.g. a save on disk) until it holds;
    AssertionError naming `what` after `bound_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {bound_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)  # sleep-ok: polls an observable, bounded by bound_s
