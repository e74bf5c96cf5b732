"""What a chaos run records for its picture (`cluster.tools.report_html`), beside the faults.

- `StepSampler`: a thread that asks the scheduler for the job's status a few times a second and
  keeps each rank's newest checkpoint step when it changes: the training step over time.
- `load_events`: the scheduler's event log of the run (CLUSTER_EVENT_LOG, set for the job), with
  each event's time made relative to the moment the job formed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from cluster.protocol.events import JobEvent
from cluster.storage import rotation
from cluster.tools.testing import LocalJob

SAMPLE_EVERY_S = 0.25
EVENT_LOG = "events.jsonl"


class StepSampler:
    """Samples `job`'s checkpoint steps from `started_at` (wall clock) until `stop()`."""

    def __init__(self, job: LocalJob, started_at: float, every_s: float = SAMPLE_EVERY_S) -> None:
        self.job = job
        self.started_at = started_at
        self.every_s = every_s
        self.samples: list[list[float]] = []  # [t, rank, step]
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-steps", daemon=True)

    def start(self) -> StepSampler:
        self.job.status()  # makes the status client here, not on two threads at once
        self._thread.start()
        return self

    def stop(self) -> list[list[float]]:
        self._stop.set()
        self._thread.join(10.0)
        return self.samples

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            view = self.job.status()
            if view is None:
                continue
            t = round(time.time() - self.started_at, 3)
            for node in view.nodes:
                if node.rank is None or not node.checkpoints:
                    continue
                step = int(node.checkpoints[-1])
                if self._last.get(node.rank) != step:
                    self._last[node.rank] = step
                    self.samples.append([t, node.rank, step])


def load_events(path: Path, started_at: float) -> list[dict[str, Any]]:
    """The events in `path` (its rotated old files first), each as {"t": seconds since
    `started_at`, "event": kind, ...}."""
    lines = []
    for where in rotation.in_order(path):
        try:
            lines.extend(where.read_text(errors="replace").splitlines())
        except OSError:
            continue
    found = []
    for line in lines:
        try:
            event = JobEvent.from_json(line)
            event.typed()  # the fields the report reads, checked (EventFieldError: skipped)
        except ValueError:
            continue
        found.append(
            {"t": round(event.time - started_at, 3), "event": event.kind, **dict(event.fields)}
        )
    return found
