"""What a relay refuses on its own. `mscluster relay` and what is at its socket's path: a relay
that cannot take the path leaves what is there (a serving relay's socket, a user's file), and a
socket it cannot probe is not taken for a dead relay's. A worker's call the scheduler would end
the host's whole link for is refused alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest

from cluster.protocol.config import Limits
from cluster.protocol.environment import from_env
from cluster.protocol.errors import ConfigError
from cluster.scheduler import JobSettings, SchedulerServer
from cluster.scheduler.machine.state import NodeState
from cluster.storage import holder_lock
from cluster.testing import free_port, wait_until
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport import edge, failures, hop, hop_channel
from cluster.worker.agent import WorkerAgent
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.aio import eventually
from tests.procs import MSCLUSTER, PYTHON, Procs, job_env

EXIT_USAGE = 2  # `mscluster`'s code for a ConfigError


def _takes_connections(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def _refusal(processes: Procs, name: str, sock: Path) -> str:
    """The one line a second `mscluster relay` on `sock` exits with (EXIT_USAGE)."""
    command = [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"]
    refused = processes.start(name, command, job_env(2, free_port()))
    assert refused.wait(60) == EXIT_USAGE, refused.output
    lines = refused.output.strip().splitlines()
    assert len(lines) == 1, refused.output
    return lines[0]


def test_a_second_relay_on_a_served_socket_leaves_it_serving(
    processes: Procs, short_dir: Path
) -> None:
    sock = short_dir / "r.sock"
    command = [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"]
    first = processes.start("relay", command, job_env(2, free_port()))
    first.wait_for_output("mscluster relay: serving", 60)
    bound = sock.stat().st_ino
    line = _refusal(processes, "second", sock)
    assert "a relay already serves" in line
    assert "choose another --socket" in line
    assert first.running
    assert sock.is_socket()
    assert sock.stat().st_ino == bound
    assert _takes_connections(sock)
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0, first.output
    assert not sock.exists()  # the relay that bound it removes it as it stops


RACE_ROUNDS = 8
# Run argv[2:] at the wall-clock time argv[1]: two relays started so begin within a millisecond
# or two of each other, closer than two Popens of this (large) process follow one another.
# sleep-ok: the wait is the start instant itself, the race under test, not a synchronization.
_AT = "import os,sys,time; time.sleep(max(0.0, float(sys.argv[1]) - time.time())); " + (  # sleep-ok
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def test_two_relays_started_at_once_one_serves_the_other_names_it(
    processes: Procs, short_dir: Path
) -> None:
    """Two `mscluster relay --socket X` started together: one takes X.lock and serves, the
    other is refused in one line naming it, never both saying `serving` while the first's
    socket file was unlinked under it by the second's bind (a race of a few milliseconds:
    without the lock about one start in four, so the start is made RACE_ROUNDS times)."""
    sock = short_dir / "r.sock"
    for round_ in range(RACE_ROUNDS):
        command = [PYTHON, "-c", _AT, str(time.time() + 0.5), *MSCLUSTER]
        command += ["relay", "--socket", f"unix:{sock}"]
        env = job_env(2, free_port())
        pair = [processes.start(f"relay-{round_}-{i}", command, env) for i in (0, 1)]

        def decided() -> bool:
            return all("serving unix:" in p.output or not p.running for p in pair)

        wait_until(decided, 60, "both relays to serve or end")
        serving = [p for p in pair if "serving unix:" in p.output]
        assert len(serving) == 1, [p.output for p in pair]
        (refused,) = [p for p in pair if p not in serving]
        assert refused.wait(30) == EXIT_USAGE, refused.output
        (line,) = refused.output.strip().splitlines()
        assert f"a relay already serves '{sock}' (pid {serving[0].pid} on this host" in line
        assert f"holds '{sock}.lock'" in line
        assert _takes_connections(sock)
        serving[0].signal(signal.SIGTERM)
        assert serving[0].wait(30) == 0, serving[0].output
        assert not sock.exists()


async def test_a_relay_between_its_claim_and_its_bind_keeps_the_path(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race above made certain: relay a has claimed the path and not bound it yet (its
    bind held back) when relay b starts on it. b is refused, naming a, instead of binding a
    socket that a's bind would then unlink (both serving, only a reachable)."""
    sock = short_dir / "r.sock"
    address = f"unix:{sock}"
    bind = hop.HopServer.start
    claimed, go_on = asyncio.Event(), asyncio.Event()

    async def held_back(server: hop.HopServer, path: str) -> None:
        if not claimed.is_set():
            claimed.set()
            await go_on.wait()
        await bind(server, path)

    monkeypatch.setattr(hop.HopServer, "start", held_back)
    first = Relay(RelaySettings(address, f"127.0.0.1:{free_port()}", 2, 30.0))
    second = Relay(RelaySettings(address, f"127.0.0.1:{free_port()}", 2, 30.0))
    starting = asyncio.create_task(first.start())
    try:
        await asyncio.wait_for(claimed.wait(), 20)
        with pytest.raises(ConfigError, match=rf"a relay already serves '{sock}' \(pid \d+"):
            await second.start()
        go_on.set()
        assert await asyncio.wait_for(starting, 20) == address
        there = sock.lstat()
        assert first._bound == (there.st_dev, there.st_ino)  # the socket a bound, still there
    finally:
        go_on.set()
        await second.stop()
        await asyncio.wait((starting,), timeout=20)
        await first.stop()
    assert not sock.exists()


def test_a_relay_leaves_a_file_at_its_path(processes: Procs, short_dir: Path) -> None:
    path = short_dir / "notes"
    path.write_text("the user's\n")
    line = _refusal(processes, "relay", path)
    assert "exists and is not a socket: choose another path" in line
    assert path.read_text() == "the user's\n"


async def test_a_socket_too_busy_to_take_the_probe_is_not_taken_for_a_dead_relays(
    short_dir: Path,
) -> None:
    """A listening socket whose backlog is full (a relay whose loop stalls) does not take the
    probe's connection in time: the relay refuses to start and leaves it; a socket nobody
    listens on refuses the probe, and is taken."""
    sock = short_dir / "r.sock"
    address = f"unix:{sock}"
    with contextlib.ExitStack() as stack:
        busy = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        busy.bind(str(sock))
        busy.listen(0)
        full = False
        for _ in range(64):  # fill its backlog: nothing accepts
            queued = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            queued.setblocking(False)
            try:
                queued.connect(str(sock))
            except BlockingIOError:
                full = True
                break
        assert full, "the backlog never filled"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{free_port()}", 2, 30.0))
        try:
            with pytest.raises(ConfigError, match="cannot tell whether a relay serves") as refused:
                await relay.start()
            assert "choose another --socket" in str(refused.value)
        finally:
            await relay.stop()
        assert sock.is_socket()
        bound = sock.stat().st_ino
    # Closed: the socket file is left, and nobody listens on it.
    assert sock.stat().st_ino == bound
    relay = Relay(RelaySettings(address, f"127.0.0.1:{free_port()}", 2, 30.0))
    try:
        assert await relay.start() == address
        assert _takes_connections(sock)  # the new relay's
    finally:
        await relay.stop()
    assert not sock.exists()


async def test_a_workers_call_too_large_for_the_hosts_link_is_refused_alone(
    short_dir: Path,
) -> None:
    """A Watch whose request and call metadata pass the scheduler's bound of an attach would
    end the host's link, and every worker's stream on it: the relay refuses that call alone
    (INVALID_ARGUMENT, a BadRequestError naming the bound), and the other worker's stream stays
    on the link."""
    job = JobSettings(
        worker_num=1,
        server_num=0,
        node_timeout_s=30.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        limits=Limits(),
    )
    async with SchedulerServer(job) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 1, 30.0))
        await relay.start()
        env = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "1", "MS_SCHED_HOST": "127.0.0.1"}
        env |= {"MS_SCHED_PORT": str(srv.port), "CLUSTER_RELAY": address}
        said: list[str] = []
        identity = NodeIdentity("a", new_incarnation(), "127.0.0.1", 40000)
        agent = WorkerAgent(from_env(env), identity, say=said.append, on_fatal=said.append)
        links = relay._forwarder.links._links  # type: ignore[attr-defined]
        channel = hop_channel.HopChannel(address, schedulers=[f"127.0.0.1:{srv.port}"])
        try:
            assert (await asyncio.wait_for(agent.start(), 20)).size == 1
            await eventually(lambda: sum(len(k.slots) for k in links.values()) == 1, "a's slot")
            watch = channel.unary_stream("/cluster.v1.Scheduler/Watch")
            call = watch(b"", metadata=[("cluster-node-id", "b"), ("x-pad", "x" * 9000)])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(anext(aiter(call)), 10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {edge.HOST_ATTACH_BYTES}" in (refused.value.details() or "")
            kind = dict(refused.value.trailing_metadata() or ())
            assert kind.get(failures.ERROR_KIND_KEY) == "BadRequestError"
            # The host's link carries a's stream as before.
            assert all(link.ended is None for link in links.values())
            assert sum(len(link.slots) for link in links.values()) == 1
            assert srv.core.state.members["a"].state is NodeState.ALIVE
            await agent.kv_set("k", b"v")
            assert said == []
        finally:
            await channel.close()
            await agent.close()
            await relay.stop()


def test_a_relay_whose_lock_file_was_removed_locks_it_anew_or_says_who_took_it(
    processes: Procs, short_dir: Path
) -> None:
    """PATH.lock removed while a relay serves: within a check it says so and locks the file
    there anew, and a second relay is refused, naming it. Removed again while it is stopped and
    locked by another process before it looked: it says so once and serves on; once the other
    lets go, it holds the file again."""
    sock = short_dir / "r.sock"
    where = holder_lock.lock_path(sock)
    command = [*MSCLUSTER, "relay", "--socket", f"unix:{sock}"]
    first = processes.start("relay", command, job_env(2, free_port()))
    first.wait_for_output("mscluster relay: serving", 60)
    where.unlink()
    first.wait_for_output("so it kept no other relay off the path: locked the file there anew", 15)
    line = _refusal(processes, "second", sock)
    assert f"a relay already serves '{sock}' (pid {first.pid} on this host" in line

    first.signal(signal.SIGSTOP)
    wait_until(first.stopped, 10, "the relay to stop")
    where.unlink()
    fd = holder_lock.open_lock(where)
    try:
        assert holder_lock.try_lock(fd, where) is None
        holder_lock.write_holder(fd)
        first.signal(signal.SIGCONT)
        first.wait_for_output("has locked it since", 15)
        assert f"another relay (pid {os.getpid()} on this host) has locked it since" in first.output
        assert _takes_connections(sock)
    finally:
        os.close(fd)
    first.wait_for_output(f"this relay holds '{where}' again", 15)
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0, first.output
    assert first.output.count("has locked it since") == 1
