"""Ranks, a part of the scheduler's state machine: which rank and local rank each member holds,
and which ranks a job that did not form was missing."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from cluster.protocol.config import is_numeric_node_id
from cluster.protocol.display import listed
from cluster.protocol.records import Member, NodeRole, TopologyReadyEvent
from cluster.protocol.settings import JobSettings

# The most node ids, or spans of ranks, a reason names: thousands stay a line.
LISTED_MAX = 32


def assign_ranks(members: list[Member], space: int, *, newcomer: str | None = None) -> None:
    """Numeric node ids keep their number; the others fill the free ranks by (host, node id).
    Local ranks follow the hosts (`place_locally`)."""
    taken = {int(m.node_id) for m in members if is_numeric_node_id(m.node_id)}
    free = iter(r for r in range(space) if r not in taken)
    for m in sorted(members, key=lambda m: (m.host, m.node_id)):
        if m.rank is None:
            m.rank = int(m.node_id) if is_numeric_node_id(m.node_id) else next(free)
    place_locally(members, newcomer)


def place_locally(members: list[Member], newcomer: str | None) -> None:
    """Each member's local rank and local size among the members (of one role) of its host;
    the local size is how many they are. `newcomer`: the node id that holds its rank with a
    new process (a promoted spare, a worker back on another host); every other member keeps
    its local rank (its process goes on into the new generation with its device bound by it),
    unless one of lower rank on its host holds it. None: the job forms, nobody keeps one. The
    others, by rank, take the lowest local ranks free on their host: when the job forms, 0, 1,
    ... by rank. A host that a member left keeps the gap, so a local rank may be at or past
    the local size."""
    by_host: dict[str, list[Member]] = {}
    for m in sorted(members, key=lambda m: m.rank if m.rank is not None else -1):
        by_host.setdefault(m.host, []).append(m)
    for group in by_host.values():
        held: set[int] = set()
        moved: list[Member] = []
        for m in group:
            if newcomer not in (None, m.node_id) and m.local_rank not in held:
                held.add(m.local_rank)
            else:
                moved.append(m)
        free = (i for i in itertools.count() if i not in held)
        for m in moved:
            m.local_rank = next(free)
        for m in group:
            m.local_size = len(group)


def missing_ranks(workers: Iterable[Member], worker_num: int) -> list[tuple[int, int]] | None:
    """The missing ranks as spans (first, last), when every registered worker has a numeric id
    (so ranks are known). Walks the registered ranks, never range(worker_num): a job of 10**8
    workers that timed out would spend its last seconds, and gigabytes, listing them."""
    ids = [m.node_id for m in workers]
    if not all(is_numeric_node_id(i) for i in ids):
        return None
    spans: list[tuple[int, int]] = []
    start = 0
    for held in sorted({int(i) for i in ids if int(i) < worker_num}):
        if held > start:
            spans.append((start, held - 1))
        start = held + 1
    if start < worker_num:
        spans.append((start, worker_num - 1))
    return spans


def describe_missing(members: Iterable[Member], settings: JobSettings, waited: float) -> str:
    """Why a job that waited `waited` s did not form: how many of each role registered, and
    the missing ranks (or, when ranks are not known yet, the node ids that registered)."""
    workers = [m for m in members if m.role is NodeRole.WORKER]
    servers = [m for m in members if m.role is NodeRole.SERVER]
    parts = [f"{len(workers)} of {settings.worker_num} workers"]
    if settings.server_num:
        parts.append(f"{len(servers)} of {settings.server_num} servers")
    head = f"{' and '.join(parts)} registered after {waited:.0f} s (MS_TOPO_TIMEOUT)"
    missing = missing_ranks(workers, settings.worker_num)
    if missing == []:
        names = listed(sorted(m.node_id for m in servers), LISTED_MAX) or "none"
        return f"{head}; registered servers: {names}"
    if missing is not None:
        several = len(missing) > 1 or missing[0][0] != missing[0][1]
        return f"{head}; missing: rank{'s' if several else ''} {ranges(missing, LISTED_MAX)}"
    names = listed(sorted(m.node_id for m in workers), LISTED_MAX) or "none"
    return f"{head}; registered node ids: {names}"


def ranges(spans: list[tuple[int, int]], most: int | None = None) -> str:
    """[(0, 2), (5, 5)] -> '0-2, 5'; with `most`, the first `most` spans and how many more."""
    shown = (str(first) if first == last else f"{first}-{last}" for first, last in spans)
    return listed(shown, len(spans) if most is None else most)


def catch_up_for(member: Member | None, generation: int, told: list[Any]) -> list[Any]:
    """What of `told` (the events told so far, as saved) a node whose stream just opened may
    hear: not a told generation, older than the current `generation`, that gives the node's id
    another rank than the one decided for it (a new process of the id, taken as a spare or
    with its rank while that generation waits for its save): it would take that rank from its
    previous process's row (found by the simulation, seed 7389). It hears its own generation
    once that is saved."""
    if member is None:
        return told
    kept = []
    for event in told:
        if isinstance(event, TopologyReadyEvent) and event.generation < generation:
            row = next((p.rank for p in event.peers if p.node_id == member.node_id), None)
            if row is not None and row != member.rank:
                continue
        kept.append(event)
    return kept
