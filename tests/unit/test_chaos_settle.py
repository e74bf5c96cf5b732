"""`mscluster chaos` takes msrun's variables of its environment (MS_NODE_TIMEOUT,
MS_RECOVERY_PATH, MS_TOPO_TIMEOUT, MS_ENABLE_RECOVERY) as `mscluster run` does
(`launch_setup.settle`): as the options' defaults, an option given winning."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.tools.chaos_run import ChaosSpec, spec_of
from cluster.tools.cli_args import add_run_arguments

CHAOS = argparse.Namespace(
    faults="kill", every=5.0, duration=10.0, seed=0, count=None, report=None, standbys=0
)


def _spec(run_args: list[str], env: dict[str, str], out: io.StringIO) -> ChaosSpec:
    parser = argparse.ArgumentParser(add_help=False)
    add_run_arguments(parser)
    run = parser.parse_args([*run_args, "train.py"])
    return spec_of(CHAOS, run, 2, Path("logs"), env=env, out=out)


def test_exported_variables_are_the_run_options_defaults(tmp_path: Path) -> None:
    env = {
        "MS_ENABLE_RECOVERY": "1",
        "MS_RECOVERY_PATH": str(tmp_path / "state"),
        "MS_NODE_TIMEOUT": "7",
        "MS_TOPO_TIMEOUT": "40",
    }
    out = io.StringIO()
    spec = _spec([], env, out)
    assert spec.node_timeout_s == 7.0
    assert spec.topo_timeout_s == 40.0
    assert spec.recovery_path == tmp_path / "state"
    assert out.getvalue() == ""


def test_an_option_given_wins_over_its_variable_and_says_so() -> None:
    out = io.StringIO()
    spec = _spec(["--node-timeout", "5"], {"MS_NODE_TIMEOUT": "7"}, out)
    assert spec.node_timeout_s == 5.0
    assert "MS_NODE_TIMEOUT=7 of this environment is not used: --node-timeout 5" in out.getvalue()


def test_without_variables_the_chaos_defaults_stay() -> None:
    spec = _spec([], {}, io.StringIO())
    assert (spec.node_timeout_s, spec.topo_timeout_s, spec.recovery_path) == (3.0, None, None)


def test_a_bad_variable_is_one_line_naming_it() -> None:
    with pytest.raises(ConfigError, match="MS_NODE_TIMEOUT"):
        _spec([], {"MS_NODE_TIMEOUT": "soon"}, io.StringIO())


def _refused(tmp_path: Path, given: list[str], env: dict[str, str]) -> str:
    """`mscluster chaos -- --worker-num 2 --log-dir LOGS GIVEN train.py` run as a user runs it
    with `env`, refused: its one line (exit 2, nothing written in the log directory)."""
    script = tmp_path / "train.py"
    script.write_text("")
    logs = tmp_path / "logs"
    run = ["--worker-num", "2", "--log-dir", str(logs), *given, str(script)]
    done = subprocess.run(
        [sys.executable, "-m", "cluster", "chaos", "--duration", "1", "--", *run],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip().splitlines()
    assert len(said) == 1, done.stderr
    assert not logs.exists()
    return said[0]


def test_recovery_turned_off_by_the_environment_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """Run as a user runs it: one line, exit 2, nothing written in the log directory."""
    said = _refused(tmp_path, [], {**os.environ, "MS_ENABLE_RECOVERY": "0"})
    assert "MS_ENABLE_RECOVERY=0 of this environment turns recovery off" in said


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        (
            ["--lease", "5"],
            "--lease is the leader's hold on a state store in etcd, and this job has none: "
            "give --state-url with it, or leave --lease out",
        ),
        (
            ["--state-url", "etcd://127.0.0.1:1/jobs/a", "--lease", "0"],
            "--lease='0' must be between 2 and 3600 seconds (etcd lengthens a lease shorter "
            "than 2 s anyway)",
        ),
    ],
)
def test_a_lease_is_refused_as_mscluster_run_refuses_it(
    tmp_path: Path, given: list[str], refusal: str
) -> None:
    """`--lease` after `--` without `--state-url`, or one etcd would not grant: chaos ran the
    job and ignored it without a word, where `mscluster run` (and `mscluster scheduler`)
    refuses it. The same line, exit 2, nothing started or written in the log directory."""
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_STATE_URL"}
    assert _refused(tmp_path, given, env) == f"mscluster: ConfigError: {refusal}"
