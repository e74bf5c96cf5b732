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
