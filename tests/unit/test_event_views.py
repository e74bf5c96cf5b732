"""Typed views of the events the CLI and the metrics read (cluster.protocol.events), the one
rank convention on the wire (absent, not a sentinel), and a resume from memory as an event
and a line of `mscluster status` (issue 26, "The protocol says what it means")."""

from __future__ import annotations

import json

import pytest

from cluster.protocol.errors import EventFieldError
from cluster.protocol.events import (
    Cause,
    Ended,
    Failed,
    Formed,
    JobEvent,
    Kind,
    LeaderChange,
    MemoryResume,
    Refused,
)
from cluster.protocol.records import NodeFailedEvent
from cluster.scheduler import convert
from cluster.scheduler.events import EventJournal
from cluster.scheduler.machine import events
from cluster.tools.chaos import ChaosReport
from cluster.tools.status import job_view, render
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert as worker_convert
from tests.conftest import FakeClock
from tests.unit.test_events import formed, make_state
from tests.unit.test_worker_core import config


def event(kind: str, **fields: object) -> JobEvent:
    return JobEvent(7, 1_700_000_000.0, kind, fields)


def test_the_views_read_the_fields_the_readers_use() -> None:
    failed = event("failed", rank=2, node_id="2", cause="stream_broken", reason="r", generation=3)
    assert failed.typed() == Failed(2, "2", Cause.STREAM_BROKEN, "r", 3)
    assert event("refused", node_id="x", reason="job_mismatch", message="m").typed() == Refused(
        "job_mismatch", 1, "x"
    )
    assert event("formed", generation=1, nodes=8, seconds=0.25).typed() == Formed(1, 8, 0.25)
    assert event("job_failed", detail="rank 1 died").typed() == Ended(False, "rank 1 died")
    leader = event("leader_change", role="leader", address="h:1", term=2).typed()
    assert isinstance(leader, LeaderChange)
    assert leader.leading


def test_kinds_without_a_view_and_unknown_kinds_have_none() -> None:
    assert event("nodes_back", seconds=1.0).typed() is None
    assert event("from_a_newer_scheduler", x=1).typed() is None


def test_a_cause_this_version_does_not_know_reads_as_other() -> None:
    failed = event("failed", rank=None, node_id="s", cause="eaten_by_a_grue", generation=1)
    assert failed.typed() == Failed(None, "s", Cause.OTHER, "", 1)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rank": "2", "node_id": "2", "cause": "other"}, "rank='2'"),
        ({"rank": True, "node_id": "2", "cause": "other"}, "rank=True"),
        ({"rank": -1, "node_id": "2", "cause": "other"}, "rank=-1"),
        ({"rank": 1, "cause": "other"}, "no field 'node_id'"),
        ({"rank": 1, "node_id": 5, "cause": "other"}, "node_id=5"),
    ],
)
def test_a_field_of_the_wrong_type_names_the_event_and_the_field(
    fields: dict[str, object], named: str
) -> None:
    with pytest.raises(EventFieldError, match="event 7 \\(failed\\)") as caught:
        event("failed", **fields).typed()
    assert named in str(caught.value)


def test_a_role_other_than_leader_or_standby_is_refused() -> None:
    with pytest.raises(EventFieldError, match="role='boss', not leader or standby"):
        event("leader_change", role="boss", address="h:1").typed()


def test_the_line_a_view_reads_is_the_line_written() -> None:
    line = MemoryResume(2, 23, "every survivor finished step 23").record()
    written = JobEvent(1, 1_700_000_000.0, line.kind.value, line.fields).to_json()
    data = json.loads(written)
    assert {k: data[k] for k in ("event", "generation", "step")} == {
        "event": "memory_resume",
        "generation": 2,
        "step": 23,
    }
    assert JobEvent.from_json(written).typed() == MemoryResume(
        2, 23, "every survivor finished step 23"
    )


# -- one rank convention: absent, not a sentinel ----------------------------------------------


def test_a_failed_node_without_a_rank_has_no_rank_on_the_wire_and_in_the_event() -> None:
    st = make_state(FakeClock())
    failed = NodeFailedEvent(None, "spare-1", "its connection to the scheduler broke", 1)
    message = convert.event_to_pb(failed)
    assert not message.node_failed.HasField("rank")
    told = worker_convert.stream_event(message, config(), "0")
    assert isinstance(told, NodeFailedEvent)
    assert told.rank is None
    record = events.of_effect(failed, st)
    assert record is not None
    assert record.fields["rank"] is None
    ranked = convert.event_to_pb(NodeFailedEvent(0, "0", "x", 1))
    assert ranked.node_failed.HasField("rank")
    assert ranked.node_failed.rank == 0


# -- a resume from memory: an event, a metric, a line of status ------------------------------


def test_rank_0s_resume_of_the_current_generation_is_one_event() -> None:
    st = formed(FakeClock())
    journal = EventJournal(st, wall=lambda: 1_700_000_000.0)
    resumed = MemoryResume(st.generation, 23, "every survivor holds step 23")
    journal.memory_resume("1", resumed)  # rank 1: not the one that tells
    journal.memory_resume("0", MemoryResume(st.generation + 1, 23, "x"))  # not this generation
    assert journal.last_memory_resume is None
    journal.memory_resume("0", resumed)
    journal.memory_resume("0", resumed)  # a retried report: no second event
    told = [e for e in journal.history() if e.kind == Kind.MEMORY_RESUME.value]
    assert [e.typed() for e in told] == [resumed]
    assert journal.last_memory_resume == resumed


def test_the_why_is_kept_short() -> None:
    st = formed(FakeClock())
    news = events.of_memory_resume(st, "0", MemoryResume(st.generation, 1, "w" * 10_000), None)
    assert news is not None
    assert len(news.why) == events.WHY_MAX


def test_status_shows_the_last_resume_from_memory() -> None:
    st = formed(FakeClock())
    response = convert.status_to_pb(st, 100.0)
    assert "in memory" not in render(job_view("a:1", response))
    response.memory_resume.CopyFrom(
        convert.memory_resume_to_pb(MemoryResume(2, 23, "every survivor holds step 23"))
    )
    view = job_view("a:1", response)
    assert view.memory_resume == MemoryResume(2, 23, "every survivor holds step 23")
    assert "generation 2 resumed from step 23 in memory (not from disk)" in render(view)
    assert json.loads(view.to_json())["memory_resume"]["step"] == 23


def test_the_report_request_carries_the_resume() -> None:
    request = pb.ReportCheckpointsRequest(node_id="0", incarnation=1, steps=[20])
    assert not request.HasField("resumed")
    request.resumed.CopyFrom(pb.MemoryResume(generation=2, step=23, why="w"))
    assert convert.memory_resume_of(request.resumed) == MemoryResume(2, 23, "w")


def test_the_chaos_report_names_the_resumes_from_memory() -> None:
    report = ChaosReport(seed=1, exit_code=0)
    report.events = [{"t": 3.0, "event": "memory_resume", "generation": 2, "step": 23}]
    assert "resumed from memory (not from disk): generation 2 at step 23" in report.render()
