"""What a mutual-TLS gRPC server of the job (the scheduler's, a worker's state server) runs
around every call: the client certificate's check against the CRL and its expiry on each call
(gRPC checks the CA only at the handshake), and the server's mutual-TLS credentials, which
follow its files as they are renewed (`ReloadingIdentity`)."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from cluster.protocol.display import safe
from cluster.protocol.errors import TLSConfigError
from cluster.transport import handlers, trust
from cluster.transport import tls as tls_module

log = logging.getLogger("cluster.transport")


if TYPE_CHECKING:  # generic in grpc-stubs only
    Interceptor = grpc.aio.ServerInterceptor[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]
    Check = Callable[[Context], Awaitable[None]]
    # Told of each call refused: its context, its method, the reason (`revoked`, `expired`,
    # `unauthenticated`) and the problem, escaped.
    Tell = Callable[[Context, str, str, str], object]
else:
    Interceptor = grpc.aio.ServerInterceptor


class PeerCertificateCheck(Interceptor):
    """Refuses every call whose client certificate is revoked (by the CRL as it is at that call)
    or expired. gRPC checked the CA at the handshake; it has no CRL, and a connection outlives
    the moment a certificate is revoked.

    Each refusal is told to `tell`: the scheduler's counts every one and tells its log and
    journal of a peer address at a bounded rate (`cluster.scheduler.refusals`). Without it,
    each refusal is a warning in the log.
    """

    def __init__(self, check: tls_module.PeerCheck, tell: Tell | None = None) -> None:
        self._check = check
        self._tell = tell

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rpartition("/")[2]
        return _guarded(handler, functools.partial(self._refuse, method=method))

    async def _refuse(self, context: Context, *, method: str) -> None:
        pems = list(context.auth_context().get("x509_pem_cert", []))
        if not pems:
            reason, problem = "unauthenticated", "this node presented no client certificate"
        else:
            cert = self._check.certificate(pems[0])
            found = self._check.refusal(cert)
            if found is None:
                return
            reason = found[0]
            problem = safe(f"this node's certificate ({trust.describe(cert)}) {found[1]}", 400)
        if self._tell is None:
            log.warning("refused a call from %s: %s", context.peer(), problem)
        else:
            self._tell(context, method, reason, problem)
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

    return handlers.rebuilt(handler, wrap=wrap)


def server_credentials(identity: tls_module.Identity) -> grpc.ServerCredentials:
    """Mutual TLS: the job's server certificate, and a client certificate of the CA required;
    fixed for the server's life (a server of the job serves `ReloadingIdentity.credentials`)."""
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.chain_pem)],
        root_certificates=identity.ca_pem,
        require_client_auth=True,
    )


def _configuration(identity: tls_module.Identity) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(identity.key_pem, identity.chain_pem)], root_certificates=identity.ca_pem
    )


class ReloadingIdentity:
    """A server's identity as its files are now: its p12, CA bundle and ssl.json are read again
    when one of them changes (its time, size or inode), and new connections get what they now
    hold. Connections already open keep what they were made with. Every mutual-TLS server of
    the job serves through one: the scheduler, and each worker's state server (its log lines
    begin with `name`, "state server: ").

    New files are checked as at start (`tls.load_identity`) before they are used: files that do
    not check out (a wrong password, a half-written p12, an expired certificate, one the CA did
    not sign) leave the last good identity in use, with one warning that says why, until the
    files change again. The CRL is read again by its own `Revocation` on every call.

    gRPC asks `fetch` before each new connection's handshake, in a thread of its own, and the
    expiry check asks `refresh` in the event loop; a lock keeps the two apart.
    """

    def __init__(self, identity: tls_module.Identity, name: str = "") -> None:
        self.current = identity
        self._said = f"{name}: " if name else ""  # what begins its log lines
        self._stamp = tls_module.files_stamp(identity.options, identity.settings, identity.server)
        self._served = identity  # the identity gRPC was last given
        self._lock = threading.RLock()

    @property
    def revocation(self) -> trust.Revocation | None:
        return self.current.revocation

    def refresh(self) -> tls_module.Identity:
        """The identity, read again first when a file of it changed since it was read."""
        with self._lock:
            old = self.current
            stamp = tls_module.files_stamp(old.options, old.settings, old.server)
            if stamp == self._stamp:
                return old
            self._stamp = stamp
            try:
                new = tls_module.load_identity(old.options, server=old.server)
            except TLSConfigError as exc:
                log.warning(
                    "%s%s: new connections still get the previous certificate (%s, valid until "
                    "%s); it is read again when the files change",
                    self._said,
                    exc,
                    trust.describe(old.cert),
                    trust.utc_date(old.cert.not_valid_after_utc),
                )
                return old
            if new.settings.ciphers != old.settings.ciphers:
                log.warning(
                    "%scipher_list in %s changed: it takes effect when this process restarts",
                    self._said,
                    new.settings.path,
                )
            self.current = new
        log.info(
            "%sthe TLS files changed: new connections get %s (%s, valid until %s)",
            self._said,
            new.what,
            trust.describe(new.cert),
            trust.utc_date(new.cert.not_valid_after_utc),
        )
        return new

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question before a handshake: the configuration to use from now on, or None
        to keep the one it has."""
        with self._lock:
            try:
                identity = self.refresh()
            except Exception:  # one that raises fails the handshake: serve what it has instead
                log.exception(
                    "%sreading the TLS files again failed; the previous ones are kept", self._said
                )
                return None
            if identity is self._served:
                return None
            self._served = identity
        return _configuration(identity)

    def credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS (a client certificate of the CA required) that follows the files."""
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self.current),
            self.fetch,  # type: ignore[arg-type]  # grpc-stubs leave out None, "no change"
            require_client_authentication=True,
        )
