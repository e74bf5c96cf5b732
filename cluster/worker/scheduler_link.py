"""A worker's channel to the scheduler: its options (reconnect pacing, gRPC's pings, message
sizes) in a job of a given size, and the worker's TLS identity."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.protocol.config import ClusterConfig, TLSOptions
from cluster.transport import channel as scheduler_channel

if TYPE_CHECKING:
    import grpc

    from cluster.transport import tls

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Reconnect fast: workers often start before the scheduler, and every 100 ms of grpc's default
# 1 s first backoff is start-up time lost. The ceiling is low too: the time from the scheduler
# listening to the last worker registering is up to one ceiling (half of it on average), and a
# restarted scheduler should have every worker back within a fraction of a second. At 300 ms
# the tutorial's 8 workers, started with their scheduler, spent some 130 ms of a 1.1 s job
# waiting to try again (issue 26, "Cheap to start"); a refused connection costs next to
# nothing. In a large job the ceiling grows with the job (see reconnect_ceiling_ms).
FIRST_RECONNECT_MS = 50
RECONNECT_CEILING_MS = 100
# A job's nodes try to reconnect at most about this often in all, once backed off (from 100
# nodes on): at 8,192 nodes with a 300 ms ceiling, a scheduler slow to take connections got
# 27,000 attempts a second, each abandoned one taking the place of a connection it could have
# finished.
RECONNECTS_PER_S = 1000
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # One connection per agent, as a real worker process has (matters when many agents share a
    # process, as in the benchmarks).
    ("grpc.use_local_subchannel_pool", 1),
]


def reconnect_ceiling_ms(nodes: int) -> int:
    """The longest pause between a node's connection attempts in a job of `nodes`."""
    return max(RECONNECT_CEILING_MS, nodes * 1000 // RECONNECTS_PER_S)


def channel_options(nodes: int, node_timeout_s: float | None) -> list[tuple[str, Any]]:
    """The options of a node's channel to the scheduler, in a job of `nodes`; gRPC pings
    it for `node_timeout_s` (None: not at all, see `channel.keepalive_options`)."""
    return [
        *scheduler_channel.reconnect_options(FIRST_RECONNECT_MS, reconnect_ceiling_ms(nodes)),
        *scheduler_channel.keepalive_options(node_timeout_s),
        *_OPTIONS,
    ]


def silence_timeout(config: ClusterConfig) -> float | None:
    """MS_NODE_TIMEOUT, or None with MS_DISABLE_HEARTBEAT (no silence looked for)."""
    return config.node_timeout_s if config.heartbeat_enabled else None


def open_channel(
    address: str, identity: tls.Identity | None, config: ClusterConfig
) -> grpc.aio.Channel:
    """This worker's channel to the scheduler at `address` (mutual TLS with `identity`)."""
    options = channel_options(config.expected_nodes, silence_timeout(config))
    return scheduler_channel.open_channel(address, identity, options)


def prepare_tls(options: TLSOptions, say: Callable[[str], None]) -> tls.Identity:
    """This worker's TLS identity, checked, its expiry warnings said; cryptography (which the
    TLS module imports) only for a worker with TLS on."""
    from cluster.transport import tls  # noqa: PLC0415 - TLS only

    identity = tls.prepare(options, server=False)
    for warning in tls.expiry_warnings(identity):
        say(warning)
    return identity
