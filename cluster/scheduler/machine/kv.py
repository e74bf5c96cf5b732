"""The job's key-value store as a pure table: set, get, atomic add, the caps and each member's
share, and the admission of waits.

Counters are stored as decimal ASCII, as in torch's TCPStore, so a counter can be read with get
like any other key.

What it holds is capped (CLUSTER_KV_MAX_BYTES of keys and values, CLUSTER_KV_MAX_KEYS keys, a
number of pending waits), counted as it changes: a set past a cap is refused with a
`CapacityError` that names the cap, and nothing else changes. Each member has its share of each
cap (the cap over the job's nodes, and never less than a floor a real job's rank needs): a key is
counted to the member that set it last, and a member past its share is refused while the others
go on. So one runaway member cannot fill the store, or hold every wait, for everyone.

With recovery, a set is in two steps (write-ahead): `stage` takes the value (caps are counted
on the newest values, staged or not, and `add` counts on from the newest), and `commit`, once it
is saved (`cluster.scheduler.persist`), makes it visible to `get` and to the waits. So no node
reads a value that a crash could forget. Without recovery `set` does both at once.

An add that names itself (`Add`: its member's process and its number there) is counted once,
however often it is made: each member's last add and its answer are kept, and saved after the
counter (`cluster.scheduler.machine.adds`); made again, it is answered as it was and changes
nothing. Those records are the scheduler's own keys (a reserved prefix no member may use), kept
apart from the store's keys and not counted to its caps: their number is bounded by the
members, never by the adds.

This module decides; it holds no future. `cluster.scheduler.kv.KvStore` keeps the waits'
futures and wakes those of the keys a `commit` makes visible.
"""

from __future__ import annotations

import collections
import math

from cluster.protocol.config import DEFAULT_KV_MAX_BYTES, DEFAULT_KV_MAX_KEYS
from cluster.protocol.errors import CapacityError, CollectiveError
from cluster.protocol.value import frozen
from cluster.scheduler.machine.adds import (
    RESERVED_PREFIX,
    Add,
    AddLedger,
    AddRecord,
    Members,
    is_reserved,
)
from cluster.scheduler.machine.rounds import MAX_ANSWER_BYTES

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 4 * 1024 * 1024
# Pending waits: a node waits on a few keys at a time (its threads' rendezvous).
WAITS_PER_NODE = 16
MIN_MAX_WAITS = 1024
# The least share of a member, whatever the job's size: a rank of a large job may still set a
# few full values and a torch store's keys.
SHARE_FLOOR_BYTES = 16 * 1024 * 1024
SHARE_FLOOR_KEYS = 1024
# A counter's bounds: an add's answer is an int64 (torch's TCPStore's too).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@frozen
class Added:
    """What an add that names itself did: `value`, its answer; `record`, the key and value to
    save after the counter (None: made again, nothing staged, answered as before)."""

    value: int
    record: tuple[str, bytes] | None


class KvTable:
    def __init__(
        self,
        max_bytes: int = DEFAULT_KV_MAX_BYTES,
        max_keys: int = DEFAULT_KV_MAX_KEYS,
        *,
        nodes: int = 1,
        max_waits: int | None = None,
    ) -> None:
        """`nodes`: the job's, which sizes the pending waits kept (unless `max_waits` says)."""
        self.data: dict[str, bytes] = {}  # committed: what get and wait see
        # Staged, not yet committed: the newest value of a key, and how many sets are in flight.
        self._staged: dict[str, tuple[bytes, int]] = {}
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.max_waits = (
            max(MIN_MAX_WAITS, WAITS_PER_NODE * nodes) if max_waits is None else max_waits
        )
        self.held_bytes = 0  # keys and values, in bytes
        self.pending_waits = 0
        nodes = max(nodes, 1)
        self.byte_share = min(max_bytes, max(max_bytes // nodes, SHARE_FLOOR_BYTES))
        self.key_share = min(max_keys, max(max_keys // nodes, SHARE_FLOOR_KEYS))
        self.wait_share = min(self.max_waits, max(self.max_waits // nodes, WAITS_PER_NODE))
        # Who set each key last ("": a restored key, or a caller that is nobody's member), and
        # what each member holds and waits for (a member that holds, or waits for, nothing has
        # no entry: ids that come and go leave nothing behind).
        self._owner: dict[str, str] = {}
        self._bytes_of: collections.Counter[str] = collections.Counter()
        self._keys_of: collections.Counter[str] = collections.Counter()
        self._waits_of: collections.Counter[str] = collections.Counter()
        self.adds = AddLedger()  # each member's last add (`add_once`), not among the keys

    def __len__(self) -> int:
        """Keys held, staged ones included (keys are never removed)."""
        return len(self.data) + sum(1 for k in self._staged if k not in self.data)

    def restore(self, saved: dict[str, bytes]) -> None:
        """Start from `saved` (the saved store of a resumed job, its adds' records among it),
        committed."""
        values = {key: value for key, value in saved.items() if not is_reserved(key)}
        self.adds.restore({key: value for key, value in saved.items() if is_reserved(key)})
        self.data = values
        self._staged = {}
        self.held_bytes = sum(len(k.encode()) + len(v) for k, v in values.items())
        self._owner = dict.fromkeys(values, "")
        self._bytes_of = collections.Counter({"": self.held_bytes})
        self._keys_of = collections.Counter({"": len(values)})

    def _newest(self, key: str) -> bytes | None:
        staged = self._staged.get(key)
        return staged[0] if staged is not None else self.data.get(key)

    def set(self, key: str, value: bytes, owner: str = "") -> None:
        """Stage and commit at once (no saving)."""
        self.stage(key, value, owner)
        self.commit(key, value)

    def stage(self, key: str, value: bytes, owner: str = "") -> None:
        """Take `value` for `key` from member `owner`, counted against the caps and its share,
        not yet visible."""
        check_key(key)
        if len(value) > MAX_VALUE_BYTES:
            raise CollectiveError(
                f"value for key {key!r} has {len(value)} bytes; the store takes at most "
                f"{MAX_VALUE_BYTES} (it is for control data, not tensors)"
            )
        old = self._newest(key)
        grows = len(value) + (len(key.encode()) if old is None else -len(old))
        self._check_room(key, new_key=old is None, grows=grows)
        self._check_share(key, value, owner, old)
        self.held_bytes += grows
        self._charge(key, value, owner, old)
        pending = self._staged.get(key, (b"", 0))[1]
        self._staged[key] = (value, pending + 1)

    def commit(self, key: str, value: bytes) -> None:
        """A staged `value` of `key` is saved: visible from now on (the store wakes its
        waiters)."""
        self.data[key] = value
        staged = self._staged.get(key)
        if staged is not None:
            if staged[1] <= 1:
                del self._staged[key]
            else:
                self._staged[key] = (staged[0], staged[1] - 1)

    def get(self, keys: list[str]) -> tuple[list[bytes], list[str]]:
        """Values of the present keys in request order, and the missing keys; a CapacityError,
        before any answer is built, when the values would not fit in one (`answer`)."""
        values = self.answer("a get", [k for k in keys if k in self.data])
        missing = [k for k in keys if k not in self.data]
        return values, missing

    def answer(self, what: str, keys: list[str]) -> list[bytes]:
        """The values of `keys` (every one present), in their order, once their size is known to
        fit in one answer: a request of 256 KiB may list one 4 MiB key thousands of times, and
        its answer would be built whole (gigabytes) before gRPC refused to send it."""
        size = sum(len(self.data[k]) for k in keys)
        if size > MAX_ANSWER_BYTES:
            raise CapacityError(
                f"{what} of {len(keys)} keys would answer {size} bytes, more than the "
                f"{MAX_ANSWER_BYTES} one answer carries (a key listed twice counts twice): ask "
                "for fewer keys at a time"
            )
        return [self.data[k] for k in keys]

    def add(self, key: str, amount: int, owner: str = "") -> int:
        """Add to a counter (stage and commit at once); its new value."""
        number = self.stage_add(key, amount, owner)
        self.commit(key, str(number).encode("ascii"))
        return number

    def stage_add(self, key: str, amount: int, owner: str = "") -> int:
        """Stage the counter's new value, counted from its newest (staged) value; returns it."""
        current = self._newest(key)
        try:
            number = int((b"0" if current is None else current).decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise CollectiveError(
                f"key {key!r} holds a value that is not a counter; add works on counters only"
            ) from None
        if not INT64_MIN <= number <= INT64_MAX:
            raise CollectiveError(
                f"key {key!r} holds {number}, past a counter's bounds "
                f"[{INT64_MIN}, {INT64_MAX}]; add works on 64-bit counters only"
            )
        number += amount
        if not INT64_MIN <= number <= INT64_MAX:
            raise CollectiveError(
                f"adding {amount} to key {key!r} would take it past a counter's bounds "
                f"[{INT64_MIN}, {INT64_MAX}]; nothing was added"
            )
        self.stage(key, str(number).encode("ascii"), owner)
        return number

    def add_once(self, key: str, amount: int, owner: str, add: Add, members: Members) -> Added:
        """Stage `add` (as `stage_add`) and record it as its member's last add; or, when it is
        that add made again, its answer, staging nothing. `members`: who is a member now (the
        records of those gone are rewritten by the next members' adds)."""
        answered = self.adds.answer(add, key, amount)
        if answered is not None:
            return Added(answered, None)
        number = self.stage_add(key, amount, owner)
        return Added(number, self.adds.record(AddRecord(add, key, amount, number), members))

    def _check_share(self, key: str, value: bytes, owner: str, old: bytes | None) -> None:
        """Refuse member `owner` (only it) past its share of the bytes or the keys."""
        if not owner:
            return
        own_old = old is not None and self._owner.get(key) == owner
        freed = len(key.encode()) + len(old) if old is not None and own_old else 0
        held = self._bytes_of[owner] + len(key.encode()) + len(value) - freed
        keys = self._keys_of[owner] + (0 if own_old else 1)
        if keys > self.key_share or held > self.byte_share:
            raise CapacityError(
                f"node {owner!r} would hold {keys} keys and {held} bytes of the key-value "
                f"store, past its share ({self.key_share} keys, {self.byte_share} bytes: "
                "CLUSTER_KV_MAX_KEYS and CLUSTER_KV_MAX_BYTES over the job's nodes, at least "
                f"{SHARE_FLOOR_KEYS} keys and {SHARE_FLOOR_BYTES} bytes), so key {key[:40]!r} "
                "is refused; the other members go on: store less, or reuse keys"
            )

    def _charge(self, key: str, value: bytes, owner: str, old: bytes | None) -> None:
        """Count `key`'s new value to `owner`, and its old one no longer to whoever set it."""
        if old is not None:
            before = self._owner.get(key, "")
            self._bytes_of[before] -= len(key.encode()) + len(old)
            self._keys_of[before] -= 1
            if not self._keys_of[before]:  # it holds nothing any more: not kept
                self._keys_of.pop(before, None)
                self._bytes_of.pop(before, None)
        self._owner[key] = owner
        self._bytes_of[owner] += len(key.encode()) + len(value)
        self._keys_of[owner] += 1

    def _check_room(self, key: str, *, new_key: bool, grows: int) -> None:
        if new_key and len(self) >= self.max_keys:
            raise CapacityError(
                f"the key-value store is full: it holds {len(self)} keys, its cap "
                f"(CLUSTER_KV_MAX_KEYS={self.max_keys}), so key {key[:40]!r} cannot be added; "
                "it is for coordination, not data: reuse keys, or start the scheduler with a "
                "larger CLUSTER_KV_MAX_KEYS"
            )
        if self.held_bytes + grows > self.max_bytes:
            raise CapacityError(
                f"the key-value store is full: it holds {self.held_bytes} bytes of keys and "
                f"values, and key {key[:40]!r} would add {grows} more, past its cap "
                f"(CLUSTER_KV_MAX_BYTES={self.max_bytes}); it is for coordination, not data: "
                "store less, or start the scheduler with a larger CLUSTER_KV_MAX_BYTES"
            )

    def admit_wait(self, keys: list[str], timeout_s: float, owner: str = "") -> None:
        """Take a wait of member `owner` for `keys`, within the pending waits and its share;
        `wait_ended` when it is over."""
        for key in keys:
            check_key(key)
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise CollectiveError(
                f"key-value wait timeout {timeout_s!r} is not a number of seconds"
            )
        if self.pending_waits >= self.max_waits and any(k not in self.data for k in keys):
            raise CapacityError(
                f"{self.pending_waits} key-value waits are pending, the most the scheduler keeps "
                f"for this job (at least {MIN_MAX_WAITS}, {WAITS_PER_NODE} per node): wait for "
                "fewer keys at a time"
            )
        if owner and self._waits_of[owner] >= self.wait_share:
            raise CapacityError(
                f"node {owner!r} has {self._waits_of[owner]} key-value waits pending, its share "
                f"({self.wait_share}: the job's waits over its nodes, at least "
                f"{WAITS_PER_NODE}): wait for fewer keys at a time"
            )
        self.pending_waits += 1
        self._waits_of[owner] += 1

    def wait_ended(self, owner: str = "") -> None:
        self.pending_waits -= 1
        self._waits_of[owner] -= 1
        if not self._waits_of[owner]:
            del self._waits_of[owner]

    def missing(self, keys: list[str]) -> list[str]:
        """The keys not visible yet."""
        return [k for k in keys if k not in self.data]


def check_key(key: str) -> None:
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise CollectiveError(f"key {key[:40]!r} must be 1-{MAX_KEY_BYTES} bytes long")
    if is_reserved(key):
        raise CollectiveError(
            f"key {key[:40]!r} starts with {RESERVED_PREFIX!r}, which the scheduler keeps for "
            "its own records: use another key"
        )
