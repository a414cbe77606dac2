"""The host view's truth (issue 40, points 2-3; issue 43, point 6): holders found in
threads with their own fd table and behind a zombie leader, never lost to a link read
that fails; age from the newest of mtime and ctime; each file's area, and orphans only
where an area allows; device nodes are no objects; a walk that skips says so and holds
few fds; hard links; SysV identity from the kernel's shm device, never from a name.
Real processes, threads, namespaces and tmpfs mounts. Root only."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import resource
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from hostpool.host import mounts
from hostpool.host.model import HostObject
from hostpool.host.scan import holders_of, scan_host
from hostpool.proc import hostread
from hostpool.proc.scan import ROW_FDS, ROW_MATCH
from tests import hostobjects

PAGE = mmap.PAGESIZE
SYS_EXIT = {"x86_64": 60, "aarch64": 93, "riscv64": 93, "ppc64le": 1, "s390x": 1}


def by_identity(identity: tuple[int, int]) -> HostObject | None:
    return next((o for o in scan_host().objects if o.identity == identity), None)


@contextmanager
def python(code: str, *args: str, prefix: tuple[str, ...] = ()) -> Iterator[tuple[Any, Any]]:
    """A Python process running `code` (after `prefix`, e.g. unshare); yields (process,
    its first stdout line as JSON); it ends when its stdin closes (killed otherwise)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the process died before it was ready"
        yield proc, json.loads(line)
    finally:
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- holders -------------------------------------------------------------------------------

# A thread that unshares its fd table (CLONE_FILES) and then opens the file: only that
# thread's table holds it; the leader holds nothing
OWN_TABLE = r"""
import ctypes, json, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def thread():
    assert libc.unshare(0x400) == 0, ctypes.get_errno()
    fd = os.open(sys.argv[1], os.O_RDONLY)
    print(json.dumps({"tid": threading.get_native_id()}), flush=True)
    sys.stdin.read()
t = threading.Thread(target=thread)
t.start()
t.join()
"""


def test_a_thread_with_its_own_fd_table_holds(root: None, shm_path: str) -> None:
    hostobjects.write_file(shm_path, 2 * PAGE)
    st = os.stat(shm_path)
    identity = (st.st_dev, st.st_ino)
    with python(OWN_TABLE, shm_path) as (proc, _info):
        assert not any(
            os.stat(f"/proc/{proc.pid}/fd/{fd}").st_ino == st.st_ino
            for fd in os.listdir(f"/proc/{proc.pid}/fd")
        )  # the leader's table does not hold it
        obj = by_identity(identity)
        assert obj is not None and not obj.orphan
        assert [(h.pid, h.fds, h.mappings) for h in obj.holders] == [(proc.pid, 1, 0)]
        assert [h.pid for h in holders_of([identity])[identity]] == [proc.pid]


# The main thread exits alone (SYS_exit) once a thread opened and mapped a file and a
# memfd: the leader is a zombie, /proc/PID/maps and /proc/PID/fd read empty
ZOMBIE_LEADER = r"""
import ctypes, json, mmap, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
path, tag, sys_exit = sys.argv[1], sys.argv[2], int(sys.argv[3])
ready = threading.Event()
def thread():
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 4096)
    m[0] = 1
    memfd = os.memfd_create(tag, 0)
    os.ftruncate(memfd, 3 * 4096)
    m2 = mmap.mmap(memfd, 3 * 4096)
    m2[0] = 1
    st = os.fstat(memfd)
    print(json.dumps({"memfd": [st.st_dev, st.st_ino]}), flush=True)
    ready.set()
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=thread).start()
ready.wait()
libc.syscall(sys_exit, 0)
"""


def wait_zombie(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[0] == b"Z":
                return
        time.sleep(0.01)  # polling the leader's state: no event says it changed
    raise AssertionError("the leader did not become a zombie")


def test_holders_behind_a_zombie_leader(root: None, shm_path: str) -> None:
    number = SYS_EXIT.get(platform.machine())
    if number is None:
        pytest.skip("SYS_exit's number is not known here")
    hostobjects.write_file(shm_path, PAGE)
    st = os.stat(shm_path)
    tag = f"hostpool-test-zombie-{secrets.token_hex(3)}"
    with python(ZOMBIE_LEADER, shm_path, tag, str(number)) as (proc, info):
        wait_zombie(proc.pid)
        with open(f"/proc/{proc.pid}/maps", "rb") as f:
            assert f.read() == b""  # what the old reader saw of it
        objects = {o.identity: o for o in scan_host().objects}
        file, memfd = objects[(st.st_dev, st.st_ino)], objects[tuple(info["memfd"])]
        # two fds each: its own and the one Python's mmap keeps (a dup)
        assert [(h.pid, h.fds, h.mappings) for h in file.holders] == [(proc.pid, 2, 1)]
        assert [(h.pid, h.fds, h.mappings) for h in memfd.holders] == [(proc.pid, 2, 1)]
        assert memfd.kind == "memfd" and memfd.name == tag and memfd.resident_bytes == PAGE
        assert not file.orphan
        identity = file.identity
        assert identity is not None
        assert [h.pid for h in holders_of([identity])[identity]] == [proc.pid]


# Two fds on one memfd; closes the fd named on stdin, then says so
TWO_FDS = r"""
import json, os, sys
fd = os.memfd_create(sys.argv[1], 0)
os.ftruncate(fd, 4096)
os.write(fd, b"x")
other = os.dup(fd)
st = os.fstat(fd)
print(json.dumps({"fds": [fd, other], "memfd": [st.st_dev, st.st_ino]}), flush=True)
for line in sys.stdin:
    os.close(int(line))
    print("closed", flush=True)
"""


def test_a_link_that_closes_while_read_keeps_its_holder(
    root: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fd a row is named by closes between its stat and its link read (the holder
    closes it for real, at that moment): the row stays, named by the other fd."""
    tag = f"hostpool-test-twofds-{secrets.token_hex(3)}"
    real = os.readlink
    closed: list[str] = []
    with python(TWO_FDS, tag) as (proc, info):
        fd_dir = f"/proc/{proc.pid}/fd"

        def readlink(path: Any, *, dir_fd: int | None = None) -> Any:
            if dir_fd is not None and not closed and real(f"/proc/self/fd/{dir_fd}") == fd_dir:
                closed.append(os.fsdecode(path))
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{closed[0]}\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "closed"
            return real(path, dir_fd=dir_fd)

        monkeypatch.setattr(os, "readlink", readlink)  # hostread reads links by os.readlink
        devices = {hostread.internal_devices().shmem}
        rows = hostread.HostReader(devices).read(proc.pid).rows
        monkeypatch.undo()
    assert closed and int(closed[0]) in info["fds"]
    dev, ino = info["memfd"]
    row = rows[(ino, os.major(dev), os.minor(dev))]
    assert row[ROW_FDS] == 2 and row[ROW_MATCH] == ("memfd", tag)


def test_a_memfd_in_flight_is_no_object(root: None) -> None:
    """A memfd whose only reference is an SCM_RIGHTS message not yet received: in Shmem,
    in no object (unattributed), never another kind."""
    a, b = socket.socketpair(socket.AF_UNIX)
    fd = os.memfd_create(f"hostpool-test-flight-{secrets.token_hex(3)}", 0)
    try:
        os.ftruncate(fd, 4 * PAGE)
        os.pwrite(fd, b"\1" * 4 * PAGE, 0)
        st = os.fstat(fd)
        socket.send_fds(a, [b"x"], [fd])
        os.close(fd)
        fd = -1
        assert by_identity((st.st_dev, st.st_ino)) is None
    finally:
        if fd >= 0:
            os.close(fd)
        a.close()
        b.close()


# -- age, links ----------------------------------------------------------------------------


def test_age_is_the_newest_of_mtime_and_ctime(root: None, shm_path: str) -> None:
    """A file restored with old times (cp -a sets mtime; the kernel sets ctime)."""
    hostobjects.write_file(shm_path, PAGE)
    os.utime(shm_path, (946684800, 946684800))  # 2000-01-01
    st = os.stat(shm_path)
    obj = by_identity((st.st_dev, st.st_ino))
    assert obj is not None and obj.age_seconds is not None and obj.age_seconds < 3600


def test_hard_links_are_one_object(root: None, shm_path: str) -> None:
    hostobjects.write_file(shm_path, PAGE)
    os.link(shm_path, shm_path + ".link")
    try:
        st = os.stat(shm_path)
        mine = [o for o in scan_host().objects if o.identity == (st.st_dev, st.st_ino)]
        assert len(mine) == 1 and mine[0].links == 2 and mine[0].kind == "file"
    finally:
        os.unlink(shm_path + ".link")


# -- areas ---------------------------------------------------------------------------------

UID = "3f1c2a9e-7b4d-4e21-9a55-0c8d6e2f1b77"
VOLUMES = f"/var/lib/kubelet/pods/{UID}/volumes"
SANDBOX = "/run/containerd/io.containerd.grpc.v1.cri/sandboxes/" + "ab" * 32 + "/shm"
# the tmpfs mounts of a node laid out as kubelet and containerd lay them: (mount point,
# its area, whether its unheld files are orphans)
AREAS = [
    (f"{VOLUMES}/kubernetes.io~secret/token", "kubelet_volume", False),
    (f"{VOLUMES}/kubernetes.io~projected/kube-api-access", "kubelet_volume", False),
    (f"{VOLUMES}/kubernetes.io~configmap/config", "kubelet_volume", False),
    (f"{VOLUMES}/kubernetes.io~downward-api/podinfo", "kubelet_volume", False),
    (f"{VOLUMES}/kubernetes.io~empty-dir/cache", "empty_dir", True),
    ("/run", "system", False),
    (SANDBOX, "dev_shm", True),
    ("/dev/shm", "dev_shm", True),
]


@contextmanager
def node_tmpfs(extra: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A sleeper in a private mount namespace with every mount of AREAS (a tmpfs on
    /var/lib first, to lay kubelet's tree out), a file `f` of (index + 1) pages in each,
    then `extra` shell lines."""
    script = ["set -e", "mount -t tmpfs -o size=64m hostpool-test /var/lib"]
    for i, (mountpoint, _area, _orphan) in enumerate(AREAS):
        script += [
            f"mkdir -p '{mountpoint}'",
            f"mount -t tmpfs -o size=64m hostpool-test '{mountpoint}'",
            f"head -c {(i + 1) * PAGE} /dev/zero > '{mountpoint}/f'",
        ]
    script += [*extra, "echo ready", "exec sleep 600"]
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(script)]
    with hostobjects.ready_sleeper(argv) as proc:
        yield proc


def test_each_file_has_its_area_and_only_some_areas_orphan(root: None) -> None:
    """A kubelet secret also bind-mounted elsewhere (as a container sees it) stays a
    kubelet volume; every file still counts in the attributed bytes."""
    bind = f"mkdir -p /run/secrets && mount --bind '{AREAS[0][0]}' /run/secrets"
    with node_tmpfs([bind]) as sleeper:
        root_ = f"/proc/{sleeper.pid}/root"
        view = scan_host()
        found = {
            o.path[len(root_) :]: o
            for o in view.objects
            if o.path and o.path.startswith(root_) and o.path.endswith("/f")
        }
        for i, (mountpoint, area, orphan) in enumerate(AREAS):
            obj = found.get(f"{mountpoint}/f") or found.get("/run/secrets/f")
            assert obj is not None, mountpoint
            assert (obj.area, obj.orphan) == (area, orphan), (mountpoint, obj)
            assert obj.resident_bytes == (i + 1) * PAGE and obj.holders == ()
        plain = sum(o.resident_bytes for o in view.objects if not o.hugetlb)
        assert view.totals.attributed_bytes == plain
        assert view.totals.orphaned_bytes >= sum(
            o.resident_bytes for o in found.values() if o.orphan
        )


# -- devices, SysV identity -------------------------------------------------------------

# Maps a character device node on this namespace's tmpfs /dev/shm (1:5, /dev/zero's)
# private (its fd kept by Python's mmap) and /dev/zero private (mapping only)
DEVICES = r"""
import ctypes, json, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
node = os.open("/dev/shm/zero", os.O_RDWR)
m = mmap.mmap(node, 4096, flags=mmap.MAP_PRIVATE)
m[0] = 1
zero = os.open("/dev/zero", os.O_RDWR)
at = libc.mmap(None, 4096, 3, 2, zero, 0)  # PROT_READ|WRITE, MAP_PRIVATE
ctypes.memset(at, 1, 4096)
out = [list(os.fstat(fd)[2:0:-1]) for fd in (node, zero)]  # [st_dev, st_ino]
os.close(zero)
print(json.dumps(out), flush=True)
import sys; sys.stdin.read()
"""


def in_namespace(setup: str) -> tuple[str, ...]:
    """The prefix that runs a Python process after `setup` (shell) in a private mount
    namespace."""
    return ("unshare", "-m", "--propagation", "private", "sh", "-c", f'{setup} && exec "$@"', "sh")


def test_device_nodes_are_no_objects(root: None) -> None:
    setup = "mount -t tmpfs hostpool-test /dev/shm && mknod /dev/shm/zero c 1 5"
    with python(DEVICES, prefix=in_namespace(setup)) as (_proc, nodes):
        identities = {tuple(n) for n in nodes}
        assert len(identities) == 2
        view = scan_host()
        assert [o for o in view.objects if o.identity in identities] == []


# At the root of a tmpfs (moved onto this namespace's /, as a pivot_root leaves it),
# files named like a SysV segment and like huge anonymous memory, each mapped (the
# second private); says their inode numbers
SPOOF = r"""
import json, mmap, os, subprocess, sys
top = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "hostpool-test", top], check=True)
maps = []
for name, flags in (("SYSV0000beef", mmap.MAP_SHARED), ("anon_hugepage", mmap.MAP_PRIVATE)):
    fd = os.open(f"{top}/{name}", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"\1" * 4096)
    maps.append(mmap.mmap(fd, 4096, flags=flags))
    os.close(fd)
    maps[-1][0] = 1
inos = {name: os.stat(f"{top}/{name}").st_ino for name in ("SYSV0000beef", "anon_hugepage")}
subprocess.run(["mount", "--move", top, "/"], check=True)
print(json.dumps(inos), flush=True)
sys.stdin.read()
"""


def test_a_file_named_like_a_segment_is_a_file(root: None, tmp_path: Any) -> None:
    """Issue 43 point 6: in an IPC namespace whose only segment's shmid is the inode of a
    tmpfs file named `/SYSV0000beef` (shm_next_id), that file's holder is no attacher of
    the segment, the file is one held object (not a phantom orphan plus a segment), and
    one named `/anon_hugepage` mapped private is held, not dropped as huge anon memory."""
    top = tmp_path / "top"
    top.mkdir()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # a new IPC namespace for the holder, the segment and the scan
        try:
            os.close(r)
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.unshare(0x08000000) == 0, ctypes.get_errno()  # CLONE_NEWIPC
            with python(SPOOF, str(top), prefix=in_namespace("true")) as (proc, inos):
                with open("/proc/sys/kernel/shm_next_id", "w") as f:
                    f.write(str(inos["SYSV0000beef"]))
                shmid = libc.shmget(0, PAGE, 0o1600)
                view = scan_host()
                libc.shmctl(shmid, 0, None)
                doc = {
                    "pid": proc.pid,
                    "shmid": shmid,
                    "inos": inos,
                    "objects": [o.as_json() | {"identity": o.identity} for o in view.objects],
                }
            os.write(w, json.dumps(doc).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        doc = json.loads(f.read() or b"{}")
    os.waitpid(child, 0)
    assert doc and doc["shmid"] == doc["inos"]["SYSV0000beef"]
    pid = doc["pid"]
    segments = [o for o in doc["objects"] if o["kind"] == "sysv"]
    assert [(o["shmid"], o["holders"], o["orphan"]) for o in segments] == [(doc["shmid"], [], True)]
    theirs = {
        o["name"]: o
        for o in doc["objects"]
        if o["kind"] == "file" and any(h["pid"] == pid for h in o["holders"])
    }
    assert set(theirs) == {"SYSV0000beef", "anon_hugepage"}
    for o in theirs.values():
        assert [h["mappings"] for h in o["holders"]] == [1] and not o["orphan"]
    assert not [o for o in doc["objects"] if o["name"] in theirs and o["holders"] == []]


# -- the walk ------------------------------------------------------------------------------


def scan_with_few_fds(limit: int, under: str) -> dict[str, Any]:
    """scan_host() in a forked child whose RLIMIT_NOFILE is `limit`: whether it says it
    is complete, and the paths of the files it found whose path starts with `under`."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            view = scan_host()
            found = [o.path for o in view.objects if o.path and o.path.startswith(under)]
            os.write(w, json.dumps({"complete": view.complete, "found": found}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(child, 0)
    assert data, "the scan's child died"
    result: dict[str, Any] = json.loads(data)
    return result


@contextmanager
def shm_tree(tree: str) -> Iterator[str]:
    """A sleeper in a private mount namespace whose /dev/shm is a fresh tmpfs laid out by
    `tree` (shell, run in it); yields that /dev/shm's path as the host sees it."""
    setup = f"mount -t tmpfs hostpool-test /dev/shm && cd /dev/shm && {tree}"
    with python("import sys; print('{}', flush=True); sys.stdin.read()",
                prefix=in_namespace(setup)) as (proc, _):  # fmt: skip
        yield f"/proc/{proc.pid}/root/dev/shm/"


def test_a_wide_tree_is_walked_whole_with_few_fds(root: None) -> None:
    """300 directories side by side, walked with 64 fds: every file found (the walk
    holds one fd per level, not one per directory waiting to be walked)."""
    with shm_tree("for i in $(seq 300); do mkdir d$i && echo x > d$i/f; done") as under:
        got = scan_with_few_fds(64, under)
    assert got["complete"] and len(got["found"]) == 300


def test_a_walk_that_runs_out_of_fds_says_incomplete(root: None) -> None:
    """A chain 40 directories deep, walked with 30 fds: EMFILE part way down, and the
    view says it is not complete."""
    with shm_tree("for i in $(seq 40); do mkdir d && cd d; done && echo x > f") as under:
        got = scan_with_few_fds(30, under)
    assert not got["complete"] and got["found"] == []


def test_a_tree_deeper_than_the_walk_goes_says_incomplete(root: None) -> None:
    """Directories below MAX_DEPTH levels are skipped (the walk holds one fd per level):
    the view says it is not complete."""
    depth = mounts.MAX_DEPTH + 2
    with shm_tree(f"for i in $(seq {depth}); do mkdir d && cd d; done && echo x > f") as under:
        view = scan_host()
        assert not view.complete
        assert not [o for o in view.objects if o.path and o.path.startswith(under)]


@pytest.mark.parametrize(
    ("mountpoint", "fstype", "area"),
    [
        ("/dev/shm", "tmpfs", "dev_shm"),
        ("/run/containerd/io.containerd.grpc.v1.cri/sandboxes/" + "c" * 64 + "/shm", "tmpfs",
         "dev_shm"),
        ("/var/lib/docker/containers/" + "d" * 64 + "/mounts/shm", "tmpfs", "dev_shm"),
        ("/run/containers/storage/overlay-containers/" + "e" * 64 + "/userdata/shm", "tmpfs",
         "dev_shm"),
        (f"/data/kubelet/pods/{UID}/volumes/kubernetes.io~secret/s", "tmpfs", "kubelet_volume"),
        (f"{VOLUMES}/kubernetes.io~csi/inline", "tmpfs", "kubelet_volume"),
        (f"{VOLUMES}/kubernetes.io~empty-dir/cache", "tmpfs", "empty_dir"),
        (f"{VOLUMES}/kubernetes.io~empty-dir/huge", "hugetlbfs", "hugetlbfs"),
        ("/dev/hugepages", "hugetlbfs", "hugetlbfs"),
        ("/dev/shm/sub", "tmpfs", "system"),
        ("/run", "tmpfs", "system"),
        ("/dev", "devtmpfs", "system"),
    ],
)  # fmt: skip
def test_the_area_of_a_mount(mountpoint: str, fstype: str, area: str) -> None:
    assert mounts.mount_area(mountpoint, fstype) == area


def test_mounts_that_disagree_and_bind_mounts_of_part() -> None:
    views: tuple[mounts.View, ...] = (
        ("/", "system"),
        ("/pod", "dev_shm"),
    )  # /run/pod at a /dev/shm
    assert mounts.area_of(views, "/pod/f") == "dev_shm"
    assert mounts.area_of(views, "/podx/f") == mounts.area_of(views, "/f") == "system"
    both: tuple[mounts.View, ...] = (("/", "dev_shm"), ("/", "kubelet_volume"))
    assert mounts.area_of(both, "/f") == "kubelet_volume"
