"""hostpool.proc.procfs against real memfds, /dev/shm files, mappings and processes."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostpool.proc import names, procfs, procgroup, scan
from hostpool.proc.names import ShmName, classify_path, parse_name
from tests import helpers, waiting

PAGE = mmap.PAGESIZE
KiB, MiB = 1 << 10, 1 << 20
MFD_HUGETLB, MFD_HUGE_2MB = 0x4, 21 << 26


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("hostpool.kv.123.4", ShmName("hostpool.kv.123.4", "hostpool.", "kv", 123, 4)),
        (  # the /dev/shm fallback adds a random suffix
            "hostpool.kv_2-a.9.10.3f9ac1d2",
            ShmName("hostpool.kv_2-a.9.10.3f9ac1d2", "hostpool.", "kv_2-a", 9, 10),
        ),
        (  # hostpool's sglang-compatible prefix
            "sglang_host_pool_kv.55.0",
            ShmName("sglang_host_pool_kv.55.0", "sglang_host_pool_", "kv", 55, 0),
        ),
        (  # sglang's own names carry no pool
            "sglang_host_pool_" + "ab" * 16,
            ShmName("sglang_host_pool_" + "ab" * 16, "sglang_host_pool_", "-"),
        ),
        ("sglang_host_pool_" + "cd" * 16 + ".mmap",
         ShmName("sglang_host_pool_" + "cd" * 16 + ".mmap", "sglang_host_pool_", "-")),
        ("hostpool.", ShmName("hostpool.", "hostpool.", "-")),
        ("hostpool.a.b.c", ShmName("hostpool.a.b.c", "hostpool.", "-")),
        ("hostpoolX.kv.1.2", None),
        ("other.kv.1.2", None),
    ],
)  # fmt: skip
def test_parse_name(name: str, expected: ShmName | None) -> None:
    assert parse_name(name) == expected


def test_a_narrower_prefix_selects_but_the_pool_still_parses() -> None:
    assert parse_name("hostpool.kv.1.2", ("hostpool.", "hostpool.kv")) == ShmName(
        "hostpool.kv.1.2", "hostpool.kv", "kv", 1, 2
    )
    assert parse_name("hostpool.idx.1.2", ("hostpool.kv",)) is None
    assert parse_name("myapp_kv.1.2", ("myapp_",)) == ShmName("myapp_kv.1.2", "myapp_", "kv", 1, 2)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/memfd:hostpool.kv.1.2 (deleted)", ("memfd", "hostpool.kv.1.2")),
        ("/memfd:name with spaces (deleted)", ("memfd", "name with spaces")),
        ("/dev/shm/hostpool.kv.1.2.ab12 (deleted)", ("file", "hostpool.kv.1.2.ab12")),
        ("/dev/shm/sglang_host_pool_ab.mmap", ("file", "sglang_host_pool_ab.mmap")),
        ("/mnt/fallback/hostpool.kv.1.2.ab (deleted)", ("file", "hostpool.kv.1.2.ab")),
        ("[anon:hostpool.kv.1.2]", ("anon", "hostpool.kv.1.2")),
        ("[anon_shmem:hostpool.kv.1.2]", ("anon", "hostpool.kv.1.2")),
        ("/usr/lib/libc.so.6", None),
        ("[heap]", None),
        ("socket:[1234]", None),
    ],
)
def test_classify_path(path: str, expected: tuple[str, str] | None) -> None:
    assert classify_path(path) == expected


@pytest.fixture
def memfd() -> Iterator[tuple[str, int]]:
    name = f"hostpool.pfs.{os.getpid()}.{secrets.randbelow(1 << 30)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, MiB)
    yield name, fd
    os.close(fd)


def test_fds_of_self_identify_memfds_and_devshm_files(memfd: tuple[str, int]) -> None:
    name, fd = memfd
    os.pwrite(fd, b"x" * (3 * PAGE), 0)
    shm_name = f"hostpool.pfs.{os.getpid()}.0.{secrets.token_hex(4)}"
    path = f"/dev/shm/{shm_name}"
    file_fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    try:
        os.ftruncate(file_fd, 8 * KiB)
        found = {f.fd: f for f in procfs.shm_fds("self") if f.name.pool == "pfs"}
        assert set(found) == {fd, file_fd}
        st = os.fstat(fd)
        got = found[fd]
        assert (got.kind, got.name.name, got.target) == ("memfd", name, f"/memfd:{name} (deleted)")
        assert (got.dev, got.ino, got.size) == (st.st_dev, st.st_ino, MiB)
        assert got.allocated_bytes == 3 * PAGE
        assert (found[file_fd].kind, found[file_fd].name.name) == ("file", shm_name)
        assert found[file_fd].ino == os.fstat(file_fd).st_ino
        assert procfs.shm_fds("self", ("hostpool.zzz",)) == []
    finally:
        os.close(file_fd)


def test_mappings_with_usage_match_the_kernels_residency(memfd: tuple[str, int]) -> None:
    name, fd = memfd
    with mmap.mmap(fd, MiB) as mm:
        for off in range(0, 5 * PAGE, PAGE):
            mm[off] = 1
        view = ctypes.c_char.from_buffer(mm)
        address = ctypes.addressof(view)
        del view  # a live buffer export would stop mm.close()
        (plain,) = [m for m in procgroup.shm_mappings("self") if m.name.name == name]
        (used,) = [m for m in procgroup.shm_mappings("self", usage=True) if m.name.name == name]
        assert helpers.mincore_resident(address, MiB) == 5 * PAGE
    st = os.fstat(fd)
    assert (plain.start, plain.size, plain.offset, plain.kind) == (address, MiB, 0, "memfd")
    assert (plain.dev, plain.ino, plain.usage) == (st.st_dev, st.st_ino, None)
    assert used.usage is not None
    assert used.usage.rss == used.usage.resident_bytes == 5 * PAGE
    assert used.usage.kernel_page_size == PAGE


def test_one_mmap_split_into_vmas_is_one_mapping(memfd: tuple[str, int]) -> None:
    name, fd = memfd
    mm = mmap.mmap(fd, MiB)
    try:
        mm.madvise(mmap.MADV_DONTFORK, 0, 4 * PAGE)  # new VM flags: the VMA splits
        mm2 = mmap.mmap(fd, MiB)  # a second, separate mapping
        try:
            process = procgroup.read_process("self", (name,))
            assert len(process.mappings) == 3
            (obj,) = procgroup.group_objects(process)
            assert sorted(len(m) for m in obj.mappings) == [1, 2]
            assert obj.mapped_bytes == 2 * MiB
            kinds = [f.kind for f in procgroup.findings([obj])]
            assert kinds == ["mapped_twice"]
        finally:
            mm2.close()
    finally:
        mm.close()


@pytest.fixture
def touched_hugepage(hugepages_2m: int) -> Iterator[str]:
    """A hugetlb memfd of one 2 MiB page, mapped here and touched: its name."""
    name = f"hostpool.huge.{os.getpid()}.0"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | MFD_HUGETLB | MFD_HUGE_2MB)
    try:
        os.ftruncate(fd, 2 * MiB)
        with mmap.mmap(fd, 2 * MiB) as mm:
            mm[0] = 1
            yield name
    finally:
        os.close(fd)


def test_hugetlb_pages_count_as_resident(touched_hugepage: str) -> None:
    name = touched_hugepage
    (m,) = [m for m in procgroup.shm_mappings("self", usage=True) if m.name.name == name]
    assert m.usage is not None
    assert m.usage.rss == 0  # hugetlb pages are not in Rss
    assert m.usage.resident_bytes == 2 * MiB
    assert m.usage.kernel_page_size == 2 * MiB


def test_missing_and_forbidden_processes_raise_distinct_errors(root: None) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    with pytest.raises(procfs.ProcessNotFoundError):
        procgroup.read_process(pid_max + 1)
    with pytest.raises(procfs.ProcessNotFoundError):
        procfs.check_readable(pid_max + 1)

    def read_pid1() -> str:
        for attempt in (lambda: procfs.shm_fds(1), lambda: procgroup.shm_mappings(1)):
            try:
                attempt()
            except procfs.ProcessAccessError as exc:
                assert isinstance(exc, PermissionError) and exc.pid == 1
                continue
            return "read without permission"
        try:
            procfs.check_readable(1)
        except procfs.ProcessAccessError as exc:
            return str(exc)
        return "check_readable passed"

    import psutil  # noqa: F401  (loaded before the fork: uid 65534 cannot read /root)

    code, text = helpers.run_forked(read_pid1, uid=65534)
    assert code == 0, text
    assert text.startswith(
        "permission denied reading /proc/1/fd: it runs as uid 0 gid 0 and you as uid 65534 "
        "gid 65534; reading another user's process needs CAP_SYS_PTRACE and "
        "CAP_DAC_READ_SEARCH"
    ), text


def test_scan_finds_other_processes_by_prefix() -> None:
    prefix = f"hostpool.scan{secrets.token_hex(4)}"
    child = subprocess.Popen(
        [sys.executable, "-c",
         f"import os, sys; fd = os.memfd_create('{prefix}.1.2'); print(fd, flush=True); "
         "sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        fd = int(child.stdout.readline())
        result = procgroup.scan((prefix,))
        assert [(p.pid, [f.fd for f in p.fds]) for p in result.processes] == [(child.pid, [fd])]
        (f,) = result.processes[0].fds
        assert (f.name.prefix, f.name.pool) == (prefix, prefix.removeprefix("hostpool."))
    finally:
        child.kill()
        child.wait()


def test_maps_lines_of_named_anonymous_regions_parse() -> None:
    """The kernel here lacks CONFIG_ANON_VMA_NAME, so parse lines as they appear elsewhere."""
    (anon,) = procgroup.parse_maps(
        b"7f0000000000-7f0000200000 rw-p 00000000 00:00 0    [anon:hostpool.kv.12.3]"
    )
    assert (anon.kind, anon.name.pool, anon.size, anon.ino) == ("anon", "kv", 2 * MiB, 0)
    assert procgroup.parse_maps(b"7f00-7f01 r--p 00000000 fe:00 29775  /usr/lib/x.so") == []


def test_a_process_reaped_between_opening_and_listing_its_fds_is_not_found() -> None:
    """The exact window of a fork loop's race, made deterministic: /proc/PID/fd opened
    while the process lives, listed after it was reaped (the kernel answers ENOENT)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    fd_dir = f"/proc/{child.pid}/fd"
    dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        child.kill()
        child.wait()
        with pytest.raises(procfs.ProcessNotFoundError):
            procfs._shm_fds_in(dir_fd, child.pid, fd_dir, names.KNOWN_PREFIXES)
    finally:
        os.close(dir_fd)
        assert child.stdin is not None
        child.stdin.close()


# -- holdings: the exporter's reader ----------------------------------------------------

# One of each way a process holds shm, in a real child: memfds mapped by Python's mmap
# (its fd + mmap's dup), one split into two VMAs by madvise, one mapped twice, an fd that
# maps nothing, a deleted /dev/shm file, and a memfd mapped through libc with its fd
# closed (no fd at all: residency from smaps). argv[1] is the prefix.
HOLDER = """
import ctypes, mmap, os, sys
prefix, keep, PAGE = sys.argv[1], [], mmap.PAGESIZE
def memfd(pool, size, touched):
    fd = os.memfd_create(f"{prefix}{pool}.{os.getpid()}.{len(keep)}", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    for off in range(0, touched, PAGE):
        mm[off] = 1
    keep.append((fd, mm))
    return fd, mm
memfd("kv", 1 << 20, 5 * PAGE)
memfd("kv", 256 << 10, 256 << 10)[1].madvise(mmap.MADV_DONTFORK, 0, 4 * PAGE)
fd, _ = memfd("swa", 64 << 10, 2 * PAGE)
keep.append(mmap.mmap(fd, 64 << 10))  # a second, separate mapping
keep.append(os.memfd_create(f"{prefix}idle.{os.getpid()}.9"))  # held, never mapped
path = f"/dev/shm/{prefix}file.{os.getpid()}.0.{os.urandom(4).hex()}"
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
os.unlink(path)
os.ftruncate(fd, 128 << 10)
os.pwrite(fd, b"x" * (3 * PAGE), 0)
keep.append(mmap.mmap(fd, 128 << 10))
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
fd = os.memfd_create(f"{prefix}nofd.{os.getpid()}.0")
os.ftruncate(fd, 64 << 10)
address = libc.mmap(None, 64 << 10, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
ctypes.memset(address, 1, 3 * PAGE)
os.close(fd)
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def holder() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    prefix = f"hostpool.hold{secrets.token_hex(3)}"
    proc = helpers.python_child(HOLDER, prefix + "_")
    try:
        yield prefix, proc
    finally:
        proc.kill()
        proc.wait()


def _detailed(pid: int, prefix: str) -> dict[str, tuple[int, int, int]]:
    """(open fds, logical mappings, mapped bytes) per pool from the detailed reader."""
    objects = procgroup.group_objects(procgroup.read_process(pid, (prefix,), usage=False))
    return {u.pool: (u.open_fds, u.mappings, u.mapped_bytes) for u in procgroup.pool_usage(objects)}


@pytest.mark.parametrize("fds_by", ["stat", "link", "auto"])
def test_holdings_agree_with_the_detailed_reader(
    holder: tuple[str, subprocess.Popen[str]], fds_by: scan.FdStrategy
) -> None:
    prefix, proc = holder
    matcher = scan.Matcher((prefix,))
    holdings = scan.read_holdings(proc.pid, matcher, fds_by=fds_by)
    assert holdings.complete
    assert scan.fill_residency(holdings, matcher, {})
    totals = procgroup.holdings_totals(holdings)
    pool = prefix.removeprefix("hostpool.") + "_"
    got = {p: (t.open_fds, t.mappings, t.mapped_bytes) for (_, p), t in totals.items()}
    assert got == _detailed(proc.pid, prefix)
    # each figure from the kernel's own view, independently of both readers
    assert got[f"{pool}kv"] == (4, 2, MiB + 256 * KiB)  # 2 memfds x (fd + mmap's dup)
    assert got[f"{pool}swa"] == (3, 2, 128 * KiB)  # fd, 2 mmap dups, 2 mappings
    assert got[f"{pool}idle"] == (1, 0, 0)
    assert got[f"{pool}file"] == (2, 1, 128 * KiB)
    assert got[f"{pool}nofd"] == (0, 1, 64 * KiB)
    resident = {p: t.resident_bytes for (_, p), t in totals.items()}
    assert resident == {
        f"{pool}kv": 5 * PAGE + 256 * KiB,
        f"{pool}swa": 2 * PAGE,  # the object's pages once, though mapped twice
        f"{pool}idle": 0,  # not mapped: held memory is not "of the mapped bytes"
        f"{pool}file": 3 * PAGE,  # written through its fd, never touched through the map
        f"{pool}nofd": 3 * PAGE,  # from smaps: no fd to stat
    }


def test_resident_bytes_are_the_pages_the_object_holds(memfd: tuple[str, int]) -> None:
    """Pages written through the fd back the mapping though this process never touched
    them (Rss 0): residency is the object's st_blocks, capped at the bytes mapped."""
    name, fd = memfd
    os.pwrite(fd, b"x" * (7 * PAGE), 0)
    with mmap.mmap(fd, 4 * PAGE) as mm:  # maps 4 of the object's 7 written pages
        matcher = scan.Matcher((name,))
        holdings = scan.read_holdings("self", matcher)
        (row,) = holdings.rows.values()
        st = os.fstat(fd)
        assert row[scan.ROW_ALLOCATED] == st.st_blocks * 512 == 7 * PAGE
        (totals,) = procgroup.holdings_totals(holdings).values()
        assert totals.resident_bytes == 4 * PAGE
        (m,) = [m for m in procgroup.shm_mappings("self", (name,), usage=True)]
        assert m.usage is not None and m.usage.rss == 0  # what smaps would have said
        mm[0] = 1  # does not change the object's page count


def test_hugetlb_objects_are_resident_in_whole_pages(touched_hugepage: str) -> None:
    name = touched_hugepage
    holdings = scan.read_holdings("self", scan.Matcher((name,)))
    (totals,) = procgroup.holdings_totals(holdings).values()
    (m,) = [m for m in procgroup.shm_mappings("self", (name,), usage=True)]
    assert m.usage is not None
    assert totals.resident_bytes == m.usage.resident_bytes == 2 * MiB


def test_an_object_is_measured_once_per_scan_whoever_maps_it() -> None:
    """A child forked after mapping maps the same objects (same inode); with its own fds
    closed it has none to stat: it takes the pages the parent's fd measured, whichever
    process the scan reads first, not its own (empty) page tables."""
    prefix = f"hostpool.share{secrets.token_hex(3)}"
    code = """
import mmap, os, sys
fd = os.memfd_create(sys.argv[1] + ".1.0")
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
mm.write(b"x" * (5 * mmap.PAGESIZE))
r, w = os.pipe()
if os.fork() == 0:  # the mapping without any fd: every inherited one closed
    os.closerange(3, w)
    os.closerange(w + 1, 1 << 16)
    os.close(w)  # the parent's read sees EOF: the child holds no fd now
    sys.stdin.readline()
    os._exit(0)
os.close(w)
assert os.read(r, 1) == b""
print("ready", flush=True)
sys.stdin.readline()
"""
    proc = helpers.python_child(code, prefix)
    children = _children(proc.pid)
    try:
        assert len(children) == 1
        result = procgroup.scan_totals(scan.Matcher((prefix,)))
        pool = (prefix, prefix.removeprefix("hostpool."))
        by_pid = {pid: pools[pool] for pid, pools in result.processes}
        assert set(by_pid) == {proc.pid, children[0]}
        assert by_pid[proc.pid].resident_bytes == 5 * PAGE
        assert by_pid[children[0]].open_fds == 0
        assert by_pid[children[0]].mapped_bytes == MiB
        assert by_pid[children[0]].resident_bytes == 5 * PAGE
    finally:
        assert proc.stdin is not None
        proc.communicate(timeout=waiting.DEADLINE)  # closes stdin: EOF ends both
        for pid in children:
            _wait_gone(pid)


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children()]


def _wait_gone(pid: int) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):  # reaped by init once its parent is gone
        psutil.Process(pid).wait(timeout=waiting.DEADLINE)


def test_a_deadline_cuts_the_reading_short(holder: tuple[str, subprocess.Popen[str]]) -> None:
    prefix, proc = holder
    matcher = scan.Matcher((prefix,))
    import time

    holdings = scan.read_holdings(proc.pid, matcher, deadline=time.monotonic() - 1)
    assert not holdings.complete
    assert holdings.rows  # maps was read before the deadline was looked at
    result = procgroup.scan_totals(matcher, deadline=time.monotonic() - 1)
    assert (result.truncated, result.processes) == (True, [])
    result = procgroup.scan_totals(matcher)
    assert not result.truncated
    assert [pid for pid, _ in result.processes] == [proc.pid]


LONG_PATH_HOLDER = """
import mmap, os, sys
prefix, top = sys.argv[1], sys.argv[2]
os.chdir(top)
for _ in range(24):  # relative steps: the whole path is 4,800+ bytes, past a page
    os.mkdir("d" * 200)
    os.chdir("d" * 200)
far = os.open(prefix + ".far.1.0", os.O_CREAT | os.O_RDWR, 0o600)  # named like a match
fd = os.memfd_create(prefix + ".1.0")
os.ftruncate(fd, 1 << 16)
mm = mmap.mmap(fd, 1 << 16)
mm[0] = 1
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("fds_by", ["stat", "link"])
def test_an_fd_whose_path_the_kernel_cannot_spell_is_skipped(
    tmp_path: Path, fds_by: scan.FdStrategy
) -> None:
    """Any user can hold a file under a path longer than a page: /proc cannot give its
    link (ENAMETOOLONG). The reader skips that fd and reads the rest, never failing."""
    prefix = f"hostpool.long{secrets.token_hex(3)}"
    proc = helpers.python_child(LONG_PATH_HOLDER, prefix, str(tmp_path))
    try:
        fds = os.listdir(f"/proc/{proc.pid}/fd")
        unreadable = 0
        for fd in fds:
            try:
                os.readlink(f"/proc/{proc.pid}/fd/{fd}")
            except OSError as exc:
                unreadable += exc.errno == 36  # ENAMETOOLONG: the case is real
        assert unreadable == 1
        matcher = scan.Matcher((prefix,))
        holdings = scan.read_holdings(proc.pid, matcher, fds_by=fds_by)
        assert scan.fill_residency(holdings, matcher, {})
        pool = (prefix, prefix.removeprefix("hostpool."))
        totals = procgroup.holdings_totals(holdings)
        assert (totals[pool].open_fds, totals[pool].mappings) == (2, 1)  # fd + mmap's dup
        assert totals[pool].resident_bytes == PAGE
        # the detailed reader (inspect, the leak check) skips it too
        assert len(procfs.shm_fds(proc.pid, (prefix,))) == 2
    finally:
        proc.kill()
        proc.wait()


# -- fds identified by inode, cheaply ---------------------------------------------------


def test_a_maps_line_names_the_object_as_its_fds_do(memfd: tuple[str, int]) -> None:
    """The key of a mapped object (from maps' `major:minor inode`) is the identity a
    statx of an fd for it gives: that is how fds are joined to mappings."""
    name, fd = memfd
    with mmap.mmap(fd, PAGE):
        holdings = scan.read_holdings("self", scan.Matcher((name,)))
        st = os.fstat(fd)
        assert list(holdings.rows) == [(st.st_ino, os.major(st.st_dev), os.minor(st.st_dev))]
        (row,) = holdings.rows.values()
        assert row[scan.ROW_FDS] == 2  # the fixture's fd and mmap's dup


NAMESAKE_HOLDER = """
import mmap, os, sys
name, PAGE = sys.argv[1], mmap.PAGESIZE
# the same name, another object: held, never mapped; its fd comes first (a lower number)
twin = os.memfd_create(name)
os.pwrite(twin, b"y" * (64 * PAGE), 0)
fd = os.memfd_create(name)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
mm.write(b"x" * (3 * PAGE))
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("fds_by", ["stat", "link"])
def test_a_namesake_fd_is_counted_but_never_lends_its_pages(fds_by: scan.FdStrategy) -> None:
    """Any process may name a memfd like a mapped one: its fd counts for the pool (the
    name decides that), but the mapped object's residency is its own pages (3), never
    the namesake's (64): an fd is trusted for pages only once its inode is the
    mapping's."""
    name = f"hostpool.twin{secrets.token_hex(3)}.1.0"
    proc = helpers.python_child(NAMESAKE_HOLDER, name)
    try:
        matcher = scan.Matcher((name,))
        holdings = scan.read_holdings(proc.pid, matcher, fds_by=fds_by)
        assert scan.fill_residency(holdings, matcher, {})
        totals = procgroup.holdings_totals(holdings)
        (pool,) = totals.values()
        assert (pool.open_fds, pool.mappings, pool.mapped_bytes) == (3, 1, MiB)
        assert pool.resident_bytes == 3 * PAGE
    finally:
        proc.kill()
        proc.wait()
