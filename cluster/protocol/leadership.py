"""Whether this scheduler leads, stands by, or steps down: decided here, with an injected clock.

Several schedulers of one job share an etcd lease-based election (`cluster.scheduler.leading`
does the I/O). The rules:

- A candidate campaigns; it leads when it created the leader key, and stands by when another
  scheduler holds it (and then follows that key: when it is gone, it campaigns again).
- A leader serves only while it is sure that its lease still lives in etcd. etcd counts a
  lease's time from when it *received* the last keepalive; the leader counts from when it *sent*
  it, which is earlier, so its own deadline (`valid_until`) always comes first. A margin covers
  the drift of two clocks over one lease and the time to stop serving. So a leader cut off from
  etcd keeps the job going for as long as its lease allows, then stops, before a standby can
  take the lease: two schedulers never serve at once.
- A leader steps down when its deadline passes without a keepalive that landed, when etcd says
  its lease has ended, or when a write is refused because its leader key is gone (fenced).
  Stepping down makes it a candidate again: it campaigns when etcd answers.
- A scheduler stopped by its operator (SIGTERM) resigns: it stops serving at once and never
  campaigns again; the shell saves what is pending, then deletes its leader key and revokes its
  lease, so that a standby leads at once instead of after the lease.

Pure: the shell reports what happened (`won`, `lost`, `kept`, ...) and does what the returned
`Step` says; `serving()` is asked before every call the scheduler answers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import field

from cluster.protocol.value import frozen, mutable

# A leader stops serving this long before its lease could end in etcd (at least MIN_MARGIN_S):
# clocks drift far less than that over one lease, and stopping takes a moment.
MARGIN_SHARE = 0.1
MIN_MARGIN_S = 0.1
# A leader sends a keepalive every third of its lease: two may be lost before it must stop.
KEEPALIVES_PER_LEASE = 3


class Role(enum.Enum):
    CANDIDATE = "candidate"  # campaigns as soon as etcd answers
    LEADER = "leader"
    STANDBY = "standby"


class Step(enum.Enum):
    NOTHING = "nothing"
    LEAD = "lead"  # load the state and serve the job
    STAND_BY = "stand by"  # answer every call with the leader's address
    STEP_DOWN = "step down"  # stop serving at once, drop the job's state, campaign again
    CAMPAIGN = "campaign"  # try to take the leader key


@mutable
class Leadership:
    lease_s: float
    clock: Callable[[], float]
    role: Role = Role.CANDIDATE
    leader: str = ""  # the leader's address, as last seen ("" unknown)
    # Leader: it serves until then at most; -inf otherwise.
    valid_until: float = -math.inf
    # Why it stepped down last ("" never).
    reason: str = ""
    # Resigned for good (the process is stopping): it never leads again.
    resigned: bool = False
    _terms: int = field(default=0, repr=False)

    @property
    def margin_s(self) -> float:
        return max(MIN_MARGIN_S, self.lease_s * MARGIN_SHARE)

    @property
    def keepalive_every_s(self) -> float:
        return self.lease_s / KEEPALIVES_PER_LEASE

    @property
    def terms(self) -> int:
        """How many times this scheduler has become the leader."""
        return self._terms

    def serving(self) -> bool:
        """Whether this scheduler may answer for the job now."""
        return self.role is Role.LEADER and self.clock() < self.valid_until

    def lease_left_s(self) -> float:
        return max(0.0, self.valid_until - self.clock()) if self.role is Role.LEADER else 0.0

    # -- what happened ---------------------------------------------------------------------

    def won(self, sent_at: float, ttl_s: float, address: str) -> Step:
        """The campaign created our leader key, on a lease that a keepalive sent at `sent_at`
        (just before the campaign) renewed for `ttl_s`: etcd ends the lease `ttl_s` after that
        keepalive arrived, whenever the campaign was."""
        if self.resigned:  # a campaign that was on its way when it resigned
            self.role, self.leader, self.valid_until = Role.CANDIDATE, "", -math.inf
            return Step.STEP_DOWN
        self.role, self.leader = Role.LEADER, address
        self.valid_until = sent_at + min(ttl_s, self.lease_s) - self.margin_s
        if not self.serving():  # the answer came too late to be sure of anything
            return self._step_down("the campaign's answer came after the lease could end")
        self._terms += 1
        return Step.LEAD

    def lost(self, leader: str) -> Step:
        """The campaign found another scheduler leading (at `leader`; "" unknown)."""
        self.role, self.leader, self.valid_until = Role.STANDBY, leader, -math.inf
        return Step.STAND_BY

    def kept(self, sent_at: float, ttl_s: float) -> Step:
        """A keepalive sent at `sent_at` landed: etcd says the lease has `ttl_s` left."""
        if self.role is Role.LEADER:
            if self.clock() >= self.valid_until:
                return self._step_down("a keepalive landed after the lease could have ended")
            self.valid_until = max(
                self.valid_until, sent_at + min(ttl_s, self.lease_s) - self.margin_s
            )
        return Step.NOTHING

    def lease_ended(self) -> Step:
        """etcd says our lease is gone (a keepalive answered with no time left)."""
        if self.role is Role.LEADER:
            return self._step_down("its lease in etcd has ended")
        return Step.CAMPAIGN if self.role is Role.CANDIDATE else Step.NOTHING

    def fenced(self, why: str) -> Step:
        """A write was refused: our leader key is gone, or the state is not what we saved."""
        if self.role is Role.LEADER:
            return self._step_down(why)
        return Step.NOTHING

    def leader_seen(self, leader: str | None) -> Step:
        """The leader key read by a standby: None when nobody leads (campaign)."""
        if self.role is Role.LEADER:
            return Step.NOTHING
        if leader is None:
            self.role, self.leader = Role.CANDIDATE, ""
            return Step.NOTHING if self.resigned else Step.CAMPAIGN
        self.role, self.leader = Role.STANDBY, leader
        return Step.NOTHING

    def resign(self, why: str) -> Step:
        """The operator stops this scheduler: it serves no more, from now on and for good;
        STEP_DOWN when it was leading (save what is pending, then release the key and lease)."""
        self.resigned = True
        if self.role is Role.LEADER:
            return self._step_down(why)
        self.role, self.leader, self.valid_until = Role.CANDIDATE, "", -math.inf
        return Step.NOTHING

    def tick(self, stalled_s: float = 0.0) -> Step:
        """Time passes: a leader whose deadline has come steps down. `stalled_s`: how long
        this process did not run just now (a pause that ended that much later than it was to),
        which, longer than the margin, is why no keepalive landed, not etcd."""
        if self.role is Role.LEADER and self.clock() >= self.valid_until:
            if stalled_s > self.margin_s:
                return self._step_down(
                    f"this scheduler did not run for {stalled_s:.1f} s (its process was "
                    "stopped, by SIGSTOP or a debugger, or its host stalled: swapped out, a "
                    f"paused VM), and its {self.lease_s:g} s lease may have ended meanwhile"
                )
            return self._step_down(
                f"no keepalive of its {self.lease_s:g} s lease landed in time (etcd "
                "unreachable or too slow)"
            )
        return Step.NOTHING

    def _step_down(self, why: str) -> Step:
        self.role, self.leader, self.valid_until, self.reason = Role.CANDIDATE, "", -math.inf, why
        return Step.STEP_DOWN


@frozen
class Standing:
    """A scheduler's part in the election: whether it leads, who does, the schedulers of the
    job, the lease and what is left of it, and where the job's state is kept."""

    leading: bool
    leader: str
    schedulers: tuple[str, ...]
    lease_s: float
    lease_left_s: float
    state_store: str
