"""The package as a user gets it: the wheel and sdist that `python -m build` makes, installed
with pip into a fresh virtual environment outside the checkout, run there as `mscluster run`.

The checkout stays as it was: the build reads a copy of the files git would see (tracked, and
new ones not ignored), so neither egg-info nor build/ lands in it. The wheel's dependencies come
from the package registry, as for any user (about 15 s here with pip's cache).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from cluster.testing import free_port
from tests.procs import ROOT

pytestmark = pytest.mark.slow

JOB = """\
import cluster

cluster.init()
print("gathered", cluster.allgather_object(cluster.get_rank()), flush=True)
cluster.finalize()
"""


def _clean_env() -> dict[str, str]:
    """This environment without what would lead Python back to the checkout or its venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args,
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, f"{args}: {result.returncode}\n{result.stdout}{result.stderr}"
    return result


def _source_copy(target: Path) -> Path:
    """The checkout's files that git sees (tracked, and untracked ones not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet committed is listed too
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/ with the wheel and the sdist of this checkout."""
    tmp = tmp_path_factory.mktemp("package")
    source = _source_copy(tmp / "src")
    dist = tmp / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)], tmp, 300)
    return dist


def test_the_wheel_carries_the_run_time_files_and_no_tests(built: Path) -> None:
    (wheel,) = built.glob("*.whl")
    assert wheel.name.startswith("mscluster_grpc-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cluster/py.typed" in names
    for module in ("scheduler_pb2.py", "scheduler_pb2_grpc.py", "peer_state_pb2.py"):
        assert f"cluster/v1/{module}" in names
    assert "cluster/v1/scheduler_pb2.pyi" in names  # the messages' types, for mypy users
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/"))]
    assert all(n.startswith(("cluster/", "mscluster_grpc-")) for n in names), names
    (sdist,) = built.glob("*.tar.gz")
    checked = _run([sys.executable, "-m", "twine", "check", str(wheel), str(sdist)], built, 60)
    assert checked.stdout.count("PASSED") == 2, checked.stdout


def test_the_sdist_regenerates_the_protocol_code_and_carries_the_license(
    built: Path, tmp_path: Path
) -> None:
    """A user building from the sdist can regenerate cluster/v1/ from its .proto files with
    the one command (`python scripts/gen_protos.py`), and gets what is in it; and the license
    files of the checkout (`LICEN[CS]E*`, `COPYING*`, `NOTICE*`) are in it. The sdist had
    neither protos/ nor the command."""
    (sdist,) = built.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    (source,) = tmp_path.iterdir()
    protos = sorted(p.relative_to(ROOT) for p in (ROOT / "protos").rglob("*.proto"))
    assert protos
    assert sorted(p.relative_to(source) for p in (source / "protos").rglob("*.proto")) == protos
    licenses = ("LICEN[CS]E*", "COPYING*", "NOTICE*")
    for pattern in licenses:
        assert sorted(p.name for p in source.glob(pattern)) == sorted(
            p.name for p in ROOT.glob(pattern)
        )
    fresh = tmp_path / "fresh"
    _run(
        [sys.executable, str(source / "scripts" / "gen_protos.py"), "--out", str(fresh)],
        source,
        120,
    )
    generated = sorted((fresh / "cluster" / "v1").glob("*_pb2*"))
    shipped = sorted((source / "cluster" / "v1").glob("*_pb2*"))
    assert [p.name for p in generated] == [p.name for p in shipped]
    assert [p.read_bytes() for p in generated] == [p.read_bytes() for p in shipped]


def test_the_wheel_runs_a_job_from_a_fresh_venv_outside_the_checkout(
    built: Path, tmp_path: Path
) -> None:
    assert not tmp_path.resolve().is_relative_to(ROOT)
    (wheel,) = built.glob("*.whl")
    venv = tmp_path / "venv"
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], tmp_path, 600)
    installed = time.monotonic() - started
    # The installed package, not this checkout's.
    where = _run([str(python), "-c", "import cluster; print(cluster.__file__)"], tmp_path, 60)
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    version = _run([str(venv / "bin" / "mscluster"), "--version"], tmp_path, 60)
    assert version.stdout.startswith("mscluster-grpc "), version.stdout
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.py").write_text(JOB)
    args = [str(venv / "bin" / "mscluster"), "run", "--worker-num", "2", "--local-worker-num"]
    args += ["2", "--master-port", str(free_port()), "job.py"]
    result = _run(args, job, 120)
    assert "job finished: 2 local workers exited 0" in result.stderr, result.stderr
    for rank in range(2):
        assert "gathered [0, 1]" in (job / "logs" / f"worker_{rank}.log").read_text()
    print(f"venv and install: {installed:.1f} s")
