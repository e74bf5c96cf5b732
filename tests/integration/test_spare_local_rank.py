"""A spare promoted onto another host takes a local rank free there, with real processes on two
loopback addresses: workers '0' and '1' advertise 127.0.0.1, worker '2' and the spare
127.0.0.2; worker '0' is SIGKILLed. The spare took local rank 0 beside worker 2, which had bound
its device by local rank 0 in generation 1 (and was told 1 in generation 2): two ranks of one
host on one GPU (NCCL's "Duplicate GPU detected", or an out-of-memory)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from cluster.testing import Process, free_port
from tests.procs import ROOT, Procs, job_env

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "local_ranks.py"
PLACE = re.compile(
    r"^node (\S+) rank (\d+) generation (\d+) local_rank (\d+) local_size (\d+)$", re.MULTILINE
)
LIMIT_S = 60


def places(*processes: Process) -> dict[tuple[str, int], tuple[int, int, int]]:
    """What each process said: (node id, generation) -> (rank, local rank, local size)."""
    said = {}
    for proc in processes:
        for node, rank, generation, local_rank, local_size in PLACE.findall(proc.output):
            said[node, int(generation)] = (int(rank), int(local_rank), int(local_size))
    return said


def test_a_spare_promoted_onto_another_host_takes_a_local_rank_free_there(
    processes: Procs, tmp_path: Path
) -> None:
    env = job_env(3, free_port(), MS_ENABLE_RECOVERY="1", MS_RECOVERY_PATH=str(tmp_path / "rec"))
    scheduler = processes.start_role("sched", "MS_SCHED", ["-m", "cluster", "scheduler"], env)

    def start(node: str, host: str, **extra: str) -> Process:
        node_env = {**env, "MS_NODE_ID": node, "CLUSTER_ADVERTISE_HOST": host, **extra}
        return processes.start_role(node, "MS_WORKER", [str(SCRIPT)], node_env)

    spare = start("spare-0", "127.0.0.2", CLUSTER_SPARE="1")
    spare.wait_for_output("as a spare", LIMIT_S)
    hosts = {"0": "127.0.0.1", "1": "127.0.0.1", "2": "127.0.0.2"}
    workers = {node: start(node, host) for node, host in hosts.items()}
    for node, worker in workers.items():
        worker.wait_for_output(f"node {node} rank {node} generation 1 ", LIMIT_S)
    workers["0"].signal(signal.SIGKILL)
    for proc in (spare, workers["1"], workers["2"], scheduler):
        assert proc.wait(LIMIT_S) == 0, proc.output
    assert "promoted: this spare takes rank 0 in generation 2" in spare.output, spare.output
    said = places(spare, *workers.values())
    assert said[("2", 1)] == (2, 0, 1)  # worker 2 binds its device by local rank 0
    assert said[("spare-0", 2)][1] != said[("2", 1)][1], said  # so the spare must not
    # Generation 2: worker 2 keeps local rank 0, the spare beside it takes 1; worker 1 keeps
    # its 1, alone on 127.0.0.1 now.
    assert said[("spare-0", 2)] == (0, 1, 2)
    assert said[("2", 2)] == (2, 0, 2)
    assert said[("1", 1)] == (1, 1, 2)
    assert said[("1", 2)] == (1, 1, 1)
