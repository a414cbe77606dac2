"""Byte sizes and durations as people write them: 4096, "2MB", "2MiB", "1GB", "4GiB",
"512k"; "0", "30s", "10m", "2h", "1d", "1.5h"; and moments as every output writes them
(`iso_utc`)."""

from __future__ import annotations

import datetime
import re

from hostpool.errors import InvalidRequestError

# Hugepage and memory sizes in this domain are binary: "2MB" means 2 MiB, as sglang's
# SGLANG_HUGEPAGE_SIZE and the kernel's hugepages-2048kB do.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: object, *, what: str = "size") -> int:
    """Bytes from an int or a string such as "4GiB"; InvalidRequestError otherwise."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidRequestError(f"{what} must not be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if number != int(number):
                raise InvalidRequestError(f"{what} {value!r} is not a whole number of bytes")
            return int(number)
    raise InvalidRequestError(
        f"{what} must be bytes or a size like '2MB', '1GiB', '512k'; got {value!r}"
    )


def parse_size_with_unit(value: str, *, what: str, unit: str = "GiB") -> int:
    """`parse_size` for a flag whose figures are never a handful of bytes (a memory
    limit, a pool, a page size): a number without a unit is refused, but 0, with `unit`
    offered (`--engine-memory 48`: "did you mean 48GiB?"); InvalidRequestError."""
    match = _SIZE.fullmatch(value)
    if match and not match.group(2) and float(match.group(1)) != 0:
        raise InvalidRequestError(
            f"{what} {value.strip()} has no unit (did you mean {match.group(1)}{unit}?)"
        )
    return parse_size(value, what=what)


def format_size(n: int) -> str:
    """Short binary form used in labels and messages: 4KiB, 2MiB, 1GiB, 1.5GiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def page_spans(address: int, length: int, span: int, page_size: int) -> list[tuple[int, int]]:
    """[address, address+length) cut into (start, n) pieces of at most `span` bytes, each a
    whole number of pages (the last may be shorter)."""
    span = max(page_size, span // page_size * page_size)
    return [(address + off, min(span, length - off)) for off in range(0, length, span)]


_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", re.IGNORECASE)


def parse_duration(value: str, *, what: str = "duration") -> float:
    """Seconds from "0", "30s", "10m", "2h", "1d" (a bare number is seconds);
    InvalidRequestError otherwise (negative, empty, an unknown unit)."""
    match = _DURATION.fullmatch(value)
    if match is None:
        raise InvalidRequestError(
            f"{what} must be a duration like '30s', '10m', '2h', '1d' or '0'; got {value!r}"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def format_duration(seconds: float) -> str:
    """Short form for people: 45s, 12m, 2h3m, 3d4h (rounded down to its two largest units)."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m{secs}s" if secs else f"{minutes}m"
    return f"{secs}s"


def iso_utc(epoch: float) -> str:
    """`epoch` (seconds since 1970, as time.time()) as ISO-8601 UTC with milliseconds,
    e.g. `2026-01-31T12:00:00.123Z`: the one form of a moment in JSON output."""
    moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
