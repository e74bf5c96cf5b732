"""The in-memory resume decision (cluster.protocol.resume): pure, so tested without a network,
by properties over every gathered list hypothesis makes, and by the cases the issue names."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.resume import NOTHING, decide, decode, encode

steps = st.integers(min_value=0, max_value=50)
held_lists = st.lists(st.one_of(st.none(), steps), min_size=1, max_size=9)


def can_get(held: list[int | None], rank: int, step: int, *, replicated: bool) -> bool:
    """Whether `rank` can have the state of `step` from memory: its own, or a replica's."""
    if held[rank] == step:
        return True
    return replicated and held[rank] is None and step in held


@given(held_lists, steps, st.booleans())
def test_the_decision_never_picks_a_step_in_memory_some_rank_cannot_get(
    held: list[int | None], disk_step: int, replicated: bool
) -> None:
    resume = decide(held, disk_step, replicated=replicated)
    if resume.in_memory:
        assert all(
            can_get(held, r, resume.step, replicated=replicated) for r in range(len(held))
        ), resume
        assert resume.servers == tuple(r for r, s in enumerate(held) if s == resume.step)
        assert resume.servers
        assert resume.step >= disk_step
    else:
        assert resume.step == disk_step
        assert resume.servers == ()
    assert {resume.source(r, s) for r, s in enumerate(held)} <= {"own", "peer", "disk"}


@given(held_lists, steps, st.booleans())
def test_a_step_in_memory_that_every_rank_can_get_is_taken(
    held: list[int | None], disk_step: int, replicated: bool
) -> None:
    """The converse: disk only when memory cannot serve every rank (no lost chance)."""
    resume = decide(held, disk_step, replicated=replicated)
    candidates = {
        s
        for s in held
        if s is not None
        and s >= disk_step
        and all(can_get(held, r, s, replicated=replicated) for r in range(len(held)))
    }
    if candidates:
        assert resume.in_memory
        assert resume.step in candidates
    else:
        assert not resume.in_memory


@given(st.integers(min_value=1, max_value=9), steps, steps, st.booleans())
def test_every_worker_at_the_same_step_resumes_there_with_no_newcomer(
    size: int, step: int, disk_step: int, replicated: bool
) -> None:
    """A scheduler restart that cut a collective in two: everyone a survivor, nothing moves."""
    resume = decide([step] * size, min(disk_step, step), replicated=replicated)
    assert (resume.step, resume.in_memory) == (step, True)
    assert all(resume.source(r, step) == "own" for r in range(size))


def test_a_newcomer_gets_the_survivors_step_from_a_peer_when_states_are_replicas() -> None:
    resume = decide([37, None, 37, 37], 35, replicated=True)
    assert (resume.step, resume.in_memory, resume.servers) == (37, True, (0, 2, 3))
    assert resume.source(1, None) == "peer"
    assert resume.source(0, 37) == "own"
    assert "rank 1 gets it from a peer" in resume.why


def test_a_newcomer_without_its_ranks_own_state_sends_everyone_to_disk() -> None:
    """replicated=False: rank 1's state was held by the worker it replaces, which is gone."""
    resume = decide([37, None, 37, 37], 35, replicated=False)
    assert (resume.step, resume.in_memory) == (35, False)
    assert resume.source(0, 37) == "disk"
    assert "replicated=False" in resume.why


def test_survivors_at_different_steps_roll_back_to_disk() -> None:
    """One survivor finished the step the others abandoned: no step every rank holds."""
    resume = decide([37, None, 38, 37], 35, replicated=True)
    assert (resume.step, resume.in_memory) == (35, False)
    assert "ranks 0, 3 at 37; rank 2 at 38" in resume.why


def test_nobody_holding_memory_is_the_disk_rollback() -> None:
    resume = decide([None, None], 20, replicated=True)
    assert (resume.step, resume.in_memory) == (20, False)


@given(st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1)))
def test_a_contribution_reads_back_as_it_was_sent(step: int | None) -> None:
    assert decode(encode(step)) == step


@given(st.binary(max_size=20))
def test_any_bytes_read_as_a_step_or_nothing_never_an_error(raw: bytes) -> None:
    value = decode(raw)
    assert value is None or (len(raw) == 8 and value >= 0)
    assert decode(encode(None)) is None
    assert NOTHING < 0
