"""Values from the wire as a person may see them: control characters escaped, long ones cut.

Pure. `safe` is the one helper for everything shown to a person (a terminal, a log, a report):
C0 and C1 controls, DEL, and the Unicode format characters that reorder or hide text (bidi
overrides and isolates, zero-width marks) become visible escapes, so that no value can clear a
screen, retitle a window, forge a line, or read backwards.
"""

from __future__ import annotations

import unicodedata

_ELLIPSIS = "..."


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _shown(char: str) -> bool:
    """Whether `char` is safe to print as it is."""
    if char == "\\":
        return False
    category = unicodedata.category(char)
    # Cc: C0, DEL, C1; Cf: format (bidi, zero width); Zl/Zp: line and paragraph separators;
    # Cs/Co/Cn: surrogates, private use, unassigned.
    return category[0] != "C" and category not in ("Zl", "Zp")


def safe(text: str, limit: int | None = None) -> str:
    """`text` with every unsafe character escaped (a backslash doubled); with `limit`, at most
    that many characters of it, and how long it was."""
    cut = limit is not None and len(text) > limit
    head = text[:limit] if cut else text
    if head.isascii() and head.isprintable() and "\\" not in head:
        shown = head
    else:
        shown = "".join(c if _shown(c) else ("\\\\" if c == "\\" else _escape(c)) for c in head)
    return f"{shown}{_ELLIPSIS} ({len(text):,} characters)" if cut else shown
