"""cluster.protocol.leader_search: whom to ask next for the job's leader, and when to give up.

The search is driven here as a client drives it, against made-up schedulers: each address is
down, the leader, or a standby that names some address (one of the job's, a stranger, itself or
none). The rules hold for every such job: every address is asked at most once; the first asked
is the one given first; a named leader not yet asked is asked next; the search gives up only
once every address of the configuration was asked; the leader is found whenever a leader is
among the addresses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.leader_search import LeaderSearch, leader_to_follow, next_in_turn

LEADER = "leader"
DOWN = "down"


@dataclass(frozen=True)
class Run:
    asked: list[str]
    found: str | None  # the leader's address, None when the search gave up


def drive(search: LeaderSearch, answers: dict[str, str]) -> Run:
    """Ask until the leader answers or the search gives up. `answers[address]` is LEADER, DOWN
    (also for an address not in `answers`), or the leader a standby names ("" for none)."""
    asked: list[str] = []
    while (address := search.next_address()) is not None:
        asked.append(address)
        answer = answers.get(address, DOWN)
        if answer == LEADER:
            return Run(asked, address)
        if answer != DOWN:
            search.standby(answer)
    return Run(asked, None)


def test_next_in_turn_goes_round_and_starts_from_the_first_for_a_stranger() -> None:
    addresses = ["a:1", "b:1", "c:1"]
    assert next_in_turn(addresses, "a:1") == "b:1"
    assert next_in_turn(addresses, "c:1") == "a:1"
    assert next_in_turn(addresses, "named:1") == "a:1"
    assert next_in_turn(["a:1"], "a:1") == "a:1"


def test_a_leader_is_not_followed_when_none_is_named_or_the_standby_names_itself() -> None:
    assert leader_to_follow("a:1", "b:1", ()) == "b:1"
    assert leader_to_follow("a:1", "", ()) is None
    assert leader_to_follow("a:1", "a:1", ()) is None
    assert leader_to_follow("a:1", "b:1", {"b:1"}) is None  # found down lately, or asked


def test_a_named_leader_is_asked_next_and_then_the_turn_goes_on_where_it_was() -> None:
    # a names c, which is down: b is next (the turn after a), then d.
    run = drive(LeaderSearch(["a", "b", "c", "d"]), {"a": "c", "d": LEADER})
    assert run == Run(["a", "c", "b", "d"], "d")


def test_the_search_starts_where_asked_and_goes_round() -> None:
    run = drive(LeaderSearch(["a", "b", "c"], first="b"), {"a": LEADER})
    assert run == Run(["b", "c", "a"], "a")


def test_a_stranger_is_followed_unless_only_the_listed_are() -> None:
    answers = {"a": "elsewhere", "elsewhere": LEADER}
    assert drive(LeaderSearch(["a", "b"]), answers) == Run(["a", "elsewhere"], "elsewhere")
    assert drive(LeaderSearch(["a", "b"], listed_only=True), answers) == Run(["a", "b"], None)


def test_no_address_is_no_search() -> None:
    assert drive(LeaderSearch([]), {}) == Run([], None)


ADDRESSES = st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True)


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[str], dict[str, str], str | None, bool]:
    """Addresses, what each answers (strangers x and y among the named), where the search
    starts, and whether it follows strangers."""
    addresses = draw(ADDRESSES)
    named = st.sampled_from([*addresses, "x", "y", ""])
    answer = st.one_of(st.just(LEADER), st.just(DOWN), named)
    answers = {a: draw(answer) for a in [*addresses, "x", "y"]}
    first = draw(st.one_of(st.none(), st.sampled_from(addresses)))
    return addresses, answers, first, draw(st.booleans())


@given(jobs())
def test_every_address_is_asked_at_most_once_and_all_before_giving_up(
    job: tuple[list[str], dict[str, str], str | None, bool],
) -> None:
    addresses, answers, first, listed_only = job
    run = drive(LeaderSearch(addresses, first, listed_only=listed_only), answers)
    assert len(run.asked) == len(set(run.asked))
    assert run.asked[0] == (first or addresses[0])
    if run.found is None:
        assert set(addresses) <= set(run.asked)
    else:
        assert answers[run.found] == LEADER
        assert run.asked[-1] == run.found
    if listed_only:
        assert set(run.asked) <= set(addresses)
    if any(answers[a] == LEADER for a in addresses):
        assert run.found is not None


@given(jobs())
def test_a_named_leader_not_yet_asked_is_asked_next(
    job: tuple[list[str], dict[str, str], str | None, bool],
) -> None:
    addresses, answers, first, listed_only = job
    run = drive(LeaderSearch(addresses, first, listed_only=listed_only), answers)
    for i, address in enumerate(run.asked[:-1]):
        named = answers[address]
        followed = named not in (LEADER, DOWN, "", address) and named not in run.asked[:i]
        if followed and (named in addresses or not listed_only):
            assert run.asked[i + 1] == named


@pytest.mark.parametrize("first", ["a", "zz"])
def test_a_first_that_is_not_listed_starts_from_the_first_listed(first: str) -> None:
    assert drive(LeaderSearch(["a", "b"], first=first), {}).asked[0] == "a"
