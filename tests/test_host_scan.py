"""The host view's scan (hostpool.host.scan) against real objects: kinds, holders, mount
namespaces, hugetlb, names that try to forge a maps line, `holders_of`, `tmpfs_dirs`,
the engine table and `hostpool shm`. Root only (SysV, mount namespaces)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from hostpool.host import engines
from hostpool.host.engines import ENGINE_PATTERNS, engine_of
from hostpool.host.model import ENGINES, HostObject
from hostpool.host.scan import holders_of, scan_host, tmpfs_dirs
from hostpool.proc.hostread import classify
from tests import helpers, hostobjects

PAGE = mmap.PAGESIZE
KEYS = {"kind", "name", "path", "area", "engine", "pool", "size_bytes", "resident_bytes",
        "holders", "pod_uid", "container_id", "orphan", "age_seconds"}  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent


def by_identity(identity: tuple[int, int]) -> HostObject:
    return next(o for o in scan_host().objects if o.identity == identity)


def test_every_kind_with_its_holders(root: None) -> None:
    with hostobjects.holder(4 * PAGE) as held:
        view = scan_host()
        pid, child = held.info["pid"], held.info["child"]
        mine = [o for o in view.objects if {pid, child} & {h.pid for h in o.holders}]
        kinds = {o.kind for o in mine}
        assert kinds == {"memfd", "file", "anon_shared", "sysv"}
        for o in mine:
            assert o.resident_bytes == 4 * PAGE and o.size_bytes == 4 * PAGE, o
            assert not o.orphan and o.age_seconds is not None and o.age_seconds >= 0
            assert {h.pid for h in o.holders} == {pid, child}
            assert all(h.comm == "python" or h.comm.startswith("python") for h in o.holders)
            doc = o.as_json()
            extra = {"sysv": {"shmid"}, "file": {"links"}}.get(o.kind, set())
            assert set(doc) == KEYS | extra
            assert (doc["path"] is None) == (o.kind != "file")
        sysv = next(o for o in mine if o.kind == "sysv")
        assert sysv.shmid == held.info["shmid"] and sysv.name == "0x00000000"
        memfd = next(o for o in mine if o.kind == "memfd")
        assert memfd.name.startswith("hostpool-test-") and memfd.engine == "unknown"


def test_a_deleted_file_still_held_is_held_with_no_path(root: None, shm_path: str) -> None:
    with open(shm_path, "w+b") as f:
        f.write(b"x" * 3 * PAGE)
        f.flush()
        os.unlink(shm_path)
        st = os.fstat(f.fileno())
        obj = by_identity((st.st_dev, st.st_ino))
        assert obj.kind == "file" and obj.path is None and not obj.orphan
        assert obj.resident_bytes == 3 * PAGE and obj.name == os.path.basename(shm_path)
        assert [h.pid for h in obj.holders] == [os.getpid()]


def test_orphans_and_holders_of(root: None, shm_path: str) -> None:
    hostobjects.write_file(shm_path, 2 * PAGE)
    st = os.stat(shm_path)
    identity = (st.st_dev, st.st_ino)
    obj = by_identity(identity)
    assert obj.orphan and obj.holders == () and obj.path == shm_path
    assert obj.resident_bytes == 2 * PAGE
    assert holders_of([identity]).get(identity, ()) == ()
    with open(shm_path, "rb"):
        (holder,) = holders_of([identity])[identity]
        assert (holder.pid, holder.fds, holder.mappings) == (os.getpid(), 1, 0)
        assert not by_identity(identity).orphan


def test_another_mount_namespace_is_reached_through_its_root(root: None, tmp_path: Path) -> None:
    """A private /dev/shm tmpfs, bind-mounted a second time, is one superblock: one mount,
    one object per file; a file its sleeper holds open is held, the other an orphan."""
    bind = tmp_path / "b"
    bind.mkdir()
    files = {"held": 5 * PAGE, "lost": 7 * PAGE}
    with hostobjects.private_tmpfs("/dev/shm", files, bind=str(bind), hold="held") as sleeper:
        prefix = f"/proc/{sleeper.pid}/root"
        dev = os.stat(f"{prefix}/dev/shm").st_dev
        theirs = [m for m in tmpfs_dirs() if m.st_dev == dev]
        assert len(theirs) == 1 and theirs[0].pid == sleeper.pid
        assert theirs[0].mountpoint in ("/dev/shm", str(bind))
        view = scan_host()
        found = {o.name: o for o in view.objects if o.path and o.path.startswith(prefix)}
        assert set(found) == {"held", "lost"}
        assert found["lost"].orphan and found["lost"].resident_bytes == 7 * PAGE
        assert not found["held"].orphan and found["held"].resident_bytes == 5 * PAGE
        assert [(h.pid, h.fds) for h in found["held"].holders] == [(sleeper.pid, 1)]
        assert {o.area for o in found.values()} == {"dev_shm"}
        assert os.path.exists(found["lost"].path or "")
        assert not os.listdir(bind)  # our namespace sees the empty directory


def test_hugetlb_objects_have_their_own_totals(hugepages_2m: int) -> None:
    fd = os.memfd_create(f"hostpool-test-huge-{secrets.token_hex(3)}", 0x4 | 21 << 26)
    try:
        os.ftruncate(fd, 2 << 20)
        with mmap.mmap(fd, 2 << 20) as m:
            m[0] = 1
            st = os.fstat(fd)
            view = scan_host()
            obj = next(o for o in view.objects if o.identity == (st.st_dev, st.st_ino))
            assert obj.kind == "memfd" and obj.hugetlb and obj.resident_bytes == 2 << 20
            assert view.totals.hugetlb_bytes >= 2 << 20
            plain = sum(o.resident_bytes for o in view.objects if not o.hugetlb)
            assert view.totals.attributed_bytes == plain
    finally:
        os.close(fd)


# A name that would be a maps line of its own if the reader split on \r, \v, \f, \x1c-\x1e
# or \x85 as str.splitlines does (the kernel escapes only \n in maps paths)
FORGED = "/memfd:forged (deleted)"
SEPARATORS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85"]


@pytest.mark.parametrize("sep", SEPARATORS, ids=[f"{ord(s):#x}" for s in SEPARATORS])
def test_a_name_cannot_forge_an_object(sep: str) -> None:
    line = f"7f0000000000-7f0000400000 rw-s 00000000 00:01 4242 {FORGED}"
    name = f"hostpool-test{sep}{line}"
    fd = os.memfd_create(name, 0)
    try:
        os.ftruncate(fd, PAGE)
        with mmap.mmap(fd, PAGE) as m:
            m[0] = 1
            view = scan_host()
        mine = [o for o in view.objects if any(h.pid == os.getpid() for h in o.holders)]
        assert [o.name for o in mine if o.kind == "memfd"].count(name) == 1
        assert not any(o.name == "forged" or o.identity == (1, 4242) for o in view.objects)
    finally:
        os.close(fd)


def test_classify_reads_what_the_kernel_prints() -> None:
    assert classify(b"/memfd:a b (deleted)") == ("memfd", "a b")
    assert classify(b"/SYSV0000abcd (deleted)") == ("sysv", "0x0000abcd")
    assert classify(b"/dev/zero (deleted)") == ("anon", "/dev/zero")
    assert classify(b"/dev/shm/x (deleted)") == ("file", "/dev/shm/x")


def test_the_engine_table() -> None:
    examples = {
        "hostpool.kv.12.0": "hostpool",
        "sglang_host_pool_0123abcd.mmap": "sglang",
        "vllm_offload_5734b1787271.mmap": "vllm",
        "torch_123_456789_0": "torch",
        "psm_1a2b3c4d": "python",
        "mooncake_shm": "mooncake",
        "kvcached_seg_0": "kvcached",
        "lmcache_buffer": "lmcache",
        "something else": "unknown",
        "": "unknown",
    }
    assert {name: engine_of(name) for name in examples} == examples
    assert {row.engine for row in ENGINE_PATTERNS} | {"unknown"} == set(ENGINES)
    assert all(row.source for row in ENGINE_PATTERNS)
    assert engines.pool_of("hostpool.kv.12.0") == "kv"
    assert engines.pool_of("sglang_host_pool_0123abcd") is None


def test_the_docs_table_is_the_engine_table() -> None:
    page = (ROOT / "docs" / "host-view.md").read_text()
    rows = re.findall(r"^\| `([a-z]+)` \| `([^`]+)` \| ([^|]+) \| (yes|no) \|$", page, re.M)
    expected = [(r.engine, r.pattern, r.source, "yes" if r.verified else "no")
                for r in ENGINE_PATTERNS]  # fmt: skip
    assert [(e, p, s.strip(), v) for e, p, s, v in rows] == expected


def hostpool_shm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hostpool", "shm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_cli(root: None, shm_path: str) -> None:
    """Text grouped by engine with orphans marked and names escaped, totals last; JSON
    with exactly the documented keys; the filters."""
    ugly = f"/dev/shm/psm_test\x1b[31m{secrets.token_hex(3)}"
    try:
        hostobjects.write_file(ugly, PAGE)
        fd = os.memfd_create("hostpool.kv.1.0", 0)
        try:
            os.ftruncate(fd, PAGE)
            os.write(fd, b"x")
            text = hostpool_shm()
            doc = json.loads(hostpool_shm("--json").stdout)
            orphans = json.loads(hostpool_shm("--json", "--orphans", "--engine", "python").stdout)
            bad = hostpool_shm("--engine", "nosuch")
        finally:
            os.close(fd)
    finally:
        os.unlink(ugly)
    assert text.returncode == 0, text.stderr
    assert "\x1b" not in text.stdout and "psm_test\\x1b[31m" in text.stdout
    lines = text.stdout.splitlines()
    assert lines[-1].startswith("Shmem ") or lines[-2].startswith("Shmem ")
    python = lines.index(next(ln for ln in lines if ln.startswith("python:")))
    assert "ORPHAN" in next(ln for ln in lines[python:] if "psm_test" in ln)
    assert any(ln.startswith("hostpool:") for ln in lines)
    assert set(doc) >= {"objects", "totals"}
    assert set(doc["totals"]) >= {"shmem_bytes", "attributed_bytes", "unattributed_bytes",
                                  "orphaned_bytes"}  # fmt: skip
    for o in doc["objects"]:
        assert set(o) == KEYS | {"sysv": {"shmid"}, "file": {"links"}}.get(o["kind"], set())
    mine = [o for o in doc["objects"] if o["name"] == "hostpool.kv.1.0"]
    assert [(o["engine"], o["pool"], o["kind"]) for o in mine] == [("hostpool", "kv", "memfd")]
    assert orphans["objects"] and all(
        o["orphan"] and o["engine"] == "python" for o in orphans["objects"]
    )
    assert any(o["path"] == ugly for o in orphans["objects"])
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_sysv_orphan(root: None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0, 3 * PAGE, 0o600 | 0o1000)
    assert shmid >= 0
    try:
        obj = next(o for o in scan_host().objects if o.kind == "sysv" and o.shmid == shmid)
        assert obj.orphan and obj.holders == () and obj.size_bytes == 3 * PAGE
        assert obj.resident_bytes == 0  # never touched
    finally:
        assert libc.shmctl(shmid, 0, None) == 0  # IPC_RMID
    assert helpers is not None


def test_json_keeps_a_name_that_is_not_utf8(root: None) -> None:
    """Bytes /proc shows that are not UTF-8 come out escaped (`\\udcff`), whichever
    encoder runs."""
    path = b"/dev/shm/psm_test\xff" + secrets.token_hex(3).encode()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"x")
        os.close(fd)
        out = hostpool_shm("--json", "--orphans")
        assert out.returncode == 0, out.stderr
        names = [o["name"] for o in json.loads(out.stdout)["objects"]]
        assert os.fsdecode(path).rpartition("/")[2] in names
        assert "\\udcff" in out.stdout
    finally:
        os.unlink(path)


def test_a_past_deadline_gives_a_partial_view(root: None) -> None:
    """A deadline already passed: no process is read, the view says it is incomplete
    and still lists the files (and their totals close)."""
    import time

    view = scan_host(deadline=time.monotonic() - 1)
    assert not view.complete
    assert all(o.holders == () for o in view.objects)
    t = view.totals
    assert t.attributed_bytes == sum(o.resident_bytes for o in view.objects if not o.hugetlb)
    assert scan_host().complete


def test_the_shmem_device_without_memfd_create(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a seccomp profile refuses memfd_create, a shared anonymous page of ours
    shows the same device in maps."""
    from hostpool.proc import hostread

    expected = hostread.internal_devices().shmem

    def refused(*args: object) -> int:
        raise PermissionError(1, "memfd_create refused")

    hostread.internal_devices.cache_clear()
    monkeypatch.setattr(hostread.os, "memfd_create", refused)
    try:
        got = hostread.internal_devices()
        assert got.shmem == expected and got.hugetlb == frozenset()
    finally:
        hostread.internal_devices.cache_clear()


def test_processes_and_files_vanishing_meanwhile_raise_nothing(root: None) -> None:
    """Holders that exit and files unlinked while scans run: every scan completes."""
    import threading

    stop = threading.Event()
    made: list[str] = []

    def churn() -> None:
        while not stop.is_set():
            path = f"/dev/shm/hostpool-test-churn-{secrets.token_hex(4)}"
            hostobjects.write_file(path, PAGE)
            made.append(path)
            code = "import os, sys; os.memfd_create('x'); open(sys.argv[1])"
            proc = subprocess.Popen(  # it may find the file unlinked already: no matter
                [sys.executable, "-c", code, path], stderr=subprocess.DEVNULL
            )
            os.unlink(path)
            proc.wait()

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(10):
            view = scan_host()
            assert view.totals.shmem_bytes > 0
    finally:
        stop.set()
        worker.join()
    assert made and not any(os.path.exists(p) for p in made)
