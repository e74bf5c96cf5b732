"""A refused Exchange says why by a reason on the wire (`ExchangeRefusal`), not by its words: the
scheduler's converter writes it, the worker's reads it into the error the user catches, and an
older peer on either side (which neither sends nor reads it) gets what it always did."""

from __future__ import annotations

import grpc
import pytest

from cluster.protocol.errors import (
    ClusterError,
    CollectiveError,
    CollectiveMismatchError,
    PeerFailedError,
    PeerFinishedError,
)
from cluster.scheduler import convert as scheduler_convert
from cluster.transport.failures import (
    ERROR_KIND_KEY,
    EXCHANGE_REFUSAL_KEY,
    CallFailure,
    failure_of,
    status_of,
)
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import convert

# The scheduler's words, which a reworded message must not change the meaning of.
MISMATCH = (
    "rank 0 called allgather as collective #1, but another rank called broadcast(root=0): "
    "every rank must call the same collectives in the same order"
)


def _refused(error: ClusterError, *why: tuple[str, str | bytes]) -> grpc.aio.AioRpcError:
    """A call refused with `error` as the scheduler ends it, with the trailing metadata `why`."""
    code, metadata = status_of(error)
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata, *why), details=str(error)
    )


def _read(exc: grpc.aio.AioRpcError) -> CallFailure:
    """A failed Exchange as the worker reads it."""
    return convert.exchange_failure(exc, failure_of(exc))


def test_a_mismatch_crosses_the_wire_as_its_reason_and_keeps_its_words() -> None:
    error = CollectiveMismatchError(MISMATCH)
    why = scheduler_convert.exchange_refusal(error)
    [(key, value)] = why
    assert key == EXCHANGE_REFUSAL_KEY
    assert pb.ExchangeRefusal.FromString(value).reason == pb.EXCHANGE_REFUSAL_MISMATCH
    failure = _read(_refused(error, *why))
    assert failure.kind is CollectiveMismatchError
    raised = failure.error("allgather")
    assert type(raised) is CollectiveMismatchError
    assert str(raised) == f"allgather failed: {MISMATCH}"


FINISHED = "rank 0 has finished (called cluster.finalize()): no round of generation 1 completes"


def test_a_finished_peer_crosses_the_wire_as_its_reason() -> None:
    """A round refused because a rank has finished is a PeerFinishedError at the worker (its
    TrainingLoop's end barrier tells the others finished by it), a CollectiveError to one that
    reads no reason."""
    error = PeerFinishedError(FINISHED)
    why = scheduler_convert.exchange_refusal(error)
    [(_, value)] = why
    assert pb.ExchangeRefusal.FromString(value).reason == pb.EXCHANGE_REFUSAL_FINISHED
    exc = _refused(error, *why)
    assert dict(exc.trailing_metadata())[ERROR_KIND_KEY] == "CollectiveError"
    raised = _read(exc).error("barrier")
    assert type(raised) is PeerFinishedError
    assert str(raised) == f"barrier failed: {FINISHED}"
    assert type(failure_of(exc).error("barrier")) is CollectiveError


def test_a_mismatch_goes_as_a_collective_error_to_a_worker_that_reads_no_reason() -> None:
    """The kind on the wire is CollectiveError: an older worker, which knows no reason and no
    CollectiveMismatchError, raises the CollectiveError with the same words as before."""
    error = CollectiveMismatchError(MISMATCH)
    exc = _refused(error, *scheduler_convert.exchange_refusal(error))
    assert dict(exc.trailing_metadata())[ERROR_KIND_KEY] == "CollectiveError"
    raised = failure_of(exc).error("allgather")
    assert type(raised) is CollectiveError
    assert str(raised) == f"allgather failed: {MISMATCH}"


@pytest.mark.parametrize(
    "why",
    [
        (),  # an older scheduler's refusal: no reason, whatever its words
        ((EXCHANGE_REFUSAL_KEY, pb.ExchangeRefusal().SerializeToString()),),
        ((EXCHANGE_REFUSAL_KEY, pb.ExchangeRefusal(reason=99).SerializeToString()),),  # newer
        ((EXCHANGE_REFUSAL_KEY, b"\xff\xff not a message"),),
    ],
    ids=["none", "unspecified", "unknown", "garbled"],
)
def test_a_refusal_without_a_known_reason_is_a_plain_collective_error(
    why: tuple[tuple[str, bytes], ...],
) -> None:
    failure = _read(_refused(CollectiveError(MISMATCH), *why))
    assert failure.kind is CollectiveError
    assert type(failure.error("allgather")) is CollectiveError


def test_only_a_collective_error_is_told_apart_by_its_reason() -> None:
    """The reason refines a CollectiveError; another kind stays what it is, and an error without
    a reason sends none."""
    why = (
        (
            EXCHANGE_REFUSAL_KEY,
            pb.ExchangeRefusal(reason=pb.EXCHANGE_REFUSAL_MISMATCH).SerializeToString(),
        ),
    )
    assert _read(_refused(PeerFailedError("rank 1 has failed"), *why)).kind is PeerFailedError
    assert scheduler_convert.exchange_refusal(CollectiveError("rank 0 has finished")) == ()
    assert scheduler_convert.exchange_refusal(PeerFailedError("rank 1 has failed")) == ()
