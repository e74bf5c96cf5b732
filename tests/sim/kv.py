"""The key-value store in the simulation: the scheduler's real table (`machine.kv.KvTable`),
saved as the engine saves it (`WriteAheadSaver.write_kv`: staged, saved with the state's next
save, then committed and answered), and restored from the disk by a restarted scheduler
(`SchedulerCore.load`: the job's saved store; a new job starts with an empty one).

Each worker sets its own key (`k<node id>`) to a number that only grows, and reads any
worker's key. A call goes on the node's connection (in order; lost when the scheduler dies,
then made again once the node is back in).

Invariants (`Violation.invariant`):

- `kv-durable`: a set that was answered is never lost: a scheduler restarted on the job's saved
  store holds it (or a newer value of its key);
- `kv-read`: a get sees every set of its key answered before the get was sent (or a newer one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.protocol import auth
from cluster.protocol.errors import ClusterError
from cluster.scheduler.machine.admission import Denied
from cluster.scheduler.machine.kv import KvTable

if TYPE_CHECKING:
    from tests.sim.control_plane import Process, Sim


@dataclass(frozen=True)
class Op:
    """A key-value call: set `key` to `number`, or get `key` (`number`: the newest value of
    the key answered to its writer when the get was sent)."""

    job: str
    kind: str  # "set" or "get"
    key: str
    number: int


@dataclass
class KvSim:
    sim: Sim
    plant: str = ""
    table: KvTable = field(default_factory=KvTable)
    disk: dict[str, dict[str, bytes]] = field(default_factory=dict)  # per job
    # The sets staged and waiting for the next save: (node id, incarnation, op).
    batch: list[tuple[str, int, Op]] = field(default_factory=list)
    # The newest number answered to the writer of each key, per (job, key); the numbers each
    # node id set (its processes count on); the call each node waits on.
    acked: dict[tuple[str, str], int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    calls: dict[str, Op] = field(default_factory=dict)
    reads: int = 0

    def __post_init__(self) -> None:
        self.disk[self.sim.state.cluster_id] = {}

    # -- a worker ------------------------------------------------------------------------------

    def call(self, proc: Process, write: bool, whose: str) -> None:
        """`proc` sets its key (`write`) or reads `whose` key, unless it waits on a call."""
        waiting = self.calls.get(proc.node_id)
        if not proc.running or proc.stopped or not proc.member:
            return
        if waiting is not None and waiting.job == proc.job:
            return
        if write:
            number = self.counters[proc.node_id] = self.counters.get(proc.node_id, 0) + 1
            op = Op(proc.job, "set", f"k{proc.node_id}", number)
        else:
            key = f"k{whose}"
            op = Op(proc.job, "get", key, self.acked.get((proc.job, key), 0))
        self.calls[proc.node_id] = op
        self.send(proc)

    def send(self, proc: Process) -> None:
        op = self.calls.get(proc.node_id)
        if op is not None and op.job == proc.job:
            body = ("kv", proc.incarnation, op)
            self.sim.net.send(self.sim.clock.now, proc.node_id, "sched", body, stream=True)

    def forget(self, proc: Process) -> None:
        self.calls.pop(proc.node_id, None)

    def on_answer(self, proc: Process, op: Op, result: bytes | ClusterError | None) -> None:
        if self.calls.get(proc.node_id) != op:
            return
        del self.calls[proc.node_id]
        if isinstance(result, ClusterError):
            return
        if op.kind == "set":
            key = (op.job, op.key)
            self.acked[key] = max(self.acked.get(key, 0), op.number)
            return
        self.reads += 1
        seen = 0 if result is None else int(result)
        if seen < op.number:
            raise self.sim.violation(
                "kv-read",
                f"{proc.node_id} read {op.key}={seen or 'nothing'} in job {op.job}, but "
                f"{op.number} was answered to its writer before the read was sent",
            )

    # -- the scheduler -------------------------------------------------------------------------

    def on_call(self, node_id: str, incarnation: int, op: Op) -> None:
        """As `SchedulerCore.kv_set` / `kv_get`: admit, then stage (answered once saved) or
        read what is committed."""
        sim, st = self.sim, self.sim.state
        proc = sim.processes[node_id]
        if op.job != st.cluster_id:
            return  # meant for another job's scheduler
        presented = auth.Presented(digest=sim.registration(proc).credential_digest)
        verdict = st.admission.admit(node_id, incarnation, presented)
        if isinstance(verdict, Denied):
            self.answer(node_id, incarnation, op, verdict.error())
        elif op.kind == "get":
            values, _ = self.table.get([op.key])
            self.answer(node_id, incarnation, op, values[0] if values else None)
        else:
            value = str(op.number).encode()
            self.table.stage(op.key, value, node_id)
            self.batch.append((node_id, incarnation, op))
            if self.plant == "kv-early-answer":
                self.table.commit(op.key, value)
                self.answer(node_id, incarnation, op, None)

    def answer(
        self, node_id: str, incarnation: int, op: Op, result: bytes | ClusterError | None
    ) -> None:
        body = ("kvanswer", incarnation, op, result)
        self.sim.net.send(self.sim.clock.now, "sched", node_id, body, stream=True)

    def save_lands(self) -> None:
        """The saver's round saves the sets staged (`WriteAheadSaver._save_kv`): then they are
        committed, visible, and answered."""
        batch, self.batch = self.batch, []
        job = self.sim.state.cluster_id
        for node_id, incarnation, op in batch:
            value = str(op.number).encode()
            self.disk.setdefault(job, {})[op.key] = value
            if self.plant != "kv-early-answer":
                self.table.commit(op.key, value)
                self.answer(node_id, incarnation, op, None)

    def restart(self) -> None:
        """The scheduler came back on the disk: the job's saved store, or an empty one for a
        new job. Every set answered in the job is there."""
        self.batch = []
        job = self.sim.state.cluster_id
        self.table = KvTable(nodes=self.sim.state.expected)
        if job not in self.disk:
            self.disk[job] = {}
        saved = self.disk[job]
        self.table.restore(saved)
        for (acked_job, key), number in sorted(self.acked.items()):
            held = int(saved.get(key, b"0"))
            if acked_job == job and held < number:
                raise self.sim.violation(
                    "kv-durable",
                    f"{key}={number} was answered in job {job}, but the scheduler restarted "
                    f"from the disk with {key}={held or 'nothing'}",
                )
