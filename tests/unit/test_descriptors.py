"""The scheduler's look at its own descriptors (`cluster.scheduler.descriptors`), on real
sockets of this process: connections and their peers from /proc, one shut down in place."""

from __future__ import annotations

import socket
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
