"""A connection to an etcd v3 cluster for the state store: aetcd clients, one per endpoint.

aetcd (the maintained asyncio etcd v3 client) talks to one endpoint over a plaintext channel.
This module gives it what a scheduler needs beyond that: every endpoint of CLUSTER_STATE_URL,
tried in turn when the current one fails (a killed or partitioned member costs one request
timeout, not the job), mutual TLS for etcds:// (grpc credentials made here, with the
server name of each endpoint), and etcd's user/password authentication. Each client is handed a
channel made here; the requests, the leases and the watches are aetcd's.

Authentication is etcd's token flow, done here: aetcd logs in only inside its own `connect()`,
which makes a plaintext channel to one address and which we bypass (`_attach`), and it never
logs in again when a token ends. So each client calls `Auth.Authenticate` on its channel before
its first request, sends the token as the `token` metadata of every call (aetcd reads
`client.metadata`), and logs in again, once, when etcd says the token is no longer valid
(etcd's simple tokens end after --auth-token-ttl idle seconds, and on a password change).

A refusal that retrying cannot cure (authentication required, a wrong user or password, no
permission on the prefix) is an `EtcdRefused` in one line that says what to set.

Every failure that names etcd becomes a StateFileError (`EtcdUnavailable` when no member
answered), so the scheduler's saving treats it as any failed save: retried, never told.
aetcd is imported only when an etcd URL is used (the `mscluster-grpc[etcd]` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from cluster.protocol.errors import ConfigError, EtcdRefused, EtcdUnavailable, StateFileError
from cluster.protocol.state_url import PASSWORD_FILE_ENV, STATE_URL_ENV, USER_ENV, StateUrl

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


def import_aetcd(named: str = STATE_URL_ENV) -> Any:
    """aetcd, the etcd client of the `etcd` extra; a ConfigError naming `named` (the setting
    that names an etcd URL) and what to install, where it is not installed."""
    try:
        import aetcd  # noqa: PLC0415 - the etcd store is optional
    except ImportError:
        raise ConfigError(
            f"{named} names etcd, but the etcd client is not installed: "
            "pip install 'mscluster-grpc[etcd]' (it adds aetcd)"
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
        login: tuple[str, str] | None = None,
    ) -> None:
        """`login`: (user, password) for an etcd with authentication on."""
        if url.tls and credentials is None:
            raise ConfigError(f"{url} uses TLS (etcds://) but no CA was given for it")
        self.url = url
        self.timeout_s = timeout_s
        self._aetcd = import_aetcd()
        self._credentials = credentials
        self._clients: dict[int, aetcd.Client] = {}
        self._current = 0
        self.last_error = ""
        self._login = login
        self._logged_in: set[int] = set()  # the endpoints whose client holds a token

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
        errors, late = [], []
        count = len(self.url.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            try:
                result = await self._request(index, request)
            except EtcdRefused:
                raise
            except Exception as exc:
                problem = describe(exc)
                if not unavailable(exc):
                    self._refused(exc)
                    raise StateFileError(
                        f"etcd refused to {what}: {problem}{_advice(problem)}"
                    ) from None
                errors.append(f"{self._name(index)}: {problem}")
                if _late(exc, problem):
                    late.append(self._name(index))
                continue
            if index != self._current:
                log.info("etcd: now using %s (%s)", self._name(index), "; ".join(errors))
                self._current = index
            self.last_error = ""
            return result
        self.last_error = "; ".join(errors)
        raise EtcdUnavailable(
            f"cannot {what}: no etcd member of {self.url} answered ({self.last_error})"
            f"{_no_quorum_hint(late)}"
        )

    async def _request(self, index: int, request: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """`request` on endpoint `index`, logged in first where a login is set; once more
        after logging in again when etcd says the token is no longer valid."""
        client = self.client(index)
        if self._login is None:
            return await request(client)
        if index not in self._logged_in:
            await self._authenticate(index, client)
        try:
            return await request(client)
        except Exception as exc:
            if not token_ended(exc):
                raise
        log.info("etcd: the token of %s ended; logging in again", self._name(index))
        await self._authenticate(index, client)
        return await request(client)

    async def _authenticate(self, index: int, client: aetcd.Client) -> None:
        """Log in on `client`'s channel; its token goes in the metadata of its later calls."""
        assert self._login is not None
        user, password = self._login
        self._logged_in.discard(index)
        rpc = self._aetcd.rpc
        try:
            reply = await rpc.AuthStub(client.channel).Authenticate(
                rpc.AuthenticateRequest(name=user, password=password), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if "authentication is not enabled" in details:
                log.warning(
                    "etcd at %s has authentication off: %s is not needed there, and the "
                    "job's keys are open to whoever reaches etcd",
                    self._name(index),
                    USER_ENV,
                )
                reply = None
            elif "invalid user ID or password" in details:
                raise EtcdRefused(
                    f"etcd at {self.url} refused the scheduler: wrong user or password (user "
                    f"{user!r}): set {USER_ENV} and {PASSWORD_FILE_ENV}"
                ) from None
            else:
                raise
        metadata = None if reply is None else (("token", reply.token),)
        client.metadata = metadata
        client._watcher._metadata = metadata
        self._logged_in.add(index)

    def _refused(self, exc: BaseException) -> None:
        """Raise EtcdRefused when `exc` is etcd refusing this client itself."""
        details = describe(exc)
        if "user name is empty" in details or (
            self._login is None and "invalid auth token" in details
        ):
            raise EtcdRefused(
                f"etcd at {self.url} refused the scheduler: authentication required: set "
                f"{USER_ENV} and {PASSWORD_FILE_ENV}"
            )
        if _status(exc) is grpc.StatusCode.PERMISSION_DENIED:
            who = "the anonymous user" if self._login is None else f"user {self._login[0]!r}"
            raise EtcdRefused(
                f"etcd at {self.url} refused the scheduler: {who} may not read and write "
                f"{self.url.prefix}: grant its role readwrite on that prefix (etcdctl role "
                f"grant-permission ROLE --prefix=true readwrite {self.url.prefix})"
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


# What a member says, or its caller, when it took a request and did not answer it in time.
_LATE = ("deadline exceeded", "request timed out", "no leader", "leader changed")


def _late(exc: BaseException, problem: str) -> bool:
    """Whether a member did not answer in time, rather than refuse the connection."""
    if isinstance(exc, asyncio.TimeoutError) or _status(exc) is grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return any(said in problem.lower() for said in _LATE)


def _no_quorum_hint(late: list[str]) -> str:
    """What members that did not answer in time (`late`) may mean: etcd without a quorum."""
    if not late:
        return ""
    return (
        f"; {', '.join(late)} did not answer in time: an etcd member that runs answers nothing "
        "while etcd has lost its quorum (fewer than a majority of its members running and in "
        "touch: start the ones that are down; `etcdctl endpoint health` names them), and a "
        "member that is overloaded or cut off does the same"
    )


# What etcd says of a write once its database is over its space quota (the NOSPACE alarm is on).
NO_SPACE = "database space exceeded"


def no_space(exc: BaseException) -> bool:
    """Whether `exc` is etcd refusing a write for want of space (NOSPACE)."""
    return NO_SPACE in str(exc)


def _advice(problem: str) -> str:
    """What to do about `problem`, etcd's refusal, where a line can say it."""
    if NO_SPACE not in problem:
        return ""
    return (
        " (etcd's database is over its space quota, --quota-backend-bytes, and its NOSPACE "
        "alarm is on: it refuses every write of every job until an operator frees space and "
        "disarms the alarm: etcdctl compact REVISION (the newest: etcdctl endpoint status -w "
        "json), etcdctl defrag on each member, etcdctl alarm disarm; see 'etcd out of space' "
        "in docs/howto/standbys.md)"
    )


# What etcd says of a token it no longer knows (ended, or its user's password changed) or of one
# issued before the auth store changed (a role granted, a user added): log in again.
_TOKEN_ENDED = ("invalid auth token", "revision of auth store is old")


def token_ended(exc: BaseException) -> bool:
    details = describe(exc)
    return any(said in details for said in _TOKEN_ENDED)


def describe(exc: BaseException) -> str:
    """One line for an etcd failure."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.aio.AioRpcError):
            return f"{seen.code().name}: {seen.details() or ''}".rstrip(": ")
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """What `awaitable` gives, or asyncio.TimeoutError after `timeout_s` (it is cancelled
    then). A cancel of the caller always raises CancelledError here: asyncio.wait_for before
    Python 3.12 returns the result instead when the cancel lands just as the awaitable ends,
    and a loop cancelled that way (the election's, at a hand-over) would go on forever."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((task,), timeout=max(timeout_s, 0.0))
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)
    if not done:
        raise asyncio.TimeoutError
    return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark the outcome of a task given up on as seen (no 'never retrieved' warning)."""
    if not task.cancelled():
        task.exception()
