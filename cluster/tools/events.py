"""`mscluster events`: the job's events as a table, from its event log or a running scheduler.

    mscluster events                              LOG_DIR/events.jsonl of `mscluster run` (logs/)
    mscluster events --file PATH --follow         and each new one, until the job's last
    mscluster events --addr H:P[,H:P] [--follow]  from the scheduler (WatchEvents), the leader
    mscluster events ... --json                   the JSON lines themselves
    mscluster events --log-dir DIR [--addr ...]   DIR/events.jsonl; with --addr, DIR/job.secret
                                                  proves this reader (`reading`)

`--addr` takes every scheduler of the job, comma-separated (H1:P,H2:P): the leader among them
is read. A followed scheduler that restarts is asked again (for up to RECONNECT_S), one that
stands by sends the follow to the leader it names, and the events already shown are not shown
twice; a follow ends only at the job's last event (exit 1 when it is `job_failed`: `exit_status`),
or with an error that says why. `--follow --file` gives up likewise (exit 1, one line) once no
one writes the file: nobody holds FILE.lock (the lock its scheduler holds while it writes it)
nor the launcher.lock beside it (`mscluster run` holds it from before its scheduler starts),
and it has not grown for RECONNECT_S; a live scheduler that is merely quiet holds the lock, and
is followed on. A file that is not there is waited for while one of those locks is held, and
for RECONNECT_S when none is: then one line says no event log came there (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import os
import sys
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Generator,
    Iterator,
    Sequence,
)
from pathlib import Path
from typing import IO, Any

from cluster.protocol.display import listed, safe
from cluster.protocol.errors import ConfigError, NotLeaderAnswer, SchedulerUnreachableError
from cluster.protocol.events import JobEvent, Kind, LeaderChange
from cluster.protocol.leader_search import LeaderSearch
from cluster.storage import holder_lock, rotation
from cluster.tools import following, reading, status
from cluster.tools.launch_lock import LOCK_FILE as LAUNCHER_LOCK
from cluster.tools.placement import DEFAULT_LOG_DIR
from cluster.transport import channel as scheduler_channel
from cluster.transport import tls

FINAL = frozenset({"finished", "job_failed"})
BEGINS = frozenset({"started", "resumed"})  # a job's first event (or a restarted scheduler's)
EVENT_LOG = "events.jsonl"  # in the log directory of `mscluster run`
POLL_S = 0.25
RECONNECT_S = 60.0
# How often a follower at the end of an event log that does not grow asks whether its writer
# holds the lock (`_Writer`).
LOCK_ASKED_S = 1.0
# A followed scheduler that stops answering gRPC's pings (its host lost power, a partition, a
# stopped process: no connection is closed) is taken as gone between this and 4/3 of it, and a
# second, after it last answered (`channel.keepalive_options`), and asked again.
FOLLOW_KEEPALIVE_S = 10.0
_SHOWN_APART = ("rank", "node_id")
# The longest line of an event log read as an event, its newline counted: 16 times what a
# reader can get of one event from a scheduler (gRPC's 4 MiB a message, and
# CLUSTER_FOLLOWER_MAX_BYTES's default); the scheduler's events are far shorter (a node id is at
# most 128 characters, a value from outside is cut to 64). A longer line is no event: it is read
# past in pieces of SKIP_PIECE_BYTES, never held whole, so a file of no newline costs no memory.
LINE_MAX_BYTES = 64 * 1024 * 1024
SKIP_PIECE_BYTES = 1024 * 1024
# What `_lines` gives for a line over LINE_MAX_BYTES: a line that is not an event.
_OVERLONG = "<a line over LINE_MAX_BYTES>"
# A value of an event is shown escaped (`safe`) and cut to this many characters (a node id is
# at most 128; a reason a sentence or two): an outsider's 8 MiB id is a line, not a screenful.
SHOWN_MAX = 512


# -- the table ---------------------------------------------------------------------------------

HEADER = f"{'time':<12}  {'event':<14}  {'who':<9}  details"


def row(event: JobEvent) -> str:
    """One event as a line of the table: local time, what, who, and the rest as key=value;
    every part from the log or the wire escaped (`safe`), so a line is one line of text."""
    clock = _clock(event.time)
    fields = event.fields
    if fields.get("rank") is not None:
        who = f"rank {_value(fields['rank'])}"
    elif fields.get("node_id") is not None:
        who = f"node {_value(fields['node_id'])}"
    else:
        who = ""
    rest = " ".join(
        f"{safe(k, SHOWN_MAX)}={_value(v)}" for k, v in fields.items() if k not in _SHOWN_APART
    )
    return f"{clock:<12}  {safe(event.kind, SHOWN_MAX):<14}  {who:<9}  {rest}".rstrip()


def _to_stderr(line: str) -> None:
    print(safe(line), file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    """The local time of day of `seconds` since the epoch; "?" for a time no date holds (a
    scheduler's event from the wire is not checked as a line of the log is)."""
    try:
        return datetime.datetime.fromtimestamp(seconds).strftime("%H:%M:%S.%f")[:-3]
    except (ValueError, OverflowError, OSError):
        return "?"


def _value(value: Any) -> str:
    if isinstance(value, str):
        plain = value and " " not in value and '"' not in value
        return safe(value if plain else json.dumps(value, ensure_ascii=False), SHOWN_MAX)
    return safe(json.dumps(value, ensure_ascii=False), SHOWN_MAX)


# -- sources -----------------------------------------------------------------------------------


def log_of(log_dir: str | Path | None) -> Path:
    """The event log `mscluster run` writes in `log_dir` (default: its logs/)."""
    return Path(log_dir if log_dir else DEFAULT_LOG_DIR) / EVENT_LOG


def parse(lines: Iterator[str], source: str) -> Iterator[JobEvent]:
    """The events of JSON lines; a line that is not one is skipped, unless none is."""
    seen = parsed = 0
    for line in lines:
        if not line.strip():
            continue
        seen += 1
        try:
            event = JobEvent.from_json(line)
        except ValueError:
            continue
        parsed += 1
        yield event
    if seen and not parsed:
        raise ConfigError(f"{source} is not an event log: none of its {seen} lines is an event")


def from_file(
    path: Path,
    *,
    follow: bool,
    poll_s: float = POLL_S,
    say: Callable[[str], None] = print,
    gone_s: float | None = None,
) -> Iterator[JobEvent]:
    """The events in `path`, its rotated old files first (PATH.<n> ... PATH.1); with `follow`,
    then each one appended, across rotations, until the end of the job that the log's last
    `started` or `resumed` began when the follow began (every `mscluster run` in a directory
    appends to its log: an earlier job's end is history); a file not there yet is waited for,
    and `say` says so. SchedulerUnreachableError once the file has no writer (`_Writer`:
    nobody held its lock or its directory's launcher.lock and it did not grow for `gone_s`,
    default RECONNECT_S); ConfigError when it never came and nobody held either meanwhile."""
    if not follow:
        files = rotation.in_order(path)
        if not files:
            raise ConfigError(
                f"no event log at {path}: give the one `mscluster run` wrote "
                "(LOG_DIR/events.jsonl), or the scheduler's CLUSTER_EVENT_LOG, or --addr"
                f"{found_below(path)}"
            )
        yield from parse(_lines(files), str(path))
        return
    if not path.exists():
        say(f"mscluster: waiting for {path} (the scheduler writes it once it has started)")
    begun = _jobs_begun(rotation.in_order(path))  # the last one is followed to its end
    old = rotation.in_order(path)[:-1] if path.exists() else rotation.in_order(path)
    writer = _Writer(path, RECONNECT_S if gone_s is None else gone_s)
    with contextlib.closing(_follow_file(path, poll_s, writer)) as appended:
        for event in itertools.chain(parse(_lines(old), str(path)), appended):
            yield event
            if event.kind in BEGINS:
                begun -= 1
            elif event.kind in FINAL and begun <= 0:
                return


def _jobs_begun(files: list[Path]) -> int:
    """How many `started` and `resumed` events `files` hold."""
    count = 0
    for line in _lines(files):
        if any(f'"{kind}"' in line for kind in BEGINS):  # the others are not parsed
            with contextlib.suppress(ValueError):
                count += JobEvent.from_json(line).kind in BEGINS
    return count


def _lines(files: list[Path]) -> Iterator[str]:
    """The lines of `files` in turn, read one at a time (errors replaced); a line over
    LINE_MAX_BYTES as `_OVERLONG`, read past (`_past_line`)."""
    for where in files:
        try:
            with where.open("rb") as handle:
                while chunk := handle.readline(LINE_MAX_BYTES):
                    if len(chunk) == LINE_MAX_BYTES and not chunk.endswith(b"\n"):
                        _past_line(handle)
                        yield _OVERLONG
                        continue
                    yield chunk.removesuffix(b"\n").decode("utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(f"cannot read the event log {where} ({exc.strerror})") from None


def _past_line(handle: IO[bytes]) -> bool:
    """Read past the rest of the line `handle` is in, SKIP_PIECE_BYTES at a time; whether its
    end was reached (False: the end of what is written came first)."""
    while piece := handle.readline(SKIP_PIECE_BYTES):
        if piece.endswith(b"\n"):
            return True
    return False


def _follow_file(path: Path, poll_s: float, writer: _Writer) -> Generator[JobEvent, None, None]:
    """The events appended to `path` for as long as it has a `writer`; when the scheduler
    rotates it (a new file at `path`), the rest of the old one, then the new one from its
    start."""
    while (handle := _opened(path)) is None:
        writer.check(None)
        time.sleep(poll_s)
    tail = _Tail(handle)
    try:
        switching = False
        while True:
            line = tail.line()
            if line is None and switching:  # the old file read to its very end: the next one
                following = _opened(_after(path, tail.handle))
                if following is None:  # rotated once more meanwhile: asked again
                    time.sleep(poll_s)
                    continue
                tail.handle.close()
                tail, switching = _Tail(following), False
                continue
            if line is None:
                # Rotated: once more to the end of the old file (written before the rename).
                switching = _rotated(path, tail.handle)
                if not switching:
                    writer.check(tail.handle)
                    time.sleep(poll_s)
                continue
            try:
                event = JobEvent.from_json(line)
            except ValueError:
                continue  # not an event (a line of something else): skipped
            yield event
    finally:
        tail.handle.close()


# How many log directories below a missing event log's a refusal names.
FOUND_BELOW = 3


def found_below(path: Path) -> str:
    """Where event logs of `path`'s name lie one or two directories below its directory, the
    newest first (each host's part of a job that spans hosts, `logs/node<R>/`; a Slurm step's
    `logs/<job>.<step>/` and its `node<R>/`), as the end of a refusal: '' when none do."""
    with contextlib.suppress(OSError):
        found = [*path.parent.glob(f"*/{path.name}"), *path.parent.glob(f"*/*/{path.name}")]
        if found:
            found.sort(key=lambda log: log.stat().st_mtime, reverse=True)
            if len(found) == 1:
                return (
                    f"; one lies below it, in {found[0].parent}: give --log-dir {found[0].parent}"
                )
            shown = listed((str(log.parent) for log in found), FOUND_BELOW)
            return f"; event logs lie below it, in {shown} (newest first): give one as --log-dir"
    return ""


class _Writer:
    """Whether the event log `path` still has a writer, asked by a follower at the end of it
    (or while there is no file there): gone once nobody held its FILE.lock (the scheduler that
    writes it) nor the launcher.lock of its directory (`mscluster run`, from before its
    scheduler made the file), asked every LOCK_ASKED_S, and the file did not grow (or come), for
    `gone_s`. A lock that cannot be asked (no locks on its file system) is taken as held: that
    follower waits for the job's last event as before."""

    def __init__(self, path: Path, gone_s: float) -> None:
        self.path = path
        self.gone_s = gone_s
        self._locks = (holder_lock.lock_path(path), path.with_name(LAUNCHER_LOCK))
        self._size: int | None = None  # None: no file there
        self._seen = time.monotonic()  # the last sign of a writer: the file grew, or a lock
        self._asked = 0.0  # when the locks were asked last

    def check(self, handle: IO[bytes] | None) -> None:
        """At the end of what `handle` reads of the log (None: no file there yet):
        SchedulerUnreachableError once its writer is gone; ConfigError once no file came and
        nothing would write one."""
        now = time.monotonic()
        size = None if handle is None else os.fstat(handle.fileno()).st_size
        if size != self._size:
            self._size, self._seen = size, now
            return
        if now - self._asked < LOCK_ASKED_S:
            return
        self._asked = now
        if any(holder_lock.held(lock) is not False for lock in self._locks):
            self._seen = now
        elif now - self._seen >= self.gone_s:
            raise self._gone()

    def _gone(self) -> ConfigError | SchedulerUnreachableError:
        scheduler, launcher = (lock.name for lock in self._locks)
        if self._size is None:
            return ConfigError(
                f"no event log appeared at {self.path} in {self.gone_s:g} s, and nothing "
                f"would write one there: no `mscluster run` or scheduler holds {launcher} or "
                f"{scheduler} in {self.path.parent}; run this in the directory `mscluster run` "
                "ran in (or give its --log-dir), or give --file FILE (a scheduler's "
                f"CLUSTER_EVENT_LOG) or --addr HOST:PORT{found_below(self.path)}"
            )
        return SchedulerUnreachableError(
            f"the event log {self.path} has no writer: nobody holds {scheduler} or {launcher} "
            f"and nothing was added for {self.gone_s:g} s, but the job's last event is not in "
            "it (its scheduler was killed, or its host lost?); mscluster status or events "
            "--addr asks a scheduler of the job"
        )


def _opened(path: Path) -> IO[bytes] | None:
    """`path` open to read; None while there is no file there (a rotation under way)."""
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the event log {path} ({exc.strerror})") from None


class _Tail:
    """The lines of one file as they are appended. A line still being written is held until
    its end comes. When the scheduler cuts off the part of a line that a failed write left (a
    full disk: `rotation.RotatingFile`) after some of it was read here, the part held is
    dropped and the file read again from where that line began: the file is found shorter
    than what was read, or a whole line read is not what the file holds at its place. Each
    line is checked whole, as one read may begin in the part and go on in the line written
    in its place after the cut (a line of two events). A line over LINE_MAX_BYTES is no event
    (the scheduler's are far shorter): it is read past, not held, and so not checked."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self._held = b""
        self._start = 0  # where the held part of a line begins in the file
        # Reading past a line over LINE_MAX_BYTES (none of it held): it is no event.
        self._overlong = False

    def line(self) -> str | None:
        """The next whole line of at most LINE_MAX_BYTES; None at the end of what is written
        so far. A longer line is read past, its bytes not held."""
        while True:
            if self._overlong:
                if not _past_line(self.handle):
                    self._at_end()
                    return None
                self._overlong = False
                continue
            chunk = self.handle.readline(LINE_MAX_BYTES - len(self._held))
            if not chunk:
                self._at_end()
                return None
            if not self._held:
                self._start = self.handle.tell() - len(chunk)
            self._held += chunk
            if not self._held.endswith(b"\n"):
                if len(self._held) == LINE_MAX_BYTES:
                    self._held, self._overlong = b"", True
                continue  # the end of what is written: readline says so next
            line, self._held = self._held, b""
            if os.pread(self.handle.fileno(), len(line), self._start) != line:
                self._again(self._start)  # cut back, and another line written in its place
                continue
            return line.decode("utf-8", errors="replace")

    def _at_end(self) -> None:
        """At the end of what is written: read again from where the held part (or the line
        read past) began when the file was cut back under this reader."""
        size = os.fstat(self.handle.fileno()).st_size
        if size < self.handle.tell():  # cut back under this reader
            self._again(min(self._start, size) if self._held or self._overlong else size)

    def _again(self, offset: int) -> None:
        self.handle.seek(offset)
        self._held, self._overlong = b"", False


def _after(path: Path, handle: IO[bytes]) -> Path:
    """The file written after the one `handle` reads: the next newer old file (when `path`
    rotated more than once meanwhile) or `path`; the oldest one left when `handle`'s file is
    gone already (rotated past CLUSTER_LOG_KEEP: its successors are lost too)."""
    files = rotation.in_order(path)
    held = os.fstat(handle.fileno())
    for number, where in enumerate(files):
        with contextlib.suppress(OSError):
            now = where.stat()
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return files[number + 1] if number + 1 < len(files) else path
    return files[0] if files else path


def _rotated(path: Path, handle: IO[bytes]) -> bool:
    """Whether `path` is now another file than the one `handle` reads (read to its end)."""
    try:
        now = path.stat()
    except OSError:
        return False  # between the rename and the new file
    held = os.fstat(handle.fileno())
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


async def from_scheduler(
    address: str | Sequence[str],
    identity: tls.Identity | None,
    *,
    follow: bool,
    reconnect_s: float = RECONNECT_S,
    where: Callable[[], str] | None = None,
    secret: reading.Secret = reading.FROM_ENV,
    keepalive_s: float = FOLLOW_KEEPALIVE_S,
) -> AsyncGenerator[JobEvent, None]:
    """The job's retained events from its leader among `address` (one, or every scheduler of
    the job); with `follow`, then each new one until the job's last.

    A scheduler that stands by (its answer, or the end of its stream as it gives up leading)
    sends the read to the leader it names, else to the next address, and each move is said in
    one line on stderr. A scheduler that restarts, goes silent (found by `keepalive_s`) or
    ends its stream before the job's last event is asked again, each address in turn, until
    no new event came for `reconnect_s`; then SchedulerUnreachableError (NotLeaderAnswer: the
    scheduler stands by) says what each answered: a follow never ends without the job's last
    event. No event is shown twice (`_Shown`). `where`: the one address to ask at each
    (re)connection instead (the leader as `Following` finds it: it says the moves). `secret`:
    what proves this reader (`reading`; a fresh challenge at each). ReadRefusedError when the
    scheduler refuses it; TLSConfigError when its certificate is refused or it speaks the
    other protocol."""
    found = reading.resolve(secret)
    listed = [address] if isinstance(address, str) else list(address)
    asking = _Asking(listed if where is None else None, where, reconnect_s)
    shown = _Shown()
    options = [
        *scheduler_channel.reconnect_options(100, 1000),
        *scheduler_channel.keepalive_options(keepalive_s),
    ]
    while True:
        asked = asking.next()
        if asked is None:  # each asked once since the last new event
            await asking.pause(give_up=not follow or not shown.any)
            continue
        streaming, ended = False, "ended its event stream before the job's last event"
        gave_up: SchedulerUnreachableError | None = None
        watched = _watch(asked, identity, follow=follow, options=options, secret=found)
        try:
            async with contextlib.aclosing(watched) as stream:
                async for event in stream:
                    if not shown.first(event):
                        continue
                    if not streaming:  # the first new event on this connection
                        streaming = True
                        asking.streams(asked)
                    yield event
                    if event.kind in FINAL:
                        return
                    if _gave_up(event):  # its stream may go on: the leader has the job's
                        gave_up = NotLeaderAnswer(f"the scheduler at {asked} stands by", "")
                        break
        except SchedulerUnreachableError as exc:
            asking.failed(exc)
            continue
        if not follow:
            return
        asking.failed(gave_up or SchedulerUnreachableError(f"the scheduler at {asked} {ended}"))


def _gave_up(event: JobEvent) -> bool:
    """Whether `event` says that the scheduler that sent it gave up leading the job."""
    try:
        view = event.typed()
    except ValueError:  # EventFieldError: a damaged event is no word on leadership
        return False
    return isinstance(view, LeaderChange) and not view.leading


class _Asking:
    """Whom a read of the events asks next: rounds of `LeaderSearch` over `listed` (the
    scheduler whose events came last first; a leader a standby names next), or, with `where`,
    the one address it gives. Each move to another scheduler of `listed` is said on stderr."""

    def __init__(
        self, listed: list[str] | None, where: Callable[[], str] | None, reconnect_s: float
    ) -> None:
        self._listed = listed
        self._where = where
        self._reconnect_s = reconnect_s
        self._lost_at: float | None = None  # when a round first found none streaming
        self.streaming = listed[0] if listed else ""  # the scheduler whose events came last
        self._answers: list[SchedulerUnreachableError] = []  # this round's
        self._search = self._round()

    def _round(self) -> LeaderSearch:
        if self._listed is None:
            assert self._where is not None
            return LeaderSearch([self._where()], listed_only=True)
        others = [a for a in self._listed if a != self.streaming]
        return LeaderSearch([self.streaming, *others])

    def next(self) -> str | None:
        """The address to ask now; None: each was asked in this round."""
        return self._search.next_address()

    async def pause(self, *, give_up: bool) -> None:
        """Each was asked in this round, none streamed a new event: the error saying what
        each answered when `give_up`, or when none did for `reconnect_s`; else, after
        POLL_S, a new round."""
        now = time.monotonic()
        self._lost_at = now if self._lost_at is None else self._lost_at
        if give_up or now - self._lost_at > self._reconnect_s:
            raise self.failure()
        await asyncio.sleep(POLL_S)
        self._answers = []
        self._search = self._round()

    def failed(self, exc: SchedulerUnreachableError) -> None:
        """The scheduler last asked did not stream the job to its end: `exc` says why."""
        self._answers.append(exc)
        if isinstance(exc, NotLeaderAnswer):
            self._search.standby(exc.leader)

    def streams(self, address: str) -> None:
        """A new event came from `address` (the first on its connection): the next round
        begins with it."""
        if self._listed is not None and address != self.streaming and self._answers:
            _to_stderr(f"mscluster: {following.moved(address, self.streaming, self._answers[0])}")
        self.streaming, self._lost_at = address, None
        self._answers = []
        self._search = self._round()

    def failure(self) -> SchedulerUnreachableError:
        """What this round's schedulers answered, as one error."""
        if len(self._answers) == 1:
            return self._answers[0]
        return SchedulerUnreachableError("; ".join(map(str, self._answers)) or "none asked")


class _Shown:
    """The events a read has shown, known by their number, time and kind: each is shown once,
    however often the schedulers asked send their retained events again. (A new leader, or a
    scheduler started again without its event log, numbers events of its own from 1: the
    number alone does not tell an event shown from a new one.) The newest KEPT are known: more
    than any scheduler retains and sends again (`cluster.scheduler.events.RETAINED_EVENTS`)."""

    KEPT = 4 * 4096

    def __init__(self) -> None:
        self._keys: dict[tuple[int, float, str], None] = {}

    @property
    def any(self) -> bool:
        return bool(self._keys)

    def first(self, event: JobEvent) -> bool:
        """Whether `event` was not shown yet (it is taken as shown now)."""
        key = (event.seq, event.time, event.kind)
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self.KEPT:
            del self._keys[next(iter(self._keys))]
        return True


async def _watch(
    address: str,
    identity: tls.Identity | None,
    *,
    follow: bool,
    options: list[tuple[str, int]],
    secret: reading.ReadSecret | None,
) -> AsyncGenerator[JobEvent, None]:
    """The events of one connection to `address`: with a CRL, its certificate checked first
    (`status.checked`); a failure to reach it explained (`status.explain`)."""
    await status.checked(address, identity)
    async with scheduler_channel.open_channel(address, identity, options) as channel:
        try:
            async for event in status.watch_events(channel, address, follow=follow, secret=secret):
                yield event
        except NotLeaderAnswer:
            raise
        except SchedulerUnreachableError:
            await status.explain(address, identity)
            raise


# -- the command -------------------------------------------------------------------------------


class Printer:
    """Prints events as they come: the table (its header before the first row) or JSON lines."""

    def __init__(self, out: IO[str], *, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.count = 0
        self.last: JobEvent | None = None  # the last event printed

    def __call__(self, event: JobEvent) -> None:
        if self.count == 0:
            self._header()
        print(event.to_json() if self.as_json else row(event), file=self.out, flush=True)
        self.count += 1
        self.last = event

    def done(self) -> JobEvent | None:
        """The last event printed, None when none was (an empty table still has its header)."""
        if self.count == 0:
            self._header()
        return self.last

    def _header(self) -> None:
        if not self.as_json:
            print(HEADER, file=self.out, flush=True)


def show(events: Iterator[JobEvent], out: IO[str], *, as_json: bool) -> JobEvent | None:
    """Print `events` as they come; the last one (None: none)."""
    printer = Printer(out, as_json=as_json)
    for event in events:
        printer(event)
    return printer.done()


async def show_stream(
    events: AsyncIterator[JobEvent], out: IO[str], *, as_json: bool
) -> JobEvent | None:
    """`show` for a scheduler's stream."""
    printer = Printer(out, as_json=as_json)
    async for event in events:
        printer(event)
    return printer.done()


def exit_status(last: JobEvent | None, *, follow: bool) -> int:
    """The exit status of `mscluster events`: a follow ends at the job's last event, 1 when
    that is `job_failed` (the job failed), 0 at `finished`; a plain listing is 0."""
    return 1 if follow and last is not None and last.kind == Kind.JOB_FAILED.value else 0
