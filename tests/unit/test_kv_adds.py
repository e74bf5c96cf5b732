"""An add made again is counted once (`cluster.scheduler.machine.adds`, `KvTable.add_once`),
without a loop: members add to counters, their answers are lost, their schedulers die before or
after saving and come back from what was saved, members leave and new ones join, processes
restart; every add that names itself is counted exactly once, answered the same each time it is
made, and the records stay bounded by the members, whatever the number of adds."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.protocol.errors import CollectiveError
from cluster.scheduler.machine.adds import RECORD_PREFIX, Add, AddLedger, AddRecord, decode, encode
from cluster.scheduler.machine.kv import KvTable

KEYS = ["x", "y"]


def test_an_add_made_again_is_answered_as_before_and_changes_nothing() -> None:
    table = KvTable()
    first = table.add_once("n", 1, "0", Add("0", 7, 1), {"0"})
    assert first.value == 1
    assert first.record is not None
    table.commit("n", b"1")
    again = table.add_once("n", 1, "0", Add("0", 7, 1), {"0"})
    assert (again.value, again.record) == (1, None)
    assert table.get(["n"]) == ([b"1"], [])
    # Another number, another process, or another amount: another add.
    assert table.add_once("n", 1, "0", Add("0", 7, 2), {"0"}).value == 2
    assert table.add_once("n", 1, "0", Add("0", 8, 2), {"0"}).value == 3
    assert table.add_once("n", 5, "0", Add("0", 8, 2), {"0"}).value == 8


def test_the_records_saved_with_the_counters_come_back_with_them() -> None:
    table = KvTable()
    saved: dict[str, bytes] = {}
    for node, number in (("0", 1), ("1", 1), ("0", 2)):
        added = table.add_once("n", 1, node, Add(node, 3, number), {"0", "1"})
        assert added.record is not None
        saved["n"] = str(added.value).encode()
        saved[added.record[0]] = added.record[1]
    again = KvTable()
    again.restore(saved)
    assert again.get(["n"]) == ([b"3"], [])
    assert len(again) == 1  # the records are not among the keys
    assert again.add_once("n", 1, "0", Add("0", 3, 2), {"0", "1"}).value == 3
    assert again.add_once("n", 1, "1", Add("1", 3, 1), {"0", "1"}).value == 2
    assert again.add_once("n", 1, "0", Add("0", 3, 1), {"0", "1"}).value == 4  # not the last


def test_a_member_may_not_use_the_schedulers_own_keys() -> None:
    table = KvTable()
    for call in (
        lambda: table.stage(RECORD_PREFIX + "0", b"{}", "0"),
        lambda: table.stage_add(RECORD_PREFIX + "0", 1, "0"),
        lambda: table.admit_wait([RECORD_PREFIX + "0"], 1.0, "0"),
    ):
        with pytest.raises(CollectiveError, match="keeps for its own records: use another key"):
            call()
    assert table.get([RECORD_PREFIX + "0"]) == ([], [RECORD_PREFIX + "0"])


def test_a_record_that_does_not_read_is_passed_over() -> None:
    record = AddRecord(Add("node-é", 2**63 - 1, 5), "k\0ü", -3, -(2**63))
    assert decode(encode(record)) == record
    for data in (b"", b"{", b"[]", b'{"node": 1}', encode(record).replace(b"-3", b"-3.5")):
        assert decode(data) is None
    ledger = AddLedger()
    ledger.restore({RECORD_PREFIX + "0": b"not json", RECORD_PREFIX + "x": encode(record)})
    assert len(ledger) == 0


def test_slots_of_members_that_left_are_reused() -> None:
    ledger = AddLedger()
    members = {"a", "b"}
    keys = set()
    for i in range(100):
        node = f"n{i}"
        members = {"a", node}
        key, _ = ledger.record(AddRecord(Add(node, 1, 1), "k", 1, i), members)
        keys.add(key)
        ledger.record(AddRecord(Add("a", 1, i + 1), "k", 1, i), members)
    assert len(ledger) <= 4
    assert len(keys) <= 4  # the store holds at most that many records


class Adds(RuleBasedStateMachine):
    """The scheduler's table and what it saved (`disk`); the members' processes, each with its
    adds' numbers and the add whose answer it still waits for (made again before its next)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = KvTable()
        self.disk: dict[str, bytes] = {}
        self.members: dict[str, int] = {"0": 1, "1": 2, "2": 3}  # node id -> incarnation
        self.incarnations = 3  # the last one given
        self.joined = 3  # node ids "0", "1", ... given so far
        self.most_members = len(self.members)
        self.numbers: dict[str, int] = {}
        # The add a member waits on: (add, key, amount).
        self.waiting: dict[str, tuple[Add, str, int]] = {}
        # Each add that was saved, once: its answer; and the model's counters.
        self.answers: dict[Add, int] = {}
        self.counters: dict[str, int] = {}

    def restart(self) -> None:
        self.table = KvTable()
        self.table.restore(self.disk)

    def make(self, node: str, add: Add, key: str, amount: int, fate: str) -> None:
        """The call of `add` reaches the scheduler; `fate`: "answered", "lost" (saved, its
        answer lost) or "died" (the scheduler died before saving it)."""
        added = self.table.add_once(key, amount, node, add, set(self.members))
        if added.record is None:
            assert add in self.answers, f"{add} was never saved, yet answered as made before"
            assert added.value == self.answers[add]
        elif fate == "died":
            self.restart()
            self.waiting[node] = (add, key, amount)
            return
        else:
            assert add not in self.answers, f"{add} was saved before, yet counted again"
            self.counters[key] = self.counters.get(key, 0) + amount
            assert added.value == self.counters[key]
            self.answers[add] = added.value
            value = str(added.value).encode()
            self.disk[key] = value  # the counter, then its record (`WriteAheadSaver`)
            self.disk[added.record[0]] = added.record[1]
            self.table.commit(key, value)
        if fate == "answered":
            self.waiting.pop(node, None)
        else:
            self.waiting[node] = (add, key, amount)

    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS),
        amount=st.integers(-3, 5),
        fate=st.sampled_from(["answered", "answered", "lost", "died"]),
    )
    def add(self, data: st.DataObject, key: str, amount: int, fate: str) -> None:
        free = sorted(set(self.members) - set(self.waiting))
        if not free:
            return
        node = data.draw(st.sampled_from(free))
        number = self.numbers[node] = self.numbers.get(node, 0) + 1
        self.make(node, Add(node, self.members[node], number), key, amount, fate)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), fate=st.sampled_from(["answered", "lost", "died"]))
    def make_again(self, data: st.DataObject, fate: str) -> None:
        node = data.draw(st.sampled_from(sorted(self.waiting)))
        add, key, amount = self.waiting[node]
        self.make(node, add, key, amount, fate)

    @rule()
    def scheduler_restarts(self) -> None:
        self.restart()

    @precondition(lambda self: len(self.members) > 1)
    @rule(data=st.data())
    def leaves(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.members)))
        del self.members[node]
        self.waiting.pop(node, None)
        self.numbers.pop(node, None)

    @precondition(lambda self: len(self.members) < 4)
    @rule(again=st.booleans())
    def joins(self, again: bool) -> None:
        """A new node id, or one that left and comes back (a new process)."""
        gone = [str(n) for n in range(self.joined) if str(n) not in self.members]
        node = gone[0] if again and gone else str(self.joined)
        self.joined += node == str(self.joined)
        self.incarnations += 1
        self.members[node] = self.incarnations
        self.most_members = max(self.most_members, len(self.members))

    @rule(data=st.data())
    def process_restarts(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.members)))
        self.incarnations += 1
        self.members[node] = self.incarnations
        self.waiting.pop(node, None)
        self.numbers.pop(node, None)

    @invariant()
    def each_add_is_counted_once(self) -> None:
        for key in KEYS:
            held = self.disk.get(key)
            assert int(held or b"0") == self.counters.get(key, 0)
            assert self.table.get([key])[0] == ([] if held is None else [held])

    @invariant()
    def the_records_are_bounded_by_the_members(self) -> None:
        assert len(self.table.adds) <= 2 * self.most_members
        records = [key for key in self.disk if key.startswith(RECORD_PREFIX)]
        assert len(records) <= 2 * self.most_members


Adds.TestCase.settings = settings(max_examples=300, stateful_step_count=100, deadline=None)
test_adds_are_counted_once = Adds.TestCase
