"""State from a live peer: a checkpoint of `--mb` MB moved between two local processes.

A child process runs a worker's state server (`cluster.worker.state_server`, plaintext, on
127.0.0.1) over a checkpoint written here by `CheckpointManager`; this process fetches it as a
newcomer does (`cluster.worker.state_fetch.fetch`: the gRPC stream, written to a temporary file,
fsynced, verified by the ordinary reader, which also rebuilds the state, then renamed and the
directory fsynced), a new file each round. Against it, in the same run:

- transfer only: the same stream written to /dev/null (no disk, no verification);
- local load: `checkpoint_files.read` of the same file from this host's disk (the page cache:
  it was just written), which is what a worker that holds the file pays instead.

The first round warms up and is not counted; figures are medians (and minima) over `--repeat`
rounds. Target (issue #15): the 100 MB state moves in under 0.5 s.

Usage: python benchmarks/peer_state.py [--mb 100] [--repeat 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol import peer_state
from cluster.storage import checkpoint_files
from cluster.storage.served import ServedCheckpoints
from cluster.worker import state_fetch
from cluster.worker.session import BackgroundLoop
from cluster.worker.state_server import StateServer

STEP = 1


def serve(root: Path) -> None:
    """The child: serve rank 0's checkpoints under `root` until stdin closes."""
    server = StateServer("127.0.0.1", 2)
    server.offer(ServedCheckpoints(root, "bench", 0))
    loop = BackgroundLoop("bench-state-server")
    loop.run(server.start(), timeout_s=10)
    print(server.published.encode().decode(), flush=True)
    sys.stdin.read()
    loop.run(server.stop(0.5), timeout_s=5)
    loop.stop()


def write_state(root: Path, mb: int) -> Path:
    rng = np.random.default_rng(0)
    count = mb * 1_000_000 // 4 // 4
    state = {f"layer{i}": rng.standard_normal(count, dtype=np.float32) for i in range(4)}
    config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=2)
    with CheckpointManager(root, "bench", config, rank=0, recovery=False) as checkpoints:
        checkpoints.save(STEP, state)
    return checkpoints.path(STEP)


def timed(action: object) -> float:
    start = time.perf_counter()
    action()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (a disk)")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peer-state-bench-") as tmp:
        run(Path(tmp), args.mb, args.repeat)


def run(tmp: Path, mb: int, repeat: int) -> None:
    source = write_state(tmp / "peer", mb)
    size = source.stat().st_size
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(tmp / "peer")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    loop = BackgroundLoop("bench-fetch")
    try:
        assert child.stdout is not None
        published = peer_state.Published.decode(child.stdout.readline().encode(), "peer")
        holder = state_fetch.Holder(0, "peer", published)
        wanted = peer_state.Request("bench", 1, STEP, True)
        dest_dir = tmp / "newcomer" / "rank_1"
        dest_dir.mkdir(parents=True)
        dest = dest_dir / source.name
        fetch_s, transfer_s, local_s = [], [], []
        for _ in range(repeat + 1):
            dest.unlink(missing_ok=True)
            fetch_s.append(timed(lambda: state_fetch.fetch(loop, [holder], wanted, dest)))
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                transfer_s.append(
                    timed(lambda: loop.run(state_fetch.receive(holder, wanted, null)))  # noqa: B023
                )
            finally:
                os.close(null)
            local_s.append(timed(lambda: checkpoint_files.read(source, STEP)))
        assert dest.read_bytes() == source.read_bytes()
    finally:
        loop.stop()
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)
    print(f"python benchmarks/peer_state.py --mb {mb} --repeat {repeat}")
    print(f"checkpoint file: {size / 1e6:.1f} MB, {repeat} rounds after one warm-up")
    for name, figures in (
        ("fetched from a peer (stream, write, fsync, verify, rename)", fetch_s[1:]),
        ("transfer only (stream to /dev/null)", transfer_s[1:]),
        ("local load from disk (read, verify; page cache)", local_s[1:]),
    ):
        median = statistics.median(figures)
        print(
            f"  {name:60s} median {median:.3f} s  min {min(figures):.3f} s  "
            f"({size / 1e6 / median:.0f} MB/s)"
        )


if __name__ == "__main__":
    main()
