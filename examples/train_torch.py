"""The tutorials' quick-start network, data parallel over every worker, in torch (DDP on gloo).

examples/train_mlp.py with torch: Dense(32->16), ReLU, Dense(16->16), MSE loss, Momentum(lr=0.2,
momentum=0.1) as torch.optim.SGD (with dampening 0 and without Nesterov, torch's momentum is
MindSpore's: v = momentum * v + grad; w -= lr * v). The same fixed data and initial parameters
as train_mlp.py, the same batches by step; gradients are averaged by DistributedDataParallel
over a gloo process group that `cluster.torch` makes from the job. A `cluster.TrainingLoop`
saves the model's and the optimizer's state dicts and, after a failure, rolls every worker back
and re-makes the process group for the job's new generation, so a run with faults ends with
bit-for-bit the parameters of a run without: float64, deterministic algorithms, one thread.

    mscluster run --worker-num 4 --local-worker-num 4 --enable-recovery \\
        --recovery-path state --max-restarts 2 examples/train_torch.py --out out

Each step prints `epoch: <e> step: <s>, loss is <x>` (the loss of the whole global batch). With
--out DIR, rank 0 writes the final parameters to DIR/final.npz and their SHA-256 (of their
float64 bytes, in the model's parameter order) to DIR/final.sha256.

On GPUs, one worker per GPU of its host (`torch.cuda.set_device(cluster.get_local_rank())`),
gradients averaged over NCCL:

    mscluster run --worker-num 2 examples/train_torch.py --device cuda --backend nccl
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # the package without its `torch` extra (scripts/demo installs none)
    raise SystemExit(
        "examples/train_torch.py needs torch: pip install 'mscluster-grpc[torch]' (the CPU "
        "build: docs/install.md)"
    ) from None
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cluster
import cluster.torch

SAMPLES = 1024
GLOBAL_BATCH = 64
IN, HIDDEN, OUT = 32, 16, 16
LR, MOMENTUM = 0.2, 0.1


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, the same on every worker (fixed seed; train_mlp.py's data)."""
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((SAMPLES, IN))
    teacher = rng.standard_normal((IN, OUT)) / np.sqrt(IN)
    y = np.tanh(x @ teacher) + 0.05 * rng.standard_normal((SAMPLES, OUT))
    return torch.from_numpy(x), torch.from_numpy(y)


def network() -> nn.Sequential:
    """The network, initialised the same on every worker (fixed seed; train_mlp.py's values)."""
    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((IN, HIDDEN)) * np.sqrt(2.0 / IN)
    w2 = rng.standard_normal((HIDDEN, OUT)) * np.sqrt(1.0 / HIDDEN)
    net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)).double()
    with torch.no_grad():
        for layer, weight in ((net[0], w1), (net[2], w2)):
            layer.weight.copy_(torch.from_numpy(weight.T))  # torch stores (out, in)
            layer.bias.zero_()
    return net


def shard(step: int, rank: int, size: int) -> slice:
    """This rank's rows of the step's global batch: the data position follows the step."""
    start = (step * GLOBAL_BATCH) % SAMPLES
    per_rank = GLOBAL_BATCH // size
    return slice(start + rank * per_rank, start + (rank + 1) * per_rank)


def digest(net: nn.Module) -> str:
    sha = hashlib.sha256()
    for param in net.parameters():
        sha.update(param.detach().cpu().to(torch.float64).contiguous().numpy().tobytes())
    return sha.hexdigest()


class Trainer:
    """The network, its optimizer, and its DDP wrapper over the current generation's group.

    The wrapper (and the process group under it) is made at the first step, and again by
    set_state in every later generation, never before the loop: in a generation after the
    first, the loop's first collective is the workers' agreement on where to resume, and a
    newcomer (a promoted spare, a restarted worker) must meet the survivors there.
    """

    def __init__(self, per_rank: int, device: torch.device, backend: str) -> None:
        self.per_rank = per_rank
        self.backend = backend
        self.net = network().to(device)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=LR, momentum=MOMENTUM)
        self.model: DistributedDataParallel | None = None

    def _data_parallel(self) -> DistributedDataParallel:
        """DDP over the process group of the job's current generation. init_sync=False: every
        rank holds the same parameters already (the same seed, or the same checkpoint step),
        and then the wrapping makes no collective, so one rank may repeat it alone."""
        cluster.torch.init_process_group(self.backend)
        model = DistributedDataParallel(self.net, init_sync=False)
        # Gradients added in rank order: the same bits whether or not a rollback re-made the
        # wrapper (and with it DDP's bucket layout) before this step.
        model.register_comm_hook(None, cluster.torch.allreduce_in_rank_order)
        return model

    def get_state(self) -> dict[str, Any]:
        return {"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def set_state(self, saved: dict[str, Any]) -> None:
        """Put a checkpoint back, for a new generation: a new group (the old one has a dead or
        replaced peer), and a new wrapper over it (the old one's gradient hooks go with it).
        No group when the loop puts back its last step: no step follows, and a peer may have
        finished already (init_process_group then returns False)."""
        self.net.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.model = None
        if cluster.torch.init_process_group(self.backend):
            self.model = self._data_parallel()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One step on this rank's rows; the summed squared error of the whole global batch."""
        if self.model is None:  # the first step of the first generation
            self.model = self._data_parallel()
        self.optimizer.zero_grad(set_to_none=True)
        squared = ((self.model(x) - y) ** 2).sum()
        # DDP averages the ranks' gradients: this is the gradient of the summed squared error
        # averaged over the global batch, train_mlp.py's.
        (squared / self.per_rank).backward()
        self.optimizer.step()
        total = squared.detach().clone()
        dist.all_reduce(total)  # for the log line
        return total.item()


def arguments() -> argparse.Namespace:
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--backend", choices=cluster.torch.BACKENDS, help="default: nccl on cuda, else gloo"
    )
    args = parser.parse_args()
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    return args


def main() -> None:
    args = arguments()
    if args.device == "cuda":
        # Deterministic cuBLAS needs a fixed workspace (set before CUDA starts).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    # Bit-for-bit repeatable arithmetic: one thread (the same reduction order in every kernel)
    # and deterministic kernels only. Done before cluster.init(), with everything else that does
    # not depend on the rank: a hot spare waits inside init() until it takes a failed worker's
    # rank, and what it has done by then costs the job nothing when it does (torch's first
    # settings alone take over a second).
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    x, y = dataset()
    cluster.init()  # in the scheduler role this serves the job and exits
    rank, size = cluster.get_rank(), cluster.get_group_size()
    if GLOBAL_BATCH % size:
        raise SystemExit(f"the global batch ({GLOBAL_BATCH}) must divide among {size} workers")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = gpu_of_this_worker()
        x, y = x.to(device), y.to(device)
    trainer = Trainer(GLOBAL_BATCH // size, device, args.backend)
    directory = args.checkpoint_dir or (args.out or Path("checkpoints")) / "checkpoints"
    checkpoints = cluster.CheckpointManager(
        directory,
        "torch",
        cluster.CheckpointConfig(args.save_every, args.keep, memory_snapshot=args.memory_snapshot),
    )
    loop = cluster.TrainingLoop(args.steps, checkpoints, trainer.get_state, trainer.set_state)
    steps_per_epoch = SAMPLES // GLOBAL_BATCH
    for step in loop:
        with loop.step():
            rows = shard(step, rank, size)
            loss = trainer.step(x[rows], y[rows]) / GLOBAL_BATCH / OUT
            epoch, in_epoch = divmod(step, steps_per_epoch)
            print(f"epoch: {epoch + 1} step: {in_epoch + 1}, loss is {loss:.6f}", flush=True)
            if args.step_delay > 0:
                time.sleep(args.step_delay)
    print(f"steps redone: {loop.steps_redone} in {loop.rollbacks} rollbacks", flush=True)
    if rank == 0 and args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        arrays = {name: p.detach().cpu().numpy() for name, p in trainer.net.named_parameters()}
        np.savez(args.out / "final.npz", **arrays)
        (args.out / "final.sha256").write_text(digest(trainer.net) + "\n")
        print(
            f"final parameters: {args.out / 'final.npz'} sha256 {digest(trainer.net)}", flush=True
        )
    cluster.finalize()  # destroys the process group too


def gpu_of_this_worker() -> torch.device:
    """The GPU of this worker's local rank: one worker per GPU (NCCL refuses two ranks on one
    GPU, with an error that is harder to read than this one)."""
    local_rank, local_size = cluster.get_local_rank(), cluster.get_local_size()
    count = torch.cuda.device_count()
    if local_size > count:
        raise SystemExit(
            f"{local_size} workers on this host but {count} GPUs visible: run one worker per GPU"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


if __name__ == "__main__":
    main()
