"""What a restarted scheduler needs of the job (`save`), and the job made again from it
(`resume`): the state machine's snapshot, as plain JSON-able data, stamped with the release and
protocol revision of the scheduler that saved it (`cluster.protocol.version`): a scheduler of
another revision resumes nothing of it (a state without the stamp is of revision 1)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.protocol import version
from cluster.protocol.auth import trust_fingerprint
from cluster.protocol.display import safe
from cluster.protocol.errors import SnapshotError
from cluster.protocol.records import Member, NodeState, Phase, TopologyReadyEvent

if TYPE_CHECKING:
    from cluster.scheduler.machine.state import SchedulerState

KEYS = ("cluster_id", "worker_num", "server_num", "phase", "generation", "members")


def save(job: SchedulerState) -> dict[str, Any]:
    """What a restarted scheduler needs, as plain JSON-able data.

    Nodes that registered while the job forms are not in it: they have no rank yet, and
    after a restart they simply register again (their job id is the saved one).
    """
    forming = job.phase is Phase.WAITING
    release, revision = job.admission.runs
    return {
        # Who saved it: a scheduler of another protocol revision does not resume it.
        "protocol_revision": revision,
        "cluster_version": release,
        "cluster_id": job.cluster_id,
        "previous_cluster_id": job.previous_cluster_id,
        # The job's trust: a scheduler with another job secret does not take this job over.
        "trust": trust_fingerprint(job.settings.job_secret),
        "worker_num": job.settings.worker_num,
        "server_num": job.settings.server_num,
        "phase": job.phase.value,
        "detail": job.detail,
        "generation": job.generation,
        "revision": job.revision,
        # The published generation's own rollback step and reason (a restarted scheduler
        # must tell reconnecting nodes the same, not recompute them from newer reports).
        "rollback_step": job.published_rollback_step,
        "reason": "" if job.published is None else job.published.reason,
        "members": [] if forming else [m.saved() for m in job.members.values()],
        "spares": [] if forming else [m.saved() for m in job.spares.values()],
        # By node id, the generation whose rollback step the worker had put back when it
        # listed the checkpoints saved for it (`RollbackPlanner`).
        "put_back": {} if forming else job.rollback.saved(),
    }


def resume(fresh: SchedulerState, snapshot: dict[str, Any]) -> SchedulerState:
    """This new state made the one `snapshot` saved (itself, when that job had ended)."""
    settings = fresh.settings
    _check_version(snapshot, fresh.admission.runs)
    missing = [k for k in KEYS if k not in snapshot]
    if missing:
        raise SnapshotError(f"the saved state lacks {', '.join(missing)}")
    saved = (snapshot["worker_num"], snapshot["server_num"])
    phase = Phase(snapshot["phase"])
    if phase in (Phase.FINISHED, Phase.FAILED):
        fresh.previous_cluster_id = str(snapshot["cluster_id"])
        return fresh
    if saved != (settings.worker_num, settings.server_num):
        raise SnapshotError(
            f"it holds job {snapshot['cluster_id']} with MS_WORKER_NUM={saved[0]}, "
            f"MS_SERVER_NUM={saved[1]}, but this scheduler has {settings.describe_counts()}: "
            "restart it with the job's values"
        )
    _check_trust(snapshot, settings.job_secret)
    fresh.cluster_id = str(snapshot["cluster_id"])
    fresh.previous_cluster_id = str(snapshot.get("previous_cluster_id", ""))
    fresh.generation = int(snapshot["generation"])
    fresh.revision = int(snapshot.get("revision", 0))
    fresh.detail = str(snapshot.get("detail", ""))
    if phase is Phase.WAITING:
        return fresh
    now = fresh.clock()
    for saved_member in snapshot["members"]:
        fresh.add_restored(Member.loaded(saved_member, now))
    for saved_spare in snapshot.get("spares", ()):
        spare = Member.loaded(saved_spare, now)
        fresh.spares[spare.node_id] = spare
    fresh.liveness.unheard.update(fresh.members, fresh.spares)
    fresh.rollback.restored(snapshot.get("put_back", {}))
    if len(fresh.members) != fresh.expected:
        raise SnapshotError(
            f"job {fresh.cluster_id} had formed, but the saved state names "
            f"{len(fresh.members)} nodes instead of {fresh.expected}"
        )
    fresh.phase = Phase.READY
    fresh.restored_generation = fresh.generation
    saved_step = snapshot.get("rollback_step", 0)
    fresh.published = TopologyReadyEvent(
        fresh.generation, fresh.peers(), int(saved_step), str(snapshot.get("reason", "formed"))
    )
    return fresh


def _check_version(snapshot: dict[str, Any], runs: tuple[str, int]) -> None:
    """SnapshotError when `snapshot` was saved under another protocol revision than this
    scheduler's (`runs`: its release and revision), whose keys may mean something else here."""
    revision = version.revision_of(int(snapshot.get("protocol_revision", 0)))
    if revision == runs[1]:
        return
    release = safe(snapshot.get("cluster_version", ""), version.MAX_VERSION_CHARS)
    saver = f"cluster {release}" if release else "the release that saved it"
    raise SnapshotError(
        f"it was saved by {version.describe(release, revision)}, but this scheduler runs "
        f"{version.describe(*runs)}: start the job's schedulers from {saver} to resume the job"
    )


def _check_trust(snapshot: dict[str, Any], secret: bytes | None) -> None:
    """SnapshotError when the job saved in `snapshot` is of another job secret than `secret`
    (a state saved before states recorded it is taken as it is)."""
    saved = snapshot.get("trust")
    if saved is None or str(saved) == trust_fingerprint(secret):
        return
    if not saved:
        differs = "has no job secret, but this scheduler has one"
    elif secret is None:
        differs = "has a job secret, but this scheduler has none"
    else:
        differs = "has another job secret than this scheduler"
    raise SnapshotError(
        f"it holds job {snapshot['cluster_id']}, which {differs} (CLUSTER_JOB_SECRET_FILE): "
        "it is another job's state, whose nodes this scheduler would refuse; if it is this "
        "job's, start this scheduler with that job's secret"
    )


def restored_note(restored: SchedulerState, snapshot: dict[str, object], path: str) -> str:
    """What the scheduler logs once it knows it can go on from `snapshot` (saved again)."""
    if restored.previous_cluster_id == snapshot["cluster_id"]:
        return (
            f"the job saved in {path} ({snapshot['cluster_id']}) had ended "
            f"({snapshot['phase']}); starting a new job {restored.cluster_id}"
        )
    if restored.phase is Phase.READY and not restored.awaiting:
        return (
            f"resuming job {restored.cluster_id} from {path}: generation {restored.generation}, "
            f"with no node to reconnect: {_none_alive(restored)}"
        )
    if restored.phase is Phase.READY:
        return (
            f"resuming job {restored.cluster_id} from {path}: generation {restored.generation}, "
            f"waiting up to MS_NODE_TIMEOUT={restored.settings.node_timeout_s:g} s for its "
            f"{len(restored.awaiting)} nodes to reconnect"
        )
    return f"resuming job {restored.cluster_id} from {path}: still forming"


def _none_alive(restored: SchedulerState) -> str:
    """What a formed job resumed with no node alive waits for, in words."""
    members = len(restored.members)
    failed = sum(member.state is NodeState.FAILED for member in restored.members.values())
    who = (
        f"all {members} of its nodes had failed"
        if failed == members
        else f"{failed} of its {members} nodes had failed and {members - failed} finished"
    )
    return (
        f"{who} when it was saved; it waits for each that failed to rejoin (started again), up "
        f"to MS_TOPO_TIMEOUT={restored.settings.topo_timeout_s:g} s after its guard ends, and "
        "fails the job otherwise"
    )
