"""A Slurm step over two real hosts (network namespaces, tests/netns.py) whose names resolve the
way a Debian or Ubuntu /etc/hosts has them: each host's own name to 127.0.1.1, the other's to
its address. No Slurm daemons: each launcher gets the variables srun gives a task."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tests.netns import Host, two_hosts
from tests.procs import MSCLUSTER, Procs, private_copy, processes_running

NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/hosts on /etc/hosts


@contextlib.contextmanager
def hosts_files(entries: dict[Host, str]) -> Iterator[None]:
    """Each host's own /etc/hosts (as `ip netns exec` shows it), removed at the end."""
    made_top = not NETNS_ETC.exists()
    made: list[Path] = []
    try:
        for host, text in entries.items():
            directory = NETNS_ETC / host.namespace
            directory.mkdir(parents=True)
            made.append(directory)
            (directory / "hosts").write_text(text)
        yield
    finally:
        for directory in made:
            (directory / "hosts").unlink(missing_ok=True)
            directory.rmdir()
        if made_top:
            with contextlib.suppress(OSError):  # another test's namespace may use it now
                NETNS_ETC.rmdir()


def step_env(rank: int) -> dict[str, str]:
    return {
        **os.environ,
        "SLURM_JOB_ID": "7301",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "nodea,nodeb",
        "SLURM_NODEID": str(rank),
    }


def test_node_zero_whose_name_is_loopback_still_serves_the_other_node(
    processes: Procs, tmp_path: Path
) -> None:
    # nodea's own name resolves to 127.0.1.1 there: its scheduler listened on that alone, and
    # nodeb's workers were refused until MS_TOPO_TIMEOUT. It listens on nodea's address
    # towards nodeb now, and its workers advertise that address too.
    script = private_copy(tmp_path)
    with two_hosts() as (a, b):
        own = "127.0.0.1 localhost\n127.0.1.1 {}\n{} {}\n"
        files = {a: own.format("nodea", b.ip, "nodeb"), b: own.format("nodeb", a.ip, "nodea")}
        with hosts_files(files):
            args = [*MSCLUSTER, "run", "--cluster-time-out", "20", str(script)]
            runs = [
                processes.start(f"node{rank}", host.command(args), step_env(rank), tmp_path)
                for rank, host in enumerate((a, b))
            ]
            for run in runs:
                assert run.wait(60) == 0, run.output
    logs = tmp_path / "logs" / "7301.0"
    for rank in (0, 1):
        log = (logs / f"node{rank}" / f"worker_{rank}.log").read_text()
        assert f"allgather rank={rank} size=2 result=[0, 1]" in log
    assert f"listening on {a.ip}:" in (logs / "node0" / "scheduler.log").read_text()
    assert not processes_running(str(script))
