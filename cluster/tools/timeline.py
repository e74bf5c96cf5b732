"""What each rank went through during a run, from the scheduler's events: pure.

`lanes` turns the event log (as the chaos report holds it: each event with `t`, seconds since
the job formed) into one lane per rank: segments of `alive`, `failed` (from the failure to the
first guard refusal of its node id), `guard` (refused by the re-registration guard until it
rejoined), and `rejoined` marks. A node that comes back without a guard refusal (the same
process, after a partition or a long stop) goes from `failed` to `alive` directly. A spare
has no lane until it takes a rank: `promoted` puts that rank's lane back to `alive` with a
promotion mark, and from then on the rank is the spare's (the failed node's id, refused by
the guard or failing again, no longer moves it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ALIVE, FAILED, GUARD = "alive", "failed", "guard"


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    state: str


@dataclass
class Lane:
    rank: int
    segments: list[Segment] = field(default_factory=list)
    rejoins: list[float] = field(default_factory=list)
    promotions: list[tuple[float, str]] = field(default_factory=list)  # (t, the spare's node id)
    state: str = ALIVE
    since: float = 0.0

    def move(self, t: float, state: str) -> None:
        if state == self.state:
            return
        if t > self.since:
            self.segments.append(Segment(self.since, t, self.state))
        self.state, self.since = state, t

    def close(self, end: float) -> None:
        if end > self.since:
            self.segments.append(Segment(self.since, end, self.state))
        self.since = end


def end_of(events: Iterable[Mapping[str, Any]], default: float) -> float:
    """When the job ended (its last event), or `default`."""
    ends = [float(e["t"]) for e in events if e["event"] in ("finished", "job_failed")]
    return min(ends) if ends else default


def lanes(events: Iterable[Mapping[str, Any]], workers: int, end: float) -> list[Lane]:
    """One lane per rank, from 0 (the job formed) to `end` seconds (or the job's last event)."""
    by_rank = [Lane(rank) for rank in range(workers)]
    rank_of: dict[str, int] = {}  # node id -> rank, as events name them
    for event in sorted(events, key=lambda e: float(e["t"])):
        t, kind = max(float(event["t"]), 0.0), event["event"]
        rank = event.get("rank")
        node_id = event.get("node_id")
        if isinstance(rank, int) and node_id is not None:
            _name(rank_of, str(node_id), rank, taken=kind == "promoted")
        if rank is None and node_id is not None:
            rank = rank_of.get(str(node_id))
        if kind in ("finished", "job_failed"):
            end = min(end, t)
            continue
        if not isinstance(rank, int) or not 0 <= rank < workers:
            continue
        lane = by_rank[rank]
        if kind == "failed":
            lane.move(t, FAILED)
        elif kind == "guard_refusal" and lane.state == FAILED:
            lane.move(t, GUARD)
        elif kind == "rejoined":
            lane.move(t, ALIVE)
            lane.rejoins.append(t)
        elif kind == "promoted":
            lane.move(t, ALIVE)
            lane.promotions.append((t, str(node_id)))
    for lane in by_rank:
        lane.close(end)
    return by_rank


def _name(rank_of: dict[str, int], node_id: str, rank: int, *, taken: bool) -> None:
    """`node_id` holds `rank` now; `taken` (a spare's promotion): it alone, the node ids that
    held it before no longer do."""
    if taken:
        for before in [n for n, r in rank_of.items() if r == rank]:
            del rank_of[before]
    rank_of[node_id] = rank


def step_series(
    samples: Iterable[tuple[float, int, int]], workers: int
) -> list[list[tuple[float, int]]]:
    """Per rank, its (t, newest checkpoint step) samples in time order."""
    series: list[list[tuple[float, int]]] = [[] for _ in range(workers)]
    for t, rank, step in sorted(samples):
        if 0 <= rank < workers:
            series[rank].append((t, step))
    return series
