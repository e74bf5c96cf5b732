"""Who may make a call: the admission rules of the scheduler's state machine.

Every call of a node (its Watch hello, heartbeats, collectives, key-value calls, Finish, checkpoint
reports) is admitted here before anything changes: the node id must be a member's, the
incarnation (when the call names one) that member's current one, and the call must carry the
credential of that incarnation (see `cluster.protocol.auth`). A collective is also checked
against the phase, the generation and the other members. The answer is a `Denied` with a kind
(whose `error()` the scheduler sends back as a status code) or what the call may go on with; a
refused call changes nothing.

Who may join is decided here too (`check_registration`, `check_new`): the node's protocol
revision (`cluster.protocol.version`: what a node of another one sends may mean something
else), its credential and, with a job secret, its proof of the secret (a fresh challenge, a
nonce never seen), the job it names, its counts and the room left for its role. A node of
another revision is refused as one, whatever else is wrong; with a job secret its proof is
checked first, and only a node that proved the secret learns this scheduler's release from it.

`Admission` is a part of `SchedulerState` (it reads the job through `JobView`) and owns what
trust remembers: the nonces seen, the challenges issued, the read proofs accepted and each
node's call window. None of them is saved: a restarted scheduler issues new challenges, and
waits for each node's registration before it takes the node's call proofs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import field
from typing import Protocol

from cluster.protocol import auth, version
from cluster.protocol.config import canonical_node_id, is_numeric_node_id, valid_node_id
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
from cluster.protocol.records import (
    Member,
    NodeRole,
    NodeState,
    Phase,
    Refusal,
    Refused,
    Registration,
)
from cluster.protocol.settings import JobSettings
from cluster.protocol.state_url import STATE_URL_ENV
from cluster.protocol.value import frozen, mutable

BARRIER = "barrier"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
COLLECTIVE_OPS = (BARRIER, ALLGATHER, BROADCAST)
# Why a node of another revision that did not prove the job secret is not told this
# scheduler's release (`version.refusal`).
_UNPROVEN = "which this node did not (a process of another revision may make its proof otherwise)"
# A worker keeps a handful of checkpoints (keep_checkpoint_max); a report of more steps than
# this is not a real one, and every step reported is held in the state and its saved file.
MAX_REPORTED_CHECKPOINTS = 1024


class Denial(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"  # no credential, or not the named node's
    NOT_A_MEMBER = "not_a_member"  # no such node id, or not its current incarnation
    JOB_OVER = "job_over"  # the job has ended, or has not formed (collectives)
    PEER_FAILED = "peer_failed"  # a member failed, or the job moved to a new generation
    WRONG_GENERATION = "wrong_generation"  # a generation the job has not reached
    COLLECTIVE_MISUSE = "collective_misuse"  # not a ranked worker, not a collective, a bad root
    OVER_CAP = "over_cap"  # more than the scheduler holds for a caller
    # A job secret's call proof of a node that has not registered with this scheduler (it was
    # restarted, or took over): transient, the node registers again and repeats the call.
    NOT_REGISTERED_HERE = "not_registered_here"
    # A Finish of a member the job holds failed while it waits for it to rejoin (recovery):
    # transient too, the node registers again, then finishes.
    REJOIN_FIRST = "rejoin_first"


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
    Denial.REJOIN_FIRST: RegistrationPendingError,
}


@frozen
class Denied:
    kind: Denial
    message: str

    def error(self) -> ClusterError:
        """The refusal as the error the call raises."""
        return _ERRORS[self.kind](self.message)


@frozen
class ExchangeTicket:
    """An admitted collective: the caller's rank among `size` workers. `closed`: why no round
    can complete any more (a rank has finished), "" while one can; then only a call made again
    of a round already answered gets its answer (`Rounds.join`), any other is refused."""

    rank: int
    size: int
    closed: str = ""


class JobView(Protocol):
    """What admission reads of the job (`SchedulerState`)."""

    cluster_id: str
    previous_cluster_id: str
    started_anew_under: str
    settings: JobSettings
    phase: Phase
    detail: str
    generation: int
    members: dict[str, Member]
    spares: dict[str, Member]

    @property
    def clock(self) -> Callable[[], float]: ...


@mutable
class Admission:
    """Who may join the job, and which call a node may make."""

    job: JobView
    # Per member or spare: the call numbers seen since it last registered with this scheduler
    # (a job secret's call proofs); dropped when it leaves the job (`forget`).
    call_windows: dict[str, auth.CallWindow] = field(default_factory=dict)
    _nonces: auth.ReplayCache = field(default_factory=auth.ReplayCache)
    _challenges: auth.ChallengeIssuer = field(default_factory=auth.ChallengeIssuer)
    # The operators' read proofs accepted while their challenges are good: each is taken once.
    _reads: auth.ReplayCache = field(default_factory=auth.ReplayCache)
    # What this scheduler runs: its release and protocol revision.
    runs: tuple[str, int] = version.RUNS

    def admit(
        self, node_id: str, incarnation: int | None, presented: auth.Presented
    ) -> Member | Denied:
        """The member this call speaks for, if it may; `incarnation` None: any (the credential
        is per incarnation anyway). What a call `presented` is checked once: a call admitted
        as its first message came (`vouched`) is not checked again."""
        member = self.named(node_id, incarnation)
        if isinstance(member, Denied) or presented.vouched:
            return member
        secret = self.job.settings.job_secret
        problem = (
            self._check_bearer(member, presented.digest)
            if secret is None
            else self._check_call(member, presented.call, secret)
        )
        return member if problem is None else problem

    def admit_value(
        self,
        node_id: str,
        incarnation: int | None,
        presented: auth.Presented,
        value_sha256: bytes,
        method: str,
    ) -> Member | Denied:
        """`admit`, for a value call (an Exchange's, a KvSet's) on its first message, whose
        `value_sha256` a job secret's call proof covers (the call's head): with a secret, one
        that names no SHA-256 of its value is refused, as no process of the node makes it."""
        if self.job.settings.job_secret is not None and len(value_sha256) != auth.DIGEST_BYTES:
            return Denied(
                Denial.UNAUTHENTICATED,
                f"a {method} call whose first message names no SHA-256 of its value, which a "
                "job secret's call proof covers: only that node's own process may make it",
            )
        return self.admit(node_id, incarnation, presented)

    def admit_finish(
        self, node_id: str, incarnation: int, presented: auth.Presented
    ) -> Member | Denied:
        """`admit`, for a Finish. Once the job failed, the Finish of a member that had not
        finished is refused as the job's failure: it came too late to count, and a node told it
        was heard would exit as finished (a Finish heard before, sent again, is answered). A
        member the job holds failed, waiting for it to rejoin (with recovery, while it is
        formed), has its Finish refused for now: counted, it would leave the job waiting for a
        rejoin that never comes. The node registers again, then finishes."""
        member = self.admit(node_id, incarnation, presented)
        job = self.job
        if (
            not isinstance(member, Denied)
            and job.phase is Phase.FAILED
            and member.state is not NodeState.FINISHED
        ):
            return Denied(
                Denial.JOB_OVER,
                f"job failed: {job.detail}; this node's finish came after that",
            )
        if (
            isinstance(member, Denied)
            or member.state is not NodeState.FAILED
            or job.phase is not Phase.READY
            or not job.settings.recovery
            or member.node_id in job.spares
            or member.replaced_by  # a spare took its rank: nobody waits for it
        ):
            return member
        return Denied(
            Denial.REJOIN_FIRST,
            f"{member.describe()} was failed ({member.failure or 'its stream ended'}) and the "
            "job waits for it to rejoin: it registers again, then finishes",
        )

    def named(self, node_id: str, incarnation: int | None) -> Member | Denied:
        """The member or spare a call names (`incarnation` None: any), before what it presents
        is looked at: a call that names none is refused unread (`ServicerEdge.named`), so
        that no stranger has the scheduler take its request in."""
        member = None
        if valid_node_id(node_id):
            key = canonical_node_id(node_id)
            member = self.job.members.get(key) or self.job.spares.get(key)
        if member is None or (incarnation is not None and member.incarnation != incarnation):
            which = "" if incarnation is None else f" (incarnation {incarnation})"
            return Denied(
                Denial.NOT_A_MEMBER,
                f"node {node_id[:140]!r}{which} is not a member of job {self.job.cluster_id}: "
                "register first",
            )
        return member

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
        if self.job.phase is not Phase.READY:
            return Denied(
                Denial.JOB_OVER,
                f"job is {self.job.phase.value}: {self.job.detail or 'not formed yet'}",
            )
        if member.rank is None or member.role is not NodeRole.WORKER:
            return Denied(
                Denial.COLLECTIVE_MISUSE, f"node {node_id!r} is not a ranked worker of this job"
            )
        if op not in COLLECTIVE_OPS:
            return Denied(Denial.COLLECTIVE_MISUSE, f"{op!r} is not a collective")
        gone = [m for m in self.job.members.values() if m.state is NodeState.FINISHED]
        closed = (
            f"{op} cannot complete: {gone[0].describe()} has already finished (called "
            "cluster.finalize()); every rank must take part in every collective"
            if gone
            else ""
        )
        return self._check_round(generation, op, root) or ExchangeTicket(
            member.rank, self.job.settings.worker_num, closed
        )

    def _check_round(self, generation: int, op: str, root: int) -> Denied | None:
        if generation < self.job.generation:
            return Denied(
                Denial.PEER_FAILED,
                f"{op} belongs to generation {generation}, but the job has moved on to "
                f"generation {self.job.generation} (a failed node rejoined): roll back and go on",
            )
        if generation != self.job.generation:
            return Denied(
                Denial.WRONG_GENERATION,
                f"collective of generation {generation}, but the job is at generation "
                f"{self.job.generation}",
            )
        down = [m for m in self.job.members.values() if m.state is NodeState.FAILED]
        if down:
            return Denied(
                Denial.PEER_FAILED,
                f"{op} cannot complete: {down[0].describe()} has failed ({down[0].failure}); "
                "the job waits for it to rejoin in a new generation",
            )
        if op == BROADCAST and not 0 <= root < self.job.settings.worker_num:
            return Denied(
                Denial.COLLECTIVE_MISUSE,
                f"broadcast root {root} is not a rank (0-{self.job.settings.worker_num - 1})",
            )
        return None

    # -- joining ---------------------------------------------------------------------------------

    def challenge(self) -> bytes:
        """A challenge for a registration under the job secret (`cluster.protocol.auth`)."""
        return self._challenges.issue(self.job.clock())

    def read_problem(self, challenge: bytes, proof: bytes, method: str) -> str | None:
        """Why an operator's read proof does not prove the job secret; None when it does, and
        then the proof is spent: its replay is refused."""
        secret = self.job.settings.job_secret
        if secret is None:
            return None
        stale = self._challenges.problem(challenge, self.job.clock())
        if stale is not None:
            return f"its proof of the job secret cannot be checked: {stale}"
        if not auth.same_digest(auth.read_proof(secret, challenge, method), proof):
            return "its proof is not of this job's secret"
        # Only proofs of the secret are remembered (an outsider adds nothing), each for as long
        # as a challenge issued now stays good (a clock skew's second included).
        now = self.job.clock()
        if not self._reads.first_time(proof, now_s=now, until_s=now + auth.CHALLENGE_TTL_S + 1):
            return (
                f"{auth.READ_REPLAYED}: every read answers a challenge of its own (mscluster "
                "status and events ask for one at every call)"
            )
        return None

    def check_registration(self, reg: Registration) -> Refused | None:
        """Whether `reg` may be looked at: its protocol revision, its credential and proof,
        its job and counts. With a job secret the proof is checked first, then the revision:
        a node of another revision is refused as one, whatever its proof's refusal (it may
        make its proof otherwise), and told this scheduler's release only when it proved the
        secret."""
        if self.job.settings.job_secret is None:  # an open job: anyone may join it anyway
            return self._check_version(reg) or self._check_proof(reg) or self._check_job(reg)
        unproven = self._check_proof(reg)
        return self._check_version(reg, proven=unproven is None) or unproven or self._check_job(reg)

    def registered(self, node_id: str, reg: Registration, *, again: bool) -> None:
        """`reg` was accepted. The same process registering again (after a cut, `again`) keeps
        its window: calls it made before, still on their way, are taken once, as ever. A new
        incarnation, or this scheduler's first sight of the node, starts one above the
        registration's floor."""
        if self.job.settings.job_secret is None:
            return
        if not (again and node_id in self.call_windows):
            self.call_windows[node_id] = auth.CallWindow(reg.call_seq)

    def forget(self, node_id: str) -> None:
        """`node_id` left the job for good: its call window goes (a registration of it starts
        a new one)."""
        self.call_windows.pop(node_id, None)

    def _check_version(self, reg: Registration, *, proven: bool = True) -> Refused | None:
        """A node of this scheduler's protocol revision (one that says none speaks revision
        1, `version.revision_of`), whatever its release; one that has not `proven` the job
        secret is not told this scheduler's release (the scheduler's log names it)."""
        revision = version.revision_of(reg.protocol_revision)
        unproven = "" if proven else _UNPROVEN
        lines = version.refusal(
            f"node {reg.node_id!r}", reg.cluster_version, revision, self.runs, unproven=unproven
        )
        if lines is None:
            return None
        told, logged = lines
        return Refused(Refusal.VERSION_MISMATCH, told, logged=logged if unproven else "")

    def _check_proof(self, reg: Registration) -> Refused | None:
        """The node's credential, and with a job secret its proof of the secret."""
        if len(reg.credential_digest) != auth.DIGEST_BYTES:
            return Refused(
                Refusal.INVALID_NODE,
                f"node {reg.node_id!r} sent no node credential: it must draw one per process "
                "and send it with its registration (is it an older version of cluster?)",
            )
        secret = self.job.settings.job_secret
        if secret is None:
            return None
        stale = self._challenges.problem(reg.challenge, self.job.clock()) if reg.proof else None
        if not reg.proof:
            problem = "did not prove it"
        elif stale is not None:
            return Refused(
                Refusal.STALE_CHALLENGE,
                f"node {reg.node_id!r} sent a registration this scheduler cannot take: {stale}; "
                "the node asks for a new challenge and registers again",
                retry_after_s=0.1,
            )
        elif len(reg.nonce) < auth.NONCE_BYTES or not auth.proven(secret, reg.message(), reg.proof):
            problem = "proved another secret"
        elif reg.job_id != self.job.cluster_id:
            problem = f"proved it for job {reg.job_id[:40]!r}"
        elif not self._nonces.first_time(reg.nonce):
            problem = "sent a registration seen before (a replay)"
        else:
            return None
        return Refused(
            Refusal.NOT_A_MEMBER,
            f"node {reg.node_id!r} is not a member of this job: this scheduler needs the job "
            f"secret (CLUSTER_JOB_SECRET_FILE or CLUSTER_JOB_SECRET) and the node {problem}; "
            "start every process of the job with the same secret",
        )

    def _check_job(self, reg: Registration) -> Refused | None:
        job, settings = self.job, self.job.settings
        if reg.cluster_id and reg.cluster_id not in (job.cluster_id, job.previous_cluster_id):
            return Refused(Refusal.FOREIGN_JOB, self._foreign(reg, settings.recovery))
        if reg.worker_num != settings.worker_num or reg.server_num != settings.server_num:
            return Refused(
                Refusal.WORKER_NUM_MISMATCH,
                f"node {reg.node_id!r} has MS_WORKER_NUM={reg.worker_num}, "
                f"MS_SERVER_NUM={reg.server_num}, but the scheduler has "
                f"{settings.describe_counts()}: start every process of the job with the "
                "same values",
            )
        if job.phase in (Phase.FINISHED, Phase.FAILED):
            return Refused(
                Refusal.JOB_FINISHED if job.phase is Phase.FINISHED else Refusal.JOB_OVER,
                f"job {job.cluster_id} is over ({job.phase.value}: {job.detail}); start a new "
                "scheduler for a new job",
            )
        return None

    def _foreign(self, reg: Registration, recovery: bool) -> str:
        """Why a node of another job is refused, and what to do. Without recovery, that job
        ended with its scheduler: the node's process was in it, and started again it joins this
        one. A scheduler that started its job anew on an etcd prefix where nothing was saved is
        most likely one meant to stand by for the node's job, given another prefix: that is
        said first, since the node's record is right and the fix is this scheduler's
        CLUSTER_STATE_URL."""
        job = self.job
        head = (
            f"node {reg.node_id!r} belongs to job {reg.cluster_id}, but this scheduler runs "
            f"job {job.cluster_id}"
        )
        if not recovery:
            return (
                f"{head} (recovery is off, so a restarted scheduler starts a new job): the "
                "node's process was in that job, which ended when its scheduler stopped; start "
                "the node again and it joins this job (where it read that job from its record, "
                f"worker-{reg.node_id}.json in the MS_RECOVERY_PATH of its host, move that "
                "record away first)"
            )
        record = (
            f"the node's process was in that job, or read it from its record, "
            f"worker-{reg.node_id}.json in the MS_RECOVERY_PATH of its host. Where that "
            "directory is this job's own (the state of that job there was lost or moved away), "
            "move that record away and start the node again: it joins this job (to start a job "
            "anew, move the whole directory away before its scheduler starts). Where another "
            "job shares that directory, give each job its own MS_RECOVERY_PATH (mscluster run "
            "--recovery-path) and start the node again with this job's own directory"
        )
        if not job.started_anew_under:
            return f"{head}: {record}"
        return (
            f"{head}, which it started anew under {job.started_anew_under}, where nothing was "
            f"saved: if job {reg.cluster_id} keeps its state in etcd under another prefix, this "
            f"scheduler was started with the wrong {STATE_URL_ENV}: stop it and start it with "
            f"that job's prefix, and keep the node's record; otherwise: {record}"
        )

    def check_new(self, node_id: str, reg: Registration, same_role: int) -> Refused | None:
        """Whether a node id the job has not seen may join, with `same_role` members of its
        role already in."""
        settings = self.job.settings
        space = settings.space(reg.role)
        if reg.role is NodeRole.SERVER and settings.server_num == 0:
            return Refused(
                Refusal.INVALID_NODE,
                f"node {node_id!r} is a parameter server, but the job has MS_SERVER_NUM=0",
            )
        if is_numeric_node_id(node_id) and int(node_id) >= space:
            return Refused(
                Refusal.INVALID_NODE,
                f"MS_NODE_ID={node_id} is numeric, so it is the rank, and must be below "
                f"the number of {reg.role.value}s ({space})",
            )
        if self.job.phase is not Phase.WAITING or same_role >= space:
            return Refused(
                Refusal.CLUSTER_FULL,
                f"the job already has all {space} {reg.role.value}s "
                f"({settings.describe_counts()}); node {node_id!r} is one too many: check the "
                "numbers, or that no old process of the same job is still running",
            )
        return None
