"""Whose silence is it, behind a host's relay: a stalled scheduler's (SIGSTOP: a GC pause, swap,
a paused VM), which the workers wait out on their relay, or a stopped relay's, which they leave
for the scheduler directly, saying so."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.worker import scheduler_link
from cluster.worker.link import Closing, Link
from tests.aio import eventually
from tests.integration.test_relay import gather_rolling_back, make_agent, relayed_job
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


async def test_a_new_worker_goes_direct_past_a_stopped_relay_and_says_why(
    processes: Procs, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay stopped (SIGSTOP) before its workers start: its socket still takes connections
    (the kernel does), but it answers no ping on them. The workers go to the scheduler directly
    and say why, and the job forms within seconds, not at MS_TOPO_TIMEOUT with an error that
    blamed the scheduler ("is it running, and are MS_SCHED_HOST / MS_SCHED_PORT right?")."""
    job = await relayed_job(processes, short_dir, MS_NODE_TIMEOUT="2")
    await asyncio.gather(*(a.close() for a in job.agents))  # never started: made again below
    job.relay.popen.send_signal(signal.SIGSTOP)
    # New worker processes: no check of the relay made by another agent of theirs a moment ago.
    monkeypatch.setattr(scheduler_link, "_relay_checks", {})
    said: list[str] = []
    relay = f"unix:{short_dir / 'r.sock'}"
    env = {"CLUSTER_RELAY": relay, "MS_NODE_TIMEOUT": "2", "MS_TOPO_TIMEOUT": "30"}
    agents = [make_agent(job.port, 2, n, said, MS_NODE_ID=n, **env) for n in "ab"]
    try:
        tops = await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), 10)
        assert sorted(t.rank for t in tops) == [0, 1]
        why = "it takes connections, but answered no ping within 0.5 s: stopped or hung?"
        direct = f"no relay answers at {relay} ({why}): this node talks to the scheduler directly"
        assert said == [direct, direct], said
    finally:
        await asyncio.gather(*(a.close() for a in agents))


async def test_workers_leave_a_relay_stopped_under_their_registration(
    processes: Procs, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay answered when the workers checked it at start, and stopped before they
    registered through it: their registrations go unanswered, and the scheduler answers their
    probe, so the relay is lost (the worker core's rule): each names it, goes direct, and the
    job forms within seconds (it waited for MS_TOPO_TIMEOUT, probing a scheduler that was up
    and registering through the stopped relay again, and blamed the scheduler)."""
    job = await relayed_job(processes, short_dir, MS_NODE_TIMEOUT="2", MS_TOPO_TIMEOUT="30")
    checked, all_checked = [], asyncio.Event()
    check_relay = Link.check_relay

    async def then_stopped(link: Link, address: str) -> Closing | None:
        """The real check; once every worker's found the relay answering, it stops."""
        closing = await check_relay(link, address)
        assert link.route.relay is not None  # it answered
        checked.append(link)
        if len(checked) == len(job.agents):
            job.relay.popen.send_signal(signal.SIGSTOP)
            all_checked.set()
        await all_checked.wait()
        return closing

    monkeypatch.setattr(Link, "check_relay", then_stopped)
    try:
        tops = await asyncio.wait_for(asyncio.gather(*(a.start() for a in job.agents)), 15)
        assert sorted(t.rank for t in tops) == [0, 1]
        where = f"the scheduler at 127.0.0.1:{job.port}"
        why = f"it did not answer this node's registration, while {where} answers"
        relay = f"unix:{short_dir / 'r.sock'}"
        lost = f"lost the relay at {relay} ({why}): this node talks to the scheduler directly"
        assert job.said.count(lost) == 2, job.said
        assert not [line for line in job.said if "MS_SCHED_HOST" in line], job.said
    finally:
        await asyncio.gather(*(a.close() for a in job.agents))


async def test_workers_off_a_stopped_relay_move_back_only_once_it_runs_again(
    processes: Procs, short_dir: Path
) -> None:
    """The relay stopped mid-job: its workers leave it (its hop silent too), go direct, and look
    for it every second; a look finds it stopped (a connection taken is no answer: its ping
    goes unanswered), so they stay direct until it runs again, and then move back to it."""
    job = await relayed_job(processes, short_dir, MS_NODE_TIMEOUT="2")
    relay = f"unix:{short_dir / 'r.sock'}"
    lost = f"lost the relay at {relay}: this node talks to the scheduler directly"
    back = f"the relay at {relay} answers again: this node talks through it"
    try:
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in job.agents)), 30)
        job.relay.popen.send_signal(signal.SIGSTOP)
        await eventually(lambda: job.said.count(lost) == 2, "both workers off the relay", 30)
        assert await asyncio.wait_for(gather_rolling_back(job.agents), 30) == [[b"a", b"b"]] * 2
        since = time.monotonic()

        def looked() -> bool:  # a look at the relay since, which found it stopped
            why, when = scheduler_link._relay_checks.get(relay, ("", 0.0))
            return bool(why) and when >= since

        await eventually(looked, "a look at the stopped relay", 10)
        assert back not in job.said, job.said
        job.relay.popen.send_signal(signal.SIGCONT)
        await eventually(lambda: job.said.count(back) == 2, "both workers back on the relay", 30)
        sched = job.sched.popen.pid
        through = lambda: connections_by_owner(sched, [job.relay.pid, os.getpid()])  # noqa: E731
        await eventually(lambda: through() == {job.relay.pid: 1}, "the relay's one connection", 40)
    finally:
        job.relay.popen.send_signal(signal.SIGCONT)
        await asyncio.gather(*(a.close() for a in job.agents))
