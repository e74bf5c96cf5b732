"""A client's way to the scheduler: one grpc.aio channel, plaintext or mutual TLS, and a check.

`open_channel` is what the worker agent and `mscluster status` use. With TLS, grpc verifies that
the scheduler's certificate comes from the CA and names the host, but it cannot consult a CRL and
says no more than "unavailable" when the two sides disagree about TLS. So `check_scheduler` makes
one handshake of its own first, with Python's ssl and the same CA, client certificate, name and
cipher list: it refuses a scheduler whose certificate is revoked or of another CA, and it tells a
plaintext scheduler from a TLS one in either direction, so a mismatch is one clear error at once
instead of a wait until MS_TOPO_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from cluster.protocol.errors import TLSConfigError
from cluster.protocol.parse import lookup_name
from cluster.protocol.value import frozen

if TYPE_CHECKING:
    from cluster.transport import tls

# The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with SETTINGS.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS = 0x04
_FRAME_HEADER = 9
# How long a scheduler whose certificate passed a `SchedulerProbe`'s check is taken as checked by
# the agents that share the probe (while the CRL stays the same): long enough for the agents
# that start together to share one check, short enough that a scheduler restarted on the same
# address is checked again.
CHECK_KEPT_S = 30.0
# How long grpc gives one connection attempt (TCP connect, TLS and HTTP/2 handshakes) before it
# abandons it and tries again. grpc takes this from "grpc.min_reconnect_backoff_ms", which is
# not a backoff at all: set to 100 ms with the backoff, it made a burst of 1024 registrations
# on a busy machine open 2,000-2,400 connections instead of 1,024 (each abandoned attempt's
# handshake work wasted, on both sides) and the rendezvous 20% slower. Long enough for a
# handshake queued behind a whole job's; short enough that after a network partition heals
# the next attempt is seconds away, not a SYN retransmission 8 s later (grpc's default is 20 s).
CONNECT_TIMEOUT_MS = 5_000


@frozen
class TLSRemedies:
    """What a process whose TLS differs from the scheduler's is told: `who` it is, what to do
    when the scheduler uses TLS and it does not (`add`), and the other way round (`drop`)."""

    who: str
    add: str
    drop: str


# A worker, a relay or a scheduler's script: started with the job's environment.
NODE_REMEDIES = TLSRemedies(
    who="this node",
    add=(
        "start it with CLUSTER_TLS_CONFIG naming the job's ssl.json (mscluster run --tls-config "
        "does that), or call cluster.set_ps_context(enable_ssl=True, config_file_path=...) "
        "before cluster.init()"
    ),
    drop="start the scheduler with the same CLUSTER_TLS_CONFIG, or run this node without it",
)


def reconnect_options(first_ms: int, ceiling_ms: int) -> list[tuple[str, int]]:
    """Channel options for a client that must find the scheduler soon after it (re)appears:
    retry after `first_ms`, backing off to at most `ceiling_ms`, each attempt bounded by
    CONNECT_TIMEOUT_MS. A refused connection (the scheduler not listening yet) fails at once, so
    short backoffs cost its host next to nothing."""
    return [
        ("grpc.initial_reconnect_backoff_ms", first_ms),
        ("grpc.max_reconnect_backoff_ms", ceiling_ms),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ]


# gRPC's own pings (HTTP/2 PING frames, sent and answered by gRPC's core threads: no Python
# on either side) watch every connection between a node and the scheduler, both ways. A process
# that is stopped, or cut off without its connection closing, stops answering them, and the
# other side's gRPC closes the connection, which ends the node's stream: the scheduler takes the
# node for failed, the node looks for the scheduler again. Pinged every MS_NODE_TIMEOUT / 3 and
# given MS_NODE_TIMEOUT and KEEPALIVE_SLACK_MS to answer, a silent process is found between
# MS_NODE_TIMEOUT and 4/3 of it (and the slack) after it last answered: in a small job always
# after the heartbeats' own limit has found it (so what it is told names the heartbeat), in a
# large one whose heartbeats are rarer (see `config.silence_limit`) long before. Not more often
# than the scheduler lets a client ping (`serving.SERVER_OPTIONS`).
KEEPALIVE_MIN_MS = 1_000
KEEPALIVE_SLACK_MS = 1_000
KEEPALIVE_PINGS_PER_TIMEOUT = 3


def keepalive_ms(node_timeout_s: float) -> tuple[int, int]:
    """How often a peer is pinged, and how long it has to answer, in ms (see KEEPALIVE_MIN_MS):
    gRPC's pings and the local hop's (`cluster.transport.hop_channel`) alike."""
    timeout_ms = int(node_timeout_s * 1000)
    return max(KEEPALIVE_MIN_MS, timeout_ms // KEEPALIVE_PINGS_PER_TIMEOUT), (
        timeout_ms + KEEPALIVE_SLACK_MS
    )


def keepalive_options(node_timeout_s: float | None) -> list[tuple[str, int]]:
    """Channel or server options that make gRPC find a silent peer (see KEEPALIVE_MIN_MS);
    none for None (MS_DISABLE_HEARTBEAT: no silence is looked for)."""
    if node_timeout_s is None:
        return []
    every_ms, answer_ms = keepalive_ms(node_timeout_s)
    return [
        ("grpc.keepalive_time_ms", every_ms),
        ("grpc.keepalive_timeout_ms", answer_ms),
        # Any ping, not only the keepalive's: gRPC has one ping in flight at a time, and a
        # flow-control probe's ping sent just before the peer stopped held the keepalive's back
        # for gRPC's default minute.
        ("grpc.http2.ping_timeout_ms", answer_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Pings go on when nothing else does: a large job's idle connection carries a
        # heartbeat only every minute or so (gRPC stops after 2 pings without data otherwise).
        ("grpc.http2.max_pings_without_data", 0),
    ]


def open_channel(
    address: str, identity: tls.Identity | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A channel to the scheduler at `address`: mutual TLS with `identity`, else plaintext."""
    if identity is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    extra = []
    if identity.server_name:
        extra.append(("grpc.ssl_target_name_override", identity.server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=identity.ca_pem,
        private_key=identity.key_pem,
        certificate_chain=identity.chain_pem,
    )
    return grpc.aio.secure_channel(address, credentials, options=[*options, *extra])


async def close_for_good(channel: grpc.aio.Channel, grace_s: float | None) -> None:
    """Close `channel` once its calls end (`grace_s` at most; None: cancelled now), and let go
    of its connection now: grpc.aio lets a closed channel's connection go only with its calls'
    objects, which sit in reference cycles, and without a collection here the scheduler would
    hold the connection until the process's next full collection (minutes away in a busy
    process)."""
    await channel.close(grace=grace_s)
    gc.collect()


@frozen
class Reach:
    """What `check_scheduler` found: `ok` when the scheduler answers in this node's protocol;
    else `why` it could not be reached: refused (nothing listens), timed out (no answer: the
    address, a firewall, a partition), or accepted and dropped (an overloaded scheduler); ""
    when no cause is known."""

    ok: bool
    why: str = ""


REACHED = Reach(ok=True)


class SchedulerProbe:
    """Checks of schedulers (`check`), and what they found, for the agents that share it: a
    worker session's agent, or the thousand simulated workers of a benchmark process. Checks of
    one scheduler that run together are made once; a scheduler found up, or whose certificate
    passed under the CRL as it is now, is taken as such for CHECK_KEPT_S."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, remedies: TLSRemedies = NODE_REMEDIES
    ) -> None:
        self._clock = clock
        self._remedies = remedies  # what a TLSConfigError of a protocol mismatch says to do
        # (host, port, identity) -> (the CRL it passed under, when)
        self._passed: dict[tuple[str, int, tls.Identity], tuple[object, float]] = {}
        self._running: dict[tuple[Any, ...], asyncio.Future[Reach]] = {}
        self._up: dict[tuple[str, int], float] = {}  # when a check last found host:port up

    async def check(
        self, host: str, port: int, identity: tls.Identity | None, timeout_s: float
    ) -> Reach:
        """Whether the scheduler answers in this node's protocol, and why not when it does not.

        Raises TLSConfigError when it speaks the other protocol, when its certificate is refused
        here (other CA, wrong name, revoked, expired), or when it refuses this node's
        certificate.
        """
        where = f"the scheduler at {_address(host, port)}"
        key = (host, port, identity, asyncio.get_running_loop())
        running = self._running.get(key)
        if running is None:
            check = (
                _check_plaintext(host, port, where, timeout_s, self._remedies)
                if identity is None
                else _check_tls(
                    (host, port),
                    identity,
                    where,
                    timeout_s,
                    functools.partial(self._passed_now, host, port, identity),
                    self._remedies,
                )
            )
            running = asyncio.ensure_future(check)
            self._running[key] = running
            running.add_done_callback(functools.partial(self._checked, key))
        return await asyncio.shield(running)

    def _checked(self, key: tuple[Any, ...], task: asyncio.Future[Reach]) -> None:
        del self._running[key]
        if task.cancelled():
            return
        # Retrieved: every waiter may have given up.
        if task.exception() is None and task.result().ok:
            self._up[key[:2]] = self._clock()
        else:
            self._up.pop(key[:2], None)

    def _passed_now(self, host: str, port: int, identity: tls.Identity) -> None:
        crl = None if identity.revocation is None else identity.revocation.current()
        self._passed[(host, port, identity)] = (crl, self._clock())

    def found_up(self, host: str, port: int) -> bool:
        """Whether the last check of host:port, within CHECK_KEPT_S, found the scheduler there
        and speaking this node's protocol."""
        when = self._up.get((host, port))
        return when is not None and self._clock() - when < CHECK_KEPT_S

    def passed_recently(self, host: str, port: int, identity: tls.Identity) -> bool:
        """Whether the scheduler at host:port passed a check within CHECK_KEPT_S, under the CRL
        as it is now."""
        entry = self._passed.get((host, port, identity))
        if entry is None:
            return False
        crl = None if identity.revocation is None else identity.revocation.current()
        return entry[0] is crl and self._clock() - entry[1] < CHECK_KEPT_S


async def check_scheduler(
    host: str, port: int, identity: tls.Identity | None, timeout_s: float
) -> Reach:
    """One check of the scheduler at host:port, shared with nobody (`SchedulerProbe.check`)."""
    return await SchedulerProbe().check(host, port, identity, timeout_s)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or exc).lower().replace("_", " ")


def _is_alert(exc: ssl.SSLError) -> bool:
    """The peer spoke TLS and refused us (an alert), as opposed to not speaking TLS at all."""
    return "ALERT" in str(exc.reason or "")


async def _open(
    host: str, port: int, context: ssl.SSLContext | None, name: str | None, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | str:
    """A connection (TLS with `context`), the TCP connection and the handshake each bounded by
    `timeout_s`; why not, in words, when there is no TCP connection; what the handshake raised
    when it failed (`_unreached` says why in words)."""
    try:
        sock = await _connect(host, port, timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        return _connect_failure(host, exc, timeout_s)
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(
                sock=sock, ssl=context, server_hostname=name if context else None
            ),
            timeout_s,
        )
    except BaseException:
        sock.close()
        raise


def _unreached(exc: BaseException, timeout_s: float) -> Reach:
    """Not reached, and why, after `_open`'s handshake raised `exc`."""
    if isinstance(exc, asyncio.TimeoutError):
        why = f"it accepts connections but did not answer on one within {timeout_s:g} s"
        return Reach(ok=False, why=f"{why}: {_OVERLOADED}")
    if isinstance(exc, ssl.SSLEOFError | ConnectionError):
        why = f"it accepts connections, then drops them ({_strerror(exc)})"
        return Reach(ok=False, why=f"{why}: {_OVERLOADED}")
    return Reach(ok=False)


_OVERLOADED = "it is overloaded (out of open files? see its log) or hung"


async def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to the first address of `host` that takes one."""
    loop = asyncio.get_running_loop()
    infos = await _addresses(loop, host, port)
    error: BaseException = OSError(f"{host} has no address")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, address), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            error = exc
            continue
        return sock
    raise error


async def await_listening(host: str, port: int, timeout_s: float, every_s: float) -> str:
    """Wait about `timeout_s` until host:port takes a TCP connection (closed at once), trying
    it every `every_s` while every address of `host` refuses them (the pace of `_await_port`).
    Why, in words, when they refused all the while; "" when one took a connection, or when the
    wait cannot tell (no answer, no route, no address: the registration that follows finds out
    and says)."""
    if await _await_port(host, port, timeout_s, every_s, patient=False) is False:
        return _connect_failure(host, ConnectionRefusedError(), timeout_s)
    return ""


async def await_taken(host: str, port: int, timeout_s: float, every_s: float) -> bool:
    """Wait about `timeout_s` until host:port takes a TCP connection (closed at once), trying
    it every `every_s` however a try failed (refused, no answer, no route, no address): whether
    one was taken."""
    return await _await_port(host, port, timeout_s, every_s, patient=True) is True


async def _await_port(
    host: str, port: int, timeout_s: float, every_s: float, *, patient: bool
) -> bool | None:
    """True: a connection was taken; False: none was, trying every `every_s` until `timeout_s`
    had passed; None (not `patient`): a try failed otherwise than refused, and the wait cannot
    tell.

    The pace holds across waits: a wait that ends without a connection ends `every_s` after
    its last try (so up to `every_s` past `timeout_s`), and the next wait's first try comes no
    sooner. A wait shorter than its pace makes one try and waits out the pace; it never ends
    at once, to be called again at once, trying the port as fast as the loop turns."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    infos: list[tuple[Any, ...]] | None = None
    while True:
        tried_at = loop.time()
        try:
            if infos is None:
                infos = await asyncio.wait_for(_addresses(loop, host, port), until - tried_at)
            taken = await _try_addresses(loop, infos, until)
        except (OSError, asyncio.TimeoutError):
            taken = None
        if taken or (taken is None and not patient):
            return taken
        await asyncio.sleep(max(tried_at + every_s - loop.time(), 0.0))
        if loop.time() >= until:
            return False


async def _try_addresses(
    loop: asyncio.AbstractEventLoop, infos: list[tuple[Any, ...]], until: float
) -> bool | None:
    """One connection to the first of `infos` that takes it, closed at once: True; False when
    every one refused; None when one failed otherwise (no answer by `until`, no route)."""
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setblocking(False)
            try:
                await asyncio.wait_for(
                    loop.sock_connect(sock, address), max(until - loop.time(), 0.0)
                )
            except ConnectionRefusedError:
                continue
            except (OSError, asyncio.TimeoutError):
                return None
            return True
    return False


async def _addresses(
    loop: asyncio.AbstractEventLoop, host: str, port: int
) -> list[tuple[Any, ...]]:
    """The addresses of host:port: a numeric host at once, a name through the resolver (an
    ASCII one without the idna codec, `lookup_name`)."""
    name = lookup_name(host)
    try:
        return socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        return await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)


def _connect_failure(host: str, exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return (
            "nothing took the connection (connection refused): the scheduler is not running "
            "(yet), MS_SCHED_HOST / MS_SCHED_PORT point elsewhere, or the scheduler is out of "
            'open files (its log then says "File descriptor limit reached")'
        )
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return (
            f"no answer to a connection attempt within {timeout_s:g} s (timed out): a wrong "
            "MS_SCHED_HOST, a firewall or a network partition, or a scheduler too overloaded "
            "to take connections"
        )
    if isinstance(exc, socket.gaierror):
        return f"{host!r} does not resolve ({_strerror(exc)}): check MS_SCHED_HOST"
    return f"it cannot be reached ({_strerror(exc)}): check MS_SCHED_HOST and the network"


def _strerror(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLEOFError):
        return "closed during the TLS handshake"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


async def _close(writer: asyncio.StreamWriter) -> None:
    # Abort, not close: a TLS close waits for the peer's close_notify, which gRPC never sends,
    # and every worker's start would wait out that timeout.
    writer.transport.abort()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def _speaks_plain_http2(host: str, port: int, timeout_s: float) -> bool:
    try:
        opened = await _open(host, port, None, None, timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    if isinstance(opened, str):
        return False
    reader, writer = opened
    try:
        writer.write(_PREFACE)
        head = await asyncio.wait_for(reader.read(_FRAME_HEADER), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        await _close(writer)
    return len(head) == _FRAME_HEADER and head[3] == _SETTINGS


async def _check_plaintext(
    host: str, port: int, where: str, timeout_s: float, remedies: TLSRemedies
) -> Reach:
    """A TLS hello, no certificate shown or checked: a reply in TLS means a TLS scheduler."""
    try:
        opened = await _open(host, port, plain_probe_context(), host, timeout_s)
    except ssl.SSLEOFError as exc:
        return _unreached(exc, timeout_s)  # taken and dropped
    except ssl.SSLError as exc:
        if not _is_alert(exc):
            return REACHED  # it answered the hello in plaintext HTTP/2: a plaintext scheduler
    except (OSError, asyncio.TimeoutError) as exc:
        return _unreached(exc, timeout_s)
    else:
        if isinstance(opened, str):
            return Reach(ok=False, why=opened)
        await _close(opened[1])
    raise TLSConfigError(f"{where} uses TLS and {remedies.who} does not: {remedies.add}")


async def _check_tls(
    address: tuple[str, int],
    identity: tls.Identity,
    where: str,
    timeout_s: float,
    passed: Callable[[], None],
    remedies: TLSRemedies,
) -> Reach:
    """`passed()` once the scheduler's certificate passed, under the CRL as it is now."""
    from cryptography import x509  # noqa: PLC0415 - TLS only

    from cluster.transport import tls, trust  # noqa: PLC0415 - TLS only

    host, port = address
    name = identity.server_name or host
    try:
        opened = await _open(host, port, client_context(identity), name, timeout_s)
    except ssl.SSLCertVerificationError as exc:
        raise TLSConfigError(_untrusted(where, identity, name, exc)) from None
    except (ConnectionResetError, asyncio.IncompleteReadError, ssl.SSLEOFError) as exc:
        # Dropped mid-handshake: a plaintext scheduler, or an overloaded one.
        if await _speaks_plain_http2(host, port, timeout_s):
            raise TLSConfigError(_plaintext_scheduler(where, identity, remedies)) from None
        return _unreached(exc, timeout_s)
    except ssl.SSLError as exc:
        if not _is_alert(exc) and await _speaks_plain_http2(host, port, timeout_s):
            raise TLSConfigError(_plaintext_scheduler(where, identity, remedies)) from None
        raise TLSConfigError(_refused(where, identity, exc)) from None
    except (OSError, asyncio.TimeoutError) as exc:
        return _unreached(exc, timeout_s)
    if isinstance(opened, str):
        return Reach(ok=False, why=opened)
    reader, writer = opened
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        peer = x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True))
        problem = tls.PeerCheck(identity).problem(peer)
        if problem is not None:
            raise TLSConfigError(
                f"{where} is refused: its certificate ({trust.describe(peer)}) {problem}"
            )
        # In TLS 1.3 the scheduler judges this node's certificate after the handshake, so only
        # its first answer tells whether it accepted it.
        writer.write(_PREFACE)
        try:
            head = await asyncio.wait_for(reader.read(_FRAME_HEADER), timeout_s)
        except ssl.SSLError as exc:
            raise TLSConfigError(_refused(where, identity, exc)) from None
        except (OSError, asyncio.TimeoutError):
            return Reach(ok=False)
        if not head:
            raise TLSConfigError(
                f"{where} closed the connection after the TLS handshake: it did not accept "
                f"this node's certificate ({identity.what}); is it signed by the CA the "
                "scheduler trusts, and not revoked?"
            )
        passed()
        return REACHED
    finally:
        await _close(writer)


def _untrusted(
    where: str, identity: tls.Identity, name: str, exc: ssl.SSLCertVerificationError
) -> str:
    message = str(exc.verify_message or exc.reason)
    if "hostname" in message.lower() or "ip address mismatch" in message.lower():
        return (
            f"{where} is refused: its certificate does not name {name!r} ({message}); reach it "
            "by a name its certificate carries, or set CLUSTER_TLS_SERVER_NAME to one"
        )
    return (
        f"{where} is refused: its certificate does not check out against ca_cert_path "
        f"{identity.settings.ca_cert_path} ({message})"
    )


def _plaintext_scheduler(where: str, identity: tls.Identity, remedies: TLSRemedies) -> str:
    return (
        f"{where} does not use TLS, but {remedies.who} does (TLS config "
        f"{identity.settings.path}): {remedies.drop}"
    )


def _refused(where: str, identity: tls.Identity, exc: ssl.SSLError) -> str:
    reason = _reason(exc)
    if "certificate" in reason or "unknown ca" in reason:
        hint = (
            f"it does not accept this node's certificate ({identity.what}): is it signed by the "
            "CA the scheduler trusts, and not expired?"
        )
    elif "handshake failure" in reason or "protocol version" in reason:
        hint = "no TLS version or cipher suite in common: compare the cipher_list of both sides"
    else:
        hint = "see the scheduler's log"
    return f"{where} refused the TLS handshake ({reason}): {hint}"


@functools.lru_cache(maxsize=8)
def client_context(identity: tls.Identity) -> ssl.SSLContext:
    """Python ssl with this worker's certificate, the CA, TLS >= 1.2 and the cipher list."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - TLS only

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(":".join(identity.settings.ciphers))
    context.set_alpn_protocols(["h2"])
    context.load_verify_locations(cadata=identity.ca_pem.decode())
    # The ssl module loads keys from files only: the key goes there encrypted with a one-time
    # password that never leaves memory, and the file is gone when this returns.
    import tempfile  # noqa: PLC0415 - TLS only; with shutil and the compressors, 5 ms to import

    one_time = os.urandom(32)
    encrypted = identity.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(one_time),
    )
    with tempfile.NamedTemporaryFile(prefix="cluster-tls-", suffix=".pem") as handle:
        handle.write(identity.chain_pem + encrypted)
        handle.flush()
        context.load_cert_chain(handle.name, password=one_time)
    return context


def plain_probe_context() -> ssl.SSLContext:
    """A context that only asks "do you speak TLS?": no certificate is shown or checked."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context
