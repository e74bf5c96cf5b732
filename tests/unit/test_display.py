"""cluster.protocol.display: what reaches a person never holds a byte a terminal obeys."""

from __future__ import annotations

import logging
import string
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.display import LOG_MESSAGE_MAX, SafeFormatter, quoted, safe, unsafe
from cluster.tools import report_html

# What a terminal or a bidi-aware display acts on: C0, DEL, C1, the bidi embeddings,
# overrides, isolates and marks, the Arabic letter mark, the line and paragraph separators.
DANGEROUS = (
    [chr(c) for c in range(0x20)]
    + ["\x7f"]
    + [chr(c) for c in range(0x80, 0xA0)]
    + [chr(c) for c in range(0x202A, 0x202F)]
    + [chr(c) for c in range(0x2066, 0x206A)]
    + ["\u200e", "\u200f", "\u061c", "\u2028", "\u2029", "\u200b", "\ufeff"]
)


def test_every_dangerous_character_is_escaped() -> None:
    for char in DANGEROUS:
        assert unsafe(char), hex(ord(char))
        shown = safe(f"a{char}b")
        assert shown[0] + shown[-1] == "ab"
        assert char not in shown
        assert shown.isascii()
        assert shown.isprintable()


def test_escapes_are_the_ones_people_know() -> None:
    assert safe("\x1b[2J") == "\\x1b[2J"
    assert safe("\x1b]0;x\x07") == "\\x1b]0;x\\x07"
    assert safe("a\nb\r\tc") == "a\\nb\\r\\tc"
    assert safe("\x9b") == "\\x9b"
    assert safe("\u202eexe.txt") == "\\u202eexe.txt"
    assert safe("\U000e0001") == "\\U000e0001"  # a language tag, a format character
    assert quoted("n\n1") == "'n\\n1'"


def test_printable_text_is_left_alone() -> None:
    assert safe(string.printable.strip(string.whitespace)) == string.printable.strip(
        string.whitespace
    )
    assert safe("worker-0 on höst-ünïcode, 节点 1") == "worker-0 on höst-ünïcode, 节点 1"
    assert safe(42) == "42"


def test_a_long_value_is_cut_and_says_how_long_it_was() -> None:
    assert safe("x" * (8 << 20), 16) == "x" * 16 + f"...({8 << 20} chars)"
    assert safe("short", 16) == "short"
    assert safe("\x1b" * 40, 4) == "\\x1b" * 4 + "...(40 chars)"


@given(st.text())
def test_output_never_holds_a_control_or_format_character(text: str) -> None:
    shown = safe(text)
    assert not any(unicodedata.category(c) in {"Cc", "Cf", "Zl", "Zp", "Cs"} for c in shown)


@given(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E)))
def test_printable_ascii_is_unchanged(text: str) -> None:
    assert safe(text) == text


@given(st.text(), st.integers(min_value=0, max_value=50))
def test_a_cut_value_shows_at_most_its_limit(text: str, limit: int) -> None:
    shown = safe(text, limit)
    if len(text) <= limit:
        assert shown == safe(text)
    else:
        assert shown.startswith(safe(text[:limit]))
        assert shown.endswith(f"...({len(text)} chars)")


def test_a_log_line_quoting_the_wire_is_one_escaped_line() -> None:
    formatter = SafeFormatter("cluster[scheduler]: %(message)s")
    record = logging.LogRecord(
        "cluster.scheduler", logging.INFO, __file__, 1, "refused node %s: %s", None, None
    )
    record.args = ("x\x1b[2J\nforged", "y" * (LOG_MESSAGE_MAX + 10))
    line = formatter.format(record)
    assert "\n" not in line
    assert "\x1b" not in line
    assert line.startswith("cluster[scheduler]: refused node x\\x1b[2J\\nforged: yyy")
    assert line.endswith(f"...({len(record.getMessage())} chars)")
    assert record.getMessage().startswith("refused node x\x1b")  # the record itself is unchanged


def test_the_html_report_escapes_controls_and_html() -> None:
    hostile = "<b>\x1b]0;x\x07\u202e</b>"
    page = report_html.faults_table(
        [
            {
                "kind": "kill",
                "target": hostile,
                "injected_at_s": 1.0,
                "detected_after_s": 0.1,
                "recovered_after_s": 1.0,
                "steps_lost": 0,
                "note": hostile,
            }
        ]
    )
    assert "<b>" not in page
    assert "\x1b" not in page
    assert "\u202e" not in page
    assert "&lt;b&gt;\\x1b]0;x\\x07\\u202e&lt;/b&gt;" in page
