"""Every benchmark in benchmarks/ runs: each script once, at its smallest real size (tiny
states, one round, a couple of workers), as `python benchmarks/X.py` (or `bash`) in a process
of its own with a bounded wait; it must exit 0, with no traceback, and print its table.

The benchmarks are run by hand for benchmarks/RESULTS.md, so a change that breaks one would
otherwise go unseen until the next figure is measured. The GPU ones (`checkpoint.py --device
cuda`, `gpu_check.sh`) are skipped where torch sees no CUDA device; the ones that compare with
torch (TCPStore, dcp, the torch example) where torch is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import PYTHON, ROOT, Procs

# solo (scripts/test runs it alone): the benchmarks load the machine, and some time guards
# (recovery.py: a 1 s MS_NODE_TIMEOUT) that a neighbour's load could move.
pytestmark = [pytest.mark.slow, pytest.mark.solo]

BENCHMARKS = ROOT / "benchmarks"


@dataclass(frozen=True)
class Smoke:
    """`command` (the script and its options, from the repository's root) and what its
    output must hold: each of `table` (regular expressions, one line each)."""

    command: tuple[str, ...]
    table: tuple[str, ...]
    torch: bool = False  # compares with torch: skipped without it
    torch_table: tuple[str, ...] = ()  # also in its output where torch is installed
    gpu: bool = False  # needs a CUDA device: skipped without one
    timeout_s: float = 90.0


# Per file of benchmarks/ ("file --mode" for a second mode of one): how it runs smallest. A
# module without a main of its own is run through the script that imports it, with the options
# that reach it.
SMOKES = {
    "checkpoint.py": Smoke(  # part 1, the systems of checkpoint_systems.py
        ("benchmarks/checkpoint.py", "--sizes", "1", "--repeat", "1", "--steps", "0"),
        (
            r"^system +pause ms +ms/100MB +durable ms +load ms$",
            r"^cluster async \(numpy\) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$",
            r"^numpy\.savez \+ fsync +[\d.]+",
        ),
        torch_table=(
            r"^torch\.save \+ fsync +[\d.]+",
            r"^torch dcp\.async_save \(gloo, 1 proc\) +[\d.]+",
        ),
    ),
    "checkpoint_training.py": Smoke(  # part 2 of checkpoint.py (step_memory.py joins its way)
        ("benchmarks/checkpoint.py", "--sizes", "", "--repeat", "1", "--steps", "5"),
        (
            r"^--step-delay +checkpoints +steps/s +ms/step +of none$",
            r"^ +0 +every step, sync \(flush\) +[\d.]+ +[\d.]+ +\d+%$",
        ),
        torch=True,
    ),
    "checkpoint_cuda.py": Smoke(
        ("benchmarks/checkpoint.py", "--device", "cuda", "--sizes", "1", "--repeat", "1"),
        (r"^D2H floor, pinned +[\d.]+", r"^cluster async \(CheckpointManager\) +[\d.]+"),
        torch=True,
        gpu=True,
    ),
    "gpu_check.sh": Smoke(
        ("benchmarks/gpu_check.sh", "--sizes", "1", "--repeat", "1", "--steps", "5"),
        (r"^gpu_check summary", r"^  PASS  GPU tests$", r"^  PASS  train_torch\.py over NCCL$"),
        torch=True,
        gpu=True,
        timeout_s=300.0,
    ),
    "connections.py": Smoke(
        ("benchmarks/connections.py", "--idle", "10", "--repeat", "1", "--limit", "20"),
        (r"^idle sockets +median +runs$", r"^ +10 +[\d.]+ s +[\d.]+$"),  # "-": did not form
    ),
    "heartbeats.py": Smoke(
        (
            *("benchmarks/heartbeats.py", "--workers", "2", "--procs", "1", "--relays", "1"),
            *("--interval", "0.2", "--window", "0.3", "--metrics", "--scrape-interval", "0.2"),
        ),
        (
            r"^  cluster +one beat per 0\.2 s: server .*a scrape costs",
            r"^  tcpstore +one beat per 0\.2 s: server ",
            r"^  cluster-relays +one beat per 0\.2 s: .*scheduler connections: 1\b",
        ),
        torch=True,
    ),
    "kv_log.py": Smoke(
        (
            *("benchmarks/kv_log.py", "--rewrites", "100", "--value-bytes", "64"),
            *("--store-mb", "1", "--rewrite-mb", "1"),
        ),
        (r'^  "us_per_rewrite": [\d.]+', r'^  "restart_full_s": [\d.]+'),
    ),
    "outsider.py": Smoke(
        (
            *("benchmarks/outsider.py", "--followers", "2", "--count", "1", "--mb", "1"),
            *("--burst", "2", "--burst-mib", "1"),
        ),
        (
            r"^system +RSS before +RSS after +grown +peak grown +files grown$",
            *(rf"^{s} +[\d.]+MB" for s in ("cluster", "cluster-secret", "tcpstore")),
        ),
        torch=True,
    ),
    "unread_streams.py": Smoke(
        ("benchmarks/unread_streams.py", "--calls", "2", "--mib", "1", "--hold", "0.5"),
        (r"^never reads it +1 +[\d.]+MB", r"^reads its request +4 +[\d.]+MB"),
    ),
    "peer_lookup.py": Smoke(
        ("benchmarks/peer_lookup.py", "--sizes", "256", "--repeat", "1"),
        (r"^ +N ids \| +wire KiB \|", r"^ +256 numeric \|", r"^ +256 named \|"),
    ),
    "peer_state.py": Smoke(
        ("benchmarks/peer_state.py", "--mb", "1", "--repeat", "1"),
        (r"^  fetched from a peer .* median [\d.]+ s", r"^  local load from disk .* median"),
    ),
    "recovery.py": Smoke(
        (
            *("benchmarks/recovery.py", "--real", "2", "--simulated", "2", "--procs", "1"),
            *("--repeat", "1", "--guard-workers", "2", "--node-timeout", "1"),
            *("--rollback-steps", "30", "--relay-outage", "0.5", "--relay-nodes", "4"),
        ),
        (
            r"^ +2 +real processes +\d+ ms +\d+ ms$",
            r"^ +2 +simulated in 1 processes +\d+ ms +\d+ ms$",
            r"^guard end -> new generation .*: median \d+ ms",
            r"^time lost to one worker SIGKILL, .*: median \d+ ms",
            r"^scheduler SIGKILL, 0\.5 s down, restart -> all 2 workers back .* from spawn \d+ ms",
        ),
    ),
    "rendezvous.py": Smoke(
        (
            *("benchmarks/rendezvous.py", "--sizes", "2", "--repeat", "1", "--procs", "1"),
            *("--real", "2", "--retries", "0", "--relays", "1", "--systems"),
            "cluster,tcpstore,cluster-tls,cluster-tls-crl,grpc,grpc-tls",
        ),
        (
            r"^ +N \| +cluster \| +TCPStore \| TCPStore/cluster$",
            r"^ +2 \| +\d+ ms \| +\d+ ms \| +[\d.]+$",
            r"^ +2 \| +\d+ ms \| +\d+ ms \| +[\d.]+ \| +\d+ ms \| +[\d.]+$",  # TLS
            r"^ +2 \| +\d+ ms \| +\d+ ms \| +[\d.]+ \| +\d+ ms/\d+ ms \|",  # relays
            r"^Real job, 2 worker processes .*: median \d+ ms",
        ),
        torch=True,
    ),
    "scale_model.py": Smoke(
        ("benchmarks/scale_model.py", "--sizes", "64"),
        (r"^ +N \| design +\| +conns \|", r"^ +64 \| current +\| +64 \|"),
    ),
    "spares.py": Smoke(  # the torch example's 2 x 3 processes would take 15-25 s more
        (
            *("benchmarks/spares.py", "--examples", "mlp", "--modes", "spare"),
            *("--repeat", "1", "--steps", "12", "--save-every", "4", "--kill-at", "6"),
            *("--step-delay", "0.01", "--node-timeout", "2", "--workers", "2"),
        ),
        (
            r"^example +mode +time lost +resumed after +recomputed$",
            r"^train_mlp\.py +spare +-?[\d.]+s +[\d.]+s +\d+$",
        ),
    ),
    "startup.py": Smoke(
        ("benchmarks/startup.py", "--repeat", "1", "--job-repeat", "1", "--workers", "2"),
        (r"^tree +grpc +worker +ratio \|", r"^after +[\d.]+ +[\d.]+ +[\d.]+ \|"),
    ),
    "startup.py --phases": Smoke(
        ("benchmarks/startup.py", "--phases", "--job-repeat", "1", "--workers", "2"),
        (r"^worker +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+", r"^job CPU \d+ ms, 3 imports \d+ ms: "),
    ),
    "step_memory.py": Smoke(
        ("benchmarks/step_memory.py", "--size", "1", "--steps", "3", "--repeat", "1"),
        (r"^  copy every step +[\d.]+ ms/step", r"^putting the step back: from memory [\d.]+ ms"),
    ),
}


# The modules that have no main of their own: the smoke run of the script that runs them.
RUN_BY = {"checkpoint_systems.py": "checkpoint.py"}


def test_every_benchmark_has_a_smoke_run() -> None:
    """A benchmark added to benchmarks/ is run here too (RESULTS.md holds the figures)."""
    files = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    assert files == {name.split()[0] for name in SMOKES} | set(RUN_BY)
    assert set(RUN_BY.values()) <= set(SMOKES)


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize(
    "name",
    [
        # The suite's own bound (120 s) is a process's wait here, and a little more.
        pytest.param(name, id=name, marks=pytest.mark.timeout(max(120, smoke.timeout_s + 30)))
        for name, smoke in sorted(SMOKES.items())
    ],
)
def test_a_benchmark_runs_at_its_smallest_size(
    name: str, processes: Procs, short_dir: Path
) -> None:
    smoke = SMOKES[name]
    if smoke.torch and not torch_installed():
        pytest.skip(f"{name} compares with torch, which is not installed")
    if smoke.gpu:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip(f"no CUDA device (torch {torch.__version__}): {name} needs a GPU")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    # Its temporary files (unix sockets among them) under a short path of the test's own.
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TMPDIR=str(short_dir), PYTHON=PYTHON)
    script, *options = smoke.command
    runner = "bash" if script.endswith(".sh") else PYTHON
    started = time.monotonic()
    proc = processes.start(name, [runner, str(ROOT / script), *options], env, cwd=short_dir)
    code = proc.wait(smoke.timeout_s)
    took = time.monotonic() - started
    output = proc.output
    assert code == 0, output
    assert "Traceback" not in output, output
    table = smoke.table + (smoke.torch_table if torch_installed() else ())
    missing = [row for row in table if not re.search(row, output, re.MULTILINE)]
    assert not missing, f"{name} printed no line matching {missing}:\n{output}"
    print(f"{name}: {took:.1f} s")
