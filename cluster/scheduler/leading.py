"""The election's I/O loop: campaign, keep the lease alive, follow the leader, step down.

It reports what etcd answered to the pure `Leadership` (`cluster.protocol.leadership`) and does
what it decides: `lead()` (the server loads the job and serves it) and `step_down(why)` (the
server stops answering for the job). A leader's keepalive is bounded by the time its lease
surely has left, so a leader cut off from etcd steps down when that time is up, not when the
request gives up. A candidate renews its lease just before it campaigns and counts a won
term from that keepalive. A standby keeps its own lease alive too (its registration, for
Status), and waits on a watch of the leader key, read again at least every keepalive.

A won term's takeover (`lead()`: load the job, save it once, then open the gate) runs in a
task of its own while this loop keeps the lease alive, however long the load takes; stepping
down cancels it. The gate stays closed until `lead()` installs the job's core. Each keepalive of
a leader also reads the leader key: one that is gone, or that another campaign made (an
operator's `etcdctl del`, then anyone's campaign), steps it down at once, not at its next fenced
save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from cluster.protocol.backoff import Backoff
from cluster.protocol.errors import EtcdUnavailable, FencedError, StateFileError
from cluster.protocol.leadership import Leadership, Role, Step
from cluster.scheduler.etcd_client import within
from cluster.scheduler.etcd_election import EtcdElection, LeaderKey

log = logging.getLogger("cluster.scheduler")

# While etcd does not answer: the first retry after this long, doubling up to RETRY_MAX_S.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
# While every takeover fails on the job's state (torn, foreign: etcd answered, and what it
# holds cannot be used): the next campaign after this long, doubling up to TAKEOVER_RETRY_MAX_S,
# until a takeover goes well. A state mended meanwhile is led within TAKEOVER_RETRY_MAX_S.
TAKEOVER_RETRY_FIRST_S = 1.0
TAKEOVER_RETRY_MAX_S = 16.0


class Leading:
    def __init__(
        self,
        election: EtcdElection,
        leadership: Leadership,
        lead: Callable[[], Coroutine[Any, Any, None]],
        step_down: Callable[[str], Awaitable[None]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.election = election
        self.leadership = leadership
        self._lead = lead
        self._step_down = step_down
        self._clock = clock
        self._known: LeaderKey | None = None
        self._retry = Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        self._takeover_retry = Backoff(TAKEOVER_RETRY_FIRST_S, TAKEOVER_RETRY_MAX_S)
        # Why the takeovers fail, once said ("" when none failed since one went well, or
        # since etcd answered again): the same failure is not said again at every term.
        self._failing = ""
        self.unreachable = ""  # why etcd did not answer last ("" when it did)
        self.schedulers: list[str] = []
        # The takeover of the term won last (`lead()`), while it runs, and when it began.
        self._takeover: asyncio.Task[None] | None = None
        self._won_at = 0.0
        self._twin = False  # said: another process's leader key names our address

    async def run(self) -> None:
        """Until cancelled (the server stops, or the job is over), or resigned."""
        try:
            while not self.leadership.resigned:
                role = self.leadership.role
                try:
                    if role is Role.CANDIDATE:
                        await self._campaign()
                        self._reachable()
                    elif role is Role.LEADER:
                        await self._keep()
                        await self._took_over()
                    else:
                        await self._follow()
                        self._reachable()
                except StateFileError as exc:  # etcd did not answer (fenced is handled below)
                    await self._unreachable(exc)
        finally:
            await self._end_takeover()

    async def _campaign(self) -> None:
        sent, ttl = await self._refresh_lease()
        holder = await self.election.campaign()
        if holder is None:
            step = self.leadership.won(sent, ttl, self.election.address)
            say = log.debug if self._failing else log.info  # said when the takeover goes well
            say(
                "leading the job (term %d): holding the leader key in %s on a %g s lease",
                self.leadership.terms,
                self.election.connection.url,
                self.leadership.lease_s,
            )
            if step is not Step.LEAD:
                await self._step_down(self.leadership.reason)
                return
            self._won_at = self._clock()
            self._takeover = asyncio.create_task(self._lead(), name="cluster-takeover")
            return
        if self.election.stale(holder):
            await self.election.drop_stale(holder)
            return  # and campaign again
        self._say_twin(holder)
        self._known = holder
        if self.leadership.lost(holder.address) is Step.STAND_BY:
            log.info("standing by: the leader is %s", holder.address or "(changing)")

    async def _refresh_lease(self) -> tuple[float, float]:
        """A keepalive of this scheduler's lease (a new lease when it has none, or it ended):
        when it was sent, and the seconds etcd then gave the lease. A campaign puts the leader
        key on this lease, so a leader counts its lease from then, not from the campaign: etcd
        ends a lease it had before at its last keepalive plus its TTL."""
        await self.election.ensure_lease()
        sent = self._clock()
        try:
            return sent, await self.election.keepalive()
        except FencedError:  # it ended while etcd was away: a new one
            await self.election.ensure_lease()
            sent = self._clock()
            return sent, await self.election.keepalive()

    async def _keep(self) -> None:
        """One keepalive and a read of the leader key, bounded by the time the lease surely
        has; then a read of the job's schedulers and a pause (cut short when the takeover
        ends), together no longer than a keepalive period and never past that time."""
        leadership = self.leadership
        sent = self._clock()
        budget = leadership.valid_until - sent
        try:
            ttl, gone = await within(self._keepalive(), budget)
        except FencedError:
            step = leadership.lease_ended()
        except (StateFileError, asyncio.TimeoutError) as exc:
            step = leadership.tick(stalled_s=self._clock() - (sent + budget))  # woken late
            if step is Step.NOTHING:
                self._note(exc)
        else:
            step = leadership.kept(sent, ttl)
            if step is Step.NOTHING and gone is not None:
                step = leadership.fenced(gone)
            self._reachable()
        if step is Step.STEP_DOWN:
            await self._stepped_down()
            return
        due = min(self._clock() + leadership.keepalive_every_s, leadership.valid_until)
        await self._refresh_schedulers(due - self._clock())
        stalled = await self._pause(max(due - self._clock(), 0))
        if leadership.tick(stalled) is Step.STEP_DOWN:
            await self._stepped_down()

    async def _keepalive(self) -> tuple[float, str | None]:
        """A keepalive of the lease, then a read of the leader key: the seconds etcd gave the
        lease, and why the key is not this term's any more (None while it is)."""
        ttl = await self.election.keepalive()
        fence = self.election.fence
        found = await self.election.leader()
        if found is not None and found.revision == fence:
            return ttl, None
        if found is None:
            return ttl, "its leader key in etcd was deleted (not by it) while its lease lived"
        return ttl, (
            f"its leader key in etcd was replaced: {found.address or 'another scheduler'} "
            "leads by it now"
        )

    async def _pause(self, seconds: float) -> float:
        """Sleep `seconds`, or less when the takeover ends meanwhile; how much later than
        `seconds` it woke up (this process did not run meanwhile: stopped, or its host
        stalled)."""
        until = self._clock() + seconds
        takeover = self._takeover
        if takeover is None or takeover.done():
            await asyncio.sleep(seconds)
        else:
            await asyncio.wait((takeover,), timeout=seconds)
        return max(0.0, self._clock() - until)

    async def _took_over(self) -> None:
        """Once the takeover is over: nothing when it went well; a StateFileError steps down
        (etcd away or the leader key lost: the loop tries again after a pause; the job's state
        unusable: `_failed`), anything else is raised (a bug)."""
        takeover = self._takeover
        if takeover is None or not takeover.done():
            return
        self._takeover = None
        exc = None if takeover.cancelled() else takeover.exception()
        if exc is None:
            self._took_over_well()
            return
        if not isinstance(exc, StateFileError):
            raise exc
        if isinstance(exc, EtcdUnavailable | FencedError):  # etcd away, or the key lost
            if self.leadership.role is Role.LEADER:
                self.leadership.fenced(f"it could not take the job over ({exc}); {self._took()}")
                await self._stepped_down()
            raise exc
        await self._failed(exc)

    def _took_over_well(self) -> None:
        if self._failing and not self.leadership.resigned:  # given back: nothing is led
            log.info(
                "leading the job (term %d): the job's state in %s can be used again",
                self.leadership.terms,
                self.election.connection.url,
            )
        self._failing = ""
        self._takeover_retry.reset()

    async def _failed(self, exc: StateFileError) -> None:
        """The takeover found the job's state unusable (etcd answered): step down, said once
        for as long as the same thing is wrong, and campaign again after a pause that grows."""
        why = str(exc)
        quiet = why == self._failing
        if self.leadership.role is Role.LEADER:
            self.leadership.fenced(
                f"it could not take the job over ({why}); {self._took()}; it campaigns again "
                f"after a pause that grows to {TAKEOVER_RETRY_MAX_S:g} s, and says nothing more "
                "until what is wrong changes or the job's state can be used"
            )
            await self._stepped_down(quiet=quiet)
        self._failing = why
        await self._hold_off(self._takeover_retry.next_s())

    async def _hold_off(self, seconds: float) -> None:
        """Wait `seconds` before campaigning again, keeping this scheduler's lease (and so its
        registration, shown by Status) alive meanwhile."""
        every = self.leadership.keepalive_every_s
        until = self._clock() + seconds
        while (left := until - self._clock()) > 0:
            # An ended lease is made anew when it campaigns.
            with contextlib.suppress(StateFileError, asyncio.TimeoutError):
                await within(self.election.keepalive(), min(every, left))
            await asyncio.sleep(max(0.0, min(every, until - self._clock())))

    async def _end_takeover(self) -> None:
        """Cancel the takeover under way, if any (not when it is the caller)."""
        takeover, self._takeover = self._takeover, None
        if takeover is None or takeover is asyncio.current_task():
            return
        takeover.cancel()
        await asyncio.wait((takeover,))
        if not takeover.cancelled():
            takeover.exception()  # retrieved: stepping down supersedes it

    def _took(self) -> str:
        """How long this scheduler's takeover has run, against its lease."""
        took = self._clock() - self._won_at
        lease = self.leadership.lease_s
        over = f", {took - lease:.1f} s longer than its lease" if took > lease else ""
        return f"this scheduler's takeover of the job ran {took:.1f} s ({lease:g} s lease{over})"

    async def _stepped_down(self, *, quiet: bool = False) -> None:
        """Step down; `quiet`: as the term before did, and for the same reason (not said)."""
        why = self.leadership.reason
        if self._takeover is not None and not self._takeover.done():
            why = f"{why}; {self._took()}"
        say = log.debug if quiet else log.error
        say("stepping down: %s; no call is answered until this scheduler leads again", why)
        await self._end_takeover()
        await self.election.resign()
        await self._step_down(why)

    async def _follow(self) -> None:
        """A standby: keep its lease, and wait for the leader key to change."""
        every = self.leadership.keepalive_every_s
        try:
            await within(self.election.keepalive(), every)
        except FencedError:
            await self.election.ensure_lease()  # ended while etcd was away: a new one
        except asyncio.TimeoutError:
            pass
        await self._refresh_schedulers(every)
        await self.election.wait_for_change(self._known, every)
        found = await self.election.leader()
        if found is not None and self.election.stale(found):
            await self.election.drop_stale(found)
            found = None
        elif found is not None:
            self._say_twin(found)
        if found != self._known:
            self._known = found
            if found is not None:
                log.info("standing by: the leader is now %s", found.address or "(changing)")
        self.leadership.leader_seen(None if found is None else found.address)

    def _say_twin(self, holder: LeaderKey) -> None:
        """Say once that another process's leader key names this scheduler's address."""
        if holder.address != self.election.address or self._twin:
            return
        self._twin = True
        log.warning(
            "the leader key in %s names this scheduler's address %s but another process put "
            "it (pid %s on host %s): this scheduler's previous run, whose key ends with its "
            "lease (%g s), or another scheduler that advertises the same address: give each "
            "scheduler an address of its own (--host, MS_SCHED_HOST)",
            self.election.connection.url,
            holder.address,
            holder.pid or "?",
            holder.host or "?",
            self.leadership.lease_s,
        )

    async def fenced(self, why: str) -> None:
        """A write was refused: our leader key is gone (called by the server)."""
        if self.leadership.fenced(why) is Step.STEP_DOWN:
            await self._stepped_down()

    async def _refresh_schedulers(self, within_s: float) -> None:
        """Read the job's schedulers (Status shows them) within `within_s`; a read etcd does not
        answer in time keeps the list read before."""
        try:
            peers = await within(self.election.peers(), within_s)
        except (StateFileError, asyncio.TimeoutError):
            return
        self.schedulers[:] = [p.address for p in peers]  # in place: the gate shows it

    async def _unreachable(self, exc: StateFileError) -> None:
        self._note(exc)
        if self.leadership.tick() is Step.STEP_DOWN:
            await self._stepped_down()
        await asyncio.sleep(self._retry.next_s())

    def _note(self, exc: BaseException) -> None:
        why = str(exc) or "no answer in time"
        if not self.unreachable:
            if isinstance(exc, (EtcdUnavailable, asyncio.TimeoutError)):
                log.warning("etcd does not answer: %s; trying again", why)
            else:  # etcd answered, and what it holds or said is the trouble
                log.warning("cannot use the job's state in etcd: %s; trying again", why)
        self.unreachable = why

    def _reachable(self) -> None:
        if self.unreachable:
            log.info("etcd answers again")
            self._failing = ""  # a takeover that fails again says why again
        self.unreachable = ""
        self._retry.reset()
