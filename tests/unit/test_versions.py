"""Which cluster a process runs: a registration and a saved state name their release and protocol
revision (`cluster.protocol.version`), and a scheduler refuses another revision in one line
naming both. Pure tests of the decision (`Admission`, the snapshot), and of the conversions that
carry it to and from the wire; the state machine's property test (`test_state.SchedulerMachine`)
sends registrations of other revisions at random moments too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grpc
import pytest

import cluster
from cluster.protocol import auth, version
from cluster.protocol.environment import from_env
from cluster.protocol.errors import RegistrationRefused, SnapshotError
from cluster.protocol.records import Refused, Registration
from cluster.scheduler import convert
from cluster.scheduler.machine import snapshot
from cluster.scheduler.machine.state import NodeRole, Phase, Refusal, SchedulerState
from cluster.scheduler.servicer_edge import relay_refusal
from cluster.transport import edge, failures, relay
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert as worker_convert
from cluster.worker.identity import NodeIdentity
from cluster.worker.machine import steps
from tests.conftest import FakeClock
from tests.unit.test_state import accept, make_state, ready_state, refuse, reg

ROOT = Path(__file__).resolve().parents[2]
OURS = f"cluster {version.VERSION} (protocol revision {version.PROTOCOL_REVISION})"


def test_the_release_is_kept_in_one_place() -> None:
    """`cluster.__version__`, the package's version (pyproject.toml reads it) and what a
    process sends are one value."""
    assert cluster.__version__ == version.VERSION
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '\nversion = { attr = "cluster.protocol.version.VERSION" }\n' in project
    assert version.PROTOCOL_REVISION >= 1


# -- registrations ------------------------------------------------------------------------------


def test_a_node_that_names_no_revision_is_taken_as_revision_1() -> None:
    """A node of a release before revisions were sent (no field) joins as one of revision 1,
    which a scheduler of revision 1 takes."""
    state = make_state(FakeClock(), worker_num=2)
    state.admission.runs = ("0.1.0", 1)
    accept(state, reg(state, "0", protocol_revision=0))  # nothing named
    accept(state, reg(state, "1", protocol_revision=1, cluster_version="0.1.0"))
    assert state.phase is Phase.READY


def test_another_revision_is_refused_naming_both_releases() -> None:
    state = make_state(FakeClock(), worker_num=2)
    refused = refuse(
        state,
        reg(state, "0", protocol_revision=version.PROTOCOL_REVISION + 1, cluster_version="0.9.0"),
        Refusal.VERSION_MISMATCH,
    )
    assert refused.message == (
        f"node '0' runs cluster 0.9.0 (protocol revision {version.PROTOCOL_REVISION + 1}), but "
        f"this scheduler runs {OURS}: start every process of the job (schedulers, relays, "
        "workers) from the same version of cluster"
    )
    assert not refused.reason.transient
    assert state.members == {}


def test_a_scheduler_of_a_later_revision_refuses_a_node_that_names_none() -> None:
    state = make_state(FakeClock(), worker_num=2)
    state.admission.runs = ("0.9.0", 2)
    refused = refuse(state, reg(state, "0", protocol_revision=0), Refusal.VERSION_MISMATCH)
    assert (
        "node '0' runs an older cluster that does not name its version (protocol revision 1), "
        "but this scheduler runs cluster 0.9.0 (protocol revision 2)" in refused.message
    )
    accept(state, reg(state, "0", protocol_revision=2, cluster_version="0.9.1"))


def test_another_revision_is_refused_as_one_whatever_else_is_wrong() -> None:
    """What a node of another revision sends may mean something else: its proof of the job
    secret, its counts and its job are not judged by this revision's rules (its refusal says
    the revision, not what those rules would find)."""
    state = ready_state(FakeClock(), ["0", "1"], job_secret=b"the secret")
    unproven = dataclasses.replace(reg(state, "7", worker_num=9, cluster_id="x"), proof=b"")
    other = dataclasses.replace(unproven, protocol_revision=NEWER)
    refuse(state, other, Refusal.VERSION_MISMATCH)
    # The same registration of this revision is refused for what is wrong in it.
    assert isinstance(outcome := state.register(unproven)[0], Refused)
    assert outcome.reason is Refusal.NOT_A_MEMBER


# This scheduler's release in the tests of what a node that did not prove the job secret learns:
# a string no other part of a refusal names.
HIDDEN = ("7.7.7+ours", version.PROTOCOL_REVISION)
NEWER = version.PROTOCOL_REVISION + 1
THEIRS = f"cluster 9.9.9 (protocol revision {NEWER})"
TOLD = (
    f"node '7' runs {THEIRS}, which this scheduler does not speak; it names its own release "
    "only to a process that proves the job secret (CLUSTER_JOB_SECRET_FILE or "
    "CLUSTER_JOB_SECRET), which this node did not (a process of another revision may make its "
    "proof otherwise), and in its own log: start every process of the job (schedulers, relays, "
    "workers) from the same version of cluster"
)
# The forgeries: what a registration of the next revision that does not prove the job secret
# sends in place of what a member's process would.
FORGERIES = ["no proof", "another secret", "another job", "no credential", "stale", "replay"]


def _unproven(state: SchedulerState, clock: FakeClock, forgery: str) -> Registration:
    """Node 7's registration of release 9.9.9, of the next revision, that does not prove the
    job secret as `forgery` says."""
    newer = reg(state, "7", protocol_revision=NEWER, cluster_version="9.9.9")
    secret = state.settings.job_secret
    assert secret is not None
    if forgery == "stale":
        clock.advance(auth.CHALLENGE_TTL_S + 5)
        return newer
    if forgery == "replay":
        refuse(state, newer, Refusal.VERSION_MISMATCH)  # proven: told the release, once
        return newer
    forged = {
        "no proof": {"proof": b""},
        "another secret": {"proof": auth.prove(b"another secret", newer.message())},
        "another job": {"job_id": "another-job"},
        "no credential": {"credential_digest": b""},
    }[forgery]
    changed = dataclasses.replace(newer, **forged)  # type: ignore[arg-type]
    if forgery == "another job":  # proven, for that job
        changed = dataclasses.replace(changed, proof=auth.prove(secret, changed.message()))
    return changed


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_node_that_does_not_prove_the_secret_is_not_told_the_release(forgery: str) -> None:
    """Whoever reaches the port learns nothing of this scheduler from a registration of another
    revision: it is told its own release and what to do; the scheduler's log names both."""
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], job_secret=b"the secret")
    state.admission.runs = HIDDEN
    refused = refuse(state, _unproven(state, clock, forgery), Refusal.VERSION_MISMATCH)
    assert refused.message == TOLD
    assert HIDDEN[0] not in refused.message
    assert refused.logged == (
        f"node '7' runs {THEIRS}, but this scheduler runs cluster 7.7.7+ours (protocol "
        f"revision {version.PROTOCOL_REVISION}): start every process of the job (schedulers, "
        "relays, workers) from the same version of cluster; told without this scheduler's "
        "release: it names its own release only to a process that proves the job secret, "
        "which this node did not (a process of another revision may make its proof otherwise)"
    )
    assert not refused.reason.transient


def test_a_node_that_proves_the_secret_is_told_both_releases() -> None:
    state = ready_state(FakeClock(), ["0", "1"], job_secret=b"the secret")
    state.admission.runs = HIDDEN
    newer = reg(state, "7", protocol_revision=NEWER, cluster_version="9.9.9")
    refused = refuse(state, newer, Refusal.VERSION_MISMATCH)
    assert refused.message == (
        f"node '7' runs {THEIRS}, but this scheduler runs cluster 7.7.7+ours (protocol "
        f"revision {version.PROTOCOL_REVISION}): start every process of the job (schedulers, "
        "relays, workers) from the same version of cluster"
    )
    assert refused.logged == ""  # the log says what the node was told


def test_in_an_open_job_any_node_is_told_both_releases() -> None:
    """Without a job secret anyone may join: a node is told both, proof or none."""
    state = make_state(FakeClock(), worker_num=2)
    state.admission.runs = HIDDEN
    newer = dataclasses.replace(
        reg(state, "7", protocol_revision=NEWER, cluster_version="9.9.9"), credential_digest=b""
    )
    refused = refuse(state, newer, Refusal.VERSION_MISMATCH)
    assert "but this scheduler runs cluster 7.7.7+ours" in refused.message
    assert refused.logged == ""


def test_a_node_of_this_revision_is_told_what_its_proof_lacks() -> None:
    """The proof's own refusal, for a node of this revision: another secret is one."""
    state = ready_state(FakeClock(), ["0", "1"], job_secret=b"the secret")
    state.admission.runs = HIDDEN
    same = reg(state, "7")
    forged = dataclasses.replace(same, proof=auth.prove(b"another secret", same.message()))
    refused = refuse(state, forged, Refusal.NOT_A_MEMBER)
    assert "the node proved another secret" in refused.message
    assert HIDDEN[0] not in refused.message


def test_a_members_own_process_of_another_revision_changes_nothing() -> None:
    """Its credential and address are the member's: only its revision differs."""
    state = ready_state(FakeClock(), ["0", "1"])
    before = (state.snapshot(), dict(state.members))
    again = reg(state, "0", port=6000, cluster_id=state.cluster_id, protocol_revision=5)
    refuse(state, again, Refusal.VERSION_MISMATCH)
    assert (state.snapshot(), dict(state.members)) == before


# -- saved states -------------------------------------------------------------------------------


def _saved(state: SchedulerState) -> dict[str, object]:
    saved = json.loads(json.dumps(state.snapshot()))
    assert isinstance(saved, dict)
    return saved


def test_a_saved_state_names_who_saved_it() -> None:
    saved = _saved(ready_state(FakeClock(), ["0", "1"], recovery=True))
    assert saved["protocol_revision"] == version.PROTOCOL_REVISION
    assert saved["cluster_version"] == version.VERSION


@pytest.mark.parametrize("phase", ["forming", "formed"])
def test_a_state_saved_under_another_revision_is_not_resumed(phase: str) -> None:
    clock = FakeClock()
    if phase == "formed":
        state = ready_state(clock, ["0", "1"], recovery=True)
    else:
        state = make_state(clock, worker_num=2, recovery=True)
    saved = {**_saved(state), "protocol_revision": NEWER, "cluster_version": "0.9.0"}
    with pytest.raises(SnapshotError) as refused:
        SchedulerState.restore(saved, state.settings, clock, new_cluster_id="new")
    assert str(refused.value) == (
        f"it was saved by cluster 0.9.0 (protocol revision {NEWER}), but this scheduler runs "
        f"{OURS}: "
        "start the job's schedulers from cluster 0.9.0 to resume the job"
    )


def test_a_state_saved_without_the_stamp_is_of_revision_1() -> None:
    """Resumed by a scheduler of revision 1, refused by one of a later revision."""
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], recovery=True)
    saved = _saved(state)
    del saved["protocol_revision"], saved["cluster_version"]
    with pytest.raises(SnapshotError, match=r"older cluster .* \(protocol revision 1\), but"):
        SchedulerState.restore(saved, state.settings, clock, new_cluster_id="new")
    of_revision_1 = make_state(clock, worker_num=2, recovery=True)
    of_revision_1.admission.runs = ("0.1.0", 1)
    restored = snapshot.resume(of_revision_1, saved)
    assert restored.cluster_id == state.cluster_id
    assert restored.phase is Phase.READY


def test_a_state_of_another_revision_without_a_release_says_so() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, recovery=True)
    other = version.PROTOCOL_REVISION + 1
    saved = {**_saved(state), "protocol_revision": other, "cluster_version": "\x1b[2J"}
    del saved["cluster_version"]
    with pytest.raises(SnapshotError, match="by an older cluster that does not name its version"):
        SchedulerState.restore(saved, state.settings, clock, new_cluster_id="new")
    saved["cluster_version"] = "\x1b[2J"  # shown escaped
    with pytest.raises(SnapshotError, match=rf"cluster \\x1b\[2J \(protocol revision {other}\)"):
        SchedulerState.restore(saved, state.settings, clock, new_cluster_id="new")


# -- the wire ----------------------------------------------------------------------------------


def test_a_worker_names_its_release_and_the_scheduler_reads_it() -> None:
    config = from_env(
        {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "h", "MS_SCHED_PORT": "1"}
    )
    secret = b"the secret"
    request = worker_convert.register_request(
        config,
        NodeIdentity("0", 5, "h", 1),
        "",
        secret,
        challenge=(b"c" * auth.CHALLENGE_BYTES, "job"),
    )
    assert (request.protocol_revision, request.cluster_version) == (
        version.PROTOCOL_REVISION,
        version.VERSION,
    )
    seen = convert.registration_from_pb(request, NodeRole.WORKER, secret)
    assert (seen.protocol_revision, seen.cluster_version) == (
        version.PROTOCOL_REVISION,
        version.VERSION,
    )
    # Proven alike with or without them (an older release of this revision sends none).
    assert auth.proven(secret, seen.message(), seen.proof)
    unstated = dataclasses.replace(seen, protocol_revision=0, cluster_version="")
    assert auth.proven(secret, unstated.message(), seen.proof)


def test_the_refusal_reaches_the_worker_as_a_permanent_one() -> None:
    """Not retried: the worker ends with a RegistrationRefused of the scheduler's line."""
    line = f"node '0' runs cluster 0.9.0 (protocol revision 2), but this scheduler runs {OURS}"
    response = convert.register_response(Refused(Refusal.VERSION_MISMATCH, line), 1.0, 30.0)
    assert response.refused.reason == pb.REFUSAL_VERSION_MISMATCH
    answer = worker_convert.answer(pb.Event(refused=response.refused))
    assert answer == steps.Refused(line, transient=False, retry_after_s=0.0)


@pytest.mark.parametrize(
    ("sent", "problem"),
    [
        ("", None),
        ("0.1.0", None),
        ("1.0.0rc1+local.7", None),
        ("9" * version.MAX_VERSION_CHARS, None),
        ("9" * (version.MAX_VERSION_CHARS + 1), "65 characters"),
        ("0.1\n", "version 0.1\\n (4 characters)"),
    ],
)
def test_the_release_a_node_names_is_bounded_at_the_edge(sent: str, problem: str | None) -> None:
    found = edge.registration_problem("0", "h", 1, (), {}, sent)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert "is not a release's" in found
        assert problem in found


# -- a host's relay ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "read"),
    [
        (None, (1, "")),
        (version.stamp(), (version.PROTOCOL_REVISION, version.VERSION)),
        ("2 9.9.9", (2, "9.9.9")),
        ("2", (2, "")),
        ("x 9.9.9", (-1, "9.9.9")),
        ("\u0663 9.9.9", (-1, "9.9.9")),  # an Arabic-Indic 3 is no revision
    ],
)
def test_a_relays_stamp_names_its_revision_and_release(
    sent: str | None, read: tuple[int, str]
) -> None:
    assert version.stamped(sent) == read
    assert relay.stamp() == ((version.METADATA_KEY, version.stamp()),)


class _Call:
    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.metadata = metadata

    def peer(self) -> str:
        return "ipv4:10.0.0.7:41000"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def test_a_relay_of_another_revision_is_refused_and_its_workers_read_a_refusal() -> None:
    """Its link and its beats are refused with a RegistrationRefused, which every worker whose
    Watch the link carried reads as the end of its registration (not a failed collective)."""
    assert relay_refusal(_Call(), ("0.1.0", 1)) is None  # one from before stamps: revision 1
    assert relay_refusal(_Call()) is not None
    assert relay_refusal(_Call(*relay.stamp())) is None
    found = relay_refusal(_Call((version.METADATA_KEY, f"{NEWER} 9.9.9\x1b")))
    assert found is not None
    refused, logged = found
    assert isinstance(refused, RegistrationRefused)
    assert (
        str(refused)
        == logged
        == (
            f"the relay of host 10.0.0.7 runs cluster 9.9.9\\x1b (protocol revision {NEWER}), but "
            f"this scheduler runs {OURS}: start every process of the job (schedulers, relays, "
            "workers) from the same version of cluster"
        )
    )
    code, trailing = failures.status_of(refused)
    ended = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), "x")
    assert failures.failure_of(ended).kind is RegistrationRefused


def test_a_relay_to_a_job_with_a_secret_is_not_told_the_release() -> None:
    """A relay proves no job secret of its own: it is told its own release and what to do;
    the scheduler's log names both."""
    assert relay_refusal(_Call(*relay.stamp()), HIDDEN, open_job=False) is None
    found = relay_refusal(_Call((version.METADATA_KEY, f"{NEWER} 9.9.9")), HIDDEN, open_job=False)
    assert found is not None
    refused, logged = found
    assert str(refused) == (
        f"the relay of host 10.0.0.7 runs cluster 9.9.9 (protocol revision {NEWER}), which this "
        "scheduler does not speak; it names its own release only to a process that proves the "
        "job secret (CLUSTER_JOB_SECRET_FILE or CLUSTER_JOB_SECRET), which a relay does not "
        "(each of its workers proves it for itself), and in its own log: start every process of "
        "the job (schedulers, relays, workers) from the same version of cluster"
    )
    assert HIDDEN[0] not in str(refused)
    assert logged.startswith(
        f"the relay of host 10.0.0.7 runs cluster 9.9.9 (protocol revision {NEWER}), but this "
        f"scheduler runs cluster 7.7.7+ours (protocol revision {version.PROTOCOL_REVISION})"
    )
