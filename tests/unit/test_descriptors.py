"""The scheduler's look at its own descriptors (`cluster.scheduler.descriptors`), on real
sockets of this process: connections and their peers, found taking no descriptor; one shut down
in place."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cluster.scheduler import descriptors
from cluster.scheduler.machine.reserve import Connection

pytestmark = pytest.mark.skipif(
    not descriptors._FD_DIR.is_dir(), reason="no /proc/self/fd (not Linux)"
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on loopback: (the client's end, the accepted end)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    with client, accepted:
        yield client, accepted


def test_connections_name_their_peers_and_leave_out_listeners(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, accepted = pair
    found = {c.fd: c for c in descriptors.connections()}
    host, port = client.getsockname()
    assert found[accepted.fileno()].peer == f"{host}:{port}"
    assert found[accepted.fileno()].inode > 0
    count = descriptors.open_descriptors()
    assert count is not None
    assert count >= 2


def test_ages_count_from_when_a_socket_was_first_seen(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    _, accepted = pair
    seen: dict[int, float] = {}
    descriptors.connections(seen, now=10.0)
    later = {c.fd: c for c in descriptors.connections(seen, now=13.5)}
    assert later[accepted.fileno()].age_s == 3.5


def test_a_connection_is_shut_down_in_place_and_its_descriptor_kept(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, accepted = pair
    (mine,) = [c for c in descriptors.connections() if c.fd == accepted.fileno()]
    assert descriptors.shut_down(mine)
    client.settimeout(5)
    assert client.recv(1) == b""  # the other end sees the connection end
    assert accepted.fileno() == mine.fd  # the owner still holds (and closes) its descriptor


def test_a_descriptor_that_is_no_longer_the_socket_is_left_alone(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, accepted = pair
    other = Connection(accepted.fileno(), "127.0.0.1:1", inode=1)  # not its inode
    assert not descriptors.shut_down(other)
    client.setblocking(False)
    with pytest.raises(BlockingIOError):
        client.recv(1)  # still open


FULL_TABLE = """
import os, resource, socket, sys
from cluster.scheduler import descriptors

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
client = socket.create_connection(listener.getsockname())
accepted, _ = listener.accept()
limit = len(os.listdir("/proc/self/fd")) + 16
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.dup(0))
except OSError:
    pass
assert descriptors.open_descriptors() is None  # no descriptor left to list them
found = {c.fd: c for c in descriptors.connections(limit=limit)}
host, port = client.getsockname()
assert found[accepted.fileno()].peer == f"{host}:{port}", found
assert found[client.fileno()].peer == "%s:%d" % listener.getsockname(), found
assert listener.fileno() not in found
assert descriptors.shut_down(found[accepted.fileno()])
client.settimeout(5)
assert client.recv(1) == b""
print("ok", len(held))
"""


def test_connections_are_found_with_no_descriptor_free() -> None:
    # At the limit, gRPC's accept thread takes every descriptor freed: the look takes none.
    done = subprocess.run(
        [sys.executable, "-c", FULL_TABLE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")


def test_an_ipv6_peer_is_named_as_grpc_names_it() -> None:
    with socket.socket(socket.AF_INET6) as listener:
        try:
            listener.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        listener.listen()
        with socket.create_connection(listener.getsockname()[:2]) as client:
            accepted, _ = listener.accept()
            with accepted:
                found = {c.fd: c for c in descriptors.connections()}
                assert found[accepted.fileno()].peer == f"[::1]:{client.getsockname()[1]}"
