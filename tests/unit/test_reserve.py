"""Which connections the scheduler sheds to keep descriptors for its members."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cluster.scheduler.machine.reserve import (
    RESERVE_BASE,
    Connection,
    peer_address,
    reserve,
    to_shed,
)

FLOOD = [Connection(100 + i, f"10.0.0.9:{5000 + i}", age_s=50 - i) for i in range(50)]
NEWCOMER = Connection(90, "10.0.0.2:7000")
MEMBER = Connection(80, "10.0.0.1:6000")


def test_nothing_is_shed_while_the_reserve_is_free() -> None:
    assert to_shed(900, 1000, 100, [*FLOOD, NEWCOMER, MEMBER], {MEMBER.peer}) == []


def test_past_the_reserve_the_flood_goes_first_and_members_stay() -> None:
    shed = to_shed(950, 1000, 100, [*FLOOD, NEWCOMER, MEMBER], {MEMBER.peer})
    assert len(shed) == 51  # enough to leave 200 free, as far as there are others
    assert shed[:50] == FLOOD  # the oldest of the flood first
    assert shed[50] == NEWCOMER
    assert MEMBER not in shed


def test_only_what_leaves_twice_the_reserve_free() -> None:
    assert to_shed(990, 1000, 10, [*FLOOD, NEWCOMER], set()) == []
    shed = to_shed(995, 1000, 10, [*FLOOD, NEWCOMER], set())
    assert shed == FLOOD[:15]


def test_the_connections_of_nodes_still_to_come_are_kept() -> None:
    # 16,384 nodes forming under a limit of 20,000: the connections not yet carrying a stream
    # may all be nodes whose registration is on its way, and none is shed; past that many,
    # the rest may go.
    forming = [Connection(100 + i, f"127.0.0.1:{5000 + i}", age_s=i / 100) for i in range(50)]
    assert to_shed(990, 1000, 100, forming, set(), still_to_come=60) == []
    shed = to_shed(990, 1000, 100, forming, set(), still_to_come=20)
    assert shed == sorted(forming, key=lambda c: -c.age_s)[:30]


def test_the_reserve_counts_the_nodes_still_to_connect() -> None:
    assert reserve(8, 0) == RESERVE_BASE + 8
    assert reserve(8, 8) == RESERVE_BASE
    assert reserve(8, 10) == RESERVE_BASE  # spares beside the ranks


def test_within_an_address_the_oldest_go_first_then_the_lowest_descriptors() -> None:
    fresh = [Connection(fd, f"127.0.0.1:{fd}") for fd in (30, 10, 20)]
    old = Connection(40, "127.0.0.1:40", age_s=3.0)
    shed = to_shed(1000, 1000, 2, [*fresh, old], set())
    assert shed == [old, fresh[1], fresh[2], fresh[0]]


def test_peers_as_grpc_names_them() -> None:
    assert peer_address("ipv4:10.0.0.5:41234") == "10.0.0.5:41234"
    assert peer_address("ipv6:[::1]:41234") == "[::1]:41234"
    assert peer_address("unix:/tmp/s") == ""
    assert Connection(3, "[::1]:41234").host == "[::1]"


connections = st.lists(
    st.builds(
        Connection,
        st.integers(3, 10_000),
        st.sampled_from(["10.0.0.1", "10.0.0.2", "[::1]"]).flatmap(
            lambda h: st.integers(1, 65535).map(lambda p: f"{h}:{p}")
        ),
    ),
    unique_by=lambda c: c.fd,
    max_size=60,
)


@given(connections, st.integers(0, 2000), st.integers(1, 2000), st.integers(0, 300), st.data())
def test_a_member_is_never_shed_and_no_more_than_needed(
    conns: list[Connection], open_fds: int, limit: int, keep: int, data: st.DataObject
) -> None:
    members = {c.peer for c in data.draw(st.lists(st.sampled_from(conns)))} if conns else set()
    to_come = data.draw(st.integers(0, 80))
    shed = to_shed(open_fds, limit, keep, conns, members, to_come)
    assert not {c.peer for c in shed} & members
    assert len(shed) <= max(open_fds + 2 * keep - limit, 0)
    others = [c for c in conns if c.peer not in members]
    assert len(shed) <= max(len(others) - to_come, 0)
    if open_fds + keep <= limit:
        assert shed == []
