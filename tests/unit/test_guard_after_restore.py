"""The guard's refusal after a scheduler restart names what the scheduler knows: a member restored
from its snapshot and not heard since was not "last seen alive 0.0 s ago" (it may have died with
the previous scheduler), it was not heard since the restore. The guard itself is unchanged: it
runs from the restore until the member is heard, and from then on from its last beat."""

from __future__ import annotations

from cluster.protocol.records import NodeState, Refusal
from tests.conftest import FakeClock
from tests.unit.test_state import recovering, refuse, reg, restore

UNHEARD = "node id '1' was not heard by this scheduler since it was restored"


def test_a_restored_member_not_heard_since_is_named_by_the_restore_not_a_sighting() -> None:
    clock = FakeClock()
    restored = restore(recovering(clock).snapshot(), clock)
    refusal = refuse(restored, reg(restored, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith(f"{UNHEARD} 0.0 s ago; the scheduler takes a new process")
    assert "last seen alive" not in refusal.message
    assert refusal.retry_after_s == 10.0  # the guard runs from the restore, as before
    clock.now += 2.5
    refusal = refuse(restored, reg(restored, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith(f"{UNHEARD} 2.5 s ago;")
    assert "(retry in 7.5 s)" in refusal.message


def test_a_restored_member_heard_since_is_named_by_its_last_beat() -> None:
    clock = FakeClock()
    restored = restore(recovering(clock).snapshot(), clock)
    clock.now += 3.0
    restored.heartbeat("1", 1)  # the old process is back
    clock.now += 1.5
    refusal = refuse(restored, reg(restored, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith("node id '1' was last seen alive 1.5 s ago;")
    assert "(retry in 8.5 s)" in refusal.message


def test_a_restored_member_failed_before_it_was_heard_is_still_unheard() -> None:
    clock = FakeClock()
    state = recovering(clock)
    state.disconnect("1", 1)
    restored = restore(state.snapshot(), clock)
    assert restored.members["1"].state is NodeState.FAILED
    clock.now += 4.0
    refusal = refuse(restored, reg(restored, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith(
        "node id '1' (failed) was not heard by this scheduler since it was restored 4.0 s ago;"
    )


def test_without_a_restore_the_refusal_names_the_last_sighting() -> None:
    clock = FakeClock()
    state = recovering(clock)
    clock.now += 0.5
    refusal = refuse(state, reg(state, "1", incarnation=2), Refusal.NODE_ALIVE)
    assert refusal.message.startswith("node id '1' was last seen alive 0.5 s ago;")
