"""The examples of the README and of the docs pages do what the pages show.

Every marked block (tests/docs_blocks.py says how a block is marked) is run as written: in a
fresh copy of the checkout (each top-level entry linked, so what the commands write stays in the
test's directory), with this checkout's `python` and `mscluster` first on PATH, as they are in
the reader's activated virtual environment. Nothing is added to a command: a page that needs
`logs/` makes it itself. A page that needs a server (`<!-- test: needs etcd -->`) gets one of
tests/servers/, named in the variable the page's commands read (SERVERS), as the reader's shell
would name theirs.

The pages' commands listen on fixed ports, as the reader's do (8118, the default, on 127.0.0.1
and 127.0.0.2): two test processes on one machine (two checkouts' test runs side by side) would
each find the other's scheduler on them. So one page runs at a time on the machine
(`_one_page_at_a_time`), across test processes.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from cluster.protocol.errors import JobTimeoutError
from cluster.testing import free_port, wait_until
from tests import docs_blocks
from tests.docs_blocks import ROOT, Block
from tests.integration.test_demo import run_demo
from tests.procs import PYTHON, Procs, job_env
from tests.servers.etcd import EtcdCluster
from tests.servers.slurm import Slurm

RUN_S = 120
# Held by the test process whose page runs; another waits for it up to PAGE_WAIT_S (the
# standbys' page, the longest, took 23-43 s on the 2-core machine at a load average of 6-9).
PAGES_LOCK = Path(tempfile.gettempdir()) / "cluster-docs-pages.lock"
PAGE_WAIT_S = 300
# What a checkout holds that is not the reader's: build outputs, caches, virtual environments.
NOT_CHECKOUT = re.compile(r"^(\.git|\.venv.*|\.ci-venv|logs|demo|checkpoints|site|build|dist)$")


def _etcd(request: pytest.FixtureRequest) -> dict[str, str]:
    """A 3-member etcd (tests/servers/etcd.py), the page's job under a prefix of its own."""
    cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
    return {"CLUSTER_STATE_URL": cluster.state_url()}


def _slurm(request: pytest.FixtureRequest) -> dict[str, str]:
    """A Slurm of two nodes on this host (tests/servers/slurm.py; root): `sbatch` and `srun`
    reach it as a login node's reach the site's, by its slurm.conf."""
    slurm: Slurm = request.getfixturevalue("slurm")
    return {"SLURM_CONF": str(slurm.conf)}


# What `<!-- test: needs NAME -->` gets: a server started for the page, and the variables that
# name it to the page's commands.
SERVERS: dict[str, Callable[[pytest.FixtureRequest], dict[str, str]]] = {
    "etcd": _etcd,
    "slurm": _slurm,
}


@contextmanager
def _one_page_at_a_time() -> Iterator[None]:
    """Hold PAGES_LOCK while a page runs: no other test process's page takes its ports. The
    kernel releases it when the holder ends, however it ends."""

    with PAGES_LOCK.open("a") as lock:

        def taken() -> bool:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        what = f"another test process's docs page to end (it holds {PAGES_LOCK})"
        wait_until(taken, PAGE_WAIT_S, what, poll_s=0.2)
        yield


def _runnable_pages() -> list[Path]:
    return [p for p in docs_blocks.pages() if any(b.kind == "run" for b in docs_blocks.blocks(p))]


def _marked(kind: str) -> list[Block]:
    return [b for page in docs_blocks.pages() for b in docs_blocks.blocks(page) if b.kind == kind]


def _checkout(tmp_path: Path) -> Path:
    """The reader's checkout: every top-level entry of this one, linked, in a fresh directory."""
    where = tmp_path / "checkout"
    where.mkdir()
    for entry in ROOT.iterdir():
        if not NOT_CHECKOUT.match(entry.name) and not entry.name.endswith("_cache"):
            (where / entry.name).symlink_to(entry)
    return where


def _reader_env() -> dict[str, str]:
    """The reader's shell: no job variables set, this checkout's python and mscluster first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)  # the checkout's code, as `pip install -e .` gives it
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(block: Block, checkout: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run `block` with bash as the reader would paste it; its exit status and what it printed.

    In a process group of its own, killed once the block ends: a walkthrough that failed
    half-way (or ran past RUN_S) leaves none of its background jobs running."""
    with subprocess.Popen(
        ["bash", "-e", "-c", block.text],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as bash:
        try:
            printed, _ = bash.communicate(timeout=RUN_S)
        except subprocess.TimeoutExpired:
            os.killpg(bash.pid, signal.SIGKILL)
            printed, _ = bash.communicate()
            printed += f"\n(still running after {RUN_S} s: killed)"
        finally:
            with suppress(ProcessLookupError):
                os.killpg(bash.pid, signal.SIGKILL)
    return bash.returncode, printed


def test_every_mark_is_on_a_block_and_runs_are_found() -> None:
    runs = _marked("run")
    assert runs, "no page has a block marked <!-- test: run -->"
    assert any(b.page.name == "README.md" for b in runs)
    for block in _marked("output"):
        before = [b for b in docs_blocks.blocks(block.page) if b.line < block.line]
        assert before, f"{block.where}: no block before it"
        assert before[-1].kind == "run", f"{block.where}: no run block before it"
    for page in docs_blocks.pages():
        for server in docs_blocks.needs(page):
            assert server in SERVERS, f"{page}: needs {server!r}, not one of {sorted(SERVERS)}"
            assert page in _runnable_pages(), f"{page}: needs {server!r} but runs nothing"


@pytest.mark.timeout(PAGE_WAIT_S + RUN_S)  # the wait for another process's page, then its own
@pytest.mark.parametrize(
    "page", _runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)).replace("/", ".")
)
def test_the_pages_examples_do_what_the_page_shows(
    page: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with _one_page_at_a_time():
        _run_page(page, tmp_path, request)


def _run_page(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    checkout = _checkout(tmp_path)
    env = _reader_env()
    for server in docs_blocks.needs(page):
        env.update(SERVERS[server](request))
    printed = ""
    for block in docs_blocks.blocks(page):
        if block.kind == "file":
            (checkout / block.argument).write_text(block.text)
        elif block.kind == "run":
            returncode, printed = _run(block, checkout, env)
            assert returncode == 0, f"{block.where} exited {returncode}:\n{printed}"
        elif block.kind == "output":
            missing = docs_blocks.shows(block.text, printed)
            assert not missing, f"{block.where}: not printed: {missing}\nprinted:\n{printed}"


def test_one_page_runs_at_a_time_across_test_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another test process's page holds the machine's ports: this one waits for it to end."""
    holder = subprocess.Popen(
        [
            *(PYTHON, "-c"),
            "import sys\n"
            "from tests.integration.test_docs import _one_page_at_a_time\n"
            "with _one_page_at_a_time():\n"
            "    print('holding', flush=True)\n"
            "    sys.stdin.read()\n",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "holding\n"
        monkeypatch.setattr(f"{__name__}.PAGE_WAIT_S", 0.5)
        waited = pytest.raises(JobTimeoutError, match="another test process's docs page")
        with waited, _one_page_at_a_time():
            pass
    finally:
        holder.communicate("", timeout=30)  # stdin closed: it lets go and ends
    with _one_page_at_a_time():
        pass


def test_the_readme_training_script_runs_as_a_job(processes: Procs, tmp_path: Path) -> None:
    """The README's script, started by hand as its environment says (2 workers)."""
    (script,) = [
        b for b in _marked("file") if b.page.name == "README.md" and b.language == "python"
    ]
    path = tmp_path / script.argument
    path.write_text(script.text)
    base = job_env(2, free_port())
    sched = processes.start_role("scheduler", "MS_SCHED", [str(path)], base)
    workers = [processes.start_role(f"w{i}", "MS_WORKER", [str(path)], base) for i in range(2)]
    for proc in [*workers, sched]:
        assert proc.wait(30) == 0, proc.output


def test_the_environment_page_names_every_environment_variable() -> None:
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    source = "\n".join(p.read_text() for p in (ROOT / "cluster").rglob("*.py"))
    names = set(re.findall(r'"((?:MS|CLUSTER)_[A-Z_]+)"', source))
    assert names, "no variable names found in the source"
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"the environment page's table lacks {missing}"


def test_the_recovery_example_script_runs(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "guide" / "recovery.md").read_text()
    assert "examples/run_recovery.sh" in page
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "run_recovery.sh")],
        env={
            **job_env(2, free_port()),
            "LOG_DIR": str(tmp_path),
            "PYTHON": PYTHON,
            "HOLD": "10",
            "MS_NODE_TIMEOUT": "3",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rejoined rank=1 size=2" in result.stdout
    assert "every node is back after the scheduler's restart" in result.stdout
    assert "job exit status: 0" in result.stdout


def test_the_demo_ends_as_the_pages_say(tmp_path: Path) -> None:
    """The demo (without its set-up step): both runs end with the hash the pages show."""
    shown = _marked("demo-output")
    assert {b.page.name for b in shown} >= {"README.md", "tutorial.md"}
    result = run_demo(tmp_path, sizes={})
    assert result.returncode == 0, result.stdout + result.stderr
    for block in shown:
        missing = docs_blocks.shows(block.text, result.stdout)
        assert not missing, f"{block.where}: not printed: {missing}\n{result.stdout}"
