"""A recoverable loop of replicas (`CheckpointConfig(replicated=True)`): each step adds 1 to
every element of the state on every rank, and the ranks meet at a barrier. Checkpoints go to
CKPT_DIR/rank_<r>/ every SAVE_EVERY steps. Node '1' dies where it is told (exit 1), so that its
rank goes to a spare started beside the job; every worker prints `node <id> rank <r> final w
<value>` at the end.

    MS_ROLE=MS_WORKER ... python replicated_counter.py CKPT_DIR [--steps N] [--save-every K]
        [--early] [--die-in-step S | --die-at-the-end | --linger-after-the-loop]
        [--spare-lingers-after-the-loop] [--fetch-on-cue FILE] [--all-die-in-step S]

`--early`: the CheckpointManager is made before `cluster.init()`. `--die-in-step S`: node '1'
exits 1 in step S, before its barrier, once every rank holds its newest checkpoint (the
scheduler's answer to its report says so). `--die-at-the-end`: node '1' exits 1 once every rank
holds the final step on disk, before the loop's end barrier: the next generation's rollback
step is the end. `--linger-after-the-loop`: node '1', in its first process, waits after its
loop (past the end barrier) until it is killed; `--spare-lingers-after-the-loop`: so does the spare
'spare-0', in its first process. `--fetch-on-cue FILE`: a fetch of a peer's
state says `fetching step S` and waits until FILE exists before it begins (the test stops the
peer that holds the state meanwhile). `--all-die-in-step S`: every worker exits 1 as it begins
step S in generation 2 (the whole job fails at once: no survivor holds a step in memory in the
next generation).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import cluster
from cluster.api import peer_state, runtime
from cluster.testing import wait_until

LINGER_S = 120.0


def dying_at(steps: int) -> Callable[[list[int]], int]:
    """A report to the scheduler that ends this process once every rank holds step `steps`."""

    def report(held: list[int]) -> int:
        answer = runtime.report_checkpoints(held)
        if steps in held:
            wait_until(
                lambda: runtime.report_checkpoints(held) == steps,
                60,
                "every rank to hold the final step",
            )
            print(f"node 1 dies: every rank holds step {steps}", flush=True)
            os._exit(1)
        return answer

    return report


def every_rank_holds(checkpoints: cluster.CheckpointManager) -> str:
    """Once this rank's newest checkpoint is written, wait until every rank holds it (the
    scheduler's answer to a report says so); what to say of it ("" when none was saved)."""
    checkpoints.flush()
    held = checkpoints.steps()
    if not held:
        return ""
    wait_until(
        lambda: runtime.report_checkpoints(held) == held[-1],
        60,
        f"every rank to hold step {held[-1]}",
    )
    return f" (every rank holds step {held[-1]})"


def fetching_on_cue(cue: Path) -> None:
    """Have each fetch of a peer's state wait for `cue` (at most LINGER_S) before it begins."""
    fetch = peer_state.fetch

    def on_cue(*args: object, **kwargs: object) -> object:
        print(f"fetching step {args[1]}", flush=True)
        wait_until(cue.exists, LINGER_S, "the test's cue")
        return fetch(*args, **kwargs)  # type: ignore[arg-type]

    peer_state.fetch = on_cue  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--early", action="store_true")
    parser.add_argument("--die-in-step", type=int, default=-1)
    parser.add_argument("--die-at-the-end", action="store_true")
    parser.add_argument("--linger-after-the-loop", action="store_true")
    parser.add_argument("--spare-lingers-after-the-loop", action="store_true")
    parser.add_argument("--fetch-on-cue", type=Path)
    parser.add_argument("--all-die-in-step", type=int, default=-1)
    args = parser.parse_args()
    if args.fetch_on_cue is not None:
        fetching_on_cue(args.fetch_on_cue)
    node = os.environ["MS_NODE_ID"]
    config = cluster.CheckpointConfig(save_checkpoint_steps=args.save_every, keep_checkpoint_max=3)
    dies = node == "1"
    report = dying_at(args.steps) if dies and args.die_at_the_end else None

    def manager() -> cluster.CheckpointManager:
        return cluster.CheckpointManager(args.directory, "w", config, report=report)

    early = manager() if args.early else None
    cluster.init()
    checkpoints = early or manager()
    state = {"w": np.zeros(1000)}
    loop = cluster.TrainingLoop(args.steps, checkpoints, lambda: state, state.update)
    for step in loop:
        with loop.step():
            if dies and step == args.die_in_step:
                held = every_rank_holds(checkpoints)
                print(f"node 1 dies in step {step}{held}", flush=True)
                os._exit(1)
            if step == args.all_die_in_step and cluster.get_generation() == 2:
                print(f"node {node} dies in step {step} of generation 2", flush=True)
                os._exit(1)
            state["w"] = state["w"] + 1
            cluster.barrier()
    print(f"node {node} rank {cluster.get_rank()} final w {state['w'][0]}", flush=True)
    spare = node == "spare-0"
    lingers = args.linger_after_the_loop if dies else spare and args.spare_lingers_after_the_loop
    if lingers and not cluster.is_rejoin():
        print(f"node {node} lingers after its loop", flush=True)
        time.sleep(LINGER_S)  # sleep-ok: the fault itself; the test kills this process
    cluster.finalize()


if __name__ == "__main__":
    main()
