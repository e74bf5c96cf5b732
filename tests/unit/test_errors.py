"""One error tree: every exception class of `cluster` is a ClusterError in cluster.protocol.errors,
and every failure crosses the wire and comes back as the class it left as."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import grpc
import pytest

import cluster
from cluster.protocol import errors
from cluster.protocol.errors import (
    AccessDeniedError,
    CapacityError,
    ClusterError,
    CollectiveError,
    ConfigError,
    EvictedError,
    FellBehindError,
    JobFailedError,
    NotAuthenticatedError,
    NotLeaderError,
    PeerFailedError,
    UnknownNodeError,
)
from cluster.transport.failures import (
    ERROR_KIND_KEY,
    PING_TIMEOUT_DETAILS,
    RELAY_CUT_OFF,
    RELAY_ELSEWHERE,
    RELAY_KEY,
    failure_of,
    status_of,
)
from cluster.worker import convert
from cluster.worker.machine import steps


def _modules() -> list[str]:
    found = []
    for info in pkgutil.walk_packages(cluster.__path__, "cluster."):
        if info.name.startswith("cluster.v1") or info.name.endswith(".__main__"):
            continue  # generated code; the command line
        found.append(info.name)
    return found


def _exception_classes() -> dict[str, type[BaseException]]:
    classes: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
            ):
                classes[f"{name}.{value.__qualname__}"] = value
    return classes


def test_every_exception_class_is_a_cluster_error_defined_with_the_others() -> None:
    classes = _exception_classes()
    assert classes  # the walk found the package
    outside = [name for name, kind in classes.items() if kind.__module__ != errors.__name__]
    assert outside == [], "error classes belong in cluster/protocol/errors.py"
    for name, kind in classes.items():
        if name in outside or kind.__module__ != errors.__name__:
            continue
        assert issubclass(kind, ClusterError), name
        assert (kind.__doc__ or "").strip(), f"{name} has no docstring"


def _rpc_error(error: ClusterError) -> grpc.aio.AioRpcError:
    code, metadata = status_of(error)
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), details=str(error)
    )


@pytest.mark.parametrize(
    "error",
    [
        EvictedError("replaced by a new process"),
        JobFailedError("rank 1 died"),
        PeerFailedError("allgather cannot complete: rank 1 has failed"),
        NotAuthenticatedError("does not carry its credential"),
        UnknownNodeError("not a member: register first"),
        CapacityError("over CLUSTER_KV_MAX_BYTES=64"),
        CollectiveError("broadcast root 9 is not a rank"),
        FellBehindError("this event stream fell 10000 events behind"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_refusal_comes_back_as_the_class_it_left_as(error: ClusterError) -> None:
    failure = failure_of(_rpc_error(error))
    assert failure.kind is type(error)
    assert not failure.cut_off
    assert isinstance(failure.error("kv set"), type(error))
    assert str(error) in str(failure.error("kv set"))


def test_evicted_and_job_failed_share_a_code_and_differ_by_kind() -> None:
    evicted, failed = status_of(EvictedError("x")), status_of(JobFailedError("x"))
    assert evicted[0] == failed[0] == grpc.StatusCode.ABORTED
    assert evicted[1] != failed[1]


def test_not_the_leader_carries_the_leaders_address() -> None:
    failure = failure_of(_rpc_error(NotLeaderError("this scheduler is a standby", "10.0.0.2:8118")))
    assert failure.kind is NotLeaderError
    assert failure.leader == "10.0.0.2:8118"
    error = failure.error("registration")
    assert isinstance(error, NotLeaderError)
    assert error.leader == "10.0.0.2:8118"


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, AccessDeniedError),  # the certificate check
        (grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityError),  # gRPC's own message limit
        (grpc.StatusCode.DEADLINE_EXCEEDED, CollectiveError),  # the caller's deadline
        (grpc.StatusCode.UNAVAILABLE, None),  # the scheduler went away: cut off
        (grpc.StatusCode.CANCELLED, None),
        (grpc.StatusCode.INTERNAL, None),
    ],
)
def test_a_failure_without_a_kind_is_read_from_its_code(
    code: grpc.StatusCode, kind: type[ClusterError] | None
) -> None:
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")
    failure = failure_of(error)
    assert failure.kind is kind
    assert failure.cut_off is (kind is None)


def test_the_worker_core_hears_a_standby_as_the_way_to_its_leader() -> None:
    """A registration or stream ended by a standby becomes the core's NotLeader, which it
    follows at once; any other refusal of a registration ends this node's part."""
    standby = _rpc_error(NotLeaderError("this scheduler is a standby", "10.0.0.2:8118"))
    follow = steps.NotLeader("10.0.0.2:8118", retry_after_s=convert.NOT_LEADER_RETRY_S)
    assert convert.rpc_failure(standby, "the scheduler") == follow
    assert convert.lost(standby) == follow
    refused = convert.rpc_failure(_rpc_error(EvictedError("replaced")), "the scheduler")
    assert isinstance(refused, steps.Fatal)
    assert isinstance(refused.error, EvictedError)
    cut_off = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone"
    )
    assert convert.rpc_failure(cut_off, "the scheduler") == steps.Unanswered()
    assert convert.lost(cut_off) == steps.StreamLost("gone")
    # The challenge asked before a registration under the job secret has the attempt's
    # deadline: on a loaded scheduler it passes, which is no refusal (seen in the standbys
    # walkthrough: two workers exited "rejected registration: Deadline Exceeded").
    late = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="Deadline Exceeded",
    )
    assert convert.rpc_failure(late, "the scheduler") == steps.Unanswered()
    # A host's relay that cannot reach the scheduler says so: the worker asks it again.
    relayed = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata((RELAY_KEY, RELAY_CUT_OFF)),
        details="connection refused",
    )
    assert failure_of(relayed).relay_cut_off
    assert failure_of(relayed).cut_off
    assert convert.rpc_failure(relayed, "the scheduler") == steps.Unanswered("connection refused")
    assert not failure_of(cut_off).relay_cut_off
    # A relay that forwards to none of the worker's schedulers (another job's) refuses the call
    # itself: the worker's error is the relay's line as it is, no scheduler named as its maker.
    elsewhere = grpc.aio.AioRpcError(
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.aio.Metadata(),
        grpc.aio.Metadata((ERROR_KIND_KEY, "ConfigError"), (RELAY_KEY, RELAY_ELSEWHERE)),
        details="this worker is for ..., but the relay at unix:/r (CLUSTER_RELAY) forwards to ...",
    )
    assert failure_of(elsewhere).relay_elsewhere
    refused = convert.rpc_failure(elsewhere, "the scheduler at h:1")
    assert isinstance(refused, steps.Fatal)
    assert type(refused.error) is ConfigError
    assert str(refused.error) == elsewhere.details()


@pytest.mark.parametrize(
    "said", ["Stream removed (ping timeout)", "keepalive watchdog timeout", "Ping timeout"]
)
def test_an_unanswered_grpc_ping_is_told_as_what_it_means(said: str) -> None:
    """gRPC closes a connection whose ping went unanswered (the peer stopped, hung or was cut
    off); the user hears that, not gRPC's words."""
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=said
    )
    failure = failure_of(exc)
    assert failure.details == PING_TIMEOUT_DETAILS
    assert "MS_NODE_TIMEOUT" in failure.details
    assert failure.cut_off  # a lost connection: reconnect, as for any other
