"""Transcripts in etcd raft's style (`interaction_test.go` over `testdata/*.txt`): a scenario of
commands, each followed by what the control plane did, one line each, as the expectation.

    # a comment, kept
    register w0 w1 w2
    ----
    0.0s w0 hears: accepted, registered, generation 0 of job-0
    ...

The simulation (`control_plane.Sim`) runs without network faults and without collectives,
with MS_NODE_TIMEOUT at its default (30 s); saves land as soon as they are asked for until
`disk fails`. Commands:

- `cluster w0 w1 w2 s0 [sched-a sched-b]`: the job's node ids (one starting with "s" is a
  spare) and, for standbys on a simulated etcd, its schedulers (`sched-a` leads first); first;
- `register A B`, `start A`: start processes (a new process of a node id: its next
  incarnation), which register;
- `kill A`, `stop A`, `continue A`: the process dies, is stopped (SIGSTOP), continues;
- `partition [sched] A`, `heal A`: cut and mend the link between A and the scheduler;
- `partition sched-a etcd`, `heal sched-a etcd`, `stop sched-a`, `continue sched-a`,
  `kill sched-a`, `start sched-a`: the same for a scheduler, its link to etcd, its process;
- `report A 10 20`: A's rank holds the checkpoints of steps 10 and 20, and A says so;
- `tick 31s`: time passes (heartbeats, timeouts);
- `disk fails`, `disk heals`: saves stop landing, and land again; `save lands`: one lands;
- `restart sched`: the scheduler dies and starts again on what the disk holds;
- `stabilize`: every message in flight is delivered (and, unless the disk fails, saved).

Each line starts with the virtual time since the scenario began. The lines: what the scheduler
tells (`ready`, `failed`, `shutdown`, `evict`, `progress`), each save that lands (`saved`), a
restart, a scheduler that leads, stands by or steps down, and what a process hears in answer
to its registration (in a run of refusals, each node's first is shown, with their count).

`python tests/sim/transcript.py FILE...` prints a scenario's output; the test
(`test_transcripts.py`) compares it, and CLUSTER_REWRITE_TRANSCRIPTS=1 rewrites the files.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.scheduler.machine.ready import Ready
from tests.sim.control_plane import Process, Sim

TRANSCRIPTS = Path(__file__).parent / "transcripts"
MS_NODE_TIMEOUT_S = 30.0
SETTLE_BOUND = 100_000
NOTHING = "(nothing)"


class Scenario(Sim):
    """The simulation driven by commands; saves land at once while the disk works."""

    disk_ok: bool = True

    def new_incarnation(self, proc: Process) -> int:
        """Its next incarnation (1, 2, ...), not a random one: a transcript's lines read so."""
        return proc.incarnation + 1

    def carry_out(self, ready: Ready) -> None:
        super().carry_out(ready)
        if ready.save is not None and self.disk_ok:
            self.save_lands()

    def settle(self) -> None:
        """Deliver what is in flight (each hop takes a millisecond)."""
        for _ in range(SETTLE_BOUND):
            if not self.net.queue or self.net.next_at() - self.clock.now > 0.5:
                return
            self.time_passes(self.net.next_at() - self.clock.now)
        raise AssertionError(f"messages still in flight after {SETTLE_BOUND} deliveries")


def new_scenario(words: list[str]) -> Scenario:
    names = [n for n in words if not n.startswith("sched-")]
    workers = sum(1 for n in names if not n.startswith("s"))
    sim = Scenario(
        0,
        workers,
        spares=len(names) - workers,
        schedulers=max(1, len(words) - len(names)),
        names=names,
        node_timeout_s=MS_NODE_TIMEOUT_S,
        collective_steps=False,
        log=[],
    )
    sim.net.faults = False
    sim.next_beat = sim.clock.now + 1.0  # the first heartbeats a second after the start
    return sim


def perform(sim: Scenario, words: list[str]) -> None:
    verb, args = words[0], words[1:]
    if sim.ha is not None and args and args[0] in sim.ha.scheds:
        scheduler(sim, verb, args)
        sim.settle()
        return
    procs = [sim.processes[a] for a in args if a in sim.processes]
    if verb in ("register", "start"):
        for proc in procs:
            sim.start(proc)
    elif verb == "kill":
        sim.kill(procs[0])
    elif verb == "stop":
        procs[0].stopped = procs[0].running
    elif verb == "continue":
        sim.continue_(procs[0])
    elif verb == "partition":
        sim.net.partition(args[-1])
    elif verb == "heal":
        sim.net.heal(args[-1], sim.clock.now)
    elif verb == "report":
        report(sim, args[0], [int(a) for a in args[1:]])
    elif verb == "tick":
        sim.time_passes(float(args[0].removesuffix("s")))
    elif verb == "disk":
        sim.disk_ok = args[0] == "heals"
        if sim.disk_ok:
            sim.save_lands()
    elif verb == "save":
        sim.save_lands()
    elif verb == "restart" and args == ["sched"]:
        sim.restart_scheduler()
        sim.note(f"restarted: on revision {sim.stored['revision']}, {sim.state.phase.value}")
    elif verb == "stabilize":
        if sim.disk_ok:
            sim.save_lands()
    else:
        raise ValueError(f"unknown command: {' '.join(words)}")
    sim.settle()


def scheduler(sim: Scenario, verb: str, args: list[str]) -> None:
    """A command about a scheduler process (standbys) or its link to etcd."""
    assert sim.ha is not None
    ha, sched = sim.ha, sim.ha.scheds[args[0]]
    actions = {
        "partition": lambda: sim.net.partition(sched.name),
        "heal": lambda: sim.net.heal(sched.name, sim.clock.now),
        "stop": lambda: ha.stop(sched),
        "continue": lambda: ha.resume(sched),
        "kill": lambda: ha.kill(sched),
        "start": lambda: ha.restart(sched),
    }
    if verb not in actions:
        raise ValueError(f"unknown command for a scheduler: {verb} {' '.join(args)}")
    actions[verb]()


def report(sim: Scenario, node_id: str, steps: list[int]) -> None:
    """The process's rank holds checkpoints of `steps`; the process reports them."""
    proc = sim.processes[node_id]
    if proc.rank is None:
        raise ValueError(f"{node_id} holds no rank to report checkpoints of")
    files = sim.files.setdefault(proc.rank, set())
    files.update(steps)
    proc.reports += 1
    generation = proc.generations.get(proc.job, [0])[-1]
    body = ("report", proc.incarnation, sorted(files), generation, proc.reports)
    sim.send(proc, body)


REFUSED = re.compile(r"^[\d.]+s (\S+ hears: refused \(\w+)")


def shown(lines: list[str]) -> list[str]:
    """The lines; in a run of refusals, each node's first shown once, with its count."""
    out: list[str] = []
    counts: list[int] = []
    run: dict[str, int] = {}  # in the current run of refusals: node -> index in `out`
    for line in lines:
        match = REFUSED.match(line)
        if match is None:
            run.clear()
        elif match.group(1) in run:
            counts[run[match.group(1)]] += 1
            continue
        else:
            run[match.group(1)] = len(out)
        out.append(line)
        counts.append(1)
    return [line if n == 1 else f"{line} (x{n})" for line, n in zip(out, counts, strict=True)]


@dataclass
class Block:
    comments: list[str]
    command: str
    expected: list[str]


def parse(text: str) -> list[Block]:
    blocks: list[Block] = []
    comments: list[str] = []
    lines = iter(text.splitlines())
    for line in lines:
        if not line.strip():
            continue
        if line.startswith("#"):
            comments.append(line)
            continue
        if next(lines, "") != "----":
            raise ValueError(f"command {line!r} is not followed by a '----' line")
        expected = []
        for out in lines:
            if not out.strip():
                break
            expected.append(out)
        blocks.append(Block(comments, line, expected))
        comments = []
    return blocks


def run(blocks: list[Block]) -> list[list[str]]:
    """What each block's command printed."""
    sim: Scenario | None = None
    outputs = []
    for block in blocks:
        words = block.command.split()
        if words[0] == "cluster":
            sim = new_scenario(words[1:])
            outputs.append([NOTHING])
            continue
        if sim is None:
            raise ValueError("a transcript starts with `cluster NAMES`")
        assert sim.log is not None
        sim.log.clear()
        perform(sim, words)
        outputs.append(shown(sim.log) or [NOTHING])
    return outputs


def render(blocks: list[Block], outputs: list[list[str]]) -> str:
    parts = []
    for block, output in zip(blocks, outputs, strict=True):
        parts.append("\n".join([*block.comments, block.command, "----", *output]))
    return "\n\n".join(parts) + "\n"


def main(paths: list[str]) -> int:
    for path in paths or sorted(map(str, TRANSCRIPTS.glob("*.txt"))):
        blocks = parse(Path(path).read_text())
        print(render(blocks, run(blocks)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
