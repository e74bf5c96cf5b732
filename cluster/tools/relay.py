"""`mscluster relay`: one host's relay, serving its workers on a local socket and holding one
connection to the scheduler for all of them (what it forwards, and why it is transport and not
authority: `cluster.transport.relay`).

`mscluster run` starts one for its workers when it starts at least two here (`--no-relay`: not)
and gives them CLUSTER_RELAY; a host that starts its workers otherwise runs `mscluster relay
--socket PATH` and sets CLUSTER_RELAY=unix:PATH for them. The scheduler is the one of the
launch environment (MS_SCHED_HOST, MS_SCHED_PORT), reached with the TLS identity of
CLUSTER_TLS_CONFIG when it is set; of several (standbys on etcd), the one that leads. The
socket is made readable by this user only: whoever may use it may speak as the workers of this
host, as whoever may read their credentials could.

A relay started by hand ends by itself, exit status 0, once this host's part in the job is
over (its scheduler told the workers it carries that the job finished or failed, or every
worker it carried finished) and every worker connected to it has closed its connection, so
that a shell loop that ends in `wait` ends with the job. A scheduler lost (a standby taking
over, one restarted to resume the job) is neither: the relay follows the new leader, or waits
for the scheduler's port. A relay `mscluster run` started is its launcher's to stop. Either
serves until it is stopped (SIGTERM, SIGINT) or its launcher is gone; then its workers' calls
end, and each goes to the scheduler directly.

The relay holds PATH.lock while it serves (`holder_lock`; the lock is the file its path names:
`try_lock` given the path opens a file removed or replaced before its lock anew). One removed or
replaced while held (by hand, with the socket's directory's other files) keeps no other relay
off the path, so the relay checks every LOCK_CHECK_S that the path still names its file. Where
it does not, it says so in one line and locks the file there now, at once; where another relay
has locked it since, it says so once and serves its workers on (the socket at the path stays
the one bound there: it removes only its own), and tries again at each check.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cluster.protocol.config import MIN_NODE_TIMEOUT_S, TLSOptions, parse_bool, parse_seconds
from cluster.protocol.environment import (
    node_counts_from_env,
    relay_address,
    sched_addresses_from_env,
    tls_options_from_env,
)
from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import split_address
from cluster.storage import holder_lock
from cluster.transport import collector
from cluster.worker import orphan

EXIT_OK = 0
_PROBE_S = 1.0  # how long the probe of an existing socket waits for its connection
# How often a serving relay checks that PATH.lock still names the file it locked.
LOCK_CHECK_S = 1.0


@dataclass(frozen=True)
class RelaySettings:
    address: str  # where the workers reach it: unix:PATH
    scheduler: str  # host:port
    # The job's nodes (MS_WORKER_NUM + MS_SERVER_NUM): its upstream channel is sized as a
    # node's, and it waits for a scheduler's port as often as the workers connected to it would.
    nodes: int
    node_timeout_s: float | None  # gRPC's pings of both sides (None: MS_DISABLE_HEARTBEAT)
    tls: TLSOptions | None = None
    # The job's other schedulers (standbys on etcd): the relay follows the one that leads.
    others: tuple[str, ...] = ()
    # Whether it ends once the job has ended and its workers have closed (one started by hand),
    # or serves on until stopped (one of `mscluster run`, which stops it).
    ends_with_job: bool = False
    # Whether its socket's directory is its launcher's, made for it alone (`mscluster run`'s
    # mkdtemp): the relay removes it at its end, with its lock file (`_clear_launchers_directory`).
    owns_directory: bool = False

    @property
    def schedulers(self) -> tuple[str, ...]:
        return (self.scheduler, *(a for a in self.others if a != self.scheduler))

    @property
    def path(self) -> Path:
        return Path(self.address.removeprefix("unix:"))


def settings_from_env(
    env: Mapping[str, str], socket: str, scheduler: str | None = None
) -> RelaySettings:
    """The relay of the launch environment `env`, serving at `socket` (unix:PATH or PATH);
    `scheduler` (HOST:PORT) instead of MS_SCHED_HOST and MS_SCHED_PORT when given."""
    if scheduler is not None:  # checked as itself: an error names the option, not the variable
        for entry in scheduler.split(","):
            split_address("--scheduler", entry.strip())
        env = {**env, "CLUSTER_SCHED_ADDRS": scheduler}
    workers, servers = node_counts_from_env(env)
    silent = parse_bool("MS_DISABLE_HEARTBEAT", env.get("MS_DISABLE_HEARTBEAT", "0") or "0")
    timeout = parse_seconds(
        "MS_NODE_TIMEOUT", env.get("MS_NODE_TIMEOUT", "") or "30", minimum=MIN_NODE_TIMEOUT_S
    )
    schedulers = sched_addresses_from_env(env)
    launched = env.get(orphan.ENV) == str(os.getppid())  # `mscluster run` is its parent
    return RelaySettings(
        address=relay_address("--socket", socket),
        scheduler=schedulers[0],
        others=tuple(schedulers[1:]),
        nodes=workers + servers,
        node_timeout_s=None if silent else timeout,
        tls=tls_options_from_env(env),
        ends_with_job=not launched,
        owns_directory=launched,
    )


class Relay:
    """A running relay: `start` binds the socket and serves, `stop` ends it."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self._server: object | None = None
        self._channel: object | None = None
        self._forwarder: object | None = None
        self._bound: tuple[int, int] | None = None  # (device, inode) of the socket it bound
        # PATH.lock, locked while it serves.
        self._lock = holder_lock.Hold(
            holder_lock.lock_path(settings.path), socket=str(settings.path)
        )
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Lock PATH.lock, bind and serve; the address the workers reach it at. A ConfigError
        when the path is not free for it: another relay holds its lock (`_lock`), or one
        without the lock serves it, or may (`_claim`)."""
        s = self.settings
        identity = None
        if s.tls is not None:
            from cluster.transport import tls  # noqa: PLC0415 - TLS only; sets grpc's ciphers

            identity = tls.prepare(s.tls, server=False)
            for warning in tls.expiry_warnings(identity):
                _say(warning)
        # These import grpc: after the TLS config set grpc's cipher list.
        from cluster.transport import channel, hop, relay, upstreams  # noqa: PLC0415
        from cluster.worker import scheduler_link  # noqa: PLC0415 - grpc

        _lock(self._lock, s.path)  # held until `stop`: no other relay claims the path meanwhile
        _claim(s.path)
        options = scheduler_link.channel_options(s.nodes, s.node_timeout_s)
        server: hop.HopServer | None = None  # the workers' calls, on the local hop
        upstream = upstreams.Upstreams(
            s.schedulers,
            lambda address: channel.open_channel(address, identity, options),
            _say,
            nodes=s.nodes,
            pause_s=scheduler_link.reconnect_ceiling_ms(s.nodes) / 1000,
            serving=lambda: 1 if server is None else server.connections,
        )
        # Beats go up in batches this often: a small part of the time a silent node is given.
        every_s = 1.0 if not s.node_timeout_s else min(1.0, s.node_timeout_s / 10)
        tables = relay.SharedTables(_say)  # the host's one copy of a large table
        forwarder = relay.Forwarder(upstream, beats_every_s=every_s, tables=tables, say=_say)
        self._channel, self._forwarder = upstream, forwarder
        server = hop.HopServer(forwarder.answers, s.schedulers, _say)  # for these only
        try:
            await server.start(str(s.path))  # a socket of this user's only
        except OSError as exc:
            raise ConfigError(
                f"--socket {str(s.path)!r}: cannot listen there ({exc.strerror or exc}): give "
                "a path in a directory that exists and this user can write in"
            ) from None
        self._server, self._bound = server, _identity(s.path)
        upstream.channel().get_state(try_to_connect=True)  # the one connection, made now
        self._watch = asyncio.create_task(self._watch_lock())
        return s.address

    async def _watch_lock(self) -> None:
        """While it serves (until `stop`): `keep_lock` every LOCK_CHECK_S."""
        while True:
            await asyncio.sleep(LOCK_CHECK_S)
            self.keep_lock()

    def keep_lock(self) -> None:
        """Nothing while PATH.lock names the file this relay locked (or it held none: a file
        system without locks). Where that file was removed or replaced, its lock is let go and
        the file there now locked at once (`holder_lock.Hold.keep`), said in one line; held by
        another relay, said once (each later check tries again, and says when it holds it)."""
        found = self._lock.keep()
        if found is None or not found.news:
            return
        where = self._lock.path
        lost = f"{str(where)!r} was removed or replaced while this relay held it"
        if found.taken:
            anew = f"{lost}, so it kept no other relay off the path: locked the file there anew"
            _say(f"this relay holds {str(where)!r} again" if found.repeated else anew)
            return
        if found.holder is not None:
            who = holder_lock.described(found.holder)
            why = f"{lost}, and another relay ({who}) has locked it since"
        else:
            why = f"{lost}, and cannot be locked anew ({found.cause})"
        _say(f"{why}: this relay serves its workers on, and removes no socket but its own")

    async def job_over(self) -> str:
        """Return once this host's part in the job is over (`HostLinks.done`: the scheduler
        told its workers that the job ended, or every worker it carried finished) and every
        worker connected to it has closed: the line that says so."""
        from cluster.transport import hop, relay  # noqa: PLC0415 - grpc, as `start`

        forwarder, server = self._forwarder, self._server
        assert isinstance(forwarder, relay.Forwarder)
        assert isinstance(server, hop.HopServer)
        links = forwarder.links
        while True:
            await links.done.wait()
            await server.emptied()
            if links.done.is_set():  # not a worker come meanwhile, whose Finish is awaited
                break
        if links.job_end is None:
            return f"every worker it carried ({links.finished}) finished and has closed: exiting"
        ok, reason = links.job_end
        return (
            f"the job {'finished' if ok else 'failed'}: {reason}; every worker it carried "
            "has closed: exiting"
        )

    async def stop(self) -> None:
        server, upstream, watch = self._server, self._channel, self._watch
        if watch is not None:
            watch.cancel()  # awaited once the server has stopped
        if self._forwarder is not None:
            self._forwarder.stop()  # type: ignore[attr-defined]
        if server is not None:
            await server.stop()  # type: ignore[attr-defined]
        if upstream is not None:
            await upstream.close()  # type: ignore[attr-defined]
        # Only the socket this relay bound, if it is still the one at the path: a relay that
        # did not start, or whose path was taken over since, leaves what is there.
        ours = self._bound is not None and _identity(self.settings.path) == self._bound
        if ours:
            with contextlib.suppress(OSError):
                self.settings.path.unlink()
        self._bound = None
        if watch is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            self._watch = None
        self._lock.release()  # the file stays (`holder_lock`), but for a launcher's relay:
        if ours and self.settings.owns_directory:
            _clear_launchers_directory(self.settings.path)


def _clear_launchers_directory(path: Path) -> None:
    """The lock file beside `path` and the directory of both, once emptied. A relay that
    `mscluster run` started serves in a directory of that launcher's own (mode 0700), where no
    other relay locks the path: the relay removes it at its end, so that a launcher that is gone
    without removing it (SIGKILL, the OOM killer) leaves nothing behind in the temporary
    directory."""
    with contextlib.suppress(OSError):
        holder_lock.lock_path(path).unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # only when empty: nothing else of anyone's is removed


def _identity(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of the file at `path` itself (None: nothing there)."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _lock(hold: holder_lock.Hold, path: Path) -> None:
    """Lock PATH.lock (`hold`) for this relay, or a ConfigError naming the relay that holds
    it: two relays started at once cannot both claim the path, each unlinking the other's
    socket as it binds. Where the file system has no locks, nothing held (said): the probe of
    `_claim` alone keeps a serving relay's path."""
    where = hold.path
    try:
        fd = holder_lock.open_lock(where)
    except OSError as exc:
        raise ConfigError(
            f"--socket {str(path)!r}: cannot listen there (its lock {str(where)!r}: "
            f"{exc.strerror or exc}): give a path in a directory that exists and this user can "
            "write in"
        ) from None
    try:
        holder = hold.lock(fd)
    except OSError as exc:
        _say(f"cannot lock {str(where)!r} ({exc.strerror or exc}): going on without the lock")
        return
    if holder is not None:
        raise ConfigError(
            f"a relay already serves {str(path)!r} ({holder_lock.described(holder)} holds "
            f"{str(where)!r}): stop it, or choose another --socket"
        )


def _claim(path: Path) -> None:
    """Make room for the socket at `path`: a socket that refuses connections (a dead relay's)
    is removed; one a relay serves, one whose probe fails otherwise (it may be a relay too busy
    to take the probe), or anything else there, is a ConfigError."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_socket():
        raise ConfigError(f"--socket {str(path)!r} exists and is not a socket: choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_S)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)  # nothing listens: a relay's left behind
            return
        except FileNotFoundError:
            return  # removed meanwhile
        except OSError as exc:
            raise ConfigError(
                f"cannot tell whether a relay serves {str(path)!r} (connecting to it: "
                f"{exc.strerror or exc or type(exc).__name__}): stop the relay there, remove "
                "the socket if none runs, or choose another --socket"
            ) from None
    raise ConfigError(f"a relay already serves {str(path)!r}: stop it, or choose another --socket")


def _say(line: str, out: IO[str] = sys.stderr) -> None:
    print(f"mscluster relay: {line}", file=out, flush=True)


async def serve(settings: RelaySettings) -> int:
    """Serve until SIGTERM or SIGINT, or (`ends_with_job`) until the job is over; the exit
    code."""
    relay = Relay(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    stopped: asyncio.Task[object] | None = None
    over: asyncio.Task[str] | None = None
    try:
        address = await relay.start()
        collector.tune_for_server()
        _say(f"serving {address} for the scheduler at {', '.join(settings.schedulers)}")
        stopped = asyncio.ensure_future(stop.wait())
        if settings.ends_with_job:
            over = asyncio.ensure_future(relay.job_over())
        await asyncio.wait([t for t in (stopped, over) if t], return_when=asyncio.FIRST_COMPLETED)
        if over is not None and over.done() and not stop.is_set():
            _say(over.result())
    finally:
        for task in (stopped, over):
            if task is not None:
                task.cancel()
        await relay.stop()
    return EXIT_OK


def run(settings: RelaySettings) -> int:
    """`mscluster relay`: serve until stopped; the exit code."""
    from cluster.scheduler import limits  # noqa: PLC0415 - light: resource only

    limits.raise_open_files()  # a descriptor per local worker, and one upstream
    return asyncio.run(serve(settings))
