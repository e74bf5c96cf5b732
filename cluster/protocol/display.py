"""Text from the wire or from a file, made safe to show to a person.

A node id, a host, a key or a reason comes from whoever reached the scheduler, and an event log
or a status is read back from disk: any of them may hold bytes a terminal obeys (ESC[2J clears
the screen, ESC]0;...BEL retitles the window, a newline forges a row) or Unicode that reorders
what is shown (a right-to-left override makes "exe.txt" read as "txt.exe"). `safe` turns every
such character into a visible escape (\\x1b, \\n, \\u202e) and can cut a long value to a short
prefix that says how long it was. Every value shown to a person (`mscluster status`, `events`,
the launcher's progress, the logs, the HTML report) passes through it; printable text, ASCII or
not, is left as it is.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

# Escapes for the controls people know by name; every other one is \xNN, \uNNNN or \UNNNNNNNN.
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Categories shown escaped: controls (C0, DEL, C1), format characters (bidi embeddings,
# overrides, isolates and marks, zero-width joiners, the Arabic letter mark, soft hyphen),
# line and paragraph separators, and lone surrogates (undecodable bytes read with
# errors="surrogateescape").
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# A value cut short ends with this, and says how long it was.
_CUT = "...({} chars)"
# How much of the first line of the error a process died of is quoted: by the process telling
# the scheduler, by the scheduler keeping it (escaped), by the launcher naming it.
ERROR_LINE_CHARS = 300
# A log message is cut to this many characters: bounded, whatever a caller sent, and far
# longer than any message this project writes.
LOG_MESSAGE_MAX = 16 * 1024


def unsafe(char: str) -> bool:
    """Whether a terminal or a bidi-aware display may act on `char` instead of showing it."""
    import unicodedata  # noqa: PLC0415 - see _escaped

    return unicodedata.category(char) in _UNSAFE_CATEGORIES


def _escaped(text: str) -> str:
    """`text` with every `unsafe` character shown as an escape. (`unicodedata` is imported
    here, on first use: only text that is not all printable comes this way, and its import is
    a fraction of a millisecond of every process's start.)"""
    import unicodedata  # noqa: PLC0415 - see above

    category = unicodedata.category
    return "".join(_escape(c) if category(c) in _UNSAFE_CATEGORIES else c for c in text)


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def safe(text: object, limit: int | None = None) -> str:
    """`text` (str() of it) with every unsafe character shown as an escape; with `limit`, only
    its first `limit` characters, then a marker with its whole length ("...(8388608 chars)")."""
    shown = text if isinstance(text, str) else str(text)
    cut = limit is not None and len(shown) > limit
    head = shown[: max(limit, 0)] if cut and limit is not None else shown
    # The usual case, at C speed: nothing to escape.
    escaped = head if head.isprintable() else _escaped(head)
    return escaped + _CUT.format(len(shown)) if cut else escaped


def quoted(text: object, limit: int | None = None) -> str:
    """`safe(text, limit)` in single quotes, for a value inside a sentence (as %r would, but
    with C1 controls and bidi characters escaped too)."""
    return f"'{safe(text, limit)}'"


def listed(items: Iterable[str], most: int) -> str:
    """The first `most` of `items`, comma-separated, then how many more there are: "a, b and 3
    more". A list that names thousands of nodes or keys stays a line."""
    shown = list(items)
    head = ", ".join(shown[:most])
    return f"{head} and {len(shown) - most} more" if len(shown) > most else head


class SafeFormatter(logging.Formatter):
    """A log formatter that shows each message `safe` (cut to LOG_MESSAGE_MAX): a node id, a
    host, a key or a reason quoted in it cannot move the cursor or forge a line of the log. A
    traceback appended to it is the program's own and is left as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        shown = copy.copy(record)  # other handlers see the record as it was
        shown.message = safe(record.message, LOG_MESSAGE_MAX)
        return super().formatMessage(shown)
