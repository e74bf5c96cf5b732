"""Whose silence is it, behind a host's relay: a stalled scheduler's (SIGSTOP: a GC pause, swap,
a paused VM), which the workers wait out on their relay, or a stopped relay's, which they leave
for the scheduler directly, saying so."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from tests.aio import eventually
from tests.integration.test_relay import gather_rolling_back, relayed_job
from tests.procs import Procs
from tests.sockets import connections_by_owner

Owners = dict[int | None, int]


async def sample(owners: Callable[[], Owners], seen: list[Owners]) -> None:
    """Append `owners()` to `seen` every 20 ms until cancelled."""
    while True:
        seen.append(owners())
        await asyncio.sleep(0.02)  # sleep-ok: samples an observable until cancelled


async def test_a_stalled_scheduler_keeps_its_workers_on_their_relay(
    processes: Procs, short_dir: Path
) -> None:
    """The scheduler stopped past MS_NODE_TIMEOUT (recovery on): its workers' streams fall
    silent, but their relay answers their pings all the while, so the silence is beyond it.
    They stay on the relay and say so (all of a job's workers turning direct at once would
    meet the scheduler, as it runs again, with a connection and two registrations each: what
    a scheduler short of open files was told to use relays against), and are back through the
    relay once it runs: the scheduler never held a connection of theirs."""
    job = await relayed_job(processes, short_dir, MS_NODE_TIMEOUT="2")
    sched, relay = job.sched.popen, job.relay.pid
    seen: list[Owners] = []

    def owners() -> Owners:
        return connections_by_owner(sched.pid, [relay, os.getpid()])

    sampler: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in job.agents)), 30)
        assert owners() == {relay: 1}
        sampler = asyncio.ensure_future(sample(owners, seen))
        sched.send_signal(signal.SIGSTOP)
        stays = (
            "which answers: the scheduler hung, or the relay's link to it is cut); training goes "
            "on (recovery is on), reconnecting through the relay"
        )
        lost = lambda: [line for line in job.said if "lost the scheduler" in line]  # noqa: E731
        # Both workers found the scheduler silent (past MS_NODE_TIMEOUT).
        await eventually(lambda: len(lost()) == 2, "both workers' word of the silence", 30)
        sched.send_signal(signal.SIGCONT)
        assert all(stays in line for line in lost()), job.said
        assert not [line for line in job.said if "lost the relay" in line], job.said
        assert await asyncio.wait_for(gather_rolling_back(job.agents), 30) == [[b"a", b"b"]] * 2
        assert owners() == {relay: 1}
        assert all(os.getpid() not in counted for counted in seen), seen  # none direct, ever
    finally:
        sched.send_signal(signal.SIGCONT)
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        await asyncio.gather(*(a.close() for a in job.agents))
