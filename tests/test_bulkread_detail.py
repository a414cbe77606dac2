"""bulkread's detailed read (`detail`: inspect and the leak check): each row's logical
mappings and their VMAs, smaps usage per VMA and per row, and the fds listed by object,
against a reference parser (the only Python parser of maps and smaps left) and real
memfds."""

from __future__ import annotations

import gc
import mmap
import os
import re
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostpool.proc import bulkread, hostread, procfs
from hostpool.proc.scan import ROW_FDS, ROW_MAPPED, ROW_MAPPINGS, ROW_PATH, ROW_SMAPS, SMAPS, VMAS
from tests.test_bulkread import NEEDLE, OBJECTS, Memfd, maps_line, memfd  # noqa: F401

PAGE = mmap.PAGESIZE
untyped: Any = bulkread

REFERENCE_LINE = re.compile(
    rb"([0-9a-f]{1,16})-([0-9a-f]{1,16}) ([^ ]+) ([0-9a-f]{1,16}) "
    rb"([0-9a-f]{1,16}):([0-9a-f]{1,16}) ([0-9]{1,20}) +(.+)",
    re.DOTALL,
)
USAGE = (b"Rss:", b"Shared_Hugetlb:", b"Private_Hugetlb:", b"KernelPageSize:")


def reference(data: bytes, needles: tuple[bytes, ...], smaps: bool) -> dict[Any, Any]:
    """{key: [mappings, mapped, smaps resident, [[VMA, ...], ...]]}: lines split at `\\n`
    only, a VMA joins its object's last mapping when it starts where that ended, at its
    next offset (any offset without an inode), and nothing of another object lies
    between; smaps fields add to the VMA above them."""
    out: dict[Any, Any] = {}
    last: tuple[Any, int, int] | None = None  # (key, end, offset end) of the last VMA taken
    current: list[int] | None = None
    for line in data.split(b"\n"):
        if smaps and not line[:1].isdigit() and not (b"a" <= line[:1] <= b"f"):
            name, _, rest = line.partition(b" ")
            if current is not None and name in USAGE and rest.split():
                current[4 + USAGE.index(name)] = int(rest.split()[0]) * 1024
            continue
        current = None
        m = REFERENCE_LINE.fullmatch(line)
        if m is None or not any(n in m[8] for n in needles) or int(m[2], 16) < int(m[1], 16):
            last = None
            continue
        start, end, offset = int(m[1], 16), int(m[2], 16), int(m[4], 16)
        inode, key_path = int(m[7]), m[8]
        key = (inode, int(m[5], 16), int(m[6], 16)) if inode else key_path
        row = out.setdefault(key, [0, 0, 0 if smaps else None, []])
        joined = (
            last is not None
            and last[0] == key
            and last[1] == start
            and (inode == 0 or last[2] == offset)
        )
        current = [start, end, offset, m[3].decode(), 0, 0, 0, 0]
        if not joined:
            row[0] += 1
            row[3].append([])
        row[1] += end - start
        row[3][-1].append(current)
        last = (key, end, offset + end - start)
    for row in out.values():
        for mapping in row[3]:
            for i, vma in enumerate(mapping):
                usage = tuple(vma[4:]) if smaps else None
                if smaps:
                    row[2] += sum(vma[4:7])
                mapping[i] = (vma[0], vma[1], vma[2], vma[3], usage)
    return out


def smaps_entry(line: bytes, rss: int, shared: int, private: int, kps: int) -> bytes:
    """A line and its smaps fields as show_smap prints them (kB), VmFlags last."""
    fields = [
        (b"Size:", 4), (b"KernelPageSize:", kps), (b"MMUPageSize:", kps), (b"Rss:", rss),
        (b"Pss:", rss // 2), (b"Shared_Hugetlb:", shared), (b"Private_Hugetlb:", private),
        (b"Swap:", 0),
    ]  # fmt: skip
    body = [b"%-16s%8d kB" % (name, kb) for name, kb in fields]
    return b"\n".join([line, *body, b"THPeligible:    0", b"VmFlags: rd wr sh mr mw me ms sd"])


def got(data: bytes, needles: tuple[bytes, ...], smaps: bool) -> dict[Any, Any]:
    rows, _unnamed = bulkread.maps_objects(data, needles, {}, None, VMAS | (SMAPS if smaps else 0))
    return {
        k: [r[ROW_MAPPINGS], r[ROW_MAPPED], r[ROW_SMAPS], [[*m] for m in r[-1]]]
        for k, r in rows.items()
    }


GAP, SIZE, OBJECT = st.sampled_from([0, 0, 0, 1, 5]), st.integers(1, 6), st.sampled_from(OBJECTS)
KB = st.integers(0, 4096)
VMA = st.tuples(GAP, SIZE, OBJECT, st.booleans(), st.integers(0, 40), KB, KB, KB)


@settings(max_examples=300, deadline=None)
@given(
    vmas=st.lists(VMA, max_size=30),
    smaps=st.booleans(),
    needles=st.sampled_from([(NEEDLE,), (NEEDLE, b"/memfd:other")]),
)
def test_the_vmas_agree_with_a_reference_parser(
    vmas: list[Any], smaps: bool, needles: tuple[bytes, ...]
) -> None:
    """Kernel-shaped maps or smaps: every row's logical mappings, VMAs and usage are the
    reference's, and the rows' counts are the exporter's (the same loop made them)."""
    lines, address, next_offset = [], 0x55D0C0A00000, dict[Any, int]()
    for gap, pages, obj, continues, offset_pages, rss, shared, private in vmas:
        path, inode, major, minor = obj
        start = address + gap * PAGE
        address = start + pages * PAGE
        offset = next_offset.get(obj, 0) if continues else offset_pages * PAGE
        next_offset[obj] = offset + pages * PAGE
        line = maps_line(start, address, offset, inode, major, minor, path)
        lines.append(smaps_entry(line, rss, shared, private, 4) if smaps else line)
    data = b"\n".join(lines)
    assert got(data, needles, smaps) == reference(data, needles, smaps)
    plain, _ = bulkread.maps_objects(data, needles, {})
    detailed, _ = bulkread.maps_objects(data, needles, {}, None, VMAS)
    assert {k: r[:-1] for k, r in detailed.items()} == plain


def test_a_vmas_usage_is_its_own_fields_only() -> None:
    """A VMA without a path ends the one above (its fields are not added to it), a field
    of another name or shape adds nothing, and the sum is Rss and both hugetlb fields."""
    memfd_path = b"/memfd:hostpool.a (deleted)"
    data = b"\n".join(
        [
            smaps_entry(maps_line(0x1000, 0x2000, 0, 7, 0, 1, memfd_path), 4, 2048, 0, 4),
            smaps_entry(maps_line(0x2000, 0x3000, 0, 0, 0, 0, None), 999, 999, 999, 4),
            b"Rss:  junk kB",
            smaps_entry(maps_line(0x3000, 0x4000, 0x2000, 7, 0, 1, memfd_path), 8, 0, 2048, 2048),
            b"Rss:",
        ]
    )
    rows, _ = bulkread.maps_objects(data, (NEEDLE,), {}, None, VMAS | SMAPS)
    row = rows[(7, 0, 1)]
    assert row[ROW_SMAPS] == (4 + 2048 + 8 + 2048) << 10
    assert row[-1] == [
        [(0x1000, 0x2000, 0, "rw-s", (4096, 2048 << 10, 0, 4096))],
        [(0x3000, 0x4000, 0x2000, "rw-s", (8192, 0, 2048 << 10, 2048 << 10))],
    ]
    # smaps without the VMA list: the sums alone, the exporter's row otherwise
    rows, _ = bulkread.maps_objects(data, (NEEDLE,), {}, None, SMAPS)
    assert rows[(7, 0, 1)] == [
        memfd_path,
        None,
        2,
        2 * 0x1000,
        0,
        None,
        (4 + 2048 + 8 + 2048) << 10,
    ]
    with pytest.raises(ValueError):
        untyped.maps_objects(data, (NEEDLE,), {}, None, 4)


def test_real_smaps_and_fds_by_object(memfd: Memfd) -> None:  # noqa: F811
    """This process's smaps: the memfd's two mappings (one split in two VMAs) with the
    kernel's Rss; its fds listed by object with its length and pages."""
    name, fd, key = memfd
    one, two = mmap.mmap(fd, 8 * PAGE), mmap.mmap(fd, 4 * PAGE)
    try:
        one.madvise(mmap.MADV_DONTFORK, 0, 2 * PAGE)  # new VM flags: the VMA splits
        assert one[: 5 * PAGE] + two[: 4 * PAGE] == b"x" * (9 * PAGE)  # faulted in: Rss
        with open("/proc/self/smaps", "rb") as f:
            rows, _ = bulkread.maps_objects(f.read(), (name,), {}, None, VMAS | SMAPS)
        path, dir_fd = procfs.open_fd_dir("self")
        try:
            held: dict[Any, Any] = {}
            entries = os.listdir(os.fsencode(path))
            bulkread.stat_fds(dir_fd, entries, rows, None, None, held)
        finally:
            os.close(dir_fd)
    finally:
        one.close()
        two.close()
    row = rows[key]
    assert row[ROW_PATH] == b"/memfd:" + name + b" (deleted)"
    mappings = sorted(row[-1], key=len)
    assert [len(m) for m in mappings] == [1, 2]
    assert sum(v[1] - v[0] for m in mappings for v in m) == 12 * PAGE == row[ROW_MAPPED]
    assert all(v[4][3] == PAGE for m in mappings for v in m)
    # 5 pages written before: resident through both mappings as far as each reaches
    assert row[ROW_SMAPS] == sum(v[4][0] for m in mappings for v in m) == 9 * PAGE
    # the memfd and each mmap's own dup of it (CPython's mmap dups the fd)
    fds = held[key]
    assert b"%d" % fd in [entry for entry, _size, _pages in fds] and len(fds) == row[ROW_FDS]
    assert {(size, pages) for _entry, size, pages in fds} == {(8 * PAGE, 5 * PAGE)}


def test_detail_leaks_no_references() -> None:
    """300 detailed reads of smaps-shaped text leave the traced memory where it was (a
    leaked VMA tuple per call would be ~100 B x 60 per call, 1.8 MB over 300)."""
    memfd_path = b"/memfd:hostpool.a (deleted)"
    data = b"\n".join(
        smaps_entry(maps_line(0x1000 * (2 * i + 1), 0x1000 * (2 * i + 2), 0, 7 + i % 3, 0, 1,
                              memfd_path), 4, 0, 0, 4)
        for i in range(60)
    )  # fmt: skip
    for _ in range(3):
        bulkread.maps_objects(data, (NEEDLE,), {}, None, VMAS | SMAPS)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            bulkread.maps_objects(data, (NEEDLE,), {}, None, VMAS | SMAPS)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown


def test_the_host_views_smaps_residency_is_the_kernels() -> None:
    """hostread.smaps_resident (the host view's fallback where map_files is refused)
    through the same C loop: a memfd mapped with no fd left, 3 of its 8 pages touched;
    a process gone gives nothing."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.memfd_create("hostpool.detail.smaps", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8 * PAGE)
        st_ = os.fstat(fd)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        address = libc.mmap(None, 8 * PAGE, prot, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
    finally:
        os.close(fd)
    try:
        ctypes.memset(address, 1, 3 * PAGE)
        key = (st_.st_ino, os.major(st_.st_dev), os.minor(st_.st_dev))
        assert hostread.smaps_resident(os.getpid(), {key}) == {key: 3 * PAGE}
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        assert hostread.smaps_resident(pid_max + 1, {key}) == {}
    finally:
        libc.munmap(address, 8 * PAGE)
