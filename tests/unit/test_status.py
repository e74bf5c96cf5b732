"""cluster.status: the scheduler's answer as a person and a script see it."""

from __future__ import annotations

import dataclasses
import json

from cluster.protocol import version
from cluster.protocol.settings import JobSettings
from cluster.scheduler import convert
from cluster.scheduler.machine.state import NodeRole, Registration, SchedulerState
from cluster.tools.status import job_view, render
from tests.credentials import digest


def formed_job() -> SchedulerState:
    settings = JobSettings(
        2, 0, node_timeout_s=10.0, topo_timeout_s=60.0, heartbeat_interval_s=1.0, recovery=True
    )
    state = SchedulerState("job-1", settings, lambda: 100.0)
    for i in range(2):
        state.register(
            Registration(
                str(i),
                NodeRole.WORKER,
                "h0",
                6000 + i,
                1,
                2,
                0,
                protocol_revision=version.PROTOCOL_REVISION,
                credential_digest=digest(str(i), 1),
            )
        )
    return state


def test_status_shows_generation_recovery_incarnations_restarts_and_checkpoints() -> None:
    state = formed_job()
    for node_id in ("0", "1"):
        state.report_checkpoints(node_id, 1, [10, 20, 30, 40])
    state.disconnect("1", 1)
    state.clock = lambda: 111.0
    state.register(
        Registration(
            "1",
            NodeRole.WORKER,
            "h0",
            7001,
            2,
            2,
            0,
            "job-1",
            protocol_revision=version.PROTOCOL_REVISION,
            credential_digest=digest("1", 2),
        )
    )
    view = job_view("127.0.0.1:8118", convert.status_to_pb(state, 111.0))
    assert (view.generation, view.recovery, view.rollback_step) == (2, True, 40)
    assert [(n.rank, n.incarnation, n.restarts) for n in view.nodes] == [(0, 1, 0), (1, 2, 1)]
    assert view.nodes[0].checkpoints == (10, 20, 30, 40)
    table = render(view)
    assert "generation 2" in table
    assert "recovery on" in table
    assert "rollback step 40" in table
    assert "..., 20, 30, 40" in table
    assert json.loads(view.to_json())["nodes"][1]["restarts"] == 1


def test_failing_saves_are_shown_with_their_cause_and_duration() -> None:
    response = convert.status_to_pb(formed_job(), 100.0)
    response.saving.error = "cannot save the recovery state to /r/scheduler.json (No space left)"
    response.saving.failing_for_s = 12.4
    response.saving.failures = 7
    response.saving.unsaved_changes = 2
    view = job_view("127.0.0.1:8118", response)
    table = render(view)
    assert "SAVES FAILING for 12 s (7 attempts)" in table
    assert "/r/scheduler.json (No space left)" in table
    assert "2 changes not saved" in table
    data = json.loads(view.to_json())
    assert (data["save_failures"], data["unsaved_changes"]) == (7, 2)
    assert "not saved" not in render(job_view("a:1", convert.status_to_pb(formed_job(), 100.0)))


def test_status_shows_the_spares_and_does_not_count_them_as_registered() -> None:
    state = formed_job()
    spare = Registration(
        "spare-0",
        NodeRole.WORKER,
        "h0",
        7000,
        1,
        2,
        0,
        protocol_revision=version.PROTOCOL_REVISION,
        credential_digest=digest("spare-0", 1),
    )
    state.register(dataclasses.replace(spare, spare=True))
    view = job_view("127.0.0.1:8118", convert.status_to_pb(state, 100.0))
    assert (view.registered, view.spares) == (2, 1)
    assert view.is_spare("spare-0") is True
    assert view.is_spare("0") is False
    assert view.is_spare("nobody") is None
    table = render(view)
    assert "2/2 registered, 1 spares" in table
    row = next(line for line in table.splitlines() if "spare-0" in line)
    assert row.split()[:3] == ["-", "spare-0", "worker"]
    assert "(spare)" in row
    state.disconnect("1", 1)  # the spare takes rank 1; node 1 waits out its guard as a spare
    view = job_view("127.0.0.1:8118", convert.status_to_pb(state, 100.0))
    assert view.rank_of("spare-0") == 1
    assert (view.is_spare("1"), view.spares) == (True, 0)
