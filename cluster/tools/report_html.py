"""The chaos report as one self-contained HTML page: `chaos-report.html` beside the JSON.

Everything is inline (CSS, SVG, a few lines of JS); the page fetches nothing. It shows:

- a timeline from the moment the job formed: a lane for the scheduler (down while killed) and
  one per rank (alive, failed, refused by the guard; rejoins and spares' promotions marked),
  from the scheduler's event log, and every fault as a marker with its detection and recovery times;
- the training step over time (each rank's newest checkpoint, as the scheduler saw it);
- the report table.

`render(report)` takes the report as its JSON holds it (`ChaosReport.to_json`).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from cluster.protocol.display import safe
from cluster.tools import timeline

WIDTH = 1000
LEFT = 96  # room for the lane labels
RIGHT = 16
LANE_H = 18
LANE_GAP = 6
AXIS_H = 24
STEPS_H = 220
KIND_COLORS = {"kill": "#b03a2e", "stop": "#7d3c98", "scheduler": "#1f618d", "partition": "#ca6f1e"}
RANK_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
)

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.verdict.ok { color: #1e8449; } .verdict.bad { color: #b03a2e; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
.seg.alive { fill: #58b368; } .seg.failed { fill: #d9534f; } .seg.guard { fill: #f0ad4e; }
.seg.down { fill: #d9534f; } .seg.up { fill: #58b368; }
.rejoin { fill: #2c6fbb; } .promotion { fill: #8e44ad; } .axis line, .grid { stroke: #ddd; }
.fault .at { stroke-width: 1.5; } .fault .detected { stroke-dasharray: 3 2; }
.fault .recovered { stroke-dasharray: 1 2; } .fault.hot line, .fault.hot path { stroke-width: 3; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; border-bottom: 1px solid #ddd; }
th { text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.hot { background: #fdf2d0; } .legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; }
"""

SCRIPT = """
for (const el of document.querySelectorAll('[data-fault]')) {
  const peers = () => document.querySelectorAll('[data-fault="' + el.dataset.fault + '"]');
  el.addEventListener('mouseenter', () => peers().forEach(p => p.classList.add('hot')));
  el.addEventListener('mouseleave', () => peers().forEach(p => p.classList.remove('hot')));
}
document.body.dataset.ready = 'yes';
"""


def _e(value: object) -> str:
    """A value of the report in HTML: control and bidi characters escaped (`safe`), then
    HTML's specials."""
    return html.escape(safe(value), quote=True)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


class _Scale:
    def __init__(self, span_s: float) -> None:
        self.span_s = max(span_s, 1.0)

    def x(self, t: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * min(max(t, 0.0), self.span_s) / self.span_s


def _span(report: Mapping[str, Any]) -> float:
    ends = [0.0]
    for fault in report.get("faults", []):
        ends.append(fault["injected_at_s"] + (fault.get("recovered_after_s") or 0.0))
    ends.extend(float(e["t"]) for e in report.get("events", []))
    ends.extend(float(s[0]) for s in report.get("steps", []))
    return max(ends) * 1.02 + 0.5


def _axis(scale: _Scale, top: float, bottom: float) -> list[str]:
    step = next(s for s in (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1e9) if scale.span_s / s <= 12)
    parts = ['<g class="axis">']
    t = 0.0
    while t <= scale.span_s:
        x = scale.x(t)
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{t:g} s</text>')
        t += step
    parts.append("</g>")
    return parts


def _scheduler_lane(report: Mapping[str, Any], scale: _Scale, y: float) -> list[str]:
    parts = [f'<g class="scheduler-lane"><text x="4" y="{y + 13}">scheduler</text>']
    width = scale.x(timeline.end_of(report.get("events", []), scale.span_s)) - LEFT
    parts.append(f'<rect class="seg up" x="{LEFT}" y="{y}" width="{width:.1f}" height="{LANE_H}"/>')
    for fault in report.get("faults", []):
        if fault["kind"] == "scheduler":
            start = fault["injected_at_s"]
            end = start + (fault.get("recovered_after_s") or 0.0)
            x0, x1 = scale.x(start), scale.x(end)
            who = f"{fault['target']} " if fault.get("took_over") else ""
            after = f", then {fault['took_over']} led" if fault.get("took_over") else ""
            parts.append(
                f'<rect class="seg down" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1.5):.1f}" '
                f'height="{LANE_H}"><title>{_e(who)}down {start:.2f}-{end:.2f} s{_e(after)}'
                "</title></rect>"
            )
    parts.append("</g>")
    return parts


def _rank_lane(lane: timeline.Lane, scale: _Scale, y: float) -> list[str]:
    rank = _e(lane.rank)
    parts = [f'<g class="lane" data-rank="{rank}"><text x="4" y="{y + 13}">rank {rank}</text>']
    for seg in lane.segments:
        x0, x1 = scale.x(seg.start), scale.x(seg.end)
        parts.append(
            f'<rect class="seg {_e(seg.state)}" x="{x0:.1f}" y="{y}" '
            f'width="{max(x1 - x0, 1.0):.1f}" height="{LANE_H}"><title>rank {rank} '
            f"{_e(seg.state)} {seg.start:.2f}-{seg.end:.2f} s</title></rect>"
        )
    for t in lane.rejoins:
        x, mid = scale.x(t), y + LANE_H / 2
        parts.append(
            f'<path class="rejoin" d="M{x:.1f},{y - 2} l6,{mid - y + 2} l-6,{mid - y + 2} '
            f'l-6,-{mid - y + 2} z"><title>rank {rank} rejoined at {t:.2f} s</title></path>'
        )
    for t, spare in lane.promotions:
        x, mid = scale.x(t), y + LANE_H / 2
        parts.append(
            f'<path class="promotion" d="M{x - 6:.1f},{y - 2} h12 l-6,{mid - y + 2} z">'
            f"<title>rank {rank} taken by spare {_e(spare)} at {t:.2f} s</title></path>"
        )
    parts.append("</g>")
    return parts


def _fault(
    number: int, fault: Mapping[str, Any], scale: _Scale, top: float, bottom: float
) -> list[str]:
    at = float(fault["injected_at_s"])
    color = KIND_COLORS.get(str(fault["kind"]), "#333")
    x = scale.x(at)
    detected, recovered = fault.get("detected_after_s"), fault.get("recovered_after_s")
    what = (
        f"#{number} {fault['kind']} {fault['target']} at {at:.2f} s: detected after "
        f"{_seconds(detected)}, recovered after {_seconds(recovered)}"
        + (f"; {fault['took_over']} took over" if fault.get("took_over") else "")
    )
    parts = [
        f'<g class="fault" data-fault="{number}" data-kind="{_e(fault["kind"])}" '
        f'data-target="{_e(fault["target"])}"><title>{_e(what)}</title>',
        f'<path d="M{x - 6:.1f},{top - 12} h12 l-6,9 z" fill="{color}"/>',
        f'<text x="{x:.1f}" y="{top - 15}" text-anchor="middle">{number}</text>',
        f'<line class="at" x1="{x:.1f}" x2="{x:.1f}" y1="{top - 3}" y2="{bottom}" '
        f'stroke="{color}"/>',
    ]
    for name, after in (("detected", detected), ("recovered", recovered)):
        if after is not None and after > 0:
            xa = scale.x(at + float(after))
            parts.append(
                f'<line class="{name}" x1="{xa:.1f}" x2="{xa:.1f}" y1="{top}" y2="{bottom}" '
                f'stroke="{color}"><title>#{number} {name} at {at + float(after):.2f} s'
                "</title></line>"
            )
    parts.append("</g>")
    return parts


def _svg(name: str, height: float) -> str:
    size = f'width="{WIDTH}" height="{height:.0f}"'
    return f'<svg id="{name}" xmlns="http://www.w3.org/2000/svg" {size}>'


def timeline_svg(report: Mapping[str, Any]) -> str:
    workers = int(report.get("workers", 0))
    scale = _Scale(_span(report))
    lanes = timeline.lanes(report.get("events", []), workers, scale.span_s)
    top = 30.0
    bottom = top + (workers + 1) * (LANE_H + LANE_GAP)
    height = bottom + AXIS_H
    parts = [_svg("timeline", height)]
    parts.extend(_axis(scale, top, bottom))
    parts.extend(_scheduler_lane(report, scale, top))
    for lane in lanes:
        parts.extend(_rank_lane(lane, scale, top + (lane.rank + 1) * (LANE_H + LANE_GAP)))
    parts.append('<g class="faults">')
    for number, fault in enumerate(report.get("faults", []), 1):
        parts.extend(_fault(number, fault, scale, top, bottom))
    parts.append("</g></svg>")
    return "\n".join(parts)


def steps_svg(report: Mapping[str, Any]) -> str:
    workers = int(report.get("workers", 0))
    scale = _Scale(_span(report))
    samples = [(float(t), int(r), int(s)) for t, r, s in report.get("steps", [])]
    top, bottom = 10.0, 10.0 + STEPS_H
    highest = max([s for _, _, s in samples] + [1])
    parts = [_svg("steps", bottom + AXIS_H)]
    parts.extend(_axis(scale, top, bottom))
    parts.append(
        f'<text x="4" y="{top + 10}">step {highest}</text><text x="4" y="{bottom}">0</text>'
    )
    for rank, series in enumerate(timeline.step_series(samples, workers)):
        if not series:
            continue
        points: list[str] = []
        for t, step in series:  # a step function: level until the next sample
            y = bottom - (bottom - top) * step / highest
            if points:
                points.append(f"{scale.x(t):.1f},{points[-1].split(',')[1]}")
            points.append(f"{scale.x(t):.1f},{y:.1f}")
        color = RANK_COLORS[rank % len(RANK_COLORS)]
        parts.append(
            f'<polyline class="steps" data-rank="{_e(rank)}" fill="none" stroke="{color}" '
            f'stroke-width="1.5" points="{" ".join(points)}">'
            f"<title>rank {_e(rank)}</title></polyline>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def faults_table(faults: Sequence[Mapping[str, Any]]) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in ("#", "at", "fault", "target", "detected", "recovered", "steps lost", "note")
    )
    rows = []
    for number, f in enumerate(faults, 1):
        lost = "-" if f.get("steps_lost") is None else f["steps_lost"]
        rows.append(
            f'<tr data-fault="{number}"><td class="num">{number}</td>'
            f'<td class="num">{float(f["injected_at_s"]):.1f}s</td><td>{_e(f["kind"])}</td>'
            f'<td>{_e(f["target"])}</td><td class="num">{_seconds(f.get("detected_after_s"))}</td>'
            f'<td class="num">{_seconds(f.get("recovered_after_s"))}</td>'
            f'<td class="num">{_e(lost)}</td><td>{_e(f.get("note", ""))}</td></tr>'
        )
    return (
        f'<table id="faults"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def render(report: Mapping[str, Any]) -> str:
    faults = report.get("faults", [])
    ok = bool(report.get("ok"))
    verdict = "finished correctly" if ok else f"FAILED ({report.get('detail', '')})"
    legend = "".join(
        f'<span><i style="background:{c}"></i>{n}</span>'
        for n, c in (
            ("alive", "#58b368"),
            ("failed / down", "#d9534f"),
            ("refused by the guard", "#f0ad4e"),
            ("rejoined", "#2c6fbb"),
            ("taken by a spare", "#8e44ad"),
        )
    )
    seed = _e(report.get("seed", ""))
    ending = (
        f"exit code {_e(report.get('exit_code'))}, {float(report.get('duration_s', 0.0)):.1f} s"
    )
    kinds = "".join(
        f'<span><i style="background:{c}"></i>{k}</span>' for k, c in KIND_COLORS.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>chaos report (seed {seed})</title><style>{STYLE}</style></head>
<body>
<h1>chaos report: seed {seed}, {len(faults)} faults, {_e(report.get("workers", "?"))} workers</h1>
<p class="verdict {"ok" if ok else "bad"}">the job {_e(verdict)}, {ending}</p>
<h2>Timeline (seconds since the job formed)</h2>
<p class="legend">{legend} &nbsp; faults: {kinds}<br>
after a fault: dashed when detected, dotted when recovered</p>
{timeline_svg(report)}
<h2>Training step (each rank's newest checkpoint)</h2>
{steps_svg(report)}
<h2>Faults</h2>
{faults_table(faults)}
<script>{SCRIPT}</script>
</body></html>
"""
