"""cluster.transport.names: a relay's lookups of names, each once, off its loop, bounded.

The resolver of the machine answers for localhost; one that hangs, or a name looked up many
times at once, is a lookup of the test's own (`Counted`), as a resolver cannot be made to hang
on demand."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from cluster.transport import names
from cluster.transport.names import Names, addresses_of
from tests.aio import BOUND_S, eventually


class Counted:
    """A lookup that answers from `table` once `go` is set, counting what it was asked."""

    def __init__(self, table: dict[str, frozenset[str]]) -> None:
        self.table = table
        self.asked: list[str] = []
        self.go = threading.Event()

    def __call__(self, name: str) -> frozenset[str]:
        self.asked.append(name)
        self.go.wait(BOUND_S)
        if name not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.table[name]


def test_the_machines_resolver_gives_localhost_its_addresses() -> None:
    found = addresses_of("localhost")
    assert found, found
    assert found <= {"127.0.0.1", "::1"}, found


async def test_a_name_is_looked_up_once_for_all_who_ask_and_kept() -> None:
    lookup = Counted({"sched": frozenset({"10.0.0.1"})})
    table = Names(lookup)
    asking = [asyncio.ensure_future(table.resolve(["sched", "other"])) for _ in range(5)]
    lookup.go.set()
    answers = await asyncio.wait_for(asyncio.gather(*asking), BOUND_S)
    for resolved, failed in answers:
        assert resolved == {"sched": frozenset({"10.0.0.1"})}
        assert failed == {"other": "Name or service not known"}
    assert sorted(lookup.asked) == ["other", "sched"]
    assert table.known == {"sched": frozenset({"10.0.0.1"})}
    resolved, failed = await asyncio.wait_for(table.resolve(["sched", "other"]), BOUND_S)
    assert resolved == {"sched": frozenset({"10.0.0.1"})}
    assert sorted(lookup.asked) == ["other", "other", "sched"]  # a failure is asked again


async def test_a_lookup_that_hangs_is_waited_for_a_bounded_while_and_kept_when_it_answers() -> None:
    lookup = Counted({"sched": frozenset({"10.0.0.1"})})
    table = Names(lookup, timeout_s=0.05)
    resolved, failed = await asyncio.wait_for(table.resolve(["sched"]), BOUND_S)
    assert resolved == {}
    assert failed == {"sched": "no answer within 0.05 s"}
    lookup.go.set()
    await eventually(lambda: "sched" in table.known, "the late answer kept")
    assert await table.resolve(["sched"]) == ({"sched": frozenset({"10.0.0.1"})}, {})
    assert lookup.asked == ["sched"]


async def test_lookups_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(names, "MAX_LOOKUPS", 2)
    lookup = Counted({})
    table = Names(lookup, timeout_s=0.05)
    try:
        _, failed = await asyncio.wait_for(table.resolve(["a", "b", "c"]), BOUND_S)
        assert len(lookup.asked) == 2
        assert sum("other names are being looked up" in why for why in failed.values()) == 1
    finally:
        lookup.go.set()
