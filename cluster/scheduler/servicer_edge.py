"""What every call of the scheduler's servicer meets around its handler: no wire format here.

`ServicerEdge` is the base of `cluster.scheduler.servicer.SchedulerServicer`, which adds the
handlers, call family by call family. It holds the gate (`cluster.scheduler.gate`: which core
answers, or a refusal naming the leader) and what the servicer keeps of the connections: the
peers that carry an admitted Watch stream (a member's, whose descriptors are never shed), the
connection of each node's admitted stream, each node's Heartbeat stream, the calls that still
wait for their first message (`handlers.Arrivals`) and the host calls open (`HostCalls`). A call
refused before it reaches the job is counted and told at a bounded rate (`at_edge`); a member's
calls are refused unread when they name no member (`named`) and counted to their member once
their request came (`counted`); reading the job needs the job secret's
proof (`_check_reader`).

A failure becomes a status code and its kind in the trailing metadata through the one table of
`cluster.transport.failures` (`refuse`). A code is set on the call, not raised with
`context.abort`: an aborted call's request stays reachable from the exception's frames until the
garbage collector runs, so a flood of refused 4 MiB calls held hundreds of MiB. Who a call comes
from is read from its metadata (`cluster.transport.membership`: `caller_of`) and admitted by the
core.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

import grpc

from cluster.protocol import auth, version
from cluster.protocol.display import safe
from cluster.protocol.errors import (
    BadRequestError,
    CapacityError,
    ClusterError,
    CrowdedError,
    NotAuthenticatedError,
    NotLeaderError,
    RegistrationRefused,
)
from cluster.scheduler import member_limits
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.gate import Gate
from cluster.scheduler.host_calls import HostCalls
from cluster.scheduler.machine import reserve
from cluster.scheduler.machine.admission import Denial, Denied
from cluster.scheduler.machine.events import Kind, Record
from cluster.transport import edge, failures, handlers, membership
from cluster.transport.handlers import Handler, peer_host

# Why a relay of another revision is not told this scheduler's release when the job has a
# secret (`version.refusal`).
_RELAY_UNPROVEN = "which a relay does not (each of its workers proves it for itself)"

Req = TypeVar("Req")
Resp = TypeVar("Resp")
_V = TypeVar("_V")


class CallContext(Protocol):
    """What the Watch of a node reads from its call and tells it: a gRPC call's context, or a
    host link's slot (`host_link.SlotContext`)."""

    def peer(self) -> str: ...
    def invocation_metadata(self) -> Any: ...
    def set_trailing_metadata(self, trailing_metadata: Any, /) -> None: ...
    def set_code(self, code: grpc.StatusCode, /) -> None: ...
    def set_details(self, details: str, /) -> None: ...


Ctx = TypeVar("Ctx", bound=CallContext)


def refuse(
    context: CallContext, exc: ClusterError, why: tuple[tuple[str, bytes], ...] = ()
) -> None:
    """End the call with the status of `exc` (its handler then returns without an answer);
    `why`: the trailing metadata of its reason, where the call's refusals carry one."""
    code, metadata = failures.status_of(exc)
    context.set_trailing_metadata((*metadata, *why))
    context.set_code(code)
    context.set_details(str(exc))


# The caller of the value call under way in this task, admitted as its first message came
# (`ServicerEdge.counted`): its handler's `caller_of` is that one.
_VOUCHED: contextvars.ContextVar[membership.Caller | None] = contextvars.ContextVar(
    "cluster_vouched_caller", default=None
)


def caller_of(context: CallContext, method: str, request: Any = None) -> membership.Caller:
    """Who the call speaks for, with what it presents (a call proof covers `request`, a value
    call's its head: `edge.head`); a value call's caller as it was admitted at its first
    message (`ServicerEdge.counted`)."""
    if method in edge.VALUE_METHODS:
        vouched = _VOUCHED.get()
        if vouched is not None:
            return vouched
        return membership.caller(context.invocation_metadata(), method, lambda: edge.head(request))
    body = bytes if request is None else request.SerializeToString
    return membership.caller(context.invocation_metadata(), method, body)


def relay_refusal(
    context: CallContext, runs: tuple[str, int] = version.RUNS, *, open_job: bool = True
) -> tuple[RegistrationRefused, str] | None:
    """Why a host's relay that makes this call (HostWatch, HostBeats) is refused, and the line
    the scheduler logs: it runs another protocol revision than this scheduler (`runs`: its
    release and revision), and what it sends for its workers may mean something else here;
    None when it runs the same (a relay that names none runs revision 1, `version.stamped`).
    A relay proves no job secret of its own (its workers' slots carry theirs): unless the
    job is open (`open_job`: it has no secret), it is not told this scheduler's release."""
    sent = dict(context.invocation_metadata() or ()).get(version.METADATA_KEY)
    revision, release = version.stamped(None if sent is None else str(sent))
    who = f"the relay of host {peer_host(context.peer() or '')}"
    unproven = "" if open_job else _RELAY_UNPROVEN
    lines = version.refusal(
        who, safe(release, version.MAX_VERSION_CHARS), revision, runs, unproven=unproven
    )
    return None if lines is None else (RegistrationRefused(lines[0]), lines[1])


async def drained(requests: AsyncIterator[Any], most_bytes: int) -> None:
    """Read the rest of a value call refused before its value was read, dropping each piece, up
    to `most_bytes` of value (0: the message that came already, none after it) and within
    `edge.VALUE_WITHIN_S`. A member's call ended while its
    worker still writes pieces can end there, in gRPC's Python client, as INTERNAL ("Internal
    error from Core": a write that fails once the status came replaces it, grpc/grpc#36066) in
    place of the refusal it was given: a share's naming what to do, or a deposed leader's
    naming the new one. Only a member's call is drained, within its share: a stranger's, and
    any at a standby, is never read (`ServicerEdge.named`)."""

    async def drain() -> None:
        seen = 0
        async for message in requests:
            if isinstance(message, edge.Unparsed):
                return
            seen += len(message.value)
            if seen >= most_bytes:
                return

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drain(), edge.VALUE_WITHIN_S)
    await handlers.done_reading(requests)


def mapped(
    handler: Callable[[Any, Req, Ctx], Awaitable[Resp]],
) -> Callable[[Any, Req, Ctx], Awaitable[Resp | None]]:
    """A unary handler whose ClusterError ends the call with its status, and which refuses a
    request over its method's limit or that did not parse (`edge.Unparsed`) without looking at
    it."""

    async def wrapper(self: Any, request: Req, context: Ctx) -> Resp | None:
        try:
            if isinstance(request, edge.Unparsed):
                raise self.at_edge(context, request.method, request.reason, request.message())
            return await handler(self, request, context)
        except ClusterError as exc:
            refuse(context, exc)
            return None

    wrapper.__name__ = handler.__name__
    return wrapper


class ServicerEdge:
    """The servicer's gate and books of its connections, and the refusals at its edge (see the
    module docstring)."""

    def __init__(self, gate: Gate | SchedulerCore) -> None:
        self._gate = gate if isinstance(gate, Gate) else Gate(gate)
        # The peers of the connections that carry an admitted Watch stream: the members', whose
        # descriptors are never shed (`cluster.scheduler.descriptors`).
        self.member_peers: Counter[str] = Counter()
        # The connection (peer) of each node's admitted stream, and the stream's own token: a
        # host's batched beats are taken only for the nodes whose streams they came beside.
        self.stream_peers: dict[tuple[str, int], tuple[str, object]] = {}
        self.arrivals = handlers.Arrivals(
            per_peer=edge.ARRIVALS_PER_PEER,
            total=edge.ARRIVALS_TOTAL,
            deadline_s=edge.first_message_s,
            peer_of=lambda context: peer_host(context.peer() or ""),
            refuse=self.turned_away,
        )
        self.host_calls = HostCalls(edge.HOST_CALLS_PER_PEER, self.member_peers)
        # Each node's Heartbeat stream (canonical node id -> what ends it): one per node.
        self.beat_streams: dict[str, asyncio.Future[None]] = {}

    def named(self, method: str, handler: Handler) -> Handler:
        """`handler`, a member's call from its start: refused unread when it names no member or
        spare of the job (`Admission.named`: a stranger's request, up to the largest message, is
        never taken in), and at a standby, which knows no member, whatever it names: its
        refusal names the leader (a value read on there would be anyone's, up to
        `edge.MAX_VALUE_BYTES` a call, as many at once as they make)."""

        def wrap(behavior: Any) -> Any:
            async def call(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                core = self._gate.core
                if core is None:
                    refuse(context, self._gate.not_leader())
                    return None
                caller = membership.named(context.invocation_metadata())
                stranger = self._stranger(context, core, method, caller)
                if stranger is not None:
                    refuse(context, stranger)
                    return None
                return await behavior(requests, context)

            return call

        return handlers.rebuilt(handler, wrap=wrap)

    def counted(self, method: str, handler: Handler) -> Handler:
        """`handler`, a member's call once its request came (`handlers.Arrivals` awaits it
        before): counted to the member it names (`MemberLimits.call`), past its share refused
        at once. Not from the call's start: a call that never sends its request is any
        caller's, and one on the member's address could otherwise hold the member's share with
        calls that name it and never send (the calls waiting for their request are bounded by
        address, `Arrivals`, and a node tries again when crowded)."""

        def wrap(behavior: Any) -> Any:
            async def call(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                core = self._gate.core
                if core is None:  # it stepped down since `named`: its refusal names the leader
                    return await behavior(requests, context)
                node_id = membership.named(context.invocation_metadata()).node_id
                host = peer_host(context.peer() or "")
                vouched = None
                if method in edge.VALUE_METHODS:
                    first = await anext(requests)
                    vouched = await self._vouched(core, method, first, requests, context)
                    if vouched is None:
                        return None
                    requests = handlers.beginning_with(first, requests)
                token = _VOUCHED.set(vouched)
                try:
                    with core.bounds.call(node_id[:200], host, method):
                        return await behavior(requests, context)
                except CapacityError as exc:  # past its share of calls: its request unread
                    if method in edge.VALUE_METHODS:
                        await drained(requests, edge.MAX_VALUE_BYTES)
                    refuse(context, exc)
                    return None
                finally:
                    _VOUCHED.reset(token)

            return call

        return handlers.rebuilt(handler, wrap=wrap)

    async def _vouched(
        self,
        core: SchedulerCore,
        method: str,
        first: Any,
        requests: AsyncIterator[Any],
        context: CallContext,
    ) -> membership.Caller | None:
        """The caller of a value call (`edge.VALUE_METHODS`), admitted as its `first` message
        came (`Admission.admit`: the credential, or a job secret's call proof over the
        request's head, `edge.head`, whose call number it takes now), before the call holds
        anything of its member's share: a call that does not prove its member is refused at
        once, unread; None once the call was refused. With a job secret the first message names
        its value's SHA-256 (`Admission.admit_value`; `joined` checks the value against it).
        `requests`: the messages after the first."""
        if isinstance(first, edge.Unparsed):
            refuse(context, self.at_edge(context, method, first.reason, first.message()))
            await handlers.done_reading(requests)
            return None
        caller = membership.caller(context.invocation_metadata(), method, lambda: edge.head(first))
        admitted = core.state.admission.admit_value(
            caller.node_id, caller.incarnation, caller.presented, first.value_sha256, method
        )
        if isinstance(admitted, Denied):
            if admitted.kind is Denial.UNAUTHENTICATED:  # not the member's: never read
                refuse(context, self.at_edge(context, method, "unauthenticated", admitted.message))
                await handlers.done_reading(requests)
            else:  # the member's own (it registers again, say): told in words, not INTERNAL
                await drained(requests, edge.MAX_VALUE_BYTES)
                refuse(context, admitted.error())
            return None
        return dataclasses.replace(
            caller, presented=dataclasses.replace(caller.presented, vouched=True)
        )

    def _stranger(
        self, context: CallContext, core: SchedulerCore, method: str, caller: membership.Caller
    ) -> ClusterError | None:
        """Why a member's `method` call from `caller` is refused before its request is read:
        it names no node (counted at the edge), or none of the job's members and spares
        (`Admission.named`, as the call read whole would be); None when it names one, whose
        proof is looked at with the request."""
        if not caller.node_id:
            return self.at_edge(
                context,
                method,
                "unauthenticated",
                f"a {method} call that names no node (no {membership.NODE_ID_KEY} metadata): "
                "only a member of the job makes it, as itself",
            )
        named = core.state.admission.named(caller.node_id, caller.incarnation)
        return named.error() if isinstance(named, Denied) else None

    async def value_core(self, requests: AsyncIterator[Any]) -> SchedulerCore:
        """The core that answers a value call (`edge.VALUE_METHODS`); when it does not lead,
        its refusal, which names the leader: once the value was read and dropped (`drained`)
        when the call is a member's, admitted and counted to its share (`counted`: the core
        lost its lease, or was fenced, since); else with nothing read past its first message
        (this scheduler stepped down as it came; a standby refuses every call at its start,
        `named`)."""
        try:
            return self._core
        except NotLeaderError:
            admitted = _VOUCHED.get() is not None
            await drained(requests, edge.MAX_VALUE_BYTES if admitted else 0)
            raise

    @property
    def _core(self) -> SchedulerCore:
        """The core that answers this call (NotLeaderError when this scheduler does not lead)."""
        return self._gate.current()

    async def turned_away(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, reason: str, problem: str
    ) -> None:
        """End a call whose request never came in time, or that found too many waiting for
        theirs (`handlers.Arrivals`): counted and told as every refusal at the edge, as
        UNAVAILABLE (CrowdedError), which a real node meets by trying again: a request late
        behind a loaded scheduler's loop, or behind the other calls of its host's relay on one
        connection, is no fault of the node's."""
        refuse(context, self.at_edge(context, method, reason, problem))

    async def joined(
        self,
        requests: AsyncIterator[Any],
        context: CallContext,
        method: str,
    ) -> tuple[Any, bytes]:
        """The request of a member's value call (`edge.VALUE_METHODS`), whose value may come in
        pieces (`edge.pieces`): the first message (here already, `handlers.Arrivals`), its
        value joined with the pieces after it, and that value (read out of the message once).

        Its whole value (the length the first message names, `value_bytes`, or its own) is
        counted to its member when the first message comes (`member_limits.request_bytes`:
        past the member's share of bytes in flight, CapacityError, the rest dropped as it comes,
        `drained`). It is refused at the edge past `edge.MAX_VALUE_BYTES` (the rest unread), as
        are a message that does not parse, a later one that carries more than a piece, and
        pieces that do not make the length named (the rules: `edge.Joining`). The rest comes
        within `edge.VALUE_WITHIN_S` of the first message, else the call is turned away
        (CrowdedError, as a request late behind a loaded scheduler: a real node tries again).
        """
        first = await anext(aiter(requests), None)
        if first is None:
            raise BadRequestError(f"a {method} call ended without a request")
        if isinstance(first, edge.Unparsed):
            raise self.at_edge(context, method, first.reason, first.message())
        joining = self._refused(context, method, edge.Joining.opened(method, first))
        if not joining.pieced:  # the value is this message's: a unary call's
            await handlers.done_reading(requests)
            member_limits.request_bytes(joining.whole)  # its other fields: a few KiB at most
            return self._as_named(context, method, self._refused(context, method, joining.end()))
        try:
            member_limits.request_bytes(joining.whole)
        except CapacityError:  # past the member's share of bytes: refused, told so
            await drained(requests, joining.left)
            raise
        within_s = edge.VALUE_WITHIN_S
        try:
            await asyncio.wait_for(self._rest(requests, context, joining), within_s)
        except asyncio.TimeoutError:  # not builtin TimeoutError before 3.11
            problem = f"the rest of a {method} value did not come within {within_s:g} s"
            raise self.at_edge(context, method, "stalled", problem) from None
        return self._as_named(context, method, self._refused(context, method, joining.end()))

    def _as_named(
        self, context: CallContext, method: str, joined: tuple[Any, bytes]
    ) -> tuple[Any, bytes]:
        """A value call's request and value, once the value matches the SHA-256 its first
        message named (`value_sha256`, which a job secret's call proof covers, and the call
        was admitted by: `_vouched`)."""
        request, value = joined
        if request.value_sha256 and auth.sha256(value) != request.value_sha256:
            problem = (
                f"a {method} value whose SHA-256 is not the one its first message named (and "
                "its call proof covers)"
            )
            raise self.at_edge(context, method, "unauthenticated", problem)
        return joined

    async def _rest(
        self, requests: AsyncIterator[Any], context: CallContext, joining: edge.Joining
    ) -> None:
        """Read the messages of a value after its first (`joined`) to the call's end, each
        taken by `joining`."""
        async for message in requests:
            if isinstance(message, edge.Unparsed):
                raise self.at_edge(context, joining.method, message.reason, message.message())
            self._refused(context, joining.method, joining.add(message))

    def _refused(self, context: CallContext, method: str, verdict: _V | edge.Refusal) -> _V:
        """`verdict`, unless it is a Refusal: then the refusal at the edge that it names."""
        if isinstance(verdict, edge.Refusal):
            raise self.at_edge(context, method, verdict.reason, verdict.problem)
        return verdict

    def at_edge(self, context: CallContext, method: str, reason: str, problem: str) -> ClusterError:
        """A call refused before it reaches the job: counted, told at a bounded rate (the
        journal and the log), its values quoted short and escaped by `problem`'s maker."""
        self._tell_at_edge(context, method, reason, problem)
        kinds: dict[str, type[ClusterError]] = {
            "oversized": CapacityError,
            "unauthenticated": NotAuthenticatedError,
            "crowded": CrowdedError,
            "stalled": CrowdedError,
        }
        return kinds.get(reason, BadRequestError)(f"{problem}: refused")

    def _tell_at_edge(
        self, context: CallContext, method: str, reason: str, problem: str, logged: str = ""
    ) -> None:
        """Count a refusal at the edge and tell it at a bounded rate: the journal (which
        readers see) `problem`, the log `logged` (where it says more) or `problem`."""
        peer = context.peer() or ""
        count = self._gate.refusals.log(peer, method, reason, logged or problem)
        core = self._gate.core
        if count and core is not None:
            fields: dict[str, object] = {"peer": peer_host(peer), "method": method}
            fields.update(reason=reason, message=problem, count=count)
            core.journal.emit(Record(Kind.REFUSED, fields))

    def refused_relay(self, context: CallContext, method: str) -> RegistrationRefused | None:
        """Why the relay that makes this call is refused (`relay_refusal`, under this job's
        secret or none), counted and told as every refusal at the edge; None: it is not."""
        found = relay_refusal(context, open_job=self._gate.open_job)
        if found is None:
            return None
        refused, logged = found
        self._tell_at_edge(context, method, "version", str(refused), logged)
        return refused

    def _check_reader(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> None:
        """With a job secret, reading the job needs proof of it: a `cluster-read` proof (which
        `mscluster status` and `events` make from the secret file) or, with mutual TLS, the
        certificate the handshake checked. CLUSTER_READERS_PROVE_SECRET=0 opens the read side;
        a job without a secret is open (docs/design/security.md). Health stays open."""
        core = self._gate.core
        if core is None or core.settings.job_secret is None:
            return  # a standby shows only who leads
        if not core.settings.limits.readers_prove_secret:
            return
        if context.auth_context().get("transport_security_type") == [b"ssl"]:
            return  # mutual TLS: the handshake checked a certificate of the job's CA
        read = membership.read_proof(context.invocation_metadata())
        problem: str | None = "it carries no proof of the job secret"
        if read is not None:
            problem = core.state.admission.read_problem(read[0], read[1], method)
        if problem is not None:
            raise self.at_edge(
                context, method, "unauthenticated", membership.read_refusal(method, problem)
            )

    @contextlib.contextmanager
    def _host_call(
        self, context: CallContext, method: str, end: Callable[[], None]
    ) -> Iterator[None]:
        """Around a host call (`HostCalls`), which `end()` ends: turned away, as crowded, past
        the address's share of calls that speak for nobody."""
        peer = context.peer() or ""
        address, connection = peer_host(peer), reserve.peer_address(peer)
        if not self.host_calls.open(address, connection, end):
            raise self.at_edge(
                context,
                method,
                "crowded",
                f"{self.host_calls.memberless(address)} host calls from {address} carry no "
                f"admitted Watch stream already, the most the scheduler holds "
                f"({self.host_calls.per_peer}); try again",
            )
        try:
            yield
        finally:
            self.host_calls.close(address, connection, end)
