"""The tutorials' quick-start network, data parallel over every worker, in numpy.

Dense(32->16), ReLU, Dense(16->16), MSE loss, Momentum(lr=0.2, momentum=0.1). Fixed random data
(the same on every worker) is cut into global batches by step, and each rank takes its shard of
the step's batch; gradients are averaged with `cluster.allreduce`. With recovery on, a
`cluster.TrainingLoop` saves checkpoints and rolls every worker back after a failure, so a run
with faults ends with bit-for-bit the parameters of a run without.

    mscluster run --worker-num 4 --local-worker-num 4 --enable-recovery \\
        --recovery-path state --max-restarts 2 examples/train_mlp.py --out out

Each step prints `epoch: <e> step: <s>, loss is <x>` (the loss of the whole global batch). With
--out DIR, rank 0 writes the final parameters to DIR/final.npz and their SHA-256 to
DIR/final.sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import numpy as np

import cluster

SAMPLES = 1024
GLOBAL_BATCH = 64
IN, HIDDEN, OUT = 32, 16, 16
LR, MOMENTUM = 0.2, 0.1
PARAMS = ("w1", "b1", "w2", "b2")


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets, the same on every worker (fixed seed)."""
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((SAMPLES, IN))
    teacher = rng.standard_normal((IN, OUT)) / np.sqrt(IN)
    y = np.tanh(x @ teacher) + 0.05 * rng.standard_normal((SAMPLES, OUT))
    return x, y


def initial_state() -> dict[str, np.ndarray]:
    """Parameters and momentum buffers, the same on every worker (fixed seed)."""
    rng = np.random.default_rng(7)
    params = {
        "w1": rng.standard_normal((IN, HIDDEN)) * np.sqrt(2.0 / IN),
        "b1": np.zeros(HIDDEN),
        "w2": rng.standard_normal((HIDDEN, OUT)) * np.sqrt(1.0 / HIDDEN),
        "b2": np.zeros(OUT),
    }
    return {**params, **{f"v_{k}": np.zeros_like(v) for k, v in params.items()}}


def shard(step: int, rank: int, size: int) -> slice:
    """This rank's rows of the step's global batch: the data position follows the step."""
    start = (step * GLOBAL_BATCH) % SAMPLES
    per_rank = GLOBAL_BATCH // size
    return slice(start + rank * per_rank, start + (rank + 1) * per_rank)


def gradients(
    state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Summed squared error over this shard and its gradients (divided by the global batch
    later, after the allreduce)."""
    h_pre = x @ state["w1"] + state["b1"]
    h = np.maximum(h_pre, 0.0)
    out = h @ state["w2"] + state["b2"]
    diff = out - y
    loss = float(np.sum(diff * diff))
    d_out = 2.0 * diff
    d_h = (d_out @ state["w2"].T) * (h_pre > 0)
    grads = {"w1": x.T @ d_h, "b1": d_h.sum(0), "w2": h.T @ d_out, "b2": d_out.sum(0)}
    return loss, grads


def digest(state: dict[str, np.ndarray]) -> str:
    sha = hashlib.sha256()
    for name in PARAMS:
        sha.update(np.ascontiguousarray(state[name], dtype=np.float64).tobytes())
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every k steps")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept per rank")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--out", type=Path, help="rank 0 writes final.npz and final.sha256 here")
    parser.add_argument("--checkpoint-dir", type=Path, help="default: OUT/checkpoints")
    parser.add_argument(
        "--memory-snapshot",
        type=int,
        default=cluster.CheckpointConfig.memory_snapshot,
        help="bytes of state kept in memory at each step boundary (0: off, roll back to disk)",
    )
    args = parser.parse_args()

    cluster.init()  # in the scheduler role this serves the job and exits
    rank, size = cluster.get_rank(), cluster.get_group_size()
    if GLOBAL_BATCH % size:
        raise SystemExit(f"the global batch ({GLOBAL_BATCH}) must divide among {size} workers")
    x, y = dataset()
    state = initial_state()
    directory = args.checkpoint_dir or (args.out or Path("checkpoints")) / "checkpoints"
    checkpoints = cluster.CheckpointManager(
        directory,
        "mlp",
        cluster.CheckpointConfig(args.save_every, args.keep, memory_snapshot=args.memory_snapshot),
    )

    def set_state(saved: dict[str, np.ndarray]) -> None:
        state.update(saved)

    loop = cluster.TrainingLoop(args.steps, checkpoints, lambda: state, set_state)
    steps_per_epoch = SAMPLES // GLOBAL_BATCH
    for step in loop:
        with loop.step():
            rows = shard(step, rank, size)
            loss, grads = gradients(state, x[rows], y[rows])
            # One allreduce for the loss and every gradient: summed in rank order, the same
            # bits on every worker.
            flat = np.concatenate([[loss], *(grads[k].ravel() for k in PARAMS)])
            total = cluster.allreduce(flat, "sum") / GLOBAL_BATCH
            offset = 1
            for name in PARAMS:
                grad = total[offset : offset + state[name].size].reshape(state[name].shape)
                offset += state[name].size
                velocity = MOMENTUM * state[f"v_{name}"] + grad
                state[f"v_{name}"] = velocity
                state[name] = state[name] - LR * velocity
            epoch, in_epoch = divmod(step, steps_per_epoch)
            print(
                f"epoch: {epoch + 1} step: {in_epoch + 1}, loss is {total[0] / OUT:.6f}", flush=True
            )
            if args.step_delay > 0:
                time.sleep(args.step_delay)
    # What failures cost this worker: steps it computed again, and the rollbacks.
    print(f"steps redone: {loop.steps_redone} in {loop.rollbacks} rollbacks", flush=True)
    if rank == 0 and args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        np.savez(args.out / "final.npz", **{k: state[k] for k in PARAMS})
        (args.out / "final.sha256").write_text(digest(state) + "\n")
        print(f"final parameters: {args.out / 'final.npz'} sha256 {digest(state)}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
