"""The scheduler's lifecycle: bind, serve until the job is over, drain, stop.

`SchedulerServer` is the library form (an async context manager that binds port 0 in tests and
reports the port it got); `run` is the blocking form used by `cluster.init()` in the scheduler
role and by `mscluster scheduler`, returning the process exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.protocol.config import ClusterConfig, ObserveConfig
from cluster.protocol.errors import ConfigError, StateFileError
from cluster.protocol.settings import JobSettings
from cluster.scheduler import limits
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.observe import Observability
from cluster.scheduler.servicer import SchedulerServicer, add_to_server
from cluster.storage.store import RecoveryLock
from cluster.transport import channel
from cluster.transport import tls as tls_module

log = logging.getLogger("cluster.scheduler")

SERVICE_NAME = "cluster.v1.Scheduler"
IDLE_CONNECTION_MS = 10_000
# Stopped (SIGTERM, SIGINT) while saves of the recovery state fail: how long it keeps trying to
# save what was decided before it stops anyway, leaving the older state on disk.
STOP_SAVE_WAIT_S = 3.0  # with the server's own stop, within the launcher's 5 s before SIGKILL
# After the job ends, how long the nodes get to receive the final event before the server stops.
DRAIN_S = 2.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    # grpc enables SO_REUSEPORT by default, which would let a second scheduler bind the same port
    # without an error and steal half the connections.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Nodes keep one stream open for the whole job and ping it; allow that.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.max_concurrent_streams", 100_000),
    # A connection holds a file descriptor: one that does not finish its handshake (TLS and
    # HTTP/2 settings) in time is dropped. The time is the one a node gives a connection attempt
    # before it abandons it and tries again, so no real node is refused by it; 2,000 idle
    # sockets held for grpc's default of 2 minutes kept every real node out.
    ("grpc.server_handshake_timeout_ms", channel.CONNECT_TIMEOUT_MS),
    # A connection with no call for this long is closed (GOAWAY). A node is never idle: it keeps
    # its Watch stream open. Status pollers reconnect when they next ask.
    ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
]
# Calls a node may have open at once: its Watch stream, its Heartbeat stream, and one call of
# its own (a collective, a store call, Finish, a checkpoint report).
CALLS_PER_NODE = 4
# Room for calls of anyone else (`mscluster status`, the health service, a stray client).
CALLS_BESIDE_NODES = 3000


def pending_calls_limit(nodes: int) -> int:
    """How many calls gRPC may hold for the scheduler before it has taken them up."""
    return CALLS_PER_NODE * nodes + CALLS_BESIDE_NODES


def server_options(nodes: int) -> list[tuple[str, int]]:
    """SERVER_OPTIONS, with gRPC's queue of calls not yet taken up sized for `nodes`.

    A grpc.aio server takes up one call per method at a time; the calls that arrive meanwhile
    wait in gRPC's queue. Past 1,000 of them gRPC cancels new calls at random, and past 3,000
    all of them (its defaults, "grpc.server.max_pending_requests" and its hard limit): every
    node of a job sends its Watch at start and its Finish at the end, so a job of 1,536 nodes
    had registrations and finishes cancelled by gRPC itself (CANCELLED), and a node whose Finish
    was cancelled left, which the scheduler took for a death. The queue holds what the nodes
    can send at once; past it, calls are refused, not queued without end.
    """
    limit = pending_calls_limit(nodes)
    return [
        *SERVER_OPTIONS,
        ("grpc.server.max_pending_requests", limit),
        ("grpc.server.max_pending_requests_hard_limit", limit),
    ]


def check_bindable(host: str, port: int) -> None:
    """Fail with a precise ConfigError where grpc would only say "failed to bind"."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"the scheduler cannot listen on {host!r}: MS_SCHED_HOST does not resolve "
            f"({exc.strerror}); use an address or host name of this machine"
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            where = bind_address(host, port)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"the scheduler cannot listen on {where}: the port is already in use "
                    "(another scheduler still running?); free it or choose another MS_SCHED_PORT"
                ) from None
            raise ConfigError(
                f"the scheduler cannot listen on {where}: {exc.strerror} (MS_SCHED_HOST must be "
                "an address of the machine the scheduler runs on)"
            ) from None


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


if TYPE_CHECKING:  # generic in grpc-stubs only
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    Check = Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]
else:
    _Interceptor = grpc.aio.ServerInterceptor


class PeerCertificateCheck(_Interceptor):
    """Refuses every call whose client certificate is revoked (by the CRL as it is at that call)
    or expired. gRPC checked the CA at the handshake; it has no CRL, and a connection outlives
    the moment a certificate is revoked."""

    def __init__(self, check: tls_module.PeerCheck) -> None:
        self._check = check

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        return None if handler is None else _guarded(handler, self._refuse)

    async def _refuse(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        pems = list(context.auth_context().get("x509_pem_cert", []))
        if not pems:
            problem = "this node presented no client certificate"
        else:
            cert = self._check.certificate(pems[0])
            found = self._check.problem(cert)
            if found is None:
                return
            problem = f"this node's certificate ({tls_module.describe(cert)}) {found}"
        log.warning("refused a call from %s: %s", context.peer(), problem)
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{problem}: use a valid certificate of the job's CA",
        )


def _guarded(
    handler: grpc.RpcMethodHandler[Any, Any], check: Check
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler, with `check` run before its behaviour on every call."""

    def wrap(behavior: Any) -> Any:
        if inspect.isasyncgenfunction(behavior):

            async def streaming(request: Any, context: Any) -> Any:
                await check(context)
                async for response in behavior(request, context):
                    yield response

            return streaming

        async def unary(request: Any, context: Any) -> Any:
            await check(context)
            return await behavior(request, context)

        return unary

    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attribute, make in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make(
                wrap(behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def server_credentials(identity: tls_module.Identity) -> grpc.ServerCredentials:
    """Mutual TLS: the scheduler's certificate, and a client certificate of the CA required."""
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.chain_pem)],
        root_certificates=identity.ca_pem,
        require_client_auth=True,
    )


class SchedulerServer:
    """A running scheduler. `async with SchedulerServer(...) as server:` binds and serves.

    With `tls` (see `cluster.tls.prepare`) it serves mutual TLS only, and re-checks its own
    certificate's expiry every `expiry_check_period_s`. With `recovery_path` it locks that
    directory, resumes the job saved there (if any) and saves the job's state there.
    """

    def __init__(
        self,
        settings: JobSettings,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: tls_module.Identity | None = None,
        expiry_check_period_s: float = tls_module.EXPIRY_CHECK_PERIOD_S,
        recovery_path: Path | None = None,
        observe: ObserveConfig | None = None,
    ) -> None:
        self.core = SchedulerCore(settings)
        # The event log and metrics (cluster.scheduler.observe); `observing.metrics_port`.
        self.observing = Observability(observe or ObserveConfig(), host)
        self.recovery_path = recovery_path
        self._lock: RecoveryLock | None = None
        self.host = host
        self.requested_port = port
        self.port = 0
        self.tls = tls
        self._expiry_check_period_s = expiry_check_period_s
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._monitor: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()
        # Set by `stop` when it had to stop with decided changes not on disk.
        self.unsaved: str | None = None

    @property
    def address(self) -> str:
        return bind_address(self.host, self.port)

    async def start(self) -> int:
        check_bindable(self.host, self.requested_port)
        if self.recovery_path is not None:
            self._lock = RecoveryLock(self.recovery_path)
            self._lock.acquire()
        try:
            return await self._start()
        except BaseException:
            await self.observing.stop()
            if self.core.persister is not None:
                await self.core.persister.stop(0)
            self._release_lock()
            raise

    async def _start(self) -> int:
        if self.recovery_path is not None:
            self.core = SchedulerCore.recovering(self.core.settings, self.recovery_path)
        await self.observing.start(self.core)
        if self.recovery_path is not None:
            await self._save_first_state()
        self._raise_open_files()
        interceptors: list[_Interceptor] = [
            *([] if self.tls is None else [PeerCertificateCheck(tls_module.PeerCheck(self.tls))]),
            *self.observing.interceptors(),
        ]
        settings = self.core.settings
        server = grpc.aio.server(
            options=server_options(settings.worker_num + settings.server_num),
            interceptors=interceptors,
        )
        add_to_server(SchedulerServicer(self.core), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        where = bind_address(self.host, self.requested_port)
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(where)
            else:
                self.port = server.add_secure_port(where, server_credentials(self.tls))
        except RuntimeError as exc:
            raise ConfigError(
                f"the scheduler cannot listen on {where}: the port is in use or the address is "
                f"not one of this host's ({exc}); check MS_SCHED_HOST / MS_SCHED_PORT"
            ) from None
        if self.port == 0:
            raise ConfigError(
                f"the scheduler cannot listen on {where}; check MS_SCHED_HOST / MS_SCHED_PORT"
            )
        await server.start()
        self._server = server
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._monitor = asyncio.create_task(self.core.monitor())
        log.info(
            "listening on %s for %s%s%s",
            self.address,
            _count(settings.worker_num, "worker"),
            f" and {_count(settings.server_num, 'server')}" if settings.server_num else "",
            "" if self.tls is None else f" (mutual TLS, {self.tls.what})",
        )
        if self.tls is not None:
            for warning in tls_module.expiry_warnings(self.tls):
                log.warning("%s", warning)
            self._expiry = asyncio.create_task(
                tls_module.recheck_expiry(self.tls, log.warning, self._expiry_check_period_s)
            )
        return self.port

    async def _save_first_state(self) -> None:
        """The job id is on disk before any node hears it (or a restart would deny it)."""
        persister = self.core.persister
        assert persister is not None
        try:
            await persister.save_first()
        except StateFileError as exc:
            raise ConfigError(f"MS_RECOVERY_PATH is not usable: {exc}") from None
        persister.start()
        if self.core.restored_note:
            log.info("%s", self.core.restored_note)

    def _raise_open_files(self) -> None:
        files = limits.raise_open_files()
        log.info("%s", files.describe())
        warning = files.too_low(self.core.settings.expected)
        if warning is not None:
            log.warning("%s", warning)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    async def wait_done(self) -> bool:
        """Wait until the job is over (or, after `request_stop`, at most STOP_SAVE_WAIT_S more
        for its end to be saved); True when every node finished."""
        done = asyncio.ensure_future(self.core.done.wait())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait((done, stop), return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                await asyncio.wait((done,), timeout=STOP_SAVE_WAIT_S)
        finally:
            done.cancel()
            stop.cancel()
        return self.core.ok and self.core.done.is_set()

    def request_stop(self, reason: str) -> None:
        """End the job as failed (a signal, an operator) and stop serving soon: at once when
        that end is saved, after STOP_SAVE_WAIT_S when saves fail."""
        self.core.abort(reason)
        self._stop_requested.set()

    async def stop(self, drain_s: float = DRAIN_S) -> None:
        """Give the nodes `drain_s` to hear the end, then stop. (An end that could not be
        saved was not told: then there is nothing to hear.)"""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        ended = self.core.done.is_set()
        if ended:
            # The nodes hear the end on their streams and close them, and their heartbeats.
            closed = asyncio.gather(self.core.streams_closed.wait(), self.core.beats_closed.wait())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closed, drain_s)
        for task in (self._monitor, self._expiry):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._server.stop(grace=0.5)
        self._server = None
        persister = self.core.persister
        if persister is not None and not await persister.stop(STOP_SAVE_WAIT_S if ended else 0):
            self.unsaved = (
                f"stopped with decided changes not saved: the recovery state in "
                f"{persister.path} is older than what this scheduler decided ({persister.error})"
                "; the nodes were not told of those changes, so a scheduler started again on "
                "it, once it can be written, resumes the job as saved"
            )
            log.error("%s", self.unsaved)
        await self.observing.stop()
        self._release_lock()

    async def __aenter__(self) -> SchedulerServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.core.done.is_set():
            self.request_stop("scheduler stopped")
            await self.wait_done()
        await self.stop(drain_s=0.5)


def _who_may_join(server: SchedulerServer) -> str:
    secret = server.core.settings.job_secret is not None
    if server.tls is not None:
        return "nodes join with a certificate of the job's CA" + (
            " and proof of the job secret" if secret else ""
        )
    if secret:
        return "nodes join with proof of the job secret (CLUSTER_JOB_SECRET_FILE)"
    return (
        "the job is open: any process that reaches this port can join it (no TLS and no job "
        "secret; set CLUSTER_JOB_SECRET_FILE on every process of the job to close it)"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


async def serve(config: ClusterConfig) -> int:
    """Serve one job; the process exit code: 0 when every node finished, 1 otherwise."""
    identity = None if config.tls is None else tls_module.prepare(config.tls, server=True)
    server = SchedulerServer(
        JobSettings.from_config(config),
        config.sched_host,
        config.sched_port,
        tls=identity,
        recovery_path=None if config.recovery is None else config.recovery.path,
        observe=config.observe,
    )
    await server.start()
    log.info("%s", _who_may_join(server))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(
            signum, server.request_stop, f"scheduler stopped by {signal.Signals(signum).name}"
        )
    try:
        ok = await server.wait_done()
    finally:
        await server.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0 if ok else 1


def run(config: ClusterConfig) -> int:
    """Blocking form of `serve`."""
    return asyncio.run(serve(config))
