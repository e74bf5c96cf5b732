"""Trust II against a real scheduler process: what an outsider on the network sends cannot grow
it, replay, or reach a person's terminal raw.

- 50 followers of the job's events that never read, then 8 registrations whose node id is
  8 MiB of escapes, and 8 whose host is: the scheduler's memory grows by far less than 64 MiB,
  its event log and output by less than 2 MiB together, and `mscluster events` (from the file
  and from the scheduler) prints no raw escape byte.
- With a job secret, Status and the events show the job only to readers that prove it (the
  default); `mscluster status` proves it from the secret file, or says in one line what to pass.
- A real registration, sent again byte for byte (as a proxy on the path would): refused by the
  running scheduler, by the same job's scheduler restarted from its recovery path, and by a new
  job that uses the same secret file.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.protocol import auth
from cluster.protocol.environment import from_env
from cluster.testing import free_port
from cluster.transport import edge
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.convert import register_request
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.credentials import read_metadata, secret_of
from tests.integration.test_hostile import env_for, peak_rss_kb, start_scheduler
from tests.procs import PYTHON, Procs, mscluster

pytestmark = pytest.mark.slow

CALL_S = 10.0
HOSTILE = "\x1b[2J\x1b]0;owned\x07\n2026-11-26 rank 0 finished\u202e"
BIG = 8 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def outsider(port: int) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options) as channel:
        grpc.channel_ready_future(channel).result(timeout=CALL_S)
        yield channel


def test_an_outsider_cannot_grow_the_scheduler_or_reach_a_terminal(
    processes: Procs, tmp_path: Path
) -> None:
    port, events = free_port(), tmp_path / "events.jsonl"
    env = env_for(port, tmp_path, None, CLUSTER_EVENT_LOG=str(events))  # an open job
    sched = start_scheduler(processes, env)
    with outsider(port) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        followers = [
            stub.WatchEvents(pb.WatchEventsRequest(follow=True), timeout=60) for _ in range(50)
        ]
        before = rss_bytes(sched.pid)
        files_before = events.stat().st_size + len(sched.output)
        codes = set()
        for i in range(8):
            for node_id, host in ((HOSTILE * (BIG // len(HOSTILE)), "h"), (f"n{i}", HOSTILE)):
                request = pb.WatchRequest(
                    register=pb.RegisterRequest(
                        node_id=node_id, role=pb.ROLE_WORKER, host=host, port=1, worker_num=2
                    )
                )
                with pytest.raises(grpc.RpcError) as info:
                    next(iter(stub.Watch(request, timeout=CALL_S)))
                codes.add(info.value.code())  # type: ignore[attr-defined]
        # A host of 4 MiB in a request of the registration's size limit is refused too.
        small = pb.RegisterRequest(node_id="n", role=pb.ROLE_WORKER, host="h" * 4000, port=1)
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(small, timeout=CALL_S)
        assert "host" in (info.value.details() or "")  # type: ignore[attr-defined]
        grown = rss_bytes(sched.pid) - before
        files_grown = events.stat().st_size + len(sched.output) - files_before
        status = stub.Status(pb.StatusRequest(), timeout=CALL_S)
        for follower in followers:
            follower.cancel()
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}
    assert grown < 64 << 20, f"the scheduler grew by {grown / 2**20:.1f} MiB"
    assert files_grown < 2 << 20, f"its files grew by {files_grown / 2**20:.1f} MiB"
    assert status.nodes == []
    assert "\x1b" not in sched.output
    shown = subprocess.run(
        [PYTHON, "-m", "cluster", "events", "--file", str(events)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert b"\x1b" not in shown.stdout
    assert b"\x07" not in shown.stdout
    assert b"\xe2\x80\xae" not in shown.stdout  # U+202E
    assert b"refused" in shown.stdout


def captured_registration(port: int, env: dict[str, str]) -> bytes:
    """A worker's real registration for the scheduler at `port` (its challenge answered, its
    proof made with the job secret), as a proxy on the path would have recorded it."""
    config = from_env({**env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "0"})
    secret = Path(env["CLUSTER_JOB_SECRET_FILE"]).read_bytes().strip()
    with outsider(port) as channel:
        answer = pb_grpc.SchedulerStub(channel).Challenge(pb.ChallengeRequest(), timeout=CALL_S)
    identity = NodeIdentity("0", new_incarnation(), "127.0.0.1", 4444)
    request = register_request(
        config, identity, "", secret, challenge=(answer.challenge, answer.job_id)
    )
    assert request.credential != identity.credential  # wrapped: never in clear
    assert len(request.credential) == auth.CREDENTIAL_BYTES
    return pb.WatchRequest(register=request).SerializeToString()


def replayed(port: int, captured: bytes) -> pb.Event:
    with outsider(port) as channel:
        watch = channel.unary_stream(
            "/cluster.v1.Scheduler/Watch",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.Event.FromString,
        )
        call = watch(captured, timeout=CALL_S)
        event = next(iter(call))
        call.cancel()
        return event  # type: ignore[no-any-return]


def readers_prove_the_secret(port: int, env: dict[str, str], tmp: Path) -> None:
    """By default Status and the events without the proof are refused (UNAUTHENTICATED, the
    answer naming the fix) and health stays open; the operator's `mscluster status` makes the
    proof from the secret file, and without it says in one line what to pass."""
    secret = secret_of(env)
    with outsider(port) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        reads = {
            "Status": lambda metadata: stub.Status(
                pb.StatusRequest(), timeout=CALL_S, metadata=metadata
            ),
            "WatchEvents": lambda metadata: list(
                stub.WatchEvents(pb.WatchEventsRequest(), timeout=CALL_S, metadata=metadata)
            ),
        }
        for method, read in reads.items():
            with pytest.raises(grpc.RpcError) as info:
                read(())
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            assert "pass --secret-file" in info.value.details()  # type: ignore[attr-defined]
            assert read(read_metadata(channel, secret, method))
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=CALL_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    address = f"127.0.0.1:{port}"
    shown = mscluster("status", "--addr", address, secret_file=env["CLUSTER_JOB_SECRET_FILE"])
    assert shown.returncode == 0, shown.stderr
    assert "0/2 registered" in shown.stdout, shown.stdout
    for command in (["status"], ["events"]):
        refused = mscluster(*command, "--addr", address, secret_file=None, cwd=tmp)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert "pass --secret-file <log-dir>/job.secret or set CLUSTER_JOB_SECRET_FILE" in (
            refused.stderr
        )


def test_a_captured_registration_replays_nowhere(processes: Procs, tmp_path: Path) -> None:
    port = free_port()
    secret = tmp_path / "job.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    state = tmp_path / "state"
    env = env_for(
        port,
        tmp_path,
        None,
        CLUSTER_JOB_SECRET_FILE=str(secret),
        MS_ENABLE_RECOVERY="1",
        MS_RECOVERY_PATH=str(state),
    )
    sched = start_scheduler(processes, env)
    readers_prove_the_secret(port, env, tmp_path)
    captured = captured_registration(port, env)
    assert replayed(port, captured).HasField("accepted")  # the real one, once
    again = replayed(port, captured)
    assert again.refused.reason == pb.REFUSAL_NOT_A_MEMBER, again
    assert "seen before" in again.refused.message
    # The same job's scheduler, restarted from its recovery path.
    sched.popen.kill()
    sched.wait(CALL_S)
    start_scheduler(processes, env)
    after_restart = replayed(port, captured)
    assert after_restart.refused.reason == pb.REFUSAL_STALE_CHALLENGE, after_restart
    # A new job with the same secret file.
    other_port = free_port()
    other_env = env_for(other_port, tmp_path / "other", None, CLUSTER_JOB_SECRET_FILE=str(secret))
    start_scheduler(processes, other_env)
    elsewhere = replayed(other_port, captured)
    assert elsewhere.refused.reason == pb.REFUSAL_STALE_CHALLENGE, elsewhere


LARGE = 16 * 1024 * 1024


def connections(port: int, count: int) -> list[grpc.Channel]:
    """`count` channels to the scheduler at `port`, each a connection of its own, that send
    messages of up to 64 MiB."""
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
    return [grpc.insecure_channel(f"127.0.0.1:{port}", options) for _ in range(count)]


@pytest.mark.parametrize("names", ["nobody", "a made-up node"])
def test_an_outsiders_large_member_calls_are_refused_unread(
    processes: Procs, tmp_path: Path, names: str
) -> None:
    """48 key-value sets of 16 MiB at once over 4 connections, from a caller that names no
    member of the job (no node id, or one the job never saw): each is refused so
    before the scheduler takes its request in: its peak grows by 1-2 MiB (by about 60 MiB
    while gRPC's bandwidth-delay probe let each stream send megabytes ahead: `serving`), where
    reading each request before looking at who sent it grew it by 265-376 MiB (and by 1.4 GB
    under 64 such sets of 32 MiB)."""
    secret = tmp_path / "job.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    port = free_port()
    sched = start_scheduler(
        processes, env_for(port, tmp_path, None, CLUSTER_JOB_SECRET_FILE=str(secret))
    )
    before = peak_rss_kb(sched.pid)
    metadata = () if names == "nobody" else (("cluster-node-id", "7"), ("cluster-incarnation", "1"))
    request = pb.KvSetRequest(key="k", value=b"x" * LARGE)
    channels = connections(port, 4)
    try:
        stubs = [pb_grpc.SchedulerStub(channel) for channel in channels]
        calls = [
            stubs[i % 4].KvSet.future(edge.pieces(request), metadata=metadata, timeout=60)
            for i in range(48)
        ]
        codes = {call.exception().code() for call in calls}  # type: ignore[union-attr]
    finally:
        for channel in channels:
            channel.close()
    code, said = (
        (grpc.StatusCode.UNAUTHENTICATED, "that names no node")
        if names == "nobody"
        else (grpc.StatusCode.NOT_FOUND, "is not a member of job")
    )
    assert codes == {code}
    grown_mib = (peak_rss_kb(sched.pid) - before) / 1024
    assert grown_mib < 32, f"the scheduler's peak grew by {grown_mib:.0f} MiB"
    assert said in calls[0].exception().details()  # type: ignore[union-attr]


def test_an_outsiders_large_requests_to_any_method_are_refused_unread(
    processes: Procs, tmp_path: Path
) -> None:
    """32 registrations of 16 MiB at once over 8 connections (Register is anyone's to call, as
    are Status, Challenge and WatchEvents): no method takes a message over
    `edge.MAX_REQUEST_BYTES` (a member's value comes in pieces), so gRPC refuses each from its
    length before it reads it, and the scheduler's peak grows by 11-14 MiB, what each stream
    may send ahead (`serving`: 44-94 MiB with gRPC's bandwidth-delay probe; when every method
    took a message of up to 64 MiB, 64 such calls of 32 MiB peaked it at 0.9-1.4 GB)."""
    port = free_port()
    sched = start_scheduler(processes, env_for(port, tmp_path, None))
    before = peak_rss_kb(sched.pid)
    body = pb.RegisterRequest(node_id="n", host="h" * LARGE, port=1).SerializeToString()
    channels = connections(port, 8)
    try:
        calls = [
            channels[i % 8].unary_unary("/cluster.v1.Scheduler/Register").future(body, timeout=60)
            for i in range(32)
        ]
        errors = [call.exception() for call in calls]
        status = pb_grpc.SchedulerStub(channels[0]).Status(pb.StatusRequest(), timeout=CALL_S)
    finally:
        for channel in channels:
            channel.close()
    assert {error.code() for error in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}  # type: ignore[union-attr]
    assert "larger than max" in (errors[0].details() or "")  # type: ignore[union-attr]
    grown_mib = (peak_rss_kb(sched.pid) - before) / 1024
    assert grown_mib < 32, f"the scheduler's peak grew by {grown_mib:.0f} MiB"
    assert status.worker_num == 2  # still answering
