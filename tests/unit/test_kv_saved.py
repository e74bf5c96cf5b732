"""The job's key-value store is part of its saved state: a set is answered, and seen by `get`
and `wait`, only once it is saved; a restarted scheduler has every key it answered."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from pathlib import Path

import pytest

from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.machine.adds import RECORD_PREFIX, decode
from cluster.storage.kv_log import FILE_NAME, KvLog
from tests import tmpfs
from tests.aio import BOUND_S, eventually
from tests.credentials import caller, registration
from tests.unit.test_persist import started


async def formed(directory: Path) -> SchedulerCore:
    core = await started(directory)
    for node_id in ("0", "1"):
        await asyncio.wait_for(core.register(registration(node_id)), BOUND_S)
    return core


async def ended(core: SchedulerCore) -> None:
    """Stop as the process would: what is decided saved, the store let go."""
    assert await core.stop_saving(BOUND_S)
    assert core.persister is not None
    await core.persister.store.close()


async def test_keys_set_before_a_restart_are_there_after_it(tmp_path: Path) -> None:
    core = await formed(tmp_path)
    node = caller("0", 1)
    await asyncio.wait_for(core.kv_set(node, "plan", b"v1"), BOUND_S)
    await asyncio.wait_for(core.kv_set(node, "plan", b"v2"), BOUND_S)
    assert await asyncio.wait_for(core.kv_add(node, "count", 3), BOUND_S) == 3
    await ended(core)
    again = await started(tmp_path)
    assert again.state.cluster_id == core.state.cluster_id
    assert again.kv.get(["plan", "count"]) == ([b"v2", b"3"], [])
    await ended(again)


async def test_a_new_job_does_not_see_the_keys_of_the_one_before(tmp_path: Path) -> None:
    core = await formed(tmp_path)
    await asyncio.wait_for(core.kv_set(caller("0", 1), "plan", b"old"), BOUND_S)
    await ended(core)
    (tmp_path / "scheduler.json").unlink()  # the operator starts a new job here
    again = await started(tmp_path)
    assert again.state.cluster_id != core.state.cluster_id
    assert again.kv.get(["plan"]) == ([], ["plan"])
    await ended(again)
    third = await started(tmp_path)  # and the old job's keys do not come back later
    assert third.kv.get(["plan"]) == ([], ["plan"])
    await ended(third)


async def test_a_set_whose_save_fails_is_neither_answered_nor_seen_until_it_lands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cluster")
    core = await formed(tmp_path)
    node = caller("1", 1)
    await asyncio.wait_for(core.kv_set(node, "a", b"1"), BOUND_S)
    log_file = tmp_path / FILE_NAME
    aside = tmp_path / "kv.log.aside"
    log_file.rename(aside)
    log_file.mkdir()  # every append now fails, as on a broken disk
    answer = asyncio.ensure_future(core.kv_set(node, "a", b"2"))
    counter = asyncio.ensure_future(core.kv_add(node, "n", 5))
    waiter = asyncio.ensure_future(core.kv.wait(["n"], BOUND_S))
    saver = core.persister
    assert saver is not None
    await eventually(lambda: saver.kv_error is not None, "a failed save of the key-value store")
    assert not any(call.done() for call in (answer, counter, waiter))
    assert core.kv.get(["a", "n"]) == ([b"1"], ["n"])  # the saved value, not the staged one
    assert caplog.text.count("the key-value calls wait meanwhile") == 1
    log_file.rmdir()
    aside.rename(log_file)
    await asyncio.wait_for(answer, BOUND_S)
    assert await asyncio.wait_for(counter, BOUND_S) == 5
    assert await asyncio.wait_for(waiter, BOUND_S) == [b"5"]
    assert core.kv.get(["a", "n"]) == ([b"2", b"5"], [])
    await ended(core)
    again = await started(tmp_path)
    assert again.kv.get(["a", "n"]) == ([b"2", b"5"], [])
    await ended(again)


async def test_one_saver_holds_a_failing_key_set_while_the_state_goes_on_being_saved(
    tmp_path: Path,
) -> None:
    """The state and the key-value store are saved by one saver, in one round, each tried
    whether the other landed: a key-value log that cannot be written holds its sets, not the
    nodes' news."""
    core = await formed(tmp_path)
    saver = core.persister
    assert saver is not None
    node = caller("1", 1)
    log_file = tmp_path / FILE_NAME
    aside = tmp_path / "kv.log.aside"
    log_file.rename(aside)
    log_file.mkdir()  # every append now fails
    answer = asyncio.ensure_future(core.kv_set(node, "a", b"1"))
    await eventually(lambda: saver.kv_error is not None, "a failed save of the key-value store")
    revision = core.state.revision
    core.state.report_checkpoints("1", 1, [5])  # a change to save, for the same saver
    core._apply([])
    await eventually(lambda: saver.saved > revision, "the state saved beside the failing sets")
    assert not answer.done()
    log_file.rmdir()
    aside.rename(log_file)
    await asyncio.wait_for(answer, BOUND_S)
    assert saver.kv_error is None
    await ended(core)


async def test_an_add_made_again_after_a_restart_is_answered_as_before_and_counted_once(
    tmp_path: Path,
) -> None:
    """The add was saved, its answer lost, and the scheduler restarted: the worker makes the
    same add (its number) again, and gets the first answer; the counter went up once."""
    core = await formed(tmp_path)
    node, other = caller("0", 1), caller("1", 1)
    assert await asyncio.wait_for(core.kv_add(node, "n", 1, 1), BOUND_S) == 1
    assert await asyncio.wait_for(core.kv_add(other, "n", 10, 1), BOUND_S) == 11
    assert await asyncio.wait_for(core.kv_add(node, "n", 1, 2), BOUND_S) == 12
    await ended(core)
    again = await started(tmp_path)
    assert await asyncio.wait_for(again.kv_add(node, "n", 1, 2), BOUND_S) == 12
    assert await asyncio.wait_for(again.kv_add(other, "n", 10, 1), BOUND_S) == 11
    assert again.kv.get(["n"]) == ([b"12"], [])
    assert len(again.kv) == 1  # the records are the scheduler's own, not keys
    assert await asyncio.wait_for(again.kv_add(node, "n", 1, 3), BOUND_S) == 13  # the next
    assert await asyncio.wait_for(again.kv_add(node, "n", 1, 0), BOUND_S) == 14  # unnumbered
    assert await asyncio.wait_for(again.kv_add(node, "n", 1, 0), BOUND_S) == 15  # counted again
    await ended(again)


async def test_an_add_made_again_while_its_save_fails_is_answered_once_it_lands(
    tmp_path: Path,
) -> None:
    """The worker makes the add again (its connection broke) while its save still fails: the
    second call is not answered before the first add is saved, and both get the same answer."""
    core = await formed(tmp_path)
    node = caller("0", 1)
    log_file = tmp_path / FILE_NAME
    aside = tmp_path / "kv.log.aside"
    log_file.rename(aside)
    log_file.mkdir()  # every append now fails
    first = asyncio.ensure_future(core.kv_add(node, "n", 1, 1))
    saver = core.persister
    assert saver is not None
    await eventually(lambda: saver.kv_error is not None, "a failed save of the key-value store")
    second = asyncio.ensure_future(core.kv_add(node, "n", 1, 1))
    for _ in range(20):  # turns of the loop: the second call runs to where it waits
        await asyncio.sleep(0)  # sleep-ok: a turn of the loop, to show nothing completes
    assert not first.done()
    assert not second.done()
    log_file.rmdir()
    aside.rename(log_file)
    assert await asyncio.wait_for(asyncio.gather(first, second), BOUND_S) == [1, 1]
    assert core.kv.get(["n"]) == ([b"1"], [])
    await ended(core)


async def test_a_batch_cut_short_keeps_no_record_without_its_counter(tmp_path: Path) -> None:
    """Two adds of one member in one batch (two threads of its process): cut the key-value
    log at any byte of that batch, and every record that loads has its counter."""
    core = await formed(tmp_path)
    node = caller("0", 1)
    assert await asyncio.wait_for(core.kv_add(node, "n", 1, 1), BOUND_S) == 1
    log_file = tmp_path / FILE_NAME
    before = log_file.stat().st_size
    both = [core.kv_add(node, "m", 1, 2), core.kv_add(node, "n", 1, 3)]
    assert await asyncio.wait_for(asyncio.gather(*both), BOUND_S) == [1, 2]
    await ended(core)
    data = log_file.read_bytes()
    job = core.state.cluster_id
    cut = tmp_path / "cut"
    cut.mkdir()
    for end in range(before, len(data) + 1):
        (cut / FILE_NAME).write_bytes(data[:end])
        held = KvLog(cut).load(job)
        for key, value in held.items():
            record = decode(value) if key.startswith(RECORD_PREFIX) else None
            if record is not None:
                assert int(held.get(record.key, b"0")) >= record.value, (end, record)
    assert held["m"] == b"1"  # the whole log: both adds, each with its record


async def test_sets_given_up_while_saves_fail_hold_one_value_of_their_key(tmp_path: Path) -> None:
    """A member sets one key again and again on a full disk, giving each call up (its deadline):
    the saver holds the newest value only, not one per call; space back, the newest lands."""
    value_bytes, calls = 64 * 1024, 100
    with tmpfs.mounted("2m") as disk:
        core = await formed(disk)
        saver = core.persister
        assert saver is not None
        node = caller("1", 1)
        filler = tmpfs.fill(disk)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            given_up = []
            for i in range(calls):
                call = asyncio.ensure_future(core.kv_set(node, "k", bytes([i]) * value_bytes))
                await asyncio.sleep(0)  # sleep-ok: a turn of the loop, the set is staged
                call.cancel()
                given_up.append(call)
            # Every call ended (a loaded machine may take more than a turn for one to): what is
            # held now is the saver's, not a call's.
            await asyncio.wait_for(asyncio.gather(*given_up, return_exceptions=True), BOUND_S)
            given_up.clear()  # (a cancelled task's error holds its frames, and so its value)
            await eventually(lambda: saver.kv_error is not None, "a failed key-value save")
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # The newest value, staged and waiting, and a batch or two of one value each: the one
        # being written and the one whose write just failed (until its retry): not 100.
        assert grown < 8 * value_bytes, f"{grown} bytes held for {calls} sets of one key"
        assert "No space left on device" in (saver.kv_error or "")
        filler.unlink()
        await asyncio.wait_for(core.kv_set(node, "k", b"last"), BOUND_S)
        assert core.kv.get(["k"]) == ([b"last"], [])
        await ended(core)
