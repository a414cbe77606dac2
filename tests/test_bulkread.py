"""hostpool.proc.bulkread (the C loops over /proc): a reference parser, real fds, rows."""

from __future__ import annotations

import gc
import mmap
import os
import re
import secrets
import stat
import sys
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostpool.proc import bulkread, procfs
from hostpool.proc.scan import ROW_ALLOCATED, ROW_FDS, ROW_MAPPED, ROW_MAPPINGS, ROW_MATCH, ROW_PATH
from tests import helpers

PAGE = mmap.PAGESIZE
P = 0x1000  # a page in the maps text written here
NEEDLE = b"hostpool."
KV, IDX = ("hostpool.", "kv"), ("hostpool.", "idx")
untyped: Any = bulkread  # for the calls that pass what the stub forbids
FdDir = tuple[str, int]  # (path, open fd) of /proc/self/fd
Memfd = tuple[bytes, int, tuple[int, int, int]]  # (name, fd, identity)

# what kernel-shaped lines map: (path or None, inode, dev major, dev minor)
OBJECTS = [
    (b"/memfd:hostpool.a (deleted)", 1001, 0, 1),
    (b"/memfd:hostpool.a (deleted)", 1005, 0, 1),  # a namesake: another object
    (b"/dev/shm/hostpool.kv.1.2.ab12", 2**64 - 1, 0x103, 0x1A2),  # header can pass col 72
    (b"/dev/shm/hostpool.kv 1 with spaces (deleted)", 2002, 0, 0x19),
    (b"[anon:hostpool.x]", 0, 0, 0),
    (b"[anon:hostpool.y]", 0, 0, 0),
    (b"/memfd:other (deleted)", 4004, 0, 1),
    (b"/usr/lib/x86_64-linux-gnu/libc.so.6", 3003, 0x103, 2),
    (None, 0, 0, 0),  # an anonymous VMA: no path
]

REFERENCE_LINE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) [^ \n]+ ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) (\d+) +([^\n]+)$",
    re.MULTILINE,
)


def maps_line(
    start: int, end: int, offset: int, inode: int, major: int, minor: int, path: bytes | None
) -> bytes:
    """A line as show_map_vma prints it: a path is padded to column 72, then one space."""
    head = b"%08x-%08x rw-s %08x %02x:%02x %d " % (start, end, offset, major, minor, inode)
    return head if path is None else head.ljust(72) + b" " + path


def reference_objects(data: bytes, needles: tuple[bytes, ...]) -> dict[Any, list[Any]]:
    """[path, mappings, mapped] per object; a VMA is one more mapping unless it starts
    where the object's last VMA ended, at its next offset (any offset without an inode)."""
    out: dict[Any, list[Any]] = {}
    last: dict[Any, tuple[int, int]] = {}  # key -> (end, offset end) of its last VMA
    for m in REFERENCE_LINE.finditer(data):
        start, end, offset, major, minor = (int(g, 16) for g in m.groups()[:5])
        inode, path = int(m[6]), m[7]
        if not any(n in path for n in needles):
            continue
        key = (inode, major, minor) if inode else path
        row = out.setdefault(key, [path, 0, 0])
        prev = last.get(key)
        joined = prev is not None and prev[0] == start and (inode == 0 or prev[1] == offset)
        row[1] += not joined
        row[2] += end - start
        last[key] = (end, offset + end - start)
    return out


def parse(data: Any, names: dict[bytes, Any] | None = None) -> tuple[dict[Any, Any], list[Any]]:
    return bulkread.maps_objects(data, (NEEDLE,), {} if names is None else names)


# (pages before: mostly 0, pages, object, at its last VMA's next offset?, else this one)
GAP, SIZE, OBJECT = st.sampled_from([0, 0, 0, 1, 5]), st.integers(1, 6), st.sampled_from(OBJECTS)
VMAS = st.lists(st.tuples(GAP, SIZE, OBJECT, st.booleans(), st.integers(0, 40)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    vmas=VMAS,
    base=st.sampled_from([0x1000, 0x55D0C0A00000, 0xFFFFFFFF000000]),
    needles=st.sampled_from([(NEEDLE,), (NEEDLE, b"/memfd:other"), (b"hostpool.a",)]),
    final_newline=st.booleans(),
)
def test_maps_objects_agrees_with_a_reference_parser(
    vmas: list[Any], base: int, needles: tuple[bytes, ...], final_newline: bool
) -> None:
    """On kernel-shaped maps the C's per-line join rule agrees with the per-object one."""
    lines, address, next_offset = [], base, dict[Any, int]()
    for gap, pages, obj, continues, offset_pages in vmas:
        path, inode, major, minor = obj
        start = address + gap * PAGE
        address = start + pages * PAGE
        offset = next_offset.get(obj, 0) if continues else offset_pages * PAGE
        next_offset[obj] = offset + pages * PAGE
        lines.append(maps_line(start, address, offset, inode, major, minor, path))
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    rows, unnamed = bulkread.maps_objects(data, needles, {})
    expected = reference_objects(data, needles)
    assert {k: [r[ROW_PATH], r[ROW_MAPPINGS], r[ROW_MAPPED]] for k, r in rows.items()} == expected
    assert all(r[ROW_MATCH] is None and r[ROW_FDS:] == [0, None, None] for r in rows.values())
    assert unnamed == list(expected)


def test_the_vmas_of_one_mmap_count_once() -> None:
    """The join rule pinned on known cases (the reference above could share a mistake)."""
    memfd, anon = b"/memfd:hostpool.a (deleted)", b"[anon:hostpool.x]"
    lines = [
        maps_line(0x1000, 0x2000, 0, 7, 0, 1, memfd),
        maps_line(0x2000, 0x4000, 0x1000, 7, 0, 1, memfd),  # split by mprotect: joined
        maps_line(0x4000, 0x5000, 0, 7, 0, 1, memfd),  # adjacent, offset restarts: new
        maps_line(0x6000, 0x7000, 0x4000, 7, 0, 1, memfd),  # a gap: new
        maps_line(0x7000, 0x8000, 0, 0, 0, 0, anon),
        maps_line(0x8000, 0x9000, 0x55, 0, 0, 0, anon),  # no inode: address decides
        maps_line(0x9000, 0xA000, 0x5000, 7, 0, 1, memfd),  # another object between: new
    ]
    rows, _ = parse(b"\n".join(lines))
    assert rows[(7, 0, 1)][ROW_MAPPINGS : ROW_MAPPED + 1] == [4, 6 * P]
    assert rows[anon][ROW_MAPPINGS : ROW_MAPPED + 1] == [1, 2 * P]


def test_names_decide_each_paths_match() -> None:
    """A path names maps to None makes no row; one it maps to a match gets that match;
    one it lacks gets None and its key in `unnamed`, once however often it is met."""
    named, skipped = b"/memfd:hostpool.kv.1.2 (deleted)", b"[anon:hostpool.skip]"
    new_anon, new_memfd = b"[anon:hostpool.new]", b"/memfd:hostpool.new (deleted)"
    match = ("memfd", None, KV)
    lines = [
        maps_line(0x1000, 0x2000, 0, 7, 0, 1, named),
        maps_line(0x3000, 0x4000, 0, 0, 0, 0, skipped),
        maps_line(0x5000, 0x6000, 0, 0, 0, 0, new_anon),
        maps_line(0x7000, 0x8000, 0, 9, 0, 1, new_memfd),
        maps_line(0x9000, 0xA000, 0, 0, 0, 0, new_anon),
    ]
    rows, unnamed = parse(b"\n".join(lines), {named: match, skipped: None})
    assert list(rows) == [(7, 0, 1), new_anon, (9, 0, 1)]
    assert rows[(7, 0, 1)][ROW_MATCH] is match
    assert rows[new_anon][ROW_MATCH] is None and rows[new_anon][ROW_MAPPINGS] == 2
    assert rows[(9, 0, 1)][ROW_MATCH] is None
    assert unnamed == [new_anon, (9, 0, 1)]


TAIL = b"/memfd:hostpool.kv.1.2 (deleted)"
GOOD = maps_line(0x1000, 0x3000, 0, 7, 0, 1, TAIL)


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b"00000000000001000-2000 rw-s 0 00:01 7 " + TAIL, id="17-hex-digits"),
        pytest.param(b"1000-2000 rw-s 00000000000000000 00:01 7 " + TAIL, id="17-digit-offset"),
        pytest.param(b"7F000000-7F001000 rw-s 0 00:01 7 " + TAIL, id="uppercase-address"),
        pytest.param(b"1000-2000 rw-s 0000A000 00:01 7 " + TAIL, id="uppercase-offset"),
        pytest.param(b"2000-1000 rw-s 0 00:01 7 " + TAIL, id="end-before-start"),
        pytest.param(b"1000-2000 rw-s 0 00:01 " + b"0" * 20 + b"7 " + TAIL, id="21-digit-inode"),
        pytest.param(b"1000-2000 rw-s 0 00:01 18446744073709551616 " + TAIL, id="inode-2**64"),
        pytest.param(b"1000-2000 rw-s 0 00:01 7 " + b" " * 60, id="no-path-padded"),
        pytest.param(b"1000-2000 rw-s 0 00:01 7", id="no-path-no-space"),
        pytest.param(b"1000-2000 0 00:01 7 " + TAIL, id="no-perms"),
        pytest.param(b"1000-2000  rw-s 0 00:01 7 " + TAIL, id="empty-perms"),
        pytest.param(b"1000-2000 rw-s 00:01 7 " + TAIL, id="no-offset"),
        pytest.param(b"1000-2000 rw-s 0 7 " + TAIL, id="no-device"),
        pytest.param(b"1000-2000 rw-s 0 00:01 " + TAIL, id="no-inode"),
        pytest.param(b"1000 rw-s 0 00:01 7 " + TAIL, id="no-end"),
        pytest.param(TAIL, id="path-only"),
    ],
)
def test_a_line_of_another_shape_is_skipped(line: bytes) -> None:
    """Each names a needle: only the check that skips it keeps it out; the lines around parse."""
    assert parse(line) == ({}, [])
    after = maps_line(0x5000, 0x6000, 0x2000, 7, 0, 1, TAIL)
    rows, unnamed = parse(GOOD + b"\n" + line + b"\n" + after)
    assert list(rows) == unnamed == [(7, 0, 1)]
    assert rows[(7, 0, 1)][ROW_MAPPINGS : ROW_MAPPED + 1] == [2, 3 * P]


def test_odd_but_valid_input_parses() -> None:
    """No last newline, any buffer, spaces in a path, the widest numbers the kernel prints."""
    assert parse(b"") == ({}, [])
    assert list(parse(GOOD)[0]) == [(7, 0, 1)]
    assert parse(bytearray(GOOD)) == parse(memoryview(GOOD)) == parse(GOOD + b"\n")
    spaced = b"/dev/shm/hostpool. a b  (deleted)"
    rows, _ = parse(b"1000-2000 rw-s 0 00:01 7" + b" " * 100 + spaced)
    assert rows[(7, 0, 1)][ROW_PATH] == spaced
    big = b"ffffffffffffe000-fffffffffffff000 r--s ffffffffffff0000 103:1a2 %d " % (2**64 - 1)
    rows, _ = parse(big + TAIL)
    assert rows == {(2**64 - 1, 0x103, 0x1A2): [TAIL, None, 1, P, 0, None, None]}


def test_bad_arguments_raise_type_error() -> None:
    """Refusals, not crashes; a refused buffer is released (the bytearray resizes)."""
    data = bytearray(GOOD)
    refused: list[Any] = [([NEEDLE], {}), (("x",), {}), ((NEEDLE, b""), {}), ((NEEDLE,), ())]
    for needles, names in refused:
        with pytest.raises(TypeError):
            untyped.maps_objects(data, needles, names)
    data += b"\n"  # BufferError if a refusal kept the buffer exported
    with pytest.raises(TypeError):
        untyped.maps_objects(GOOD.decode(), (NEEDLE,), {})
    for match in [("memfd", None), ["memfd", None, KV]]:
        with pytest.raises(TypeError):
            bulkread.pool_totals({(1, 0, 1): [b"p", match, 1, 1, 1, None, None]})
    for bad_row in ([b"p", None, 1, 1, 1, None], (b"p", None, 1, 1, 1, None, None)):
        with pytest.raises(TypeError):
            untyped.pool_totals({(1, 0, 1): bad_row})
        with pytest.raises(TypeError):
            untyped.unmeasured({(1, 0, 1): bad_row})


@pytest.fixture
def fd_dir() -> Iterator[FdDir]:
    path, dir_fd = procfs.open_fd_dir("self")
    yield path, dir_fd
    os.close(dir_fd)


@pytest.fixture
def memfd() -> Iterator[Memfd]:
    # 8 pages, 5 of them written, under a name no other object has
    name = f"hostpool.bulk.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, 8 * PAGE)
    os.pwrite(fd, b"x" * (5 * PAGE), 0)
    st_ = os.fstat(fd)
    yield name.encode(), fd, (st_.st_ino, os.major(st_.st_dev), os.minor(st_.st_dev))
    os.close(fd)


def test_stat_fds_refuses_entries_and_rows_of_another_type(fd_dir: FdDir, memfd: Memfd) -> None:
    """A str entry (in the first batch of 256 or later) raises; no other entry stays held."""
    (_, dir_fd), (_, fd, key) = fd_dir, memfd
    for bad_at in (0, 3, 290):
        entries: list[Any] = [bytes(bytearray(b"%d" % fd)) for _ in range(300)]  # distinct
        entries[bad_at] = str(fd)
        before = [sys.getrefcount(e) for e in entries]
        with pytest.raises(TypeError):
            bulkread.stat_fds(dir_fd, entries, {}, None)
        assert [sys.getrefcount(e) for e in entries] == before
    for bad_row in ([b"p", None, 1, 1, 0, None], (b"p", None, 1, 1, 0, None, None)):
        with pytest.raises(TypeError):
            untyped.stat_fds(dir_fd, [str(fd).encode()], {key: bad_row}, None)


def test_stat_fd_gives_the_identity_mode_and_blocks_fstat_does(fd_dir: FdDir, memfd: Memfd) -> None:
    """The key joining an fd to its maps row, and its pages; a closed fd raises as os.stat."""
    (_, dir_fd), (_, fd, key) = fd_dir, memfd
    st_ = os.fstat(fd)
    assert bulkread.stat_fd(dir_fd, str(fd).encode()) == (key, st_.st_mode, st_.st_blocks)
    assert st_.st_blocks * 512 >= 5 * PAGE
    os.close(closed := os.dup(fd))
    entry = b"%d" % closed
    with pytest.raises(FileNotFoundError) as raised:
        bulkread.stat_fd(dir_fd, entry)
    assert raised.value.filename == entry


def test_stat_fds_joins_this_processes_fds_to_its_maps_rows(fd_dir: FdDir, memfd: Memfd) -> None:
    """Both fds of a mapped memfd count in its row (its pages from the first); an unmapped
    memfd of the same name is left for a link read; a pipe and a closed fd are neither."""
    (path, dir_fd), (name, fd, key) = fd_dir, memfd
    unmapped = os.memfd_create(name.decode() + ".unmapped", os.MFD_CLOEXEC)
    r, w = os.pipe()

    def mapped_rows() -> dict[Any, Any]:
        with open("/proc/self/maps", "rb") as f:
            rows, unnamed = bulkread.maps_objects(f.read(), (name,), {})
        assert list(rows) == unnamed == [key]
        return rows

    try:
        with mmap.mmap(fd, 8 * PAGE):  # holds a dup of fd
            rows = mapped_rows()
            assert rows[key][:4] == [b"/memfd:" + name + b" (deleted)", None, 1, 8 * PAGE]
            entries = os.listdir(os.fsencode(path))
            closed = b"%d" % (max(map(int, entries)) + 1)  # above every open fd
            entries.append(closed)
            unmatched, read = bulkread.stat_fds(dir_fd, entries, rows, None)
            assert read == len(entries)
            assert rows[key][ROW_FDS:] == [2, os.fstat(fd).st_blocks * 512, None]
            assert str(unmapped).encode() in unmatched
            assert not {closed, *(b"%d" % n for n in (fd, r, w, dir_fd))} & set(unmatched)
            assert all(stat.S_ISREG(os.stat(e, dir_fd=dir_fd).st_mode) for e in unmatched)
            rows = mapped_rows()
            assert bulkread.stat_fds(dir_fd, entries, rows, time.monotonic() - 1) == ([], 0)
            assert rows[key][ROW_FDS:] == [0, None, None]
            rows = mapped_rows()  # 600 fds: three batches; pages already known are kept
            rows[key][ROW_ALLOCATED] = 1
            many = [b"%d" % fd] * 600
            assert bulkread.stat_fds(dir_fd, many, rows, time.monotonic() + 3600) == ([], 600)
            assert rows[key][ROW_FDS:] == [600, 1, None]
    finally:
        for other in (unmapped, r, w):
            os.close(other)


def hand_row(pool: tuple[str, str] | None, *mappings_mapped_fds_allocated_smaps: Any) -> list[Any]:
    match = None if pool is None else ("memfd", None, pool)  # the C reads only the pool
    return [b"/memfd:hostpool.x", match, *mappings_mapped_fds_allocated_smaps]


ROWS: dict[Any, list[Any]] = {
    (1, 0, 1): hand_row(KV, 1, 10 * PAGE, 2, 4 * PAGE, None),
    (2, 0, 1): hand_row(KV, 3, 2 * PAGE, 1, 8 * PAGE, 123),  # allocated > mapped
    b"[anon:hostpool.kv.1.2]": hand_row(KV, 1, 4 * PAGE, 0, None, 3 * PAGE),
    (3, 0, 1): hand_row(IDX, 2, PAGE, 0, None, None),
    (4, 0, 1): hand_row(IDX, 1, 1 << 40, 1, 1 << 39, None),
    (5, 0, 1): hand_row(None, 5, 5, 5, None, 5),
}


def test_pool_totals_sum_each_pools_rows() -> None:
    """Sums; resident: allocated at most mapped, else smaps, else 0; no match: left out."""
    snapshot = [list(r) for r in ROWS.values()]
    expected = {KV: [3, 5, 16 * PAGE, 9 * PAGE], IDX: [1, 3, PAGE + (1 << 40), 1 << 39]}
    assert bulkread.pool_totals(ROWS) == expected
    assert [list(r) for r in ROWS.values()] == snapshot
    assert bulkread.pool_totals({}) == {}


def test_unmeasured_lists_the_rows_no_fd_measured() -> None:
    """Exactly the keys whose allocated bytes are None, whatever their smaps or match."""
    assert bulkread.unmeasured(ROWS) == [b"[anon:hostpool.kv.1.2]", (3, 0, 1), (5, 0, 1)]
    assert bulkread.unmeasured({}) == []


def test_entries_that_shrink_during_a_read_are_not_read_past_their_end() -> None:
    """The list may change while stat_fds reads it (another thread while the GIL is
    released; here a rows key's __eq__): in a child, as reading past the end crashes."""

    def read() -> object:
        fd = os.memfd_create("hostpool.shrink", os.MFD_CLOEXEC)
        _, dir_fd = procfs.open_fd_dir("self")
        key, entries = bulkread.stat_fd(dir_fd, b"%d" % fd)[0], [b"%d" % fd] * 600
        methods = {"__hash__": lambda _: hash(key), "__eq__": lambda *_: entries.clear()}
        rows = {type("Shrinker", (), methods)(): hand_row(KV, 1, 1, 0, None, None)}
        return bulkread.stat_fds(dir_fd, entries, rows, None)

    code, out = helpers.run_forked(read)
    assert code >= 0, f"killed by signal {-code}: {out}"


def realistic_maps() -> tuple[bytes, dict[bytes, Any]]:
    """2,000 lines, 1/4 memfds (each met twice), 1/4 named anonymous VMAs, 1/2 others."""
    lines, names = [], dict[bytes, Any]()
    for i in range(2000):
        start, obj = 0x7F0000000000 + i * 2 * PAGE, i // 8
        memfd = b"/memfd:hostpool.kv.%d.0 (deleted)" % obj
        path = [memfd, b"[anon:hostpool.a.%d]" % i, b"/usr/lib/libc.so.6", None][i % 4]
        inode = [10_000 + obj, 0, 3003, 0][i % 4]
        lines.append(maps_line(start, start + PAGE, 0, inode, 0, 1, path))
        if i % 4 == 0 and obj % 3 < 2:  # the others are new to names
            names[memfd] = ("memfd", None, KV) if obj % 3 == 0 else None
    return b"\n".join(lines) + b"\n", names


def test_no_reference_leaks(fd_dir: FdDir, memfd: Memfd) -> None:
    """300 calls of each leave the traced memory where it was. Bound: one call's rows
    are ~670 objects (a row list ~120 B, its key tuple ~70 B, its path ~70 B each), so a
    leaked row per call is >= 50 KiB per call, 15 MB over 300 calls; a leaked `unnamed`
    list alone (~600 keys) ~1.5 MB; a leaked `unmatched` list of 256 entries ~600 KB. The
    64 KiB bound is far below all of them and above interpreter noise."""
    data, names = realistic_maps()
    rows, _ = bulkread.maps_objects(data, (NEEDLE,), names)
    assert len(rows) > 600  # every branch ran: named, skipped and unnamed paths
    _, dir_fd = fd_dir
    entry = b"%d" % memfd[1]  # a regular file none of `rows`: each read lands in unmatched
    bad: list[Any] = [entry] * 300 + ["not bytes"]  # the first batch is read, then refused
    for _ in range(3):  # warm up caches and free lists
        bulkread.maps_objects(data, (NEEDLE,), names)
        with pytest.raises(TypeError):
            bulkread.stat_fds(dir_fd, bad, {}, None)
    refs = sys.getrefcount(entry)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            bulkread.maps_objects(data, (NEEDLE,), names)
            with pytest.raises(TypeError):
                bulkread.stat_fds(dir_fd, bad, {}, None)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert sys.getrefcount(entry) == refs
