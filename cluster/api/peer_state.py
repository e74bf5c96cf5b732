"""State from live peers, for `CheckpointManager`: this process's state server, and fetching.

With recovery on, the first `CheckpointManager` of a worker process starts the process's state
server (`cluster.worker.state_server`) on its advertised host, port 0, on an event loop of its
own, and publishes where it is, with its serving token, in the job's key-value store under
`cluster/peer-state/<node id>` (members only). Every manager of the process offers its
checkpoints there. The server stops at `cluster.finalize()`, or at interpreter exit in a process
that never finalizes: no thread or port is left, and nothing is served with the job's token once
this worker is done.

`fetch` gets a rank's checkpoint of a step from the live ranked peers of the current
generation, same host first, then by rank after this one (so that several newcomers spread
over the peers); see `cluster.worker.state_fetch`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from concurrent.futures import TimeoutError as FutureTimeout  # not TimeoutError before 3.11
from dataclasses import dataclass, field
from pathlib import Path

from cluster.api import runtime
from cluster.protocol import peer_state
from cluster.protocol.errors import ClusterError, NoPeerStateError
from cluster.storage.served import ServedCheckpoints
from cluster.transport import tls
from cluster.worker import state_fetch
from cluster.worker.session import BackgroundLoop
from cluster.worker.state_server import StateServer

log = logging.getLogger("cluster.worker")

_lock = threading.Lock()
# Stopping at exit: transfers under way get this long to end.
STOP_GRACE_S = 0.5


@dataclass
class _Service:
    loop: BackgroundLoop
    server: StateServer | None  # None: this process could not serve (it said why)
    client: state_fetch.Client
    pid: int = field(default_factory=os.getpid)  # the process whose loop thread serves


_service: _Service | None = None


def serve(served: ServedCheckpoints) -> None:
    """Offer `served` to the job's members (starting and publishing the state server first, in
    the first call of the process)."""
    service = _started()
    if service.server is not None:
        service.server.offer(served)


def withdraw(prefix: str) -> None:
    if _service is not None and _service.server is not None:
        _service.server.withdraw(prefix)


def _started() -> _Service:
    global _service
    with _lock:
        if _service is None:
            session = runtime.session()
            config = session.config
            loop = BackgroundLoop("cluster-peer-state")
            identity = None if config.tls is None else tls.prepare(config.tls, server=False)
            name = config.tls.server_name if config.tls is not None else None
            client = state_fetch.Client(identity, name or config.sched_host)
            _service = _Service(loop, _start_server(loop), client)
            runtime.on_finalize(stop)
            atexit.unregister(stop)  # registered once, however many jobs the process runs
            atexit.register(stop)  # a process that never finalizes
        return _service


def _start_server(loop: BackgroundLoop) -> StateServer | None:
    """This process's state server, listening and published; None when it cannot start (said
    in one line, not raised: the job goes on, and a peer that needs this rank's state asks
    another peer)."""
    session = runtime.session()
    config = session.config
    server: StateServer | None = None
    try:
        identity = None if config.tls is None else tls.prepare(config.tls, server=True)
        server = StateServer(session.identity.host, config.worker_num, identity)
        loop.run(server.start(), timeout_s=10.0)
        published = server.published
        session.call(
            session.agent.kv_set(peer_state.key(session.identity.node_id), published.encode())
        )
    except (ClusterError, RuntimeError, OSError, TimeoutError, FutureTimeout) as exc:
        if server is not None:
            loop.run(server.stop(0), timeout_s=5.0)
        session.say(f"this worker does not serve its checkpoints to peers: {exc}")
        return None
    how = "" if identity is None else " (mutual TLS, the job's server certificate)"
    session.say(f"serving this worker's checkpoints to peers at {published.address}{how}")
    return server


def stop() -> None:
    """Stop the state server (at finalize or exit; safe to call twice). In a forked child, at
    its exit, it lets the parent's alone: their loop's thread is not in the child, and a call
    on it would wait out its timeout."""
    global _service
    with _lock:
        service, _service = _service, None
    if service is None or service.pid != os.getpid():
        return
    try:
        if service.server is not None:
            service.loop.run(service.server.stop(STOP_GRACE_S), timeout_s=STOP_GRACE_S + 2.0)
    except Exception as exc:  # exiting anyway
        log.debug("stopping the state server: %s", exc)
    service.loop.stop()


def holders() -> list[state_fetch.Holder]:
    """The live ranked peers of this generation that publish a state server, in the order to
    ask them: on this host first, then by rank after this one's."""
    session = runtime.session()
    topology = runtime.topology()
    me = topology.rank
    others = [p for p in topology.peers if p.rank != me]
    here = topology.peer(me).host
    others.sort(key=lambda p: (p.host != here, (p.rank - me) % topology.size))
    if not others:
        return []
    values, missing = session.call(
        session.agent.kv_get([peer_state.key(p.node_id) for p in others])
    )
    missing_keys = set(missing)
    found = iter(values)
    result = []
    for peer in others:
        if peer_state.key(peer.node_id) in missing_keys:
            continue
        published = peer_state.Published.decode(next(found), peer.node_id)
        result.append(state_fetch.Holder(peer.rank, peer.node_id, published))
    return result


def fetch(
    served: ServedCheckpoints, step: int, path: Path, *, replicated: bool, store: bool = True
) -> state_fetch.Fetched:
    """This rank's checkpoint of `step` from a live peer, verified and stored as `path` (with
    `store=False`: verified only, nothing left at `path`). NoPeerStateError (a CheckpointError)
    naming the rank, the step and every place looked at when none gave it: a peer that held it
    may have died or hung as it served (`data_plane.a_peer_failed` waits for the scheduler's
    word on that)."""
    wanted = peer_state.Request(served.prefix, served.rank, step, replicated)
    service = _started()
    asked = holders()
    try:
        fetched = state_fetch.fetch(service.loop, asked, wanted, path, service.client, store=store)
    except state_fetch.NotFetched as exc:
        message = _not_fetched(served.rank, step, path, replicated, exc)
        raise NoPeerStateError(exc.failures, message) from None
    if fetched.failures:
        session = runtime.session()
        session.say(f"state from a peer: asked first {'; '.join(fetched.failures)}")
    return fetched


def _not_fetched(
    rank: int, step: int, path: Path, replicated: bool, exc: state_fetch.NotFetched
) -> str:
    whose = (
        "any rank's state (the states are replicas)" if replicated else f"rank {rank}'s own file"
    )
    asked = str(exc) if exc.failures else "no live peer serves checkpoints"
    fix = (
        "start the job again from the checkpoints on disk"
        if replicated
        else "keep the checkpoint directory on storage the workers share, or a peer that can "
        "read the rank's files alive until it is fetched"
    )
    return (
        f"rank {rank} needs the checkpoint of step {step} and cannot get it: it is not in "
        f"{path}, and no live peer gave {whose} ({asked}); {fix}"
    )
