"""Start-up benchmark: what a job's processes pay to import before they do anything (issue 26).

Two comparisons, each against gRPC's own import, each measured in this one run, the runs of the
two sides alternating so that a busy machine slows both alike:

imports
    A fresh `python -c "import grpc"` against a fresh process importing what a worker needs for
    `cluster.init()`: `import cluster`, the attributes a training script touches (the tutorial's
    `examples/allgather_check.py`: init, get_rank, get_group_size, is_rejoin, allgather_object,
    finalize) and the worker session that `init()` imports before it connects. The wall time of
    each process, start to exit; `--repeat` runs of each, medians and their ratio.
    Target: at most 1.25x `import grpc`.

job
    9 processes importing grpc, started at once, against the README's tutorial job started the
    tutorial's way: 8 workers and a scheduler of `examples/allgather_check.py` (MS_ROLE the only
    difference), each worker gathering every rank and printing it. The wall time from the first
    start to the last exit. Target: at most 1.4x the 9 grpc imports. Beside it, the CPU seconds
    of each side's processes: on a machine with fewer cores than processes both sides are bound
    by their CPU, and the CPU ratio is what the wall ratio follows.

`--phases` says where each process's CPU goes instead: the same job (and 9 bare imports beside
it), each process running the tutorial's steps itself and reading its CPU (`getrusage`, all its
threads) after each: the interpreter's start, the imports, `init()` (the scheduler: serving the
job to its end), the gather, `finalize()`, the `atexit` handlers, and the interpreter's teardown
after them (the total from `wait4`, less the CPU at the last handler). Medians over the jobs,
per process, in ms.

    python benchmarks/startup.py --phases --job-repeat 9

`--before DIR` runs the same with PYTHONPATH=DIR (another checkout, e.g. the commit before this
work: `git worktree add /tmp/before <commit>`), interleaved with this tree's runs. Bytecode is
compiled first (`compileall`) and PYTHONDONTWRITEBYTECODE is dropped, so every figure is with
bytecode cached, as a job's restarts see it.

    python benchmarks/startup.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import ast
import compileall
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRPC = "import grpc"
WORKER = (
    "import cluster\n"
    "cluster.init, cluster.get_rank, cluster.get_group_size, cluster.is_rejoin\n"
    "cluster.allgather_object, cluster.finalize\n"
    "import cluster.worker.session\n"
)
EXAMPLE = "examples/allgather_check.py"
# --phases: each process marks its CPU after each step and writes the marks to the pipe named by
# MARKS_FD. The first atexit handler registered runs last.
MARKED = """\
import atexit, os, resource
def _cpu():
    used = resource.getrusage(resource.RUSAGE_SELF)
    return (used.ru_utime + used.ru_stime) * 1000
marks = {"start": _cpu()}
def _last():
    marks["atexit"] = _cpu()
    os.write(int(os.environ["MARKS_FD"]), repr(marks).encode())
atexit.register(_last)
"""
MARKED_GRPC = MARKED + "import grpc\nmarks['imports'] = _cpu()\n"
# The steps of examples/allgather_check.py, marked; the scheduler's init() serves and exits.
MARKED_JOB = (
    MARKED
    + """\
import argparse, cluster
argparse.ArgumentParser().parse_args([])
cluster.init, cluster.get_rank, cluster.allgather_object, cluster.finalize
if os.environ["MS_ROLE"] == "MS_SCHED":
    import cluster.scheduler.server
else:
    import cluster.worker.session
marks["imports"] = _cpu()
try:
    cluster.init()
finally:  # the scheduler's ends in SystemExit, once it served the job
    marks["init"] = _cpu()
cluster.allgather_object(cluster.get_rank())
marks["gather"] = _cpu()
cluster.finalize()
marks["finalize"] = _cpu()
"""
)
PHASES = ("start", "imports", "init", "gather", "finalize", "atexit")


def environment(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = str(tree)
    return env


def one_process(code: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one fresh process running `code`, in the tree
    named by PYTHONPATH (`-c` puts the working directory before PYTHONPATH on sys.path)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=env["PYTHONPATH"])
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{code!r} exited {proc.returncode}")
    return elapsed, usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def grpc_nine(env: dict[str, str], n: int) -> tuple[float, float]:
    """Wall seconds of `n` processes importing grpc, started at once, and their CPU seconds."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", GRPC], env=env) for _ in range(n)]
    codes, cpus = reap(procs)
    if any(code != 0 for code in codes):
        raise RuntimeError("a grpc import failed")
    return time.perf_counter() - start, sum(cpus)


def reap(procs: Sequence[subprocess.Popen[bytes]]) -> tuple[list[int], list[float]]:
    """Wait for every process, in the order they end: their exit codes, and the CPU seconds
    (user + system) each used."""
    codes, cpus, left = (
        [0] * len(procs),
        [0.0] * len(procs),
        {p.pid: i for i, p in enumerate(procs)},
    )
    while left:
        pid, status, usage = os.wait4(-1, 0)
        if pid in left:
            index = left.pop(pid)
            codes[index] = procs[index].returncode = os.waitstatus_to_exitcode(status)
            cpus[index] = usage.ru_utime + usage.ru_stime
    return codes, cpus


def job_environment(env: dict[str, str], workers: int) -> dict[str, str]:
    """`env` for one tutorial job of `workers` workers, its scheduler on a free loopback port
    (MS_ROLE is each process's own)."""
    return {
        **env,
        "MS_WORKER_NUM": str(workers),
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": str(free_port()),
    }


def tutorial_job(tree: Path, env: dict[str, str], workers: int) -> tuple[float, float]:
    """Wall seconds of the tutorial job, from the first start to the last exit, and the CPU
    seconds of its processes."""
    job = job_environment(env, workers)
    script = str(tree / EXAMPLE)
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        logs = [Path(tmp) / f"{i}.log" for i in range(workers + 1)]
        start = time.perf_counter()
        procs = []
        for role, log in zip(["MS_WORKER"] * workers + ["MS_SCHED"], logs, strict=True):
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, script],
                        env={**job, "MS_ROLE": role},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes, cpus = reap(procs)
        elapsed = time.perf_counter() - start
        outputs = [log.read_bytes() for log in logs]
    for code, out in zip(codes, outputs, strict=True):
        if code != 0:
            raise RuntimeError(f"a process of the job exited {code}: {out[-2000:]!r}")
    if sum(b"allgather rank=" in out for out in outputs) != workers:
        raise RuntimeError("not every worker printed its gather")
    return elapsed, sum(cpus)


def measure(trees: dict[str, Path], repeat: int, job_repeat: int, workers: int) -> dict[str, float]:
    envs = {name: environment(tree) for name, tree in trees.items()}
    for tree in trees.values():
        compileall.compile_dir(tree / "cluster", quiet=1)
    samples: dict[str, list[float]] = {}
    for env in envs.values():  # warm the page cache, untimed
        one_process(WORKER, env)
    for _ in range(repeat):
        for name, env in envs.items():
            for what, code in (("grpc", GRPC), ("worker", WORKER)):
                wall, cpu = one_process(code, env)
                samples.setdefault(f"{name} {what}", []).append(wall)
                samples.setdefault(f"{name} {what} cpu", []).append(cpu)
    for _ in range(job_repeat):
        for name, env in envs.items():
            for what, (wall, cpu) in (
                (f"grpc x{workers + 1}", grpc_nine(env, workers + 1)),
                ("job", tutorial_job(trees[name], env, workers)),
            ):
                samples.setdefault(f"{name} {what}", []).append(wall)
                samples.setdefault(f"{name} {what} cpu", []).append(cpu)
    return {key: statistics.median(values) for key, values in samples.items()}


def report(medians: dict[str, float], names: Sequence[str], workers: int) -> None:
    nine = f"grpc x{workers + 1}"
    print(
        f"{'tree':<8} {'grpc':>7} {'worker':>7} {'ratio':>6} | {'CPU: grpc':>9} {'worker':>7} "
        f"{'ratio':>6} | {nine:>9} {'job':>7} {'ratio':>6} | {'CPU: ' + nine:>14} {'job':>7} "
        f"{'ratio':>6}"
    )
    for name in names:
        m = {key.removeprefix(f"{name} "): value for key, value in medians.items()}
        print(
            f"{name:<8} {m['grpc']:7.3f} {m['worker']:7.3f} {m['worker'] / m['grpc']:6.2f} | "
            f"{m['grpc cpu']:9.3f} {m['worker cpu']:7.3f} {m['worker cpu'] / m['grpc cpu']:6.2f} | "
            f"{m[nine]:9.3f} {m['job']:7.3f} {m['job'] / m[nine]:6.2f} | "
            f"{m[nine + ' cpu']:14.3f} {m['job cpu']:7.3f} {m['job cpu'] / m[nine + ' cpu']:6.2f}"
        )
    print(f"targets: worker <= 1.25x grpc (wall); job <= 1.40x {nine} (seconds, medians)")


def marked_processes(env: dict[str, str], roles: Sequence[str]) -> list[dict[str, float]]:
    """Run one process per role at once (MARKED_JOB, or MARKED_GRPC for the role "grpc"): the CPU
    ms of each's phases (`PHASES`, each less the one before, and "teardown": its total from
    `wait4` less the CPU at its last atexit handler), in the order of `roles`."""
    procs, pipes = [], []
    for role in roles:
        read, write = os.pipe()
        code = MARKED_GRPC if role == "grpc" else MARKED_JOB
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env={**env, "MS_ROLE": role, "MARKS_FD": str(write)},
                pass_fds=(write,),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=env["PYTHONPATH"],
            )
        )
        os.close(write)
        pipes.append(read)
    codes, cpus = reap(procs)
    if any(codes):
        raise RuntimeError(f"a process of --phases exited {max(codes, key=abs)}")
    phases = []
    for read, cpu, role in zip(pipes, cpus, roles, strict=True):
        with os.fdopen(read, "rb") as marks_file:
            text = marks_file.read().decode()
        if not text:
            raise RuntimeError(f"a {role} process of --phases exited before its atexit handlers")
        marks = ast.literal_eval(text)
        done, previous = {}, 0.0
        for phase in PHASES:
            if phase in marks:
                done[phase], previous = marks[phase] - previous, marks[phase]
        done["teardown"], done["total"] = cpu * 1000 - previous, cpu * 1000
        phases.append(done)
    return phases


def phases(tree: Path, job_repeat: int, workers: int) -> None:
    """Print where each process's CPU goes: 9 bare imports, the job's workers, its scheduler."""
    env = environment(tree)
    compileall.compile_dir(tree / "cluster", quiet=1)
    samples: dict[str, list[dict[str, float]]] = {"grpc": [], "worker": [], "scheduler": []}
    for _ in range(job_repeat):
        samples["grpc"] += marked_processes(env, ["grpc"] * (workers + 1))
        job = job_environment(env, workers)
        *each, scheduler = marked_processes(job, ["MS_WORKER"] * workers + ["MS_SCHED"])
        samples["worker"] += each
        samples["scheduler"].append(scheduler)
    columns = (*PHASES, "teardown", "total")
    print(f"CPU ms per process, medians of {job_repeat} jobs ({workers} workers)")
    print(f"{'process':<10}" + "".join(f"{c:>10}" for c in columns))
    for name, runs in samples.items():
        cells = [[r[c] for r in runs if c in r] for c in columns]
        print(
            f"{name:<10}"
            + "".join(f"{statistics.median(v):10.1f}" if v else f"{'-':>10}" for v in cells)
        )
    total = {name: statistics.median(r["total"] for r in runs) for name, runs in samples.items()}
    job, nine = total["worker"] * workers + total["scheduler"], total["grpc"] * (workers + 1)
    print(f"job CPU {job:.0f} ms, {workers + 1} imports {nine:.0f} ms: {job / nine:.2f}x")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=15, help="single-process runs per side")
    parser.add_argument("--job-repeat", type=int, default=5, help="job runs per side")
    parser.add_argument("--workers", type=int, default=8, help="the tutorial job's workers")
    parser.add_argument("--before", type=Path, help="another checkout to compare, run alongside")
    parser.add_argument("--phases", action="store_true", help="where each process's CPU goes")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    trees = {"after": ROOT} if args.before is None else {"before": args.before, "after": ROOT}
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    if args.phases:
        phases(ROOT, args.job_repeat, args.workers)
        return
    medians = measure(trees, args.repeat, args.job_repeat, args.workers)
    report(medians, list(trees), args.workers)


if __name__ == "__main__":
    main()
