"""Names read from /proc, made safe for text output (terminals, logs, `key=value` lines).

Another user chooses a memfd's name and a process's command name: a newline in one
would forge a line of output, an escape sequence would drive the operator's terminal.
`printable` escapes everything that is not printable (and the backslash, so the escape
is unambiguous); `field` also quotes a value that would split a `key=value` line.
JSON output needs neither: the encoder escapes control characters itself.
"""

from __future__ import annotations

from typing import Final

_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
# surrogateescape maps an undecodable byte 0xNN to U+DCNN: show the byte
_SURROGATE_ESCAPES: Final = range(0xDC80, 0xDD00)


def printable(text: str) -> str:
    """`text` with control, format and undecodable characters as backslash escapes."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(ch) for ch in text)


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    if ch.isprintable():
        return ch
    code = ord(ch)
    if code in _SURROGATE_ESCAPES:
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def field(text: str) -> str:
    """A `key=value` value: `printable`, and double-quoted when it holds a space, `=` or
    `"` (or is empty), so one value can never read as several fields."""
    safe = printable(text)
    if safe and not any(c in safe for c in ' ="'):
        return safe
    return '"' + safe.replace('"', '\\"') + '"'
