"""What one SIGKILLed worker costs a training job: today's path, a hot spare, a spare with the
in-memory step (issue #15).

For each example (`examples/train_mlp.py`, `examples/train_torch.py`) and each mode, a real
`mscluster run --worker-num 4 --local-worker-num 4 --enable-recovery --max-restarts 2` job (4:
`--workers`, at least 2) runs twice in a row: fault-free, then with the worker of node id 1
SIGKILLed once it has printed `--kill-at` steps (the launcher starts it again at once). The time
lost is the faulty run's wall time minus the fault-free run's; the steps recomputed are what the
workers' "rolled back from step A to step B (N steps to compute again)" lines say (rank 0's).
Every faulty run must end with the fault-free run's final hash, or the benchmark fails.

Modes:
- `guard`: no spare: the restarted worker rejoins after `MS_NODE_TIMEOUT` (30 s by default), and
  every worker rolls back to the newest checkpoint all hold;
- `spare`: one spare (`--spares 1`) takes the rank at once; rollback to the newest checkpoint on
  disk (the in-memory step off: `--memory-snapshot 0`);
- `memory`: one spare, and the survivors keep the last step they finished in memory (the default):
  at most the interrupted step is computed again, and the spare gets that step from a peer.

Targets: `spare` and `memory` lose under 2 s at the default guard (today about 30 s); `memory`
recomputes at most one step.

Usage: python benchmarks/spares.py [--examples mlp,torch] [--modes guard,spare,memory]
       [--repeat 3] [--steps 200] [--save-every 10] [--kill-at 85] [--step-delay 0.02]
       [--node-timeout 30] [--workers 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.testing import free_port, launched_pid, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "mlp": ROOT / "examples" / "train_mlp.py",
    "torch": ROOT / "examples" / "train_torch.py",
}
MODES = ("guard", "spare", "memory")
STEP_LINE = re.compile(r"^epoch: \d+ step: \d+, loss is", re.MULTILINE)
REDONE = re.compile(r"rolled back from step \d+ to step \d+ \((\d+) steps to compute again\)")
RUN_S = 600.0


@dataclass(frozen=True)
class Settings:
    workers: int
    steps: int
    save_every: int
    kill_at: int
    step_delay: float
    node_timeout: float


@dataclass(frozen=True)
class Run:
    wall_s: float
    digest: str
    redone: int
    resumed_s: float | None  # from the kill to rank 0's "resuming from step" line


def resumed_after(log: Path, before: int) -> bool:
    """Whether `log` says "resuming from step" in what it holds past its first `before` bytes."""
    with log.open("rb") as file:
        file.seek(before)
        return b"resuming from step" in file.read()


def supports_memory_flag(example: Path) -> bool:
    done = subprocess.run(
        [sys.executable, str(example), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "MS_ROLE": ""},
    )
    return "--memory-snapshot" in done.stdout


def command(example: Path, mode: str, s: Settings, workdir: Path, memory_flag: bool) -> list[str]:
    run = [sys.executable, "-m", "cluster", "run", "--worker-num", str(s.workers)]
    run += ["--local-worker-num", str(s.workers), "--enable-recovery", "--max-restarts", "2"]
    run += ["--master-port", str(free_port()), "--log-dir", str(workdir / "logs")]
    run += ["--node-timeout", f"{s.node_timeout:g}"]
    if mode != "guard":
        run += ["--spares", "1"]
    args = ["--steps", str(s.steps), "--save-every", str(s.save_every)]
    args += ["--step-delay", f"{s.step_delay:g}", "--out", str(workdir / "out")]
    if mode != "memory" and memory_flag:
        args += ["--memory-snapshot", "0"]
    return [*run, str(example), *args]


def steps_in(log: Path) -> int:
    return len(STEP_LINE.findall(log.read_text(errors="replace"))) if log.exists() else 0


def run_once(example: Path, mode: str, s: Settings, *, kill: bool, memory_flag: bool) -> Run:
    with tempfile.TemporaryDirectory(prefix="cluster-spares-bench-") as tmp:
        workdir = Path(tmp)
        argv = command(example, mode, s, workdir, memory_flag)
        started = time.monotonic()
        resumed: float | None = None
        with (workdir / "run.log").open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            try:
                if kill:
                    resumed = kill_and_watch(workdir / "logs", s)
                code = proc.wait(RUN_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        wall = time.monotonic() - started
        if code != 0:
            tail = (workdir / "run.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{example.name} ({mode}) exited {code}:\n{tail}")
        rank0 = (workdir / "logs" / "worker_0.log").read_text(errors="replace")
        redone = sum(int(n) for n in REDONE.findall(rank0))
        digest = (workdir / "out" / "final.sha256").read_text().strip()
        return Run(wall, digest, redone, resumed)


def kill_and_watch(logs: Path, s: Settings) -> float:
    """SIGKILL node 1's worker at its `kill_at`-th step; the seconds until rank 0 resumes. The
    worker is the one this run's launcher lists in `logs/pids` (another job on this machine
    may run the same example with the same node ids)."""
    log = logs / "worker_1.log"
    wait_until(lambda: steps_in(log) >= s.kill_at, 120, "the step to kill at", poll_s=0.01)
    pid = launched_pid(logs, "worker_1")
    if pid is None:
        raise RuntimeError(f"{logs}/pids lists no running worker_1 of this run to kill")
    rank0 = logs / "worker_0.log"
    before = rank0.stat().st_size
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: resumed_after(rank0, before), RUN_S, "rank 0 to resume", poll_s=0.01)
    return time.monotonic() - killed


def bench(example: Path, mode: str, s: Settings, repeat: int) -> dict[str, Any]:
    memory_flag = supports_memory_flag(example)
    if mode == "spare" and not memory_flag:
        print(f"  ({example.name} has no --memory-snapshot: 'spare' keeps the in-memory step)")
    lost: list[float] = []
    redone: list[int] = []
    resumed: list[float] = []
    for _ in range(repeat):
        clean = run_once(example, mode, s, kill=False, memory_flag=memory_flag)
        faulty = run_once(example, mode, s, kill=True, memory_flag=memory_flag)
        if faulty.digest != clean.digest:
            raise RuntimeError(f"{example.name} ({mode}): the faulty run's hash differs")
        lost.append(faulty.wall_s - clean.wall_s)
        redone.append(faulty.redone)
        resumed.append(faulty.resumed_s or 0.0)
        print(
            f"  {example.name:15} {mode:7} fault-free {clean.wall_s:6.2f} s, "
            f"with the kill {faulty.wall_s:6.2f} s: lost {lost[-1]:6.2f} s, "
            f"rank 0 resumed {resumed[-1]:5.2f} s after the kill, "
            f"{faulty.redone} steps recomputed",
            flush=True,
        )
    return {
        "example": example.name,
        "mode": mode,
        "time_lost_s": lost,
        "resumed_after_s": resumed,
        "steps_redone": redone,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default="mlp,torch")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=85, help="rank 1's printed steps")
    parser.add_argument("--step-delay", type=float, default=0.02)
    parser.add_argument("--node-timeout", type=float, default=30.0, help="MS_NODE_TIMEOUT")
    parser.add_argument("--workers", type=int, default=4, help="the job's workers (node 1 killed)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error(f"--workers {args.workers}: at least 2 (the worker of node id 1 is killed)")
    settings = Settings(
        args.workers, args.steps, args.save_every, args.kill_at, args.step_delay, args.node_timeout
    )
    results = []
    for name in args.examples.split(","):
        for mode in args.modes.split(","):
            if name not in EXAMPLES or mode not in MODES:
                parser.error(f"unknown example {name!r} or mode {mode!r}")
            results.append(bench(EXAMPLES[name], mode, settings, args.repeat))
    timeout = f"MS_NODE_TIMEOUT={args.node_timeout:g} s"
    print(f"\n{args.workers} workers, {timeout}, median of {args.repeat}")
    print(f"{'example':16} {'mode':7} {'time lost':>10} {'resumed after':>14} {'recomputed':>11}")
    for r in results:
        lost = statistics.median(r["time_lost_s"])
        back = statistics.median(r["resumed_after_s"])
        redone = statistics.median(r["steps_redone"])
        print(f"{r['example']:16} {r['mode']:7} {lost:9.2f}s {back:13.2f}s {redone:11g}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
