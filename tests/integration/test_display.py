"""Every byte shown to a person is safe: `mscluster events` and `mscluster status` on hostile
values print no byte a terminal obeys.

An outsider chooses the node id of a refused registration (kept in the event log and served on
WatchEvents) and, in an open job, the host a node registers with (shown by Status). Here they
hold a screen clear (ESC[2J), a window title (OSC 0 ... BEL), a newline that would forge a
"finished" row, C1 controls and a right-to-left override. The scheduler is a fake one (a plain
gRPC server in the test) that serves them as they are, so that the display is tested whatever
the scheduler's edge lets through; the real commands run as processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.protocol.events import JobEvent
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.procs import PYTHON, ROOT

RUN_S = 60.0
FORGED_ROW = "\n12:00:00.000  finished"
HOSTILE = "evil\x1b[2J\x1b]0;pwned\x07" + FORGED_ROW + "\x9b31m\u202etxt.exe\u2066\x7f\r\x00"
# What no line of output may hold: C0 (but the newline that ends a line), DEL, C1, bidi.
FORBIDDEN = (
    {chr(c) for c in range(0x20)} - {"\n"}
    | {"\x7f"}
    | {chr(c) for c in range(0x80, 0xA0)}
    | {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x61C)}
)


def assert_safe(output: str) -> None:
    bad = sorted({f"U+{ord(c):04X}" for c in output if c in FORBIDDEN})
    assert not bad, f"raw control or bidi characters reached the person: {bad}\n{output!r}"
    assert "pwned" in output  # shown, escaped, not hidden
    assert "\\x1b[2J" in output
    assert "\\u202e" in output
    forged = [line for line in output.split("\n") if line.startswith("12:00:00.000  finished")]
    assert not forged


def mscluster(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "cluster", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="surrogateescape",
        timeout=RUN_S,
        cwd=ROOT,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def hostile_events() -> list[JobEvent]:
    now = time.time()
    return [
        JobEvent(1, now, "started", {"cluster_id": "job-1", "worker_num": 1}),
        JobEvent(
            2,
            now + 0.1,
            "refused",
            {"node_id": HOSTILE, "reason": "invalid_node_id", "message": HOSTILE},
        ),
        JobEvent(3, now + 0.2, "registered\x1b[2J", {"node_id": "0", HOSTILE: HOSTILE}),
        JobEvent(4, now + 0.3, "finished", {"detail": HOSTILE}),
    ]


class FakeScheduler(pb_grpc.SchedulerServicer):
    """Answers Status and WatchEvents with the hostile values, as a careless scheduler would."""

    def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        node = pb.NodeStatus(
            node_id=HOSTILE, role=pb.ROLE_WORKER, rank=0, host=HOSTILE, port=1, state=99
        )  # a state this version does not know: shown as "?"
        return pb.StatusResponse(
            cluster_id=HOSTILE,
            phase=pb.PHASE_FINISHED,
            generation=1,
            worker_num=1,
            nodes=[node],
            detail=HOSTILE,
            saving=pb.StateSaving(error=HOSTILE),
        )

    def WatchEvents(self, request: pb.WatchEventsRequest, context: Any) -> Iterator[pb.JobEvent]:
        for event in hostile_events():
            yield pb.JobEvent(
                seq=event.seq,
                time=event.time,
                event=event.kind,
                fields_json=json.dumps(dict(event.fields)),
            )


@pytest.fixture(scope="module")
def fake_scheduler() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SchedulerServicer_to_server(FakeScheduler(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_events_file_with_escapes_in_ids_prints_none_of_them(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text("".join(f"{e.to_json()}\n" for e in hostile_events()), encoding="utf-8")
    shown = mscluster("events", "--file", str(log))
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout + shown.stderr)
    assert len(shown.stdout.splitlines()) == 5  # the header and one line per event


def test_events_file_written_raw_by_another_writer_prints_none_of_them(tmp_path: Path) -> None:
    """A log whose JSON holds the characters themselves (json.dumps(ensure_ascii=False))."""
    log = tmp_path / "events.jsonl"
    lines = [
        json.dumps(
            {"time": "2026-03-01T12:00:01.000+00:00", "seq": e.seq, "event": e.kind, **e.fields},
            ensure_ascii=False,
        )
        for e in hostile_events()
    ]
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    shown = mscluster("events", "--file", str(log))
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout + shown.stderr)


def test_events_from_the_scheduler_print_none_of_them(fake_scheduler: str) -> None:
    shown = mscluster("events", "--addr", fake_scheduler)
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout + shown.stderr)
    as_json = mscluster("events", "--addr", fake_scheduler, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert not any(c in FORBIDDEN for c in as_json.stdout)
    assert json.loads(as_json.stdout.splitlines()[1])["node_id"] == HOSTILE  # exact, escaped


def test_status_with_escapes_in_its_host_prints_none_of_them(fake_scheduler: str) -> None:
    shown = mscluster("status", "--addr", fake_scheduler)
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout + shown.stderr)
    as_json = mscluster("status", "--addr", fake_scheduler, "--json")
    assert not any(c in FORBIDDEN for c in as_json.stdout)


def test_status_without_addr_asks_the_scheduler_the_environment_names(
    fake_scheduler: str,
) -> None:
    host, port = fake_scheduler.rsplit(":", 1)
    shown = mscluster("status", "--json", env={"MS_SCHED_HOST": host, "MS_SCHED_PORT": port})
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["phase"] == "finished"


def test_status_watch_with_escapes_prints_none_of_them(fake_scheduler: str) -> None:
    shown = mscluster("status", "--addr", fake_scheduler, "--watch", "--interval", "0.2")
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout + shown.stderr)
