"""Recovery benchmark: how fast a job gets back to normal after a scheduler or worker restart.

Part 1, scheduler restart. A job with recovery on forms (N workers); the scheduler process is
SIGKILLed and started again at once with the same environment. Measured: from the moment the new
scheduler process is spawned to the moment its Status shows all N workers alive and connected
again with their ranks ("restart to all back", which includes the Python start-up and imports of
the new process), and the scheduler's own figure from the moment it restored its state (its log
line "every node is back after the scheduler's restart (X s after start)"). Workers are either
real processes (`--real 8`: examples/allgather_check.py --hold, one process each) or simulated
(`--simulated 256`: `cluster.worker.agent.WorkerAgent`s, one gRPC connection each, spread over
`--procs` client processes). Target: under 1 s for both.

Part 2, the guard. A real job of `--guard-workers` workers with MS_NODE_TIMEOUT=T; one worker is
SIGKILLed and started again at once; it is refused until the guard ends (T after the scheduler
last heard from it) and then rejoins. Measured: from the end of the guard (the last heartbeat,
as Status reports it, plus T) to the new generation visible in Status. Target: under 0.5 s.

Part 3, rollback (`--rollback-steps N`, 0 to skip). examples/train_mlp.py on 4 real workers with
recovery on; worker 2 is SIGKILLed at a step and started again at once. Measured: the time lost
to the failure, from the kill to worker 0 training past the newest step any worker had reached at
the kill, less the guard (which only waits out MS_NODE_TIMEOUT): the detection, the rejoin, the
rollback and the steps computed again. Target: under 2 s.

For comparison (figures from the issue, measured on this machine): MindSpore 2.10 takes 29.5 s to
re-form its cluster after a scheduler restart, and has no guard (a restarted worker is accepted at
once, then the job crashes 30 s later).

Part 4, failover (`--etcd etcd://HOST:PORT/PREFIX`, skipped without): two schedulers on
127.0.0.1 and 127.0.0.2 on the etcd store (`--lease`, 2 s by default), the workers (real and
simulated, as in part 1) given both (MS_SCHED_HOST=127.0.0.1,127.0.0.2). The leader is
SIGKILLed. Measured: from the kill to the standby leading with every worker back. Target: under
3 s with a 2 s lease. With `--partition` (root, iproute2; etcd listening on every address of this
host, not only loopback), also the leader partitioned: the leader runs in a network namespace
(`cluster.testing.NetworkLab`) and reaches etcd through this host's address on its veth link;
once it leads with every worker, that link is cut (etcd and the workers alike). Measured: from
the cut to the standby (127.0.0.1) leading with every worker back: the old leader's lease must
end in etcd, and the workers must notice that their scheduler went silent, which they do after
MS_NODE_TIMEOUT (`--node-timeout`, 3 s here) without a word from it.

Part 5, a relay's return (`--relay-outage S`, 0 to skip). `--relay-workers` real workers behind
a host's relay (`mscluster relay`), recovery on; the relay is told the job has `--relay-nodes`
nodes (MS_WORKER_NUM of its own process), which is what sizes its channel's pause between
connection attempts, so that 2 workers show what a host of a 65,536-node job sees. The scheduler
is SIGKILLed and started again S seconds later. Measured: from the spawn of the new scheduler,
and from its restored state, to every worker back, and the relay's CPU over the outages. A relay
that waited out gRPC's pause came back up to that pause after the scheduler (16 s after a 30 s
outage, at 40,000 nodes); one that waits for the port tries it as often as its workers would
(every N / (10,000 x workers) seconds), and is back within that.

Usage: python benchmarks/recovery.py [--real 8] [--simulated 256] [--procs 4] [--repeat 3]
       [--guard-workers 4] [--node-timeout 3] [--etcd URL [--lease 2] [--partition]]
       [--relay-outage 30 [--relay-nodes 65536] [--relay-workers 2]] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rendezvous import cpu_seconds

from cluster.testing import NetworkLab, StatusClient, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "allgather_check.py"
TRAIN = ROOT / "examples" / "train_mlp.py"
STEP_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss", re.MULTILINE)
STEPS_PER_EPOCH = 16  # train_mlp.py: 1024 samples, global batch 64
HOST = "127.0.0.1"
POLL_S = 0.005
BASE_DATA_PORT = 40000


class Job:
    """The processes of one benchmark job; all are killed when it ends."""

    def __init__(self, workdir: Path, n: int, node_timeout_s: float) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))},
            "MS_WORKER_NUM": str(n),
            "MS_SCHED_HOST": HOST,
            "MS_SCHED_PORT": str(self.port),
            "MS_ENABLE_RECOVERY": "1",
            "MS_RECOVERY_PATH": str(workdir / "recovery"),
            "MS_NODE_TIMEOUT": f"{node_timeout_s:g}",
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.scheduler = self.start_scheduler()

    def spawn(self, args: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        with (self.workdir / log).open("ab") as out:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def start_scheduler(self) -> subprocess.Popen[bytes]:
        return self.spawn(
            [sys.executable, "-m", "cluster", "scheduler"],
            {**self.env, "MS_ROLE": "MS_SCHED"},
            "scheduler.log",
        )

    def start_worker(self, i: int, hold_s: float, **extra: str) -> subprocess.Popen[bytes]:
        return self.spawn(
            [sys.executable, str(EXAMPLE), "--hold", str(hold_s)],
            {**self.env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(i), **extra},
            f"worker_{i}.log",
        )

    def start_trainer(self, i: int, args: list[str]) -> subprocess.Popen[bytes]:
        return self.spawn(
            [sys.executable, str(TRAIN), *args],
            {**self.env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(i)},
            f"worker_{i}.log",
        )

    def start_clients(self, ids: list[int], index: int) -> subprocess.Popen[bytes]:
        return self.spawn(
            [sys.executable, __file__, "--clients", ",".join(map(str, ids))],
            self.env,
            f"clients_{index}.log",
        )

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def job(n: int, node_timeout_s: float) -> Iterator[Job]:
    with tempfile.TemporaryDirectory(prefix="cluster-recovery-bench-") as tmp:
        running = Job(Path(tmp), n, node_timeout_s)
        try:
            yield running
        finally:
            running.kill()


class StatusPoller:
    """Status of the scheduler at host:port, polled from this process over one channel."""

    def __init__(self, port: int, host: str = HOST) -> None:
        self.address = f"{host}:{port}"
        # The instrument must not lag: reconnect every 20 ms while the scheduler is down.
        self.client = StatusClient(self.address, reconnect_ms=20)

    def fetch(self) -> Any:
        return self.client.fetch()

    def wait(self, predicate: Any, timeout_s: float, what: str) -> tuple[float, Any]:
        seen: list[tuple[float, Any]] = []

        def check() -> bool:
            view = self.client.fetch()
            if view is not None and predicate(view):
                seen.append((time.monotonic(), view))
            return bool(seen)

        wait_until(check, timeout_s, what, poll_s=POLL_S)
        return seen[0]

    def close(self) -> None:
        self.client.close()


def all_back(n: int) -> Any:
    def check(view: Any) -> bool:
        ranks = sorted(
            node.rank
            for node in view.nodes
            if node.state == "alive" and node.connected and node.rank is not None
        )
        return view.phase.value == "ready" and ranks == list(range(n))

    return check


def scheduler_own_figure(log: Path) -> float | None:
    found = re.findall(
        r"every node is back after the scheduler's restart \((\d+\.\d+) s", log.read_text()
    )
    return float(found[-1]) if found else None


def gathered(workdir: Path, n: int) -> Callable[[], bool]:
    """Whether the n workers of examples/allgather_check.py printed their gather: a kill before
    that cuts the gather, and the script (which does not roll back) ends with PeerFailedError."""

    def check() -> bool:
        logs = [workdir / f"worker_{i}.log" for i in range(n)]
        return all(log.exists() and "allgather rank=" in log.read_text() for log in logs)

    return check


def restarts(
    running: Job, poller: StatusPoller, n: int, repeat: int, down_s: float = 0.0
) -> dict[str, Any]:
    """`repeat` times: the scheduler SIGKILLed and started again `down_s` later, timed from its
    spawn (and by its own figure, from its restored state) to all `n` workers back."""
    totals, own = [], []
    for _ in range(repeat):
        running.scheduler.send_signal(signal.SIGKILL)
        running.scheduler.wait(10)
        time.sleep(down_s)  # the outage
        spawned = time.monotonic()
        running.scheduler = running.start_scheduler()
        back, _ = poller.wait(all_back(n), 60 + 3 * down_s, f"{n} workers back")
        totals.append(back - spawned)
        own.append(scheduler_own_figure(running.workdir / "scheduler.log"))
    return {"restart_to_all_back_s": totals, "scheduler_restore_to_all_back_s": own}


def bench_scheduler_restart(n: int, real: bool, procs: int, repeat: int) -> dict[str, Any]:
    with job(n, node_timeout_s=30) as running:
        if real:
            for i in range(n):
                running.start_worker(i, hold_s=600)
        else:
            ids = list(range(n))
            for k in range(procs):
                running.start_clients(ids[k::procs], k)
        poller = StatusPoller(running.port)
        try:
            poller.wait(all_back(n), 120, f"{n} workers to form the job")
            if real:
                wait_until(gathered(running.workdir, n), 60, f"{n} workers' gathers")
            timed = restarts(running, poller, n, repeat)
        finally:
            poller.close()
    kind = "real processes" if real else f"simulated in {procs} processes"
    return {"workers": n, "kind": kind, **timed}


def bench_relay_outage(outage_s: float, nodes: int, workers: int, repeat: int) -> dict[str, Any]:
    with job(workers, node_timeout_s=600) as running:
        sock = running.workdir / "relay.sock"
        relay_env = {**running.env, "MS_WORKER_NUM": str(nodes)}
        command = [sys.executable, "-m", "cluster", "relay", "--socket", f"unix:{sock}"]
        relay = running.spawn(command, relay_env, "relay.log")
        log = running.workdir / "relay.log"
        wait_until(lambda: "serving" in log.read_text(), 30, "the relay serving")
        for i in range(workers):
            running.start_worker(i, hold_s=3600, CLUSTER_RELAY=f"unix:{sock}")
        poller = StatusPoller(running.port)
        try:
            poller.wait(all_back(workers), 60, f"{workers} workers to form the job")
            wait_until(gathered(running.workdir, workers), 60, f"{workers} workers' gathers")
            cpu_before = cpu_seconds(relay.pid) or 0.0
            timed = restarts(running, poller, workers, repeat, down_s=outage_s)
            relay_cpu_s = (cpu_seconds(relay.pid) or 0.0) - cpu_before
        finally:
            poller.close()
    kind = f"behind a relay of a {nodes}-node job, after {outage_s:g} s down"
    # What the relay spent while its scheduler was down (and on the workers' return).
    return {"workers": workers, "kind": kind, "relay_cpu_s": relay_cpu_s, **timed}


FAILOVER_HOSTS = ("127.0.0.1", "127.0.0.2")


class FailoverJob(Job):
    """Two schedulers on etcd (one leads, one stands by) for workers that know both. With a
    `lab`, the first runs in the lab's namespace 0 (at its address, reaching etcd through this
    host's end of the link) and only it is started: `start_at` starts the standby."""

    def __init__(
        self,
        workdir: Path,
        n: int,
        url: str,
        lease_s: int,
        lab: NetworkLab | None = None,
        node_timeout_s: float = 30,
    ) -> None:
        self.url, self.lease_s, self.lab = url, lease_s, lab
        self.hosts = FAILOVER_HOSTS if lab is None else (lab.worker_ip(0), HOST)
        self.schedulers: dict[str, subprocess.Popen[bytes]] = {}
        super().__init__(workdir, n, node_timeout_s=node_timeout_s)
        self.env["MS_SCHED_HOST"] = ",".join(self.hosts)

    def start_scheduler(self) -> subprocess.Popen[bytes]:
        for host in self.hosts[: 1 if self.lab else None]:
            self.schedulers[host] = self.start_at(host)
        return self.schedulers[self.hosts[0]]

    def start_at(self, host: str) -> subprocess.Popen[bytes]:
        env = {
            k: v for k, v in self.env.items() if k not in ("MS_RECOVERY_PATH", "MS_ENABLE_RECOVERY")
        }
        env["MS_SCHED_HOST"] = host
        url, wrap = self.url, list
        if self.lab is not None and host == self.hosts[0]:
            gateway = self.lab.worker_ip(0).rsplit(".", 1)[0] + ".1"  # this host, seen from ns 0
            url = self.url.replace("127.0.0.1", gateway)
            wrap = lambda args: self.lab.command(0, args)  # type: ignore[union-attr] # noqa: E731
        args = ["--host", host, "--port", str(self.port), "--state-url", url]
        return self.spawn(
            wrap(
                [sys.executable, "-m", "cluster", "scheduler", *args, "--lease", str(self.lease_s)]
            ),
            {**env, "MS_ROLE": "MS_SCHED"},
            f"scheduler-{host}.log",
        )


def leads_with_all_back(n: int, address: str) -> Any:
    back = all_back(n)
    return lambda view: (
        view.leadership is not None and view.leadership.leader == address and back(view)
    )


def wait_leader(pollers: dict[str, StatusPoller], n: int) -> str:
    """The host whose scheduler leads with all `n` workers (a standby's Status says nothing)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for host, poller in pollers.items():
            view = poller.fetch()
            if view is not None and leads_with_all_back(n, poller.address)(view):
                return host
        time.sleep(POLL_S)  # a poll of an observable, bounded by the deadline
    raise RuntimeError(f"timed out after 120 s waiting for a leader with {n} workers")


@dataclass(frozen=True)
class Standbys:
    """Where the schedulers keep the job (an etcd URL) and their lease."""

    url: str
    lease_s: int


def bench_failover(
    n: int,
    real: bool,
    procs: int,
    repeat: int,
    standbys: Standbys,
    *,
    cut: bool = False,
    node_timeout_s: float = 30,
) -> dict[str, Any]:
    """Leader SIGKILL (or, with `cut`, its link cut: the workers hear nothing for
    `node_timeout_s` before they look elsewhere) -> every worker back on the standby, which
    leads; a fresh job each round."""
    url, lease_s = standbys.url, standbys.lease_s
    # A prefix of its own for every job: a job on another's prefix would resume that job (of
    # another size), which the schedulers refuse; the 256-worker rounds once used the 8-worker
    # rounds' prefixes and never formed.
    kind = f"{n}{'r' if real else 's'}-{'cut' if cut else 'kill'}"
    prefix = f"{url.rstrip('/')}/bench-{os.getpid()}-{kind}"
    totals = [
        partition_once(n, real, procs, f"{prefix}-{r}", lease_s, node_timeout_s)
        if cut
        else failover_once(n, real, procs, f"{prefix}-{r}", lease_s)
        for r in range(repeat)
    ]
    return {
        "workers": n,
        "kind": "real processes" if real else f"simulated in {procs} processes",
        "lease_s": lease_s,
        "fault": "leader partitioned" if cut else "leader SIGKILL",
        **({"node_timeout_s": node_timeout_s} if cut else {}),
        "leader_kill_to_all_back_s": totals,
    }


def start_workers(running: Job, n: int, real: bool, procs: int) -> None:
    if real:
        for i in range(n):
            running.start_worker(i, hold_s=600)
    else:
        for k in range(procs):
            running.start_clients(list(range(n))[k::procs], k)


def partition_once(
    n: int, real: bool, procs: int, url: str, lease_s: int, node_timeout_s: float
) -> float:
    """The leader in a namespace leads every worker; its link is cut; the seconds until the
    standby leads with every worker back."""
    lab = NetworkLab(1)
    lab.setup()
    try:
        with tempfile.TemporaryDirectory(prefix="cluster-partition-bench-") as tmp:
            running = FailoverJob(Path(tmp), n, url, lease_s, lab, node_timeout_s)
            leader, standby = running.hosts
            pollers = {host: StatusPoller(running.port, host) for host in running.hosts}
            try:
                pollers[leader].wait(lambda view: True, 60, "the namespaced scheduler to lead")
                running.schedulers[standby] = running.start_at(standby)
                start_workers(running, n, real, procs)
                pollers[leader].wait(leads_with_all_back(n, pollers[leader].address), 120, "form")
                lab.cut(0)
                cut = time.monotonic()
                target = pollers[standby].address
                back, _ = pollers[standby].wait(leads_with_all_back(n, target), 120, "failover")
                return back - cut
            finally:
                for poller in pollers.values():
                    poller.close()
                running.kill()
    finally:
        lab.teardown()


def failover_once(n: int, real: bool, procs: int, url: str, lease_s: int) -> float:
    with tempfile.TemporaryDirectory(prefix="cluster-failover-bench-") as tmp:
        running = FailoverJob(Path(tmp), n, url, lease_s)
        pollers = {host: StatusPoller(running.port, host) for host in FAILOVER_HOSTS}
        try:
            start_workers(running, n, real, procs)
            leader = wait_leader(pollers, n)
            standby = next(h for h in FAILOVER_HOSTS if h != leader)
            running.schedulers[leader].send_signal(signal.SIGKILL)
            running.schedulers[leader].wait(10)
            killed = time.monotonic()
            target = pollers[standby].address
            back, _ = pollers[standby].wait(leads_with_all_back(n, target), 60, "failover")
            return back - killed
        finally:
            for poller in pollers.values():
                poller.close()
            running.kill()


def bench_guard(n: int, node_timeout_s: float, repeat: int) -> dict[str, Any]:
    gaps: list[float] = []
    with job(n, node_timeout_s) as running:
        workers = [running.start_worker(i, hold_s=600) for i in range(n)]
        poller = StatusPoller(running.port)
        try:
            poller.wait(all_back(n), 60, f"{n} workers to form the job")
            wait_until(gathered(running.workdir, n), 60, "the workers to gather", poll_s=POLL_S)
            for round_ in range(repeat):
                generation = round_ + 1
                workers[1].send_signal(signal.SIGKILL)
                workers[1].wait(10)
                workers[1] = running.start_worker(1, hold_s=600)
                seen, view = poller.wait(
                    lambda v: any(x.node_id == "1" and x.state == "failed" for x in v.nodes),
                    30,
                    "the node marked failed",
                )
                silent = next(x for x in view.nodes if x.node_id == "1").seconds_since_heartbeat
                guard_end = seen - silent + node_timeout_s
                published, _ = poller.wait(
                    lambda v, g=generation: v.generation > g,
                    node_timeout_s + 30,
                    "a new generation",
                )
                gaps.append(published - guard_end)
                poller.wait(all_back(n), 30, "everyone back")
        finally:
            poller.close()
    return {"workers": n, "node_timeout_s": node_timeout_s, "guard_end_to_generation_s": gaps}


def steps_printed(log: Path) -> list[int]:
    """The global step numbers (1-based) a train_mlp.py worker has printed, in order."""
    text = log.read_text() if log.exists() else ""
    return [(int(e) - 1) * STEPS_PER_EPOCH + int(s) for e, s in STEP_LINE.findall(text)]


def printed_up_to(log: Path, step: int) -> Callable[[], bool]:
    """Whether the worker logging to `log` printed `step` steps."""
    return lambda: len(steps_printed(log)) >= step


def printed_past(log: Path, step: int, skip: int) -> Callable[[], bool]:
    """Whether a step after `step` is among the steps `log` printed after its first `skip`."""
    return lambda: any(s > step for s in steps_printed(log)[skip:])


def bench_rollback(steps: int, node_timeout_s: float, repeat: int) -> dict[str, Any]:
    lost: list[float] = []
    redone: list[int] = []
    for _ in range(repeat):
        with job(4, node_timeout_s) as running:
            args = ["--steps", str(steps), "--save-every", "10", "--step-delay", "0.02"]
            args += ["--out", str(running.workdir / "out")]
            workers = [running.start_trainer(i, args) for i in range(4)]
            poller = StatusPoller(running.port)
            try:
                logs = [running.workdir / f"worker_{i}.log" for i in range(4)]
                kill_at = steps // 2
                wait_until(
                    printed_up_to(logs[2], kill_at),
                    60,
                    "the job to reach the step to kill at",
                    poll_s=POLL_S,
                )
                workers[2].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                reached = max(max(steps_printed(log), default=0) for log in logs)
                workers[2].wait(10)
                workers[2] = running.start_trainer(2, args)
                seen, view = poller.wait(
                    lambda v: any(x.node_id == "2" and x.state == "failed" for x in v.nodes),
                    30,
                    "the node marked failed",
                )
                silent = next(x for x in view.nodes if x.node_id == "2").seconds_since_heartbeat
                guard_s = seen - silent + node_timeout_s - killed
                printed_before = len(steps_printed(logs[0]))
                wait_until(
                    printed_past(logs[0], reached, printed_before),
                    60,
                    "training to get past the step of the kill",
                    poll_s=POLL_S,
                )
                lost.append(time.monotonic() - killed - guard_s)
                after = steps_printed(logs[0])[printed_before:]
                redone.append(reached - min(after) + 1 if after else 0)
                for worker in workers:
                    if worker.wait(120) != 0:
                        raise RuntimeError("a worker of the rollback run failed")
            finally:
                poller.close()
    return {"workers": 4, "time_lost_s": lost, "steps_redone": redone}


# -- simulated workers (a child process) ---------------------------------------------------------


def clients_main(ids: list[int]) -> None:
    async def run() -> None:
        from cluster.protocol import environment as cluster_config  # noqa: PLC0415
        from cluster.transport.channel import SchedulerProbe  # noqa: PLC0415
        from cluster.worker.agent import WorkerAgent  # noqa: PLC0415
        from cluster.worker.identity import NodeIdentity, new_incarnation  # noqa: PLC0415

        fatal: list[Exception] = []
        failed = asyncio.Event()

        def on_fatal(error: Exception) -> None:
            fatal.append(error)
            failed.set()

        agents = []
        probe = SchedulerProbe()  # the simulated workers share their checks of the scheduler
        for i in ids:
            config = cluster_config.from_env(
                {**os.environ, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(i)}
            )
            identity = NodeIdentity(str(i), new_incarnation(), HOST, BASE_DATA_PORT + i)
            agents.append(
                WorkerAgent(config, identity, say=lambda _m: None, on_fatal=on_fatal, probe=probe)
            )
        await asyncio.gather(*(agent.start() for agent in agents))
        print(f"ready: {len(agents)} agents", flush=True)
        await failed.wait()  # the agents work in the background until the benchmark kills us
        raise SystemExit(f"an agent failed: {fatal[0]}")

    asyncio.run(run())


def median(values: list[float | None]) -> str:
    real = [v for v in values if v is not None]
    return f"{statistics.median(real) * 1000:.0f} ms" if real else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", type=int, default=8, help="real worker processes (0: skip)")
    parser.add_argument("--simulated", type=int, default=256, help="simulated workers (0: skip)")
    parser.add_argument("--procs", type=int, default=4, help="client processes for simulated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--guard-workers", type=int, default=4, help="0: skip the guard part")
    parser.add_argument("--node-timeout", type=float, default=3.0, help="the guard, in seconds")
    parser.add_argument("--rollback-steps", type=int, default=100, help="0: skip part 3")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--etcd", help="etcd://HOST:PORT[,...]/PREFIX: also the failover to a standby (part 4)"
    )
    parser.add_argument("--lease", type=int, default=2, help="the leader's lease for --etcd")
    parser.add_argument(
        "--partition",
        action="store_true",
        help="with --etcd (root; etcd on every address): also the leader's link cut",
    )
    parser.add_argument("--relay-outage", type=float, default=0.0, help="part 5 (0: skip)")
    parser.add_argument("--relay-nodes", type=int, default=65536, help="the job, to the relay")
    parser.add_argument("--relay-workers", type=int, default=2, help="real, behind the relay")
    parser.add_argument("--clients", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clients:
        clients_main([int(i) for i in args.clients.split(",")])
        return 0
    results: list[dict[str, Any]] = []
    print("scheduler SIGKILL + restart -> all workers back (median of", args.repeat, "runs)")
    print(f"{'workers':>8}  {'kind':<28}  {'from spawn':>10}  {'from restore':>12}")
    for n, real in ((args.real, True), (args.simulated, False)):
        if n <= 0:
            continue
        result = bench_scheduler_restart(n, real, args.procs, args.repeat)
        results.append(result)
        print(
            f"{n:>8}  {result['kind']:<28}  {median(result['restart_to_all_back_s']):>10}  "
            f"{median(result['scheduler_restore_to_all_back_s']):>12}"
        )
    if args.etcd:
        for cut in (False, True) if args.partition else (False,):
            fault = f"partitioned (MS_NODE_TIMEOUT={args.node_timeout:g})" if cut else "SIGKILL"
            print(f"leader {fault} -> all workers back on the standby (etcd, {args.lease} s lease)")
            for n, real in ((args.real, True), (args.simulated, False)):
                if n <= 0:
                    continue
                result = bench_failover(
                    n,
                    real,
                    args.procs,
                    args.repeat,
                    Standbys(args.etcd, args.lease),
                    cut=cut,
                    node_timeout_s=args.node_timeout,
                )
                results.append(result)
                figures = result["leader_kill_to_all_back_s"]
                print(
                    f"{n:>8}  {result['kind']:<28}  median {median(figures)}, "
                    f"max {max(figures) * 1000:.0f} ms"
                )
    if args.guard_workers > 0:
        result = bench_guard(args.guard_workers, args.node_timeout, args.repeat)
        results.append(result)
        gaps = result["guard_end_to_generation_s"]
        print(
            f"guard end -> new generation ({args.guard_workers} real workers, MS_NODE_TIMEOUT="
            f"{args.node_timeout:g}): median {median(gaps)}, max {max(gaps) * 1000:.0f} ms"
        )
    if args.rollback_steps > 0:
        result = bench_rollback(args.rollback_steps, args.node_timeout, args.repeat)
        results.append(result)
        lost = result["time_lost_s"]
        print(
            f"time lost to one worker SIGKILL, guard excluded (train_mlp.py, 4 workers, "
            f"checkpoint every 10 steps, 20 ms steps): median {median(lost)}, max "
            f"{max(lost) * 1000:.0f} ms; steps computed again: {result['steps_redone']}"
        )
    if args.relay_outage > 0:
        result = bench_relay_outage(
            args.relay_outage, args.relay_nodes, args.relay_workers, args.repeat
        )
        results.append(result)
        print(
            f"scheduler SIGKILL, {args.relay_outage:g} s down, restart -> all "
            f"{args.relay_workers} workers back {result['kind']}: from spawn "
            f"{median(result['restart_to_all_back_s'])}, from restore "
            f"{median(result['scheduler_restore_to_all_back_s'])}; the relay's CPU "
            f"{result['relay_cpu_s']:.2f} s over {args.repeat} outages"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
