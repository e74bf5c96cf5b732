"""What a mutual-TLS gRPC server of the job (the scheduler's, a worker's state server) runs
around every call: the client certificate's check against the CRL and its expiry on each call
(gRPC checks the CA only at the handshake), and the server's mutual-TLS credentials."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from cluster.protocol.display import safe
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
    """Mutual TLS: the job's server certificate, and a client certificate of the CA required."""
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.chain_pem)],
        root_certificates=identity.ca_pem,
        require_client_auth=True,
    )
