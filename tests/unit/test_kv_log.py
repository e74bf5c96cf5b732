"""The key-value log on disk stays within a bound of what it holds: it counts the bytes of the
newest record of each key exactly, and compacts once it is twice that (and past a floor)."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.protocol.errors import FencedError, StateFileError
from cluster.storage import atomic, kv_log
from cluster.storage.directory_store import DirectoryStore
from cluster.storage.kv_log import FILE_NAME, KvLog, encode_record, needs_compaction, record_size
from tests import tmpfs

JOB = "job-1"
FLOOR = 4096  # a small COMPACT_MIN_BYTES, so that short runs compact


@pytest.fixture
def small_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_log, "COMPACT_MIN_BYTES", FLOOR)


def header_bytes(job: str) -> int:
    return len(f"cluster-kv 2 {job}\n".encode())


def compacted_size(values: dict[str, bytes], job: str = JOB) -> int:
    return header_bytes(job) + sum(record_size(k, v) for k, v in values.items())


@given(key=st.text(max_size=20), value=st.binary(max_size=100))
def test_record_size_is_the_size_of_the_encoded_record(key: str, value: bytes) -> None:
    assert record_size(key, value) == len(encode_record(key, value))


def test_a_log_compacts_past_twice_what_it_holds_and_past_the_floor() -> None:
    floor = kv_log.COMPACT_MIN_BYTES
    assert not needs_compaction(floor, 10)  # under the floor: never
    assert needs_compaction(floor + 1, 10)
    assert not needs_compaction(2 * floor, floor)  # twice what it holds: not yet
    assert needs_compaction(2 * floor + 1, floor)


def test_one_key_rewritten_thousands_of_times_keeps_the_log_small(
    tmp_path: Path, small_floor: None
) -> None:
    log = KvLog(tmp_path)
    log.load(JOB)
    largest = 0
    for i in range(3000):
        log.append(JOB, {"plan": b"%06d" % i + bytes(1024)})
        largest = max(largest, (tmp_path / FILE_NAME).stat().st_size)
    assert log.live == compacted_size({"plan": bytes(1030)})
    # 3000 records (3 MiB) were appended; the file never held more than the floor.
    assert largest <= max(FLOOR, 2 * log.live)
    assert KvLog(tmp_path).load(JOB) == {"plan": b"002999" + bytes(1024)}


def test_a_compaction_leaves_no_temporary_and_cleans_stale_ones(
    tmp_path: Path, small_floor: None
) -> None:
    stale = atomic.temporary_name(tmp_path / FILE_NAME, "1234")
    stale.write_bytes(b"left by a killed scheduler")
    log = KvLog(tmp_path)
    log.load(JOB)
    for i in range(20):
        log.append(JOB, {"k": bytes(500 + i)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]


def test_the_log_is_never_written_through_a_link(tmp_path: Path) -> None:
    """A symbolic link put where the log was is another writer's doing, as another file there
    is: the append is fenced (the scheduler stops), not retried with the system's words, and
    the file it names is left alone; a load refuses it, saying what it is."""
    log = KvLog(tmp_path)
    log.load(JOB)
    log.append(JOB, {"a": b"1"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not the job's")
    (tmp_path / FILE_NAME).unlink()
    (tmp_path / FILE_NAME).symlink_to(elsewhere)
    with pytest.raises(FencedError, match=r"not the log .* \(a symbolic link is there\)"):
        log.append(JOB, {"a": b"2"})
    assert (tmp_path / FILE_NAME).is_symlink()
    with pytest.raises(StateFileError, match=r"the key-value log .* is a symbolic link"):
        KvLog(tmp_path).load(JOB)
    assert elsewhere.read_bytes() == b"not the job's"


def test_a_compaction_without_room_fails_no_append_and_runs_once_space_returns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A floor under one page: the appends land in the log's first page, already allocated, while
    # the compaction's temporary copy needs a page of its own.
    monkeypatch.setattr(kv_log, "COMPACT_MIN_BYTES", 2048)
    caplog.set_level(logging.INFO, logger=kv_log.__name__)
    values = [bytes([i]) * 580 for i in range(6)]
    with tmpfs.mounted("256k") as disk:
        log = KvLog(disk)
        log.load(JOB)
        for value in values[:3]:
            log.append(JOB, {"k": value})
        filler = tmpfs.fill(disk)
        for value in values[3:5]:
            log.append(JOB, {"k": value})  # durable; the compaction it triggers has no room
        assert needs_compaction(log.size, log.live)
        assert (disk / FILE_NAME).stat().st_size == log.size
        assert log.size == header_bytes(JOB) + 5 * record_size("k", values[0])  # each once
        assert KvLog(disk).load(JOB) == {"k": values[4]}
        assert sorted(p.name for p in disk.iterdir()) == sorted([FILE_NAME, filler.name])
        failed = [r for r in caplog.records if "cannot compact" in r.getMessage()]
        assert len(failed) == 1, caplog.text  # once, not once per append
        assert "No space left on device" in failed[0].getMessage()
        filler.unlink()
        log.append(JOB, {"k": values[5]})
        assert (disk / FILE_NAME).stat().st_size == log.size == compacted_size({"k": values[5]})
        assert KvLog(disk).load(JOB) == {"k": values[5]}
        assert "compacted the key-value log" in caplog.text


batches = st.lists(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "dé", "e" * 40]),
        st.binary(max_size=900),
        min_size=1,
        max_size=3,
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(batches=batches)
def test_any_sequence_of_sets_stays_bounded_and_replays_the_same_map(
    batches: list[dict[str, bytes]],
) -> None:
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as tmp:
        patch.setattr(kv_log, "COMPACT_MIN_BYTES", FLOOR)
        directory = Path(tmp)
        log = KvLog(directory)
        assert log.load(JOB) == {}
        model: dict[str, bytes] = {}
        for batch in batches:
            log.append(JOB, batch)
            model.update(batch)
            on_disk = os.stat(directory / FILE_NAME).st_size
            assert log.size == on_disk
            assert log.live == compacted_size(model)
            assert on_disk <= max(FLOOR, 2 * log.live)
        log.close()
        replayed = KvLog(directory)
        assert replayed.load(JOB) == model
        assert (replayed.size, replayed.live) == (log.size, log.live)
        replayed.close()


def logged(directory: Path, batches: list[dict[str, bytes]]) -> list[int]:
    """A log of `batches`, one append each; where each batch's first record begins."""
    log = KvLog(directory)
    log.load(JOB)
    starts = []
    for batch in batches:
        starts.append(log.size)
        log.append(JOB, batch)
    log.close()
    return starts


def version_1_log(directory: Path, batches: list[dict[str, bytes]]) -> list[int]:
    """A log of `batches` in format version 1 (record headers without a check), as an older
    cluster wrote it; where each batch's first record begins."""
    data, starts = f"cluster-kv 1 {JOB}\n".encode(), []
    for batch in batches:
        starts.append(len(data))
        data += b"".join(encode_record(k, v, version=1) for k, v in batch.items())
    (directory / FILE_NAME).write_bytes(data)
    return starts


@pytest.mark.parametrize("damaged", [1, 3])
def test_a_damaged_length_of_a_saved_record_fails_its_header_check(
    tmp_path: Path, damaged: int
) -> None:
    """One bit of a saved record's length flipped, so that the record seems to run past the end
    of the log (the second record, or the last): its header's check tells the length is
    damaged, whatever follows. It was acknowledged: the log is reported, never loaded without
    it or cut."""
    starts = logged(tmp_path, [{key: key.encode() * 8} for key in "abcd"])
    message = refused_with_a_damaged_length(tmp_path, starts[damaged])
    assert "(a record's header fails its check)" in message


def refused_with_a_damaged_length(directory: Path, at: int) -> str:
    """The error of loading the log once the high byte of the length of its record at `at` is
    flipped (2 GiB past the end); the log is left as it was."""
    path = directory / FILE_NAME
    data = bytearray(path.read_bytes())
    data[at + 2] ^= 0x80
    path.write_bytes(data)
    with pytest.raises(StateFileError) as caught:
        KvLog(directory).load(JOB)
    message = str(caught.value)
    assert f"the key-value log {path} is corrupt at byte {at}" in message
    assert kv_log.ADVICE in message
    assert path.read_bytes() == data  # nothing cut: what to do is the operator's call
    return message


@pytest.mark.parametrize(
    ("damaged", "follows"),
    [(1, "a whole record follows at byte {next}"), (3, "its bytes to the end of the file are")],
)
def test_a_damaged_length_in_a_version_1_log_is_corruption_never_a_torn_tail(
    tmp_path: Path, damaged: int, follows: str
) -> None:
    """Version 1's headers have no check: a length that runs past the end is damage when whole
    records follow its header to the end (the second record), or its own bytes to the end are
    one whole record (the last)."""
    starts = version_1_log(tmp_path, [{key: key.encode() * 8} for key in "abcd"])
    message = refused_with_a_damaged_length(tmp_path, starts[damaged])
    assert follows.format(next=starts[damaged + 1] if damaged < 3 else 0) in message


@pytest.mark.parametrize("kept", range(1, record_size("c", b"c" * 8)))
def test_a_torn_last_record_is_dropped_and_the_next_append_overwrites_it(
    tmp_path: Path, kept: int
) -> None:
    """A crash mid-append leaves the start of its record (never acknowledged): loading drops
    it without a word, and the next batch is written where it began."""
    logged(tmp_path, [{"a": b"a" * 8}, {"b": b"b" * 8}])
    path = tmp_path / FILE_NAME
    whole = path.stat().st_size
    with path.open("ab") as file:
        file.write(encode_record("c", b"c" * 8)[:kept])
    log = KvLog(tmp_path)
    assert log.load(JOB) == {"a": b"a" * 8, "b": b"b" * 8}
    assert log.size == whole
    log.append(JOB, {"d": b"d"})
    log.close()
    assert path.stat().st_size == whole + record_size("d", b"d")
    replayed = KvLog(tmp_path)
    assert replayed.load(JOB) == {"a": b"a" * 8, "b": b"b" * 8, "d": b"d"}
    replayed.close()


@pytest.mark.parametrize("kept", range(1, record_size("c", b"c" * 8)))
def test_a_tail_of_zeros_in_place_of_a_header_is_torn(tmp_path: Path, kept: int) -> None:
    """A crash that grew the file but left the end of the last append unwritten (zeros, as on a
    file system that grows a file before its data lands). Cut in its header, the record was
    never acknowledged, and loading drops it; a whole header with zeros for its body is damage
    it cannot tell from a tear, and is reported."""
    logged(tmp_path, [{"a": b"a" * 8}])
    path = tmp_path / FILE_NAME
    whole = path.stat().st_size
    record = encode_record("c", b"c" * 8)
    with path.open("ab") as file:
        file.write(record[:kept] + bytes(len(record) - kept))
    log = KvLog(tmp_path)
    if kept >= kv_log._HEAD_BYTES[kv_log.VERSION]:
        with pytest.raises(StateFileError, match="a record fails its checksum"):
            log.load(JOB)
        return
    assert log.load(JOB) == {"a": b"a" * 8}
    assert log.size == whole
    log.close()


INNER = encode_record("x", b"y" * 10)
HOLDS_RECORDS = b"prefix" + INNER + INNER + b"z" * 100  # a value a member may set


@pytest.mark.parametrize("cut", [1, 50, 100, 100 + len(INNER)])
def test_a_torn_record_whose_value_holds_whole_records_is_a_torn_tail(
    tmp_path: Path, cut: int
) -> None:
    """A crash mid-append of a record whose value holds encoded records, after some of them
    landed: they are bytes of a value never acknowledged, not saved records behind a damaged
    length (they stop short of the end of the log). Loading drops the torn record, and the next
    batch is written where it began."""
    starts = logged(tmp_path, [{"a": b"1"}, {"blob": HOLDS_RECORDS}])
    path = tmp_path / FILE_NAME
    os.truncate(path, path.stat().st_size - cut)
    log = KvLog(tmp_path)
    assert log.load(JOB) == {"a": b"1"}
    assert log.size == starts[1]
    log.append(JOB, {"b": b"2"})
    log.close()
    replayed = KvLog(tmp_path)
    assert replayed.load(JOB) == {"a": b"1", "b": b"2"}
    replayed.close()


def test_an_append_never_writes_a_log_that_replaced_its_own(tmp_path: Path) -> None:
    """The log holds the file it loaded or wrote: a kv.log put in its place (a directory or a
    file replaced behind its back) is another writer's, and is never truncated or appended to."""
    ours = KvLog(tmp_path)
    ours.load(JOB)
    ours.append(JOB, {"a": b"1"})
    (tmp_path / "other").mkdir()
    theirs = KvLog(tmp_path / "other")
    theirs.append(JOB, {"b": b"2" * 64})
    theirs.close()
    os.replace(tmp_path / "other" / FILE_NAME, tmp_path / FILE_NAME)
    replaced = (tmp_path / FILE_NAME).read_bytes()
    with pytest.raises(FencedError, match="it is not the log this scheduler has been writing"):
        ours.append(JOB, {"c": b"3"})
    assert (tmp_path / FILE_NAME).read_bytes() == replaced
    reader = KvLog(tmp_path)
    assert reader.load(JOB) == {"b": b"2" * 64}
    reader.close()
    (tmp_path / FILE_NAME).unlink()
    with pytest.raises(FencedError, match=r"\(nothing is there\)"):
        ours.append(JOB, {"c": b"3"})
    assert not (tmp_path / FILE_NAME).exists()
    ours.close()


@pytest.mark.parametrize("inner", [1, 2])
def test_a_torn_record_cut_where_a_record_in_its_value_ends_is_a_torn_tail(
    tmp_path: Path, inner: int
) -> None:
    """A member's value that holds encoded records, its append cut by a crash exactly where one
    of them ends: in version 1 that looked like whole records behind a damaged length, and the
    scheduler refused to start. The header's check says the length is whole: the tail is torn,
    and the acknowledged keys load."""
    value = b"p" + INNER + INNER + b"z" * 100
    starts = logged(tmp_path, [{"a": b"1"}, {"blob": value}])
    path = tmp_path / FILE_NAME
    inner_end = value.index(INNER) + inner * len(INNER)
    head = kv_log._HEAD_BYTES[kv_log.VERSION] + 4 + len(b"blob")
    os.truncate(path, starts[1] + head + inner_end)
    log = KvLog(tmp_path)
    assert log.load(JOB) == {"a": b"1"}
    assert log.size == starts[1]
    log.close()


def test_a_version_1_log_loads_and_its_first_append_rewrites_it_in_version_2(
    tmp_path: Path,
) -> None:
    """A log an older cluster wrote (a scheduler restarted on a newer one mid-job): its values
    load, and the first append rewrites it in this version before adding its batch, so that no
    log mixes two formats; the counts follow the rewritten log."""
    version_1_log(tmp_path, [{"a": b"1" * 10}, {"b": b"2" * 10}, {"a": b"3" * 10}])
    log = KvLog(tmp_path)
    assert log.load(JOB) == {"a": b"3" * 10, "b": b"2" * 10}
    log.append(JOB, {"c": b"4"})
    path = tmp_path / FILE_NAME
    assert path.read_bytes().startswith(f"cluster-kv {kv_log.VERSION} {JOB}\n".encode())
    values = {"a": b"3" * 10, "b": b"2" * 10, "c": b"4"}
    assert log.size == path.stat().st_size == log.live == compacted_size(values)
    log.close()
    replayed = KvLog(tmp_path)
    assert replayed.load(JOB) == values
    replayed.close()


def test_a_log_of_a_newer_or_unknown_version_is_refused_naming_it(tmp_path: Path) -> None:
    for version in ("0", "3", "x"):
        (tmp_path / FILE_NAME).write_bytes(f"cluster-kv {version} {JOB}\n".encode())
        with pytest.raises(StateFileError, match=f"has format version '{version}', but this"):
            KvLog(tmp_path).load(JOB)


async def test_a_scheduler_taking_the_directory_removes_what_killed_writers_left(
    tmp_path: Path,
) -> None:
    """A scheduler killed while it compacted the key-value log (or saved its state) leaves a
    temporary copy, as large as the log: the next one to take the directory removes it, before
    it resumes the job (which reads the log and never rewrites it unless it grows). It stayed
    to the job's end and after. Other files are left."""
    log = KvLog(tmp_path)
    log.reset(JOB)
    log.append(JOB, {"k": b"v"})
    log.close()
    left = [
        atomic.temporary_name(tmp_path / n, "0123456789abcdef")
        for n in ("kv.log", "scheduler.json")
    ]
    for temporary in left:
        temporary.write_bytes(b"x" * 4096)
    other = tmp_path / ".kv.log.notes"
    other.write_text("the user's")
    directory = DirectoryStore(tmp_path)
    try:
        assert await directory.acquire() is None
        assert not [t for t in left if t.exists()]
        assert await directory.load_kv(JOB) == {"k": b"v"}
        assert other.read_text() == "the user's"
    finally:
        await directory.close()
