"""What test_fuzz.py sends: hypothesis strategies of calls of every RPC of the scheduler and of a
worker's state server, as bytes on the wire, with who they say they come from.

A call is data: its method, its request bodies (a well-formed message with arbitrary fields, one
with bytes cut or changed, or random bytes) and who it claims to be. What needs the live job (a
fresh call proof over the body, the member's last metadata, an operator's read proof, a state
server's token) is made when the call is sent (`test_fuzz.metadata_of`, `test_fuzz.fetch_body`),
so that a proof covers exactly what goes out.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message
from hypothesis import assume
from hypothesis import strategies as st

from cluster.protocol import peer_state
from cluster.transport import edge, membership
from cluster.v1 import peer_state_pb2 as ps
from cluster.v1 import scheduler_pb2 as pb

UNARY, SERVER_STREAM, CLIENT_STREAM, BIDI = "unary", "server-stream", "client-stream", "bidi"
SCHEDULER_METHODS: dict[str, tuple[str, type[Message]]] = {
    "Challenge": (UNARY, pb.ChallengeRequest),
    "Register": (UNARY, pb.RegisterRequest),
    "Watch": (SERVER_STREAM, pb.WatchRequest),
    "Heartbeat": (CLIENT_STREAM, pb.HeartbeatRequest),
    "Exchange": (CLIENT_STREAM, pb.ExchangeRequest),
    "KvSet": (CLIENT_STREAM, pb.KvSetRequest),
    "KvGet": (UNARY, pb.KvGetRequest),
    "KvWait": (UNARY, pb.KvWaitRequest),
    "KvAdd": (UNARY, pb.KvAddRequest),
    "Finish": (UNARY, pb.FinishRequest),
    "ReportCheckpoints": (UNARY, pb.ReportCheckpointsRequest),
    "Status": (UNARY, pb.StatusRequest),
    "WatchEvents": (SERVER_STREAM, pb.WatchEventsRequest),
    "PeerTable": (UNARY, pb.PeerTableRequest),
    "HostBeats": (CLIENT_STREAM, pb.HostBeatsRequest),
    "HostWatch": (BIDI, pb.HostUp),
}
# The methods whose value comes in pieces (`edge.pieces`).
VALUE_METHODS = ("Exchange", "KvSet")
# Only a member may make these: an outsider's must never be answered OK.
MEMBERS_ONLY = ("Heartbeat", "Exchange", "KvSet", "KvGet", "KvWait", "KvAdd", "Finish")
MEMBERS_ONLY += ("ReportCheckpoints", "PeerTable")
# Who a call says it is: no metadata; forged ids with garbage proofs; the member's fresh proof;
# the member's proof under another node's id; the member's last metadata again; an operator's
# read proof (with a job secret).
OUTSIDER, FORGED, MEMBER, MEMBER_AS_OTHER, REPLAY, OPERATOR = (
    "outsider",
    "forged",
    "member",
    "member-as-other",
    "replay",
    "operator",
)
OUTSIDERS = (OUTSIDER, FORGED)
CARRIES_MEMBER_PROOF = (MEMBER, MEMBER_AS_OTHER, REPLAY)
MEMBER_ID = "fuzzer"
POOL = tuple(f"fuzz/member-{i}" for i in range(8))  # the member's own keys: a bounded store
# The keys the job set (fuzz_target.py, and each worker's state server).
JOB_KEYS = ("fuzz/rank-0", "fuzz/rank-1", peer_state.key("0"), peer_state.key("1"))
SERVED = ("fuzz", 1)  # the prefix and step every worker's state server holds


@dataclass(frozen=True)
class Known:
    """What the fuzzer knows of the job: every node's incarnation (Status shows them), the
    member's own among them."""

    incarnations: dict[str, int]

    @property
    def member_incarnation(self) -> int:
        return self.incarnations[MEMBER_ID]


# -- values ---------------------------------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
small_text = st.text(max_size=48)
small_bytes = st.binary(max_size=80)
# How often a short unit repeats in a huge value: up to ~300 KiB, past every small limit.
repeats = st.one_of(st.integers(0, 2000), st.integers(2000, 40_000))
huge_text = st.builds(lambda unit, n: unit * n, st.text(min_size=1, max_size=4), repeats)
huge_bytes = st.builds(lambda unit, n: unit * n, st.binary(min_size=1, max_size=8), repeats)
text = st.one_of(small_text, small_text, huge_text)
blobs = st.one_of(small_bytes, small_bytes, huge_bytes)
keys = st.one_of(st.sampled_from([*JOB_KEYS, *POOL]), text)


def node_ids(known: Known) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(sorted(known.incarnations)), text)


def incarnations(known: Known) -> st.SearchStrategy[int]:
    seen = sorted(known.incarnations.values())
    return st.one_of(st.sampled_from(seen), st.sampled_from([k + 1 for k in seen]), u64)


def mutated(body: bytes, cut: int, noise: bytes) -> bytes:
    """`body` with `noise` written over it at `cut` (and the rest dropped, when noise is empty)."""
    at = cut % (len(body) + 1)
    return body[:at] + noise + (body[at + len(noise) :] if noise else b"")


# -- the scheduler's requests ---------------------------------------------------------------


def registrations(known: Known) -> st.SearchStrategy[pb.RegisterRequest]:
    return st.builds(
        pb.RegisterRequest,
        node_id=node_ids(known),
        role=st.sampled_from([0, 1, 2, 77]),
        host=st.one_of(st.sampled_from(["127.0.0.1", "6.6.6.6", "::1", "x.example"]), text),
        port=st.one_of(st.integers(0, 70_000), u32),
        incarnation=incarnations(known),
        worker_num=st.one_of(st.just(2), u32),
        server_num=u32,
        cluster_id=text,
        credential=blobs,
        nonce=blobs,
        proof=blobs,
        spare=st.booleans(),
        challenge=blobs,
        job_id=text,
        call_seq=u64,
    )


def host_ups(known: Known) -> st.SearchStrategy[pb.HostUp]:
    """A relay's link, as anyone may send it: attaches of Watch and Finish requests (or garbage)
    with metadata that names members and carries no proof of them, and detaches."""
    ids, incs = node_ids(known), incarnations(known)
    watches = st.one_of(
        st.builds(pb.WatchRequest, hello=st.builds(pb.Hello, node_id=ids, incarnation=incs)),
        st.builds(pb.WatchRequest, register=registrations(known)),
    ).map(lambda request: request.SerializeToString())
    keys = st.sampled_from(
        [membership.NODE_ID_KEY, membership.INCARNATION_KEY, membership.CREDENTIAL_KEY]
    )
    metadata = st.lists(st.builds(pb.Metadatum, key=keys, value=text), max_size=4)
    attach = st.builds(
        pb.HostAttach, slot=u64, request=st.one_of(watches, blobs), metadata=metadata
    )
    finishes = st.builds(pb.FinishRequest, node_id=ids, incarnation=incs).map(
        lambda request: request.SerializeToString()
    )
    finish = st.builds(
        pb.HostAttach, slot=u64, request=st.one_of(finishes, blobs), metadata=metadata
    )
    one = st.one_of(
        st.builds(pb.HostUp, attach=attach),
        st.builds(pb.HostUp, finish=finish),
        st.builds(pb.HostUp, detach=u64),
    )
    # A relay's burst: several in one message (and a batch in a batch, which is refused).
    batch = st.lists(
        st.one_of(one, one.map(lambda up: pb.HostUp(batch=pb.HostUps(ups=[up])))), max_size=8
    )
    return st.one_of(one, batch.map(lambda ups: pb.HostUp(batch=pb.HostUps(ups=ups))))


def requests(known: Known, *, member: bool) -> dict[str, st.SearchStrategy[Message]]:
    """Well-formed requests of each method, with arbitrary fields; a `member`'s set only keys of
    its own (`self_harm`)."""
    ids, incs = node_ids(known), incarnations(known)
    listed = st.one_of(st.lists(keys, max_size=6), st.lists(small_text, max_size=3000))
    hello = st.builds(pb.Hello, node_id=ids, incarnation=incs)
    steps = st.one_of(st.lists(i64, max_size=8), st.lists(i64, min_size=1000, max_size=1100))
    own = st.sampled_from(POOL)
    made: dict[str, st.SearchStrategy[Message]] = {
        "Register": registrations(known),
        "Watch": st.one_of(
            st.builds(pb.WatchRequest, hello=hello),
            st.builds(pb.WatchRequest, register=registrations(known)),
            st.just(pb.WatchRequest()),
        ),
        "Heartbeat": st.builds(pb.HeartbeatRequest, node_id=ids, incarnation=incs),
        "Exchange": st.builds(
            pb.ExchangeRequest,
            node_id=ids,
            generation=st.one_of(st.just(1), u64),
            seq=st.one_of(st.integers(0, 4), u64),
            op=st.sampled_from([0, 1, 2, 3, 99]),
            root=st.one_of(st.integers(0, 2), u32),
            value=blobs,
        ),
        "KvSet": st.builds(pb.KvSetRequest, key=own if member else keys, value=blobs),
        "KvAdd": st.builds(pb.KvAddRequest, key=own if member else keys, amount=i64),
        "KvGet": st.builds(pb.KvGetRequest, keys=listed),
        "KvWait": st.builds(pb.KvWaitRequest, keys=listed, timeout_s=st.floats()),
        "Finish": st.builds(pb.FinishRequest, node_id=ids, incarnation=incs),
        "ReportCheckpoints": st.builds(
            pb.ReportCheckpointsRequest, node_id=ids, incarnation=incs, steps=steps
        ),
        "WatchEvents": st.builds(pb.WatchEventsRequest, follow=st.booleans(), after_seq=u64),
        "PeerTable": st.builds(pb.PeerTableRequest, digest=blobs),
        "HostBeats": st.builds(pb.HostBeatsRequest, nodes=st.lists(hello, max_size=4)),
        "HostWatch": host_ups(known),
    }
    for method, (_, message) in SCHEDULER_METHODS.items():
        made.setdefault(method, st.just(message()))
    return made


def self_harm(known: Known, method: str, who: str, request: Message) -> bool:
    """What a member may do to itself or to the store it shares, which is no attack: finish
    (its node leaves), open a second stream of its own, set the job's keys (or keys without
    end: its own are a few, so that its writes stay bounded)."""
    if who not in CARRIES_MEMBER_PROOF:
        return False
    if isinstance(request, pb.WatchRequest):
        if request.WhichOneof("kind") != "hello":
            return False
        request = request.hello
    if method in ("Finish", "Watch"):
        fields = (request.node_id, request.incarnation)  # type: ignore[attr-defined]
        return fields == (MEMBER_ID, known.member_incarnation)
    return method in ("KvSet", "KvAdd") and request.key not in POOL  # type: ignore[attr-defined]


def harmless(known: Known, method: str, who: str, body: bytes) -> bool:
    """Whether `body`, if it parses at all, is not a member's `self_harm`."""
    try:
        request = SCHEDULER_METHODS[method][1].FromString(body)
    except DecodeError:
        return True
    return not self_harm(known, method, who, request)


# -- calls ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call of the scheduler as it goes on the wire."""

    method: str
    bodies: tuple[bytes, ...]  # one, or a client stream's
    who: str
    forged: tuple[tuple[str, str], ...] = ()  # metadata sent as it is (FORGED)
    other: str = ""  # the node id the member's proof is sent under (MEMBER_AS_OTHER)
    whole: bytes | None = None  # what a value call's proof covers: its head (`edge.head`)

    def __repr__(self) -> str:  # hypothesis prints a failing call: keep it short
        sizes = [len(b) for b in self.bodies]
        heads = [b[:60] for b in self.bodies]
        return (
            f"Call({self.method}, who={self.who}, sizes={sizes}, heads={heads}, "
            f"forged={self.forged!r:.300}, other={self.other!r})"
        )


printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
metadata_values = st.one_of(st.text(printable, max_size=80), st.text(printable, min_size=4000))


def forged_metadata(known: Known) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    """Ids and incarnations from Status with garbage (or nothing) as their proof."""
    ids = st.one_of(st.sampled_from(sorted(known.incarnations)), metadata_values)
    incs = st.one_of(incarnations(known).map(str), metadata_values)
    macs = st.builds(lambda n, m: f"{n}.{m.hex()}", u64, st.binary(min_size=32, max_size=32))
    proofs = st.one_of(
        st.tuples(st.just(membership.CALL_KEY), st.one_of(metadata_values, macs)),
        st.tuples(st.just(membership.CREDENTIAL_KEY), st.binary(max_size=40).map(bytes.hex)),
        st.tuples(st.just(membership.READ_KEY), metadata_values),
    )
    return st.builds(
        lambda i, n, extra: ((membership.NODE_ID_KEY, i), (membership.INCARNATION_KEY, n), *extra),
        ids,
        incs,
        st.lists(proofs, max_size=3),
    )


def scheduler_calls(known: Known, method: str) -> st.SearchStrategy[Call]:
    """Calls of `method`, a third of them with the member's proof."""
    made = requests(known, member=False)[method]
    by_member = requests(known, member=True)[method]
    whos = [OUTSIDER, FORGED, FORGED, MEMBER, MEMBER, MEMBER, MEMBER_AS_OTHER, REPLAY, OPERATOR]

    @st.composite
    def calls(draw: st.DrawFn) -> Call:
        who = draw(st.sampled_from(whos))
        requested = by_member if who in CARRIES_MEMBER_PROOF else made
        bodies: list[bytes] = []
        signed: bytes | None = None  # what a proof of the first message covers
        streams = SCHEDULER_METHODS[method][0] in (CLIENT_STREAM, BIDI)
        for _ in range(draw(st.integers(1, 3)) if streams else 1):
            shape = draw(st.sampled_from(["message"] * 6 + ["mutated", "random"]))
            if shape == "random":
                body = draw(blobs)
            else:
                message = draw(requested)
                if method in VALUE_METHODS and not bodies:  # its head, its SHA-256 set
                    signed = edge.signed_body(method, message)
                body = message.SerializeToString()
            if shape == "mutated":
                body = mutated(body, draw(u32), draw(st.binary(max_size=6)))
            bodies.append(body)
        assume(all(harmless(known, method, who, body) for body in bodies))
        forged = draw(forged_metadata(known)) if who == FORGED else ()
        others = ["0", "1", MEMBER_ID + "x"]
        other = draw(st.sampled_from(others)) if who == MEMBER_AS_OTHER else ""
        if method in VALUE_METHODS and draw(st.booleans()):  # a value in pieces, as a worker's
            whole = draw(requested)
            assume(harmless(known, method, who, whole.SerializeToString()))
            cut = draw(st.integers(1, 4096))
            head = edge.signed_body(method, whole)  # the first piece carries its SHA-256
            pieces = [piece.SerializeToString() for piece in edge.pieces(whole, cut)]
            return Call(method, tuple(pieces), who, forged, other, head)
        return Call(method, tuple(bodies), who, forged, other, signed)

    return calls()


# -- the state servers' requests ------------------------------------------------------------


@dataclass(frozen=True)
class Fetch:
    """One Fetch of a state server: a member's (proven when sent, with the token it read from
    the store), an outsider's (as drawn), the member's last one again, or random bytes."""

    server: int  # the rank of the worker whose state server is asked
    who: str  # MEMBER, OUTSIDER, REPLAY or "random"
    fields: tuple[str, int, int, bool] = ("", 0, 0, False)  # prefix, rank, step, any_rank
    body: bytes = b""  # an outsider's request, or random bytes

    def __repr__(self) -> str:
        return f"Fetch({self.server}, {self.who}, {self.fields!r:.200}, {self.body[:200]!r})"


@st.composite
def fetches(draw: st.DrawFn) -> Fetch:
    server = draw(st.integers(0, 1))
    who = draw(st.sampled_from([MEMBER, MEMBER, OUTSIDER, OUTSIDER, REPLAY, "random"]))
    if who == "random":
        return Fetch(server, who, body=draw(blobs))
    fields = (
        draw(st.one_of(st.just(SERVED[0]), text)),
        draw(st.one_of(st.integers(0, 2), u32)),
        draw(st.one_of(st.integers(0, 2), u64)),
        draw(st.booleans()),
    )
    if who == MEMBER and draw(st.booleans()):
        fields = (SERVED[0], draw(st.integers(0, 1)), SERVED[1], fields[3])  # a transfer
    request = ps.FetchRequest(
        prefix=fields[0],
        rank=fields[1],
        step=fields[2],
        any_rank=fields[3],
        nonce=draw(st.one_of(st.binary(min_size=16, max_size=16), blobs)),
        proof=draw(st.one_of(st.binary(min_size=32, max_size=32), blobs)),
    )
    body = request.SerializeToString()
    if draw(st.booleans()):
        body = mutated(body, draw(u32), draw(st.binary(max_size=6)))
    return Fetch(server, who, fields, body)
