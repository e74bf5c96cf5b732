"""Admission: a call is made by the member it speaks for, or refused and nothing changes.

Pure tests of `SchedulerState.admit*`, the job-secret proof of a registration and the
primitives of `cluster.protocol.auth`, with the fake clock of test_state.
"""

from __future__ import annotations

import dataclasses

import pytest

from cluster.protocol import auth
from cluster.protocol.errors import JobFailedError
from cluster.scheduler.machine.admission import MAX_REPORTED_CHECKPOINTS
from cluster.scheduler.machine.state import (
    Denial,
    Denied,
    ExchangeTicket,
    Member,
    NodeRole,
    Refusal,
)
from tests.credentials import digest, presented
from tests.unit.test_state import (
    JOB,
    FakeClock,
    _everything,
    accept,
    make_state,
    ready_state,
    refuse,
    reg,
)

SECRET = b"the job's secret"


def denied(verdict: object, kind: Denial, *words: str) -> Denied:
    assert isinstance(verdict, Denied), verdict
    assert verdict.kind is kind, verdict
    for word in words:
        assert word in verdict.message
    return verdict


# -- calls of members ---------------------------------------------------------------------------


def test_a_member_is_admitted_with_its_own_credential_only() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    member = state.admission.admit("0", 1, auth.Presented(digest("0", 1)))
    assert isinstance(member, Member)
    assert member.node_id == "0"
    assert (
        state.admission.admit("000", None, auth.Presented(digest("0", 1))) is member
    )  # canonical ids, any incarnation
    denied(
        state.admission.admit("0", 1, auth.Presented(digest("1", 1))),
        Denial.UNAUTHENTICATED,
        "'0'",
        "credential",
    )
    denied(
        state.admission.admit("0", 1, auth.Presented()),
        Denial.UNAUTHENTICATED,
        "carries no node credential",
    )
    denied(state.admission.admit("0", 1, auth.Presented(b"\x00" * 32)), Denial.UNAUTHENTICATED)


def test_unknown_ids_and_stale_incarnations_are_not_members() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    denied(
        state.admission.admit("7", 1, auth.Presented(digest("7", 1))),
        Denial.NOT_A_MEMBER,
        "'7'",
        "register first",
    )
    denied(
        state.admission.admit("0", 2, auth.Presented(digest("0", 2))),
        Denial.NOT_A_MEMBER,
        "incarnation 2",
    )
    denied(
        state.admission.admit("x" * 5000, None, auth.Presented()), Denial.NOT_A_MEMBER
    )  # shown cut short
    denied(
        state.admission.admit("9" * 5000, None, auth.Presented()), Denial.NOT_A_MEMBER
    )  # not parsed as a rank
    denied(state.admission.admit("²", None, auth.Presented()), Denial.NOT_A_MEMBER)


def test_a_restarted_node_has_a_new_credential_and_the_old_one_is_refused() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], recovery=True)
    state.disconnect("1", 1)
    clock.advance(11.0)
    accept(state, reg(state, "1", incarnation=2, port=6001))
    assert isinstance(state.admission.admit("1", 2, auth.Presented(digest("1", 2))), Member)
    denied(state.admission.admit("1", None, auth.Presented(digest("1", 1))), Denial.UNAUTHENTICATED)
    denied(state.admission.admit("1", 1, auth.Presented(digest("1", 1))), Denial.NOT_A_MEMBER)


def test_credentials_survive_a_scheduler_restart_as_hashes() -> None:
    clock = FakeClock()
    state = ready_state(clock, ["0", "1"], recovery=True)
    saved = state.snapshot()
    assert saved["members"][0]["credential_sha256"] == digest("0", 1).hex()
    restored = type(state).restore(saved, state.settings, clock, new_cluster_id="unused")
    assert isinstance(restored.admission.admit("1", 1, auth.Presented(digest("1", 1))), Member)
    denied(restored.admission.admit("1", 1, auth.Presented(digest("0", 1))), Denial.UNAUTHENTICATED)
    # The node reconnects with its registration of the same incarnation.
    accept(restored, reg(restored, "1", port=6001, cluster_id=JOB))


def test_a_checkpoint_report_is_bounded() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    assert isinstance(
        state.admission.admit_report("0", 1, auth.Presented(digest("0", 1)), 3), Member
    )
    denied(
        state.admission.admit_report(
            "0", 1, auth.Presented(digest("0", 1)), MAX_REPORTED_CHECKPOINTS + 1
        ),
        Denial.OVER_CAP,
        "keep_checkpoint_max",
    )
    denied(
        state.admission.admit_report("0", 1, auth.Presented(digest("1", 1)), 3),
        Denial.UNAUTHENTICATED,
    )


# -- collectives --------------------------------------------------------------------------------


def exchange(state: object, node_id: str, **kwargs: object) -> object:
    options: dict[str, object] = {"generation": 1, "op": "allgather", "root": 0}
    options.update(kwargs)
    return state.admission.admit_exchange(node_id, auth.Presented(digest(node_id, 1)), **options)  # type: ignore[attr-defined]


def test_an_admitted_collective_knows_its_rank() -> None:
    state = ready_state(FakeClock(), ["b", "a"])
    assert exchange(state, "a") == ExchangeTicket(rank=0, size=2)
    assert exchange(state, "b", op="broadcast", root=1) == ExchangeTicket(rank=1, size=2)


def test_collectives_are_refused_by_kind() -> None:
    clock = FakeClock()
    forming = make_state(clock, worker_num=2)
    accept(forming, reg(forming, "0"))
    denied(exchange(forming, "0", generation=0), Denial.JOB_OVER, "not formed yet")
    state = ready_state(clock, ["0", "1", "2"], recovery=True)
    denied(exchange(state, "0", op="scatter"), Denial.COLLECTIVE_MISUSE, "'scatter'")
    denied(exchange(state, "0", op="broadcast", root=3), Denial.COLLECTIVE_MISUSE, "0-2")
    denied(exchange(state, "0", generation=2), Denial.WRONG_GENERATION, "generation 2")
    state.finish("2", 1)
    # A finished rank closes the rounds: only a call made again of one answered goes on.
    ticket = exchange(state, "0")
    assert isinstance(ticket, ExchangeTicket)
    assert (ticket.rank, ticket.size) == (0, 3)
    assert "rank 2 (node '2' at h0:6002) has already finished" in ticket.closed
    failed = ready_state(clock, ["0", "1"], recovery=True)
    failed.disconnect("1", 1)
    denied(exchange(failed, "0"), Denial.PEER_FAILED, "rank 1", "has failed")
    clock.advance(11.0)
    accept(failed, reg(failed, "1", incarnation=2, port=6001))
    denied(exchange(failed, "0", generation=1), Denial.PEER_FAILED, "moved on to generation 2")


def test_a_finish_of_a_member_failed_while_the_job_waits_for_it_is_refused_for_now() -> None:
    """With recovery, a formed job holds a failed member's rank for it to rejoin: its Finish,
    counted, would leave the job waiting for a rejoin that never comes. Refused as transient
    (the node registers again, then finishes); alive, it is admitted."""
    clock = FakeClock()
    held = ready_state(clock, ["0", "1"], recovery=True)
    held.disconnect("1", 1, "no heartbeat for 3.0 s")
    before = _everything(held)
    verdict = held.admission.admit_finish("1", 1, auth.Presented(digest("1", 1)))
    denied(verdict, Denial.REJOIN_FIRST, "rank 1", "no heartbeat for 3.0 s", "registers again")
    assert _everything(held) == before
    alive = held.admission.admit_finish("0", 1, auth.Presented(digest("0", 1)))
    assert isinstance(alive, Member)


def test_a_finish_that_comes_after_the_job_failed_is_refused_with_its_failure() -> None:
    """Without recovery a member's stream breaking fails the job; a Finish that comes after
    that (its node was cut off and finalized meanwhile, or a survivor's) counts for nothing,
    and its node, told it was heard, would exit 0 from a failed job. Refused with the job's
    failure, and nothing changes; a Finish heard before the failure, sent again, is
    answered."""
    over = ready_state(FakeClock(), ["0", "1", "2"])
    over.finish("2", 1)
    over.disconnect("1", 1)
    before = _everything(over)
    for node in ("0", "1"):
        verdict = over.admission.admit_finish(node, 1, auth.Presented(digest(node, 1)))
        why = denied(verdict, Denial.JOB_OVER, "job failed: rank 1", "its connection")
        assert why.message.endswith("; this node's finish came after that")
        assert isinstance(why.error(), JobFailedError)
    assert _everything(over) == before
    assert isinstance(over.admission.admit_finish("2", 1, auth.Presented(digest("2", 1))), Member)


def test_a_collective_as_another_node_is_refused_before_anything_else() -> None:
    state = ready_state(FakeClock(), ["0", "1"])
    before = _everything(state)
    verdict = state.admission.admit_exchange(
        "1", auth.Presented(digest("0", 1)), generation=9, op="?", root=99
    )
    denied(verdict, Denial.UNAUTHENTICATED, "'1'")
    assert _everything(state) == before


# -- registrations ------------------------------------------------------------------------------


@pytest.mark.parametrize("ready", [False, True])
def test_a_live_node_cannot_be_moved_or_impersonated(ready: bool) -> None:
    """Register(node '0', its incarnation, host 6.6.6.6): the attack that redirected the data
    plane. Refused whatever the credential, and the peer table is unchanged."""
    clock = FakeClock()
    state = make_state(clock, worker_num=2)
    accept(state, reg(state, "0", port=6000))
    if ready:
        accept(state, reg(state, "1", port=6001))
    before = _everything(state)
    moved = reg(state, "0", host="6.6.6.6", port=6000)
    assert refuse(state, moved, Refusal.UNAUTHENTICATED).message.count("6.6.6.6") == 0
    forged = dataclasses.replace(reg(state, "0", port=6000), credential_digest=digest("1", 1))
    refuse(state, forged, Refusal.UNAUTHENTICATED)
    assert _everything(state) == before
    assert state.members["0"].host == "h0"
    # The node itself, retrying after a lost answer, is welcome.
    accept(state, reg(state, "0", port=6000))


def test_a_registration_without_a_credential_is_refused() -> None:
    state = make_state(FakeClock(), worker_num=2)
    bare = dataclasses.replace(reg(state, "0"), credential_digest=b"")
    message = refuse(state, bare, Refusal.INVALID_NODE).message
    assert "no node credential" in message
    assert state.members == {}


def test_with_a_job_secret_a_registration_must_prove_it() -> None:
    state = make_state(FakeClock(), worker_num=2, job_secret=SECRET)
    for forged in (
        dataclasses.replace(reg(state, "0"), proof=b""),
        reg(state, "0", secret=b"a guess"),
        dataclasses.replace(reg(state, "0"), port=7),  # a field changed after the proof
        dataclasses.replace(reg(state, "0"), nonce=b"short"),
    ):
        outcome = refuse(state, forged, Refusal.NOT_A_MEMBER)
        assert "not a member of this job" in outcome.message
        assert "CLUSTER_JOB_SECRET_FILE" in outcome.message
        assert not outcome.reason.transient
    assert state.members == {}
    honest = reg(state, "0")
    accept(state, honest)
    replayed = refuse(state, honest, Refusal.NOT_A_MEMBER)
    assert "seen before" in replayed.message
    # Each attempt of the node itself has a fresh nonce.
    accept(state, reg(state, "0"))


def test_slot_squatting_is_refused_when_the_job_has_a_secret() -> None:
    state = make_state(FakeClock(), worker_num=2, job_secret=SECRET)
    for outsider in ("squat-1", "squat-2"):
        refuse(state, reg(state, outsider, secret=b"unknown"), Refusal.NOT_A_MEMBER)
    accept(state, reg(state, "0"))
    accept(state, reg(state, "1"))
    assert sorted(state.members) == ["0", "1"]


def test_a_refused_registration_is_no_refusal_of_the_secret() -> None:
    """Without a secret the proof fields mean nothing; with one, the nonce of a registration
    refused for another reason is spent all the same (its replay later is refused)."""
    open_job = make_state(FakeClock(), worker_num=1)
    accept(open_job, reg(open_job, "0", secret=b"whatever"))
    state = make_state(FakeClock(), worker_num=1, job_secret=SECRET)
    too_many = reg(state, "0", worker_num=5)
    refuse(state, too_many, Refusal.WORKER_NUM_MISMATCH)
    assert "seen before" in refuse(state, too_many, Refusal.NOT_A_MEMBER).message
    accept(state, reg(state, "0"))


def test_a_read_proof_is_taken_once_and_a_fresh_challenge_makes_another() -> None:
    clock = FakeClock()
    admission = make_state(clock, worker_num=1, job_secret=SECRET).admission
    challenge = admission.challenge()
    proof = auth.read_proof(SECRET, challenge, "WatchEvents")
    assert admission.read_problem(challenge, proof, "WatchEvents") is None
    clock.advance(1.0)
    replayed = admission.read_problem(challenge, proof, "WatchEvents") or ""
    assert "used before (a replay)" in replayed
    # The same challenge answers once per method; a guess at a proof is no replay, but wrong.
    status = auth.read_proof(SECRET, challenge, "Status")
    assert admission.read_problem(challenge, status, "Status") is None
    assert "not of this job's secret" in (admission.read_problem(challenge, b"x" * 32, "X") or "")
    fresh = admission.challenge()
    assert (
        admission.read_problem(fresh, auth.read_proof(SECRET, fresh, "WatchEvents"), "WatchEvents")
        is None
    )
    clock.advance(auth.CHALLENGE_TTL_S + 1)
    assert "old" in (admission.read_problem(challenge, proof, "WatchEvents") or "")


# -- primitives ---------------------------------------------------------------------------------


def test_the_canonical_encoding_is_unambiguous() -> None:
    assert auth.canonical(("ab", "c")) != auth.canonical(("a", "bc"))
    assert auth.canonical((1,)) != auth.canonical(("1",))
    assert auth.canonical((b"1",)) != auth.canonical(("1",))


def test_credentials_and_nonces_are_random_and_sized() -> None:
    credentials = {auth.new_credential() for _ in range(100)}
    assert len(credentials) == 100
    assert {len(c) for c in credentials} == {auth.CREDENTIAL_BYTES}
    assert len(auth.new_nonce()) == auth.NONCE_BYTES
    assert not auth.same_digest(b"", b"")


def test_the_replay_cache_is_bounded() -> None:
    cache = auth.ReplayCache(size=3)
    assert all(cache.first_time(bytes([i])) for i in range(5))
    assert len(cache) == 3
    assert not cache.first_time(bytes([4]))
    assert cache.first_time(bytes([0]))  # forgotten, oldest first
    timed = auth.ReplayCache(size=100)
    for i in range(10):
        assert timed.first_time(bytes([i]), now_s=i, until_s=i + 5.0)
    assert not timed.first_time(bytes([9]), now_s=9.5)
    assert len(timed) == 5  # 5-9: 0-4 ended at 9 or before
    assert timed.first_time(bytes([0]), now_s=9.5, until_s=14.5)  # an ended one is new again
    assert timed.first_time(b"last", now_s=100.0)
    assert len(timed) == 1


def test_registration_message_covers_every_field() -> None:
    base = reg(make_state(FakeClock(), worker_num=2), "0")
    changes = {
        "node_id": "1",
        "role": NodeRole.SERVER,
        "host": "h1",
        "port": 1,
        "incarnation": 2,
        "worker_num": 3,
        "server_num": 1,
        "cluster_id": "other",
        "credential_digest": digest("1", 1),
        "nonce": b"n" * 16,
        "spare": True,
        "challenge": b"c" * 16,
        "job_id": "job",
        "call_seq": 7,
        "collectives_generation": 2,
        "collectives_answered": 3,
    }
    # Not covered: the proof, and the node's version, so that a node of this release proves
    # what one of an older release of the same protocol revision (which sends no version) would,
    # and the scheduler of either takes it.
    uncovered = {"proof": b"p", "protocol_revision": 1, "cluster_version": "0.1.0"}
    fields = {f.name for f in dataclasses.fields(base)} - set(uncovered)
    assert set(changes) == fields  # a new field is covered, or this test says which is not
    for name, value in changes.items():
        assert dataclasses.replace(base, **{name: value}).message() != base.message(), name
    for name, value in uncovered.items():
        assert dataclasses.replace(base, **{name: value}).message() == base.message(), name


def test_with_a_job_secret_a_value_calls_first_message_names_its_sha256() -> None:
    """A job secret's call proof of a value call covers its head, which names the value's
    SHA-256: a first message that names none (or not 32 bytes) is refused before its proof is
    looked at, and its call number is not taken; without a secret the credential is enough."""
    state = ready_state(FakeClock(), ["0"], job_secret=SECRET)
    proof = presented(SECRET, "0", 1, "KvSet")
    for named in (b"", b"\x01" * 31):
        denied(
            state.admission.admit_value("0", 1, proof, named, "KvSet"),
            Denial.UNAUTHENTICATED,
            "a KvSet call whose first message names no SHA-256 of its value",
        )
    assert isinstance(state.admission.admit_value("0", 1, proof, b"\x01" * 32, "KvSet"), Member)
    open_job = ready_state(FakeClock(), ["0"])
    bearer = auth.Presented(digest("0", 1))
    assert isinstance(open_job.admission.admit_value("0", 1, bearer, b"", "Exchange"), Member)
