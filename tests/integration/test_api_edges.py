"""The API at its edges in real worker processes, against a real scheduler: what allreduce
gives for bools, small integers and scalars; bytes collectives given bytes-like values and a str;
a collective called while another thread's is in flight; wait_for_generation's timeout; the
key-value store's keys and waits at their limits (tests/integration/scripts/api_edges.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

from cluster.protocol.config import Limits
from cluster.scheduler import SchedulerServer
from tests.aio import eventually
from tests.integration.test_api import settings
from tests.integration.test_withdrawn import waits_in
from tests.procs import ROOT, Procs, job_env

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "api_edges.py"
# Far longer than the test waits for a job: a rank that waits out a collective fails the test.
COLLECTIVE_TIMEOUT_S = 600.0
JOB_S = 60.0
# What a rank may wait in a collective that its peer's next call completes.
QUICK_S = 20.0


async def run(
    processes: Procs,
    n: int,
    mode: str,
    during: Callable[[SchedulerServer], Awaitable[None]] | None = None,
    **env: str,
) -> list[dict[str, str]]:
    """Run `n` workers of the script in `mode` (with `env`) to their end, `during` their run;
    what each rank said, by name."""
    job = dataclasses.replace(settings(n), limits=Limits(collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    async with SchedulerServer(job) as srv:
        base = job_env(n, srv.port, API_EDGES=mode, **env)
        workers = [
            processes.start_role(
                f"w{i}", "MS_WORKER", [str(SCRIPT)], {**base, "MS_NODE_ID": str(i)}
            )
            for i in range(n)
        ]
        if during is not None:
            await during(srv)
        codes = await asyncio.to_thread(lambda: [w.wait(JOB_S) for w in workers])
    logs = [w.output for w in workers]
    assert codes == [0] * n, logs
    for rank, log in enumerate(logs):
        assert f"barrier passed rank={rank}" in log, log
    return [dict(line.split(": ", 1) for line in log.splitlines() if ": " in line) for log in logs]


async def test_allreduce_widens_bools_and_small_integers_and_keeps_scalars(
    processes: Procs,
) -> None:
    for seen in await run(processes, 3, "reduce"):
        assert seen["bool sum"] == "array([3]) ndarray"
        assert seen["bool mean"] == "array([1.]) ndarray"
        assert seen["int8 sum"] == "array([300]) ndarray"
        assert seen["int8 mean"] == "array([100.]) ndarray"
        assert seen["numpy scalar"] == "np.float64(4.5) float64"
        assert seen["0-d array"] == "array(4.5) ndarray"
        assert seen["number"] == "np.int64(6) int64"
        assert seen["ranks"] == "array([3, 3]) ndarray"


async def test_bytes_collectives_take_bytes_like_values_and_refuse_a_str_before_taking_part(
    processes: Procs,
) -> None:
    """A str, or a root that is not a rank, is refused at once, in its rank, before that rank
    takes part (the number the agent took for a root the message cannot carry is given back):
    the peer already in the collective is not left waiting, and every rank's next collective is
    the same one."""
    ranks = await run(processes, 2, "bytes")
    wrong = (
        "CollectiveError: {}: data='a str' is of type str; it must be bytes, a bytearray or a "
        "memoryview (a str: its .encode()); nothing was sent, and this rank took no part in the "
        "collective"
    )
    assert ranks[1]["str refused"] == wrong.format("allgather_bytes")
    assert ranks[0]["broadcast str refused"] == wrong.format("broadcast_bytes")
    took_no_part = "; nothing was sent, and this rank took no part in the collective"
    assert ranks[0]["root -1 refused"] == (
        f"CollectiveError: broadcast_bytes: root=-1 is not a rank of the job: use 0-1{took_no_part}"
    )
    assert ranks[0]["root 2 refused"] == (
        f"CollectiveError: broadcast_object: root=2 is not a rank of the job: use 0-1{took_no_part}"
    )
    for root, call, kind in (
        ("True", "broadcast_object", "bool"),
        ("0.0", "broadcast_bytes", "float"),
    ):
        assert ranks[0][f"root {root} refused"] == (
            f"CollectiveError: {call}: root={root} is of type {kind}; it must be an int, a rank "
            f"of the job (0-1){took_no_part}"
        )
    assert ranks[0]["agent root -1"].startswith("ValueError: "), ranks[0]["agent root -1"]
    for seen in ranks:
        assert seen["bytearray"] == "[b'a0', b'a1'] list"
        assert seen["memoryview"] == "[b'm0', b'm1'] list"
        assert seen["broadcast"] == "b'from 0' bytes"
        assert float(seen["bytearray waited"]) < QUICK_S
        assert float(seen["broadcast waited"]) < QUICK_S


async def test_a_collective_while_another_threads_is_in_flight_is_refused_at_once(
    processes: Procs, tmp_path: Path
) -> None:
    """Rank 0's second thread is refused while its first waits in allgather_object #1; the
    first completes with rank 1's call, and the ranks' next collective is the same one."""
    go = tmp_path / "go"

    async def cue(srv: SchedulerServer) -> None:
        rounds = srv.core.exchanges.rounds
        await eventually(lambda: waits_in(rounds, 1, 0), "rank 0 waiting in collective #1", JOB_S)
        go.touch()

    ranks = await run(processes, 2, "threads", cue, API_EDGES_GO=str(go))
    assert ranks[0]["B refused"] == (
        "CollectiveError: allgather_object was called while another thread of this process is "
        "in a collective: collectives are one at a time per process (every rank must make them "
        "in the same order, which threads calling at once do not have); nothing was sent: make "
        "them from one thread, or hold a lock of your own around them"
    )
    for seen in ranks:
        assert seen["A"] == "['A0', 'A1'] list"
        assert seen["after"] == "[0, 1] list"


async def test_wait_for_generation_past_its_timeout_says_so_as_a_cluster_error(
    processes: Procs,
) -> None:
    (seen,) = await run(processes, 1, "generation")
    assert seen["timed out"] == (
        "CollectiveError: wait_for_generation: no generation above 1 came within 0.2 s: the job "
        "is at generation 1 (a new one comes once a failed worker has rejoined)"
    )
    assert seen["at once"].startswith("CollectiveError: wait_for_generation: no generation above")
    assert seen["past"] == "1 int"
    outside = (
        "CollectiveError: wait_for_generation: timeout_s={} is outside [0, 1e+09]: it must be a "
        "finite number of seconds (at most about 31 years, what the call's deadline can hold)"
    )
    assert seen["negative"] == outside.format("-1")
    assert seen["nan"] == outside.format("nan")
    assert seen["text"] == (
        "CollectiveError: wait_for_generation: timeout_s='5' is of type str; it must be a number "
        "of seconds"
    )


async def test_the_stores_keys_and_waits_are_checked_against_the_schedulers_limits(
    processes: Procs,
) -> None:
    """What the caller refuses, the scheduler would have refused with a misleading word (a
    version mismatch) or protobuf would have failed on; what it lets through, the scheduler
    reads."""
    (seen,) = await run(processes, 1, "kv")
    assert seen["unicode"] == "(None, 'значение') tuple"
    assert seen["longest key"] == "(None, b'1') tuple"
    for method in ("set", "get", "wait", "add"):
        assert seen[f"surrogate {method}"] == (
            f"CollectiveError: kv_store().{method}: key '\\ud800' has no UTF-8 form (surrogates "
            "not allowed at index 0, '\\ud800'): keys and str values must be valid text; pass "
            "bytes for a value that is not"
        )
        for name, size in (("empty", 0), ("long", 1025)):
            assert seen[f"{name} {method}"].startswith(
                f"CollectiveError: kv_store().{method}: key "
            )
            assert seen[f"{name} {method}"].endswith(
                f" is {size} bytes long in UTF-8; a key must be 1-1024 bytes long"
            )
    assert seen["surrogate value"].startswith(
        "CollectiveError: kv_store().set: value '\\udfff' has no UTF-8 form"
    )
    assert seen["wait at limit"].startswith("CollectiveError: kv wait failed: key-value wait "), (
        seen
    )
    assert seen["wait past limit"].startswith(
        "CapacityError: kv_store().wait: its 21,844 keys make a request of 262,145 bytes, more "
        "than the 262,144 (256 KiB) the scheduler takes for one wait"
    )
