"""Unit tests of cluster.scheduler.exchange.ExchangeTable."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.protocol.errors import (
    CapacityError,
    CollectiveError,
    CollectiveMismatchError,
    JobFailedError,
)
from cluster.scheduler.exchange import (
    ALLGATHER,
    BARRIER,
    BROADCAST,
    ROUNDS_PER_RANK,
    ExchangeTable,
    Withdrawn,
)
from cluster.scheduler.machine.admission import ExchangeTicket
from cluster.scheduler.machine.rounds import MAX_ANSWER_BYTES
from tests.aio import BOUND_S, settle


def contribute(
    table: ExchangeTable,
    rank: int,
    *,
    size: int,
    value: bytes | Withdrawn | None = None,
    **round_: Any,
) -> asyncio.Task[list[bytes]]:
    """Rank `rank`'s contribution (`value`, by default v<rank>) to a round of `size` ranks:
    an allgather of sequence number 1 in generation 1 with root 0, unless `round_` says
    otherwise (op=, seq=, generation=, root=)."""
    options = {"op": ALLGATHER, "seq": 1, "generation": 1, "root": 0, **round_}
    return asyncio.create_task(
        table.contribute(
            ticket=ExchangeTicket(rank, size),
            value=f"v{rank}".encode() if value is None else value,
            **options,
        )
    )


async def run_round(table: ExchangeTable, size: int, **kwargs: object) -> list[list[bytes]]:
    # Contribute in reverse rank order: the answer must not depend on arrival order.
    tasks = [contribute(table, rank, size=size, **kwargs) for rank in reversed(range(size))]  # type: ignore[arg-type]
    results = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
    return list(reversed(results))


async def test_allgather_returns_values_in_rank_order_to_all() -> None:
    table = ExchangeTable()
    results = await run_round(table, 4, op=ALLGATHER)
    assert results == [[b"v0", b"v1", b"v2", b"v3"]] * 4
    assert len(table) == 0


async def test_allgather_of_one() -> None:
    table = ExchangeTable()
    assert await run_round(table, 1, op=ALLGATHER) == [[b"v0"]]
    assert len(table) == 0


async def test_barrier_returns_nothing() -> None:
    table = ExchangeTable()
    assert await run_round(table, 3, op=BARRIER) == [[], [], []]
    assert len(table) == 0


@pytest.mark.parametrize("root", [0, 2])
async def test_broadcast_returns_only_the_roots_value(root: int) -> None:
    table = ExchangeTable()
    results = await run_round(table, 3, op=BROADCAST, root=root)
    assert results == [[f"v{root}".encode()]] * 3
    assert len(table) == 0


async def test_round_waits_for_every_rank() -> None:
    table = ExchangeTable()
    first = contribute(table, 0, size=2)
    await settle(lambda: len(table) == 1)
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    assert not first.done()
    assert len(table) == 1
    second = contribute(table, 1, size=2)
    assert await asyncio.wait_for(first, BOUND_S) == [b"v0", b"v1"]
    assert await asyncio.wait_for(second, BOUND_S) == [b"v0", b"v1"]
    assert len(table) == 0


async def test_rounds_are_keyed_by_generation_and_seq() -> None:
    table = ExchangeTable()
    tasks = {
        (gen, seq, rank): contribute(
            table, rank, size=2, generation=gen, seq=seq, value=f"{gen}.{seq}.{rank}".encode()
        )
        for gen in (1, 2)
        for seq in (1, 2)
        for rank in (0, 1)
        if rank == 0
    }
    await settle(lambda: len(table) == 4)
    for (gen, seq, _), _task in list(tasks.items()):
        tasks[(gen, seq, 1)] = contribute(
            table, 1, size=2, generation=gen, seq=seq, value=f"{gen}.{seq}.1".encode()
        )
    await asyncio.wait_for(asyncio.gather(*tasks.values()), BOUND_S)
    for (gen, seq, _), task in tasks.items():
        assert task.result() == [f"{gen}.{seq}.0".encode(), f"{gen}.{seq}.1".encode()]
    assert len(table) == 0


async def test_same_seq_can_be_used_again_after_the_round() -> None:
    table = ExchangeTable()
    assert await run_round(table, 2, value=b"a") == [[b"a", b"a"]] * 2
    assert await run_round(table, 2, op=BARRIER) == [[], []]
    assert len(table) == 0


@pytest.mark.parametrize(
    ("first", "second", "words"),
    [
        ((ALLGATHER, 0), (BARRIER, 0), ("barrier", "allgather")),
        ((BARRIER, 0), (BROADCAST, 1), ("broadcast(root=1)", "barrier")),
        ((BROADCAST, 0), (BROADCAST, 1), ("broadcast(root=1)", "broadcast(root=0)")),
    ],
)
async def test_mismatched_op_at_same_seq(
    first: tuple[str, int], second: tuple[str, int], words: tuple[str, str]
) -> None:
    table = ExchangeTable()
    waiting = contribute(table, 0, size=2, op=first[0], root=first[1], seq=7)
    await settle(lambda: len(table) == 1)
    with pytest.raises(CollectiveMismatchError) as info:
        await asyncio.wait_for(
            table.contribute(
                generation=1,
                seq=7,
                ticket=ExchangeTicket(1, 2),
                op=second[0],
                root=second[1],
                value=b"x",
            ),
            BOUND_S,
        )
    message = str(info.value)
    assert "rank 1 called " + words[0] in message
    assert "another rank called " + words[1] in message
    assert "#7" in message
    # The first caller is still waiting; ending the job releases it.
    assert not waiting.done()
    table.fail_all(JobFailedError("test over"))
    with pytest.raises(JobFailedError):
        await asyncio.wait_for(waiting, BOUND_S)


async def test_fail_all_fails_every_waiting_contributor() -> None:
    table = ExchangeTable()
    round_a = [contribute(table, rank, size=3, seq=1) for rank in (0, 1)]
    round_b = [contribute(table, 2, size=3, seq=2, op=BARRIER)]
    await settle(lambda: len(table) == 2)
    table.fail_all(JobFailedError("rank 2 ('2') failed"))
    assert len(table) == 0
    results = await asyncio.wait_for(
        asyncio.gather(*round_a, *round_b, return_exceptions=True), BOUND_S
    )
    assert len(results) == 3
    for result in results:
        assert isinstance(result, JobFailedError)
        assert str(result) == "rank 2 ('2') failed"
    assert len(table) == 0


async def test_fail_all_with_nothing_open() -> None:
    table = ExchangeTable()
    table.fail_all(JobFailedError("nothing to fail"))
    assert len(table) == 0
    assert await run_round(table, 2) == [[b"v0", b"v1"]] * 2


async def test_new_round_after_fail_all_survives_the_old_waiters() -> None:
    table = ExchangeTable()
    old = contribute(table, 0, size=2, seq=1)
    await settle(lambda: len(table) == 1)
    table.fail_all(JobFailedError("rank 0 left"))
    # Rank 1 arrives for the same collective before the old waiter has run again.
    late = contribute(table, 1, size=2, seq=1)
    with pytest.raises(JobFailedError):
        await asyncio.wait_for(old, BOUND_S)
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    assert not late.done()
    assert len(table) == 1  # the late caller's round is still known...
    table.fail_all(JobFailedError("job over"))  # ...so that ending the job releases it
    with pytest.raises(JobFailedError):
        await asyncio.wait_for(late, 1.0)


# -- bounds -------------------------------------------------------------------------------------


async def test_the_same_contribution_again_is_the_same_call_and_gets_the_same_answer() -> None:
    table = ExchangeTable()
    first = contribute(table, 0, size=2, value=b"a")
    await settle(lambda: len(table) == 1)
    again = contribute(table, 0, size=2, value=b"a")  # a retry after a lost connection
    await settle(lambda: table.held_bytes == 1)
    with pytest.raises(CollectiveError, match="twice, with different values"):
        await asyncio.wait_for(
            table.contribute(
                generation=1,
                seq=1,
                ticket=ExchangeTicket(0, 2),
                op=ALLGATHER,
                root=0,
                value=b"forged",
            ),
            BOUND_S,
        )
    last = contribute(table, 1, size=2, value=b"b")
    results = await asyncio.wait_for(asyncio.gather(first, again, last), BOUND_S)
    assert results == [[b"a", b"b"]] * 3
    assert (len(table), table.held_bytes) == (0, 0)


async def test_a_call_cancelled_after_the_round_is_complete_is_not_an_answer() -> None:
    """The round stays until the rank's call made again is answered."""
    table = ExchangeTable()
    cut = contribute(table, 0, size=2, value=b"a")
    await settle(lambda: len(table) == 1)
    # Rank 1 completes the round; rank 0's call is cut before it could write the answer.
    other = await table.contribute(
        generation=1, seq=1, ticket=ExchangeTicket(1, 2), op=ALLGATHER, root=0, value=b"b"
    )
    assert other == [b"a", b"b"]
    cut.cancel()
    await asyncio.gather(cut, return_exceptions=True)
    assert len(table) == 1  # rank 0 has not had its answer
    again = contribute(table, 0, size=2, value=b"a")
    assert await asyncio.wait_for(again, BOUND_S) == [b"a", b"b"]
    assert (len(table), table.held_bytes) == (0, 0)


async def test_a_call_cancelled_before_the_round_is_complete_takes_its_value_back() -> None:
    """Nobody waits for it: it is not held (the call made again brings it back)."""
    table = ExchangeTable()
    cut = contribute(table, 0, size=2, value=b"abc")
    await settle(lambda: table.held_bytes == 3)
    cut.cancel()
    await asyncio.gather(cut, return_exceptions=True)
    assert (len(table), table.held_bytes) == (0, 0)
    other = contribute(table, 1, size=2, value=b"b")
    await settle(lambda: table.held_bytes == 1)
    retried = contribute(table, 0, size=2, value=b"abc")
    assert await asyncio.wait_for(asyncio.gather(other, retried), BOUND_S) == [[b"abc", b"b"]] * 2


async def test_a_value_still_awaited_by_a_retry_is_kept() -> None:
    table = ExchangeTable()
    first = contribute(table, 0, size=2, value=b"a")
    retry = contribute(table, 0, size=2, value=b"a")  # made again before the first was cut
    await settle(lambda: table.held_bytes == 1 and len(table) == 1)
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert table.held_bytes == 1
    last = contribute(table, 1, size=2, value=b"b")
    assert await asyncio.wait_for(asyncio.gather(retry, last), BOUND_S) == [[b"a", b"b"]] * 2


async def test_a_rank_that_runs_ahead_is_refused_and_the_others_go_on() -> None:
    """A runaway rank opens rounds far ahead: it may wait in two; its next call alone is
    refused, and the others' collectives (which need their rounds) complete as ever."""
    table = ExchangeTable()
    ahead = [contribute(table, 0, size=3, seq=seq) for seq in range(100, 100 + ROUNDS_PER_RANK)]
    await settle(lambda: len(table) == ROUNDS_PER_RANK)
    with pytest.raises(CapacityError, match=f"per rank \\({ROUNDS_PER_RANK}\\)"):
        await asyncio.wait_for(contribute(table, 0, size=3, seq=99), BOUND_S)
    assert len(table) == ROUNDS_PER_RANK  # the refused call left nothing behind
    # The job's collectives go on (in another generation here, as after a re-formation),
    # while the far rounds wait apart.
    for seq in range(1, 6):
        honest = [contribute(table, r, size=3, seq=seq, generation=2) for r in range(3)]
        assert (
            await asyncio.wait_for(asyncio.gather(*honest), BOUND_S) == [[b"v0", b"v1", b"v2"]] * 3
        )
    for seq in range(100, 100 + ROUNDS_PER_RANK):
        for rank in (1, 2):
            contribute(table, rank, size=3, seq=seq)
    await asyncio.wait_for(asyncio.gather(*ahead), BOUND_S)
    await settle(lambda: len(table) == 0)


async def test_a_rank_holding_its_share_of_bytes_is_refused_alone() -> None:
    table = ExchangeTable(max_bytes=4 * MAX_ANSWER_BYTES)  # 2 ranks: a share of 2 answers
    big = b"x" * (MAX_ANSWER_BYTES // 2)
    first = contribute(table, 0, size=2, seq=1, value=big)
    await settle(lambda: table.held_bytes == len(big))
    with pytest.raises(CapacityError, match="past its share"):
        await asyncio.wait_for(contribute(table, 0, size=2, seq=2, value=big * 4), BOUND_S)
    assert len(table) == 1
    last = contribute(table, 1, size=2, seq=1, value=b"y")
    assert await asyncio.wait_for(asyncio.gather(first, last), BOUND_S) == [[big, b"y"]] * 2


async def test_a_round_waits_its_timeout_then_fails_on_every_rank_naming_the_absent() -> None:
    table = ExchangeTable(timeout_s=0.05)
    waiting = [contribute(table, rank, size=4, op=BARRIER) for rank in (0, 2)]
    for task in waiting:
        with pytest.raises(CollectiveError, match=r"rank\(s\) 1, 3, which never called"):
            await asyncio.wait_for(task, BOUND_S)
    # A rank that comes later gets the same error at once, and nothing is held.
    with pytest.raises(CollectiveError, match="CLUSTER_COLLECTIVE_TIMEOUT_S"):
        await asyncio.wait_for(contribute(table, 1, size=4, op=BARRIER), BOUND_S)
    assert (len(table), table.held_bytes) == (0, 0)
    # The next collective works.
    table.rounds.timeout_s = 60.0
    assert await run_round(table, 2, seq=2) == [[b"v0", b"v1"]] * 2


async def test_bytes_held_are_capped_and_the_whole_round_fails() -> None:
    table = ExchangeTable(max_bytes=10)
    first = contribute(table, 0, size=3, value=b"x" * 6)
    await settle(lambda: table.held_bytes == 6)
    with pytest.raises(CapacityError) as info:
        await asyncio.wait_for(
            table.contribute(
                generation=1,
                seq=1,
                ticket=ExchangeTicket(1, 3),
                op=ALLGATHER,
                root=0,
                value=b"y" * 6,
            ),
            BOUND_S,
        )
    assert "CLUSTER_COLLECTIVE_MAX_BYTES=10" in str(info.value)
    with pytest.raises(CapacityError):
        await asyncio.wait_for(first, BOUND_S)  # no rank of the round waits for ever
    with pytest.raises(CapacityError):
        await asyncio.wait_for(contribute(table, 2, size=3, value=b""), BOUND_S)  # late rank
    assert (len(table), table.held_bytes) == (0, 0)
    # The job goes on: the next collective works.
    assert await run_round(table, 3, seq=2) == [[b"v0", b"v1", b"v2"]] * 3


async def test_an_allgather_too_large_to_answer_fails_at_once() -> None:
    table = ExchangeTable(max_bytes=2**40)
    big = b"x" * (MAX_ANSWER_BYTES // 2 + 1)
    first = contribute(table, 0, size=3, value=big)
    await settle(lambda: len(table) == 1)
    with pytest.raises(CollectiveError, match="cannot carry"):
        await asyncio.wait_for(contribute(table, 1, size=3, value=big), BOUND_S)
    with pytest.raises(CollectiveError, match="cannot carry"):
        await asyncio.wait_for(first, BOUND_S)
    assert table.held_bytes == 0


async def test_a_withdrawal_fails_the_round_at_once_for_the_ranks_waiting_in_it() -> None:
    """Rank 1 waits in rank 0's broadcast, whose payload rank 0's own process refused: rank 0
    withdraws, and both calls fail at once (the timeout, an hour, never runs), naming rank 0;
    no timer is left, and the next collective completes for both."""
    table = ExchangeTable(timeout_s=3600.0)
    waiting = contribute(table, 1, size=2, op=BROADCAST, value=b"")
    await settle(lambda: len(table) == 1)
    why = Withdrawn("its broadcast_object payload of 70 MiB is over the limit")
    withdrawn = contribute(table, 0, size=2, op=BROADCAST, value=why)
    for task in (withdrawn, waiting):
        with pytest.raises(CollectiveError, match=rf"rank 0 withdrew from it, as {why.reason}"):
            await asyncio.wait_for(task, BOUND_S)
    assert (len(table), table.held_bytes, table._waits) == (0, 0, {})
    assert await run_round(table, 2, op=BROADCAST, seq=2) == [[b"v0"]] * 2
