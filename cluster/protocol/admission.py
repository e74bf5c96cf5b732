"""Who may make a call: the admission rules of the scheduler's state machine.

Every call of a node (its Watch hello, heartbeats, collectives, key-value calls, Finish, checkpoint
reports) is admitted here before anything changes: the node id must be a member's, the
incarnation (when the call names one) that member's current one, and the call must carry the
credential of that incarnation (see `cluster.protocol.auth`). A collective is also checked
against the phase, the generation and the other members. The answer is a `Denied` with a kind
(whose `error()` the scheduler sends back as a status code) or what the call may go on with; a
refused call changes nothing.

`Admission` is a mixin of `SchedulerState`: queries only, no input is changed here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster.protocol import auth
from cluster.protocol.config import canonical_node_id, valid_node_id
from cluster.protocol.errors import (
    CapacityError,
    ClusterError,
    CollectiveError,
    JobFailedError,
    NotAuthenticatedError,
    PeerFailedError,
    RegistrationPendingError,
    UnknownNodeError,
)
from cluster.protocol.records import Member, NodeRole, NodeState, Phase
from cluster.protocol.settings import JobSettings

BARRIER = "barrier"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
COLLECTIVE_OPS = (BARRIER, ALLGATHER, BROADCAST)
# A worker keeps a handful of checkpoints (keep_checkpoint_max); a report of more steps than
# this is not a real one, and every step reported is held in the state and its saved file.
MAX_REPORTED_CHECKPOINTS = 1024


class Denial(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"  # no credential, or not the named node's
    NOT_A_MEMBER = "not_a_member"  # no such node id, or not its current incarnation
    JOB_OVER = "job_over"  # the job has ended, or has not formed (collectives)
    PEER_FAILED = "peer_failed"  # a member failed, or the job moved to a new generation
    WRONG_GENERATION = "wrong_generation"  # a generation the job has not reached
    COLLECTIVE_MISUSE = "collective_misuse"  # not a ranked worker, a finished peer, a bad root
    OVER_CAP = "over_cap"  # more than the scheduler holds for a caller
    # A job secret's call proof of a node that has not registered with this scheduler (it was
    # restarted, or took over): transient, the node registers again and repeats the call.
    NOT_REGISTERED_HERE = "not_registered_here"


# The error a refused call raises, in the scheduler and (sent back) in the caller.
_ERRORS: dict[Denial, type[ClusterError]] = {
    Denial.UNAUTHENTICATED: NotAuthenticatedError,
    Denial.NOT_A_MEMBER: UnknownNodeError,
    Denial.JOB_OVER: JobFailedError,
    Denial.PEER_FAILED: PeerFailedError,
    Denial.WRONG_GENERATION: CollectiveError,
    Denial.COLLECTIVE_MISUSE: CollectiveError,
    Denial.OVER_CAP: CapacityError,
    Denial.NOT_REGISTERED_HERE: RegistrationPendingError,
}


@dataclass(frozen=True)
class Denied:
    kind: Denial
    message: str

    def error(self) -> ClusterError:
        """The refusal as the error the call raises."""
        return _ERRORS[self.kind](self.message)


@dataclass(frozen=True)
class ExchangeTicket:
    """An admitted collective: the caller's rank among `size` workers."""

    rank: int
    size: int


class Admission:
    """The admission queries of `SchedulerState` (which provides these attributes)."""

    cluster_id: str
    settings: JobSettings
    phase: Phase
    detail: str
    generation: int
    members: dict[str, Member]
    spares: dict[str, Member]

    # Per node: the call numbers seen since it last registered with this scheduler (a job
    # secret's call proofs; not saved: a restarted scheduler waits for the node's registration).
    call_windows: dict[str, auth.CallWindow]

    def admit(
        self, node_id: str, incarnation: int | None, presented: auth.Presented
    ) -> Member | Denied:
        """The member this call speaks for, if it may; `incarnation` None: any (the credential
        is per incarnation anyway)."""
        member = None
        if valid_node_id(node_id):
            key = canonical_node_id(node_id)
            member = self.members.get(key) or self.spares.get(key)
        if member is None or (incarnation is not None and member.incarnation != incarnation):
            which = "" if incarnation is None else f" (incarnation {incarnation})"
            return Denied(
                Denial.NOT_A_MEMBER,
                f"node {node_id[:140]!r}{which} is not a member of job {self.cluster_id}: "
                "register first",
            )
        secret = self.settings.job_secret
        problem = (
            self._check_bearer(member, presented.digest)
            if secret is None
            else self._check_call(member, presented.call, secret)
        )
        return member if problem is None else problem

    @staticmethod
    def _check_bearer(member: Member, digest: bytes) -> Denied | None:
        if not digest:
            return Denied(
                Denial.UNAUTHENTICATED,
                f"this call speaks for node {member.node_id!r} but carries no node credential "
                "(cluster-credential metadata): only that node's own process may make it",
            )
        if not auth.same_digest(member.credential_digest, digest):
            return Denied(
                Denial.UNAUTHENTICATED,
                f"this call speaks for node {member.node_id!r} but does not carry its credential: "
                "only that node's own process may make it",
            )
        return None

    def _check_call(
        self, member: Member, call: auth.CallProof | None, secret: bytes
    ) -> Denied | None:
        """A call proof under the job secret: the right MAC, a number not seen before."""
        who = f"this call speaks for node {member.node_id!r}"
        if call is None:
            return Denied(
                Denial.UNAUTHENTICATED,
                f"{who} but carries no call proof (cluster-call metadata): this job has a "
                "secret, and only that node's own process may make its calls",
            )
        expected = auth.call_mac(
            auth.call_key(secret, member.credential_digest),
            (call.method, member.node_id, member.incarnation, call.seq, call.body_digest),
        )
        if not auth.same_digest(expected, call.mac):
            return Denied(
                Denial.UNAUTHENTICATED,
                f"{who} but its call proof is not that node's (forged, or another request's): "
                "only that node's own process may make its calls",
            )
        window = self.call_windows.get(member.node_id)
        if window is None:
            return Denied(
                Denial.NOT_REGISTERED_HERE,
                f"{who}, which has not registered with this scheduler since it started; the "
                "node registers again on its own, and the call is made again",
            )
        replay = window.take(call.seq)
        if replay is not None:
            return Denied(Denial.UNAUTHENTICATED, f"{who}, but {replay}: refused")
        return None

    def admit_report(
        self, node_id: str, incarnation: int, presented: auth.Presented, steps: int
    ) -> Member | Denied:
        """A checkpoint report of `steps` steps."""
        verdict = self.admit(node_id, incarnation, presented)
        if isinstance(verdict, Member) and steps > MAX_REPORTED_CHECKPOINTS:
            return Denied(
                Denial.OVER_CAP,
                f"a checkpoint report names {steps} steps; the scheduler takes at most "
                f"{MAX_REPORTED_CHECKPOINTS} (keep fewer checkpoints: keep_checkpoint_max)",
            )
        return verdict

    def admit_exchange(
        self, node_id: str, presented: auth.Presented, *, generation: int, op: str, root: int
    ) -> ExchangeTicket | Denied:
        """A contribution to collective `op` of `generation`."""
        verdict = self.admit(node_id, None, presented)
        if isinstance(verdict, Denied):
            return verdict
        member = verdict
        if self.phase is not Phase.READY:
            return Denied(
                Denial.JOB_OVER, f"job is {self.phase.value}: {self.detail or 'not formed yet'}"
            )
        if member.rank is None or member.role is not NodeRole.WORKER:
            return Denied(
                Denial.COLLECTIVE_MISUSE, f"node {node_id!r} is not a ranked worker of this job"
            )
        if op not in COLLECTIVE_OPS:
            return Denied(Denial.COLLECTIVE_MISUSE, f"{op!r} is not a collective")
        return self._check_round(generation, op, root) or ExchangeTicket(
            member.rank, self.settings.worker_num
        )

    def _check_round(self, generation: int, op: str, root: int) -> Denied | None:
        if generation < self.generation:
            return Denied(
                Denial.PEER_FAILED,
                f"{op} belongs to generation {generation}, but the job has moved on to "
                f"generation {self.generation} (a failed node rejoined): roll back and go on",
            )
        if generation != self.generation:
            return Denied(
                Denial.WRONG_GENERATION,
                f"collective of generation {generation}, but the job is at generation "
                f"{self.generation}",
            )
        down = [m for m in self.members.values() if m.state is NodeState.FAILED]
        if down:
            return Denied(
                Denial.PEER_FAILED,
                f"{op} cannot complete: {down[0].describe()} has failed ({down[0].failure}); "
                "the job waits for it to rejoin in a new generation",
            )
        gone = [m for m in self.members.values() if m.state is NodeState.FINISHED]
        if gone:
            return Denied(
                Denial.COLLECTIVE_MISUSE,
                f"{op} cannot complete: {gone[0].describe()} has already finished "
                "(called cluster.finalize()); every rank must take part in every collective",
            )
        if op == BROADCAST and not 0 <= root < self.settings.worker_num:
            return Denied(
                Denial.COLLECTIVE_MISUSE,
                f"broadcast root {root} is not a rank (0-{self.settings.worker_num - 1})",
            )
        return None
