"""torch.distributed process groups bootstrapped from the cluster job, one per generation.

    import cluster, cluster.torch

    cluster.init()
    model = None

    def data_parallel():                    # over the group of the job's current generation
        cluster.torch.init_process_group()  # gloo, ranks and size from the job
        ddp = DistributedDataParallel(net, init_sync=False)
        ddp.register_comm_hook(None, cluster.torch.allreduce_in_rank_order)  # exact rollbacks
        return ddp

    def set_state(state):                   # the loop's: in every new generation
        global model
        net.load_state_dict(state["model"])
        model = data_parallel() if cluster.torch.init_process_group() else None

    loop = cluster.TrainingLoop(steps, checkpoints, get_state, set_state)
    for step in loop:
        with loop.step():
            if model is None:               # the first generation's first step
                model = data_parallel()
            train_one_step(model, step)

`init_process_group()` makes torch.distributed's default group for the job's current generation,
without a fixed port: rank 0 of the generation starts a `TCPStore` on a free port of its
advertised address (that address only) and tells the others where it is; the group is then
formed over that store. Called again
in the same generation it does nothing; in a later one (after a failed worker rejoined) it
destroys the old group and makes a fresh one, so call it from the `set_state` of a
`cluster.TrainingLoop`, which runs for every new generation, the restarted worker's included.
When that set_state puts back the loop's last step, it makes no group and returns False: no step
follows, and a peer may have finished the job already, so no group could form (a worker killed
after the final barrier and restarted only puts the final state back).

A group made before the loop (torchrun's habit) is made again by the loop itself, in every
generation after the first, at its resume point (before its first collective): a restarted
worker or a spare runs the program from its start and makes its group there, before its loop,
so each survivor must make it at that same point, or the two would call different collectives
(`training.remake_at_resume`). What was made over the old group (a DDP wrapper made before the
loop) is not: make it again in set_state.
`cluster.finalize()` (and the exit of the process) destroys the group, before it tells the
scheduler this worker is done: torch finds nothing to tear down (NCCL: nothing to warn about).

Why a TCPStore and not a torch Store backed by `cluster.kv_store()`: gloo's rendezvous is a burst
of set/get/wait calls, which a TCPStore answers locally in microseconds while the kv store makes
a scheduler round trip each; the kv store also lacks the store calls torch uses beyond those
(compare_set, delete_key, ...) and does not survive a scheduler restart. The TCPStore lives in
rank 0's process and dies with it, which is harmless: the group dies with it too, and the next
generation makes a new store at its own rank 0.

The store has no authentication and no caps: anyone who reaches rank 0's advertised address
while it listens may read it and write into rank 0's memory, whatever secret or TLS closes the
job. So it serves the group's making only: for a gloo group, every rank (rank 0's own included)
uses it as a client, and once every rank's init has returned (a control-plane barrier, pinned to
the generation) nobody reads it any more and rank 0 closes its server; the group's collectives
and its destruction do not use it (torch 2.13). The exposure is that window, from rank 0's
start of the store to the barrier: milliseconds to seconds. Subgroups made later
(torch.distributed.new_group) would need the store: they fail at once ("DistNetworkError:
Broken pipe"). An
NCCL group keeps the store for its whole life, as NCCL makes its communicators over it at their
first use (and again for point-to-point work): on a network others reach, close rank 0's ports
to them (a firewall) or keep such jobs on a private network.

The store's port is published with a broadcast (`broadcast_bytes`: two bytes, never unpickled;
the host is rank 0's, from the peer table), not with kv_store().set/wait:
a collective fails at once with `PeerFailedError` when a peer of the generation dies (a kv wait
would wait out its timeout), and one cut off by a scheduler restart is made again by every worker
(a key set before the restart would be lost with the scheduler's store).

Timeouts. A SIGKILLed (or crashed) peer closes its sockets, and gloo fails the collectives of the
ranks connected to it at once. A rank that waits on a live neighbour instead (in a ring
allreduce of 4, rank 0 waits on rank 3 when rank 2 dies) and every rank waiting on a hung peer
(SIGSTOP, a silent network) learn of it only from gloo's timeout: gloo cannot be interrupted
from outside (ProcessGroupGloo.abort() and shutdown() leave a blocked recv blocked, in torch
2.13). So the default timeout is MS_NODE_TIMEOUT (at least `MIN_TIMEOUT_S`): the time the job
already grants a silent node before declaring it dead, and the earliest a restarted worker can
rejoin (its guard), so a survivor stuck in gloo is free again before the new generation can form
and no time is lost to it. The price: a rank that keeps its peers waiting inside one collective
for longer than that (a straggler, a long save between two collectives) fails them as a hung
peer would. gloo's own default, 30 minutes, would stall every recovery for that long.

With hot spares the new generation forms at once, so waiting out the timeout would be the
whole cost of a failure. So a `TrainingLoop` releases the group as soon as it learns its
generation is over (`release_process_group`, registered with `runtime.on_generation_over`):
it shuts down the group's connections, and a rank blocked on this one fails at once with
"connection closed", then does the same for the ranks blocked on it. Only a hung peer (or a
silent network) still costs the timeout.

An NCCL survivor may never get as far as learning it: its main thread can be blocked in a CUDA
sync (`.item()`) behind a collective the failed peer never joins, where no Python error reaches
it. So for an NCCL group the worker's agent aborts the group's communicators itself, on a thread
of its own, as soon as it hears that the generation is over (`_abort_when_over`, registered with
`runtime.on_generation_end_heard`): the kernels end, the step's next use of the group fails, and
the loop rolls back and releases the group as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import stat
import threading
from typing import Any

try:
    import torch
    import torch.distributed as dist

    # The public names (torch.distributed.TCPStore) are re-exported without `as`, which mypy
    # --strict refuses; these are the same classes.
    from torch._C._distributed_c10d import GradBucket, PrefixStore, TCPStore
except ImportError as exc:  # say how to get it, not just that it is missing
    raise ImportError("cluster.torch needs torch: pip install 'mscluster-grpc[torch]'") from exc

from cluster.api import data_plane, runtime, training
from cluster.api.collective import MAX_WAIT_S, allgather_bytes, barrier, broadcast_bytes
from cluster.protocol.display import safe
from cluster.protocol.errors import ClusterError, PeerFailedError
from cluster.protocol.topology import Topology

BACKENDS = ("gloo", "nccl")
# Below this, scheduling jitter of a loaded host (4 workers on 2 cores, a checkpoint's fsync) is
# enough to fail a healthy collective.
MIN_TIMEOUT_S = 5.0
_PREFIX = "cluster.torch"


@dataclasses.dataclass
class _Group:
    generation: int
    backend: str
    # Rank 0's TCPStore server, for an NCCL group: NCCL makes its communicators over the store
    # at their first use, so it serves for as long as the group lives. None for gloo, whose
    # server is closed once every rank's group is made.
    server: TCPStore | None
    # The inodes of the connections gloo opened for the group (`_gloo_connections`).
    sockets: frozenset[int] = frozenset()
    # torch's group (`abort()`: every communicator of it), and whether the agent's thread has
    # aborted it already (`_abort_when_over`).
    process_group: Any = None
    aborted: bool = False


_current: _Group | None = None
# Taken by `_abort_when_over` (on the agent's thread) to claim a group's abort once.
_abort_lock = threading.Lock()
# The backend and timeout of a group made before any TrainingLoop began (`_remake_in_the_loop`).
_before_the_loop: tuple[str, float | None] | None = None


def init_process_group(backend: str = "gloo", timeout_s: float | None = None) -> bool:
    """Make torch.distributed's default process group for the job's current generation; True
    once it exists.

    Every worker of the generation must call it (it is a collective); rank and world size come
    from the job. A no-op when the group of this generation exists; the group of an older
    generation is destroyed first. `backend`: "gloo" (CPU tensors) or "nccl" (CUDA tensors; call
    `torch.cuda.set_device(cluster.get_local_rank())` first). `timeout_s`: how long a collective
    may wait for a peer before it fails (default: MS_NODE_TIMEOUT, at least 5 s; see the module).

    Called from a `TrainingLoop`'s step or `set_state`, it makes the group of the generation
    that step or restore belongs to, and raises PeerFailedError at once when the job has moved
    past it (the loop then goes on to the new generation, where set_state calls it again).
    Called from the `set_state` that puts back the loop's last step, it makes no group and
    returns False: no step follows, and a peer may have finished already (called
    cluster.finalize()), so a group could not form; wrap nothing in DDP then.

    Raises PeerFailedError when a peer of the generation failed meanwhile (the job's next
    generation needs a new group), ClusterError for a bad argument.
    """
    if backend not in BACKENDS:
        raise ClusterError(
            f"cluster.torch backend={backend!r} is not supported: use one of {', '.join(BACKENDS)}"
        )
    if timeout_s is not None and not _is_timeout(timeout_s):
        raise ClusterError(
            f"cluster.torch timeout_s={safe(repr(timeout_s), 60)} must be a number of seconds "
            f"above 0 and at most {MAX_WAIT_S:g}, or None (the default)"
        )
    if training.before_any_loop():
        _remake_in_the_loop(backend, timeout_s)
    if training.TrainingLoop.restoring_the_end():
        destroy_process_group()  # an older generation's
        return False
    topology = _topology_of_the_caller()
    generation = topology.generation
    if _current is not None and _current.generation == generation and dist.is_initialized():
        if _current.backend != backend:
            raise ClusterError(
                f"the process group of generation {generation} uses {_current.backend}, not "
                f"{backend}: call destroy_process_group() first to change the backend"
            )
        return True
    destroy_process_group()
    if dist.is_initialized():
        raise ClusterError(
            "torch.distributed already has a default process group that cluster.torch did not "
            "make: destroy it (torch.distributed.destroy_process_group()) or let cluster.torch "
            "make it"
        )
    seconds = timeout_s if timeout_s is not None else default_timeout_s()
    # The broadcast of the store's port belongs to `generation`, even where no loop pinned it:
    # once the job has moved on it fails, instead of meeting the next generation's collectives.
    session = runtime.session()
    pinned, session.generation_pin = session.generation_pin, generation
    try:
        _make(backend, topology, datetime.timedelta(seconds=seconds))
    finally:
        session.generation_pin = pinned
    return True


def _is_timeout(value: object) -> bool:
    """Whether `value` is a timeout a process group takes: a finite number of seconds above 0
    (a timedelta holds it, and torch its milliseconds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return 0 < value <= MAX_WAIT_S  # also refuses nan and inf


def _remake_in_the_loop(backend: str, timeout_s: float | None) -> None:
    """A group made before any TrainingLoop began: in a restarted worker or a spare, which runs
    the program from its start, it is the first collective of the new generation, where a
    survivor's first is its loop's resume agreement. So every loop makes it again, with these
    arguments, at its resume point, before that agreement (`training.remake_at_resume`): a
    survivor makes it there, and the newcomer finds it made (a no-op)."""
    global _before_the_loop
    _before_the_loop = (backend, timeout_s)
    training.remake_at_resume(_remake)


def _remake() -> None:
    if _before_the_loop is not None:
        init_process_group(*_before_the_loop)


def _topology_of_the_caller() -> Topology:
    """The current topology, which must be of the generation the caller's collectives belong to
    (`generation_pin`, set by a TrainingLoop around a step and a restore); PeerFailedError when
    the job has moved past that generation."""
    topology = runtime.topology()
    pinned = runtime.session().generation_pin
    if pinned is not None and topology.generation != pinned:
        raise PeerFailedError(
            f"generation {pinned} is over (the job is at generation {topology.generation}): "
            "its process group is not made; the next generation makes its own"
        )
    return topology


def _make(backend: str, topology: Topology, timeout: datetime.timedelta) -> None:
    """Make the group of `topology`'s generation and register it (see init_process_group)."""
    global _current
    generation = topology.generation
    try:
        server, client = _rendezvous(topology.rank, topology.peer(0).host, timeout)
        sockets, process_group = _make_group(backend, client, topology, timeout)
        if backend == "gloo":
            # Every rank's group is connected once every rank's init has returned: nobody
            # reads the store any more, and rank 0's server closes as it is dropped.
            barrier()
            server = None
    except Exception as exc:
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(exc, PeerFailedError):
            raise
        if data_plane.a_peer_failed(generation, exc, runtime.session().say):
            raise PeerFailedError(
                f"a peer of generation {generation} failed while the {backend} process group "
                f"was being made ({exc}); make it again in the next generation"
            ) from exc
        raise
    _current = _Group(generation, backend, server, sockets, process_group)
    runtime.on_generation_over(release_process_group)
    runtime.on_finalize(destroy_process_group)
    runtime.on_crash(abort_process_group)
    if backend == "nccl":
        runtime.on_generation_end_heard(_abort_when_over)


def _make_group(
    backend: str, store: TCPStore, topology: Topology, timeout: datetime.timedelta
) -> tuple[frozenset[int], dist.ProcessGroup]:
    """torch.distributed's default group over `store`: the connections gloo opened for it
    (`_gloo_connections`), and the group."""
    before = _socket_inodes()
    dist.init_process_group(
        backend,
        store=PrefixStore(f"{_PREFIX}/{topology.generation}/", store),
        rank=topology.rank,
        world_size=topology.size,
        timeout=timeout,
    )
    sockets = _gloo_connections(before) if backend == "gloo" else frozenset()
    return sockets, dist.distributed_c10d._get_default_group()


def _gloo_connections(before: frozenset[int]) -> frozenset[int]:
    """Of the sockets opened while the group was made (their inodes not in `before`), gloo's
    connections: those whose local port is a listener opened meanwhile (a peer connected to this
    rank's gloo) or whose remote port is one of a peer's (this rank connected to its gloo), the
    ranks' listeners gathered over the control plane, in one scan. A socket another thread of
    the program opened meanwhile (its own connection, gRPC's to the scheduler, a state server's)
    is left alone: it is no gloo's, and shutting it down when the generation ends would cut that
    thread's work."""
    ends = {inode: _ends(fd) for fd, inode in _sockets() if inode not in before}
    mine = {local for local, remote in ends.values() if local and not remote}
    listening = {int(p) for b in allgather_bytes(_ports(mine)) for p in b.split(b",") if p}
    return frozenset(
        inode
        for inode, (local, remote) in ends.items()
        if remote and (local in mine or remote in listening)
    )


def _ports(ports: set[int]) -> bytes:
    return ",".join(map(str, sorted(ports))).encode()


def _ends(fd: int) -> tuple[int, int]:
    """(local port, remote port) of the TCP socket behind `fd`: 0 for an end it has none of
    (a listener's remote), (0, 0) for any other socket (a unix one, one closed meanwhile)."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return 0, 0
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return 0, 0
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return 0, 0
        local = int(sock.getsockname()[1])
        try:
            return local, int(sock.getpeername()[1])
        except OSError:  # not connected: a listener
            return local, 0


def _rendezvous(
    rank: int, host: str, timeout: datetime.timedelta
) -> tuple[TCPStore | None, TCPStore]:
    """The store the group is made over: rank 0 serves it on a free port of its advertised
    `host` (the server, returned on rank 0 only), and every rank connects to it as a client
    (the store the group keeps, rank 0's included, so that dropping the server closes it)."""
    server = None
    if rank == 0:
        server = _serve(host, timeout)
        port = server.port
        broadcast_bytes(port.to_bytes(2, "big"), root=0)
    else:
        # The host is rank 0's advertised one, from the peer table: only the port travels, as
        # two bytes (nothing from the wire is unpickled).
        sent = broadcast_bytes(b"", root=0)
        if len(sent) != 2:
            raise ClusterError(f"rank 0 sent {len(sent)} bytes for its store's port, not 2")
        port = int.from_bytes(sent, "big")
    return server, TCPStore(host, port, None, is_master=False, timeout=timeout)


def _serve(host: str, timeout: datetime.timedelta) -> TCPStore:
    """A TCPStore server on a free port of `host` only: torch's own listener binds every
    interface, so it is given one bound here (the server owns its descriptor from then on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(socket.SOMAXCONN)
        inode = os.fstat(listener.fileno()).st_ino
        fd = listener.detach()
    try:
        # wait_for_workers=False: the others connect after the broadcast of the port, which
        # needs this call to have returned.
        return TCPStore(
            host,
            0,
            None,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        # torch takes the descriptor only once it serves on it; the inode says it is still
        # the listener's (the number may have been closed and reused meanwhile).
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == inode:
                os.close(fd)
        raise


def destroy_process_group() -> None:
    """Destroy the process group cluster.torch made, if any: done before a new one is made, at
    the end of a generation (`release_process_group`), and by `cluster.finalize()` (also at
    exit), so that torch never finds a group left at exit (NCCL warns "destroy_process_group()
    was not called before program exit"). When torch's destroy raises, the group is still
    cluster.torch's: the next call (the next init_process_group's) tries again."""
    global _current
    if _current is None:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = None


def abort_process_group() -> None:
    """Abort the NCCL group cluster.torch made (ncclCommAbort: it waits neither for the peers
    nor for the work that failed): after the program died of an uncaught exception
    (`runtime.on_crash`), so that the exit does not block in the communicator's teardown and
    torch finds no group left to warn about, and at the end of a generation (see
    `release_process_group`). A gloo group is left to the exit: its teardown does not wait on
    peers. As with destroy, the group stays cluster.torch's when torch raises."""
    global _current
    group = _current
    if group is None:
        return
    if group.backend == "nccl" and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
    _current = None


def _abort_when_over(generation: int) -> None:
    """The agent heard that `generation` is over (`runtime.on_generation_end_heard`, on a
    thread of its own, registered for an NCCL group only): abort the communicators of the NCCL
    group of that generation, or of an older one, at once. The main thread may be blocked in a
    CUDA sync behind a collective that a failed peer never completes (`.item()`), which no
    Python error reaches and torch's watchdog ends only at the group's timeout:
    ncclCommAbort ends the communicators' kernels, the collective fails, and the step's error
    brings the loop to its rollback, whose release (`abort_process_group`) lets go of the
    group. Only the communicators are aborted here, once per group: torch's bookkeeping of
    the group is the main thread's."""
    group = _current
    if group is None or group.backend != "nccl" or group.generation > generation:
        return
    with _abort_lock:
        if group.aborted:
            return
        group.aborted = True
    group.process_group.abort()


def release_process_group() -> None:
    """Let go of the group cluster.torch made as soon as its generation is over (a peer failed,
    or the job moved on): called by a `TrainingLoop` before it waits for the next generation.

    gloo: close the group's connections, then destroy it. A peer blocked in a collective on
    this worker (in a ring, waiting on a live neighbour of the failed rank) then fails at once,
    its read ends by "connection closed", instead of waiting out the group's timeout; it does
    the same in turn for its own neighbours. gloo's abort() and shutdown() leave its sockets
    open in torch 2.13, so each connection is shut down (SHUT_RDWR) through a duplicate of its
    descriptor, found by the socket's inode among those gloo opened; its listener is left alone
    (gloo's accept thread would abort).

    NCCL: abort it (`abort_process_group`). A destroy is a graceful teardown, which may wait on
    work that a failed peer never completes."""
    group = _current
    if group is None:
        return
    if group.backend == "nccl":
        abort_process_group()
        return
    for fd in _descriptors() if group.sockets else []:
        _shut_down(fd, group.sockets)
    destroy_process_group()


def _socket_inodes() -> frozenset[int]:
    return frozenset(inode for _, inode in _sockets())


def _sockets() -> list[tuple[int, int]]:
    """(descriptor, inode) of each socket of this process."""
    found = []
    for fd in _descriptors():
        with contextlib.suppress(OSError):
            status = os.fstat(fd)
            if stat.S_ISSOCK(status.st_mode):
                found.append((fd, status.st_ino))
    return found


def _descriptors() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: nothing found, nothing shut down (the group's timeout holds)
        return []


def _shut_down(fd: int, inodes: frozenset[int]) -> None:
    """Shut down the connection behind `fd` if it is one of `inodes` and not a listener."""
    try:
        # A duplicate: the number may be closed and reused meanwhile, so the duplicate's own
        # inode is what is checked, and closing it leaves gloo's descriptor as it was.
        duplicate = os.dup(fd)
    except OSError:
        return
    try:
        status = os.fstat(duplicate)
        if not stat.S_ISSOCK(status.st_mode) or status.st_ino not in inodes:
            os.close(duplicate)
            return
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return
    with sock, contextlib.suppress(OSError):
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.shutdown(socket.SHUT_RDWR)


def default_timeout_s() -> float:
    """MS_NODE_TIMEOUT, at least MIN_TIMEOUT_S: see the module for why."""
    return max(runtime.session().config.node_timeout_s, MIN_TIMEOUT_S)


def allreduce_in_rank_order(
    state: object, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DistributedDataParallel comm hook: the mean of the ranks' gradients, added in rank
    order, so that a run rolled back and resumed ends with bit-for-bit the parameters of a run
    without faults.

        model.register_comm_hook(None, cluster.torch.allreduce_in_rank_order)

    Why: DDP's own allreduce (gloo's ring) adds an element's contributions in an order that
    depends on where the element lies in the gradient bucket, and DDP lays its buckets out anew
    after the first step of every new wrapper (in the order the gradients became ready), so the
    first step after a rollback rounds differently from the same step of a run without one.
    Gathering every rank's bucket and adding them in rank order gives every element the same
    order whatever the layout. It moves `size` times the data of a ring allreduce: for small
    models, or when exact reproducibility matters more than bandwidth.
    """
    group = state if isinstance(state, dist.ProcessGroup) else None
    tensor = bucket.buffer()
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    # all_gather is not annotated (mypy sees Any); with async_op=True it returns a Work.
    work: dist.Work = dist.all_gather(gathered, tensor, group=group, async_op=True)

    def mean(_: torch.futures.Future[Any]) -> torch.Tensor:
        total = gathered[0].clone()
        for other in gathered[1:]:
            total += other
        return total.div_(len(gathered))

    return work.get_future().then(mean)


# DDP's register_comm_hook compares the annotations with the classes themselves, and
# `from __future__ import annotations` made them strings.
allreduce_in_rank_order.__annotations__.update(
    {"bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
)
