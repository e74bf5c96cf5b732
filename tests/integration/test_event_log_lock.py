"""One scheduler writes an event log at a time (CLUSTER_EVENT_LOG, `event_file.EventLogLock`),
with real `mscluster scheduler` processes: another job's is refused at start in one line naming
the holder; one started again after a SIGKILL numbers on; standbys of one job on etcd share
the file, the one that leads writing it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.scheduler import event_file
from cluster.scheduler.event_file import START_WAIT_S, EventLogLock
from cluster.storage import holder_lock
from cluster.testing import Process, free_port, wait_until
from tests.integration.test_standby import Schedulers, register
from tests.procs import PYTHON, Procs, job_env
from tests.servers.etcd import EtcdCluster


def _numbers(log: Path) -> list[int]:
    return [json.loads(line)["seq"] for line in log.read_text().splitlines()]


def _kinds(log: Path) -> list[str]:
    return [json.loads(line)["event"] for line in log.read_text().splitlines()]


def _refused(env: dict[str, str], *args: str) -> str:
    """The line a scheduler refused at start exits with (2), after the one that said it waited
    (START_WAIT_S) for the holder to end."""
    done = subprocess.run(
        [PYTHON, "-m", "cluster", "scheduler", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, done.stderr
    assert f"waiting up to {START_WAIT_S:g} s for it to end" in lines[0]
    assert "Traceback" not in done.stderr
    return lines[1]


def _scheduler(processes: Procs, name: str, log: Path) -> Process:
    env = job_env(2, free_port(), MS_ROLE="MS_SCHED", CLUSTER_EVENT_LOG=str(log))
    proc = processes.start(name, [PYTHON, "-m", "cluster", "scheduler"], env)
    proc.wait_for_output("listening on", 60)
    return proc


def test_a_second_jobs_scheduler_on_the_event_log_is_refused_and_a_restart_numbers_on(
    processes: Procs, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    first = _scheduler(processes, "first", log)
    wait_until(lambda: log.exists() and _kinds(log) == ["started"], 30, "first's start event")
    env = job_env(2, free_port(), MS_ROLE="MS_SCHED", CLUSTER_EVENT_LOG=str(log))
    line = _refused(env)
    assert f"CLUSTER_EVENT_LOG={str(log)!r} is written by another scheduler" in line
    assert f"(pid {first.pid} on this host, without a state store)" in line
    assert "give each job its own event log" in line
    assert _kinds(log) == ["started"]  # nothing of the refused one's
    first.signal(signal.SIGKILL)
    first.wait(30)
    _scheduler(processes, "again", log)
    wait_until(lambda: len(_kinds(log)) == 2, 30, "the restarted one's start event")
    assert _numbers(log) == [1, 2]


def test_standbys_of_one_job_share_the_event_log_and_the_leader_writes_it(
    processes: Procs, etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """The standby is not refused at start (it holds nothing); once the leader is SIGKILLed it
    leads and writes the job's events, numbered on; another job's scheduler is refused."""
    log = tmp_path / "events.jsonl"
    schedulers = Schedulers(processes, etcd_cluster, more=("--event-log", str(log)))
    leader = schedulers.leader()
    register(schedulers.address(leader), "0")
    wait_until(lambda: "leader_change" in _kinds(log), 30, "the leader's event")
    env = job_env(2, free_port(), MS_ROLE="MS_SCHED", CLUSTER_EVENT_LOG=str(log))
    line = _refused(env)
    assert f"for the job in {schedulers.url.rstrip('/')}" in line
    assert f"pid {schedulers.procs[leader].pid} on this host" in line
    before = len(_kinds(log))
    schedulers.procs[leader].signal(signal.SIGKILL)
    schedulers.procs[leader].wait(30)
    (standby,) = [host for host in schedulers.procs if host != leader]
    wait_until(lambda: schedulers.role(standby) == "leader", 60, "the standby to lead")
    wait_until(lambda: len(_kinds(log)) > before, 30, "the new leader's events")
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    taken = [e for e in events[before:] if e["event"] == "leader_change"]
    assert taken, events[before:]
    assert taken[0]["address"] == schedulers.address(standby)
    assert "Traceback" not in schedulers.procs[standby].output


def test_a_scheduler_whose_lock_file_was_removed_locks_a_new_one_that_keeps_others_out(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FILE.lock removed while the scheduler writes the log (by hand, with the log's other
    files): within a check it says so and locks the file there anew, so that another job's
    scheduler is refused, naming it, as before."""
    log = tmp_path / "events.jsonl"
    first = _scheduler(processes, "first", log)
    wait_until(lambda: log.exists() and _kinds(log) == ["started"], 30, "first's start event")
    holder_lock.lock_path(log).unlink()
    first.wait_for_output("locked the file there anew", 15)
    assert "was removed or replaced while this scheduler held it, so its lock kept" in first.output
    monkeypatch.setattr(event_file, "START_WAIT_S", 0.0)
    with pytest.raises(ConfigError, match=rf"another scheduler \(pid {first.pid} on this host"):
        EventLogLock(log).claim()


def test_a_scheduler_whose_lock_file_another_took_writes_nothing_more_there(
    processes: Procs, tmp_path: Path
) -> None:
    """The file removed while the scheduler was stopped, and locked anew by another job's
    scheduler before it looked: it says in one line who holds the log now, and writes none of
    its events there from then on (they would interleave with the other's)."""
    log, port = tmp_path / "events.jsonl", free_port()
    env = job_env(2, port, MS_ROLE="MS_SCHED", CLUSTER_EVENT_LOG=str(log))
    first = processes.start("first", [PYTHON, "-m", "cluster", "scheduler"], env)
    first.wait_for_output("listening on", 60)
    wait_until(lambda: log.exists() and _kinds(log) == ["started"], 30, "first's start event")
    first.signal(signal.SIGSTOP)
    wait_until(first.stopped, 10, "the scheduler to stop")
    holder_lock.lock_path(log).unlink()
    other = EventLogLock(log)
    try:
        other.claim()  # nothing of the first's to see
        assert other.held
        first.signal(signal.SIGCONT)
        register(f"127.0.0.1:{port}", "0")  # an event the first would write
        first.wait_for_output("has locked the file there since", 15)
        assert (
            f"another scheduler (pid {os.getpid()} on this host, without a state store) has "
            "locked the file there since: this scheduler's events are not written to "
        ) in first.output
        register(f"127.0.0.1:{port}", "1")
        assert _kinds(log) == ["started"]  # none of the first's since
        assert first.running
    finally:
        other.release()
