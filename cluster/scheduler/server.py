"""The scheduler's lifecycle: bind, serve until the job is over, drain, stop.

`SchedulerServer` is the library form (an async context manager that binds port 0 in tests and
reports the port it got); `run` is the blocking form used by `cluster.init()` in the scheduler
role and by `mscluster scheduler`, returning the process exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import signal
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2

from cluster.protocol.config import ClusterConfig, ObserveConfig
from cluster.protocol.environment import job_settings
from cluster.protocol.errors import ConfigError, NotLeaderError, StateFileError
from cluster.protocol.parse import lookup_name
from cluster.protocol.records import NodeState, Phase
from cluster.protocol.settings import JobSettings
from cluster.protocol.value import frozen
from cluster.scheduler import limits
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.descriptors import DescriptorReserve
from cluster.scheduler.gate import Gate
from cluster.scheduler.health import BoundedHealth
from cluster.scheduler.observe import Observability
from cluster.scheduler.servicer import SchedulerServicer, add_to_server
from cluster.scheduler.wiring import add_health_to_server
from cluster.storage.state_store import StateStore
from cluster.transport import allocator, collector
from cluster.transport.serving import server_options

if TYPE_CHECKING:
    from cluster.scheduler.etcd_election import EtcdElection
    from cluster.scheduler.ha import HighAvailability
    from cluster.transport import tls as tls_module
    from cluster.transport.server_tls import Interceptor, ReloadingIdentity

# What a scheduler without TLS, a recovery directory or standbys does not use is imported where
# it is used (issue 26, "Cheap to start"): TLS (`cluster.transport.tls`, `server_tls`), the
# directory store (tempfile, shutil, xxhash) and the election (`cluster.scheduler.ha`).

__all__ = ["JobStore", "SchedulerServer", "run", "serve"]

log = logging.getLogger("cluster.scheduler")

SERVICE_NAME = "cluster.v1.Scheduler"
# Stopped (SIGTERM, SIGINT) while saves of the recovery state fail: how long it keeps trying to
# save what was decided before it stops anyway, leaving the older state on disk.
STOP_SAVE_WAIT_S = 3.0  # with the server's own stop, within the launcher's 5 s before SIGKILL
# After the job ends, how long the nodes get to receive the final event before the server stops.
DRAIN_S = 2.0
# The end waits for nodes waiting out their guard to ask again; it looks again at least this
# often (a node's window to ask closes without any call).
GUARD_WAITER_RECHECK_S = 0.25
# How long the stop waits for the relays' host calls to end (`HostCalls.end`) before the server
# stops: a host link ends once its slots' ends are written, at most `host_link.END_S` later.
HOST_CALLS_END_S = 1.0
# What an expiry warning of the scheduler's TLS files advises (`server_tls.ReloadingIdentity`).
RENEW = "renew the file: the scheduler picks it up for new connections"


async def _tell_cut_off(core: SchedulerCore, deadline: float) -> None:
    """A failed job whose members lost their connections (a relay's host, a network cut) may
    have them back in a moment, alive, to hear that it failed (a refusal that says so), where
    they would otherwise look for a scheduler that is gone: serve them until `deadline`."""
    members = core.state.members.values()
    if core.ok or not any(m.state is NodeState.FAILED and not m.connected for m in members):
        return
    await asyncio.sleep(max(deadline - asyncio.get_running_loop().time(), 0.0))


async def _tell_lost_finishes(core: SchedulerCore) -> None:
    """A finished job whose members' Finish answers were lost with their connections (a
    relay's host, a network cut) owes them its end (`SchedulerState.owed_end`): their workers
    ask again, and the refusal that the job finished tells them their finish counted, where
    they would otherwise look for a scheduler that is gone and exit 1. Serve them until each
    asked, or its time is up."""
    owed = core.state.owed_end()
    if not owed:
        return
    log.info(
        "the answer to the finish of %s was lost with its connection: serving up to %.0f s "
        "more (MS_NODE_TIMEOUT from the loss) for it to ask again and hear that it counted",
        _named(core, owed),
        max(owed.values()),
    )
    waited = set(owed)
    while owed:
        core.registrations.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(core.registrations.wait(), min(owed.values()))
        owed = core.state.owed_end()
    if gone := waited & core.state.answers.lost.keys():
        log.warning(
            "%s did not ask again within MS_NODE_TIMEOUT: its worker may say that it cannot know "
            "whether its finish counted (it did)",
            _named(core, gone),
        )


def _named(core: SchedulerCore, nodes: Iterable[str]) -> str:
    """The members `nodes`, as the log names them."""
    return ", ".join(core.state.members[node_id].describe() for node_id in sorted(nodes))


def check_bindable(host: str, port: int) -> None:
    """Fail with a precise ConfigError where grpc would only say "failed to bind"."""
    try:
        infos = socket.getaddrinfo(
            lookup_name(host), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(
            f"the scheduler cannot listen on {host!r}: MS_SCHED_HOST does not resolve "
            f"({exc.strerror}); use an address or host name of this machine"
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            where = bind_address(host, port)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"the scheduler cannot listen on {where}: the port is already in use "
                    "(another scheduler still running?); free it or choose another MS_SCHED_PORT"
                ) from None
            raise ConfigError(
                f"the scheduler cannot listen on {where}: {exc.strerror} (MS_SCHED_HOST must be "
                "an address of the machine the scheduler runs on)"
            ) from None


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@frozen
class JobStore:
    """Where a scheduler keeps its job: the state store it holds (the recovery directory, or
    etcd) and, where schedulers stand by for each other, the election that says who leads."""

    state: StateStore
    election: EtcdElection | None = None

    @classmethod
    def directory(cls, path: Path) -> JobStore:
        """The recovery directory `path` (MS_RECOVERY_PATH): one scheduler, no standbys."""
        from cluster.storage.directory_store import DirectoryStore  # noqa: PLC0415 - recovery only

        return cls(DirectoryStore(path))


class SchedulerServer:
    """A running scheduler. `async with SchedulerServer(...) as server:` binds and serves.

    With `tls` (see `cluster.tls.prepare`) it serves mutual TLS only, reads its TLS files again
    for new connections when they change (`server_tls.ReloadingIdentity`), and re-checks its
    own certificate's expiry every `expiry_check_period_s` (None: daily). With a `store` it holds
    that store, resumes the job saved there (if any) and saves the job's state there. With an
    election (etcd's standbys), it serves the port at once and answers for the job only while it
    leads (`cluster.scheduler.ha`).
    """

    def __init__(
        self,
        settings: JobSettings,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: tls_module.Identity | None = None,
        expiry_check_period_s: float | None = None,
        store: JobStore | None = None,
        observe: ObserveConfig | None = None,
    ) -> None:
        self.settings = settings
        self.core = SchedulerCore(settings)
        self.store = None if store is None else store.state
        self.gate = Gate(self.core)
        election = None if store is None else store.election
        self.ha: HighAvailability | None = None
        if election is not None:
            from cluster.scheduler.ha import HighAvailability  # noqa: PLC0415 - standbys only

            self.ha = HighAvailability(self, election)
        # The event log and metrics (cluster.scheduler.observe); `observing.metrics_port`.
        where = "" if self.store is None else self.store.where
        self.observing = Observability(observe or ObserveConfig(), host, self.gate, where)
        self.host = host
        self.requested_port = port
        self.port = 0
        self.tls = tls  # as at start; `served.current` is the one new connections get
        self.served: ReloadingIdentity | None = None  # set once it serves, with TLS
        self._expiry_check_period_s = expiry_check_period_s
        self._server: grpc.aio.Server | None = None
        self.servicer: SchedulerServicer | None = None  # set once it serves
        self._health = health_aio.HealthServicer()
        self._monitor: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._reserve: asyncio.Task[None] | None = None
        self._open_files = 0  # the limit, once raised
        self._stop_requested = asyncio.Event()
        # Why, once SIGTERM stopped a scheduler whose job goes on: to a standby, or, with no
        # standby, to the scheduler started next on its state store.
        self.handing_over: str | None = None
        # Set by `stop` when it had to stop with decided changes not saved.
        self.unsaved: str | None = None
        # Without standbys: why saves were refused for good (another scheduler may hold the
        # store), once they were; and the standing down that followed.
        self.fenced: str | None = None
        self._standing_down: asyncio.Future[bool] | None = None

    @property
    def address(self) -> str:
        return bind_address(self.host, self.port)

    async def start(self) -> int:
        check_bindable(self.host, self.requested_port)
        store = self.store
        try:
            if self.ha is not None:
                self.gate.core = None  # nothing is answered before this scheduler leads
                self.observing.claim_event_log(standby=True)
                await self.observing.start(self.core, announce=False)
                await self._serve()
                await self.ha.start()
            else:
                if store is not None:
                    await store.acquire()  # ConfigError naming the holder when it is held
                self.observing.claim_event_log()  # the same, for the event log
                if store is not None:
                    await self.install(await self._resume())
                else:
                    await self.observing.start(self.core)
                await self._serve()
            return self.port
        except BaseException:
            await self.observing.stop()
            await self.core.stop_saving(0)
            if self._server is not None:
                await self._server.stop(grace=None)
                self._server = None
            if store is not None:
                await store.close()
            raise

    async def _resume(self) -> SchedulerCore:
        """The core of the job saved in the store, its job id saved before anyone hears it
        (or a restart would deny it)."""
        assert self.store is not None
        try:
            core = await SchedulerCore.resume(self.settings, self.store)
            await core.save_first()
        except StateFileError as exc:
            raise ConfigError(f"{self.store.name} is not usable: {exc}") from None
        return core

    async def install(self, core: SchedulerCore) -> None:
        """Answer for the job with `core` from now on (it saves in the background)."""
        if self.observing.started:
            self.observing.adopt(core)
        else:
            await self.observing.start(core)
        core.start_saving()
        if self.ha is None:
            core.on_fenced = self._fenced  # (with standbys, the election steps down)
        self.core = self.gate.core = core
        if self._server is not None:
            self._monitor = asyncio.create_task(core.monitor())
        if core.restored_note:
            log.info("%s", core.restored_note)

    async def uninstall(self, error: NotLeaderError, *, save_s: float = 0) -> bool:
        """Answer nothing more for the job: this scheduler no longer leads it. Saves what is
        pending for up to `save_s` (while saves fail), then ends every open stream and wait,
        and every follower of the job's events, with `error`; True when everything decided is
        saved. Saving stops first: the nodes
        that leave when their streams end are failed here only, never in the saved state
        that the next leader resumes."""
        core, self.gate.core = self.gate.core, None
        if core is None:
            return True
        await _cancel(self._monitor)
        self._monitor = None
        saved = await core.stop_saving(save_s)
        core.stand_down(error)
        core.journal.fail(error)
        return saved

    async def _serve(self) -> None:
        self._raise_open_files()
        servicer = self.servicer = SchedulerServicer(self.gate)
        if self.tls is not None:
            from cluster.transport.server_tls import ReloadingIdentity  # noqa: PLC0415 - TLS

            self.served = ReloadingIdentity(self.tls)
        interceptors: list[Interceptor] = [
            *_tls_interceptors(self.served, servicer),
            *self.observing.interceptors(),
        ]
        settings = self.settings
        server = grpc.aio.server(
            options=server_options(
                settings.expected,
                settings.node_timeout_s if settings.heartbeat_enabled else None,
            ),
            interceptors=interceptors,
        )
        add_to_server(servicer, server)
        add_health_to_server(BoundedHealth(self._health, servicer), server, servicer.arrivals)
        where = bind_address(self.host, self.requested_port)
        try:
            if self.served is None:
                self.port = server.add_insecure_port(where)
            else:
                self.port = server.add_secure_port(where, self.served.credentials())
        except RuntimeError as exc:
            raise ConfigError(
                f"the scheduler cannot listen on {where}: the port is in use or the address is "
                f"not one of this host's ({exc}); check MS_SCHED_HOST / MS_SCHED_PORT"
            ) from None
        if self.port == 0:
            raise ConfigError(
                f"the scheduler cannot listen on {where}; check MS_SCHED_HOST / MS_SCHED_PORT"
            )
        await server.start()
        self._server = server
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.gate.core is not None:
            self._monitor = asyncio.create_task(self.gate.core.monitor())
        reserve = DescriptorReserve(
            self._open_files, self.settings.expected, lambda: servicer.member_peers
        )
        self._reserve = asyncio.create_task(reserve.run())
        settings = self.settings
        log.info(
            "listening on %s for %s%s%s",
            self.address,
            _count(settings.worker_num, "worker"),
            f" and {_count(settings.server_num, 'server')}" if settings.server_num else "",
            "" if self.tls is None else f" (mutual TLS, {self.tls.what})",
        )
        if self.served is not None:
            self._expiry = _watch_expiry(self.served, self._expiry_check_period_s)

    def _raise_open_files(self) -> None:
        files = limits.raise_open_files()
        self._open_files = files.limit
        log.info("%s", files.describe())
        warning = files.too_low(self.settings.expected)
        if warning is not None:
            log.warning("%s", warning)

    async def wait_done(self) -> bool:
        """Wait until the job is over (or, after `request_stop`, at most STOP_SAVE_WAIT_S more
        for its end to be saved, or after `request_handover`, until it is left to resume, or,
        when its end was decided already, as after `request_stop`); True when every node
        finished, or the job was handed over or left to resume; False at once when its saves
        were refused for good (`_fenced`)."""
        if self.ha is not None:
            return await self.ha.wait_done(self._stop_requested)
        core = self.core
        done = asyncio.ensure_future(core.done.wait())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait((done, stop), return_when=asyncio.FIRST_COMPLETED)
            if self._standing_down is not None and not core.done.is_set():
                return await self._stood_down()
            # The job's end is decided (its save may be on the way, `done` set once it lands, in
            # this very step perhaps): nothing is left to resume, it ends as after a stop.
            ended = core.state.phase in (Phase.FINISHED, Phase.FAILED)
            if not ended and self.handing_over is not None:
                return await self._leave_to_resume(self.handing_over)
            if not core.done.is_set():
                await asyncio.wait((done,), timeout=STOP_SAVE_WAIT_S)
        finally:
            done.cancel()
            stop.cancel()
        return core.ok and core.done.is_set()

    def request_stop(self, reason: str) -> None:
        """End the job as failed (a signal, an operator) and stop serving soon: at once when
        that end is saved, after STOP_SAVE_WAIT_S when saves fail. A standby only stops. It
        wins over a `request_handover` not yet under way (SIGTERM, then SIGINT)."""
        if self.gate.core is not None:
            self.gate.core.abort(reason)
            self.handing_over = None
        self._stop_requested.set()

    def request_handover(self, reason: str) -> None:
        """Stop serving and let the job go on (the process exits 0, or 1 when what it decided
        could not be saved): with standbys a standby takes it over; with a state store and none,
        it waits, saved, for a scheduler started again on that store (`_leave_to_resume`).
        Without a state store nothing could resume it: end the job, as `request_stop`."""
        if self.ha is None and self.store is None:
            self.request_stop(reason)
            return
        self.handing_over = reason
        self._stop_requested.set()

    async def _leave_to_resume(self, why: str) -> bool:
        """Stop answering for the job without ending it (a state store, no standby): what was
        decided is saved first (up to STOP_SAVE_WAIT_S while saves fail), then every open stream
        and wait ends with "not the leader". The nodes keep training and register again, for
        their reconnect window, with the scheduler started next on the store, which resumes the
        job as after a crash. True when everything decided is saved."""
        store = self.store
        assert store is not None
        core = self.core
        error = NotLeaderError(
            f"not the leader: the scheduler at {self.address} is stopping ({why}); the job "
            f"goes on once a scheduler is started again with the same {store.name}"
        )
        saved = await self.uninstall(error, save_s=STOP_SAVE_WAIT_S)
        if core.done.is_set():
            # A call already under way ended the job, and its end landed in that save: the
            # nodes were told, nothing is left to resume.
            return core.ok
        if not saved:
            self._not_saved(core)
            return False
        log.info(
            "the job is left to resume (%s): everything decided is saved in %s; the nodes keep "
            "training and wait for a scheduler for their reconnect window: start one again "
            "with the same %s to resume the job",
            why,
            store.where,
            store.name,
        )
        return True

    def _fenced(self, why: str) -> None:
        """Saves were refused for good (`why`: the recovery directory was removed or replaced,
        and another scheduler may hold the new one): with no standby to step down to, this
        scheduler stands down at once (every open stream, wait and follower ends with "not the
        leader") and `wait_done` returns False, so that the process ends and frees its port for
        a scheduler started again, which the nodes find at the same address."""
        if self.fenced is not None:
            return
        self.fenced = why
        error = NotLeaderError(
            f"not the leader: the scheduler at {self.address} has stopped, its saves refused "
            f"({why})"
        )
        self._standing_down = asyncio.ensure_future(self.uninstall(error))
        self._stop_requested.set()

    async def _stood_down(self) -> bool:
        """After `_fenced`: once every stream and wait has ended, say (one line) why this
        scheduler stops and what to do; False (the process exits 1)."""
        store = self.store
        assert self._standing_down is not None
        assert store is not None
        await self._standing_down
        log.error(
            "the scheduler stops (exit 1), as nothing it decides can be saved any more: %s. To "
            "resume the job, put its directory back at %s and start the scheduler again (the "
            "nodes keep training and reconnect to it); started again on %s as it is now, it "
            "resumes what that holds (a new job if nothing)",
            self.fenced,
            store.name,
            store.name,
        )
        return False

    async def _tell_guard_waiters(self, core: SchedulerCore, deadline: float) -> None:
        """Nodes waiting out their guard have no stream: they hear of the end when they ask
        again (within `guard_window_s` of their refusal). Serve them until they did, or until
        `deadline`."""
        loop = asyncio.get_running_loop()
        while core.state.awaited_after_end() and loop.time() < deadline:
            core.registrations.clear()
            wait_s = min(deadline - loop.time(), GUARD_WAITER_RECHECK_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(core.registrations.wait(), wait_s)

    def _not_saved(self, core: SchedulerCore) -> None:
        """Say (once, and in `unsaved`) that `core` stopped with decided changes not saved."""
        persister = core.persister
        self.unsaved = (
            f"stopped with decided changes not saved: the recovery state in "
            f"{self.store.where if self.store else '?'} is older than what this scheduler "
            f"decided ({persister.error if persister else ''}); the nodes were not told of "
            "those changes, so a scheduler started again on it, once it can be written, "
            "resumes the job as saved"
        )
        log.error("%s", self.unsaved)

    async def stop(self, drain_s: float = DRAIN_S) -> None:
        """Give the nodes `drain_s` to hear the end, then stop. (An end that could not be
        saved was not told: then there is nothing to hear.)"""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        core = self.core
        ended = core.done.is_set() and self.gate.core is core
        if ended:
            # The nodes hear the end on their streams and close them, and their heartbeats.
            closed = asyncio.gather(core.streams_closed.wait(), core.beats_closed.wait())
            deadline = asyncio.get_running_loop().time() + drain_s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closed, drain_s)
            # A node the guard refused asks again within the guard's window, which grows
            # past the drain in a job of more than 750 nodes.
            loop_time = asyncio.get_running_loop().time()
            await self._tell_guard_waiters(
                core, max(deadline, loop_time + core.state.guard_window_s())
            )
            await _tell_cut_off(core, deadline)
            await _tell_lost_finishes(core)
        if self.ha is not None:
            await self.ha.stop()
        for task in (self._monitor, self._expiry, self._reserve):
            await _cancel(task)
        # A relay's host calls last as long as the relay: ended here, their handlers return,
        # rather than being cancelled by the server's stop (which grpc logs as a traceback).
        if self.servicer is not None:
            await self.servicer.host_calls.end(HOST_CALLS_END_S)
        await self._server.stop(grace=0.5)
        self._server = None
        if self.gate.core is core and not await core.stop_saving(STOP_SAVE_WAIT_S if ended else 0):
            self._not_saved(core)
        if self.store is not None:
            await self.store.close()
        await self.observing.stop()

    async def __aenter__(self) -> SchedulerServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.core.done.is_set():
            self.request_stop("scheduler stopped")
            await self.wait_done()
        await self.stop(drain_s=0.5)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _tls_interceptors(
    identity: ReloadingIdentity | None, servicer: SchedulerServicer
) -> list[Interceptor]:
    """The check of each call's client certificate, with TLS: a call refused for a revoked or
    expired certificate is a refusal at the edge (counted, told at a bounded rate)."""
    if identity is None:
        return []
    from cluster.transport import tls  # noqa: PLC0415 - TLS only
    from cluster.transport.server_tls import PeerCertificateCheck  # noqa: PLC0415 - TLS only

    return [PeerCertificateCheck(tls.PeerCheck(identity), servicer.at_edge)]


def _watch_expiry(served: ReloadingIdentity, period_s: float | None) -> asyncio.Task[None]:
    """Says now what expires soon, then rechecks every `period_s` (None: daily), of the files
    as they are then."""
    from cluster.transport import tls  # noqa: PLC0415 - TLS only

    for warning in tls.expiry_warnings(served.current, renew=RENEW):
        log.warning("%s", warning)
    period_s = period_s or tls.EXPIRY_CHECK_PERIOD_S
    check = tls.recheck_expiry(served.refresh, log.warning, period_s, renew=RENEW)
    return asyncio.create_task(check)


def _who_may_join(server: SchedulerServer) -> str:
    secret = server.core.settings.job_secret is not None
    if server.tls is not None:
        return "nodes join with a certificate of the job's CA" + (
            " and proof of the job secret" if secret else ""
        )
    if secret:
        return "nodes join with proof of the job secret (CLUSTER_JOB_SECRET_FILE)"
    return (
        "the job is open: any process that reaches this port can join it (no TLS and no job "
        "secret; set CLUSTER_JOB_SECRET_FILE on every process of the job to close it)"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


async def serve(config: ClusterConfig) -> int:
    """Serve one job; the process exit code: 0 when every node finished, 1 otherwise."""
    identity = None
    if config.tls is not None:
        from cluster.transport import tls  # noqa: PLC0415 - TLS only (cryptography)

        identity = tls.prepare(config.tls, server=True)
    store: JobStore | None = None
    if config.state_url is not None:
        from cluster.scheduler import stores  # noqa: PLC0415 - aetcd only for an etcd URL

        address = stores.advertised(config.sched_host, config.sched_port)
        etcd = await stores.open_etcd(config.state_url, address, config.lease_s, config.tls)
        store = JobStore(etcd, getattr(etcd, "election", None))
    elif config.recovery is not None:
        store = JobStore.directory(config.recovery.path)
    server = SchedulerServer(
        job_settings(config),
        config.sched_host,
        config.sched_port,
        tls=identity,
        store=store,
        observe=config.observe,
    )
    await server.start()
    collector.tune_for_server()  # this process is the scheduler's alone
    log.info("%s", _who_may_join(server))
    loop = asyncio.get_running_loop()
    # SIGINT (Ctrl-C, the launcher stopping its job) ends the job. SIGTERM (a host stopped for
    # maintenance, a pod deleted or evicted, systemctl stop) lets it go on where something can
    # resume it: a standby takes it over, or, with a state store and no standby, the scheduler
    # started next on that store; without a state store it ends the job too.
    loop.add_signal_handler(signal.SIGINT, server.request_stop, "scheduler stopped by SIGINT")
    loop.add_signal_handler(signal.SIGTERM, server.request_handover, "scheduler stopped by SIGTERM")
    try:
        ok = await server.wait_done()
    finally:
        await server.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0 if ok else 1


def run(config: ClusterConfig) -> int:
    """Blocking form of `serve`, with the allocator set to give back what a refused large
    message used (`cluster.transport.allocator`)."""
    allocator.return_large_buffers()
    return asyncio.run(serve(config))


def run_and_exit(config: ClusterConfig) -> NoReturn:
    """`run`, in a process that is the scheduler's alone and ends with it (`cluster.init()` as
    MS_SCHED, `mscluster scheduler`): exits with its code.

    Before it exits, the garbage collector is told to leave alone what is alive (gc.freeze):
    the interpreter's teardown otherwise walks every object that grpc, protobuf and asyncio
    made, several times over, to find cycles to free in a process about to end. That was
    30-40 ms of CPU of every scheduler's exit, 60-70 ms with the job's workers exiting beside
    it, and the scheduler is the job's last process to end."""
    code = run(config)
    gc.freeze()
    sys.exit(code)
