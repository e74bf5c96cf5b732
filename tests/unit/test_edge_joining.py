"""The rules of a member's value in pieces (`edge.Joining`), without a scheduler: the messages
`edge.pieces` makes of a request join to that request again, any other sequence is joined only
when it keeps every rule (the first message names the whole length, each later one carries only
the next piece, never empty, and the pieces make exactly that length), and a sequence that
breaks one is refused, never joined into a different value. `tests/integration/test_pieces.py`
sends the same over a real scheduler's port."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from cluster.transport import edge
from cluster.v1 import scheduler_pb2 as pb


def joined(messages: Iterable[Any], method: str = "KvSet") -> tuple[Any, bytes] | edge.Refusal:
    """What a scheduler joins of a call that sends `messages`, as `ServicerEdge.joined` drives
    `edge.Joining` (the messages taken one by one, the first refusal ending the call)."""
    stream = iter(messages)
    joining = edge.Joining.opened(method, next(stream))
    if isinstance(joining, edge.Refusal):
        return joining
    for message in stream:
        refusal = joining.add(message)
        if refusal is not None:
            return refusal
    return joining.end()


def copied(message: Any) -> Any:
    twin = type(message)()
    twin.CopyFrom(message)
    return twin


def kv_set(key: str, value: bytes, value_bytes: int = 0) -> pb.KvSetRequest:
    return pb.KvSetRequest(key=key, value=value, value_bytes=value_bytes)


@given(
    key=st.text(max_size=12),
    value=st.binary(max_size=3000),
    size=st.integers(min_value=1, max_value=700),
)
def test_the_pieces_of_a_set_join_to_the_request_again(key: str, value: bytes, size: int) -> None:
    request = kv_set(key, value)
    sent = [copied(message) for message in edge.pieces(request, size)]
    assert joined(sent) == (request, value)


@given(
    value=st.binary(max_size=3000),
    size=st.integers(min_value=1, max_value=700),
    generation=st.integers(min_value=0, max_value=2**64 - 1),
    seq=st.integers(min_value=0, max_value=2**64 - 1),
    root=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_the_pieces_of_an_exchange_join_to_the_request_again(
    value: bytes, size: int, generation: int, seq: int, root: int
) -> None:
    request = pb.ExchangeRequest(
        node_id="worker-3", generation=generation, seq=seq, root=root, value=value
    )
    sent = [copied(message) for message in edge.pieces(request, size)]
    assert joined(sent, "Exchange") == (request, value)


def rules_kept(messages: list[pb.KvSetRequest]) -> tuple[pb.KvSetRequest, bytes] | None:
    """The request a call of `messages` means when it keeps the rules, None when it breaks one:
    the rules written out once more, apart from `edge.Joining`."""
    first, later = messages[0], messages[1:]
    if not first.value_bytes:
        return (first, first.value) if not later else None
    if any(message.key or message.value_bytes or not message.value for message in later):
        return None
    value = first.value + b"".join(message.value for message in later)
    if len(value) != first.value_bytes:
        return None
    return pb.KvSetRequest(key=first.key, value=value), value


# Messages of a set as any client may send them: a key or none, a short value, a named length
# or none, so that sequences keeping the rules and sequences breaking them both come often.
MESSAGES = st.builds(
    kv_set,
    key=st.sampled_from(["", "k"]),
    value=st.binary(max_size=6),
    value_bytes=st.sampled_from([0, 0, 3, 6, 9, 12]),
)


@given(messages=st.lists(MESSAGES, min_size=1, max_size=5))
def test_a_sequence_is_joined_exactly_when_it_keeps_the_rules(
    messages: list[pb.KvSetRequest],
) -> None:
    expected = rules_kept([copied(message) for message in messages])
    result = joined(messages)
    if expected is None:
        assert isinstance(result, edge.Refusal)
        assert result.reason == "malformed"
        assert "KvSet" in result.problem
    else:
        assert result == expected


BROKEN = {
    "a piece left out": lambda sent: sent[:1] + sent[2:],
    "a piece twice": lambda sent: [*sent, copied(sent[-1])],
    "an empty piece": lambda sent: [*sent[:-1], kv_set("", b""), sent[-1]],
    "the last piece cut short": lambda sent: [*sent[:-1], kv_set("", sent[-1].value[:-1])],
    "a later message with a key": lambda sent: [*sent[:-1], kv_set("k", sent[-1].value)],
    "a later message naming a length": lambda sent: [
        *sent[:-1],
        kv_set("", sent[-1].value, sent[0].value_bytes),
    ],
    "a longer length named": lambda sent: [
        kv_set(sent[0].key, sent[0].value, sent[0].value_bytes + 1),
        *sent[1:],
    ],
    "a shorter length named": lambda sent: [
        kv_set(sent[0].key, sent[0].value, sent[0].value_bytes - 1),
        *sent[1:],
    ],
}


@given(
    value=st.binary(min_size=2, max_size=600),
    size=st.integers(min_value=1, max_value=200),
    broken=st.sampled_from(sorted(BROKEN)),
)
def test_pieces_that_break_a_rule_are_refused(value: bytes, size: int, broken: str) -> None:
    sent = [
        copied(message) for message in edge.pieces(kv_set("k", value), min(size, len(value) - 1))
    ]
    result = joined(BROKEN[broken](sent))
    assert isinstance(result, edge.Refusal), broken
    assert result.reason == "malformed"


def test_a_length_past_the_largest_value_is_refused_from_the_first_message() -> None:
    first = kv_set("k", b"x", edge.MAX_VALUE_BYTES + 1)
    result = joined([first, kv_set("", b"never read")])
    assert isinstance(result, edge.Refusal)
    assert result.reason == "oversized"
    assert f"{edge.MAX_VALUE_BYTES + 1:,} bytes" in result.problem


def test_a_first_message_longer_than_the_length_it_names_is_refused() -> None:
    result = joined([kv_set("k", b"abcd", 3)])
    assert result == edge.Refusal("malformed", "a KvSet value longer than the length it named")


def test_the_refusals_say_what_was_wrong() -> None:
    short = joined([kv_set("k", b"ab", 5), kv_set("", b"c")])
    assert short == edge.Refusal("malformed", "a KvSet value 2 bytes short of the length it named")
    extra = joined([kv_set("k", b"ab", 4), kv_set("x", b"cd")])
    assert extra == edge.Refusal(
        "malformed", "a later message of a KvSet carries more than a piece"
    )
    empty = joined([kv_set("k", b"ab", 4), kv_set("", b""), kv_set("", b"cd")])
    assert empty == edge.Refusal("malformed", "a later message of a KvSet carries no piece")
    after_one = joined([kv_set("k", b"ab"), kv_set("", b"")])
    assert after_one == edge.Refusal("malformed", "a KvSet of one message followed by another")
