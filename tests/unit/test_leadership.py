"""cluster.protocol.leadership: when a scheduler leads, stands by and steps down (pure, with a
fake clock), and the rule that matters most: a leader never serves once its lease may have
ended in etcd, so two schedulers never answer for one job at once."""

from __future__ import annotations

import math

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster.protocol.leadership import Leadership, Role, Step
from tests.conftest import FakeClock

LEASE_S = 2.0


def leader(clock: FakeClock) -> Leadership:
    leading = Leadership(LEASE_S, clock)
    assert leading.won(clock.now, LEASE_S, "127.0.0.1:8118") is Step.LEAD
    return leading


def test_a_won_campaign_leads_and_serves() -> None:
    clock = FakeClock(100.0)
    leading = leader(clock)
    assert leading.role is Role.LEADER
    assert leading.serving()
    assert leading.terms == 1
    assert leading.leader == "127.0.0.1:8118"


def test_a_lost_campaign_stands_by_naming_the_leader() -> None:
    standby = Leadership(LEASE_S, FakeClock(100.0))
    assert standby.lost("127.0.0.2:8118") is Step.STAND_BY
    assert standby.role is Role.STANDBY
    assert not standby.serving()
    assert standby.leader == "127.0.0.2:8118"


def test_a_standby_campaigns_when_the_leader_key_is_gone() -> None:
    standby = Leadership(LEASE_S, FakeClock(100.0))
    standby.lost("127.0.0.2:8118")
    assert standby.leader_seen("127.0.0.2:8118") is Step.NOTHING
    assert standby.leader_seen(None) is Step.CAMPAIGN
    assert standby.role is Role.CANDIDATE


def test_the_leader_serves_until_its_lease_could_end_counted_from_the_keepalive_sent() -> None:
    clock = FakeClock(100.0)
    leading = leader(clock)
    sent = clock.now + 0.5
    clock.now = sent + 0.3  # the answer took 0.3 s: etcd counts from when it got it, later
    leading.kept(sent, LEASE_S)
    assert leading.valid_until == sent + LEASE_S - leading.margin_s
    clock.now = leading.valid_until - 0.01
    assert leading.serving()
    assert leading.tick() is Step.NOTHING


def test_a_leader_cut_off_from_etcd_keeps_the_job_for_its_lease_then_steps_down() -> None:
    clock = FakeClock(100.0)
    leading = leader(clock)
    clock.now += LEASE_S - leading.margin_s - 0.01  # no keepalive lands meanwhile
    assert leading.serving()
    clock.now += 0.02
    assert not leading.serving()  # before tick even runs: no call is answered
    assert leading.tick() is Step.STEP_DOWN
    assert leading.role is Role.CANDIDATE
    assert "no keepalive" in leading.reason


def test_a_leader_that_did_not_run_past_its_lease_says_so_not_that_etcd_was_away() -> None:
    clock = FakeClock(100.0)
    leading = leader(clock)
    clock.now += LEASE_S + 3.0  # SIGSTOP, then SIGCONT: its pause ended 4 s late
    assert leading.tick(stalled_s=4.0) is Step.STEP_DOWN
    assert "did not run for 4.0 s" in leading.reason
    assert "etcd" not in leading.reason


def test_a_keepalive_that_lands_too_late_does_not_revive_the_leader() -> None:
    clock = FakeClock(100.0)
    leading = leader(clock)
    sent = clock.now
    clock.now += LEASE_S  # past the deadline: a standby may lead by now
    assert leading.kept(sent + 1.9, LEASE_S) is Step.STEP_DOWN
    assert not leading.serving()


def test_an_ended_lease_or_a_fenced_write_steps_the_leader_down() -> None:
    for event in ("lease", "fenced"):
        clock = FakeClock(100.0)
        leading = leader(clock)
        step = leading.lease_ended() if event == "lease" else leading.fenced("leader key gone")
        assert step is Step.STEP_DOWN
        assert not leading.serving()
        assert leading.leader == ""


def test_a_late_answer_to_the_campaign_leads_nothing() -> None:
    clock = FakeClock(100.0)
    leading = Leadership(LEASE_S, clock)
    sent = clock.now
    clock.now += LEASE_S
    assert leading.won(sent, LEASE_S, "127.0.0.1:8118") is Step.STEP_DOWN
    assert leading.terms == 0


def test_a_lease_longer_than_asked_is_not_trusted_beyond_what_was_asked() -> None:
    clock = FakeClock(100.0)
    leading = Leadership(LEASE_S, clock)
    leading.won(clock.now, 60.0, "127.0.0.1:8118")
    assert leading.valid_until == clock.now + LEASE_S - leading.margin_s


def test_a_resigned_leader_stops_serving_at_once_and_never_campaigns_again() -> None:
    clock = FakeClock(100.0)
    leading = leader(clock)
    assert leading.resign("scheduler stopped by SIGTERM") is Step.STEP_DOWN
    assert not leading.serving()
    assert leading.reason == "scheduler stopped by SIGTERM"
    assert leading.leader_seen(None) is Step.NOTHING  # the key gone: no campaign
    # A campaign that was under way when it resigned leads nothing.
    assert leading.won(clock.now, LEASE_S, "127.0.0.1:8118") is Step.STEP_DOWN
    assert not leading.serving()
    assert leading.terms == 1


def test_a_resigned_standby_has_nothing_to_hand_over() -> None:
    standby = Leadership(LEASE_S, FakeClock(100.0))
    standby.lost("127.0.0.2:8118")
    assert standby.resign("scheduler stopped by SIGTERM") is Step.NOTHING
    assert standby.role is Role.CANDIDATE
    assert standby.leader_seen(None) is Step.NOTHING


class LeaseModel(RuleBasedStateMachine):
    """A leader and etcd's view of its lease, under random delays and losses: whenever the
    leader serves, etcd still holds its lease (no standby can have taken over)."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(100.0)
        self.leading = Leadership(LEASE_S, self.clock)
        self.expiry = -math.inf  # when etcd lets the lease go

    def _granted(self, received: float) -> bool:
        if received >= self.expiry and self.leading.role is Role.LEADER:
            return False  # too late: etcd already let it go
        self.expiry = max(self.expiry, received + LEASE_S)
        return True

    @rule(out=st.floats(0, 0.5), back=st.floats(0, 0.5))
    def campaign(self, out: float, back: float) -> None:
        if self.leading.role is Role.LEADER or self.clock.now < self.expiry:
            return  # etcd keeps the key while the lease lives
        sent = self.clock.now
        self.expiry = sent + out + LEASE_S
        self.clock.now += out + back
        self.leading.won(sent, LEASE_S, "me")

    @rule(out=st.floats(0, 1.5), back=st.floats(0, 1.5), lost=st.booleans())
    def keepalive(self, out: float, back: float, lost: bool) -> None:
        sent = self.clock.now
        self.clock.now += out + back
        if lost:
            self.leading.tick()
            return
        if self._granted(sent + out):
            self.leading.kept(sent, LEASE_S)
        else:
            self.leading.lease_ended()

    @rule()
    def resign(self) -> None:
        self.leading.resign("stopped")

    @rule(dt=st.floats(0, 1.0))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt
        self.leading.tick()

    @invariant()
    def serving_only_under_a_live_lease(self) -> None:
        if self.leading.serving():
            assert self.clock.now < self.expiry - self.leading.margin_s + 1e-9

    @invariant()
    def resigned_never_serves(self) -> None:
        if self.leading.resigned:
            assert not self.leading.serving()


TestLeaseModel = LeaseModel.TestCase
