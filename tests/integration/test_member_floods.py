"""A member that runs away, with its own valid credential, against a real scheduler: its
concurrent large calls are refused past its share and it is named, and what the scheduler holds
of them goes with each call; its Heartbeat streams are
one (the newest), its beats are taken at most once a fraction of the interval, and its stream
opens at most at their rate (the others refused and it is named); its checkpoint reports are
saved at most once a turn. Meanwhile another rank's barriers complete, and the job ends well."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cluster.scheduler.machine.member_bounds import OPEN_EVERY_S, OPEN_HOLD_S, OPENS_BURST
from cluster.testing import Process, free_port
from cluster.transport import edge
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.integration.test_hostile import (
    START_S,
    env_for,
    peak_rss_kb,
    start_scheduler,
    start_worker,
)
from tests.procs import ROOT, Procs

FLOOD = ROOT / "tests" / "integration" / "scripts" / "member_flood.py"
SETS_ON_CUE = ROOT / "tests" / "integration" / "scripts" / "sets_on_cue.py"
# Rank 0's threads setting 2 MiB at once: past its share of bytes (64 MiB: 32 of them), and
# with its barrier under its share of calls (64).
KV_THREADS = 48
# Calls that name member '0' and never send their request: past a member's share of calls (64).
STALLED = 70
SECONDS = 4.0
# A member's turn for a report that changes what it holds (`member_limits.REPORT_EVERY_S`).
TURN_S = 0.1
# The scheduler's peak resident memory under 16 sets of 2 MiB at once (32 MiB of requests in
# flight): an idle scheduler's 45 MiB, and each request held a few times over (as it came,
# parsed, its value) while it is saved. 155-175 MiB measured; 390-440 MiB when each request
# outlived its call until the garbage collector ran.
FLOOD_PEAK_MIB = 256


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
    """KV_THREADS threads of rank 0 set 2 MiB values at once through cluster.kv_store() (two
    keys: inside its key-value share): past its share of request bytes in flight the scheduler
    refuses them, naming the node, its share and what to do; rank 1's barriers complete.

    The threads go on past SECONDS until a set was refused (`--until-refused`): how many of
    them overlap at the scheduler within a given time is the machine's load's to say (a flood
    of 0.1 s went unrefused 2 times in 4). And they are fewer than the member's share of calls
    (64, with 2 nodes), so that rank 0's own barriers, made meanwhile, are never past it: with
    64 threads, 64 sets open at a slow scheduler refused rank 0's barrier, and the job failed."""
    sched, workers = run_flood(
        processes, tmp_path, ["--kv-threads", str(KV_THREADS), "--until-refused"]
    )
    seen = codes(workers[0])
    assert seen.get("CapacityError", 0) > 0, workers[0].output
    assert seen.get("OK", 0) > 0, workers[0].output  # the member's share still goes through
    refusal = re.search(r"flood first CapacityError: (.*)", workers[0].output)
    assert refusal, workers[0].output
    for words in ("node '0'", "a member's share is", "bytes", "wait for its calls"):
        assert words in refusal.group(1), refusal.group(1)
    assert re.search(r"node '0' past its bounds \(member_(bytes|calls)\)", sched.output)
    ends_well(sched, workers)


def test_a_members_large_calls_over_several_connections_go_with_their_calls(
    processes: Procs, tmp_path: Path
) -> None:
    """16 sets of 2 MiB at once by rank 0, over 4 connections of its own, again and again for
    SECONDS (inside its shares: nothing is refused): the scheduler lets each request go with
    its call, so its peak memory stays under FLOOD_PEAK_MIB however many calls it answered;
    rank 1's barriers complete and the job ends well."""
    go = tmp_path / "go"
    sched, workers = run_flood(
        processes, tmp_path, ["--kv-threads", "16", "--connections", "4", "--go", str(go)]
    )
    try:  # before the job ends
        peak_mib = peak_rss_kb(sched.pid) / 1024
    finally:
        go.touch()
    seen = codes(workers[0])
    print(f"FLOOD peak_mib={peak_mib:.0f} {seen}")
    assert seen.get("OK", 0) > 4 * 16, workers[0].output  # the flood went on all along
    assert peak_mib < FLOOD_PEAK_MIB, f"the scheduler peaked at {peak_mib:.0f} MiB"
    ends_well(sched, workers)


def test_heartbeat_streams_of_a_node_are_one_and_its_beats_are_bounded(
    processes: Procs, tmp_path: Path
) -> None:
    """16 Heartbeat streams of rank 0, each beating as fast as it can: each newer one ends the
    older (which ends OK), the extra beats are dropped and the node is named. (The streams
    that reopen once superseded are past the node's rate of opens: see below.)"""
    sched, workers = run_flood(processes, tmp_path, ["--beats", "16"])
    seen = codes(workers[0])
    # Superseded while beating: the opens of the node's burst but the last (one of the burst
    # may be its real stream's, another come after the first reopens).
    assert seen.get("ended early", 0) >= OPENS_BURST - 3, workers[0].output
    assert "node '0' past its bounds (beats_dropped)" in sched.output
    ends_well(sched, workers)


def scrape(port: int, name: str, missing: float | None = None) -> float:
    """The value of the sample `name` (with its labels, as the exposition writes them);
    `missing` when there is none (None: there must be one)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if found is None and missing is not None:
        return missing
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


def test_a_node_reopening_its_heartbeat_stream_in_a_loop_is_refused_past_its_rate(
    processes: Procs, tmp_path: Path
) -> None:
    """4 loops of rank 0 open a Heartbeat stream each, beat once, and open another as soon as
    theirs ends (superseded by another loop's, or refused) for SECONDS: past the node's burst
    and rate the opens are refused (RESOURCE_EXHAUSTED, naming the node, the rate and what to
    do), each answered after a hold, so the loops open about once a hold; the scheduler's
    accepted opens stay within the rate, and it names the node. The real workers carry on and
    the job ends well."""
    metrics, go = free_port(), tmp_path / "go"
    sched, workers = run_flood(
        processes,
        tmp_path,
        ["--reopens", "4", "--go", str(go)],
        CLUSTER_METRICS_PORT=str(metrics),
    )
    try:  # the scheduler's metrics, read before the job ends
        accepted = heartbeat_calls(metrics, "OK")  # answered: superseded, or ended
        refused = heartbeat_calls(metrics, "RESOURCE_EXHAUSTED")
        bound = 'cluster_member_bounds_total{method="Heartbeat",reason="stream_opens"}'
        named = scrape(metrics, bound, missing=0.0)
        cpu_s = sched_cpu_s(sched)
    finally:
        go.touch()
    seen = codes(workers[0])
    # The burst, one a period after it, and the real workers' own streams (one each, and
    # rank 0's again should its next be taken before the scrape).
    most = OPENS_BURST + SECONDS / OPEN_EVERY_S + 3
    print(f"REOPENS accepted={accepted:g} refused={refused:g} sched_cpu_s={cpu_s:.2f} {seen}")
    assert accepted <= most, (accepted, seen)
    assert seen.get("superseded", 0) <= most, workers[0].output
    # Refused all along, each loop once a hold (or sooner, as the next open comes due).
    assert 0 < seen.get("RESOURCE_EXHAUSTED", 0) <= 4 * (SECONDS / OPEN_HOLD_S + 2), seen
    assert refused >= seen["RESOURCE_EXHAUSTED"]
    assert named == refused
    refusal = re.search(r"flood first RESOURCE_EXHAUSTED: (.*)", workers[0].output)
    assert refusal, workers[0].output
    for words in (
        "a Heartbeat stream of node '0' (from 127.0.0.1) refused",
        f"faster than {OPENS_BURST} at once and then one per {OPEN_EVERY_S:g} s",
        "the stream it has open goes on",
        "opens them in a loop",
    ):
        assert words in refusal.group(1), refusal.group(1)
    assert "node '0' past its bounds (stream_opens)" in sched.output
    assert "node '1' past its bounds" not in sched.output  # the real worker: never
    ends_well(sched, workers)


def heartbeat_calls(port: int, code: str) -> float:
    """The Heartbeat calls the scheduler ended with `code` (`cluster_rpc_requests_total`)."""
    labels = f'code="{code}",method="Heartbeat",service="cluster.v1.Scheduler"'
    return scrape(port, f"cluster_rpc_requests_total{{{labels}}}", missing=0.0)


def sched_cpu_s(sched: Process) -> float:
    """The scheduler's CPU time so far (user and system), in seconds."""
    fields = Path(f"/proc/{sched.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class SetsJob:
    """A job of a secret whose two workers (sets_on_cue.py) set their keys on `cue`."""

    sched: Process
    workers: list[Process]
    cue: Path
    address: str

    async def sets(self) -> None:
        """Cue the workers' sets, and wait for them to say how they went."""
        self.cue.touch()
        for rank, worker in enumerate(self.workers):
            await asyncio.to_thread(worker.wait_for_output, f"sets rank={rank}", START_S * 2)

    async def ends_well(self) -> None:
        """Every set of node '0' went through, and the job ended well."""
        assert "sets rank=0 done=20 failed=0" in self.workers[0].output, self.workers[0].output
        for worker in self.workers:
            assert await asyncio.to_thread(worker.wait, START_S) == 0, worker.output
        assert await asyncio.to_thread(self.sched.wait, START_S) == 0, self.sched.output


async def sets_job(processes: Procs, tmp_path: Path) -> SetsJob:
    env = env_for(free_port(), tmp_path, None, CLUSTER_JOB_SECRET="s" * 32)
    sched = start_scheduler(processes, env)
    cue = tmp_path / "cue"
    workers = [start_worker(processes, i, env, [str(SETS_ON_CUE), str(cue)]) for i in range(2)]
    for rank, worker in enumerate(workers):
        await asyncio.to_thread(worker.wait_for_output, f"ready rank={rank}", START_S * 2)
    return SetsJob(sched, workers, cue, f"127.0.0.1:{env['MS_SCHED_PORT']}")


async def test_calls_that_name_a_member_and_never_send_hold_none_of_its_share(
    processes: Procs, tmp_path: Path
) -> None:
    """Anyone on a member's address (a local user, a NAT), without the job secret, opened 70
    Exchange calls naming node '0' and never sent their request: each was counted to the
    member from its start, and the member's own key-value sets were refused (CapacityError)
    for as long as the calls were held. A call counts to its member once its request came;
    until then the calls that wait for theirs are bounded by address."""
    job = await sets_job(processes, tmp_path)
    async with grpc.aio.insecure_channel(job.address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        stalled = [stub.Exchange(metadata=(("cluster-node-id", "0"),)) for _ in range(STALLED)]
        # A call made after them on the same connection has its answer once theirs are open.
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Status(pb.StatusRequest(), timeout=START_S)
        await job.sets()
        for call in stalled:
            call.cancel()
    await job.ends_well()


async def test_calls_that_name_a_member_and_send_an_unproven_first_piece_hold_none_of_it(
    processes: Procs, tmp_path: Path
) -> None:
    """As above, each call sending the first piece of a 2 MiB value with a forged call proof,
    then nothing more: a value call's proof covers its head, which the first message carries
    (the value's length and SHA-256), so each is refused as that message comes, before it
    counts to the member, and the member's own sets go through."""
    job = await sets_job(processes, tmp_path)
    forged = (("cluster-node-id", "0"), ("cluster-call", f"7.{'ab' * 32}"))
    piece = pb.KvSetRequest(
        key="k", value=b"v" * edge.PIECE_BYTES, value_bytes=2 * edge.PIECE_BYTES
    )
    piece.value_sha256 = os.urandom(32)
    async with grpc.aio.insecure_channel(job.address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        stalled = [stub.KvSet(metadata=forged) for _ in range(STALLED)]
        for call in stalled:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(piece)
        codes = [await asyncio.wait_for(call.code(), START_S) for call in stalled]
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        assert "its call proof is not that node's" in (await stalled[0].details() or "")
        await job.sets()
    await job.ends_well()
