"""A worker's channel to the scheduler: its options (reconnect pacing, gRPC's pings, message
sizes) in a job of a given size, the worker's TLS identity, and its route: through its host's
relay (CLUSTER_RELAY) while the relay answers, else direct."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.protocol.backoff import Backoff
from cluster.protocol.config import ClusterConfig, TLSOptions
from cluster.protocol.parse import split_address
from cluster.transport import channel as scheduler_channel
from cluster.worker.machine import steps

if TYPE_CHECKING:
    import grpc

    from cluster.transport import tls

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# gRPC's reconnect pacing: a first retry after FIRST_RECONNECT_MS, backing off to the ceiling.
# gRPC waits no less than 100 ms between attempts whatever it is given (measured: set to 10 ms,
# a worker's connection attempts still came 100 ms apart), so the scheduler coming up is found
# sooner by the wait for its port (`steps.AwaitListening`, at start and after a lost stream),
# which tries every 10 ms at first (`backoff.LISTEN_TRY_S`). The ceiling is low too: a restarted
# scheduler should have every worker back within a fraction of a second. In a large job it
# grows with the job (see reconnect_ceiling_ms).
FIRST_RECONNECT_MS = 100
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


async def await_listening(address: str, wait: steps.AwaitListening) -> steps.ListeningAwaited:
    """Wait as `wait` says for the scheduler at `address` (host:port) to take connections."""
    host, port = split_address("the scheduler address", address)
    why = await scheduler_channel.await_listening(host, port, wait.timeout_s, wait.every_s)
    return steps.ListeningAwaited(refused=bool(why), why=why)


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


# How long a check of a relay holds for the other agents of the process (a benchmark runs a
# thousand on one relay), and how soon a relay that runs answers it (a ping on the local hop).
RELAY_CHECK_KEPT_S = 1.0
RELAY_CHECK_S = 0.5
_relay_checks: dict[str, tuple[str, float]] = {}  # address -> (why it does not answer, when)
# A relay lost is looked for again, when the node next opens a channel or while its stream runs
# direct, this long after: a relay killed a moment ago may still have its socket listening.
RELAY_BACK_AFTER_S = 1.0
# A relay found back that did not take the node's stream is looked for again twice as late each
# time, at most this late.
RELAY_BACK_MOST_S = 60.0


def relay_check(
    address: str, *, kept_up: bool = True, clock: Callable[[], float] = time.monotonic
) -> str:
    """Why no relay answers at `address` (unix:PATH); "" when one does: a ping on a local
    connection of its own, answered within RELAY_CHECK_S (a stopped relay's socket still takes
    connections). A check made within RELAY_CHECK_KEPT_S by this process holds (one that found
    the relay answering only with `kept_up`). Blocks up to RELAY_CHECK_S: a worker's link runs
    it in a thread (`cluster.worker.link`)."""
    held = _relay_checks.get(address)
    now = clock()
    if held is not None and now - held[1] < RELAY_CHECK_KEPT_S and (kept_up or held[0]):
        return held[0]
    from cluster.transport.hop_channel import ping  # noqa: PLC0415 - only with a relay

    why = ping(address, RELAY_CHECK_S)
    _relay_checks[address] = (why, now)
    return why


class Route:
    """Where a worker's calls go: through its host's relay (`config.relay`) while the relay
    answers, whichever scheduler the worker talks to (one of its configuration, or a leader
    one of them named: the relay follows the one that leads, by the worker's own rules), else
    to the scheduler directly. A relay found gone
    is left, said in one line, until the worker finds it back (a launcher restarted it) when it
    opens a channel again, or while its stream runs direct (`WorkerAgent`: the stream moves).
    A relay whose scheduler refused the worker as another job's is left the same way
    (`relay_refused`), but taken back only by the stream's move, or once the stream is lost:
    the channels the worker opens while it registers go direct.
    The checks of the relay (`relay_check`) are the caller's, off its event loop (the link's),
    but for the one `relay_back` makes when called without one."""

    def __init__(
        self,
        config: ClusterConfig,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._say = say
        self._clock = clock
        self.relay = config.relay
        # A relay lost while the node ran, and when it is looked for again: RELAY_BACK_AFTER_S
        # after the loss, twice as late after each move back to it that failed (`move_failed`).
        self._lost: tuple[str, float] | None = None
        self._back = Backoff(RELAY_BACK_AFTER_S, RELAY_BACK_MOST_S)
        self._refused = False  # the relay lost was left for its scheduler's refusal
        # Moves of the stream back to the relay that failed since it was left: the first is
        # said, and the one that takes, not each try in between (`move_failed`).
        self._failed_moves = 0

    def checked(self, why: str) -> bool:
        """At start, the relay checked (`why` no relay answers there; "" when one does): True,
        once said, when none does: calls go to the scheduler directly."""
        if self.relay is None or not why:
            return False
        self._say(
            f"no relay answers at {self.relay} ({why}): this node talks to the scheduler directly"
        )
        self.relay = None
        return True

    def open(self, address: str, identity: tls.Identity | None) -> grpc.aio.Channel:
        """A channel for calls to the scheduler at `address`."""
        self.relay_back(opening=True)
        if self.relay is not None:
            # The local hop (`cluster.transport.hop`), on a socket of this user's: no TLS to the
            # relay, which holds the job's own. (Imported only behind a relay.)
            from cluster.transport.hop_channel import HopChannel  # noqa: PLC0415

            return HopChannel(self.relay, silence_timeout(self._config), self._config.addresses)
        return open_channel(address, identity, self._config)

    @property
    def away(self) -> bool:
        """Whether a relay this node talked through was lost (and may come back)."""
        return self._lost is not None

    @property
    def due(self) -> str | None:
        """The relay this node lost, once it is time to look for it again."""
        lost = self._lost
        return None if lost is None or self._clock() < lost[1] else lost[0]

    def relay_back(self, why: str | None = None, *, opening: bool = False) -> bool:
        """True, once, when the relay this node lost a while ago (RELAY_BACK_AFTER_S) answers
        again (a launcher restarted it, or it runs again after a stop): from now on calls go
        through it again (the caller opens that channel, or the next channel opened does).
        `why`: a check of it made a moment ago (`relay_check`); None: checked now. `opening`:
        asked as a channel opens, which takes no relay left for its scheduler's refusal back."""
        relay = self.due
        if relay is None or (opening and self._refused):
            return False
        if why is None:
            why = relay_check(relay, kept_up=False)
        if why:
            return False
        self.relay, self._lost, self._refused = relay, None, False
        if opening or not self._failed_moves:
            self._say(f"the relay at {relay} answers again: this node talks through it")
        return True

    def relay_lost(self, *, cut_off: bool = False, why: str = "") -> bool:
        """True, once, when the relay this node's calls went through no longer answers (`why`:
        what a check found, `relay_check`, or that it answered none of this node's calls), or
        `cut_off` its connection to it (a relay killed a moment ago may still have its socket
        listening): from now on they go to the scheduler directly (the caller opens that
        channel), until a channel opened later finds the relay back."""
        relay = self.relay
        if relay is None or not (cut_off or why):
            return False
        said = f" ({why})" if why else ""
        self._say(f"lost the relay at {relay}{said}: this node talks to the scheduler directly")
        self._leave(relay)
        return True

    def relay_refused(self, why: str) -> bool:
        """True, once, when the scheduler that this node's calls reach through the relay refused
        it as another job's (`why`): from now on they go to the scheduler directly (the caller
        opens that channel), until the node's stream, running direct, moves back through the
        relay, or is lost (`relay_back` with a check of the relay)."""
        relay = self.relay
        if relay is None:
            return False
        self._say(
            f"leaves the relay at {relay} ({why}): this node asks its job's schedulers directly, "
            "and goes back through the relay once it is in the job again"
        )
        self._leave(relay)
        self._refused = True
        return True

    def _leave(self, relay: str) -> None:
        """Direct from now on; `relay` looked for again RELAY_BACK_AFTER_S later."""
        self._back.reset()
        self._failed_moves = 0
        self.relay, self._lost = None, (relay, self._clock() + self._back.next_s())

    def move_failed(self) -> None:
        """The relay found back did not take this node's stream (its own connection to the
        scheduler not up yet, or its scheduler refused the node): direct again, looked for again
        later, twice as late each time. Said the first time; the tries after it are not (each
        worker of the host would say two lines a minute while the relay's scheduler refuses
        them), the one that takes is (`move_took`)."""
        relay = self.relay
        if relay is None:
            return
        wait_s = self._back.next_s()
        self.relay, self._lost = None, (relay, self._clock() + wait_s)
        self._failed_moves += 1
        if self._failed_moves == 1:
            self._say(
                f"the relay at {relay} did not take this node's stream: it stays direct, and "
                f"looks again in {wait_s:g} s, then twice as late each time up to every "
                f"{RELAY_BACK_MOST_S:g} s, saying so again once the relay takes it"
            )

    def move_took(self) -> None:
        """The relay took this node's stream: said when moves to it had failed before."""
        tries, self._failed_moves = self._failed_moves, 0
        if tries and self.relay is not None:
            self._say(
                f"the relay at {self.relay} took this node's stream after {tries} failed "
                f"{'try' if tries == 1 else 'tries'}: this node talks through it"
            )
