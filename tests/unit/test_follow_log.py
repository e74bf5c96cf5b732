"""`mscluster events --follow` on a file: every `mscluster run` in a directory appends to its
logs/events.jsonl, and the follow goes on to the end of the job running when it began, past
the ends of the earlier ones."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.protocol.events import JobEvent
from cluster.storage import rotation
from cluster.tools.testing import Process, wait_until
from tests.procs import MSCLUSTER, Procs, reader_env

WAIT_S = 30.0


def line(seq: int, kind: str, **fields: object) -> str:
    return JobEvent(seq, 1_772_366_400.0 + seq, kind, fields).to_json() + "\n"


def follow(processes: Procs, path: Path) -> Process:
    """`mscluster events --follow --json --file PATH`, running."""
    args = [*MSCLUSTER, "events", "--follow", "--json", "--file", str(path)]
    return processes.start("follow", args, reader_env(None))


def shown(followed: Process) -> list[tuple[int, str]]:
    return [(e["seq"], e["event"]) for e in map(json.loads, followed.output.splitlines())]


def test_following_a_log_of_two_runs_follows_the_second_to_its_end(
    tmp_path: Path, processes: Procs
) -> None:
    path = tmp_path / "events.jsonl"
    earlier = [line(1, "started"), line(2, "formed"), line(3, "finished", detail="all done")]
    path.write_text("".join([*earlier, line(4, "started"), line(5, "formed")]))
    followed = follow(processes, path)
    wait_until(
        lambda: '"seq":5' in followed.output or not followed.running, WAIT_S, "seq 5 or the end"
    )
    assert followed.running, followed.output  # the first job's end is history
    with path.open("a") as log:
        log.write(line(6, "job_failed", detail="rank 1 failed"))
    assert followed.wait(WAIT_S) == 0, followed.output
    assert shown(followed) == [
        (1, "started"),
        (2, "formed"),
        (3, "finished"),
        (4, "started"),
        (5, "formed"),
        (6, "job_failed"),
    ]


def test_following_a_log_whose_last_job_ended_in_an_old_file_ends_at_once(
    tmp_path: Path, processes: Procs
) -> None:
    path = tmp_path / "events.jsonl"
    rotation.old_file(path, 1).write_text(line(1, "started") + line(2, "finished", detail="ok"))
    path.write_text(line(3, "nodes_back", seconds=0.1))  # rotated after the job's end
    followed = follow(processes, path)
    assert followed.wait(WAIT_S) == 0, followed.output
    assert shown(followed) == [(1, "started"), (2, "finished")]
