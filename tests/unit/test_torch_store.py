"""cluster.torch's rendezvous store server, with real sockets on loopback: it listens on the
host it is given only (torch's own listener binds every interface), and closes as it is
dropped."""

from __future__ import annotations

import datetime
import gc
import socket
import time

import pytest

pytest.importorskip("torch", reason="cluster.torch needs torch")

from cluster.api import torch as cluster_torch  # after the skip
from cluster.protocol.errors import ClusterError

TIMEOUT = datetime.timedelta(seconds=5)
BOUND_S = 5.0


def accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def test_the_store_listens_on_its_host_only_and_closes_as_it_is_dropped() -> None:
    server = cluster_torch._serve("127.0.0.1", TIMEOUT)
    port = server.port
    assert accepts("127.0.0.1", port)
    # Another address of the same loopback: a wildcard listener would accept it.
    assert not accepts("127.0.0.2", port)
    del server
    gc.collect()
    deadline = time.monotonic() + BOUND_S
    while accepts("127.0.0.1", port):
        assert time.monotonic() < deadline, f"port {port} still accepts after {BOUND_S} s"
        time.sleep(0.05)  # sleep-ok: polling, bounded by BOUND_S


def test_a_host_that_is_not_this_machines_is_refused_with_the_os_error() -> None:
    with pytest.raises(OSError):
        cluster_torch._serve("192.0.2.1", TIMEOUT)  # TEST-NET-1: no address of this host


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan"), 1e10, "30", True])
def test_a_bad_group_timeout_is_refused_naming_it(timeout_s: object) -> None:
    """Before anything is made, and without a job: a ClusterError naming the value."""
    with pytest.raises(ClusterError, match=r"cluster.torch timeout_s=.* must be a number of"):
        cluster_torch.init_process_group(timeout_s=timeout_s)  # type: ignore[arg-type]
