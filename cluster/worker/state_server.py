"""A worker's state server: its checkpoints, sent to a member of the job that takes a rank
without them (a promoted spare, a worker restarted on another host), peer to peer.

`StateServer` is a grpc.aio server (service `cluster.v1.PeerState`, one server-streaming
`Fetch`) on the worker's advertised host, port 0, run on an event loop of its own (not the
agent's, so that a transfer or a flood of requests never delays the node's heartbeats, and never
on the training thread). It serves what the `CheckpointManager`s of the process offer
(`cluster.storage.served`): a complete file read as it is on disk, or the step held in memory
encoded as the same bytes, in pieces of `served.PIECE_BYTES`.

Who may fetch: a request proves, with a fresh nonce, the serving token that the worker
published in the job's key-value store (members only; `cluster.protocol.peer_state`); with TLS
on, the server holds the job's server certificate and requires a client certificate of the
job's CA, checked against the CRL on every call, as the scheduler does. As the scheduler's,
its TLS files are read again when they change (`server_tls.ReloadingIdentity`): a renewed p12
is served to new connections without a restart, and files that do not check out leave the last
good certificate in use, said in one line. Every refusal is a status with a message that names
what was wrong, and changes nothing:

- bytes that are not a FetchRequest, or a field out of range (rank, step, prefix, nonce):
  INVALID_ARGUMENT;
- a proof that does not match (a forged token, none) or a nonce seen before (a replay):
  UNAUTHENTICATED;
- more than `max_streams` states being sent at once, or a call that finds `ARRIVALS_PER_PEER`
  calls of its peer's address (`ARRIVALS_TOTAL` in all) waiting for their request:
  RESOURCE_EXHAUSTED;
- no request within `FIRST_MESSAGE_S` of the call's start: DEADLINE_EXCEEDED; the call's end
  before its request: INVALID_ARGUMENT;
- a step this worker does not hold: NOT_FOUND.

Bounds: requests of at most `REQUEST_BYTES`, `max_streams` transfers at once (gRPC itself holds
at most `MAX_CALLS` calls, refusing more), at most `connection_cap` connections at once (gRPC
closes the ones past it as it accepts them: a flood of connections cannot take the training
process's descriptors, which NCCL, the scheduler's channel and checkpoint files need),
connections that do not finish their handshake in 5 s dropped, and idle ones closed after 10 s.
A call waits for its request as the scheduler's do (`handlers.Arrivals`): gRPC counts a call
whose headers came and whose request never does against `MAX_CALLS` for as long as the peer
answers pings: unbounded, `MAX_CALLS` such calls from anyone who reaches the port would refuse
every member's fetch before its proof is read. Calls waiting for their request hold at most
`ARRIVALS_TOTAL` of the `MAX_CALLS` (the rest are for calls whose request came: a member's is
admitted or refused at once), one address at most `ARRIVALS_PER_PEER` of them, each for at most
`FIRST_MESSAGE_S`.
"""

from __future__ import annotations

import collections
import logging
import resource
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cluster.protocol import auth, peer_state
from cluster.storage.served import PIECE_BYTES, ServedCheckpoints
from cluster.transport import channel, edge, handlers, serving, tls
from cluster.transport.server_tls import Interceptor, PeerCertificateCheck, ReloadingIdentity
from cluster.v1 import peer_state_pb2 as pb

log = logging.getLogger("cluster.worker")

# States sent at once by one worker: a newcomer needs one; more are other newcomers (or a flood).
MAX_STREAMS = 4
# Calls gRPC holds at once (refused past it), whatever they are.
MAX_CALLS = 64
# Calls waiting for their request at once, from one peer address and in all: a host's newcomers
# send theirs right behind their headers, so few wait; past either a new call is turned away at
# once, and the calls whose request came always find a free one of the MAX_CALLS.
ARRIVALS_PER_PEER = 4
ARRIVALS_TOTAL = MAX_CALLS // 2
# How long a call may take to send its request (a few hundred bytes) after it started.
FIRST_MESSAGE_S = edge.FIRST_MESSAGE_S
# The status of a call refused before its request, by `handlers.Arrivals`' reason.
_ARRIVAL_CODES = {
    "crowded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "stalled": grpc.StatusCode.DEADLINE_EXCEEDED,
    "empty": grpc.StatusCode.INVALID_ARGUMENT,
}
# A FetchRequest is a few hundred bytes.
REQUEST_BYTES = 4096
IDLE_CONNECTION_MS = 10_000
# Connections held at once, beyond one for each member of the job (each fetches over one).
SPARE_CONNECTIONS = 16
# The share of the process's open-files limit the server may hold at most: the rest is the
# training's.
LIMIT_SHARE = 8
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    # A stranger's large requests are refused unread, and take in the training's process at
    # most a request a stream (a few KiB), not the megabytes gRPC would read ahead.
    *serving.one_message_ahead(REQUEST_BYTES),
    ("grpc.max_send_message_length", PIECE_BYTES + 4096),
    ("grpc.server_handshake_timeout_ms", channel.CONNECT_TIMEOUT_MS),
    ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
]


def connection_cap(worker_num: int, limit: int | None = None) -> int:
    """The connections the server holds at once: every member fetching at once and some to
    spare, but at most 1/LIMIT_SHARE of `limit` (this process's soft open-files limit when
    None)."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return worker_num + SPARE_CONNECTIONS
    return max(1, min(worker_num + SPARE_CONNECTIONS, limit // LIMIT_SHARE))


class StateServer:
    """The state server of one worker process; `start()` and `stop()` on its event loop."""

    def __init__(
        self,
        host: str,
        worker_num: int,
        identity: tls.Identity | None = None,
        *,
        max_streams: int = MAX_STREAMS,
        max_connections: int | None = None,
    ) -> None:
        self.host = host
        self.worker_num = worker_num
        self.max_streams = max_streams
        self.max_connections = (
            connection_cap(worker_num) if max_connections is None else max_connections
        )
        self.token = peer_state.new_token()
        self.port = 0
        self.sent = 0  # states sent whole
        self.refused: collections.Counter[str] = collections.Counter()
        self._identity = identity
        self._served: dict[str, ServedCheckpoints] = {}
        self._replays = auth.ReplayCache()
        self._active = 0
        self._server: grpc.aio.Server | None = None
        self.arrivals = handlers.Arrivals(
            per_peer=ARRIVALS_PER_PEER,
            total=ARRIVALS_TOTAL,
            deadline_s=lambda _method: FIRST_MESSAGE_S,
            peer_of=lambda context: handlers.peer_host(context.peer() or ""),
            refuse=self._turned_away,
            server="this state server",
        )

    @property
    def published(self) -> peer_state.Published:
        return peer_state.Published(self.host, self.port, self.token)

    def offer(self, served: ServedCheckpoints) -> None:
        """Serve what `served` holds (replacing what was served under its prefix)."""
        self._served = {**self._served, served.prefix: served}

    def withdraw(self, prefix: str) -> None:
        self._served = {p: s for p, s in self._served.items() if p != prefix}

    async def start(self) -> int:
        """Listen on host, a free port; the port."""
        served = (
            None if self._identity is None else ReloadingIdentity(self._identity, "state server")
        )
        interceptors: list[Interceptor] = []
        if served is not None:
            interceptors.append(PeerCertificateCheck(tls.PeerCheck(served)))
        options = [*SERVER_OPTIONS, ("grpc.max_allowed_incoming_connections", self.max_connections)]
        server = grpc.aio.server(
            options=options, interceptors=interceptors, maximum_concurrent_rpcs=MAX_CALLS
        )
        _add_to_server(_Servicer(self), server, self.arrivals)
        where = f"[{self.host}]:0" if ":" in self.host else f"{self.host}:0"
        if served is None:
            self.port = server.add_insecure_port(where)
        else:
            self.port = server.add_secure_port(where, served.credentials())
        await server.start()
        self._server = server
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop listening; transfers under way get `grace_s` to end, then are cancelled."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)

    async def fetch(
        self, request: pb.FetchRequest | Unparsed, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.FetchChunk]:
        """`request` Unparsed: bytes that did not parse as a FetchRequest (`_parsed`)."""
        if isinstance(request, Unparsed):
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "bad request: not a FetchRequest"
            )
            return
        wanted = peer_state.Request(request.prefix, request.rank, request.step, request.any_rank)
        await self._admit(wanted, request, context)
        served = self._served.get(wanted.prefix)
        source = (
            None
            if served is None
            else served.open(wanted.rank, wanted.step, any_rank=wanted.any_rank)
        )
        if source is None:
            await self._refuse(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"this worker holds no complete checkpoint {wanted.prefix!r} of step "
                f"{wanted.step} for rank {wanted.rank}: ask another peer",
            )
            return
        self._active += 1
        try:
            first = True
            for piece in source.pieces():
                yield pb.FetchChunk(file_bytes=source.nbytes if first else 0, data=piece)
                first = False
            self.sent += 1
        finally:
            self._active -= 1
            source.close()

    async def _admit(
        self,
        wanted: peer_state.Request,
        request: pb.FetchRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Refuse (abort) a request that is invalid, unproven, replayed or one too many."""
        problem = wanted.problem(self.worker_num, request.nonce)
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {problem}")
        if not peer_state.proven(self.token, wanted, request.nonce, request.proof):
            await self._refuse(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "not a member of this job: the request's proof does not match this worker's "
                "serving token (members read it from the job's key-value store)",
            )
        if not self._replays.first_time(request.nonce):
            await self._refuse(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "this request was seen before (a replay): a request is good once; make a new "
                "one with a fresh nonce",
            )
        if self._active >= self.max_streams:
            await self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this worker is sending {self._active} states, as many as it sends at once: "
                "ask another peer, or again later",
            )

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
    ) -> None:
        self._count(context, code, message)
        await context.abort(code, message)

    async def _turned_away(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, reason: str, problem: str
    ) -> None:
        """End a call refused before its request came (`handlers.Arrivals`): counted and logged
        as every refusal. The status is set, not raised: the handler then ends the call."""
        code = _ARRIVAL_CODES[reason]
        self._count(context, code, problem)
        context.set_code(code)
        context.set_details(problem)

    def _count(
        self, context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
    ) -> None:
        self.refused[code.name] += 1
        count = self.refused[code.name]
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a flood does not flood the log
            log.warning(
                "state server: refused a request from %s (%s, %d so far): %s",
                context.peer(),
                code.name,
                count,
                message,
            )


class Unparsed:
    """What `_parsed` hands `fetch` for bytes that are not a FetchRequest (not None: None is a
    call `handlers.Arrivals` refused)."""


def _parsed(data: bytes) -> pb.FetchRequest | Unparsed:
    """A FetchRequest, or an Unparsed for bytes that are not one (refused by `fetch`: left to
    gRPC, they would end as UNKNOWN with the parser's exception)."""
    try:
        return pb.FetchRequest.FromString(data)
    except DecodeError:
        return Unparsed()


def _add_to_server(
    servicer: _Servicer, server: grpc.aio.Server, arrivals: handlers.Arrivals
) -> None:
    """`add_PeerStateServicer_to_server`, with a request that does not parse handed to `fetch`
    as an Unparsed, and each call's request awaited by `arrivals` (within its time, or refused)."""
    fetch = grpc.unary_stream_rpc_method_handler(
        servicer.Fetch,
        request_deserializer=_parsed,
        response_serializer=pb.FetchChunk.SerializeToString,
    )
    methods = {"Fetch": arrivals.wrap("Fetch", fetch)}
    service = "cluster.v1.PeerState"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    server.add_registered_method_handlers(service, methods)  # type: ignore[attr-defined]  # missing from grpc-stubs


class _Servicer:
    """What `_add_to_server` registers: `Fetch`, served by the StateServer."""

    def __init__(self, server: StateServer) -> None:
        self._server = server

    async def Fetch(
        self, request: pb.FetchRequest | Unparsed, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.FetchChunk]:
        async for chunk in self._server.fetch(request, context):
            yield chunk
