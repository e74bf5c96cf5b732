"""The scheduler's lifecycle: bind, serve until the job is over, drain, stop.

`SchedulerServer` is the library form (an async context manager that binds port 0 in tests and
reports the port it got); `run` is the blocking form used by `cluster.init()` in the scheduler
role and by `mscluster scheduler`, returning the process exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from types import TracebackType

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import ClusterConfig
from cluster.errors import ConfigError
from cluster.scheduler.core import CoreSettings, SchedulerCore
from cluster.scheduler.servicer import SchedulerServicer
from cluster.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("cluster.scheduler")

SERVICE_NAME = "cluster.v1.Scheduler"
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
]


def settings_from_config(config: ClusterConfig) -> CoreSettings:
    return CoreSettings(
        worker_num=config.worker_num,
        server_num=config.server_num,
        node_timeout_s=config.node_timeout_s,
        topo_timeout_s=config.topo_timeout_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_enabled=config.heartbeat_enabled,
        recovery=config.recovery is not None,
    )


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


class SchedulerServer:
    """A running scheduler. `async with SchedulerServer(...) as server:` binds and serves."""

    def __init__(self, settings: CoreSettings, host: str = "127.0.0.1", port: int = 0) -> None:
        self.core = SchedulerCore(settings)
        self.host = host
        self.requested_port = port
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._monitor: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return bind_address(self.host, self.port)

    async def start(self) -> int:
        check_bindable(self.host, self.requested_port)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(self.core), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        where = bind_address(self.host, self.requested_port)
        try:
            self.port = server.add_insecure_port(where)
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
        settings = self.core.settings
        log.info(
            "listening on %s for %s%s",
            self.address,
            _count(settings.worker_num, "worker"),
            f" and {_count(settings.server_num, 'server')}" if settings.server_num else "",
        )
        return self.port

    async def wait_done(self) -> bool:
        """Wait until the job is over; True when every node finished."""
        await self.core.done.wait()
        return self.core.ok

    async def stop(self, drain_s: float = DRAIN_S) -> None:
        """Give the nodes `drain_s` to hear the end, then stop."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.core.streams_closed.wait(), max(deadline - loop.time(), 0))
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self._server.stop(grace=0.5)
        self._server = None

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
            self.core.abort("scheduler stopped")
        await self.stop(drain_s=0.5)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


async def serve(config: ClusterConfig) -> int:
    """Serve one job; the process exit code: 0 when every node finished, 1 otherwise."""
    server = SchedulerServer(settings_from_config(config), config.sched_host, config.sched_port)
    await server.start()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(
            signum, server.core.abort, f"scheduler stopped by {signal.Signals(signum).name}"
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
