"""cluster.tools.launch_reading: the launcher's fresh read when a worker has failed, against a
real in-process scheduler with a job secret, and what `launch_policy` decides from it. A
scheduler that none reaches is gone; one that refuses the read is up, and a recovering job
takes the worker back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cluster.protocol.events import JobEvent
from cluster.protocol.records import Phase
from cluster.scheduler import SchedulerServer
from cluster.testing import free_port
from cluster.tools import launch_policy as policy
from cluster.tools.launch_reading import FRESH_TRIES, Fresh, JobReader, job_ended, job_seen
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
