"""hostpool.proc.textsafe: names from /proc made safe for text output."""

from __future__ import annotations

import pytest

from hostpool.proc.textsafe import field, printable


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("hostpool.kv.1.2", "hostpool.kv.1.2"),  # the common case is untouched
        ("a\nb\rc\td", "a\\nb\\rc\\td"),
        ("\x1b[2J\x07\x7f", "\\x1b[2J\\x07\\x7f"),  # ESC, BEL, DEL
        ("\x9b31m", "\\x9b31m"),  # the 8-bit CSI
        ("back\\slash", "back\\\\slash"),  # escapes stay unambiguous
        ("bad\udcffbyte", "bad\\xffbyte"),  # an undecodable byte (surrogateescape)
        ("rtl\u202eevil", "rtl\\u202eevil"),  # bidi override: reorders the line shown
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("über", "über"),  # printable non-ASCII stays readable
    ],
)
def test_printable(raw: str, shown: str) -> None:
    assert printable(raw) == shown


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("kv", "kv"),
        ("", '""'),
        ("a b", '"a b"'),
        ("x=1", '"x=1"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("line\nbreak", "line\\nbreak"),
    ],
)
def test_field_is_one_key_value_token(raw: str, shown: str) -> None:
    assert field(raw) == shown
