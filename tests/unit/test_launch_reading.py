"""cluster.tools.launch_reading: the launcher's fresh read when a worker has failed, against a
real in-process scheduler with a job secret, and what `launch_policy` decides from it. A
scheduler that none reaches is gone; one that refuses the read is up, and a recovering job
takes the worker back."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from cluster.protocol.events import JobEvent
from cluster.protocol.records import Phase
from cluster.scheduler import SchedulerServer
from cluster.storage import rotation
from cluster.testing import free_port
from cluster.tools import launch_policy as policy
from cluster.tools import launch_reading
from cluster.tools.launch_reading import (
    FRESH_TRIES,
    LOG_END_BYTES,
    Fresh,
    JobReader,
    job_ended,
    job_seen,
    without_rank_at_end,
)
from cluster.tools.status import JobView
from tests.unit.test_readers import SECRET, closed, secret_in

RECOVERING = policy.JobSeen(Phase.READY, recovery=True)


def decided(fresh: Fresh) -> policy.Decision:
    """What the launcher of a formed job with recovery decides on a killed worker, given
    `fresh` (as `Launcher._seen` puts it)."""
    return policy.decide(
        policy.Seen(
            (policy.WorkerSeen(0, None), policy.WorkerSeen(1, -9)),
            max_restarts=2,
            own_scheduler=True,
            recovery=True,
            last=RECOVERING,
            now=job_seen(fresh.view),
            unreachable=fresh.unreachable,
            unread=fresh.unread,
        )
    )


async def test_a_refused_fresh_read_is_asked_again_then_decided_as_a_scheduler_that_is_up(
    tmp_path: Path,
) -> None:
    right = secret_in(tmp_path / "right" / "job.secret", SECRET.decode())
    wrong = secret_in(tmp_path / "wrong" / "job.secret", "not the job's secret")
    async with SchedulerServer(closed()) as server:
        addresses = [f"127.0.0.1:{server.port}"]
        answered = await JobReader(addresses, None, right).fresh()
        assert answered.view is not None
        assert answered.view.phase is Phase.WAITING
        refused = await JobReader(addresses, None, wrong).fresh()
    assert refused.view is None
    assert refused.unreachable == ""
    assert "refused the proof" in refused.unread, refused.unread
    assert refused.unread.endswith(f"({FRESH_TRIES} tries)"), refused.unread
    assert decided(refused) == policy.Decision(policy.Action.RESTART, 1)


async def test_only_a_scheduler_that_none_reaches_is_gone(tmp_path: Path) -> None:
    right = secret_in(tmp_path / "job.secret", SECRET.decode())
    gone = await JobReader([f"127.0.0.1:{free_port()}"], None, right).fresh()
    assert gone.view is None
    assert gone.unread == ""
    assert "no scheduler answers" in gone.unreachable, gone.unreachable
    decision = decided(gone)
    assert decision.action is policy.Action.FAIL
    assert "its scheduler is gone" in decision.reason


def event_log(path: Path, *kinds: str) -> Path:
    """An event log holding one event of each of `kinds`, in order (with a line cut short)."""
    lines = [JobEvent(seq, 1.7e9 + seq, kind, {}).to_json() for seq, kind in enumerate(kinds, 1)]
    path.write_text("".join(f"{line}\n" for line in lines) + '{"seq": 9, "ti')
    return path


def test_the_jobs_end_is_seen_in_the_event_log_of_its_last_run(tmp_path: Path) -> None:
    """A scheduler that exited 0 ended the job when its event log's last job ended (`finished`,
    `job_failed`), whatever the last answer said; otherwise it left the job to resume."""
    log = tmp_path / "events.jsonl"
    assert not job_ended(None, log)  # no log yet
    assert job_ended(None, event_log(log, "started", "formed", "finished"))
    assert job_ended(None, event_log(log, "started", "failed", "job_failed", "refused"))
    assert not job_ended(None, event_log(log, "started", "formed", "generation"))
    # An earlier run in the same directory ended: this one, begun since, did not.
    assert not job_ended(None, event_log(log, "started", "finished", "started", "formed"))
    assert not job_ended(None, event_log(log, "started", "finished", "resumed"))
    # The newest events are in the file, the older ones rotated away.
    old = event_log(tmp_path / "events.jsonl.1", "started", "formed")
    assert job_ended(None, event_log(log, "finished"))
    assert not job_ended(None, event_log(log, "refused"))
    old.unlink()


def test_the_jobs_end_is_seen_in_the_last_answer(tmp_path: Path) -> None:
    view = JobView("127.0.0.1:1", "job", Phase.FINISHED, 1, 1, 0, 1, True, 1.0, "", ())
    assert job_ended(view, None)
    assert not job_ended(dataclasses.replace(view, phase=Phase.READY), None)


def line(seq: int, kind: str, **fields: object) -> str:
    return JobEvent(seq, 1.7e9 + seq, kind, fields).to_json() + "\n"


def registrations(first: int, count: int) -> list[str]:
    """`count` nodes registering (a 600-node job's take over 64 KiB of the log)."""
    return [
        line(first + i, "registered", node_id=f"node-{i:05d}", rank=i, host="10.0.0.1")
        for i in range(count)
    ]


def test_a_job_begun_further_back_than_a_log_end_is_read_back_to_its_beginning(
    tmp_path: Path,
) -> None:
    """A scheduler left to resume (no end) after 600 registrations: the earlier run's end in
    the rotated file is history, not this job's."""
    log = tmp_path / "events.jsonl"
    earlier = line(1, "started") + line(2, "formed") + line(3, "finished", detail="all done")
    rotation.old_file(log, 1).write_text(earlier)
    running = [line(1, "started"), *registrations(2, 600), line(602, "formed", generation=1)]
    log.write_text("".join(running))
    assert log.stat().st_size > LOG_END_BYTES
    assert not job_ended(None, log)
    with log.open("a") as appended:  # the same job's end, in the current file
        appended.write(line(603, "finished", detail="all 600 nodes finished"))
    assert job_ended(None, log)


def test_a_jobs_end_and_beginning_in_a_rotated_file_are_read(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    rotation.old_file(log, 2).write_text(line(1, "started") + line(2, "finished"))
    begun = [line(1, "started"), *registrations(2, 600)]
    # The job ended in the file since rotated; only a late refusal came after.
    rotation.old_file(log, 1).write_text("".join([*begun, line(602, "job_failed", detail="x")]))
    log.write_text(line(603, "refused", reason="the job is over"))
    assert job_ended(None, log)
    # Begun in the rotated file, running on in the current one (over 64 KiB): no end.
    rotation.old_file(log, 1).write_text("".join(begun))
    generations = [line(602 + g, "generation", generation=g, step=g) for g in range(1000)]
    log.write_text("".join(generations))
    assert log.stat().st_size > LOG_END_BYTES
    assert not job_ended(None, log)


def test_who_holds_no_rank_at_the_end_is_read_from_the_last_job_in_the_log(
    tmp_path: Path,
) -> None:
    """Each node's newest event decides: a spare never promoted holds no rank, nor a node whose
    rank a newer promotion gave to a spare; a promoted spare and a node back at its own rank
    hold one. An earlier job in the same log (before `started`) is not this job's."""
    log = tmp_path / "events.jsonl"
    assert without_rank_at_end(None) == {}
    assert without_rank_at_end(log) == {}  # no log yet
    earlier = [line(1, "started"), line(2, "registered", node_id="old", spare=True)]
    job = [
        line(3, "started"),
        *(line(4 + i, "registered", node_id=n) for i, n in enumerate(("0", "1", "2"))),
        line(7, "registered", node_id="spare-0", spare=True),
        line(8, "registered", node_id="spare-1", spare=True),
        line(9, "formed", generation=1, nodes=3),
        line(10, "failed", rank=1, node_id="1"),
        line(11, "promoted", node_id="spare-0", rank=1),
        line(12, "failed", rank=2, node_id="2"),
        line(13, "rejoined", rank=2, node_id="2"),
        line(14, "failed", rank=1, node_id="spare-0"),
        line(15, "promoted", node_id="spare-1", rank=1),
        line(16, "finished", detail="all 3 nodes finished"),
    ]
    log.write_text("".join(earlier + job))
    expected = {"0": False, "1": True, "2": False, "spare-0": True, "spare-1": False}
    assert without_rank_at_end(log) == expected
    # Node 1 started again registers as a spare (or is refused): it still holds no rank.
    log.write_text("".join([*earlier, *job[:-1], line(17, "registered", node_id="1", spare=True)]))
    assert without_rank_at_end(log) == expected
    # The job began in the rotated file, over a log end's worth of registrations before.
    rotation.old_file(log, 1).write_text("".join([*job[:7], *registrations(100, 600)]))
    log.write_text("".join(job[7:]))
    assert log.stat().st_size < LOG_END_BYTES < rotation.old_file(log, 1).stat().st_size
    assert without_rank_at_end(log) == {
        **expected,
        **{f"node-{i:05d}": False for i in range(600)},
    }


def test_a_damaged_line_is_skipped(tmp_path: Path) -> None:
    """A torn line (a write a full disk cut off) and bytes that are no text are not events,
    whatever words they hold."""
    log = tmp_path / "events.jsonl"
    torn_end = line(3, "finished", detail="done")[:-20]
    torn_start = line(5, "resumed")[:-5]
    log.write_bytes(
        (line(1, "started") + line(2, "formed") + f"{torn_end}\n").encode()
        + b"\xff\xfe finished \x00\n"
        + "".join(registrations(4, 600)).encode()
    )
    assert not job_ended(None, log)
    rows = [line(1, "started"), line(2, "finished"), f"{torn_start}\n", line(6, "refused")]
    log.write_text("".join(rows))
    assert job_ended(None, log)


def test_a_line_longer_than_its_bound_is_skipped_and_the_rest_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch_reading, "EVENT_LINE_MAX_BYTES", 300)
    monkeypatch.setattr(launch_reading, "LOG_END_BYTES", 64)
    log = tmp_path / "events.jsonl"
    long_end = line(3, "finished", detail="x" * 1000)
    log.write_text(line(1, "started") + line(2, "formed") + long_end + line(4, "refused"))
    assert not job_ended(None, log)  # the end is too long to be read: `started` is the last
    log.write_text(line(1, "finished") + long_end + line(4, "started") + line(5, "finished"))
    assert job_ended(None, log)
    log.write_text(long_end + line(4, "refused"))
    assert not job_ended(None, log)


def test_an_unreadable_file_ends_the_read_back(tmp_path: Path) -> None:
    """An older file does not speak for a newer one that cannot be read."""
    log = tmp_path / "events.jsonl"
    rotation.old_file(log, 2).write_text(line(1, "started") + line(2, "finished"))
    rotation.old_file(log, 1).mkdir()
    log.write_text(line(3, "formed"))
    assert not job_ended(None, log)


@pytest.mark.parametrize("piece", [1, 7, 64, 4096])
def test_reading_back_in_pieces_finds_what_reading_forward_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """Logs of random events and damaged lines, read back `piece` bytes at a time: the answer is
    whether an end follows the last beginning, as read from the start."""
    monkeypatch.setattr(launch_reading, "LOG_END_BYTES", piece)
    rng = random.Random(piece)
    kinds = ["started", "resumed", "finished", "job_failed", "formed", "registered", "refused"]
    log = tmp_path / "events.jsonl"
    for _ in range(200):
        rows = []
        for seq in range(rng.randrange(0, 12)):
            row = line(seq, rng.choice(kinds), node_id="n" * rng.randrange(0, 90))
            rows.append(row[: rng.randrange(1, len(row))] + "\n" if rng.random() < 0.1 else row)
        log.write_text("".join(rows))
        expected = False
        for row in rows:
            try:
                kind = JobEvent.from_json(row).kind
            except ValueError:
                continue
            if kind in ("started", "resumed"):
                expected = False
            elif kind in ("finished", "job_failed"):
                expected = True
        assert job_ended(None, log) == expected, rows
