"""The key-value store as a pure table (`cluster.scheduler.machine.kv`), without a loop: random
sets, adds and commits by members, some past their share, keep what is held accounted, within the
caps and within each member's share; a refused set changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cluster.protocol.errors import CapacityError, CollectiveError
from cluster.scheduler.machine.kv import INT64_MAX, INT64_MIN, KvTable

MEMBERS = ["0", "1", "2"]
KEYS = ["a", "b", "c", "counter"]


def test_a_staged_value_is_seen_only_once_committed() -> None:
    table = KvTable(max_bytes=1000, max_keys=10)
    table.stage("a", b"1", "0")
    assert table.get(["a"]) == ([], ["a"])
    assert table.missing(["a"]) == ["a"]
    table.commit("a", b"1")
    assert table.get(["a"]) == ([b"1"], [])


def test_waits_are_admitted_within_their_share() -> None:
    table = KvTable(max_bytes=1000, max_keys=10, nodes=100, max_waits=1024)
    for _ in range(table.wait_share):
        table.admit_wait(["a"], 1.0, "0")
    table.admit_wait(["a"], 1.0, "1")  # another member goes on
    with pytest.raises(CapacityError, match="its share"):
        table.admit_wait(["a"], 1.0, "0")
    table.wait_ended("0")
    with pytest.raises(CollectiveError, match="not a number of seconds"):
        table.admit_wait(["a"], float("nan"), "0")


@pytest.mark.parametrize(
    ("held", "amount"),
    [(None, INT64_MAX + 1), (str(INT64_MAX).encode(), 1), (str(INT64_MIN).encode(), -1)],
)
def test_an_add_past_a_counters_bounds_is_refused_and_stages_nothing(
    held: bytes | None, amount: int
) -> None:
    table = KvTable(max_bytes=1000, max_keys=10)
    if held is not None:
        table.set("n", held)
    with pytest.raises(CollectiveError, match=r"past a counter's bounds \[-9223372036854775808"):
        table.stage_add("n", amount, "0")
    assert table._newest("n") == held
    table.set("n", b"9" * 30)  # set takes any bytes; an add refuses a counter past int64
    with pytest.raises(CollectiveError, match=f"holds {'9' * 30}, past a counter's bounds"):
        table.stage_add("n", 1, "0")
    assert table._newest("n") == b"9" * 30
    table.set("n", b"41")
    assert table.add("n", 1, "0") == 42  # the key keeps working


def test_owners_that_come_and_go_leave_no_counters_behind() -> None:
    """Nodes with ids of their own set a key another sets after them, and wait for keys: a
    member that holds and waits for nothing has no entry (zero counters were kept for every id
    ever seen)."""
    table = KvTable(max_bytes=10_000, max_keys=10)
    for i in range(1000):
        owner = f"host-{i}"
        table.set("shared", owner.encode(), owner)
        table.admit_wait(["missing"], 1.0, owner)
        table.wait_ended(owner)
    assert dict(table._keys_of) == {"host-999": 1}
    assert dict(table._bytes_of) == {"host-999": len("shared") + len("host-999")}
    assert dict(table._waits_of) == {}


class KvMachine(RuleBasedStateMachine):
    @initialize(max_bytes=st.sampled_from([40, 200]), max_keys=st.sampled_from([3, 10]))
    def setup(self, max_bytes: int, max_keys: int) -> None:
        self.table = KvTable(max_bytes=max_bytes, max_keys=max_keys, nodes=len(MEMBERS))
        self.table.byte_share = max_bytes // 2  # small enough for a member to reach
        self.table.key_share = 2
        self.staged: list[tuple[str, bytes]] = []
        self.waits: list[str] = []  # the owners of the waits admitted and not yet ended

    def _counted(self) -> tuple[int, int]:
        return self.table.held_bytes, len(self.table)

    @rule(
        key=st.sampled_from(KEYS[:3]), value=st.binary(max_size=12), owner=st.sampled_from(MEMBERS)
    )
    def stage(self, key: str, value: bytes, owner: str) -> None:
        before = self._counted()
        try:
            self.table.stage(key, value, owner)
        except CapacityError:
            event("refused")
            assert self._counted() == before  # a refusal changes nothing
            return
        self.staged.append((key, value))

    @rule(
        amount=st.one_of(st.integers(-3, 3), st.sampled_from([INT64_MAX, INT64_MIN])),
        owner=st.sampled_from(MEMBERS),
    )
    def add(self, amount: int, owner: str) -> None:
        before = self._counted(), self.table._newest("counter")
        try:
            number = self.table.stage_add("counter", amount, owner)
        except CapacityError:
            return
        except CollectiveError:
            event("past int64")
            assert (self._counted(), self.table._newest("counter")) == before
            return
        assert INT64_MIN <= number <= INT64_MAX
        self.staged.append(("counter", str(number).encode("ascii")))

    @rule(owner=st.sampled_from(MEMBERS))
    def wait(self, owner: str) -> None:
        try:
            self.table.admit_wait(["a"], 1.0, owner)
        except CapacityError:
            return
        self.waits.append(owner)

    @rule(index=st.integers(min_value=0, max_value=40))
    def a_wait_ends(self, index: int) -> None:
        if self.waits:
            self.table.wait_ended(self.waits.pop(index % len(self.waits)))

    @rule()
    def a_save_lands(self) -> None:
        if self.staged:
            key, value = self.staged.pop(0)
            self.table.commit(key, value)

    @invariant()
    def held_is_accounted_and_within_caps_and_shares(self) -> None:
        table = self.table
        newest = {**table.data, **{k: v for k, (v, _) in table._staged.items()}}
        assert table.held_bytes == sum(len(k.encode()) + len(v) for k, v in newest.items())
        assert table.held_bytes <= table.max_bytes
        assert len(table) <= table.max_keys
        for owner in MEMBERS:
            assert table._bytes_of[owner] <= table.byte_share
            assert table._keys_of[owner] <= table.key_share
        # Each owner's counts are what it holds and waits for, and only an owner of something
        # has an entry.
        owned: dict[str, list[str]] = {}
        for key, owner in table._owner.items():
            owned.setdefault(owner, []).append(key)
        assert dict(table._keys_of) == {o: len(keys) for o, keys in owned.items()}
        assert dict(table._bytes_of) == {
            o: sum(len(k.encode()) + len(newest[k]) for k in keys) for o, keys in owned.items()
        }
        assert dict(table._waits_of) == {o: self.waits.count(o) for o in set(self.waits)}


TestKv = KvMachine.TestCase
TestKv.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
