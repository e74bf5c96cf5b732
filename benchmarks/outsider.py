"""Outsider benchmark: what a stranger on the network can make a job's rendezvous server keep.

The attack of issue 24, against each system's server in the same run:

- `cluster`: a real `mscluster scheduler` (an open job, and one with a job secret), its event log
  on disk. The outsider opens `--followers` WatchEvents(follow=True) streams that never read,
  then sends `--count` registrations whose node id is `--mb` MiB of terminal escapes, and as
  many whose host is; then `--burst` registrations of `--burst-mib` MiB at once over 8
  connections (Register is anyone's to call).
- `tcpstore`: torch's TCPStore server (`torch.distributed.TCPStore(is_master=True)`, as torchrun's
  c10d rendezvous uses it), in a process of its own. The outsider, a TCPStore client, opens
  `--followers` connections waiting on a key nobody sets, then sets 2 x `--count` keys of `--mb`
  MiB (a TCPStore has no notion of members: every client may write; it drops a connection that
  sends a value over 8 MiB, so the values stop 1 KiB short of that), then `--burst` sets at
  once, one client each (values 1 KiB short of 8 MiB).

Measured: the server's resident memory (VmRSS) before and after, its peak's growth (VmHWM), and
how much its files grew (cluster: events.jsonl and its output). Printed as a table.

`--flood`: a member runs away instead (issue 25's runaway, with its own valid credential).
- `cluster`: a recovered job of two workers of tests/integration/scripts/member_flood.py whose
  rank 0 makes `--sets` key-value sets of 2 MiB at once, again and again for `--seconds`, over
  its one channel (`--kv-threads`: threads calling cluster.kv_store()), and then 48 of them
  over `--connections` of its own (48: its share of calls in a job of two, 64, less room for
  its own barriers, which rank 1's need); rank 1 passes barriers meanwhile. The floor: the same
  job with no flood.
  Then `--large-sets` sets of `--large-mib` MiB at once over `--connections` (rank 0's own
  gRPC calls, signed as rank 0: past the 4 MiB cluster.kv_store() sends, up to the 64 MiB a
  message may have; the store refuses each once it has read it). And a well-behaved job's large
  values, timed (`--legit` of member_flood.py): an allgather_object of 16 MiB objects and one
  KvSet of 63 MiB, each the median of 3; with `--legit-rtt MS,...` also with the workers behind
  a proxy that delays each way by half the round trip (`tests.proxy.Proxy`: what the
  scheduler's stream window costs a member across hosts).
- `tcpstore`: `--sets` TCPStore clients each set one of two keys to 2 MiB again and again.
Measured: the server's peak resident memory (VmHWM) at its start and once the flood is over,
and the sets answered and refused.

Usage: python benchmarks/outsider.py [--followers 50] [--count 8] [--mb 8]
       [--systems cluster,cluster-secret,tcpstore]
       python benchmarks/outsider.py --flood [--sets 128] [--connections 8] [--seconds 4]
       [--large-sets 48] [--large-mib 32] [--legit-rtt 1,10] [--systems cluster,tcpstore]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.proxy import Proxy

HOST = "127.0.0.1"
CALL_S = 10.0
HOSTILE = "\x1b[2J\x1b]0;owned\x07\n2026-11-26 rank 0 finished\u202e"
TCPSTORE_MAX_VALUE = 8 * 1024 * 1024
MIB = 1024 * 1024
SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "integration" / "scripts"
FLOOD_SCRIPT = SCRIPTS / "member_flood.py"
FLOOD_VALUE = 2 * MIB  # member_flood.py's values
CONNECTION_SETS = 48
TCPSTORE = """
import sys, time, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=600))
print("listening", flush=True)
time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory (`field`: VmRSS now, VmHWM its peak so far), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def wait_for(proc: subprocess.Popen[str], text: str, limit_s: float = 60.0) -> None:
    """Read the server's output until `text` (bounded by `limit_s`)."""
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if text in line:
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(limit_s) or proc.poll() is not None:
        raise RuntimeError(f"the server did not say {text!r} within {limit_s:g} s")


@contextlib.contextmanager
def server(argv: list[str], env: dict[str, str], ready: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(proc, ready)
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


def attack_cluster(port: int, args: argparse.Namespace) -> None:
    big = HOSTILE * (args.mb * 1024 * 1024 // len(HOSTILE))
    options = [("grpc.max_send_message_length", 256 << 20)]
    with grpc.insecure_channel(f"{HOST}:{port}", options) as channel:
        grpc.channel_ready_future(channel).result(timeout=CALL_S)
        stub = pb_grpc.SchedulerStub(channel)
        followers = [
            stub.WatchEvents(pb.WatchEventsRequest(follow=True), timeout=120)
            for _ in range(args.followers)
        ]
        for i in range(args.count):
            for node_id, host in ((big, "h"), (f"n{i}", big)):
                register = pb.RegisterRequest(
                    node_id=node_id, role=pb.ROLE_WORKER, host=host, port=1, worker_num=2
                )
                with contextlib.suppress(grpc.RpcError):
                    next(iter(stub.Watch(pb.WatchRequest(register=register), timeout=CALL_S)))
        burst_cluster(port, args.burst, args.burst_mib)
        time.sleep(1.0)  # a benchmark, not a test: let the server settle before measuring
        for follower in followers:
            follower.cancel()


def burst_cluster(port: int, count: int, mib: int) -> None:
    """`count` registrations of `mib` MiB at once over 8 connections, each refused."""
    body = pb.RegisterRequest(node_id="n", host="h" * (mib << 20), port=1).SerializeToString()
    options = [("grpc.max_send_message_length", 256 << 20), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(f"{HOST}:{port}", options) for _ in range(8)]
    try:
        register = [c.unary_unary("/cluster.v1.Scheduler/Register") for c in channels]
        calls = [register[i % 8].future(body, timeout=120) for i in range(count)]
        for call in calls:
            call.exception()  # each refused (or answered): waited for
    finally:
        for channel in channels:
            channel.close()


def scheduler_env(port: int) -> dict[str, str]:
    """The environment of a scheduler of a job of two on `port`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    return env | {
        "MS_ROLE": "MS_SCHED",
        "MS_WORKER_NUM": "2",
        "MS_SCHED_HOST": HOST,
        "MS_SCHED_PORT": str(port),
    }


# RSS before and after, the peak's growth, and the files' growth, in MiB.
Grown = tuple[float, float, float, float]


def run_cluster(args: argparse.Namespace, tmp: Path, secret: bool) -> Grown:
    port, events = free_port(), tmp / f"events-{secret}.jsonl"
    env = scheduler_env(port) | {"CLUSTER_EVENT_LOG": str(events)}
    if secret:
        path = tmp / "job.secret"
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
        env["CLUSTER_JOB_SECRET_FILE"] = str(path)
    argv = [sys.executable, "-m", "cluster", "scheduler"]
    with server(argv, env, "listening on") as proc:
        before, files_before = rss_mib(proc.pid), events.stat().st_size
        peak = rss_mib(proc.pid, "VmHWM")
        attack_cluster(port, args)
        after = rss_mib(proc.pid)
        peak = rss_mib(proc.pid, "VmHWM") - peak
        files = (events.stat().st_size - files_before) / 2**20
    return before, after, peak, files


def run_tcpstore(args: argparse.Namespace) -> Grown:
    # Each waiter's end, when the server goes, is a warning with a C++ stack: not shown.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch.distributed as dist  # noqa: PLC0415 - after the log level; only for this row

    port = free_port()
    argv = [sys.executable, "-c", TCPSTORE, str(port)]
    timeout = datetime.timedelta(seconds=CALL_S)

    def wait_for_nothing() -> None:
        with contextlib.suppress(RuntimeError):  # the server's end (or the wait's timeout)
            dist.TCPStore(HOST, port, is_master=False, timeout=timeout).wait(["never"])

    waiters = [
        threading.Thread(target=wait_for_nothing, daemon=True) for _ in range(args.followers)
    ]
    with server(argv, dict(os.environ), "listening") as proc:
        before, peak = rss_mib(proc.pid), rss_mib(proc.pid, "VmHWM")
        outsider = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        for waiter in waiters:
            waiter.start()
        # TCPStore drops a connection whose value is over 8 MiB: just under its limit.
        value = (HOSTILE * (args.mb * 1024 * 1024 // len(HOSTILE))).encode()
        value = value[: min(len(value), TCPSTORE_MAX_VALUE - 1024)]
        for i in range(args.count):
            outsider.set(f"squatter-{i}", value)
            outsider.set(f"n{i}", value)
        burst = (b"h" * (args.burst_mib << 20))[: TCPSTORE_MAX_VALUE - 1024]

        def set_one(i: int) -> None:
            with contextlib.suppress(RuntimeError):
                dist.TCPStore(HOST, port, is_master=False, timeout=timeout).set(f"b{i}", burst)

        setters = [threading.Thread(target=set_one, args=(i,)) for i in range(args.burst)]
        for setter in setters:
            setter.start()
        for setter in setters:
            setter.join(CALL_S * 6)
        time.sleep(1.0)
        after, peak = rss_mib(proc.pid), rss_mib(proc.pid, "VmHWM") - peak
    # The server is gone: each wait ends with its connection (torch aborts if they outlive us).
    for waiter in waiters:
        waiter.join(CALL_S * 2)
    return before, after, peak, 0.0


# Peak memory at the start and after, how the sets ended, and what rank 0 printed.
Peaks = tuple[float, float, Counter[str], str]


def flood_cluster(
    args: argparse.Namespace, tmp: Path, flood: list[str], round_trip_ms: float = 0.0
) -> Peaks:
    """A recovered job of member_flood.py whose rank 0 floods with the options `flood`: the
    scheduler's peak memory at its start and once rank 0 flooded, and rank 0's codes. With
    `round_trip_ms`, the workers reach the scheduler through a `tests.proxy.Proxy` that delays
    each way by half of it."""
    port = free_port()
    env = scheduler_env(port) | {
        "MS_TOPO_TIMEOUT": "60",
        "MS_ENABLE_RECOVERY": "1",
        "MS_RECOVERY_PATH": str(tmp / f"recovery-{port}"),
        "PYTHONUNBUFFERED": "1",
    }
    go, log = tmp / f"go-{port}", tmp / f"rank0-{port}.log"
    script = [str(FLOOD_SCRIPT), "--seconds", str(args.seconds), *flood, "--go", str(go)]
    text = ""
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(
            server([sys.executable, "-m", "cluster", "scheduler"], env, "listening on")
        )
        reached = port
        if round_trip_ms:
            line = Proxy((HOST, port), delay_s=round_trip_ms / 2000)
            stack.callback(line.close)
            reached = line.port
        start = rss_mib(proc.pid, "VmHWM")
        worker_env = env | {"MS_ROLE": "MS_WORKER", "MS_SCHED_PORT": str(reached)}
        with log.open("w") as out:
            workers = [
                subprocess.Popen(
                    [sys.executable, *script],
                    env=worker_env | {"MS_NODE_ID": str(rank)},
                    stdout=out if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
                for rank in (0, 1)
            ]
        try:
            codes = flood_codes(log, workers[0])
            peak = rss_mib(proc.pid, "VmHWM")
            text = log.read_text()
        finally:
            go.touch()
            for worker in workers:
                try:
                    worker.wait(60)
                except subprocess.TimeoutExpired:
                    worker.kill()
    return start, peak, codes, text


def flood_codes(log: Path, worker: subprocess.Popen[bytes], limit_s: float = 120.0) -> Counter[str]:
    """How rank 0's sets ended ("OK", or the error's kind), once it says so in `log`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = re.search(r"flood codes=(\{.*\})", log.read_text())
        if found:
            return Counter(ast.literal_eval(found.group(1)))
        if worker.poll() is not None:
            break
        time.sleep(0.1)  # a benchmark's poll of a file, bounded by limit_s
    raise RuntimeError(f"rank 0 did not say how its flood went:\n{log.read_text()[-3000:]}")


def flood_tcpstore(args: argparse.Namespace) -> Peaks:
    """`--sets` TCPStore clients setting 2 MiB values for `--seconds`: the server's peak memory
    at its start and after, and how the sets ended."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch.distributed as dist  # noqa: PLC0415 - after the log level; only for this row

    port, value, codes = free_port(), b"v" * FLOOD_VALUE, Counter[str]()
    argv = [sys.executable, "-c", TCPSTORE, str(port)]
    timeout = datetime.timedelta(seconds=CALL_S * 6)
    with server(argv, dict(os.environ), "listening") as proc:
        start = rss_mib(proc.pid, "VmHWM")
        # Connected one by one first: its one thread takes 128 at once slower than they wait.
        stores = [
            dist.TCPStore(HOST, port, is_master=False, timeout=timeout) for _ in range(args.sets)
        ]
        end = time.monotonic() + args.seconds

        def sets(i: int) -> None:
            while time.monotonic() < end:
                try:
                    stores[i].set(f"flood/{i % 2}", value)
                    codes["OK"] += 1
                except RuntimeError as exc:
                    codes[type(exc).__name__] += 1

        threads = [threading.Thread(target=sets, args=(i,)) for i in range(args.sets)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = rss_mib(proc.pid, "VmHWM")
    return start, peak, codes, ""


def run_floods(args: argparse.Namespace) -> None:
    print(f"one member's sets of 2 MiB (or as said) at once for {args.seconds:g} s")
    header = f"{'peak at start':>13} {'peak':>9} {'grown':>9} {'sets':>6} {'refused':>8}"
    print(f"{'system':34} {header}")
    sets, connections = str(args.sets), str(args.connections)
    # (label, rank 0's options, None for TCPStore; the workers' round trip in ms, 0: direct)
    rows: list[tuple[str, list[str] | None, float]] = [
        ("cluster, no flood (the floor)", ["--kv-threads", "0"], 0.0),
        (f"cluster, {sets} over 1 connection", ["--kv-threads", sets], 0.0),
        (
            f"cluster, {CONNECTION_SETS} over {connections} connections",
            ["--kv-threads", str(CONNECTION_SETS), "--connections", connections],
            0.0,
        ),
    ]
    large, large_mib = str(args.large_sets), str(args.large_mib)
    if args.large_sets:
        rows.append(
            (
                f"cluster, {large} of {large_mib} MiB, {connections} conn.",
                ["--kv-threads", large, "--connections", connections, "--value-mib", large_mib],
                0.0,
            )
        )
    legit = ["--kv-threads", "0", "--legit"]
    rows.append(("cluster, no flood, --legit", legit, 0.0))
    away = [float(ms) for ms in args.legit_rtt.split(",") if ms]
    rows += [(f"cluster, --legit, {ms:g} ms away", legit, ms) for ms in away]
    systems = args.systems.split(",")
    if "cluster" not in systems:
        rows = []
    if "tcpstore" in systems:
        rows.append((f"tcpstore, {sets} clients", None, 0.0))
    with tempfile.TemporaryDirectory() as tmp:
        for label, flood, round_trip_ms in rows:
            if flood is None:
                start, peak, codes, text = flood_tcpstore(args)
            else:
                start, peak, codes, text = flood_cluster(args, Path(tmp), flood, round_trip_ms)
            answered, refused = codes["OK"], codes.total() - codes["OK"]
            print(
                f"{label:34} {start:11.1f}MB {peak:7.1f}MB {peak - start:7.1f}MB "
                f"{answered:6} {refused:8}"
            )
            found = re.search(r"legit (.*)", text)
            if found:
                print(f"  {found.group(1)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, default=50)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--burst-mib", type=int, default=32)
    parser.add_argument("--systems", default="cluster,cluster-secret,tcpstore")
    parser.add_argument("--flood", action="store_true", help="a member runs away instead")
    parser.add_argument("--sets", type=int, default=128)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--large-sets", type=int, default=CONNECTION_SETS)
    parser.add_argument("--large-mib", type=int, default=32)
    parser.add_argument("--legit-rtt", default="", help="round trips in ms, e.g. 1,10")
    args = parser.parse_args()
    if args.flood:
        run_floods(args)
        return
    sent = 2 * args.count * args.mb
    print(
        f"{args.followers} idle followers, {2 * args.count} messages of {args.mb} MiB "
        f"({sent} MiB sent), then {args.burst} of {args.burst_mib} MiB at once"
    )
    print(
        f"{'system':16} {'RSS before':>11} {'RSS after':>10} {'grown':>8} {'peak grown':>11} "
        f"{'files grown':>12}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for system in args.systems.split(","):
            if system == "tcpstore":
                before, after, peak, files = run_tcpstore(args)
            else:
                grown = run_cluster(args, Path(tmp), system == "cluster-secret")
                before, after, peak, files = grown
            print(
                f"{system:16} {before:9.1f}MB {after:8.1f}MB {after - before:6.1f}MB "
                f"{peak:9.1f}MB {files:10.2f}MB"
            )


if __name__ == "__main__":
    main()
