"""Which errors of a training step are the data plane's (gloo, NCCL through torch.distributed),
for which a TrainingLoop gives the scheduler MS_NODE_TIMEOUT + 2 s to name a failed peer, and
which are the program's own, raised at once. torch's errors are real ones: a TCPStore that
finds no server, and gloo's own words."""

from __future__ import annotations

import datetime

import pytest

from cluster.api.data_plane import is_data_plane_error
from cluster.protocol.errors import ClusterError
from cluster.testing import free_port

torch = pytest.importorskip("torch", reason="the data plane's errors are torch's")
dist = pytest.importorskip("torch.distributed")

# What gloo's all_reduce raised in a survivor when its peer was SIGKILLed (torch 2.13).
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:31978."
)


def raised(error: BaseException) -> BaseException:
    """`error` as it is caught: with a traceback of this module's frames."""
    try:
        raise error
    except BaseException as caught:
        return caught


def test_the_programs_own_errors_are_not_the_data_planes() -> None:
    for error in (
        ZeroDivisionError("division by zero"),
        KeyError("w"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
        FileNotFoundError(2, "No such file or directory"),
        ValueError("Default process group has not been initialized"),
    ):
        assert not is_data_plane_error(raised(error)), error


def test_a_store_that_finds_no_server_is_the_data_planes() -> None:
    """torch.distributed.DistNetworkError (a DistError), raised by torch itself."""
    with pytest.raises(dist.DistError) as caught:
        dist.TCPStore("127.0.0.1", free_port(), 2, False, timeout=datetime.timedelta(seconds=0.2))
    assert is_data_plane_error(caught.value)


def test_a_runtime_error_that_names_gloo_or_nccl_is_the_data_planes() -> None:
    """DDP's allreduce fails inside the autograd engine, whose frames are not
    torch.distributed's: the words say it."""
    assert is_data_plane_error(raised(RuntimeError(GLOO_CLOSED)))
    assert is_data_plane_error(raised(RuntimeError("NCCL error in: ... unhandled system error")))
    assert is_data_plane_error(raised(dist.DistBackendError("a watchdog timeout")))


def test_an_error_raised_from_or_during_a_data_plane_error_is_one() -> None:
    def reraised() -> BaseException:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as exc:
            try:
                raise ClusterError("the step failed") from exc
            except ClusterError as outer:
                return outer

    assert is_data_plane_error(reraised())
