"""The job secret that the nodes of a Slurm step share through their working directory."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.tools import slurm, slurm_io

STEP = {
    "SLURM_JOB_ID": "31",
    "SLURM_STEP_ID": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "n[1-2]",
}


def node(rank: int, nodes: int = 2, **changes: str) -> slurm.Allocation:
    env = {**STEP, "SLURM_NODEID": str(rank), "SLURM_STEP_NUM_NODES": str(nodes), **changes}
    found = slurm.allocation_from_env({**env, "SLURM_STEP_NUM_TASKS": str(nodes)})
    assert found is not None
    return found


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_node_zero_makes_the_secret_and_every_node_copies_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the job's working directory, shared by the nodes
    first = slurm_io.share_secret(node(0), Path("logs/node0"))
    second = slurm_io.share_secret(node(1), Path("logs/node1"))
    shared = tmp_path / ".mscluster" / "slurm-31.2.r0.secret"
    assert first == Path("logs/node0/job.secret")
    assert first.read_text() == second.read_text() == shared.read_text()
    assert len(first.read_text().strip()) == 64  # 32 random bytes, hex
    assert mode(shared.parent) == 0o700
    assert (mode(shared), mode(first), mode(second)) == (0o600, 0o600, 0o600)
    assert sorted(p.name for p in shared.parent.iterdir()) == [shared.name]  # no temporary left
    slurm_io.remove_shared_secret(node(1))  # not node 0's: it stays
    assert shared.exists()
    slurm_io.remove_shared_secret(node(0))
    assert not shared.exists()


def test_every_step_gets_a_new_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    one = slurm_io.share_secret(node(0), Path("a")).read_text()
    two = slurm_io.share_secret(node(0), Path("b")).read_text()
    assert one != two


def test_a_requeued_job_never_reads_the_secret_its_run_before_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A requeue keeps the job id and starts the steps at 0 again. The first run's node 0 died
    # with its node, so its shared secret (and a temporary it was writing) is still there.
    monkeypatch.chdir(tmp_path)
    first = slurm_io.share_secret(node(0), Path("run0/node0")).read_text()
    shared = tmp_path / ".mscluster"
    (shared / ".slurm-31.2.r0.secret.0123456789abcdef.tmp").write_text("half")
    (shared / "slurm-31.5.r0.secret").write_text("another step's\n")
    (shared / "slurm-32.2.r0.secret").write_text("another job's\n")
    again = {"SLURM_RESTART_COUNT": "1"}
    # Node 1 of the requeued run reaches the secret before node 0 does: it waits for node 0's.
    with pytest.raises(ConfigError, match="did not write the job secret"):
        slurm_io.share_secret(node(1, **again), Path("logs/node1"), wait_s=0.3)
    zero = slurm_io.share_secret(node(0, **again), Path("logs/node0")).read_text()
    one = slurm_io.share_secret(node(1, **again), Path("logs/node1")).read_text()
    assert zero == one != first
    # Node 0 removed what the run before left of this job, and nothing else.
    left = sorted(p.name for p in shared.iterdir())
    assert left == ["slurm-31.2.r1.secret", "slurm-32.2.r0.secret"]


def test_a_requeued_step_with_recovery_shares_the_secret_node_zero_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Recovery on: the step's saved state resumes only under the secret it was saved with, which
    # node 0's log directory holds from the run before; without recovery a run gets a new one.
    monkeypatch.chdir(tmp_path)
    first = slurm_io.share_secret(node(0), Path("logs/node0"), keep=True).read_text()
    slurm_io.share_secret(node(1), Path("logs/node1"), keep=True)
    again = {"SLURM_RESTART_COUNT": "1"}
    zero = slurm_io.share_secret(node(0, **again), Path("logs/node0"), keep=True).read_text()
    one = slurm_io.share_secret(node(1, **again), Path("logs/node1"), keep=True).read_text()
    assert zero == one == first
    assert sorted(p.name for p in (tmp_path / ".mscluster").iterdir()) == ["slurm-31.2.r1.secret"]
    later = {"SLURM_RESTART_COUNT": "2"}
    assert slurm_io.share_secret(node(0, **later), Path("logs/node0")).read_text() != first


def test_node_zero_keeps_only_a_secret_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    held = tmp_path / "logs" / "node0" / "job.secret"
    held.parent.mkdir(parents=True)
    held.write_text("f" * 64 + "\n")
    held.chmod(0o644)  # not a file the launcher made: others may have read it
    zero = slurm_io.share_secret(node(0), Path("logs/node0"), keep=True).read_text()
    assert zero != "f" * 64 + "\n"
    assert mode(held) == 0o600


@pytest.mark.parametrize("value", ["x", "-1"])
def test_a_bad_restart_count_is_a_config_error_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT"):
        node(0, SLURM_RESTART_COUNT=value)


def test_a_node_waits_for_node_zero_and_then_says_what_to_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        slurm_io.share_secret(node(1), Path("logs/node1"), wait_s=0.3)
    message = str(caught.value)
    assert "node 0 of Slurm job 31 step 2, node 1 of 2 (n[1-2]) did not write" in message
    assert str(tmp_path / ".mscluster" / "slurm-31.2.r0.secret") in message
    assert "is the working directory shared by the nodes" in message
    assert "CLUSTER_JOB_SECRET_FILE" in message
    assert not (tmp_path / "logs").exists()


def test_an_unwritable_place_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").write_text("a file where the log directory should be")
    with pytest.raises(ConfigError, match=r"cannot write the job secret to .*logs/node0/job"):
        slurm_io.share_secret(node(0), Path("logs/node0"))


def test_a_secret_is_shared_only_by_several_nodes_when_none_is_given() -> None:
    assert slurm_io.shares_secret(node(0), {})
    assert not slurm_io.shares_secret(node(0, nodes=1), {})
    assert not slurm_io.shares_secret(None, {})
    assert not slurm_io.shares_secret(node(0), {"CLUSTER_JOB_SECRET_FILE": "/etc/job.secret"})
    assert not slurm_io.shares_secret(node(0), {"CLUSTER_JOB_SECRET": "s"})
