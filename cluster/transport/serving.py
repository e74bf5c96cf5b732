"""The gRPC server's options for the scheduler's service. (A host's relay serves its workers
the same calls over its own hop on a local socket, `cluster.transport.hop`, with its own
bounds: a message over `edge.MAX_REQUEST_BYTES` ends the connection.)"""

from __future__ import annotations

from cluster.transport import channel, edge

IDLE_CONNECTION_MS = 10_000


def one_message_ahead(message_bytes: int) -> list[tuple[str, int]]:
    """A gRPC server's options for requests of at most `message_bytes`: gRPC refuses a longer
    one from its length, unread, whoever sends it to whichever method (its caps per method
    apply to what it has read: docs/design/security.md), and a stream may send at most one
    such message ahead of what the server has read. gRPC's bandwidth-delay probe, turned off
    here, would grow that to megabytes a stream, which the server then holds for a stranger's
    call it refuses from the length it reads first: 32 registrations of 16 MiB grew the
    scheduler's peak by 44-94 MiB with the probe, 11-14 without it. A stream's data then flows
    at most a message per round trip: 1 GB/s at 1 ms for the scheduler's."""
    return [
        ("grpc.max_receive_message_length", message_bytes),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", message_bytes),
    ]


# An answer may carry a whole allgather: every rank's value, at most 64 MiB in all.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    # grpc enables SO_REUSEPORT by default, which would let a second scheduler bind the same port
    # without an error and steal half the connections.
    ("grpc.so_reuseport", 0),
    # No method takes a message longer than this (a member's value comes in pieces).
    *one_message_ahead(edge.MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_ANSWER_BYTES),
    # Nodes keep one stream open for the whole job and ping it (`channel.keepalive_options`):
    # allow that, at up to twice the rate they use.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", channel.KEEPALIVE_MIN_MS // 2),
    ("grpc.max_concurrent_streams", 100_000),
    # A connection holds a file descriptor: one that does not finish its handshake (TLS and
    # HTTP/2 settings) in time is dropped. The time is the one a node gives a connection attempt
    # before it abandons it and tries again, so no real node is refused by it; 2,000 idle
    # sockets held for grpc's default of 2 minutes kept every real node out.
    ("grpc.server_handshake_timeout_ms", channel.CONNECT_TIMEOUT_MS),
    # A connection with no call for this long is closed (GOAWAY). A node is never idle: it keeps
    # its Watch stream open. Status pollers reconnect when they next ask.
    ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
]
# Calls a node may have open at once: its Watch stream, its Heartbeat stream, and one call of
# its own (a collective, a store call, Finish, a checkpoint report).
CALLS_PER_NODE = 4
# Room for calls of anyone else (`mscluster status`, the health service, a stray client).
CALLS_BESIDE_NODES = 3000


def pending_calls_limit(nodes: int) -> int:
    """How many calls gRPC may hold for the scheduler before it has taken them up."""
    return CALLS_PER_NODE * nodes + CALLS_BESIDE_NODES


def server_options(nodes: int, node_timeout_s: float | None) -> list[tuple[str, int]]:
    """SERVER_OPTIONS, with gRPC's queue of calls not yet taken up sized for `nodes`, and
    gRPC's pings of every connection (`channel.keepalive_options`) for `node_timeout_s`
    (None: no pings, MS_DISABLE_HEARTBEAT).

    A grpc.aio server takes up one call per method at a time; the calls that arrive meanwhile
    wait in gRPC's queue. Past 1,000 of them gRPC cancels new calls at random, and past 3,000
    all of them (its defaults, "grpc.server.max_pending_requests" and its hard limit): every
    node of a job sends its Watch at start and its Finish at the end, so a job of 1,536 nodes
    had registrations and finishes cancelled by gRPC itself (CANCELLED), and a node whose Finish
    was cancelled left, which the scheduler took for a death. The queue holds what the nodes
    can send at once; past it, calls are refused, not queued without end.
    """
    limit = pending_calls_limit(nodes)
    return [
        *SERVER_OPTIONS,
        *channel.keepalive_options(node_timeout_s),
        ("grpc.server.max_pending_requests", limit),
        ("grpc.server.max_pending_requests_hard_limit", limit),
    ]
