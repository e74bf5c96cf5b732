"""scripts/demo sets up only what the demo needs; scripts/test (and so CI) sets up everything,
the test servers included.

Each script's own `scripts/setup` line is run with --dry-run, on a PATH where none of the test
servers is installed (and a stand-in apt-get that fails if called): scripts/setup then says
what it would install, and installs nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests import docs_blocks
from tests.procs import ROOT

SERVER_WORDS = ("etcd", "prometheus", "slurm", "chromium", "iproute2", "test servers", "apt-get")
TOOLS = ("dirname", "sed", "id", "sort")


def setup_options(script: str) -> list[str]:
    """The options that `script` passes to scripts/setup (it calls it exactly once)."""
    calls = re.findall(r"bash scripts/setup\b([^\n]*)", (ROOT / script).read_text())
    assert len(calls) == 1, calls
    return calls[0].split()


def dry_run(tmp_path: Path, options: list[str]) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\necho 'apt-get called' >&2\nexit 1\n")
    apt.chmod(0o755)
    env = {"PATH": str(bin_dir), "VENV": str(tmp_path / "venv"), "HOME": str(tmp_path)}
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, str(ROOT / "scripts" / "setup"), *options, "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "apt-get called" not in done.stderr
    return done.stdout + done.stderr


def test_the_demo_sets_up_the_package_and_no_test_server(tmp_path: Path) -> None:
    options = setup_options("scripts/demo")
    assert "--demo" in options
    said = dry_run(tmp_path, options)
    lines = said.splitlines()
    assert lines[-1].endswith(" -m pip install --quiet --disable-pip-version-check -e ."), said
    for word in (*SERVER_WORDS, "install_packages", "checkov", "dev", "torch"):
        assert word not in said.lower(), said


def test_the_tests_and_ci_set_up_everything_the_test_servers_included(tmp_path: Path) -> None:
    assert "exec bash scripts/test" in (ROOT / ".ci" / "run").read_text()
    assert "CLUSTER_REQUIRE_SERVERS=1" in (ROOT / ".ci" / "run").read_text()
    options = setup_options("scripts/test")
    assert "--demo" not in options
    said = dry_run(tmp_path, options)
    assert "setup: the test servers: etcd, Prometheus, Slurm, Chromium, iproute2" in said
    if os.geteuid() == 0:  # as CI: root with apt-get, so it would install every missing one
        installs = re.findall(r"would run: install_packages (.*)", said)
        assert installs, said
        assert set(installs[0].split()) >= {"etcd-server", "prometheus", "slurm-wlm", "chromium"}
    else:  # it says which tests will skip
        assert "setup: etcd is missing" in said, said
    assert "-e .[dev,torch,etcd]" in said
    assert "checkov==" in said


def test_the_tests_set_up_the_cpu_build_of_torch_first(tmp_path: Path) -> None:
    """PyPI's torch for Linux is the CUDA build (several GB of nvidia-* wheels): scripts/setup
    installs torch alone first, the pin of the [torch] extra from PyTorch's CPU index (or a
    wheel pip finds on the machine), so that the extras find it there."""
    pin = re.search(
        r'^torch = \["(torch==[0-9.]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M
    )
    assert pin is not None
    lines = dry_run(tmp_path, setup_options("scripts/test")).splitlines()
    torch = [n for n, line in enumerate(lines) if line.endswith(f" {pin[1]}")]
    extras = [n for n, line in enumerate(lines) if "-e .[dev,torch,etcd]" in line]
    assert torch, lines
    assert "--no-deps --index-url https://download.pytorch.org/whl/cpu " in lines[torch[0]]
    assert torch[0] < extras[0], lines


def test_the_demo_ends_with_the_line_that_activates_its_environment(tmp_path: Path) -> None:
    """scripts/demo, in a copy whose set-up and training steps are stand-ins: after the demo's
    own end it says how to put $VENV's python and mscluster on the shell's PATH, which the
    tutorial's next commands need (a plain shell has neither)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "scripts" / "demo", tmp_path / "scripts" / "demo")
    (tmp_path / "scripts" / "setup").write_text("echo set up\n")
    (tmp_path / "examples" / "run_training_demo.sh").write_text("echo identical\n")
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, str(tmp_path / "scripts" / "demo")],
        env={**os.environ, "VENV": ".venv-demo"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["set up", "identical"], done.stdout
    assert lines[-1] == "  . .venv-demo/bin/activate", done.stdout


def test_the_tutorial_activates_the_demos_environment_before_it_runs_python() -> None:
    """The tutorial's commands after the demo run `python` and `mscluster` from .venv: the page
    says to activate it before its first such command."""
    page = ROOT / "docs" / "tutorial.md"
    lines = page.read_text().splitlines()
    first = min(b.line for b in docs_blocks.blocks(page) if b.kind == "run")
    activate = [n for n, line in enumerate(lines, 1) if line.startswith(". .venv/bin/activate")]
    assert activate, "docs/tutorial.md never says `. .venv/bin/activate`"
    assert activate[0] < first, (activate, first)
