"""A worker's state server and the fetcher, on loopback: a real grpc.aio server on port 0, real
files, real TLS with certificates made here. The good fetch, a checksum mismatch, and the
refusals of a forged, absent or replayed proof, of fields out of range, of an absurd request and
of a flood, each with nothing changed; an outsider's calls that never send their request are
cut at the first-message deadline while members fetch."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from cluster.api import peer_state as api_peer_state
from cluster.api import runtime
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol import auth, peer_state
from cluster.protocol.config import TLSOptions
from cluster.protocol.errors import ClusterError
from cluster.scheduler.descriptors import open_descriptors
from cluster.storage import atomic, checkpoint_files, checkpoint_tree
from cluster.storage.served import ServedCheckpoints
from cluster.storage.snapshot import Snapshot
from cluster.testing import wait_until
from cluster.transport import certs, tls
from cluster.v1 import peer_state_pb2 as pb
from cluster.v1 import peer_state_pb2_grpc as pb_grpc
from cluster.worker import state_fetch, state_server
from cluster.worker.session import BackgroundLoop
from cluster.worker.state_server import IDLE_CONNECTION_MS, MAX_CALLS, StateServer, connection_cap
from tests.proxy import Proxy

WORKERS = 4
STEP = 10


@pytest.fixture(scope="module")
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-peer-state")
    yield background
    background.stop()


def saved(root: Path, rank: int, state: dict[str, np.ndarray], step: int = STEP) -> Path:
    config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=3)
    with CheckpointManager(root, "net", config, rank=rank, recovery=False) as checkpoints:
        checkpoints.save(step, state)
    return checkpoints.path(step)


def state(value: float = 1.0, size: int = 300_000) -> dict[str, np.ndarray]:
    return {"w": np.full(size, value), "step": np.array([STEP])}


class Served:
    """A StateServer serving `root` (rank `rank`), started on `loop`; stopped by `close`."""

    def __init__(
        self,
        loop: BackgroundLoop,
        root: Path,
        rank: int,
        identity: tls.Identity | None = None,
        **options: int,
    ) -> None:
        self.loop = loop
        self.server = StateServer("127.0.0.1", WORKERS, identity, **options)
        self.server.offer(ServedCheckpoints(root, "net", rank))
        loop.run(self.server.start(), timeout_s=10)
        self.holder = state_fetch.Holder(rank, f"node-{rank}", self.server.published)

    def close(self) -> None:
        self.loop.run(self.server.stop(0), timeout_s=10)


@pytest.fixture
def serving(loop: BackgroundLoop, tmp_path: Path) -> Iterator[Served]:
    saved(tmp_path / "peer", 2, state())
    served = Served(loop, tmp_path / "peer", 2)
    yield served
    served.close()


def wanted(rank: int = 1, step: int = STEP, any_rank: bool = True) -> peer_state.Request:
    return peer_state.Request("net", rank, step, any_rank)


def nothing_left(directory: Path) -> bool:
    return not directory.exists() or not any(directory.iterdir())


def test_a_good_fetch_is_the_peers_file_byte_for_byte_verified_and_stored(
    loop: BackgroundLoop, serving: Served, tmp_path: Path
) -> None:
    dest = tmp_path / "newcomer" / "rank_1" / checkpoint_files.file_name("net", STEP)
    dest.parent.mkdir(parents=True)
    fetched = state_fetch.fetch(loop, [serving.holder], wanted(), dest)
    source = tmp_path / "peer" / "rank_2" / dest.name
    assert dest.read_bytes() == source.read_bytes()
    assert fetched.holder == serving.holder
    assert fetched.failures == []
    assert fetched.state["w"].tobytes() == state()["w"].tobytes()
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no temporary left
    assert serving.server.sent == 1


def test_a_checksum_mismatch_leaves_nothing_and_the_next_peer_gives_it(
    loop: BackgroundLoop, serving: Served, tmp_path: Path
) -> None:
    saved(tmp_path / "bad", 3, state())
    corrupt = tmp_path / "bad" / "rank_3" / checkpoint_files.file_name("net", STEP)
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x40  # a bit flipped in the payload: it still looks complete
    corrupt.write_bytes(bytes(data))
    bad = Served(loop, tmp_path / "bad", 3)
    try:
        dest = tmp_path / "newcomer" / corrupt.name
        dest.parent.mkdir()
        with pytest.raises(state_fetch.NotFetched) as refused:
            state_fetch.fetch(loop, [bad.holder], wanted(), dest)
        assert "does not verify" in str(refused.value)
        assert "checksum does not match" in str(refused.value)
        assert nothing_left(dest.parent)
        fetched = state_fetch.fetch(loop, [bad.holder, serving.holder], wanted(), dest)
        assert fetched.holder == serving.holder
        assert len(fetched.failures) == 1
        assert "rank 3" in fetched.failures[0]
        assert [p.name for p in dest.parent.iterdir()] == [dest.name]
    finally:
        bad.close()


def test_a_file_of_another_rank_under_the_ranks_name_is_refused_and_the_next_peer_gives_it(
    loop: BackgroundLoop, tmp_path: Path
) -> None:
    """Without `any_rank` the file must be of the rank asked for: rank 3's checkpoint copied
    into rank_1/ verifies (step, checksum) but is not rank 1's state."""
    saved(tmp_path / "misplaced", 3, state(3.0))
    (tmp_path / "misplaced" / "rank_3").rename(tmp_path / "misplaced" / "rank_1")
    saved(tmp_path / "good", 1, state(1.0))
    misplaced = Served(loop, tmp_path / "misplaced", 2)
    good = Served(loop, tmp_path / "good", 1)
    try:
        dest = tmp_path / "newcomer" / "rank_1" / checkpoint_files.file_name("net", STEP)
        dest.parent.mkdir(parents=True)
        only_rank_1 = wanted(rank=1, any_rank=False)
        with pytest.raises(state_fetch.NotFetched) as refused:
            state_fetch.fetch(loop, [misplaced.holder], only_rank_1, dest)
        assert "does not verify" in str(refused.value)
        assert "holds the state of rank 3, not of rank 1" in str(refused.value)
        assert nothing_left(dest.parent)
        fetched = state_fetch.fetch(loop, [misplaced.holder, good.holder], only_rank_1, dest)
        assert fetched.holder == good.holder
        assert len(fetched.failures) == 1
        assert fetched.state["w"].tobytes() == state(1.0)["w"].tobytes()
        replica = state_fetch.fetch(loop, [misplaced.holder], wanted(rank=1), dest)
        assert replica.state["w"].tobytes() == state(3.0)["w"].tobytes()  # any rank will do
    finally:
        misplaced.close()
        good.close()


def test_fetch_state_reads_a_peers_state_and_leaves_no_file_and_no_report(
    loop: BackgroundLoop, serving: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state of a step resumed from memory is fetched, not stored as this rank's checkpoint
    nor reported (`load` of a missing file, by contrast, stores and reports it). The job's
    runtime is given (a session that says, the peers to ask); the server, the transfer and the
    files are real."""
    said: list[str] = []
    session = SimpleNamespace(
        config=SimpleNamespace(recovery=object()), say=said.append, topology=None
    )
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "session", lambda: session)
    service = api_peer_state._Service(loop, None, state_fetch.Client())
    monkeypatch.setattr(api_peer_state, "_service", service)
    monkeypatch.setattr(api_peer_state, "holders", lambda: [serving.holder])
    temporaries: list[Path] = []

    def create_temporary(path: Path) -> tuple[int, Path]:
        fd, temporary = real_create_temporary(path)
        temporaries.append(temporary)
        return fd, temporary

    real_create_temporary = atomic.create_temporary
    monkeypatch.setattr(atomic, "create_temporary", create_temporary)
    reports: list[list[int]] = []
    config = CheckpointConfig(keep_checkpoint_max=3)
    with CheckpointManager(
        tmp_path / "newcomer", "net", config, rank=1, recovery=True, report=reports.append
    ) as ckpt:
        got = ckpt.fetch_state(STEP)
        assert got["w"].tobytes() == state()["w"].tobytes()
        assert [p.name for p in ckpt.directory.iterdir()] == [".net.lock"]
        assert (ckpt.steps(), reports) == ([], [])
        assert said[-1].endswith("(the state only: not stored as a checkpoint of this rank)")
        # Its temporary bore the name of one a killed save leaves: the next save removes it.
        [temporary] = temporaries
        temporary.write_bytes(b"left by a kill")
        ckpt.save(STEP + 1, {"w": np.zeros(1)})
        ckpt.flush()
        assert not temporary.exists()
        assert reports == [[STEP + 1]]
        assert ckpt.load(STEP)["w"].tobytes() == got["w"].tobytes()  # missing: fetched, stored
        assert (ckpt.steps(), reports[-1]) == ([STEP, STEP + 1], [STEP, STEP + 1])


class Silent:
    """A state server that takes every Fetch and never answers it (a hung peer), started on
    `loop`; stopped by `close`."""

    def __init__(self, loop: BackgroundLoop) -> None:
        self.loop = loop
        self.asked = 0
        self.server = loop.run(self._start(), timeout_s=10)
        published = peer_state.Published("127.0.0.1", self.port, peer_state.new_token())
        self.holder = state_fetch.Holder(5, "node-silent", published)

    async def _start(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        pb_grpc.add_PeerStateServicer_to_server(self, server)  # type: ignore[no-untyped-call]
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server

    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.FetchChunk]:
        self.asked += 1
        await asyncio.Event().wait()  # until the call is cancelled
        yield pb.FetchChunk()

    def close(self) -> None:
        self.loop.run(self.server.stop(0), timeout_s=10)


class Python310TimeoutError(Exception):
    """asyncio.TimeoutError as Python 3.10 has it: not the builtin TimeoutError."""


class Python310Asyncio:
    """The asyncio module as state_fetch sees it on Python 3.10, where a wait_for that times
    out raises an asyncio.TimeoutError that is not the builtin TimeoutError."""

    TimeoutError = Python310TimeoutError

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    @staticmethod
    async def wait_for(waited: Awaitable[Any], timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(waited, timeout)
        except TimeoutError:
            raise Python310TimeoutError from None


@pytest.mark.parametrize("python", ["3.11", "3.10"])
def test_a_silent_peer_is_given_up_on_and_the_next_peer_gives_it(
    loop: BackgroundLoop,
    serving: Served,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    python: str,
) -> None:
    """CI's Python 3.11 cannot show 3.10's asyncio.TimeoutError (another class there): the
    "3.10" case gives state_fetch a wait_for that raises one."""
    monkeypatch.setattr(state_fetch, "PIECE_WAIT_S", 1.0)
    if python == "3.10":
        monkeypatch.setattr(state_fetch, "asyncio", Python310Asyncio())
    silent = Silent(loop)
    try:
        dest = tmp_path / "newcomer" / checkpoint_files.file_name("net", STEP)
        dest.parent.mkdir()
        started = time.monotonic()
        fetched = state_fetch.fetch(loop, [silent.holder, serving.holder], wanted(), dest)
        assert time.monotonic() - started < 5.0
        assert silent.asked == 1
        assert fetched.holder == serving.holder
        assert fetched.failures == [f"{silent.holder}: it sent nothing for 1 s"]
        assert dest.read_bytes() == (tmp_path / "peer" / "rank_2" / dest.name).read_bytes()
    finally:
        silent.close()


def call(served: Served, request: pb.FetchRequest) -> grpc.RpcError:
    """The refusal of `request` (a plain client, as an attacker has)."""
    return call_at(served.holder.published.address, request)


def request(
    token: bytes, ask: peer_state.Request | None = None, nonce: bytes | None = None
) -> pb.FetchRequest:
    ask = ask or wanted()
    nonce = auth.new_nonce() if nonce is None else nonce
    return pb.FetchRequest(
        prefix=ask.prefix,
        rank=ask.rank,
        step=ask.step,
        any_rank=ask.any_rank,
        nonce=nonce,
        proof=ask.prove(token, nonce),
    )


def test_a_forged_or_absent_proof_is_refused_and_nothing_is_sent(serving: Served) -> None:
    for forged in (
        request(peer_state.new_token()),  # a token guessed
        pb.FetchRequest(prefix="net", rank=1, step=STEP, any_rank=True, nonce=auth.new_nonce()),
    ):
        refused = call(serving, forged)
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "not a member of this job" in str(refused.details())
    # A proof made for another request proves nothing for this one.
    nonce = auth.new_nonce()
    other = request(serving.server.token, wanted(step=STEP - 1), nonce)
    other.step = STEP
    assert call(serving, other).code() == grpc.StatusCode.UNAUTHENTICATED
    assert serving.server.sent == 0
    assert serving.server.refused["UNAUTHENTICATED"] == 3


def test_a_replayed_request_is_refused(serving: Served) -> None:
    good = request(serving.server.token)
    with grpc.insecure_channel(serving.holder.published.address) as channel:
        chunks = list(pb_grpc.PeerStateStub(channel).Fetch(good, timeout=10))
    assert sum(len(c.data) for c in chunks) == chunks[0].file_bytes
    refused = call(serving, good)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "seen before (a replay)" in str(refused.details())
    assert serving.server.sent == 1


@pytest.mark.parametrize(
    ("ask", "nonce", "says"),
    [
        (wanted(rank=WORKERS), None, f"rank {WORKERS} is out of range: the job has 4 workers"),
        (wanted(step=0), None, "step 0 is out of range"),
        (wanted(step=peer_state.MAX_STEP + 1), None, "out of range"),
        (peer_state.Request("../../etc", 1, STEP, True), None, "is not a checkpoint prefix"),
        (wanted(), b"short", "the nonce has 5 bytes, not 16"),
    ],
)
def test_fields_out_of_range_are_refused_by_name(
    serving: Served, ask: peer_state.Request, nonce: bytes | None, says: str
) -> None:
    refused = call(serving, request(serving.server.token, ask, nonce))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in str(refused.details())


def test_a_step_not_held_is_not_found_and_an_absurd_request_is_refused(serving: Served) -> None:
    refused = call(serving, request(serving.server.token, wanted(step=STEP + 1)))
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert "holds no complete checkpoint 'net' of step 11" in str(refused.details())
    absurd = request(serving.server.token)
    absurd.prefix = "x" * 100_000  # far past what a request may be
    assert call(serving, absurd).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server still serves members.
    ok = request(serving.server.token)
    with grpc.insecure_channel(serving.holder.published.address) as channel:
        assert list(pb_grpc.PeerStateStub(channel).Fetch(ok, timeout=10))


def test_a_flood_past_the_streams_allowed_is_refused_while_the_transfer_goes_on(
    loop: BackgroundLoop, tmp_path: Path
) -> None:
    saved(tmp_path / "big", 0, state(size=4_000_000))  # 32 MB: held by flow control
    served = Served(loop, tmp_path / "big", 0, max_streams=1)
    try:
        with grpc.insecure_channel(served.holder.published.address) as channel:
            stub = pb_grpc.PeerStateStub(channel)
            first = stub.Fetch(request(served.server.token), timeout=30)
            head = next(first)  # under way, and not read further: the server waits on us
            refused = [call(served, request(served.server.token)) for _ in range(20)]
            assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "as many as it sends at once" in str(refused[0].details())
            rest = sum(len(c.data) for c in first)
            assert len(head.data) + rest == head.file_bytes
        assert served.server.sent == 1
    finally:
        served.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


def test_with_tls_a_member_with_the_jobs_certificate_fetches_and_others_are_refused(
    loop: BackgroundLoop, pki: certs.Pki, tmp_path: Path
) -> None:
    options = TLSOptions(pki.ssl_json)
    server_identity = tls.load_identity(options, server=True)
    client_identity = tls.load_identity(options, server=False)
    saved(tmp_path / "peer", 2, state())
    served = Served(loop, tmp_path / "peer", 2, server_identity)
    try:
        dest = tmp_path / "newcomer" / checkpoint_files.file_name("net", STEP)
        dest.parent.mkdir()
        # The peer is dialled at its own address; the job's server certificate names the
        # scheduler's (`localhost` here stands for that name).
        client = state_fetch.Client(client_identity, "localhost")
        fetched = state_fetch.fetch(loop, [served.holder], wanted(), dest, client)
        assert fetched.state["w"].tobytes() == state()["w"].tobytes()
        dest.unlink()
        # Plaintext, and a certificate the CRL revokes: refused, nothing stored.
        with pytest.raises(state_fetch.NotFetched):
            state_fetch.fetch(loop, [served.holder], wanted(), dest, state_fetch.Client())
        bad = _identity_of(pki, pki.revoked_client_p12, tmp_path)
        with pytest.raises(state_fetch.NotFetched) as refused:
            state_fetch.fetch(
                loop, [served.holder], wanted(), dest, state_fetch.Client(bad, "localhost")
            )
        assert "UNAUTHENTICATED" in str(refused.value)
        assert "revoked" in str(refused.value)
        assert nothing_left(dest.parent)
        assert served.server.sent == 1
    finally:
        served.close()


def _identity_of(pki: certs.Pki, p12: Path, tmp: Path) -> tls.Identity:
    """A client identity whose certificate is `p12` (the rest of the job's ssl.json, but the
    CRL)."""
    data = json.loads(pki.ssl_json.read_text())
    for key, value in data.items():
        if key.endswith(("_path", "_file")) and value:
            data[key] = str(pki.dir / value)
    data["client_cert_path"] = str(p12)
    data["crl_path"] = ""  # this client does not check itself; the server does
    path = tmp / "revoked-ssl.json"
    path.write_text(json.dumps(data))
    return tls.load_identity(TLSOptions(path), server=False)


def test_the_in_memory_step_is_fetched_as_its_file_and_a_replacement_mid_transfer_is_not_torn(
    loop: BackgroundLoop, tmp_path: Path
) -> None:
    """`serve_memory` (issue #15 item 3's hook) through the real server: the step held in
    memory arrives as the bytes its file would have; replaced (and the old snapshot refilled at
    once) while a transfer of it is under way, that transfer still gets the old step whole."""
    config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=3)
    checkpoints = CheckpointManager(tmp_path / "live", "net", config, rank=0, recovery=False)
    server = StateServer("127.0.0.1", WORKERS)
    server.offer(checkpoints.served)
    loop.run(server.start(), timeout_s=10)
    try:
        old = Snapshot()
        old.fill(STEP, 0, "net", checkpoint_tree.encode(state(5.0, size=4_000_000)))
        expected = b"".join(old.chunks())
        checkpoints.serve_memory(STEP, old)
        with grpc.insecure_channel(server.published.address) as channel:
            stub = pb_grpc.PeerStateStub(channel)
            stream = stub.Fetch(request(server.token), timeout=30)
            first = next(stream)  # under way
            new = Snapshot()
            new.fill(STEP + 1, 0, "net", checkpoint_tree.encode(state(6.0)))
            checkpoints.serve_memory(STEP + 1, new)
            old.fill(STEP + 2, 0, "net", checkpoint_tree.encode(state(7.0, size=4_000_000)))
            got = first.data + b"".join(c.data for c in stream)
        assert got == expected
        dest = tmp_path / "newcomer" / checkpoint_files.file_name("net", STEP + 1)
        dest.parent.mkdir()
        holder = state_fetch.Holder(0, "live", server.published)
        fetched = state_fetch.fetch(loop, [holder], wanted(step=STEP + 1), dest)
        assert dest.read_bytes() == b"".join(new.chunks())
        assert fetched.state["w"].tobytes() == state(6.0)["w"].tobytes()
        checkpoints.serve_memory(STEP + 1, None)
        gone = call_at(server.published.address, request(server.token, wanted(step=STEP + 1)))
        assert gone.code() == grpc.StatusCode.NOT_FOUND
    finally:
        loop.run(server.stop(0), timeout_s=10)
        checkpoints.close()


def call_at(address: str, ask: pb.FetchRequest) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.PeerStateStub(channel).Fetch(ask, timeout=10))
    return refused.value


def test_a_published_address_round_trips_and_garbage_is_named() -> None:
    published = peer_state.Published("10.0.0.5", 41234, peer_state.new_token())
    assert peer_state.Published.decode(published.encode(), "n1") == published
    assert peer_state.Published("::1", 5, b"t").address == "[::1]:5"
    for garbage in (b"", b"{}", b'{"host": "h", "port": 0, "token": "00"}', b"\xff"):
        with pytest.raises(ClusterError, match="'cluster/peer-state/n1'"):
            peer_state.Published.decode(garbage, "n1")


# What a gRPC client sends first: the HTTP/2 preface and an empty SETTINGS frame.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (what it sent before is read and dropped)."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return True


def test_a_flood_of_connections_is_held_to_the_cap_and_a_member_still_fetches(
    loop: BackgroundLoop, tmp_path: Path
) -> None:
    cap, flood = 8, 100
    saved(tmp_path / "peer", 2, state())
    served = Served(loop, tmp_path / "peer", 2, max_connections=cap)
    socks: list[socket.socket] = []
    try:
        before = open_descriptors()
        assert before is not None
        for _ in range(flood):
            sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=10)
            sock.sendall(PREFACE)
            sock.setblocking(False)
            socks.append(sock)
        closed = [False] * flood

        def past_cap_closed() -> bool:
            closed[:] = [done or closed_by_server(s) for done, s in zip(closed, socks, strict=True)]
            return sum(closed) >= flood - cap

        # Well before the idle ones are closed (which would close them all).
        wait_until(past_cap_closed, IDLE_CONNECTION_MS / 2000, "the connections past the cap")
        # Those the server holds, still open: at most the cap (on a slow machine, the first
        # held may already have been closed idle).
        assert flood - sum(closed) <= cap
        held = open_descriptors()
        assert held is not None
        assert held - before <= flood + cap + 4  # the flood's own ends, and at most `cap`
        for sock in socks:
            sock.close()
        socks.clear()
        dest = tmp_path / "newcomer" / checkpoint_files.file_name("net", STEP)
        dest.parent.mkdir()
        fetched = state_fetch.fetch(loop, [served.holder], wanted(), dest)
        assert fetched.holder == served.holder
    finally:
        for sock in socks:
            sock.close()
        served.close()


def test_the_connection_cap_covers_the_job_and_leaves_the_descriptors_to_training() -> None:
    assert connection_cap(4, limit=1_048_576) == 4 + 16  # every member, and some to spare
    assert connection_cap(8_000, limit=1_048_576) == 8_016
    assert connection_cap(8_000, limit=1024) == 128  # an eighth of the limit at most


# The outsider's own bound on its calls: past it, the server held them on.
SILENT_CALL_S = 30.0


async def silent_fetches(address: str, ended: list[tuple[str, float]]) -> None:
    """`MAX_CALLS` Fetch calls on one connection that send their headers and never their request
    (the streams stay open, pings answered); how each ended, and when (seconds from the start),
    added to `ended` as it ends."""
    never = asyncio.Event()

    async def no_request() -> AsyncIterator[bytes]:
        await never.wait()  # the stall itself: no request, ever
        yield b""

    async def end_of(call: Any, started: float) -> None:
        code = await call.code()
        ended.append((f"{code.name}: {await call.details()}", time.monotonic() - started))

    async with grpc.aio.insecure_channel(address) as channel:
        fetch = channel.stream_stream(
            "/cluster.v1.PeerState/Fetch", request_serializer=bytes, response_deserializer=bytes
        )
        started = time.monotonic()
        calls = [fetch(no_request(), timeout=SILENT_CALL_S) for _ in range(MAX_CALLS)]
        await asyncio.gather(*(end_of(call, started) for call in calls))
        never.set()


def test_an_outsiders_silent_calls_are_cut_at_the_deadline_while_a_member_fetches(
    loop: BackgroundLoop, serving: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The outsider (no token, another address: 127.0.0.2 through a proxy) opens as many calls
    as gRPC holds and sends none of their requests: its address's share waits, the rest are
    turned away at once, a member's fetch is served meanwhile, and the share is cut once its
    requests are `FIRST_MESSAGE_S` late. Without the bound, the outsider held every call the
    server takes until it let go, and every member's fetch was refused."""
    caplog.set_level(logging.WARNING, logger="cluster.worker")
    proxy = Proxy(("127.0.0.1", serving.server.port), source="127.0.0.2")
    outsider = BackgroundLoop("test-outsider")
    ended: list[tuple[str, float]] = []
    try:
        attack = asyncio.run_coroutine_threadsafe(
            silent_fetches(f"127.0.0.1:{proxy.port}", ended), outsider.loop
        )
        wait_until(lambda: len(ended) >= MAX_CALLS // 2, 10, "the outsider's calls turned away")
        dest = tmp_path / "newcomer" / checkpoint_files.file_name("net", STEP)
        dest.parent.mkdir()
        fetched = state_fetch.fetch(loop, [serving.holder], wanted(), dest)
        assert fetched.holder == serving.holder
        share = state_server.ARRIVALS_PER_PEER
        assert serving.server.arrivals.waiting == share  # the outsider's, held meanwhile
        assert not attack.done()
        attack.result(SILENT_CALL_S + 5)
    finally:
        outsider.stop()
        proxy.close()
    crowded = [(how, at) for how, at in ended if "wait for their request already" in how]
    cut = [(how, at) for how, at in ended if "no request within 5 s" in how]
    assert len(crowded) == MAX_CALLS - share
    assert {how.split(":")[0] for how, _ in crowded} == {"RESOURCE_EXHAUSTED"}
    assert "from 127.0.0.2 " in crowded[0][0]
    assert len(cut) == share
    assert {how.split(":")[0] for how, _ in cut} == {"DEADLINE_EXCEEDED"}
    assert all(state_server.FIRST_MESSAGE_S <= at < SILENT_CALL_S for _, at in cut)
    assert serving.server.arrivals.waiting == 0
    assert serving.server.refused == {
        "RESOURCE_EXHAUSTED": MAX_CALLS - share,
        "DEADLINE_EXCEEDED": share,
    }
    logged = [r.getMessage() for r in caplog.records if "state server: refused" in r.getMessage()]
    assert any("127.0.0.2" in line and "no request within 5 s" in line for line in logged)
    assert len(logged) < MAX_CALLS // 4  # told at a bounded rate


def test_the_state_server_is_stopped_at_exit_once_however_many_jobs_started_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each job of a process starts its state server anew: its stop at exit is registered once,
    not once per job (atexit keeps every registration to the process's end)."""
    registered: list[object] = []

    def unregister(func: object) -> None:  # as atexit's: every registration of func goes
        registered[:] = [f for f in registered if f != func]

    exits = SimpleNamespace(register=registered.append, unregister=unregister)
    session = SimpleNamespace(config=SimpleNamespace(tls=None, sched_host="127.0.0.1"))
    monkeypatch.setattr(api_peer_state, "atexit", exits)
    monkeypatch.setattr(api_peer_state, "_service", None)
    monkeypatch.setattr(runtime, "session", lambda: session)
    monkeypatch.setattr(runtime, "on_finalize", lambda closer: None)
    monkeypatch.setattr(api_peer_state, "_start_server", lambda loop: None)
    for _ in range(3):  # three jobs, one after the other
        api_peer_state._started()
        api_peer_state.stop()
    assert registered == [api_peer_state.stop]
