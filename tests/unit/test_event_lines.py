"""A damaged line of the event log (a bit flipped, another writer, a hand edit) is no event:
`JobEvent.from_json` refuses it with a ValueError naming the field, and every reader skips it
as it skips any line that is not an event: `mscluster events`, a scheduler numbering on from
the log's last event (`last_seq`), the chaos report's `load_events`."""

from __future__ import annotations

import random
import subprocess
import tracemalloc
from pathlib import Path

import pytest

from cluster.protocol.config import ObserveConfig
from cluster.protocol.errors import ConfigError
from cluster.protocol.events import JobEvent
from cluster.scheduler import SchedulerServer
from cluster.scheduler.event_file import last_seq
from cluster.tools import chaos_record
from cluster.tools import events as events_tool
from tests.procs import PYTHON, ROOT
from tests.scrape import settings

GOOD = (
    '{"time":"2026-03-01T12:00:03.132+00:00","seq":7,"event":"failed","rank":2,"node_id":"2",'
    '"cause":"stream_broken","reason":"x","generation":1}'
)


def line(seq: str = "8", time: str = '"2026-03-01T12:00:04.000+00:00"', event: str = '"x"') -> str:
    """An event line whose fields are these JSON texts."""
    return f'{{"time":{time},"seq":{seq},"event":{event}}}'


# Each damaged line, and the field its refusal names.
DAMAGED = {
    "seq null": (line(seq="null"), "seq="),
    "seq a list": (line(seq="[1]"), "seq="),
    "seq infinite": (line(seq="1e400"), "seq="),
    "seq NaN": (line(seq="NaN"), "seq="),
    "seq a bool": (line(seq="true"), "seq="),
    "seq a fraction": (line(seq="8.5"), "seq="),
    "seq a string": (line(seq='"8"'), "seq="),
    "seq negative": (line(seq="-1"), "seq="),
    "seq past uint64": (line(seq=str(2**64)), "seq="),
    "time year 1": (line(time='"0001-01-01T00:00:00+00:00"'), "time="),
    "time year 9999": (line(time='"9999-12-31T23:59:59"'), "time="),
    "time past the range": (line(time='"9999-12-31T23:59:59-23:59"'), "time="),
    "time a number": (line(time="1772366403"), "time="),
    "time no time": (line(time='"yesterday"'), "time="),
    "event a number": (line(event="5"), "event="),
    "event null": (line(event="null"), "event="),
    "nested too deep": ("[" * 5000, "nested too deep"),
}


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_line_is_a_value_error_naming_its_field(name: str) -> None:
    line, field = DAMAGED[name]
    with pytest.raises(ValueError, match=f"not an event: {field}"):
        JobEvent.from_json(line)


@pytest.mark.parametrize("name", DAMAGED)
def test_every_reader_skips_a_damaged_line(name: str, tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(f"{GOOD}\n{DAMAGED[name][0]}\n")
    assert [e.seq for e in events_tool.from_file(path, follow=False)] == [7]
    assert last_seq(path) == 7
    assert [e["event"] for e in chaos_record.load_events(path, 0.0)] == ["failed"]


def test_mscluster_events_shows_the_good_lines_of_a_damaged_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(f"{GOOD}\n{line}\n" for line, _ in DAMAGED.values()))
    shown = subprocess.run(
        [PYTHON, "-m", "cluster", "events", "--file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert (shown.returncode, shown.stderr) == (0, "")
    assert shown.stdout.count("failed          rank 2") == len(DAMAGED)


async def test_a_scheduler_starts_on_a_damaged_log_and_numbers_on(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(f"{GOOD}\n{DAMAGED['seq null'][0]}\n")
    async with SchedulerServer(settings(), observe=ObserveConfig(event_log=path)) as server:
        assert [e.seq for e in server.core.journal.history()][:1] == [8]


SMALL_CAP = 4096


def test_a_line_over_the_cap_is_no_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line of LINE_MAX_BYTES with its newline is read; a longer one is skipped as any line
    that is not an event is, and the events around it are read."""
    monkeypatch.setattr(events_tool, "LINE_MAX_BYTES", SMALL_CAP)
    fits = line(event='"' + "x" * (SMALL_CAP - len(line(event='""')) - 1) + '"')
    assert len(fits) + 1 == SMALL_CAP
    path = tmp_path / "events.jsonl"
    path.write_text(f"{GOOD}\n{'y' * 3 * SMALL_CAP}\n{fits}\n{'z' * SMALL_CAP}")
    assert [e.seq for e in events_tool.from_file(path, follow=False)] == [7, 8]
    path.write_text("z" * 5 * SMALL_CAP)
    with pytest.raises(ConfigError, match="is not an event log: none of its 1 lines is an event"):
        list(events_tool.from_file(path, follow=False))


@pytest.mark.parametrize("capped", [True, False], ids=["no newline", "random bytes"])
def test_reading_a_file_that_is_no_event_log_holds_a_line_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capped: bool
) -> None:
    """`mscluster events --file` read the whole file into memory, about 9 times its size (915
    MB for 100 MB of random bytes; /dev/zero without bound): now one line at a time, and at
    most LINE_MAX_BYTES of one (a file of no newline)."""
    path = tmp_path / "events.jsonl"
    if capped:
        monkeypatch.setattr(events_tool, "LINE_MAX_BYTES", SMALL_CAP)
        monkeypatch.setattr(events_tool, "SKIP_PIECE_BYTES", SMALL_CAP)
        path.write_bytes(b"\0" * (16 << 20))
    else:
        path.write_bytes(random.Random(7).randbytes(16 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="is not an event log"):
            list(events_tool.from_file(path, follow=False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_time_no_date_holds_is_shown_as_unknown() -> None:
    """A scheduler's event from the wire: its time is not checked as a line of the log is."""
    for seconds in (1e300, float("nan"), -1e300):
        assert events_tool.row(JobEvent(1, seconds, "started", {})).startswith("?  ")
