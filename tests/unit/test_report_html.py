"""The chaos report's picture: lanes from the scheduler's events (pure), and the page's parts."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from cluster.tools import report_html
from cluster.tools.timeline import ALIVE, FAILED, GUARD, Segment, lanes, step_series

EVENTS: list[dict[str, Any]] = [
    {"t": -0.2, "event": "registered", "node_id": "1"},
    {"t": 0.0, "event": "formed", "generation": 1},
    {"t": 2.0, "event": "failed", "rank": 1, "node_id": "1", "cause": "stream_broken"},
    {"t": 2.5, "event": "guard_refusal", "node_id": "1", "retry_after_s": 2.5},
    {"t": 3.0, "event": "guard_refusal", "node_id": "1", "retry_after_s": 2.0},
    {"t": 5.0, "event": "rejoined", "rank": 1, "node_id": "1"},
    {"t": 5.0, "event": "generation", "generation": 2, "rollback_step": 10},
    {"t": 7.0, "event": "failed", "rank": 0, "node_id": "0", "cause": "heartbeat_silence"},
    {"t": 7.5, "event": "rejoined", "rank": 0, "node_id": "0"},  # the same process: no guard
    {"t": 9.0, "event": "finished", "detail": "all 2 nodes finished"},
]

REPORT: dict[str, Any] = {
    "seed": 3,
    "workers": 2,
    "ok": True,
    "exit_code": 0,
    "duration_s": 12.0,
    "detail": "",
    "faults": [
        {
            "kind": "kill",
            "target": "worker 1",
            "injected_at_s": 1.9,
            "detected_after_s": 0.1,
            "recovered_after_s": 3.1,
            "steps_lost": 4,
            "note": "",
        },
        {
            "kind": "scheduler",
            "target": "scheduler",
            "injected_at_s": 6.0,
            "detected_after_s": 0.0,
            "recovered_after_s": 0.8,
            "steps_lost": None,
            "note": "<b>not markup</b>",
        },
    ],
    "events": EVENTS,
    "steps": [[0.5, 0, 10], [0.5, 1, 10], [4.0, 0, 20], [6.0, 1, 30]],
}


def test_a_killed_rank_fails_waits_out_the_guard_and_rejoins() -> None:
    zero, one = lanes(EVENTS, workers=2, end=20.0)
    assert one.segments == [
        Segment(0.0, 2.0, ALIVE),
        Segment(2.0, 2.5, FAILED),
        Segment(2.5, 5.0, GUARD),
        Segment(5.0, 9.0, ALIVE),  # to the job's last event, not to `end`
    ]
    assert one.rejoins == [5.0]
    assert zero.segments == [
        Segment(0.0, 7.0, ALIVE),
        Segment(7.0, 7.5, FAILED),
        Segment(7.5, 9.0, ALIVE),
    ]


def test_a_rank_a_spare_takes_is_alive_again_and_the_old_node_no_longer_moves_it() -> None:
    promoted = [
        {"t": 1.0, "event": "failed", "rank": 2, "node_id": "2", "cause": "stream_broken"},
        {"t": 1.1, "event": "promoted", "rank": 2, "node_id": "s0", "generation": 2},
        {"t": 1.5, "event": "guard_refusal", "node_id": "2", "retry_after_s": 2.0},
        {"t": 4.0, "event": "registered", "node_id": "2", "spare": True},
        {"t": 6.0, "event": "failed", "rank": None, "node_id": "2", "cause": "stream_broken"},
        {"t": 7.0, "event": "failed", "rank": 2, "node_id": "s0", "cause": "stream_broken"},
        {"t": 7.5, "event": "guard_refusal", "node_id": "s0", "retry_after_s": 2.0},
    ]
    rank_2 = lanes(promoted, workers=4, end=10.0)[2]
    assert rank_2.segments == [
        Segment(0.0, 1.0, ALIVE),
        Segment(1.0, 1.1, FAILED),
        Segment(1.1, 7.0, ALIVE),  # the spare's, whatever its old node does meanwhile
        Segment(7.0, 7.5, FAILED),
        Segment(7.5, 10.0, GUARD),  # the spare's own node id, refused by the guard
    ]
    assert rank_2.promotions == [(1.1, "s0")]
    assert rank_2.rejoins == []
    page = Elements()
    page.feed(report_html.render({**REPORT, "workers": 4, "events": promoted}))
    assert len(page.having("path", "promotion")) == 1


def test_the_step_series_is_per_rank_in_time_order() -> None:
    series = step_series([(4.0, 0, 20), (0.5, 0, 10), (0.5, 1, 10), (1.0, 5, 99)], workers=2)
    assert series == [[(0.5, 10), (4.0, 20)], [(0.5, 10)]]


class Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))

    def having(self, tag: str, cls: str) -> list[dict[str, str | None]]:
        return [a for t, a in self.found if t == tag and cls in (a.get("class") or "").split()]


def test_the_page_has_a_lane_per_rank_a_marker_per_fault_and_fetches_nothing() -> None:
    page = report_html.render(REPORT)
    parsed = Elements()
    parsed.feed(page)
    assert [a["data-rank"] for a in parsed.having("g", "lane")] == ["0", "1"]
    assert [(a["data-kind"], a["data-target"]) for a in parsed.having("g", "fault")] == [
        ("kill", "worker 1"),
        ("scheduler", "scheduler"),
    ]
    assert len(parsed.having("rect", "down")) == 1  # the scheduler's lane, while it was killed
    assert len(parsed.having("path", "rejoin")) == 2
    assert len(parsed.having("polyline", "steps")) == 2
    assert len([a for t, a in parsed.found if t == "tr" and "data-fault" in a]) == 2
    assert "&lt;b&gt;not markup&lt;/b&gt;" in page
    # Self-contained: nothing is loaded from anywhere.
    assert not [a for _, a in parsed.found if a.get("src") or a.get("href")]
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
