"""Each member's last counter add, kept so that an add made again is counted once.

A worker numbers its adds (`KvAddRequest.add_id`, from 1 in each process) and makes an add
again, with the same number, when its scheduler went away before answering (a restart, a new
leader). That add may have been saved before its answer was lost: counted again, one +1 would
be +2, and a counter that ranks count on for a barrier or a rendezvous would be wrong. So the
ledger keeps, for each member, the last add it made: its process (incarnation), its number, the
key, the amount and the answer. An add whose process, number, key and amount are those of its
member's last add is that add made again: it gets the recorded answer and changes nothing. Only
the last add of a member is kept: a process makes its adds one after another (an add made
again comes before its next one), and of adds sent at once from several threads of one process
only the last is known when made again.

The records are saved in the key-value store itself, under the reserved keys `RECORD_PREFIX`
and a slot number, which no member may set, add to or wait for (`is_reserved`), in the batch of
their counter and after it (`WriteAheadSaver`): a restarted scheduler, or a new leader, has the
record of every add whose counter it has. A torn batch may keep a counter without its record
(that add, made again, is counted again, as without a ledger), never a record without its
counter.

Bounded by the members, never by the adds: a member has one slot, which each of its adds
rewrites. A slot of a member that left is given to the next member that needs one. The slots
are swept for members no longer there only when there are twice as many as members, so they
stay at most twice the most members the job had, and a sweep frees at least half of them (it
costs O(1) per add, amortized). A member that had a slot gets that one back while its record is
there, so no node id is named by two slots.

An add without a number (0: an older worker) is not recorded: counted each time it is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from cluster.protocol.value import frozen

# Keys under this prefix are the scheduler's own (`is_reserved`); an add's record is
# RECORD_PREFIX + its slot.
RESERVED_PREFIX = "\0cluster/"
RECORD_PREFIX = RESERVED_PREFIX + "add/"


def is_reserved(key: str) -> bool:
    return key.startswith(RESERVED_PREFIX)


@frozen
class Add:
    """One add as its member's process numbered it."""

    node_id: str  # canonical
    incarnation: int
    number: int


@frozen
class AddRecord:
    """An add and its answer: `value`, the counter `key` held once `amount` was added."""

    add: Add
    key: str
    amount: int
    value: int


class Members(Protocol):
    """Who is a member now (by canonical node id), and how many there are."""

    def __contains__(self, node_id: object, /) -> bool: ...

    def __len__(self) -> int: ...


def encode(record: AddRecord) -> bytes:
    import json  # noqa: PLC0415 - at the first add: a scheduler starts without json

    add = record.add
    fields = {
        "node": add.node_id,
        "incarnation": add.incarnation,
        "number": add.number,
        "key": record.key,
        "amount": record.amount,
        "value": record.value,
    }
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()


def decode(data: bytes) -> AddRecord | None:
    """The record saved as `data`; None when it is not one (it is then not used: that member's
    last add, made again, is counted again)."""
    import json  # noqa: PLC0415 - at the first add: a scheduler starts without json

    try:
        fields = json.loads(data)
        node, key = fields["node"], fields["key"]
        numbers = [fields[name] for name in ("incarnation", "number", "amount", "value")]
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(node, str) and isinstance(key, str)):
        return None
    if not all(type(n) is int for n in numbers):
        return None
    incarnation, number, amount, value = numbers
    return AddRecord(Add(node, incarnation, number), key, amount, value)


class AddLedger:
    def __init__(self) -> None:
        self._records: dict[int, AddRecord] = {}  # slot -> the record saved there
        self._slot_of: dict[str, int] = {}  # node id -> the slot whose record names it
        self._free: dict[int, None] = {}  # slots of members that left, in the order found
        self._next = 0  # the next new slot

    def __len__(self) -> int:
        """Slots held (each one saved record)."""
        return len(self._records)

    def restore(self, saved: Mapping[str, bytes]) -> None:
        """Start from the records in `saved` (keys RECORD_PREFIX + slot); other keys, and
        records that do not read, are passed over."""
        self._records, self._slot_of, self._free, self._next = {}, {}, {}, 0
        for key, data in saved.items():
            slot_text = key[len(RECORD_PREFIX) :]
            record = decode(data) if key.startswith(RECORD_PREFIX) else None
            if record is None or not (slot_text.isascii() and slot_text.isdigit()):
                continue
            slot = int(slot_text)
            if record.add.node_id in self._slot_of:
                self._free[slot] = None  # a node named twice: its first record is kept
            else:
                self._slot_of[record.add.node_id] = slot
            self._records[slot] = record
            self._next = max(self._next, slot + 1)

    def answer(self, add: Add, key: str, amount: int) -> int | None:
        """What `add` was answered, when it is its member's last add made again (the same
        process, number, key and amount); None for an add not recorded."""
        slot = self._slot_of.get(add.node_id)
        record = None if slot is None else self._records[slot]
        if record is None or (record.add, record.key, record.amount) != (add, key, amount):
            return None
        return record.value

    def record(self, record: AddRecord, members: Members) -> tuple[str, bytes]:
        """Keep `record` as its member's last add; the key and the value to save it under,
        after its counter."""
        slot = self._slot(record.add.node_id, members)
        self._records[slot] = record
        return RECORD_PREFIX + str(slot), encode(record)

    def _slot(self, node_id: str, members: Members) -> int:
        slot = self._slot_of.get(node_id)
        if slot is not None:
            self._free.pop(slot, None)
            return slot
        if not self._free and len(self._records) >= 2 * max(len(members), 1):
            self._free = {s: None for s, r in self._records.items() if r.add.node_id not in members}
        if self._free:
            slot = next(iter(self._free))
            del self._free[slot]
            gone = self._records[slot].add.node_id
            if self._slot_of.get(gone) == slot:
                del self._slot_of[gone]
        else:
            slot, self._next = self._next, self._next + 1
        self._slot_of[node_id] = slot
        return slot
