"""bulkread's host mode (`devices` given): maps lines taken by device against a reference
parser, the extra row items, and fds on the devices stat-ed into rows of their own."""

from __future__ import annotations

import mmap
import os
import re
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hostpool.proc import bulkread
from hostpool.proc.hostread import HROW_CTIME, HROW_MTIME, HROW_SHARED, HROW_SIZE, HROW_VIA
from hostpool.proc.scan import ROW_ALLOCATED, ROW_FDS, ROW_MAPPED, ROW_MAPPINGS, ROW_PATH
from tests.test_bulkread import maps_line

PAGE = mmap.PAGESIZE
SHM, TMPFS, EXT4 = (0, 1), (0, 0x1B), (0x103, 2)
DEVICES = {os.makedev(*SHM), os.makedev(*TMPFS)}
OBJECTS = [  # (path, inode, device)
    (b"/memfd:anything at all (deleted)", 11, SHM),
    (b"/dev/zero (deleted)", 12, SHM),
    (b"/SYSV00000000 (deleted)", 0, SHM),  # shmid 0: inode 0, keyed by its path
    (b"/dev/shm/vllm_offload_1.mmap", 13, TMPFS),
    (b"/usr/lib/libc.so.6", 14, EXT4),
    (b"/home/memfd:lookalike", 15, EXT4),
]
LINE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) (\d+) +([^\n]+)$", re.M
)


def reference(data: bytes) -> dict[Any, list[Any]]:
    """[path, mappings, mapped, first VMA's map_files name, shared] per object on DEVICES."""
    out: dict[Any, list[Any]] = {}
    last: dict[Any, tuple[int, int]] = {}
    for m in LINE.finditer(data):
        start, end = int(m[1], 16), int(m[2], 16)
        offset, major, minor, inode = int(m[4], 16), int(m[5], 16), int(m[6], 16), int(m[7])
        if os.makedev(major, minor) not in DEVICES:
            continue
        key = (inode, major, minor) if inode else m[8]
        row = out.setdefault(key, [m[8], 0, 0, b"%x-%x" % (start, end), False])
        prev = last.get(key)
        row[1] += not (prev is not None and prev[0] == start and (inode == 0 or prev[1] == offset))
        row[2] += end - start
        row[4] = row[4] or m[3][3:4] == b"s"
        last[key] = (end, offset + end - start)
    return out


@settings(max_examples=200, deadline=None)
@given(
    vmas=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 4), st.sampled_from(OBJECTS), st.booleans()),
        max_size=30,
    )
)
def test_lines_are_taken_by_device(vmas: list[Any]) -> None:
    lines, address, offsets = [], 0x10000, dict[Any, int]()
    for gap, pages, (path, inode, (major, minor)), shared in vmas:
        start = address + gap * PAGE
        address = start + pages * PAGE
        offset = offsets.get(path, 0)
        offsets[path] = offset + pages * PAGE
        line = maps_line(start, address, offset, inode, major, minor, path)
        lines.append(line if shared else line.replace(b" rw-s ", b" rw-p ", 1))
    data = b"\n".join(lines)
    rows, unnamed = bulkread.maps_objects(data, (), {}, DEVICES)
    got = {
        k: [r[ROW_PATH], r[ROW_MAPPINGS], r[ROW_MAPPED], r[HROW_VIA][0], r[HROW_SHARED]]
        for k, r in rows.items()
    }
    assert got == reference(data)
    assert unnamed == list(got)
    assert all(r[HROW_VIA][1] == 0 and r[HROW_SIZE] is None for r in rows.values())


def test_without_devices_rows_are_the_exporters() -> None:
    line = maps_line(0x1000, 0x2000, 0, 11, 0, 1, b"/memfd:hostpool.a (deleted)")
    rows, _ = bulkread.maps_objects(line, (b"hostpool.",), {})
    assert [len(r) for r in rows.values()] == [7]
    assert bulkread.maps_objects(line, (), {}, set()) == ({}, [])


def test_fds_on_the_devices_become_rows() -> None:
    """A mapped memfd's fds join its row (pages, length, times from the first); an
    unmapped one gets a row of its own; a file elsewhere is skipped; nothing to link-read."""
    mapped, unmapped = os.memfd_create("a", 0), os.memfd_create("b", 0)
    other = os.open(sys.executable, os.O_RDONLY)  # a regular file on no device of ours
    dup = os.dup(mapped)
    try:
        for fd, size in ((mapped, 3 * PAGE), (unmapped, 5 * PAGE)):
            os.ftruncate(fd, size)
            os.pwrite(fd, b"x", 0)
        with mmap.mmap(mapped, 3 * PAGE):
            st_m, st_u = os.fstat(mapped), os.fstat(unmapped)
            with open("/proc/self/maps", "rb") as f:
                data = f.read()
            devices = {st_m.st_dev}
            rows, _ = bulkread.maps_objects(data, (), {}, devices)
            dir_fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
            try:
                entries = os.listdir(b"/proc/self/fd")
                unmatched, read = bulkread.stat_fds(dir_fd, entries, rows, None, devices)
            finally:
                os.close(dir_fd)
        assert unmatched == [] and read == len(entries)
        m = rows[(st_m.st_ino, os.major(st_m.st_dev), os.minor(st_m.st_dev))]
        assert m[ROW_FDS] == 3  # the fd, its dup, and the one mmap made
        assert (m[ROW_ALLOCATED], m[HROW_SIZE]) == (PAGE, 3 * PAGE)
        assert m[HROW_MTIME] == st_m.st_mtime and m[HROW_CTIME] == st_m.st_ctime
        u = rows[(st_u.st_ino, os.major(st_u.st_dev), os.minor(st_u.st_dev))]
        assert u[: ROW_ALLOCATED + 1] == [None, None, 0, 0, 1, PAGE]
        assert u[HROW_VIA] == (str(unmapped).encode(), 1) and u[HROW_SIZE] == 5 * PAGE
        other_st = os.fstat(other)
        assert (other_st.st_ino, os.major(other_st.st_dev), os.minor(other_st.st_dev)) not in rows
    finally:
        for fd in (mapped, unmapped, dup, other):
            os.close(fd)
