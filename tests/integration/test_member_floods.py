"""A member that runs away, with its own valid credential, against a real scheduler: its
concurrent large calls are refused past its share and it is named; its Heartbeat streams are
one (the newest), and its beats are taken at most once a fraction of the interval; its
checkpoint reports are saved at most once a turn. Meanwhile another rank's barriers complete,
and the job ends well."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from cluster.testing import Process, free_port
from tests.integration.test_hostile import START_S, env_for, start_scheduler, start_worker
from tests.procs import ROOT, Procs

FLOOD = ROOT / "tests" / "integration" / "scripts" / "member_flood.py"
SECONDS = 4.0
# A member's turn for a report that changes what it holds (`member_limits.REPORT_EVERY_S`).
TURN_S = 0.1


def run_flood(
    processes: Procs, tmp_path: Path, args: list[str], **extra: str
) -> tuple[Process, list[Process]]:
    """A recovered job of member_flood.py whose rank 0 floods for SECONDS; returns once every
    rank passed its barriers and printed what it saw (the job then ends)."""
    env = env_for(
        free_port(),
        tmp_path,
        None,
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(tmp_path / "recovery"),
        **extra,
    )
    sched = start_scheduler(processes, env)
    script = [str(FLOOD), "--seconds", str(SECONDS), *args]
    workers = [start_worker(processes, i, env, script) for i in range(2)]
    for rank, worker in enumerate(workers):
        # Another member's barriers complete while rank 0 floods.
        worker.wait_for_output(f"barriers done rank={rank}", START_S * 2)
    workers[0].wait_for_output("flood codes=", START_S * 2)
    return sched, workers


def ends_well(sched: Process, workers: list[Process]) -> None:
    for rank, worker in enumerate(workers):
        assert worker.wait(START_S) == 0, worker.output
        assert f"done rank={rank}" in worker.output
        assert "Traceback" not in worker.output
    assert sched.wait(START_S) == 0, sched.output
    assert "job finished: all 2 nodes finished" in sched.output


def codes(worker: Process) -> dict[str, int]:
    found = re.search(r"flood codes=(\{.*\})", worker.output)
    assert found, worker.output
    return {k: int(v) for k, v in re.findall(r"'([^']+)': (\d+)", found.group(1))}


def test_a_members_concurrent_large_calls_are_refused_past_its_share_and_named(
    processes: Procs, tmp_path: Path
) -> None:
    """64 threads of rank 0 set 2 MiB values at once through cluster.kv_store() (two keys:
    inside its key-value share): past its share of request bytes in flight the scheduler
    refuses them, naming the node, its share and what to do; rank 1's barriers complete."""
    sched, workers = run_flood(processes, tmp_path, ["--kv-threads", "64"])
    seen = codes(workers[0])
    assert seen.get("CapacityError", 0) > 0, workers[0].output
    assert seen.get("OK", 0) > 0, workers[0].output  # the member's share still goes through
    refusal = re.search(r"flood first CapacityError: (.*)", workers[0].output)
    assert refusal, workers[0].output
    for words in ("node '0'", "a member's share is", "bytes", "wait for its calls"):
        assert words in refusal.group(1), refusal.group(1)
    assert re.search(r"node '0' past its bounds \(member_(bytes|calls)\)", sched.output)
    ends_well(sched, workers)


def test_heartbeat_streams_of_a_node_are_one_and_its_beats_are_bounded(
    processes: Procs, tmp_path: Path
) -> None:
    """16 Heartbeat streams of rank 0, each beating as fast as it can: each newer one ends the
    older (which ends OK), the extra beats are dropped and the node is named."""
    sched, workers = run_flood(processes, tmp_path, ["--beats", "16"])
    seen = codes(workers[0])
    assert seen.get("ended early", 0) >= 15, workers[0].output  # superseded while beating
    assert "node '0' past its bounds (beats_dropped)" in sched.output
    ends_well(sched, workers)


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, text[:2000]
    return float(found.group(1))


def test_a_members_changing_checkpoint_reports_are_saved_at_most_once_a_turn(
    processes: Procs, tmp_path: Path
) -> None:
    """16 at once, reports of 1,024 steps that change what rank 0 holds at every call: each
    waits for the member's turn, the newest wins; the saves of the state stay at about one a
    turn, not one a report."""
    metrics, go = free_port(), tmp_path / "go"
    sched, workers = run_flood(
        processes, tmp_path, ["--reports", "16", "--go", str(go)], CLUSTER_METRICS_PORT=str(metrics)
    )
    try:  # the scheduler's metrics, read before the job ends
        saves = scrape(metrics, "cluster_state_saves_total")
    finally:
        go.touch()
    reports = codes(workers[0]).get("OK", 0)
    turns = SECONDS / TURN_S
    print(f"REPORTS reports={reports} saves={saves:g} turns={turns:g}")
    assert reports > 2 * turns, workers[0].output  # the flood went on all along
    assert saves < turns + 40  # a turn's saves, and the job's own (formation, ...)
    assert "node '0' past its bounds (reports_coalesced)" in sched.output
    ends_well(sched, workers)
