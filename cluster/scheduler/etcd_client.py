"""A connection to an etcd v3 cluster for the state store: aetcd clients, one per endpoint.

aetcd (the maintained asyncio etcd v3 client) talks to one endpoint over a plaintext channel.
This module gives it what a scheduler needs beyond that: every endpoint of CLUSTER_STATE_URL,
tried in turn when the current one fails (a killed or partitioned member costs one request
timeout, not the job), and mutual TLS for etcds:// (grpc credentials made here, with the
server name of each endpoint). Each client is handed a channel made here; the requests, the
leases and the watches are aetcd's.

Every failure that names etcd becomes a StateFileError (`EtcdUnavailable` when no member
answered), so the scheduler's saving treats it as any failed save: retried, never told.
aetcd is imported only when an etcd URL is used (the `cluster[etcd]` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from cluster.protocol.errors import ConfigError, EtcdUnavailable, StateFileError
from cluster.protocol.state_url import StateUrl

if TYPE_CHECKING:
    import aetcd

log = logging.getLogger("cluster.scheduler")

T = TypeVar("T")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A member that went away is tried again soon after it is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class EtcdCredentials:
    """PEM bytes for etcds://: the CA that signed the members' certificates, and this client's
    certificate chain and key (None: no client certificate)."""

    ca_pem: bytes
    chain_pem: bytes | None = None
    key_pem: bytes | None = None


def _import_aetcd() -> Any:
    try:
        import aetcd  # noqa: PLC0415 - the etcd store is optional
    except ImportError:
        raise ConfigError(
            "CLUSTER_STATE_URL names etcd, but the etcd client is not installed: "
            "pip install 'cluster[etcd]' (it adds aetcd)"
        ) from None
    return aetcd


class EtcdConnection:
    """Requests to whichever member answers, starting with the one that answered last."""

    def __init__(
        self,
        url: StateUrl,
        credentials: EtcdCredentials | None = None,
        *,
        timeout_s: float = 2.0,
    ) -> None:
        if url.tls and credentials is None:
            raise ConfigError(f"{url} uses TLS (etcds://) but no CA was given for it")
        self.url = url
        self.timeout_s = timeout_s
        self._aetcd = _import_aetcd()
        self._credentials = credentials
        self._clients: dict[int, aetcd.Client] = {}
        self._current = 0
        self.last_error = ""

    @property
    def endpoint(self) -> str:
        host, port = self.url.endpoints[self._current]
        return f"{host}:{port}"

    def client(self, index: int | None = None) -> aetcd.Client:
        """The aetcd client of endpoint `index` (the current one by default), made once."""
        index = self._current if index is None else index
        made = self._clients.get(index)
        if made is None:
            made = self._clients[index] = self._make(index)
        return made

    def _make(self, index: int) -> aetcd.Client:
        host, port = self.url.endpoints[index]
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        client = self._aetcd.Client(host=host, port=port, timeout=self.timeout_s)
        creds = self._credentials
        if creds is None:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(
                target,
                grpc.ssl_channel_credentials(creds.ca_pem, creds.key_pem, creds.chain_pem),
                options=CHANNEL_OPTIONS,
            )
        _attach(self._aetcd, client, channel)
        return client

    async def call(self, request: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """`request(client)` on the current member, then on each other one in turn while they
        fail to answer; EtcdUnavailable when none did, another StateFileError when etcd refused
        the request itself."""
        errors = []
        count = len(self.url.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            try:
                result = await request(self.client(index))
            except Exception as exc:
                problem = describe(exc)
                if not unavailable(exc):
                    raise StateFileError(f"etcd refused to {what}: {problem}") from None
                errors.append(f"{self._name(index)}: {problem}")
                continue
            if index != self._current:
                log.info("etcd: now using %s (%s)", self._name(index), "; ".join(errors))
                self._current = index
            self.last_error = ""
            return result
        self.last_error = "; ".join(errors)
        raise EtcdUnavailable(
            f"cannot {what}: no etcd member of {self.url} answered ({self.last_error})"
        )

    def _name(self, index: int) -> str:
        host, port = self.url.endpoints[index]
        return f"{host}:{port}"

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            with contextlib.suppress(Exception):  # closing what may already be gone
                await asyncio.wait_for(client.close(), self.timeout_s)


def _attach(aetcd: Any, client: aetcd.Client, channel: grpc.aio.Channel) -> None:
    """Hand `client` a channel of ours (aetcd makes only plaintext ones, to one address)."""
    rpc = aetcd.rpc
    client.channel = channel
    client.metadata = None
    client.kvstub = rpc.KVStub(channel)
    client.clusterstub = rpc.ClusterStub(channel)
    client.leasestub = rpc.LeaseStub(channel)
    client.maintenancestub = rpc.MaintenanceStub(channel)
    client._watcher = aetcd.watcher.Watcher(
        rpc.WatchStub(channel),
        timeout=client._timeout,
        metadata=None,
    )
    client._connected.set()


# Errors of one member, not of the request: another member may answer it.
_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


def _status(exc: BaseException) -> grpc.StatusCode | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.aio.AioRpcError):
            return seen.code()
        seen = seen.__cause__ or seen.__context__
    return None


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` says a member did not answer (try another) rather than refused."""
    if isinstance(exc, asyncio.TimeoutError | ConnectionError | OSError):
        return True
    code = _status(exc)
    if code is not None:
        return code in _UNAVAILABLE_CODES
    name = type(exc).__name__
    return name in {
        "ConnectionFailedError",
        "ConnectionTimeoutError",
        "InternalError",
        "WatchTimeoutError",
        "ClientError",
    }


def describe(exc: BaseException) -> str:
    """One line for an etcd failure."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.aio.AioRpcError):
            return f"{seen.code().name}: {seen.details() or ''}".rstrip(": ")
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__
