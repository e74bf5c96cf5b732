"""Seeing a job: a real `mscluster run --metrics-port` job with recovery on, one worker
SIGKILLed and started again by the launcher, watched by a real Prometheus (its HTTP query API)
scraping the scheduler and the workers (CLUSTER_WORKER_METRICS_PORT), by `mscluster events`
(the scheduler's WatchEvents stream, and the event log file afterwards) and by
`mscluster status --watch` with its output in a file (plain lines)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from cluster.testing import free_port, wait_until
from tests.procs import MSCLUSTER, ROOT, Procs, launched, private_copy, reader_env, run_args
from tests.servers.prometheus import Prometheus, value_is

pytestmark = pytest.mark.slow

# What `mscluster events` must list for this job, in this order (other events between them).
SEQUENCE = ["formed", "failed", "guard_refusal", "rejoined", "generation 2", "finished"]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free right now (workers take base + local rank)."""
    for _ in range(50):
        base = free_port()
        with ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise AssertionError(f"no {count} consecutive free ports")


def in_order(listed: list[str], wanted: list[str]) -> bool:
    """`wanted` is a subsequence of `listed`."""
    rest = iter(listed)
    return all(any(item == want for item in rest) for want in wanted)


def kinds(table: str) -> list[str]:
    """The event column of `mscluster events`' table, with generation numbers."""
    found = []
    for line in table.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 2:
            continue
        kind = parts[1]
        if kind == "generation":
            kind += " " + next(p.split("=")[1] for p in parts if p.startswith("generation="))
        found.append(kind)
    return found


def test_a_killed_worker_is_seen_by_prometheus_by_the_events_and_by_the_watch(
    prometheus: Prometheus, processes: Procs, tmp_path: Path
) -> None:
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    port, metrics_port, workers_base = free_port(), free_port(), free_ports(4)
    logs = tmp_path / "logs"
    args = run_args(
        "--enable-recovery", "--max-restarts", "1", "--node-timeout", "6",
        "--metrics-port", str(metrics_port),
        script, "--steps", "600", "--step-delay", "0.04", "--out", tmp_path / "out",
        worker_num=4, master_port=port, log_dir=logs,
    )  # fmt: skip
    env = {**os.environ, "CLUSTER_WORKER_METRICS_PORT": str(workers_base)}
    run = processes.start("run", args, env)
    target = f"127.0.0.1:{metrics_port}"
    rank0 = f"127.0.0.1:{workers_base}"  # a survivor: worker 0 is rank 0, local rank 0
    prometheus.set_targets([target, *(f"127.0.0.1:{workers_base + i}" for i in range(4))])
    failures = 'cluster_node_failures_total{cause="stream_broken"}'
    # Scraped at 0 before the kill: Prometheus sees the counter rise by one.
    prometheus.wait_for(f'up{{instance="{target}"}}', value_is(1), timeout_s=60)
    prometheus.wait_for("cluster_generation", value_is(1), timeout_s=30)
    prometheus.wait_for(failures, value_is(0), timeout_s=30)
    address, operator = f"127.0.0.1:{port}", reader_env(logs / "job.secret")
    followed = processes.start(
        "events-follow", [*MSCLUSTER, "events", "--addr", address, "--follow"], operator
    )
    watched = processes.start(
        "watch", [*MSCLUSTER, "status", "--watch", "--addr", address, "--interval", "0.5"],
        operator,
    )  # fmt: skip
    watched.wait_for_output("rank  node id", 30)  # the first table: it is watching
    wait_until(lambda: "formed" in followed.output, 30, "the followed events up to formed")

    # MS_NODE_TIMEOUT=6 s: the launcher's new worker 2 registers well within it, and the
    # re-registration guard refuses it until the 6 s are over.
    os.kill(launched(logs, "worker_2"), signal.SIGKILL)

    prometheus.wait_for(failures, value_is(1), timeout_s=30)
    prometheus.wait_for("cluster_generation", value_is(2), timeout_s=30)
    prometheus.wait_for('cluster_nodes{role="worker",state="alive"}', value_is(4), timeout_s=30)
    prometheus.wait_for("sum(cluster_node_failures_total)", value_is(1), timeout_s=10)
    prometheus.wait_for("cluster_rejoins_total", value_is(1), timeout_s=10)
    guard = prometheus.query("cluster_guard_refusals_total")
    assert guard[0].value >= 1, guard
    # The workers' own metrics: rank 0 rolled back once, and it trains, saves and reduces.
    prometheus.wait_for(
        f'cluster_worker_rollbacks_total{{instance="{rank0}"}}', value_is(1), timeout_s=30
    )
    for name, labels in (
        ("cluster_worker_steps_total", ""),
        ("cluster_worker_step_seconds_count", ""),
        ("cluster_worker_collective_seconds_count", 'op="allreduce", '),
        ("cluster_worker_checkpoint_pause_seconds_count", ""),
        ("cluster_worker_checkpoint_persist_seconds_count", ""),
    ):
        prometheus.wait_for(
            f'{name}{{{labels}instance="{rank0}"}}',
            lambda samples: len(samples) == 1 and samples[0].value > 0,
            timeout_s=30,
        )

    assert run.wait(120) == 0, run.output
    assert "worker 2 (rank 2, node id '2') was killed by SIGKILL; restarting it" in run.output

    table = subprocess.run(
        [*MSCLUSTER, "events", "--file", str(logs / "events.jsonl")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert in_order(kinds(table.stdout), SEQUENCE), table.stdout
    failed = next(line for line in table.stdout.splitlines() if " failed " in line)
    assert "rank 2" in failed
    assert "cause=stream_broken" in failed

    assert followed.wait(30) == 0, followed.output
    assert in_order(kinds(followed.output), SEQUENCE), followed.output

    assert watched.wait(30) == 0, watched.output
    for line in ("node 2: state alive -> failed", "job: generation 1 -> 2", "the job finished"):
        assert line in watched.output, watched.output
