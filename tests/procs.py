"""Real processes for tests: start a job's processes, wait on what they print, never orphan.

What is not only for tests (a free port, `wait_until`, a `Process` with its log) is the public
`cluster.testing`; here are the test-only pieces: the environment of a job on this checkout, a
private copy of a script, the processes running it, a group killed when the test ends, the
command line of `mscluster run`, and `mscluster` as the job's operator runs it (with the job's
secret file: a job with a secret shows Status and its events only to readers that prove it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cluster.testing import (
    Process,
    launched_pid,
    processes_running,  # noqa: F401 - the tests import it from here
)
from cluster.tools.processes import descendants
from cluster.worker.orphan import proc_stat
from tests.servers import require

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MSCLUSTER = [PYTHON, "-m", "cluster"]


def job_env(worker_num: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env.update(
        MS_WORKER_NUM=str(worker_num),
        MS_SCHED_HOST="127.0.0.1",
        MS_SCHED_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_args(
    *args: str | os.PathLike[str],
    worker_num: int | str | None = None,
    local_worker_num: int | str | None = None,
    master_port: int | str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """`mscluster run` with the usual flags that are given (`--worker-num`,
    `--local-worker-num`, `--master-port`, `--log-dir`), then `args` as they are: other options,
    the script and its arguments."""
    flags = {
        "--worker-num": worker_num,
        "--local-worker-num": local_worker_num,
        "--master-port": master_port,
        "--log-dir": None if log_dir is None else os.fspath(log_dir),
    }
    given = [
        word for flag, value in flags.items() if value is not None for word in (flag, str(value))
    ]
    return [*MSCLUSTER, "run", *given, *(os.fspath(arg) for arg in args)]


def as_a_user(*also: str) -> list[str]:
    """The words that run a command as root without the capabilities that pass over a file's
    mode (`setpriv`), and without `also` (e.g. "fowner", which passes over its owner): a file's
    mode keeps it out, as it keeps any user out. The test is skipped, saying why, where that
    cannot be done (not root, no setpriv)."""
    setpriv = shutil.which("setpriv")
    require("reading as a user the mode keeps out needs root" if os.geteuid() != 0 else None)
    require(None if setpriv is not None else "setpriv (util-linux) is not installed")
    assert setpriv is not None
    dropped = ",".join(f"-{cap}" for cap in ("dac_override", "dac_read_search", *also))
    return [setpriv, f"--inh-caps={dropped}", f"--bounding-set={dropped}", "--"]


def run_as_a_user(script: str, directory: Path, *also: str) -> subprocess.CompletedProcess[str]:
    """`python -c script directory` run to its end as a user (`as_a_user`, without `also`),
    from the repository's root; it must exit 0."""
    result = subprocess.run(
        [*as_a_user(*also), PYTHON, "-c", script, str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def certs(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`mscluster certs --out OUT EXTRA` run to its end; its output as text."""
    return subprocess.run(
        [*MSCLUSTER, "certs", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def reader_env(
    secret_file: str | os.PathLike[str] | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment (`base`, default this process's) of an operator who holds the job's
    secret file: `mscluster status` and `events` read the job with it (CLUSTER_JOB_SECRET_FILE).
    None: a reader without it."""
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    env.pop("CLUSTER_JOB_SECRET", None)
    env.pop("CLUSTER_JOB_SECRET_FILE", None)
    if secret_file is not None:
        env["CLUSTER_JOB_SECRET_FILE"] = str(secret_file)
    return env


def mscluster(
    *args: str,
    secret_file: str | os.PathLike[str] | None,
    timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`mscluster ARGS` (status, events, ...) run to its end as the job's operator, who holds
    `secret_file` (None: a reader without the job's secret), in `cwd` (where it looks for
    logs/job.secret last); its output as text."""
    return subprocess.run(
        [*MSCLUSTER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=reader_env(secret_file, env),
        cwd=cwd,
    )


def example_error_line(env: Mapping[str, str]) -> str:
    """The one line of standard error the tutorial's example (`examples/allgather_check.py`)
    exits non-zero with in `env`: no traceback, nothing else."""
    result = subprocess.run(
        [PYTHON, str(ROOT / "examples" / "allgather_check.py")],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def launched(log_dir: Path, name: str) -> int:
    """The pid of process `name` (`worker_2`, `scheduler`) of the `mscluster run` whose log
    directory is `log_dir`, as that launcher lists it (`<log_dir>/pids`): the process a test
    signals is its own job's, never one found by its script on the whole machine."""
    pid = launched_pid(log_dir, name)
    if pid is None:
        listed = (log_dir / "pids").read_text() if (log_dir / "pids").exists() else "no file"
        raise AssertionError(f"no running {name} of the launcher in {log_dir}/pids: {listed}")
    return pid


def started_at(pid: int) -> str | None:
    """The start time of live process `pid` (field 22 of /proc/PID/stat), None if it is gone."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] in "ZX" else stat[19]


def note_below(root: int, found: dict[int, str]) -> None:
    """Add each live process below `root` to `found` (pid -> start time), for `kill_noted`."""
    for pid in descendants(root):
        started = started_at(pid)
        if started is not None:
            found[pid] = started


def kill_noted(found: dict[int, str]) -> None:
    """SIGKILL each process of `found` that still runs, once checked to be that process still."""
    for pid, started in found.items():
        if started_at(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def private_copy(tmp_path: Path, source: Path = ROOT / "examples" / "allgather_check.py") -> Path:
    """The script under a path unique to this test: a marker of this test's run, to check that
    none of its processes is left (`processes_running`); to signal one, see `launched`."""
    target = tmp_path / "job" / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    return target


@dataclass
class Procs:
    """Processes started by one test; all are killed when the test ends. `on_start(name, log)`
    is told of each (the `processes` fixture shows their logs in a failed test's report)."""

    tmp: Path
    started: list[Process] = field(default_factory=list)
    on_start: Callable[[str, Path], None] | None = None

    def start(
        self, name: str, args: list[str], env: Mapping[str, str], cwd: Path = ROOT
    ) -> Process:
        log = self.tmp / f"{name}.log"
        log.unlink(missing_ok=True)  # a name started again: only the new process's output
        proc = Process(name, args, dict(env), log, cwd=cwd)
        self.started.append(proc)
        if self.on_start is not None and all(p.log != log for p in self.started[:-1]):
            self.on_start(name, log)
        return proc

    def start_role(
        self, name: str, role: str, script: list[str], env: Mapping[str, str]
    ) -> Process:
        return self.start(name, [PYTHON, *script], {**env, "MS_ROLE": role})

    def kill_all(self) -> None:
        for proc in self.started:
            proc.kill_group()


@contextmanager
def procs(tmp: Path, on_start: Callable[[str, Path], None] | None = None) -> Iterator[Procs]:
    group = Procs(tmp, on_start=on_start)
    try:
        yield group
    finally:
        group.kill_all()
