"""A fuzzer at the edge (issue 24, item 8): hypothesis-made calls of every RPC of both servers,
against a live job, by an outsider and by a member.

The job: a real scheduler (recovery on, one spare slot), two real workers (fuzz_target.py) that
have formed, saved a checkpoint (so each runs a state server, published in the key-value store)
and wait, rank 0 inside an open allgather; once with a job secret (and readers that prove it),
once open. The member is this test itself, registered as the job's spare through the worker
library's own `register_request` and call signer, keeping its event stream open and beating as
a spare does: a spare is a member (its proofs are valid, it reads the key-value store, which is
how it learns the state servers' addresses and tokens, as a real member does) that holds no
rank, so nothing it sends can block the job's collectives. A real worker's credential never
leaves its process, so a member's own node is the honest way to hold one.

Every call is sent as bytes on a raw channel: a well-formed request with arbitrary fields
(known node ids and incarnations read from Status, odd and huge strings, extreme integers,
random bytes), a well-formed request with bytes cut or changed, or random bytes; with the
metadata of an outsider (none, forged ids with garbage proofs and credentials), of the member
(a fresh proof over what it sends, its proof under another node's id, a proof replayed), or of
an operator (a read proof). What a member may do to itself (finish, open a second stream) and
to the job's keys (members share the store) is left out: it is not an attack.

Checked: each call ends with a status within its deadline (never UNKNOWN, which is an error
that escaped a handler; never a timeout but where the call waits by design); an outsider's call
of a member's method is never answered and no registration is accepted; after every call the job
is as it was (phase, generation, every worker's rank, address, incarnation, state and
checkpoints, the member still a live spare, the job's keys), the scheduler's and each worker's
resident set grew by less than `RSS_BOUND`; at the end a member's fetch still gets the file
whole, no process logged a traceback, and the job ends with exit 0 everywhere.

CI runs `CLUSTER_FUZZ_EXAMPLES` scheduler calls per job (default 260: 20 of each method) and a
quarter as many fetches, derandomized (the same calls every run); a run that sets the count
draws new ones each time:

    CLUSTER_FUZZ_EXAMPLES=20000 python -m pytest tests/integration/test_fuzz.py

Found on the way (fixed, with unit tests): bytes that are not a request were answered UNKNOWN
by both servers (tests/unit/test_malformed.py); with a job secret the second beat of a Heartbeat
call was refused as a replay of the call's proof (tests/unit/test_heartbeat_stream.py).
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from cluster.protocol import peer_state
from cluster.protocol.environment import from_env
from cluster.storage import checkpoint_files
from cluster.testing import Process, free_port, wait_until
from cluster.transport import membership
from cluster.v1 import peer_state_pb2 as ps
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from cluster.worker.convert import register_request
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.credentials import read_metadata, secret_of
from tests.integration.edge_calls import (
    BIDI,
    CLIENT_STREAM,
    FORGED,
    JOB_KEYS,
    MEMBER,
    MEMBER_AS_OTHER,
    MEMBER_ID,
    MEMBERS_ONLY,
    OPERATOR,
    OUTSIDERS,
    REPLAY,
    SCHEDULER_METHODS,
    SERVED,
    SERVER_STREAM,
    UNARY,
    Call,
    Fetch,
    Known,
    fetches,
    scheduler_calls,
)
from tests.integration.test_hostile import env_for, nodes, start_scheduler, start_worker
from tests.integration.test_outsider import rss_bytes
from tests.procs import ROOT, Procs

pytestmark = pytest.mark.slow

DEFAULT_EXAMPLES = 260
EXAMPLES = int(os.environ.get("CLUSTER_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
# CI repeats the same examples (derandomized); a run that asks for its count explores anew.
LONG_RUN = "CLUSTER_FUZZ_EXAMPLES" in os.environ
RSS_BOUND = 64 << 20
START_S = 60.0
CALL_S = 10.0  # a call that must be answered at once
WAIT_S = 0.5  # a call that may wait by design (KvWait, followed events) is cut off after this
MAX_ANSWERS = 64  # events or chunks a stream is read for before it is cut off
TARGET = ROOT / "tests" / "integration" / "scripts" / "fuzz_target.py"
# Ends of a call that the fuzzer reports: an error escaped a handler, or nobody answered.
BROKEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG_RUN,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


# -- the member -----------------------------------------------------------------------------


class Member:
    """This test as a spare of the job: registered, its stream open, beating, signing."""

    def __init__(self, channel: grpc.Channel, env: dict[str, str], secret: bytes | None) -> None:
        self.secret = secret
        self.identity = NodeIdentity(MEMBER_ID, new_incarnation(), "127.0.0.1", free_port())
        self._signer = membership.signer(secret, self.identity)
        self._lock = threading.Lock()
        self.last: membership.Metadata = ()
        self.ended: list[str] = []  # how its stream and its heartbeats ended, as they did
        stub = pb_grpc.SchedulerStub(channel)
        config = from_env(
            {**env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": MEMBER_ID, "CLUSTER_SPARE": "1"}
        )
        challenge = (b"", "")
        if secret is not None:
            answer = stub.Challenge(pb.ChallengeRequest(), timeout=CALL_S)
            challenge = (answer.challenge, answer.job_id)
        request = pb.WatchRequest(
            register=register_request(config, self.identity, "", secret, challenge=challenge)
        )
        self.registration = request.SerializeToString()
        self._stream = stub.Watch(request, timeout=START_S * 10)
        accepted = next(iter(self._stream))
        assert accepted.accepted.spare, accepted
        self._stop = threading.Event()
        interval = accepted.accepted.heartbeat_interval_s
        self._threads = [
            threading.Thread(target=self._drain, daemon=True),
            threading.Thread(target=self._beat, args=(stub, interval), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _drain(self) -> None:
        try:
            for _ in self._stream:
                pass
            self.ended.append("the event stream ended")
        except grpc.RpcError as exc:  # cut off by close(), or the job ended
            self.ended.append(f"the event stream ended: {exc.code()} {exc.details()}")  # type: ignore[attr-defined]

    def _beat(self, stub: pb_grpc.SchedulerStub, interval_s: float) -> None:
        def beats() -> Iterator[pb.HeartbeatRequest]:
            while not self._stop.wait(interval_s):
                yield pb.HeartbeatRequest(node_id=MEMBER_ID, incarnation=self.incarnation)

        try:
            stub.Heartbeat(beats(), timeout=START_S * 10, metadata=self.metadata("Heartbeat"))
            self.ended.append("the heartbeats ended")
        except grpc.RpcError as exc:  # the job ended
            self.ended.append(f"the heartbeats ended: {exc.code()} {exc.details()}")  # type: ignore[attr-defined]

    @property
    def incarnation(self) -> int:
        return self.identity.incarnation

    def metadata(self, method: str, body: bytes = b"") -> membership.Metadata:
        """A fresh call proof over `body` (or the credential, in an open job)."""
        with self._lock:
            if self._signer is None:
                made = membership.call_metadata(
                    MEMBER_ID, self.incarnation, self.identity.credential
                )
            else:
                made = self._signer.metadata(method, body)
            self.last = made
            return made

    def close(self) -> None:
        self._stop.set()
        self._stream.cancel()
        for thread in self._threads:
            thread.join(CALL_S)


# -- the job --------------------------------------------------------------------------------


@dataclass
class Job:
    """The live job under fuzz, what it looked like before, and what the calls got."""

    sched: Process
    workers: list[Process]
    go: Path
    checkpoints: Path
    channel: grpc.Channel
    member: Member
    reader: bytes | None  # the job secret, for an operator's reads (None: an open job)
    known: Known = field(default_factory=lambda: Known({}))
    servers: list[peer_state.Published] = field(default_factory=list)
    before: tuple[Any, ...] = ()
    rss: dict[int, int] = field(default_factory=dict)
    ends: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    last_fetch: bytes = b""  # the member's last request to a state server

    def status(self) -> pb.StatusResponse:
        metadata = read_metadata(self.channel, self.reader)
        stub = pb_grpc.SchedulerStub(self.channel)
        answer: pb.StatusResponse = stub.Status(
            pb.StatusRequest(), timeout=CALL_S, metadata=metadata
        )
        return answer

    def kv(self, keys: tuple[str, ...]) -> list[bytes]:
        """The values of `keys`, read as the member."""
        request = pb.KvGetRequest(keys=keys)
        metadata = self.member.metadata("KvGet", request.SerializeToString())
        stub = pb_grpc.SchedulerStub(self.channel)
        answer = stub.KvGet(request, timeout=CALL_S, metadata=metadata)
        assert not answer.missing, answer
        return list(answer.values)

    def state(self) -> tuple[Any, ...]:
        """What no call of the fuzzer may change (the member's own checkpoints it may)."""
        status = self.status()
        workers = {k: v for k, v in nodes(status).items() if k != MEMBER_ID}
        member = [(n.state, n.incarnation) for n in status.nodes if n.node_id == MEMBER_ID]
        return status.phase, status.generation, workers, member, self.kv(JOB_KEYS)

    def check(self) -> None:
        """The job as it was, every process up and within its memory bound."""
        try:
            now = self.state()
        except grpc.RpcError as exc:
            now = (exc.code(), exc.details())  # type: ignore[attr-defined]
        told = [line for line in self.sched.output.splitlines() if "refused" not in line]
        assert now == self.before, (self.member.ended, told[-20:])
        for proc in (self.sched, *self.workers):
            assert proc.running, proc.output
        for pid, rss in self.rss.items():
            grown = rss_bytes(pid) - rss
            assert grown < RSS_BOUND, f"process {pid} grew by {grown / 2**20:.1f} MiB"

    def ended(self, method: str, who: str, code: grpc.StatusCode) -> None:
        self.ends[method, who, code.name] += 1
        self.check()


def start_job(processes: Procs, tmp: Path, *, secret: bool) -> Job:
    extra = {
        "MS_ENABLE_RECOVERY": "1",
        "MS_RECOVERY_PATH": str(tmp / "state"),
        "CLUSTER_MAX_SPARES": "1",
    }
    if secret:
        secret_file = tmp / "job.secret"
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        extra.update(CLUSTER_JOB_SECRET_FILE=str(secret_file), CLUSTER_READERS_PROVE_SECRET="1")
    port = free_port()
    env = env_for(port, tmp, None, **extra)
    go, checkpoints = tmp / "go", tmp / "checkpoints"
    sched = start_scheduler(processes, env)
    script = [str(TARGET), str(go), str(checkpoints)]
    workers = [start_worker(processes, i, env, script) for i in range(2)]
    for i, worker in enumerate(workers):
        worker.wait_for_output(f"ready rank={i}", START_S)
    options = [("grpc.max_send_message_length", 64 << 20)]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options)
    member = Member(channel, env, secret_of(env))
    job = Job(sched, workers, go, checkpoints, channel, member, secret_of(env))
    wait_until(lambda: len(job.status().nodes) == 3, START_S, "the member among the spares")
    job.known = Known({n.node_id: n.incarnation for n in job.status().nodes})
    job.servers = [
        peer_state.Published.decode(value, str(rank))
        for rank, value in enumerate(job.kv(JOB_KEYS[2:]))
    ]
    job.before = job.state()
    job.rss = {pid: rss_bytes(pid) for pid in (sched.pid, *(w.pid for w in workers))}
    return job


def finish(job: Job) -> None:
    """The fuzzer's last checks, then the job ends as if nothing had happened."""
    job.check()
    for rank in range(len(job.servers)):
        assert served_whole(job, rank)
    job.member.close()
    job.channel.close()
    job.go.touch()
    for rank, worker in enumerate(job.workers):
        assert worker.wait(START_S) == 0, worker.output
        assert f"gathered rank={rank} result=[0, 1]" in worker.output
        assert f"done rank={rank} generation=1" in worker.output
    assert job.sched.wait(START_S) == 0, job.sched.output
    assert "job finished: all 2 nodes finished" in job.sched.output
    for proc in (job.sched, *job.workers):
        assert "Traceback" not in proc.output, proc.output


# -- the scheduler --------------------------------------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


def metadata_of(job: Job, call: Call) -> membership.Metadata:
    if call.who == FORGED:
        return call.forged
    if call.who == OPERATOR:
        return tuple(read_metadata(job.channel, job.reader, call.method))
    if call.who == REPLAY and job.member.last:
        return job.member.last
    if call.who in (MEMBER, MEMBER_AS_OTHER, REPLAY):
        # What the scheduler hashes: the request (a value's head), or nothing for a Heartbeat
        # stream.
        body = b"" if call.method == "Heartbeat" else call.whole or call.bodies[0]
        made = job.member.metadata(call.method, body)
        if call.who == MEMBER_AS_OTHER:
            made = tuple((k, call.other if k == membership.NODE_ID_KEY else v) for k, v in made)
        return made
    return ()


def bodies_of(job: Job, call: Call) -> tuple[bytes, ...]:
    """What goes out: in a job with a secret, a replayed registration is the member's own."""
    if call.who != REPLAY or job.reader is None or call.method not in ("Register", "Watch"):
        return call.bodies
    watch = pb.WatchRequest.FromString(job.member.registration)
    return (
        job.member.registration if call.method == "Watch" else watch.register.SerializeToString(),
    )


def waits(method: str) -> bool:
    """A call that may stay open by design: a member's KvWait, a follower of the events."""
    return method in ("KvWait", "WatchEvents")


def call_ended(
    channel: grpc.Channel, path: str, kind: str, bodies: tuple[bytes, ...], metadata: Any
) -> tuple[grpc.StatusCode, bytes]:
    """How the call ended (CANCELLED: a stream cut off once it said enough), and its first
    answer."""
    timeout = WAIT_S if waits(path.rsplit("/", 1)[1]) else CALL_S
    first = b""
    try:
        if kind == UNARY:
            send = channel.unary_unary(path, _identity, _identity)
            first = send(bodies[0], timeout=timeout, metadata=metadata)
        elif kind == CLIENT_STREAM:
            send_all = channel.stream_unary(path, _identity, _identity)
            first = send_all(iter(bodies), timeout=timeout, metadata=metadata)
        else:
            if kind == BIDI:
                link = channel.stream_stream(path, _identity, _identity)
                answers = link(iter(bodies), timeout=timeout, metadata=metadata)
            else:
                stream = channel.unary_stream(path, _identity, _identity)
                answers = stream(bodies[0], timeout=timeout, metadata=metadata)
            for count, answer in enumerate(answers):
                first = first or answer
                if count == MAX_ANSWERS:
                    answers.cancel()
                    return grpc.StatusCode.CANCELLED, first
    except grpc.RpcError as exc:
        return exc.code(), first  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, first


def admitted(method: str, first: bytes) -> bool:
    """Whether a Register or Watch answer accepted a registration."""
    if method == "Register":
        return pb.RegisterResponse.FromString(first).HasField("accepted")
    if method == "HostWatch" and first:
        first = pb.HostDown.FromString(first).event
    watches = method in ("Watch", "HostWatch")
    return watches and bool(first) and pb.Event.FromString(first).HasField("accepted")


def sent(job: Job, call: Call) -> None:
    """Send `call` to the scheduler: it ends with a status, in time; an outsider's call of a
    member's method is refused, and no registration is accepted."""
    kind = SCHEDULER_METHODS[call.method][0]
    path = f"/cluster.v1.Scheduler/{call.method}"
    bodies, metadata = bodies_of(job, call), metadata_of(job, call)
    code, first = call_ended(job.channel, path, kind, bodies, metadata)
    assert code not in BROKEN, f"{call!r} ended with {code}"
    if not waits(call.method):
        assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"{call!r} was not answered"
    if call.who in OUTSIDERS and call.method in MEMBERS_ONLY:
        assert code is not grpc.StatusCode.OK, f"{call!r} was answered"
    assert not admitted(call.method, first), f"{call!r} was accepted"
    job.ended(call.method, call.who, code)


# -- the state servers ----------------------------------------------------------------------


def proven(token: bytes, fields: tuple[str, int, int, bool]) -> bytes:
    """A member's request, proven with the serving token it read from the store."""
    nonce = secrets.token_bytes(peer_state.NONCE_BYTES)
    proof = peer_state.Request(*fields).prove(token, nonce)
    prefix, rank, step, any_rank = fields
    request = ps.FetchRequest(
        prefix=prefix, rank=rank, step=step, any_rank=any_rank, nonce=nonce, proof=proof
    )
    return request.SerializeToString()


def fetch_body(job: Job, fetch: Fetch) -> bytes:
    if fetch.who == MEMBER:
        job.last_fetch = proven(job.servers[fetch.server].token, fetch.fields)
        return job.last_fetch
    if fetch.who == REPLAY and job.last_fetch:
        return job.last_fetch
    return fetch.body


def fetched(job: Job, fetch: Fetch) -> None:
    """Send `fetch`: it ends with a status, in time; an outsider's is refused."""
    path = "/cluster.v1.PeerState/Fetch"
    body = fetch_body(job, fetch)
    with grpc.insecure_channel(job.servers[fetch.server].address) as channel:
        code, _ = call_ended(channel, path, SERVER_STREAM, (body,), ())
    assert code not in BROKEN, f"{fetch!r} ended with {code}"
    assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"{fetch!r} was not answered"
    if fetch.who in OUTSIDERS or fetch.who == "random":
        assert code is not grpc.StatusCode.OK, f"{fetch!r} was served"
    job.ended("Fetch", fetch.who, code)


def served_whole(job: Job, rank: int) -> bool:
    """A member's fetch of the served step from rank `rank`'s server gets the file as it is."""
    body = proven(job.servers[rank].token, (SERVED[0], rank, SERVED[1], False))
    with grpc.insecure_channel(job.servers[rank].address) as channel:
        fetch = channel.unary_stream(
            "/cluster.v1.PeerState/Fetch", _identity, ps.FetchChunk.FromString
        )
        data = b"".join(chunk.data for chunk in fetch(body, timeout=CALL_S))
    name = checkpoint_files.file_name(*SERVED)
    return data == (job.checkpoints / f"rank_{rank}" / name).read_bytes()


# -- the fuzzer -----------------------------------------------------------------------------


def fuzz_the_scheduler(job: Job) -> None:
    """`EXAMPLES` calls, as many of each method."""
    for method in SCHEDULER_METHODS:

        @settings(FUZZ, max_examples=max(1, EXAMPLES // len(SCHEDULER_METHODS)))
        @given(scheduler_calls(job.known, method))
        def each(call: Call) -> None:
            sent(job, call)

        each()


def fuzz_the_state_servers(job: Job) -> None:
    @settings(FUZZ, max_examples=max(1, EXAMPLES // 4))
    @given(fetches())
    def each(fetch: Fetch) -> None:
        fetched(job, fetch)

    each()


def reached(job: Job) -> None:
    """The member's calls went past the edge: answered by the scheduler's core, and served."""
    print("\n".join(f"{n:5d} {m} {w} {c}" for (m, w, c), n in sorted(job.ends.items())))
    if EXAMPLES < DEFAULT_EXAMPLES:
        return
    answered = {m for (m, w, c) in job.ends if w == MEMBER and c == "OK"}
    assert {"KvGet", "KvSet", "Fetch"} <= answered, answered


@pytest.mark.timeout(120 + EXAMPLES // 2)
@pytest.mark.parametrize("secret", [True, False], ids=["job-secret", "open-job"])
def test_the_edge_survives_fuzzed_calls_and_the_job_is_unchanged(
    processes: Procs, tmp_path: Path, secret: bool
) -> None:
    job = start_job(processes, tmp_path, secret=secret)
    try:
        fuzz_the_scheduler(job)
        fuzz_the_state_servers(job)
        reached(job)
        grown = {pid: (rss_bytes(pid) - rss) / 2**20 for pid, rss in job.rss.items()}
        print(f"{sum(job.ends.values())} calls; grown (MiB): {grown}")
        finish(job)
    finally:
        job.member.close()
        job.channel.close()
