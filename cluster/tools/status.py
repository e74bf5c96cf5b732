"""Asking a scheduler how its job is doing, and showing the answer to a person or a script."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from cluster.protocol.config import join_address
from cluster.protocol.display import safe
from cluster.protocol.errors import (
    ConfigError,
    NotLeaderAnswer,
    NotLeaderError,
    ReadRefusedError,
    SchedulerUnreachableError,
)
from cluster.protocol.events import JobEvent, MemoryResume
from cluster.protocol.leader_search import LeaderSearch
from cluster.protocol.parse import split_address
from cluster.protocol.records import NodeState, Phase
from cluster.tools import reading
from cluster.tools.placement import DEFAULT_MASTER_PORT
from cluster.tools.table import format_table
from cluster.transport import channel as channel_module
from cluster.transport import failures, membership, tls
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc

STATUS_TIMEOUT_S = 3.0
# A value from the scheduler is shown escaped (`safe`) and cut to this many characters: a node
# id is at most 128, a host name at most 253.
SHOWN_MAX = 256
# This process's checks of schedulers (`checked`, `explain`): a scheduler whose certificate
# passed under the CRL is taken as checked for `channel.CHECK_KEPT_S`.
PROBE = channel_module.SchedulerProbe(
    remedies=channel_module.TLSRemedies(
        who="this reader",
        add="give it --tls-config naming the job's ssl.json (or set CLUSTER_TLS_CONFIG)",
        drop="leave out --tls-config (and CLUSTER_TLS_CONFIG): this job has no TLS",
    )
)
_ROLE_NAMES = {pb.ROLE_WORKER: "worker", pb.ROLE_SERVER: "server"}
NO_ANSWER = "no scheduler answers at"
# gRPC's details of a connection it could not make, its last words what the system said:
# "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8118: Failed to
# connect to remote host: Connection refused".
_UNCONNECTED = re.compile(r"^failed to connect to all addresses; last error: .*: ([^:]+)$")


@dataclass(frozen=True)
class NodeView:
    rank: int | None
    node_id: str
    role: str
    address: str
    state: str
    connected: bool
    seconds_since_heartbeat: float
    incarnation: int
    restarts: int
    checkpoints: tuple[int, ...] = ()  # the steps it reported holding
    # A spare (no rank), or a failed node whose rank a spare took, waiting out its guard.
    spare: bool = False


@dataclass(frozen=True)
class LeadershipView:
    """With standby schedulers (the etcd store): who leads, who stands by, the lease."""

    leader: str
    schedulers: tuple[str, ...]
    lease_s: float
    lease_left_s: float  # how long the leader holds its lease for sure without a keepalive
    state_store: str

    @property
    def standbys(self) -> tuple[str, ...]:
        return tuple(s for s in self.schedulers if s != self.leader)


@dataclass(frozen=True)
class JobView:
    address: str
    cluster_id: str
    phase: Phase
    generation: int
    worker_num: int
    server_num: int
    registered: int
    recovery: bool
    uptime_s: float
    detail: str
    nodes: tuple[NodeView, ...]
    rollback_step: int = 0  # where the current generation (re)started training
    # With recovery: saving the job's state (see StateSaving in the proto).
    save_error: str = ""  # empty while saves succeed
    save_failing_for_s: float = 0.0
    save_failures: int = 0  # failed attempts since the scheduler started
    unsaved_changes: int = 0  # decided, not on disk, not told to the nodes
    leadership: LeadershipView | None = None  # None: a scheduler without standbys
    # The last generation resumed from the survivors' memory (None: none since it started).
    memory_resume: MemoryResume | None = None

    @property
    def expected(self) -> int:
        return self.worker_num + self.server_num

    @property
    def spares(self) -> int:
        """Live spares: registered workers without a rank."""
        return sum(1 for n in self.nodes if n.spare and n.state == "alive")

    def is_spare(self, node_id: str) -> bool | None:
        """Whether the node is among the spares now (None: the scheduler does not know it)."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node.spare
        return None

    def rank_of(self, node_id: str) -> int | None:
        for node in self.nodes:
            if node.node_id == node_id:
                return node.rank
        return None

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["phase"] = self.phase.value
        return json.dumps(data, indent=2)


_PHASES: dict[int, Phase] = {
    pb.PHASE_WAITING: Phase.WAITING,
    pb.PHASE_READY: Phase.READY,
    pb.PHASE_FINISHED: Phase.FINISHED,
    pb.PHASE_FAILED: Phase.FAILED,
}
_NODE_STATES: dict[int, NodeState] = {
    pb.NODE_STATE_ALIVE: NodeState.ALIVE,
    pb.NODE_STATE_FAILED: NodeState.FAILED,
    pb.NODE_STATE_FINISHED: NodeState.FINISHED,
}


def _phase(value: int) -> Phase:
    phase = _PHASES.get(value)
    if phase is None:
        raise SchedulerUnreachableError(
            f"the scheduler reported an unknown job phase ({value}): is it a newer version?"
        )
    return phase


def _node_state(value: int) -> str:
    """A node's state in words ("alive", ...), or "?" for one this version does not know."""
    found = _NODE_STATES.get(value)
    return "?" if found is None else found.value


def job_view(address: str, response: pb.StatusResponse) -> JobView:
    nodes = tuple(
        NodeView(
            rank=n.rank if n.HasField("rank") else None,
            node_id=n.node_id,
            role=_ROLE_NAMES.get(n.role, "?"),
            address=join_address(n.host, n.port),
            state=_node_state(n.state),
            connected=n.connected,
            seconds_since_heartbeat=round(n.seconds_since_heartbeat, 3),
            incarnation=n.incarnation,
            restarts=n.restarts,
            checkpoints=tuple(n.checkpoints),
            spare=n.spare,
        )
        for n in response.nodes
    )
    return JobView(
        address=address,
        cluster_id=response.cluster_id,
        phase=_phase(response.phase),
        generation=response.generation,
        worker_num=response.worker_num,
        server_num=response.server_num,
        registered=sum(1 for n in nodes if not n.spare),
        recovery=response.recovery,
        uptime_s=round(response.uptime_s, 3),
        detail=response.detail,
        nodes=nodes,
        rollback_step=response.rollback_step,
        save_error=response.saving.error,
        save_failing_for_s=round(response.saving.failing_for_s, 3),
        save_failures=response.saving.failures,
        unsaved_changes=response.saving.unsaved_changes,
        leadership=_leadership(response.leadership),
        memory_resume=_memory_resume(response),
    )


def _memory_resume(response: pb.StatusResponse) -> MemoryResume | None:
    if not response.HasField("memory_resume"):
        return None
    told = response.memory_resume
    return MemoryResume(int(told.generation), int(told.step), told.why)


_SCHEDULER_ROLES = {pb.SCHEDULER_ROLE_LEADER: "leader", pb.SCHEDULER_ROLE_STANDBY: "standby"}


def scheduler_role(leadership: pb.Leadership) -> str:
    """'leader', 'standby', or '' for a scheduler without standbys."""
    return _SCHEDULER_ROLES.get(leadership.role, "")


def _leadership(found: pb.Leadership) -> LeadershipView | None:
    if found.role == pb.SCHEDULER_ROLE_UNSPECIFIED:
        return None
    return LeadershipView(
        leader=found.leader,
        schedulers=tuple(found.schedulers),
        lease_s=found.lease_s,
        lease_left_s=round(found.lease_left_s, 3),
        state_store=found.state_store,
    )


async def fetch(
    channel: grpc.aio.Channel,
    address: str,
    timeout_s: float = STATUS_TIMEOUT_S,
    secret: reading.Secret = reading.FROM_ENV,
) -> JobView:
    """The job's status from the scheduler behind `channel`: SchedulerUnreachableError when
    none answers, ReadRefusedError when it refuses this reader. `secret`: the job secret that
    proves this reader (`reading`; by default the environment's)."""
    stub = pb_grpc.SchedulerStub(channel)
    found = reading.resolve(secret)
    try:
        response = await _ask(stub, found, timeout_s)
    except grpc.aio.AioRpcError as exc:
        if reading.refused(exc):
            raise refusal(address, found, exc) from None
        if (denied := reading.denied(address, exc)) is not None:
            raise denied from None
        failure = failures.failure_of(exc)
        if failure.kind is NotLeaderError and not failure.leader:
            raise stopping(address) from None
        raise SchedulerUnreachableError(
            f"{NO_ANSWER} {address}: {unconnected(failure.details)}"
        ) from None
    assert isinstance(response, pb.StatusResponse)
    leadership = response.leadership
    if leadership.role == pb.SCHEDULER_ROLE_STANDBY:
        raise standing_by(address, leadership.leader)
    if leadership.role == pb.SCHEDULER_ROLE_UNSPECIFIED and not response.phase:
        raise stopping(address)  # a scheduler of an earlier version says it so
    return job_view(address, response)


def unconnected(details: str) -> str:
    """A failed call's `details`, gRPC's account of a connection it could not make said as the
    system's reason alone (`connection refused`); any other as it is."""
    found = _UNCONNECTED.match(details)
    return details if found is None else found[1].strip().lower()


def pointed(line: str, addr_given: bool) -> str:
    """`line`, a SchedulerUnreachableError of `mscluster status` or `mscluster events`, with
    (when no scheduler answered) where it looked and how to point it at the job's scheduler."""
    if NO_ANSWER not in line:
        return line
    if addr_given:
        return f"{line}: is the job running, with a scheduler at that --addr?"
    return (
        f"{line}: is the job running? Without --addr this asks MS_SCHED_HOST:MS_SCHED_PORT "
        f"(127.0.0.1:{DEFAULT_MASTER_PORT} when unset): point it at the job's scheduler with "
        "--addr HOST:PORT, or set those variables"
    )


def stopping(address: str) -> SchedulerUnreachableError:
    """The scheduler at `address`, without standbys, answers for no job: it is stopping."""
    return SchedulerUnreachableError(
        f"the scheduler at {address} is stopping (or has yet to start) and answers for no job "
        "now: wait a moment and try again; with recovery, the job resumes once a scheduler is "
        "started again on its state (MS_RECOVERY_PATH or CLUSTER_STATE_URL)"
    )


def standing_by(address: str, leader: str) -> NotLeaderAnswer:
    """The scheduler at `address` stands by; `leader` is the one it names ("" none)."""
    where = f"the leader is {leader}" if leader else "none leads now"
    return NotLeaderAnswer(f"the scheduler at {address} stands by ({where})", leader)


def refusal(
    address: str, secret: reading.ReadSecret | None, exc: grpc.aio.AioRpcError
) -> ReadRefusedError:
    """The scheduler's refusal of a read (`reading.refused`) in one line: a proof taken as a
    replay (after a second try on a fresh challenge) is no wrong secret, and is not called one
    (`reading.refusal` says what to do about the secret)."""
    if secret is None or not membership.read_replayed(exc.details() or ""):
        return reading.refusal(address, secret)
    return ReadRefusedError(
        f"the scheduler at {address} took this reader's proof of the job secret for a replay "
        f"twice, each on a fresh challenge; the secret of {secret.source} is right: something "
        "on the path repeats this reader's calls (a proxy?); try again, and see the scheduler's "
        "log"
    )


async def read_metadata(
    stub: Any, method: str, secret: reading.ReadSecret | None, timeout_s: float
) -> membership.Metadata:
    """What a read of the job (Status, WatchEvents) carries: with a job secret, a proof of it
    that answers the scheduler's challenge (a standby, which has none, needs none; so does a
    scheduler that asks for none)."""
    if secret is None:
        return ()
    try:
        answer = await stub.Challenge(pb.ChallengeRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            return ()  # a scheduler without challenges checks no proof
        raise
    if not answer.challenge:
        return ()
    return membership.read_metadata(secret.value, answer.challenge, method)


async def _ask(stub: Any, secret: reading.ReadSecret | None, timeout_s: float) -> Any:
    """Status, with a proof of `secret` when there is one; a refused proof is made once more
    on a new challenge (the scheduler may have restarted between the challenge and the call,
    taken the proof for a replay, or begun to lead since it gave no challenge as a standby)."""
    for again in (True, False):
        metadata = await read_metadata(stub, "Status", secret, timeout_s)
        try:
            return await stub.Status(pb.StatusRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            # A scheduler that stood by when it was asked for a challenge gives none (no proof
            # made), and may lead by the call: ask it again too.
            if not (again and secret is not None and reading.refused(exc)):
                raise
    raise AssertionError("unreachable")


async def fetch_any(
    addresses: list[str],
    identity: tls.Identity | None,
    timeout_s: float = STATUS_TIMEOUT_S,
    secret: reading.Secret = reading.FROM_ENV,
) -> JobView:
    """The job's status from the leader among `addresses` (each tried in turn; a standby's
    answer names the leader, asked next), or SchedulerUnreachableError saying what each
    answered (ReadRefusedError at once: the job's schedulers share its secret; TLSConfigError
    at once when one is refused or speaks the other protocol: `fetch_checked`)."""
    search, said = LeaderSearch(addresses), []
    while (address := search.next_address()) is not None:
        try:
            async with channel_module.open_channel(address, identity) as opened:
                return await fetch_checked(opened, address, identity, timeout_s, secret)
        except NotLeaderAnswer as exc:
            said.append(str(exc))
            search.standby(exc.leader)
        except SchedulerUnreachableError as exc:
            said.append(str(exc))
    raise SchedulerUnreachableError("; ".join(said) or "no scheduler address given")


async def fetch_checked(
    channel: grpc.aio.Channel,
    address: str,
    identity: tls.Identity | None,
    timeout_s: float = STATUS_TIMEOUT_S,
    secret: reading.Secret = reading.FROM_ENV,
) -> JobView:
    """`fetch`, with the scheduler's certificate checked against the CRL first (`checked`) and
    a failure to reach it explained (`explain`): TLSConfigError when it is refused."""
    await checked(address, identity, timeout_s)
    try:
        return await fetch(channel, address, timeout_s, secret)
    except NotLeaderAnswer:
        raise
    except SchedulerUnreachableError:
        await explain(address, identity, timeout_s)
        raise


def _host_port(address: str) -> tuple[str, int] | None:
    try:
        return split_address("the scheduler address", address)
    except ConfigError:
        return None


async def checked(
    address: str, identity: tls.Identity | None, timeout_s: float = STATUS_TIMEOUT_S
) -> None:
    """Before a read of the scheduler at `address`: with a CRL (which grpc cannot consult), its
    certificate checked against it (`PROBE`, once per CHECK_KEPT_S). TLSConfigError when it is
    refused, SchedulerUnreachableError when nothing answers the check; without a CRL, nothing."""
    if identity is None or identity.revocation is None:
        return
    found = _host_port(address)
    if found is None:
        raise SchedulerUnreachableError(f"no scheduler address in {shown(address)}")
    if PROBE.passed_recently(*found, identity):
        return
    reach = await PROBE.check(*found, identity, timeout_s)
    if not reach.ok:
        why = f": {reach.why}" if reach.why else ""
        raise SchedulerUnreachableError(f"no scheduler answers at {address}{why}")


async def explain(
    address: str, identity: tls.Identity | None, timeout_s: float = STATUS_TIMEOUT_S
) -> None:
    """After a read of `address` went unanswered: TLSConfigError when a scheduler is there but
    speaks the other protocol, is refused, or refuses this reader's certificate (`PROBE`);
    nothing when none is there."""
    found = _host_port(address)
    if found is not None:
        await PROBE.check(*found, identity, timeout_s)


def shown(text: str) -> str:
    """A value from the scheduler as a person may see it: escaped, cut to SHOWN_MAX."""
    return safe(text, SHOWN_MAX)


def render(view: JobView) -> str:
    """A table for a terminal; every value from the scheduler escaped (`shown`)."""
    head = (
        f"job {shown(view.cluster_id)} at {shown(view.address)}: {view.phase.value}, "
        f"generation {view.generation}, "
        f"{view.registered}/{view.expected} registered, "
        + (f"{view.spares} spares, " if any(n.spare for n in view.nodes) else "")
        + f"recovery {'on' if view.recovery else 'off'}"
        f", up {view.uptime_s:.0f} s"
        + (f", rollback step {view.rollback_step}" if view.rollback_step else "")
    )
    lines = [head]
    if view.leadership is not None:
        lines.append(_leaders(view.leadership))
    if view.detail:
        lines.append(f"  {shown(view.detail)}")
    if view.memory_resume is not None:
        resumed = view.memory_resume
        lines.append(
            f"  generation {resumed.generation} resumed from step {resumed.step} in memory "
            f"(not from disk): {shown(resumed.why)}"
        )
    if view.save_error:
        lines.append(
            f"  SAVES FAILING for {view.save_failing_for_s:.0f} s ({view.save_failures} attempts): "
            f"{shown(view.save_error)}; {view.unsaved_changes} changes not saved, not told to the "
            "nodes until a save lands"
        )
    columns = (
        "rank",
        "node id",
        "role",
        "address",
        "state",
        "heartbeat",
        "incarnation",
        "restarts",
        "checkpoints",
    )
    rows = [
        (
            "-" if n.rank is None else str(n.rank),
            shown(n.node_id),
            f"{n.role} (spare)" if n.spare else n.role,
            shown(n.address),
            shown(n.state) if n.connected or n.state != "alive" else "alive (no stream)",
            f"{n.seconds_since_heartbeat:.1f} s ago",
            f"{n.incarnation:x}",
            str(n.restarts),
            _steps(n.checkpoints),
        )
        for n in view.nodes
    ]
    lines.extend(format_table(columns, rows))
    return "\n".join(lines)


def _leaders(leadership: LeadershipView) -> str:
    standbys = ", ".join(map(shown, leadership.standbys)) or "none"
    return (
        f"  leader {shown(leadership.leader)} (lease {leadership.lease_s:g} s, held for sure "
        f"{leadership.lease_left_s:.1f} s more), standbys: {standbys}; "
        f"state in {shown(leadership.state_store)}"
    )


def _steps(steps: tuple[int, ...]) -> str:
    """The newest few checkpoint steps a node holds, for a table cell."""
    if not steps:
        return "-"
    newest = ", ".join(map(str, steps[-3:]))
    return f"..., {newest}" if len(steps) > 3 else newest


async def watch_events(
    channel: grpc.aio.Channel, address: str, *, follow: bool, secret: reading.ReadSecret | None
) -> AsyncIterator[JobEvent]:
    """The job's events from the scheduler behind `channel` (WatchEvents), with a proof of
    `secret` when there is one; with `follow`, each new one until the job's last. A proof
    refused before the first event, or a call refused for want of one, is made once more on a
    new challenge (as `_ask`).
    NotLeaderAnswer when the scheduler stands by, or ends the stream as it gives up leading."""
    stub = pb_grpc.SchedulerStub(channel)
    for again in (True, False):
        metadata = await _watch_metadata(stub, address, secret)
        call = stub.WatchEvents(
            pb.WatchEventsRequest(follow=follow),
            timeout=None if follow else 10.0,
            metadata=metadata,
        )
        started = False
        try:
            async for message in call:
                started = True
                yield JobEvent(
                    message.seq, message.time, message.event, json.loads(message.fields_json)
                )
            return
        except grpc.aio.AioRpcError as exc:
            if reading.refused(exc):
                if again and secret is not None and not started:
                    continue  # a new challenge: see `_ask`
                raise refusal(address, secret, exc) from None
            if (denied := reading.denied(address, exc)) is not None:
                raise denied from None
            failure = failures.failure_of(exc)
            if failure.kind is NotLeaderError:
                raise standing_by(address, failure.leader) from None
            if failure.cut_off:
                raise SchedulerUnreachableError(
                    f"{NO_ANSWER} {address}: {unconnected(failure.details)}"
                ) from None
            raise SchedulerUnreachableError(
                f"the event stream ended at {address}: {failure.details}"
            ) from None


async def _watch_metadata(
    stub: Any, address: str, secret: reading.ReadSecret | None
) -> membership.Metadata:
    """`read_metadata` for WatchEvents, a failure to get a challenge said in one line."""
    try:
        return await read_metadata(stub, "WatchEvents", secret, 10.0)
    except grpc.aio.AioRpcError as exc:
        if (denied := reading.denied(address, exc)) is not None:
            raise denied from None
        raise SchedulerUnreachableError(
            f"{NO_ANSWER} {address}: {unconnected(failures.failure_of(exc).details)}"
        ) from None
