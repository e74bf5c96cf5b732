"""The host relay's pure parts: what it forwards, where a worker finds it, when the launcher
starts one, and how a worker's route to the scheduler falls back to direct."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import socket
import threading
import time
import zlib
from collections.abc import AsyncIterator, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.protocol import backoff
from cluster.protocol.environment import MAX_SOCKET_PATH, from_env, relay_from_env
from cluster.protocol.errors import CapacityError, ConfigError
from cluster.protocol.leader_search import DOWN_FOR_S, Upstream
from cluster.tools import cli, cli_args, cli_commands, launch_plan
from cluster.tools.launch_plan import LaunchOptions
from cluster.tools.relay import settings_from_env
from cluster.transport import edge, failures, hop, hop_channel, relay, stub, table_file
from cluster.transport.upstreams import PORT_WAIT_PAUSE_S, RETURN_CHECK_S, Upstreams
from cluster.v1 import scheduler_pb2 as pb
from cluster.worker import scheduler_link
from tests.aio import eventually

BASE = {"MS_WORKER_NUM": "8", "MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": "8118"}


def test_the_relay_forwards_a_workers_proof_and_drops_the_headers_of_its_hop() -> None:
    metadata = (
        (":authority", "localhost"),
        ("user-agent", "grpc-python/1.85"),
        ("grpc-accept-encoding", "identity"),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
        ("cluster-node-id", "3"),
        ("cluster-call", "7.abcd"),
        ("cluster-read", "00.11"),
        ("x-trace-bin", b"\x00\x01"),
    )
    assert relay.forwarded(metadata) == (
        ("cluster-node-id", "3"),
        ("cluster-call", "7.abcd"),
        ("cluster-read", "00.11"),
        ("x-trace-bin", b"\x00\x01"),
    )
    assert relay.forwarded(None) == ()


def test_a_call_the_relay_ends_cut_off_says_so_and_no_other() -> None:
    """A worker's call ended UNAVAILABLE with no kind (the scheduler unreachable, or lost
    under the call) carries RELAY_KEY, so that the worker asks its relay again instead of
    probing the scheduler; a refusal, a standby's pointer and an answer pass unchanged."""
    cut = relay.relayed(grpc.StatusCode.UNAVAILABLE, (("x", "1"),))
    assert cut == (("x", "1"), (failures.RELAY_KEY, failures.RELAY_CUT_OFF))
    assert relay.relayed(grpc.StatusCode.UNAVAILABLE, cut) == cut  # marked once
    standby = ((failures.ERROR_KIND_KEY, "NotLeaderError"), (failures.LEADER_KEY, "h:1"))
    assert relay.relayed(grpc.StatusCode.UNAVAILABLE, standby) == standby
    for code in (grpc.StatusCode.OK, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED):
        assert relay.relayed(code, ()) == ()


def test_the_relay_serves_every_method_of_the_scheduler_service_but_its_own() -> None:
    """Every method a worker calls; HostWatch is the relay's own call upstream."""
    service = pb.DESCRIPTOR.services_by_name["Scheduler"]
    expected = sorted(
        f"/cluster.v1.Scheduler/{m.name}" for m in service.methods if m.name != "HostWatch"
    )

    class Channel:
        def __getattr__(self, kind: str) -> object:
            return lambda path: (kind, path)

    upstreams = Upstreams(["h:1"], lambda address: Channel())  # type: ignore[arg-type,return-value]
    assert relay.Forwarder(upstreams).paths == expected


def test_the_relay_follows_the_leader_by_the_workers_rules() -> None:
    up = Upstream(["a:1", "b:1"])
    assert up.current == "a:1"
    assert up.cut_off("a:1", 10.0) == "b:1"  # the leader went: the next in turn
    assert up.cut_off("a:1", 10.1) is None  # a late word of the one left behind
    # The standby still names the leader just found down (its lease lives): stay, ask again.
    assert up.not_leader("b:1", "a:1", 10.2) is None
    assert up.current == "b:1"
    assert up.not_leader("b:1", "", 10.3) == "a:1"  # none leads (an election): next in turn
    assert up.not_leader("a:1", "b:1", 10.4) == "b:1"  # the one named
    assert up.not_leader("b:1", "a:1", 10.1 + DOWN_FOR_S) == "a:1"  # down long enough ago
    assert up.not_leader("a:1", "a:1", 12.0) is None  # itself
    single = Upstream(["a:1"])
    assert single.cut_off("a:1", 1.0) is None
    assert single.not_leader("a:1", "", 1.0) is None


def test_the_relay_follows_a_leader_named_outside_its_list_as_its_workers_do() -> None:
    """A standby names the leader by the address it advertises, which the relay's list may
    not hold (a scheduler started since; a pod's IP behind a DNS name): followed, as the
    workers follow it, so that their calls keep going through the relay. Found down, the
    first listed is asked next, also with one listed."""
    up = Upstream(["a:1", "b:1"])
    assert up.not_leader("a:1", "10.0.0.9:1", 1.0) == "10.0.0.9:1"
    assert up.not_leader("10.0.0.9:1", "b:1", 2.0) == "b:1"  # that one stood down in turn
    assert up.cut_off("b:1", 3.0) == "a:1"
    assert up.not_leader("a:1", "10.0.0.9:1", 3.1) == "10.0.0.9:1"
    assert up.cut_off("10.0.0.9:1", 4.0) == "a:1"  # gone: back to the list
    # The standby still names it (its lease lives): stay, and ask again.
    assert up.not_leader("a:1", "10.0.0.9:1", 4.5) is None
    single = Upstream(["s:1"])
    assert single.not_leader("s:1", "l:1", 1.0) == "l:1"
    assert single.cut_off("l:1", 2.0) == "s:1"


def test_the_relay_checks_only_a_leader_it_would_follow_and_one_found_down_is_not() -> None:
    """`follows` says whether a standby's word would move the relay (so only then is the
    leader asked which job it runs); a leader that did not answer that question is taken
    for down (`found_down`) without moving the relay: not followed for DOWN_FOR_S."""
    up = Upstream(["a:1", "b:1"])
    assert up.follows("a:1", "l:1", 1.0)
    assert not up.follows("b:1", "l:1", 1.0)  # a late word: not the current one
    assert not up.follows("a:1", "a:1", 1.0)  # itself
    assert not up.follows("a:1", "", 1.0)  # none named
    up.found_down("l:1", 1.0)
    assert up.current == "a:1"
    assert not up.follows("a:1", "l:1", 1.5)
    assert up.not_leader("a:1", "l:1", 1.5) is None  # stays, asks again
    assert up.follows("a:1", "l:1", 1.0 + DOWN_FOR_S)


async def test_the_relay_moves_on_what_a_forwarded_call_came_back_with() -> None:
    opened: list[str] = []
    said: list[str] = []

    class Channel:
        def get_state(self, try_to_connect: bool = False) -> None:
            pass

        async def close(self, grace: float | None = None) -> None:
            pass

    def open_channel(address: str) -> Channel:
        opened.append(address)
        return Channel()

    now = [5.0]
    upstreams = Upstreams(["a:1", "b:1"], open_channel, said.append, lambda: now[0])  # type: ignore[arg-type]
    unavailable = grpc.StatusCode.UNAVAILABLE
    # A refusal that is an answer (a crowded scheduler) moves nothing.
    upstreams.answered("a:1", unavailable, (("cluster-error", "CrowdedError"),))
    assert upstreams.current == "a:1"
    assert said == []
    upstreams.answered("a:1", unavailable, ())  # cut off
    assert upstreams.current == "b:1"
    assert opened == ["b:1"]
    now[0] += DOWN_FOR_S
    # A standby's refused registration: an OK stream whose trailing metadata names the leader.
    upstreams.answered("b:1", grpc.StatusCode.OK, (("cluster-leader", "a:1"),))
    assert upstreams.current == "a:1"
    assert opened == ["b:1", "a:1"]
    assert said == [
        "following the leader at b:1 (the scheduler at a:1 did not answer)",
        "following the leader at a:1 (the scheduler at b:1 stands by)",
    ]


async def test_a_relay_waits_for_the_port_only_where_grpcs_pause_can_pass_a_second() -> None:
    """Two relays whose channels pause after a refused connection, one for at most a second
    (a job of up to 1,000 nodes: left to gRPC), one for a minute: only the second waits for the
    scheduler's port, and opens a new channel once it takes connections."""

    class Paused:  # a channel in gRPC's pause between connection attempts
        closed = False

        def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
            return grpc.ChannelConnectivity.TRANSIENT_FAILURE

        async def close(self, grace: float | None = None) -> None:
            self.closed = True

    opened: list[Paused] = []

    def open_channel(address: str) -> Paused:
        opened.append(Paused())
        return opened[-1]

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # connections refused until it listens
        address = f"127.0.0.1:{held.getsockname()[1]}"
        said: list[str] = []
        short = Upstreams([address], open_channel, pause_s=PORT_WAIT_PAUSE_S)  # type: ignore[arg-type]
        long = Upstreams([address], open_channel, said.append, pause_s=60.0)  # type: ignore[arg-type]
        try:
            first_short, first_long = short.channel(), long.channel()
            for upstreams in (short, long):
                upstreams.answered(address, grpc.StatusCode.UNAVAILABLE, ())  # cut off
            held.listen()
            back = f"the scheduler at {address} takes connections again"
            await eventually(lambda: said == [back], "the port found taking connections")
            assert first_long.closed  # type: ignore[attr-defined]
            assert long.channel() is opened[2]  # a new one, opened on the next call
            assert short.channel() is first_short  # left to gRPC's pause
        finally:
            await short.close()
            await long.close()


@pytest.mark.parametrize(
    ("raw", "address"),
    [
        ("unix:/run/relay.sock", "unix:/run/relay.sock"),
        ("unix:///run/relay.sock", "unix:/run/relay.sock"),
        ("/run/relay.sock", "unix:/run/relay.sock"),
        ("unix:relay.sock", "unix:relay.sock"),
        ("", None),
        ("  ", None),
    ],
)
def test_cluster_relay_names_a_local_socket(raw: str, address: str | None) -> None:
    assert relay_from_env({"CLUSTER_RELAY": raw}) == address


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        ("unix:", "is not a relay address: give unix:PATH"),
        ("unix:" + "/x" * MAX_SOCKET_PATH, f"must be at most {MAX_SOCKET_PATH} bytes"),
    ],
)
def test_a_bad_cluster_relay_is_one_clear_error(raw: str, rule: str) -> None:
    with pytest.raises(ConfigError, match=rf"CLUSTER_RELAY='{raw[:12]}.*{rule}"):
        relay_from_env({"CLUSTER_RELAY": raw})


def test_a_worker_reads_its_relay_and_a_scheduler_does_not() -> None:
    env = {**BASE, "CLUSTER_RELAY": "unix:/r.sock"}
    assert from_env({**env, "MS_ROLE": "MS_WORKER"}).relay == "unix:/r.sock"
    assert from_env({**env, "MS_ROLE": "MS_SCHED"}).relay is None


def test_the_relay_takes_the_job_and_the_scheduler_from_the_launch_environment() -> None:
    made = settings_from_env({**BASE, "MS_NODE_TIMEOUT": "5"}, "/r.sock")
    assert (made.address, made.scheduler, made.nodes) == ("unix:/r.sock", "10.0.0.1:8118", 8)
    assert (made.node_timeout_s, made.tls, made.path) == (5.0, None, Path("/r.sock"))
    other = settings_from_env({**BASE, "MS_DISABLE_HEARTBEAT": "1"}, "unix:/r", "h:9")
    assert (other.scheduler, other.node_timeout_s) == ("h:9", None)
    both = settings_from_env({**BASE, "MS_SCHED_HOST": "10.0.0.1,10.0.0.2"}, "/r.sock")
    assert both.schedulers == ("10.0.0.1:8118", "10.0.0.2:8118")


@pytest.mark.parametrize("scheduler", ["abc", "", "h:9,", "h:0"])
def test_a_bad_scheduler_option_is_refused_naming_the_option(scheduler: str) -> None:
    """`mscluster relay --scheduler abc` blamed CLUSTER_SCHED_ADDRS, which the user never set,
    and `--scheduler ''` fell back to MS_SCHED_HOST without a word."""
    with pytest.raises(ConfigError, match=r"^--scheduler .* must be HOST:PORT"):
        settings_from_env(BASE, "/r.sock", scheduler)


def test_a_relay_started_by_hand_ends_with_the_job_and_a_launchers_does_not() -> None:
    """`mscluster run` stops its relay (and would take its exit for a failure to restart): only
    a relay whose parent is not its launcher ends by itself once the job is over."""
    assert settings_from_env(BASE, "/r.sock").ends_with_job
    launched = {**BASE, "CLUSTER_LAUNCHER_PID": str(os.getppid())}
    assert not settings_from_env(launched, "/r.sock").ends_with_job
    assert settings_from_env(launched, "/r.sock").owns_directory  # mkdtemp'd for it alone
    assert not settings_from_env(BASE, "/r.sock").owns_directory
    elsewhere = {**BASE, "CLUSTER_LAUNCHER_PID": str(os.getpid())}  # not its parent
    assert settings_from_env(elsewhere, "/r.sock").ends_with_job


def test_the_relay_reads_the_jobs_end_and_no_other_event() -> None:
    """The one event the relay parses: a Shutdown, finished or failed, reason and all."""
    for ok, reason in ((True, "all 4 nodes finished"), (False, "")):
        event = pb.Event(shutdown=pb.Shutdown(ok=ok, reason=reason)).SerializeToString()
        assert stub.shutdown_of(event) == (ok, reason)
    others = [
        pb.Event(progress=pb.Progress()),
        pb.Event(node_failed=pb.NodeFailed(rank=2, node_id="n", reason="died")),
        pb.Event(heartbeat=pb.SchedulerHeartbeat()),
        pb.Event(topology_ready=pb.TopologyReady(generation=3)),
    ]
    for other in others:
        assert stub.shutdown_of(other.SerializeToString()) is None, other
    assert stub.shutdown_of(b"\x22\xff") is None  # a Shutdown's tag, then no Shutdown


def test_the_relay_reads_whose_watch_it_carries_and_whose_finish_was_a_failure() -> None:
    """The node ids it waits on to finish: a Watch's (a Hello or a RegisterRequest), and a
    Finish's, which finished the node unless it carried a failure."""
    hello = pb.WatchRequest(hello=pb.Hello(node_id="a", incarnation=1))
    register = pb.WatchRequest(register=pb.RegisterRequest(node_id="b"))
    assert stub.watcher_of(hello.SerializeToString()) == "a"
    assert stub.watcher_of(register.SerializeToString()) == "b"
    done = pb.FinishRequest(node_id="a", incarnation=1)
    died = pb.FinishRequest(node_id="b", incarnation=1, failure="RuntimeError: boom")
    assert stub.finisher_of(done.SerializeToString()) == ("a", True)
    assert stub.finisher_of(died.SerializeToString()) == ("b", False)


def test_the_relay_refuses_a_node_timeout_the_job_would_refuse() -> None:
    """The relay reads MS_NODE_TIMEOUT as the scheduler and the workers do: at least 1 s."""
    with pytest.raises(ConfigError, match=r"MS_NODE_TIMEOUT='0.5' is out of range.*at least 1"):
        settings_from_env({**BASE, "MS_NODE_TIMEOUT": "0.5"}, "/r.sock")


def options(**changes: object) -> LaunchOptions:
    base = LaunchOptions(
        script=Path("train.py"),
        script_args=(),
        worker_num=8,
        local_worker_num=4,
        master_addr="127.0.0.1",
        master_port=8118,
        log_dir=Path("logs"),
        python="/usr/bin/python3",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "relayed"),
    [
        ({}, True),
        ({"relay": False}, False),  # --no-relay
        ({"local_worker_num": 1}, False),  # one worker gains nothing from a relay
        ({"local_worker_num": 1, "spares": 1, "enable_recovery": True}, True),
    ],
)
def test_the_launcher_relays_two_or_more_local_workers(
    changes: dict[str, object], relayed: bool
) -> None:
    assert launch_plan.wants_relay(options(**changes)) is relayed


def test_the_plan_starts_the_relay_and_points_the_workers_at_it() -> None:
    made = launch_plan.make_plan(
        options(relay_socket=Path("/tmp/r/relay.sock")),
        ip="127.0.0.1",
        with_scheduler=True,
        hostname="h",
        launcher_pid=9,
        tls_env={},
    )
    assert made.relay is not None
    assert made.relay.args == (
        "/usr/bin/python3",
        *("-m", "cluster", "relay", "--socket", "unix:/tmp/r/relay.sock"),
    )
    assert made.relay.log == Path("logs/relay.log")
    assert made.processes[-1] is made.relay
    assert {w.env["CLUSTER_RELAY"] for w in made.workers} == {"unix:/tmp/r/relay.sock"}
    assert made.scheduler is not None
    assert "CLUSTER_RELAY" not in made.scheduler.env
    direct = launch_plan.make_plan(
        options(), ip="127.0.0.1", with_scheduler=False, hostname="h", launcher_pid=9, tls_env={}
    )
    assert direct.relay is None
    assert all("CLUSTER_RELAY" not in w.env for w in direct.workers)


def test_the_cli_parses_relay_and_no_relay() -> None:
    parser = cli.build_parser()
    args = cli_args.parse(parser, ["relay", "--socket", "unix:/r.sock", "--scheduler", "h:1"])
    assert (args.socket, args.scheduler) == ("unix:/r.sock", "h:1")
    assert args.func is cli_commands.cmd_relay
    assert cli_args.parse(parser, ["run", "--no-relay", "t.py"]).relay is False
    assert cli_args.parse(parser, ["run", "t.py"]).relay is True


def unix_server(tmp_path: Path, name: str) -> tuple[socket.socket, Path]:
    """A unix socket listening in /tmp (short paths), and its path."""
    path = Path("/tmp") / f"relay-unit-{name}-{tmp_path.name[-20:]}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    return server, path


@pytest.fixture
def answering(tmp_path: Path) -> Iterator[str]:
    """A unix socket that answers a ping on the local hop with a pong, as a relay does (served
    by a thread), its address."""
    server, path = unix_server(tmp_path, "answering")
    server.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(5.0)
                    conn.recv(64)  # the ping's frame
                    conn.sendall(hop.frame(stub.hop_pong()))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"unix:{path}"
    finally:
        stop.set()
        thread.join(5)
        server.close()
        path.unlink()


def config(relay_address: str | None) -> object:
    env = {**BASE, "MS_ROLE": "MS_WORKER"}
    return from_env({**env, "CLUSTER_RELAY": relay_address} if relay_address else env)


def test_a_route_goes_through_an_answering_relay_until_it_is_lost(answering: str) -> None:
    said: list[str] = []
    route = scheduler_link.Route(config(answering), said.append)  # type: ignore[arg-type]
    assert route.relay == answering
    assert not route.relay_lost(why=scheduler_link.relay_check(answering))  # it answers
    assert route.relay_lost(cut_off=True)  # its connection to the relay broke
    assert route.relay is None
    assert not route.relay_lost(cut_off=True)  # said once
    assert said == [f"lost the relay at {answering}: this node talks to the scheduler directly"]


def test_a_route_finds_a_lost_relay_back_when_it_next_opens_a_channel(answering: str) -> None:
    now = [0.0]
    said: list[str] = []
    route = scheduler_link.Route(config(answering), said.append, lambda: now[0])  # type: ignore[arg-type]
    assert route.relay_lost(cut_off=True)
    assert not route.relay_back()  # too soon: a killed relay may still listen a moment
    now[0] += scheduler_link.RELAY_BACK_AFTER_S
    assert route.relay_back()
    assert route.relay == answering
    assert not route.relay_back()  # back already


def test_a_route_left_for_its_schedulers_refusal_is_taken_back_by_the_stream_only(
    answering: str,
) -> None:
    """A relay whose scheduler refused the node as another job's is left, said in one line;
    the channels the node opens while it registers directly do not take it back (it would be
    refused through it again), the move of its running stream, or its loss, does."""
    now = [0.0]
    said: list[str] = []
    route = scheduler_link.Route(config(answering), said.append, lambda: now[0])  # type: ignore[arg-type]
    assert route.relay_refused("the scheduler it forwards to runs another job: node '0' ...")
    assert not route.relay_refused("again")  # said once
    assert route.relay is None
    assert route.away
    assert said == [
        f"leaves the relay at {answering} (the scheduler it forwards to runs another job: node "
        "'0' ...): this node asks its job's schedulers directly, and goes back through the relay "
        "once it is in the job again"
    ]
    now[0] += scheduler_link.RELAY_BACK_AFTER_S
    assert not route.relay_back(opening=True)  # a channel opened: it stays direct
    assert route.relay is None
    assert route.relay_back(scheduler_link.relay_check(answering))  # the stream moves
    assert route.relay == answering
    # Lost later, it is found back as any lost relay is, when a channel opens.
    assert route.relay_lost(cut_off=True)
    now[0] += scheduler_link.RELAY_BACK_AFTER_S
    assert route.relay_back(opening=True)


def test_a_route_looks_for_a_relay_that_did_not_take_the_stream_back_later_each_time(
    answering: str,
) -> None:
    now = [0.0]
    said: list[str] = []
    route = scheduler_link.Route(config(answering), said.append, lambda: now[0])  # type: ignore[arg-type]
    assert route.relay_lost(cut_off=True)
    assert route.away
    waits = []
    for _ in range(8):
        now[0] += scheduler_link.RELAY_BACK_AFTER_S
        waited = scheduler_link.RELAY_BACK_AFTER_S
        while not route.relay_back():
            now[0] += 0.5
            waited += 0.5
        waits.append(waited)
        route.move_failed()  # its registration through the relay failed: direct again
        assert route.relay is None
        assert route.away
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    # Said: the loss, the relay answering, the first failed move; not each try after it (each
    # worker of a host whose relay's scheduler refuses them said two lines a minute).
    assert said[1:] == [
        f"the relay at {answering} answers again: this node talks through it",
        f"the relay at {answering} did not take this node's stream: it stays direct, and looks "
        "again in 2 s, then twice as late each time up to every 60 s, saying so again once the "
        "relay takes it",
    ]
    assert route.relay_lost() is False  # direct already
    now[0] += 60.0
    assert route.relay_back()
    route.move_took()
    assert said[-1] == (
        f"the relay at {answering} took this node's stream after 8 failed tries: this node "
        "talks through it"
    )
    route.move_took()  # a move that took at once is not said
    assert len(said) == 4
    assert route.relay_lost(cut_off=True)  # lost again later: looked for again after 1 s
    now[0] += scheduler_link.RELAY_BACK_AFTER_S
    assert route.relay_back()


def test_a_route_without_an_answering_relay_is_direct(tmp_path: Path) -> None:
    absent = f"unix:/tmp/relay-unit-absent-{tmp_path.name[-20:]}.sock"
    said: list[str] = []
    route = scheduler_link.Route(config(absent), said.append)  # type: ignore[arg-type]
    assert route.checked(scheduler_link.relay_check(absent))
    assert route.relay is None
    assert said == [
        f"no relay answers at {absent} (nothing takes connections there: No such file or "
        "directory): this node talks to the scheduler directly"
    ]
    assert scheduler_link.Route(config(None), said.append).relay is None  # type: ignore[arg-type]
    assert not route.checked("")  # said once
    assert len(said) == 1


def test_a_relay_check_is_a_ping_answered_in_time_not_a_connection_taken(
    tmp_path: Path, answering: str
) -> None:
    """A socket that takes connections and answers nothing (a stopped relay: the kernel takes
    them) does not answer; a relay's pong does; the check says why not, and takes no longer
    than RELAY_CHECK_S."""
    server, path = unix_server(tmp_path, "silent")
    silent = f"unix:{path}"
    try:
        started = time.monotonic()
        assert hop_channel.ping(silent, 0.2) == (
            "it takes connections, but answered no ping within 0.2 s: stopped or hung?"
        )
        assert time.monotonic() - started < 2.0
        assert hop_channel.ping(answering, 5.0) == ""
        route = scheduler_link.Route(config(answering), [].append)  # type: ignore[arg-type]
        assert not route.checked(scheduler_link.relay_check(answering))
        assert route.relay == answering
    finally:
        server.close()
        path.unlink()


def test_a_relay_check_holds_briefly_and_an_answering_one_only_when_asked() -> None:
    address, now = "unix:/nonexistent/relay-unit.sock", [100.0]
    scheduler_link._relay_checks[address] = ("", 100.0)
    try:
        assert scheduler_link.relay_check(address, clock=lambda: now[0]) == ""
        not_there = scheduler_link.relay_check(address, kept_up=False, clock=lambda: now[0])
        assert not_there.startswith("nothing takes connections there")
        scheduler_link._relay_checks[address] = ("", 100.0)
        now[0] += scheduler_link.RELAY_CHECK_KEPT_S
        assert scheduler_link.relay_check(address, clock=lambda: now[0]) == not_there
    finally:
        scheduler_link._relay_checks.pop(address, None)


async def test_a_hosts_workers_share_one_forwarded_table_and_a_failure_is_not_kept() -> None:
    forwarded: list[bytes] = []
    gate = asyncio.Event()
    results: list[bytes | None] = [None, b"table"]

    async def forward(request: bytes, context: object) -> bytes | None:
        forwarded.append(request)
        await gate.wait()
        return results.pop(0)

    answers = relay.TableAnswers(forward, None)
    request = pb.PeerTableRequest(digest=b"d" * 32).SerializeToString()
    first = [asyncio.ensure_future(answers.answer(request, None)) for _ in range(3)]  # type: ignore[arg-type]
    await asyncio.sleep(0)  # sleep-ok: one turn of the loop, so that each asks; not a wait
    gate.set()
    # The first asker's call failed (its worker hears the failure); the others waited on it,
    # then one of them forwarded its own, and the last waited on that one.
    got = await asyncio.gather(*first)
    assert got[0] is None
    assert got[1:] == [b"table", b"table"]
    assert forwarded == [request, request]
    # Another worker's request for the same digest (its own proof, asking for the shared copy
    # of a relay that has none): answered from what the relay holds.
    other = pb.PeerTableRequest(digest=b"d" * 32, shared=True).SerializeToString()
    assert await answers.answer(other, None) == b"table"  # type: ignore[arg-type]
    assert len(forwarded) == 2


def compressed_table(n: int) -> tuple[bytes, bytes, pb.PeerTable]:
    """(digest, PeerTableResponse bytes, the table) of a table of `n` workers."""
    table = pb.PeerTable(
        ranks=range(n),
        node_ids=[f"w{r}" for r in range(n)],
        hosts=[f"host-{r // 8}" for r in range(n)],
        ports=[29500 + r % 8 for r in range(n)],
        roles=[pb.ROLE_WORKER] * n,
        local_ranks=[r % 8 for r in range(n)],
        local_sizes=[8] * n,
    )
    packed = zlib.compress(table.SerializeToString())
    digest = hashlib.sha256(packed).digest()
    return digest, pb.PeerTableResponse(peers_zlib=packed).SerializeToString(), table


async def test_a_worker_that_asks_is_answered_with_the_hosts_shared_copy() -> None:
    """A relay with shared tables answers a `shared` request with where its one copy lies; a
    worker maps it and reads the rows it needs (`table_file`). A worker that did not ask gets
    the bytes; a request that is not one is refused, and changes nothing."""
    digest, answer, table = compressed_table(300)

    async def forward(request: bytes, context: object) -> bytes | None:
        return answer

    shared = relay.SharedTables()
    answers = relay.TableAnswers(forward, shared)
    try:
        plain = pb.PeerTableRequest(digest=digest).SerializeToString()
        assert await answers.answer(plain, None) == answer  # type: ignore[arg-type]
        asked = pb.PeerTableRequest(digest=digest, shared=True).SerializeToString()
        got = pb.PeerTableResponse.FromString(await answers.answer(asked, None))  # type: ignore[arg-type]
        assert got.peers_zlib == b""
        assert got.shared_path.startswith(f"/proc/{os.getpid()}/fd/")
        mapped = table_file.open_shared(got.shared_path, digest)
        assert list(mapped.node_ids) == list(table.node_ids)
        assert list(mapped.hosts[:10]) == list(table.hosts[:10])
        for column in ("ranks", "ports", "roles", "local_ranks", "local_sizes"):
            assert list(getattr(mapped, column)) == list(getattr(table, column)), column
        assert mapped.node_ids[299] == "w299"
        with pytest.raises(table_file.SharedTableError, match="not the table"):
            table_file.open_shared(got.shared_path, b"x" * 32)
        context = _Refused()
        assert await answers.answer(b"\xff\xff", context) is None  # type: ignore[arg-type]
        assert context.code is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        shared.close()
    assert list(mapped.node_ids[:2]) == ["w0", "w1"]  # a mapping outlives the relay's file


def test_a_relay_on_a_system_without_memfd_answers_with_the_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "memfd_create")
    said: list[str] = []
    shared = relay.SharedTables(said.append)
    digest, answer, _ = compressed_table(50)
    assert shared.path(digest, answer) is None
    assert "no memfd_create" in said[0]


def test_a_relay_keeps_its_last_tables_and_one_it_cannot_share_is_said_once() -> None:
    said: list[str] = []
    shared = relay.SharedTables(said.append)
    try:
        made = [compressed_table(n) for n in range(10, 10 + relay.TABLES_KEPT + 2)]
        paths = [shared.path(digest, answer) for digest, answer, _ in made]
        assert all(paths)
        assert len(shared._files) == relay.TABLES_KEPT  # the oldest closed
        assert shared.path(b"z" * 32, made[0][1]) is None  # not the bytes of that digest
        assert shared.path(b"z" * 32, b"\xff\xff") is None
        assert len(said) == 1, said
        assert "cannot share peer tables" in said[0]
    finally:
        shared.close()


class _Refused:
    code: grpc.StatusCode | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=40), st.integers(0, 300))
def test_a_batch_is_the_encoding_of_its_parts_as_they_are(slots: list[int], pad: int) -> None:
    ups = [
        pb.HostUp(detach=slot)
        if slot % 3 == 0
        else pb.HostUp(attach=pb.HostAttach(slot=slot, request=b"r" * pad))
        for slot in slots
    ]
    raw = stub.host_batch(up.SerializeToString() for up in ups)
    assert raw == pb.HostUp(batch=pb.HostUps(ups=ups)).SerializeToString()
    assert list(pb.HostUp.FromString(raw).batch.ups) == ups


class _SlowLink:
    """A HostWatch call whose writes take a turn of the loop each, and record what went up."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.gate = asyncio.Event()

    async def write(self, raw: bytes) -> None:
        await self.gate.wait()
        self.written.append(raw)

    async def read(self) -> object:
        await asyncio.Event().wait()  # nothing comes down in this test
        return None

    def cancel(self) -> None:
        pass


async def test_what_queues_while_a_write_is_on_its_way_goes_up_as_one_batch() -> None:
    call = _SlowLink()
    link = relay._Link("sched:1", call)
    try:
        n = relay.HOST_BATCH + 10
        for slot in range(1, n + 1):
            link.open(slot, stub.host_attach(slot, b"w", [("cluster-node-id", str(slot))]))
        call.gate.set()
        await eventually(lambda: len(call.written) == 2, "two writes")
        # All queued before the writer's first turn: a full batch, then the rest; every attach
        # once, in order.
        sent = [pb.HostUp.FromString(raw) for raw in call.written]
        assert [len(up.batch.ups) for up in sent] == [relay.HOST_BATCH, 10]
        assert [u.attach.slot for up in sent for u in up.batch.ups] == list(range(1, n + 1))
        # One that comes alone goes alone.
        link.open(n + 1, stub.host_attach(n + 1, b"w", []))
        await eventually(lambda: len(call.written) == 3, "a third write")
        assert pb.HostUp.FromString(call.written[2]).attach.slot == n + 1
    finally:
        link.close()


async def test_a_batch_is_cut_at_its_size_and_the_rest_goes_next() -> None:
    call = _SlowLink()
    link = relay._Link("sched:1", call)
    try:
        big = b"x" * (relay.HOST_BATCH_BYTES // 3)
        for slot in range(1, 8):
            link.open(slot, stub.host_attach(slot, big, []))
        call.gate.set()
        await eventually(lambda: sum(_parts(raw) for raw in call.written) == 7, "seven sent")
        assert all(len(raw) <= relay.HOST_BATCH_BYTES + 16 for raw in call.written)
        assert [_parts(raw) for raw in call.written] == [2, 2, 2, 1]
    finally:
        link.close()


def _parts(raw: bytes) -> int:
    up = pb.HostUp.FromString(raw)
    return len(up.batch.ups) if up.WhichOneof("kind") == "batch" else 1


def test_a_relay_tries_the_port_as_often_as_the_workers_it_serves_would() -> None:
    """In a job of 65,536 nodes a node alone tries a refusing port every 6.5 s; a relay
    serving 8 of them tries as they would together (every 0.8 s), and with none connected as
    one node. Its quick first second is a node's."""
    serving = [8]
    upstreams = Upstreams(
        ["127.0.0.1:1"],
        lambda address: None,  # type: ignore[arg-type, return-value]  # never opened here
        nodes=65_536,
        serving=lambda: serving[0],
    )
    assert upstreams.port_pace(2.0) == (
        backoff.listen_every_s(2.0, 65_536, 8),
        RETURN_CHECK_S,
    )
    assert upstreams.port_pace(2.0)[0] == 65_536 / (backoff.LISTEN_TRIES_PER_S * 8)
    serving[0] = 0
    assert upstreams.port_pace(2.0)[0] == backoff.listen_every_s(2.0, 65_536)
    assert upstreams.port_pace(0.25)[1] == backoff.LISTEN_FAST_S - 0.25


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**64 - 1), st.binary(max_size=20_000), st.booleans())
def test_the_size_of_an_attach_is_the_size_the_scheduler_reads(
    slot: int, request: bytes, finish: bool
) -> None:
    up, size = stub.host_attach_sized(slot, request, [("cluster-node-id", "a")], finish=finish)
    parsed = pb.HostUp.FromString(up)
    assert size == getattr(parsed, parsed.WhichOneof("kind")).ByteSize()


class _HostCall:
    """A HostWatch call: what the test puts in `down` comes down (then EOF ends it, as a
    scheduler that stood by ends it)."""

    def __init__(self, leader: str) -> None:
        self.down: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = False
        self._leader = leader

    async def write(self, raw: bytes) -> None:
        pass

    async def read(self) -> object:
        return await self.down.get()

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    async def details(self) -> str:
        return "not the leader"

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((failures.ERROR_KIND_KEY, "NotLeaderError"), (failures.LEADER_KEY, self._leader))

    def cancel(self) -> None:
        self.cancelled = True


class _WorkerCall:
    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.trailing: object = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("cluster-node-id", "a"),)

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, trailing: object) -> None:
        self.trailing = trailing

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


async def test_a_link_left_behind_does_not_take_a_newer_links_place_with_it() -> None:
    """The link to a scheduler ends (it stood by, naming another) while a worker's slot of it
    still has an event to hand over; meanwhile another worker's Watch made a new link to that
    address. When the first slot ends the relay has moved, so the old link goes: the new one
    stays the relay's, and is closed with the relay."""
    calls: list[_HostCall] = []

    class Channel:
        def stream_stream(self, path: str) -> object:
            def start(metadata: object) -> _HostCall:
                assert metadata == relay.stamp()  # the relay's release, on its own call
                calls.append(_HostCall("y:1"))
                return calls[-1]

            return start

        def get_state(self, try_to_connect: bool = False) -> None:
            pass

        async def close(self, grace: float | None = None) -> None:
            pass

    upstreams = Upstreams(["x:1", "y:1"], lambda address: Channel())  # type: ignore[arg-type,return-value]
    links = relay.HostLinks(upstreams)
    first, second = _WorkerCall(), _WorkerCall()
    w1 = links.watch(b"w", first)
    event = pb.HostDown(slots=[1], event=b"e").SerializeToString()
    reading = asyncio.ensure_future(anext(w1))
    await eventually(lambda: len(calls) == 1, "the first link")
    calls[0].down.put_nowait(event)
    assert await asyncio.wait_for(reading, 5) == b"e"  # slot 1 holds at its yield
    old = links._links["x:1"]
    calls[0].down.put_nowait(grpc.aio.EOF)  # type: ignore[attr-defined]
    await eventually(lambda: old.ended is not None, "the first link's end")
    w2 = links.watch(b"w", second)
    waiting = asyncio.ensure_future(anext(w2))
    try:
        await eventually(lambda: len(calls) == 2, "a new link to the same scheduler")
        new = links._links["x:1"]
        assert new is not old
        assert upstreams.current == "x:1"
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(w1), 5)  # slot 1 ends: the relay moves to y:1
        assert first.code == grpc.StatusCode.UNAVAILABLE
        assert upstreams.current == "y:1"
        assert old.slots == {}
        assert calls[0].cancelled
        assert links._links.get("x:1") is new
        links.close()
        assert calls[1].cancelled
    finally:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        links.close()


# -- the host's beats (`HostBeats`) ------------------------------------------------------------

# The longest node id a worker may have, less its numbering (`valid_node_id`: 128).
LONG_ID = "n" * 120


class _BeatsCall:
    """A HostBeats call upstream: what the relay writes, or the refusal each write meets and
    the call, awaited, ends with."""

    def __init__(self, refusal: grpc.aio.AioRpcError | None) -> None:
        self.written: list[bytes] = []
        self.refusal = refusal

    async def write(self, raw: bytes) -> None:
        if self.refusal is not None:
            raise self.refusal
        self.written.append(raw)

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass

    def __await__(self) -> Generator[Any, None, bytes]:
        return self._answer().__await__()

    async def _answer(self) -> bytes:
        if self.refusal is not None:
            raise self.refusal
        return b""  # HostBeatsResponse: empty


class _Channel:
    def __init__(self, refusal: grpc.aio.AioRpcError | None = None) -> None:
        self.calls: list[_BeatsCall] = []
        self.refusal = refusal

    def stream_unary(self, path: str) -> object:
        def start(metadata: object) -> _BeatsCall:
            assert metadata == relay.stamp()  # the relay's release, on its own call
            self.calls.append(_BeatsCall(self.refusal))
            return self.calls[-1]

        return start

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return grpc.ChannelConnectivity.READY

    async def close(self, grace: float | None = None) -> None:
        pass


async def _requests(raws: Iterable[bytes]) -> AsyncIterator[bytes]:
    for raw in raws:
        yield raw


def _beat(node_id: str, incarnation: int) -> bytes:
    return pb.HeartbeatRequest(node_id=node_id, incarnation=incarnation).SerializeToString()


def _beats(channel: _Channel, said: list[str] | None = None) -> relay.HostBeats:
    upstreams = Upstreams(["sched:1"], lambda address: channel)  # type: ignore[arg-type,return-value]
    return relay.HostBeats(upstreams, 0.001, (said if said is not None else []).append)


async def test_every_beat_of_a_full_host_of_long_ids_goes_up_in_messages_the_scheduler_takes() -> (
    None
):
    """A link's most workers (edge.HOST_SLOTS), each with a 128-character id, beat at once: a
    batch names 1.1 MiB of them, past the 256 KiB the scheduler takes of one HostBeats message.
    Every message the relay writes passes the scheduler's own check at its edge, and together
    they name every worker once."""
    channel = _Channel()
    beats = _beats(channel)
    nodes = [(f"{LONG_ID}{i:08d}", (1 << 62) + i) for i in range(edge.HOST_SLOTS)]
    whole = pb.HostBeatsRequest(nodes=[pb.Hello(node_id=n, incarnation=i) for n, i in nodes])
    assert whole.ByteSize() > edge.MESSAGE_LIMITS["HostBeats"]
    context = _WorkerCall()
    try:
        assert await beats.local(_requests(_beat(n, i) for n, i in nodes), context) == b""
        scheduler_reads = edge.capped("HostBeats", pb.HostBeatsRequest.FromString)
        named: list[tuple[str, int]] = []

        def all_named() -> bool:
            written = [raw for call in channel.calls for raw in call.written]
            read = [scheduler_reads(raw) for raw in written]
            assert not [r for r in read if isinstance(r, edge.Unparsed)], "refused at the edge"
            named[:] = [(h.node_id, h.incarnation) for r in read for h in r.nodes]
            return len(named) >= len(nodes)

        await eventually(all_named, "every beat sent")
        assert sorted(named) == sorted(nodes)
        assert len(channel.calls) == 1  # one stream, several messages
        assert all(len(raw) <= relay.HOST_BATCH_BYTES for raw in channel.calls[0].written)
    finally:
        beats.stop()


def test_a_batch_is_cut_between_its_nodes_and_reads_as_one() -> None:
    nodes = [(f"{LONG_ID}{i:08d}", i) for i in range(1000)] + [("a", 1)]
    batches = stub.host_beats(nodes, 4096)
    assert len(batches) > 1
    assert all(len(raw) <= 4096 for raw in batches)
    read = [
        (h.node_id, h.incarnation)
        for raw in batches
        for h in pb.HostBeatsRequest.FromString(raw).nodes
    ]
    assert read == nodes
    assert (
        b"".join(batches)
        == pb.HostBeatsRequest(
            nodes=[pb.Hello(node_id=n, incarnation=i) for n, i in nodes]
        ).SerializeToString()
    )
    assert stub.host_beats([], 4096) == []
    alone = pb.HostBeatsRequest(nodes=[pb.Hello(node_id="x" * 100, incarnation=1)])
    assert stub.host_beats([("x" * 100, 1)], 10) == [alone.SerializeToString()]


async def test_a_heartbeat_the_scheduler_would_refuse_is_refused_here_and_kept_out() -> None:
    """A local caller's Heartbeat request past what the scheduler takes of one (1 KiB) ends its
    call as the scheduler would end it, and the host's batch goes up without it."""
    channel = _Channel()
    beats = _beats(channel)
    context = _WorkerCall()
    try:
        huge = _beat("x" * 4096, 1)
        assert await beats.local(_requests([_beat("a", 1), huge]), context) is None
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "a Heartbeat request of 4,1" in context.details
        assert dict(context.trailing)[failures.ERROR_KIND_KEY] == CapacityError.__name__  # type: ignore[call-overload]
        await eventually(lambda: bool(channel.calls and channel.calls[0].written), "a batch")
        (raw,) = channel.calls[0].written
        assert [h.node_id for h in pb.HostBeatsRequest.FromString(raw).nodes] == ["a"]
    finally:
        beats.stop()


def _refusal(
    code: grpc.StatusCode, details: str, *trailing: tuple[str, str]
) -> grpc.aio.AioRpcError:
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, empty, grpc.aio.Metadata(*trailing), details, None)


async def test_a_batch_the_scheduler_refuses_is_said_once() -> None:
    refused = _refusal(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "a HostBeats request of 300,000 bytes; the scheduler takes at most 262,144: refused",
        (failures.ERROR_KIND_KEY, CapacityError.__name__),
    )
    channel, said = _Channel(refused), []
    beats = _beats(channel, said)
    try:
        for round_ in range(3):
            await beats.local(_requests([_beat("a", round_)]), _WorkerCall())
            await eventually(lambda n=round_: len(channel.calls) == n + 1, "a batch refused")
        assert len(said) == 1, said
        assert said[0].startswith("the scheduler at sched:1 refused this host's beats")
        assert "RESOURCE_EXHAUSTED" in said[0]
        assert "262,144" in said[0]
    finally:
        beats.stop()


@pytest.mark.parametrize(
    ("refusal", "follows"),
    [
        (_refusal(grpc.StatusCode.UNAVAILABLE, "Socket closed"), "sched:2"),
        (
            _refusal(
                grpc.StatusCode.UNAVAILABLE,
                "not the leader",
                (failures.ERROR_KIND_KEY, "NotLeaderError"),
                (failures.LEADER_KEY, "sched:3"),
            ),
            "sched:3",
        ),
    ],
    ids=["cut-off", "standby"],
)
async def test_a_beats_stream_cut_off_or_at_a_standby_moves_the_relay_and_is_no_refusal(
    refusal: grpc.aio.AioRpcError, follows: str
) -> None:
    """How the beats' call ended moves the relay as a forwarded call's end does: cut off, to
    the next scheduler; refused by a standby, to the leader it names. Neither is a refusal to
    say."""
    channel, said = _Channel(refusal), []
    upstreams = Upstreams(["sched:1", "sched:2", "sched:3"], lambda address: channel)  # type: ignore[arg-type,return-value]
    beats = relay.HostBeats(upstreams, 0.001, said.append)
    try:
        await beats.local(_requests([_beat("a", 1)]), _WorkerCall())
        await eventually(lambda: upstreams.current == follows, f"the relay to follow {follows}")
        assert said == []
    finally:
        beats.stop()


class _SwappedCall(_BeatsCall):
    """A HostBeats call to the scheduler the relay leaves: its first write waits for `cut`,
    then raises `ends` (gRPC's write raises an AioRpcError under a lost connection, and
    CancelledError under its channel closed for a new one; the call, awaited, ends so too),
    or, `ends` None, is taken and never read (a call that ended meanwhile)."""

    def __init__(self, cut: asyncio.Event, ends: BaseException | None) -> None:
        super().__init__(None)
        self.cut, self.ends, self.cancelled = cut, ends, False

    async def write(self, raw: bytes) -> None:
        await self.cut.wait()
        if self.ends is not None:
            raise self.ends
        self.written.append(raw)

    def cancel(self) -> None:
        self.cancelled = True

    async def _answer(self) -> bytes:
        if self.ends is not None:
            raise self.ends
        return b""


class _SwapChannel(_Channel):
    def __init__(self, call: _BeatsCall | None = None) -> None:
        super().__init__()
        self._next = call

    def stream_unary(self, path: str) -> object:
        def start(metadata: object) -> _BeatsCall:
            call, self._next = self._next or _BeatsCall(None), None
            self.calls.append(call)
            return call

        return start


def _named(calls: list[_BeatsCall]) -> list[str]:
    return [
        h.node_id for c in calls for r in c.written for h in pb.HostBeatsRequest.FromString(r).nodes
    ]


@pytest.mark.parametrize(
    "ends",
    [_refusal(grpc.StatusCode.UNAVAILABLE, "Socket closed"), asyncio.CancelledError(), None],
    ids=["write-fails", "channel-closed", "taken-unread"],
)
async def test_a_batch_lost_as_the_relay_moves_is_superseded_by_the_next_at_the_new_scheduler(
    ends: BaseException | None,
) -> None:
    """The batch on its way when the relay moves to another scheduler is lost (each beat goes
    up once, never again); it costs each of its workers one beat, not more. The beats heard
    while it was on its way go up next, to the scheduler the relay follows now, on a call of
    its own, with no other beat needed to carry them; the workers' next beats follow on it.
    One lost beat in MS_NODE_TIMEOUT is never a death (`config.silence_limit`: at least
    MIN_HEARTBEATS_PER_TIMEOUT intervals), so the loss fails nobody. A write cancelled under
    the relay's beats (its channel closed for a new one) stops none of that."""
    cut = asyncio.Event()
    left = _SwappedCall(cut, ends)
    channels = {"a:1": _SwapChannel(left), "b:1": _SwapChannel()}
    upstreams = Upstreams(["a:1", "b:1"], channels.__getitem__)  # type: ignore[arg-type]
    beats = relay.HostBeats(upstreams, 0.001)
    try:
        await beats.local(_requests([_beat("w", 1)]), _WorkerCall())
        await eventually(lambda: bool(left in channels["a:1"].calls), "w's batch on its way")
        await beats.local(_requests([_beat("v", 1)]), _WorkerCall())  # heard meanwhile
        upstreams.answered("a:1", grpc.StatusCode.UNAVAILABLE, ())  # its link was cut: it moves
        assert upstreams.current == "b:1"
        cut.set()
        moved = channels["b:1"].calls
        await eventually(lambda: _named(moved) == ["v"], "v's beat at the new scheduler")
        await beats.local(_requests([_beat("w", 1)]), _WorkerCall())
        await eventually(lambda: _named(moved) == ["v", "w"], "w's next beat there")
        assert len(moved) == 1  # one stream there
        lost = [] if ends is not None else ["w"]  # lost either way: never read, or not written
        assert _named(channels["a:1"].calls) == lost
        assert left.cancelled
    finally:
        beats.stop()
