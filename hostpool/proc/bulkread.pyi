"""The exporter's per-line, per-fd and per-object loops over /proc, in C
(hostpool/proc/bulkread.c). Rows are hostpool.proc.scan's (see `Row` there)."""

from typing import Any

Identity = tuple[int, int, int]  # (st_ino, dev major, dev minor)
Key = Identity | bytes
Row = list[Any]

def maps_objects(
    data: bytes,
    needles: tuple[bytes, ...],
    names: dict[bytes, Any],
    devices: set[int] | frozenset[int] | None = None,
    detail: int = 0,
    /,
) -> tuple[dict[Key, Row], list[Key]]: ...
def stat_fd(dir_fd: int, name: bytes, /) -> tuple[Identity, int, int]: ...
def stat_fds(
    dir_fd: int,
    entries: list[bytes],
    rows: dict[Key, Row],
    deadline: float | None,
    devices: set[int] | frozenset[int] | None = None,
    held: dict[Key, list[tuple[bytes, int, int]]] | None = None,
    /,
) -> tuple[list[bytes], int]: ...
def pool_totals(rows: dict[Key, Row], /) -> dict[Any, list[int]]: ...
def unmeasured(rows: dict[Key, Row], /) -> list[Key]: ...
