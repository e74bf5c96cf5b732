"""How `mscluster run` reads its job: the scheduler's status for the progress line (every
`POLL_STATUS_S`), and a fresh answer when a worker has failed (`launch_policy` decides on it).

The reads prove the job secret the launcher gives its processes (`secret`), over the job's TLS
when it has one; with standby schedulers they go to whichever leads (`status.fetch_any`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import grpc

from cluster.protocol.config import JobSecretSource
from cluster.protocol.environment import job_secret_from_env, read_job_secret
from cluster.protocol.errors import AccessDeniedError, ClusterError, ReadRefusedError
from cluster.protocol.events import JobEvent
from cluster.protocol.records import Phase
from cluster.storage import rotation
from cluster.tools import launch_policy as policy
from cluster.tools import status as status_module
from cluster.tools.events import BEGINS, FINAL
from cluster.tools.status import JobView
from cluster.transport import channel as scheduler_channel
from cluster.transport import tls

POLL_STATUS_S = 0.5
# The scheduler starts alongside the launcher: reconnect quickly, not after grpc's default
# backoff (1 s, then 1.6x), or a short job ends before the first answer.
POLL_CHANNEL_OPTIONS = scheduler_channel.reconnect_options(100, 500)
# A fresh read that a scheduler refuses is asked this many times in all (each on a fresh
# challenge) before the launcher decides without it.
FRESH_TRIES = 3
# How much of the end of a log the launcher reads (a failed process's last lines), and the
# piece of the event log read at a time as it is read back (`job_ended`).
LOG_END_BYTES = 64 * 1024
# The event log is read back from its end to the last job's beginning (`job_ended`); a line
# longer than this is skipped there, so what is held stays bounded (the events that begin or
# end a job are far shorter: their fields are the job's settings, a reason).
EVENT_LINE_MAX_BYTES = 8 * 1024 * 1024
_EDGE_WORDS = tuple(f'"{kind}"'.encode() for kind in sorted(BEGINS | FINAL))  # as JSON writes them
# The events that say whether a node holds a rank (`without_rank_at_end`), and the job's start.
_RANK_KINDS = frozenset({"registered", "failed", "rejoined", "promoted"})
_RANK_WORDS = tuple(f'"{kind}"'.encode() for kind in sorted(_RANK_KINDS | {"started"}))


@dataclass(frozen=True)
class Fresh:
    """A fresh read of the job for a decision: the answer, or why there is none."""

    view: JobView | None = None
    unreachable: str = ""  # no scheduler answered: it is gone
    unread: str = ""  # a scheduler answered and refused to show the job: it is up


class JobReader:
    """The launcher's reads of its job, from `addresses` (the first first; more than one:
    standbys) with `identity` (the job's TLS, None without), proving the secret of
    `secret_file` (when it exists) or of the environment."""

    def __init__(
        self, addresses: list[str], identity: tls.Identity | None, secret_file: Path | None
    ) -> None:
        self.addresses = addresses
        self.identity = identity
        self._secret_file = secret_file
        self._secret: bytes | None = None  # the job secret, once read (it proves our reads)

    def secret(self) -> bytes | None:
        """The secret the job's processes get (the launcher's reads of the job prove it)."""
        if self._secret is None:
            source = job_secret_from_env(os.environ)
            path = self._secret_file
            if path is not None and path.exists():
                source = JobSecretSource(path=path)
            self._secret = None if source is None else read_job_secret(source)
        return self._secret

    async def leader(self, timeout_s: float = status_module.STATUS_TIMEOUT_S) -> JobView:
        """The leading scheduler's answer, or a ClusterError saying what each one answered."""
        return await status_module.fetch_any(
            self.addresses, self.identity, timeout_s, self.secret()
        )

    async def fresh(self) -> Fresh:
        """The leader's answer for a decision (a worker has failed). Only a scheduler that none
        reaches is gone; one that refuses the read (the job secret's proof, this launcher's
        certificate: ReadRefusedError, AccessDeniedError) is up, and is asked again, FRESH_TRIES
        times in all, before `unread` says what it answered."""
        refused = ""
        for _ in range(FRESH_TRIES):
            try:
                return Fresh(view=await self.leader())
            except (ReadRefusedError, AccessDeniedError) as exc:
                refused = str(exc)
            except ClusterError as exc:
                return Fresh(unreachable=str(exc))
        return Fresh(unread=f"{refused} ({FRESH_TRIES} tries)")

    async def poll(self, channel: grpc.aio.Channel) -> JobView:
        """One poll's answer: from the one scheduler over `channel` (its certificate checked
        against the CRL, as `mscluster status` checks it), or, with standbys, from whichever
        leads (each asked in turn, a standby's answer followed to the leader it names)."""
        if len(self.addresses) > 1:
            return await self.leader(POLL_STATUS_S * 2)
        return await status_module.fetch_checked(
            channel, self.addresses[0], self.identity, POLL_STATUS_S * 2, self.secret()
        )


def job_seen(view: JobView | None) -> policy.JobSeen | None:
    return None if view is None else policy.JobSeen(view.phase, view.recovery, view.detail)


def log_end(path: Path) -> list[str]:
    """The lines of the last LOG_END_BYTES of a log ([] when it cannot be read)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - LOG_END_BYTES))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()


def job_ended(view: JobView | None, event_log: Path | None) -> bool:
    """Whether the job's end was seen: in the scheduler's last answer (`view`), or in its event
    log, where a `finished` or `job_failed` follows the log's last `started` or `resumed` (the
    scheduler writes it before it exits, when the poll may not have seen it yet). Every
    `mscluster run` in a directory appends to that log, so an end before the last beginning is an
    earlier job's; with no beginning left in the log (rotated away), any end is this job's.
    The events, not the scheduler's log line (`the job is left to resume`), are read: they are
    the job's record, and an end not found (a log not written) errs toward a scheduler started
    again, where a line not found would leave the workers without one."""
    if view is not None and view.phase in (Phase.FINISHED, Phase.FAILED):
        return True
    return event_log is not None and _last_edge(event_log) in FINAL


def _last_edge(path: Path) -> str | None:
    """The kind of the newest event that begins or ends a job (BEGINS, FINAL) in the event log
    at `path`: its lines read back from the end, then those of its rotated files, newest first,
    only until one is found, so the work is bounded by the log's own (rotation) bound. None when
    there is none, or when a file cannot be read before one is found (an older file does not
    speak for it)."""
    with contextlib.suppress(OSError):
        for event in _events_back(path, _EDGE_WORDS):
            if event.kind in BEGINS or event.kind in FINAL:
                return event.kind
    return None


def without_rank_at_end(event_log: Path | None) -> dict[str, bool]:
    """Per node id that the event log's last job names, whether it held no rank at its end: a
    spare never promoted, or a node whose rank a spare took (`promoted`) after it failed. Each
    node's newest event decides; the log is read back only to the job's `started` (or as far as
    it can be read). The scheduler writes the log before it exits, where its last answer to the
    launcher's polls (every POLL_STATUS_S) may be older than a promotion just before the end."""
    decided: dict[str, bool] = {}
    given: set[int] = set()  # ranks a newer promotion gave to a spare
    if event_log is None:
        return decided
    with contextlib.suppress(OSError):
        for event in _events_back(event_log, _RANK_WORDS):
            if event.kind == "started":
                break
            node_id, rank = event.fields.get("node_id"), event.fields.get("rank")
            if event.kind not in _RANK_KINDS or not isinstance(node_id, str):
                continue
            if event.kind == "registered":
                decided.setdefault(node_id, event.fields.get("spare") is True)
            elif isinstance(rank, int):
                decided.setdefault(node_id, event.kind != "promoted" and rank in given)
                if event.kind == "promoted":
                    given.add(rank)
    return decided


def joined_nodes(event_log: Path) -> set[str]:
    """The node ids that joined the event log's last job (a `registered` event, or a later one
    that names the node: `without_rank_at_end`'s); none when the log is not there (no
    scheduler served a job)."""
    return set(without_rank_at_end(event_log))


def _events_back(path: Path, words: tuple[bytes, ...]) -> Iterator[JobEvent]:
    """The events of the event log at `path` in pieces that hold one of `words`, newest first:
    its lines read back from the end, then those of its rotated files, newest first (a torn
    line skipped). OSError from a file that cannot be read: an older one does not speak for it."""
    for where in reversed(rotation.in_order(path)):
        with where.open("rb") as handle:
            for line in _lines_back(handle, words):
                try:
                    event = JobEvent.from_json(line.decode(errors="replace"))
                except ValueError:  # not an event: a torn line
                    continue
                yield event


def _lines_back(handle: BinaryIO, words: tuple[bytes, ...]) -> Iterator[bytes]:
    """The lines of the file that `handle` reads in the pieces that hold one of `words`, last
    first: read back from its end LOG_END_BYTES at a time, so that what is held is a piece and
    at most one line; a line longer than EVENT_LINE_MAX_BYTES is skipped."""
    end = handle.seek(0, os.SEEK_END)
    head = b""  # the start of a line that begins before the pieces read so far
    dropped = False  # `head`'s line grew past EVENT_LINE_MAX_BYTES: the rest of it is skipped
    while end > 0:
        start = max(0, end - LOG_END_BYTES)
        handle.seek(start)
        block = handle.read(end - start) + head
        end = start
        cut = block.find(b"\n")
        if cut < 0:
            head = b"" if dropped else block
        else:
            head, body = block[:cut], block[cut + 1 :]
            lines = body.split(b"\n") if any(word in body for word in words) else []
            if dropped and lines:
                lines.pop()  # the overlong line's start
            dropped = False
            yield from reversed(lines)
        if len(head) > EVENT_LINE_MAX_BYTES:
            head, dropped = b"", True
    if not dropped:
        yield head
