"""Pure tests of "Trust II": limits at the edge, the scheduler's challenge, wrapped credentials,
call proofs and their replay window, and refusals told at a bounded rate.

The attacks these stand for, run against real processes, are in
tests/integration/test_hostile.py; here each rule is checked on its own, with a fake clock.
"""

from __future__ import annotations

import dataclasses
import platform
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol import auth
from cluster.protocol.display import safe
from cluster.protocol.environment import from_env
from cluster.protocol.records import NodeRole
from cluster.scheduler import convert
from cluster.scheduler.machine.state import Denial, Denied, Member, Refusal
from cluster.scheduler.refusals import RefusalLimiter
from cluster.transport import allocator, edge, membership
from cluster.transport.handlers import peer_host
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert as worker_convert
from cluster.worker.identity import NodeIdentity
from tests.conftest import FakeClock
from tests.credentials import credential, digest, presented
from tests.unit.test_state import accept, make_state, refuse, reg

SECRET = b"the job's secret"


# -- the scheduler's challenge -----------------------------------------------------------------


def test_a_challenge_is_good_for_its_life_at_its_own_scheduler_only() -> None:
    issuer = auth.ChallengeIssuer()
    challenge = issuer.issue(100.0)
    assert len(challenge) == auth.CHALLENGE_BYTES
    assert issuer.problem(challenge, 100.0 + auth.CHALLENGE_TTL_S) is None
    assert "old" in (issuer.problem(challenge, 101.0 + auth.CHALLENGE_TTL_S) or "")
    assert "not this scheduler's" in (auth.ChallengeIssuer().problem(challenge, 100.0) or "")
    tampered = challenge[:-1] + bytes([challenge[-1] ^ 1])
    assert "not this scheduler's" in (issuer.problem(tampered, 100.0) or "")
    assert "no challenge" in (issuer.problem(b"", 100.0) or "")


def test_challenges_asked_in_the_same_millisecond_differ_so_readers_prove_differently() -> None:
    """Readers asking at once (the launcher, `status --watch`, `events`) each get a challenge
    of their own: their proofs with the same secret differ, so none is taken for a replay; the
    challenge keeps its size on the wire."""
    issuer = auth.ChallengeIssuer()
    made = {issuer.issue(100.0) for _ in range(1000)}
    assert len(made) == 1000
    assert {len(c) for c in made} == {auth.CHALLENGE_BYTES} == {40}
    assert all(issuer.problem(c, 100.0) is None for c in made)
    assert len({auth.read_proof(SECRET, c, "Status") for c in made}) == 1000


def test_a_captured_registration_fails_after_a_restart_and_in_another_job() -> None:
    clock = FakeClock()
    state = make_state(clock, worker_num=2, job_secret=SECRET)
    captured = reg(state, "0")
    accept(state, captured)
    # The running scheduler: seen before.
    assert "seen before" in refuse(state, captured, Refusal.NOT_A_MEMBER).message
    # The same job's scheduler restarted (same id, same secret, a new start): not its challenge.
    restarted = make_state(clock, worker_num=2, job_secret=SECRET)
    assert restarted.cluster_id == state.cluster_id
    refuse(restarted, captured, Refusal.STALE_CHALLENGE)
    # A new job with the same secret file: not its challenge either.
    other = make_state(clock, worker_num=2, job_secret=SECRET)
    other.cluster_id = "job-2"
    refuse(other, captured, Refusal.STALE_CHALLENGE)
    # Too old for the running one, had it not been seen.
    late = reg(state, "1")
    clock.advance(auth.CHALLENGE_TTL_S + 2)
    assert "old" in refuse(state, late, Refusal.STALE_CHALLENGE).message


def test_a_proof_for_another_job_is_refused() -> None:
    state = make_state(FakeClock(), worker_num=2, job_secret=SECRET)
    forged = dataclasses.replace(reg(state, "0"), job_id="job-elsewhere")
    forged = dataclasses.replace(forged, proof=auth.prove(SECRET, forged.message()))
    assert "proved it for job" in refuse(state, forged, Refusal.NOT_A_MEMBER).message


# -- the credential never in clear -------------------------------------------------------------


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16))
def test_a_wrapped_credential_unwraps_with_the_secret_only(cred: bytes, nonce: bytes) -> None:
    challenge = b"c" * auth.CHALLENGE_BYTES
    wrapped = auth.wrap(SECRET, challenge, nonce, cred)
    assert len(wrapped) == len(cred)
    assert auth.unwrap(SECRET, challenge, nonce, wrapped) == cred
    assert auth.unwrap(b"a guess", challenge, nonce, wrapped) != cred


def test_the_scheduler_keeps_the_hash_of_the_unwrapped_credential() -> None:
    challenge, nonce, own = b"c" * auth.CHALLENGE_BYTES, b"n" * 16, credential("0", 1)
    request = pb.RegisterRequest(
        node_id="0",
        host="h",
        port=1,
        credential=auth.wrap(SECRET, challenge, nonce, own),
        nonce=nonce,
        challenge=challenge,
    )
    assert request.credential != own
    seen = convert.registration_from_pb(request, convert.role_from_pb(pb.ROLE_WORKER), SECRET)  # type: ignore[arg-type]
    assert seen.credential_digest == digest("0", 1)


def test_a_digest_is_sha256_of_its_bytes() -> None:
    """The package's one digest (a credential's, a call body's, a compressed peer table's), and
    the size every digest on the wire is checked against (hashlib is imported on first use)."""
    import hashlib  # noqa: PLC0415 - this test's alone

    assert auth.sha256(b"table") == hashlib.sha256(b"table").digest()
    assert hashlib.sha256().digest_size == auth.DIGEST_BYTES


def test_a_registration_says_how_far_its_collectives_got_under_its_proof() -> None:
    """The node's last collective answered travels in its registration, covered by the proof:
    a relay or an outsider that changed it would make the proof fail."""
    config = from_env(
        {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "h", "MS_SCHED_PORT": "1"}
    )
    identity = NodeIdentity("0", 5, "h", 1)
    challenge = (b"c" * auth.CHALLENGE_BYTES, "job")
    request = worker_convert.register_request(
        config, identity, "job", SECRET, challenge=challenge, collectives=(3, 7)
    )
    seen = convert.registration_from_pb(request, NodeRole.WORKER, SECRET)
    assert (seen.collectives_generation, seen.collectives_answered) == (3, 7)
    assert auth.proven(SECRET, seen.message(), seen.proof)
    changed = dataclasses.replace(seen, collectives_answered=1)
    assert not auth.proven(SECRET, changed.message(), seen.proof)


# -- call proofs -------------------------------------------------------------------------------


def _member(state: object, node_id: str) -> Member:
    return state.members[node_id]  # type: ignore[attr-defined,no-any-return]


def test_with_a_secret_calls_carry_proofs_that_cannot_be_replayed_or_moved() -> None:
    state = make_state(FakeClock(), worker_num=2, job_secret=SECRET)
    accept(state, reg(state, "0"))
    member = _member(state, "0")
    call = presented(SECRET, "0", 1)
    assert state.admission.admit("0", 1, call) is member
    replayed = state.admission.admit("0", 1, call)
    assert isinstance(replayed, Denied)
    assert replayed.kind is Denial.UNAUTHENTICATED
    assert "seen before" in replayed.message
    # The credential's hash, which a call of an open job carries, is no proof here.
    bearer = state.admission.admit("0", 1, auth.Presented(digest("0", 1)))
    assert isinstance(bearer, Denied)
    assert "no call proof" in bearer.message
    # A proof moved to another method (or request) is another call's.
    proof = presented(SECRET, "0", 1).call
    assert proof is not None
    moved = state.admission.admit(
        "0", 1, auth.Presented(call=dataclasses.replace(proof, method="KvSet"))
    )
    assert isinstance(moved, Denied)
    assert "not that node's" in moved.message
    # Under another secret.
    assert isinstance(state.admission.admit("0", 1, presented(b"a guess", "0", 1)), Denied)


def test_calls_wait_for_the_nodes_registration_with_a_restarted_scheduler() -> None:
    state = make_state(FakeClock(), worker_num=1, job_secret=SECRET)
    accept(state, reg(state, "0"))
    state.admission.call_windows.clear()  # as after a restart: the windows are not saved
    verdict = state.admission.admit("0", 1, presented(SECRET, "0", 1))
    assert isinstance(verdict, Denied)
    assert verdict.kind is Denial.NOT_REGISTERED_HERE
    assert verdict.error().__class__.__name__ == "RegistrationPendingError"


def test_a_call_number_at_or_below_the_registrations_is_refused() -> None:
    state = make_state(FakeClock(), worker_num=1, job_secret=SECRET)
    registration = dataclasses.replace(reg(state, "0"), call_seq=10**15)
    registration = dataclasses.replace(
        registration, proof=auth.prove(SECRET, registration.message())
    )
    accept(state, registration)
    old = state.admission.admit("0", 1, presented(SECRET, "0", 1))  # a number from before
    assert isinstance(old, Denied)
    assert "not above" in old.message


@given(st.lists(st.integers(min_value=1, max_value=5000), max_size=200))
def test_the_call_window_takes_each_number_once(numbers: list[int]) -> None:
    window = auth.CallWindow(0, size=64)
    taken: set[int] = set()
    for seq in numbers:
        highest_before = window.highest
        refused = window.take(seq)
        if refused is None:
            assert seq not in taken
            assert seq > highest_before - 64
            taken.add(seq)
        else:
            assert seq in taken or seq <= highest_before - 64


def test_a_signer_numbers_its_calls_above_its_registration() -> None:
    identity = type("I", (), {"node_id": "0", "incarnation": 1, "credential": credential("0", 1)})
    signer = membership.signer(SECRET, identity)
    assert signer is not None
    first, second = signer.metadata("KvGet", b"x"), signer.metadata("KvGet", b"x")
    assert first != second
    read = membership.caller(second, "KvGet", lambda: b"x")
    assert read.presented.call is not None
    assert read.presented.call.seq == 2
    assert dict(second).get(membership.CREDENTIAL_KEY) is None  # never the credential


# -- limits at the edge ------------------------------------------------------------------------


def test_an_oversized_request_is_not_parsed() -> None:
    def parse(data: bytes) -> bytes:
        raise AssertionError("parsed")

    capped = edge.capped("Register", parse)
    found = capped(b"x" * (8 * 1024 * 1024))
    assert isinstance(found, edge.Oversized)
    assert "8,388,608 bytes" in found.message()
    assert "4,096" in found.message()


def test_registration_fields_are_bounded_and_quoted_short_and_escaped() -> None:
    blobs = {"proof": (b"", 32)}
    hostile = "\x1b[2J\x1b]0;owned\x07\nrank 0 finished" + "x" * (8 << 20)
    for node_id, host, port in (
        (hostile, "h", 1),
        ("0", hostile, 1),
        ("0", "h" * (4 << 20), 1),
        ("0", "h", 0),
        ("0", "h", 4294967295),
    ):
        problem = edge.registration_problem(node_id, host, port, (), blobs)
        assert problem is not None
        assert len(problem) < 300
        assert "\x1b" not in problem
        assert "\n" not in problem
        assert "\x07" not in problem
    assert edge.registration_problem("0", "10.0.0.1", 1, ("job-1",), blobs) is None
    assert edge.registration_problem("0", "::1", 65535, (), blobs) is None
    assert edge.registration_problem("0", "node-7.example.org", 1, (), blobs) is None
    assert "proof of 33 bytes" in (
        edge.registration_problem("0", "h", 1, (), {"proof": (b"p" * 33, 32)}) or ""
    )


_UNSAFE = {"Cc", "Cf", "Zl", "Zp", "Cs"}


@given(st.text(), st.none() | st.integers(min_value=0, max_value=50))
def test_nothing_unsafe_is_ever_shown(text: str, limit: int | None) -> None:
    shown = safe(text, limit)
    assert not any(unicodedata.category(c) in _UNSAFE for c in shown)
    if limit is not None and len(text) > limit:
        assert len(shown) <= limit * 10 + 40


@given(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E)))
def test_printable_ascii_is_shown_as_it_is(text: str) -> None:
    assert safe(text) == text


def test_bidi_overrides_and_c1_controls_are_escaped() -> None:
    assert safe("a\u202eb\x9bc\u2066") == "a\\u202eb\\x9bc\\u2066"


# -- refusals told at a bounded rate -----------------------------------------------------------


def test_a_flood_of_refusals_is_told_once_an_interval_with_its_count() -> None:
    clock = FakeClock()
    limiter = RefusalLimiter(clock, interval_s=60.0)
    told = [limiter.refused("ipv4:10.0.0.9:4000", "Register", "invalid") for _ in range(1000)]
    assert told[0] == 1
    assert sum(1 for t in told if t) == 1
    clock.advance(61)
    assert limiter.refused("ipv4:10.0.0.9:4001", "Register", "invalid") == 1000
    assert limiter.counts[("Register", "invalid")] == 1001
    # Another address is told at once.
    assert limiter.refused("ipv6:[::1]:4000", "Watch", "oversized") == 1


def test_peer_hosts_drop_the_port() -> None:
    assert peer_host("ipv4:10.0.0.9:4000") == "10.0.0.9"
    assert peer_host("ipv6:[::1]:4000") == "[::1]"


def test_a_node_registering_again_still_has_its_calls_in_flight_taken() -> None:
    """Cut off, a worker registers again with its own process; a call it made before, queued
    on its channel, reaches the scheduler after that registration: taken, and once only."""
    clock = FakeClock()
    state = make_state(clock, worker_num=1, job_secret=SECRET, recovery=True)
    accept(state, reg(state, "0"))
    in_flight, later = presented(SECRET, "0", 1), presented(SECRET, "0", 1)
    assert later.call is not None
    assert state.admission.admit("0", 1, later) is _member(state, "0")
    again = dataclasses.replace(reg(state, "0"), call_seq=later.call.seq)
    accept(state, dataclasses.replace(again, proof=auth.prove(SECRET, again.message())))
    assert state.admission.admit("0", 1, in_flight) is _member(state, "0")
    assert isinstance(state.admission.admit("0", 1, in_flight), Denied)
    assert isinstance(state.admission.admit("0", 1, later), Denied)
    # A new process of the node starts a window of its own, above its registration's number.
    clock.advance(state.settings.node_timeout_s + 1)
    fresh = dataclasses.replace(reg(state, "0", incarnation=2), call_seq=later.call.seq)
    accept(state, dataclasses.replace(fresh, proof=auth.prove(SECRET, fresh.message())))
    assert state.admission.call_windows["0"].floor == later.call.seq


def test_a_registration_says_a_number_below_the_calls_still_in_flight() -> None:
    identity = type("I", (), {"node_id": "0", "incarnation": 1, "credential": credential("0", 1)})
    signer = membership.signer(SECRET, identity)
    assert signer is not None
    assert signer.floor == 0
    signer.metadata("KvGet", b"")
    signer.metadata("KvGet", b"")
    assert signer.floor == 2
    signer.hold(range(2, 3))  # call 2 is on its way
    signer.metadata("KvGet", b"")
    assert signer.floor == 1
    signer.release(range(2, 3))
    assert signer.floor == 3


def test_the_scheduler_maps_large_buffers_where_the_c_library_is_glibc() -> None:
    expected = platform.libc_ver()[0] == "glibc"
    assert allocator.return_large_buffers() is expected
