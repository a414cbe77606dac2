"""Issue 40: reap frees only what nobody uses. Each test is one way the landed reaper
removed a file a live process still held (or freed what it did not): a holder /proc
cannot show (another PID namespace, a thread with its own fd table, a zombie leader, an
fd in flight in a Unix socket, a file held through an overlay, a process /proc hides from
the reaper's uid), a holder that appears after the reaper read /proc, a file restored with
old times, a hard link. The kernel's write lease keeps each of them.

Everything lives on private tmpfs mounts of `unshare -m` namespaces (`private_tmpfs`):
nothing touches the host's /dev/shm."""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest

from hostpool.errors import InvalidRequestError
from hostpool.host import lease, reap, scan, sysv
from hostpool.host.model import Area, HostObject
from tests import helpers
from tests.test_reap import TIMEOUT, hostpool, object_of, orphan_name, plant, private_tmpfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, others' /proc)")

ANY_AGE = reap.Selection(min_age=0.0)
NOBODY = 65534
PY = sys.executable

# A holder driven over its stdin, one command a line, each answered "ok" on stdout:
# `open` (an fd), `map` (a mapping, its fd closed), `two` (two fds), `close1` (close one of
# them), `opath` (an O_PATH fd), `lease` (a write lease of its own). It starts with nothing open.
_DRIVEN = r"""
import fcntl, mmap, os, signal, sys
path, fds, maps = sys.argv[1], [], []
signal.signal(signal.SIGIO, signal.SIG_IGN)
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd in ("open", "two"):
        fds += [os.open(path, os.O_RDONLY) for _ in range(1 if cmd == "open" else 2)]
    elif cmd == "map":
        fd = os.open(path, os.O_RDWR)
        maps.append(mmap.mmap(fd, 0))
        os.close(fd)
    elif cmd == "close1":
        os.close(fds.pop())
    elif cmd == "opath":
        fds.append(os.open(path, os.O_PATH))
    elif cmd == "lease":
        fds.append(os.open(path, os.O_RDONLY))
        fcntl.fcntl(fds[-1], 1024, fcntl.F_WRLCK)
    print("ok", flush=True)
"""


class Driven:
    """A `_DRIVEN` holder of `path` (behind `prefix`, a wrapper such as unshare)."""

    def __init__(self, path: str, prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, PY, "-c", _DRIVEN, path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def do(self, *commands: str) -> None:
        assert self.proc.stdin is not None
        for cmd in commands:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
            assert self._line() == "ok", cmd

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextmanager
def driven(path: str, *commands: str, prefix: tuple[str, ...] = ()) -> Iterator[Driven]:
    holder = Driven(path, prefix)
    try:
        holder.do(*commands)
        yield holder
    finally:
        holder.end()


@contextmanager
def planted_orphan(size: int = 64 << 10) -> Iterator[tuple[int, str, os.stat_result]]:
    """A private namespace's /dev/shm holding one orphan: (the namespace's pid, the
    orphan's path through /proc/PID/root, its stat)."""
    with private_tmpfs() as (pid, shm):
        path = f"{shm}/{orphan_name()}"
        yield pid, path, plant(path, size)


def scanned(st: os.stat_result) -> HostObject:
    """The planted file as a host scan sees it now: an orphan (no holder /proc shows)."""
    obj = object_of(scan.scan_host(), st)
    assert obj.orphan and obj.kind == "file", obj
    return obj


def reaped(obj: HostObject, **kwargs: object) -> reap.Result:
    [result] = reap.reap([obj], **kwargs)  # type: ignore[arg-type]
    return result


def assert_kept_by_lease(result: reap.Result, path: str) -> None:
    """Kept because the kernel refused the lease (not because /proc showed a holder)."""
    assert result.outcome == "kept_held", result
    assert "lease" in result.detail, result.detail
    assert os.path.exists(path)


# -- the kernel's proof, measured --------------------------------------------------------


def _lease_answer(path: str) -> str:
    """What the kernel answers a write lease on `path` now: granted or the errno."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.fcntl(fd, lease.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, lease.F_SETLEASE, fcntl.F_UNLCK)
        return "granted"
    except OSError as exc:
        return os.strerror(exc.errno or 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["open", "map", "two"])
def test_the_lease_is_refused_while_held_and_granted_after(how: str) -> None:
    with planted_orphan() as (_pid, path, _st):
        assert _lease_answer(path) == "granted"
        with driven(path, how):
            assert _lease_answer(path) == os.strerror(11)  # EAGAIN
        assert _lease_answer(path) == "granted"


def test_an_o_path_fd_is_not_seen_by_the_lease_but_by_the_walk() -> None:
    """The one holder the lease misses (an O_PATH fd reads and maps nothing, but keeps
    the inode and can reopen it through /proc): the /proc walk keeps the file."""
    with planted_orphan() as (_pid, path, st):
        obj = scanned(st)
        with driven(path, "opath") as holder:
            assert _lease_answer(path) == "granted"
            result = reaped(obj)
            assert result.outcome == "kept_held" and f"pid {holder.proc.pid}" in result.detail
            assert os.path.exists(path)


# -- holders /proc cannot show -----------------------------------------------------------


def test_a_holder_in_another_pid_namespace_keeps_it_from_a_reaper_that_cannot_see_it() -> None:
    """A pod without hostPID: the reaper's /proc shows only its own PID namespace, the
    holder lives in another (a child PID namespace of ours)."""
    pidns = ("unshare", "--pid", "--fork", "--kill-child")
    with planted_orphan() as (pid, path, _st), driven(path, "open", prefix=pidns):
        out = blind(pid, "reap", "--yes", "--min-age", "0", "--dir", "/dev/shm", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert os.path.exists(path)
        [obj] = json.loads(out.stdout)["objects"]
        assert (obj["outcome"], obj["freed_bytes"]) == ("kept_held", 0)
        assert "lease" in obj["detail"]


def blind(pid: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`hostpool ARGS` in the mount namespace of `pid`, in a PID namespace of its own with
    its own /proc: it sees no process but itself."""
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    # --wd: entering a mount namespace moves to its root; `-m hostpool` runs this checkout
    command = ["nsenter", "-t", str(pid), "-m", f"--wd={helpers.ROOT}", "--", "unshare",
               "--pid", "--fork", "--mount-proc", "--kill-child", PY, "-m", "hostpool",
               *args]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=helpers.ROOT,
        check=False,
    )  # fmt: skip


_CLONE_FILES = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def hold():
    assert libc.unshare(0x400) == 0  # CLONE_FILES: this thread's own fd table
    os.open(sys.argv[1], os.O_RDONLY)
    print("ready", flush=True)
    threading.Event().wait()
threading.Thread(target=hold, daemon=True).start()
sys.stdin.read()
"""

_ZOMBIE_LEADER = r"""
import ctypes, os, sys, threading
def hold():
    os.open(sys.argv[1], os.O_RDONLY)
    print("ready", flush=True)
    threading.Event().wait()
threading.Thread(target=hold).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread ends, the process lives on
"""


@pytest.mark.parametrize("code", [_CLONE_FILES, _ZOMBIE_LEADER], ids=["clone_files", "zombie"])
def test_a_holder_proc_misreads_keeps_it(code: str) -> None:
    """A thread with its own fd table (its leader has nothing open), or a process whose
    main thread exited (its /proc/PID/fd and maps read empty)."""
    with planted_orphan() as (_pid, path, st):
        obj = scanned(st)
        proc = subprocess.Popen([PY, "-c", code, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            result = reaped(obj)
            assert result.outcome == "kept_held", result
            assert os.path.exists(path)
        finally:
            proc.kill()
            proc.wait()


_IN_FLIGHT = r"""
import os, socket, sys
a, b = socket.socketpair()
fd = os.open(sys.argv[1], os.O_RDONLY)
socket.send_fds(a, [b"x"], [fd])
os.close(fd)  # the only reference left is the fd in flight in the socket
print("ready", flush=True)
sys.stdin.read()
"""


def test_an_fd_in_flight_in_a_unix_socket_keeps_it() -> None:
    with planted_orphan() as (_pid, path, st):
        proc = subprocess.Popen([PY, "-c", _IN_FLIGHT, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            obj = scanned(st)  # no fd table and no maps show it
            assert_kept_by_lease(reaped(obj), path)
        finally:
            proc.kill()
            proc.wait()


def test_a_file_held_through_an_overlay_keeps_it() -> None:
    """An overlay whose upper dir is on the tmpfs: the holder's fd is the overlay's
    file (another device and inode), the upper file looks orphaned to /proc."""
    with private_tmpfs() as (pid, shm):
        for d in ("lower", "upper", "work", "merged"):
            os.mkdir(f"{shm}/{d}")
        name = orphan_name()
        st = plant(f"{shm}/upper/{name}")
        options = "lowerdir=/dev/shm/lower,upperdir=/dev/shm/upper,workdir=/dev/shm/work"
        subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "-t", "overlay", "hpov",
                        "-o", options, "/dev/shm/merged"], check=True, timeout=60)  # fmt: skip
        with driven(f"{shm}/merged/{name}", "open"):
            obj = scanned(st)
            assert obj.path == f"{shm}/upper/{name}"
            assert_kept_by_lease(reaped(obj), obj.path)


def test_a_process_the_reaper_may_not_read_keeps_it() -> None:
    """The reaper runs as uid 65534: root's holder is unreadable to it (counted), the file
    is 65534's own (so it may lease it), and the lease keeps it."""
    with planted_orphan() as (pid, path, st):
        os.chown(path, NOBODY, NOBODY)
        with driven(path, "open"):
            report = _as_nobody_in(pid, st)
        assert report["unreadable"] > 0 and report["orphan"]
        assert report["outcome"] == "kept_held" and "lease" in report["detail"], report
        assert os.path.exists(path)


def test_unreadable_processes_do_not_stop_a_proven_removal() -> None:
    """Processes the reaper may not read are counted; a file the lease proves unheld is
    removed all the same (the proof is the kernel's, not /proc's)."""
    with planted_orphan() as (pid, path, st):
        os.chown(path, NOBODY, NOBODY)
        report = _as_nobody_in(pid, st)
        assert report["unreadable"] > 0 and report["outcome"] == "removed", report
        assert not os.path.exists(path)


def test_a_file_the_reaper_may_not_lease_is_kept_unprovable() -> None:
    """Not its owner and no CAP_LEASE: the kernel cannot answer for it; kept, said."""
    with planted_orphan() as (pid, path, st):
        report = _as_nobody_in(pid, st)
        assert report["outcome"] == "kept_unprovable" and "EACCES" in report["detail"], report
        assert os.path.exists(path)


def _as_nobody_in(pid: int, st: os.stat_result) -> dict[str, Any]:
    """Scan and reap the planted file as uid 65534 in the mount namespace of `pid` (a
    forked child: it enters the namespace as root, then drops to 65534)."""
    ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    def enter() -> None:
        if ctypes.CDLL(None, use_errno=True).setns(ns, 0) != 0:
            raise OSError(ctypes.get_errno(), "setns")

    def reap_it() -> object:
        view = scan.scan_host()
        [obj] = [o for o in view.objects if o.identity == (st.st_dev, st.st_ino)]
        [result] = reap.reap([obj])
        return {"unreadable": view.unreadable, "orphan": obj.orphan,
                "outcome": result.outcome, "detail": result.detail}  # fmt: skip

    try:
        child = helpers.Held(reap_it, uid=NOBODY, prepare=enter)
        child.end()
    finally:
        os.close(ns)
    assert isinstance(child.result, dict)
    return child.result


# -- holders that arrive after the reaper read /proc (the seam: after the walk) ----------


@pytest.mark.parametrize(
    ("commands", "then"),
    [(("open",), ()), (("map",), ()), (("two",), ("close1",)), (("lease",), ())],
    ids=["opens", "maps", "two_fds_one_closed", "its_own_lease"],
)
def test_a_holder_after_the_walk_keeps_it(commands: tuple[str, ...], then: tuple[str, ...]) -> None:
    """A process opens (or maps, or opens twice and closes one, or takes a lease of its
    own) after the reaper read every process's fds and maps: the lease keeps it, and an
    open refused by someone's lease never blocks the reaper."""
    with planted_orphan() as (_pid, path, st), driven(path) as holder:
        obj = scanned(st)

        def arrive(_obj: HostObject) -> None:
            holder.do(*commands, *then)

        started = time.monotonic()
        result = reaped(obj, before_unlink=arrive)
        assert time.monotonic() - started < 30  # never waits a lease-break time (45 s)
        assert result.outcome == "kept_held" and "lease" in result.detail, result
        assert os.path.exists(path)


def test_an_opener_during_the_unlink_waits_for_the_release_and_costs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that opens the file while the reaper holds its lease blocks until the
    release (the kernel breaks the lease; its signal must not kill the reaper), then
    holds the unlinked inode: the name went, no bytes are counted freed."""
    with planted_orphan() as (_pid, path, st):
        obj = scanned(st)
        real_unlink = os.unlink
        opener: list[subprocess.Popen[str]] = []
        code = "import os, sys; print(os.fstat(os.open(sys.argv[1], os.O_RDONLY)).st_nlink)"

        def unlink_once_an_opener_waits(name: str, *, dir_fd: int) -> None:
            opener.append(subprocess.Popen([PY, "-c", code, path], stdout=subprocess.PIPE,
                                           text=True))  # fmt: skip
            _wait_for_a_lease_break(st.st_ino)
            real_unlink(name, dir_fd=dir_fd)

        monkeypatch.setattr(os, "unlink", unlink_once_an_opener_waits)  # lease's unlink
        result = reaped(obj)
        monkeypatch.undo()
        [proc] = opener
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0 and out.strip() == "0"  # it opened the unlinked inode
        assert (result.outcome, result.freed_bytes) == ("unlinked", 0), result
        assert "opened while it was removed" in result.detail and not os.path.exists(path)


def _wait_for_a_lease_break(ino: int) -> None:
    """Until /proc/locks shows the lease on inode `ino` breaking (an opener waits on it)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        with open("/proc/locks") as f:
            if any("BREAKING" in line and f":{ino} " in line for line in f):
                return
        time.sleep(0.01)
    raise AssertionError("no opener broke the lease")


def test_ipc_stat_reads_what_proc_sysvipc_shows() -> None:
    """The segment's key, size and attachments as `shmctl(IPC_STAT)` reads them (the
    struct layout) agree with /proc/sysvipc/shm, attached and not."""
    with helpers.sysv_segment(1 << 20, 4096) as shmid:
        for attached in (False, True):
            with helpers.sysv_attached(shmid) if attached else nullcontext():
                now = lease.segment_now(shmid)
                [listed] = [g for g in sysv.read_segments() if g.shmid == shmid]
                assert now is not None
                assert (now.key, now.size, now.nattch) == (listed.key, 1 << 20, int(attached))
                assert now.changed == listed.changed
    assert lease.segment_now(shmid) is None  # gone


# -- what is not proof of age or of bytes ------------------------------------------------


def test_a_file_restored_with_old_times_is_young_by_its_ctime() -> None:
    with planted_orphan() as (_pid, path, st):
        old = time.time() - 86400
        os.utime(path, (old, old))  # cp -a, tar x: an old mtime, a ctime of now
        obj = dataclasses.replace(scanned(st), age_seconds=86400.0)
        result = reaped(obj, min_age=600.0)
        assert result.outcome == "kept_changed" and "ctime" in result.detail, result
        assert os.path.exists(path)


def test_reap_yes_leaves_a_restored_file_its_default_min_age() -> None:
    with planted_orphan() as (pid, path, _st):
        old = time.time() - 86400
        os.utime(path, (old, old))
        out = hostpool("reap", "--json", "--yes", "--dir", f"/proc/{pid}/root/dev/shm")
        assert out.returncode == 0, out.stderr
        assert os.path.exists(path)
        [mine] = [s for s in json.loads(out.stdout)["skipped"] if s["path"] == path]
        assert mine["reason"] == "younger than --min-age" and mine["age_seconds"] < 600


def test_a_hard_link_frees_nothing() -> None:
    with planted_orphan() as (_pid, path, st):
        other = f"{path}.link"
        os.link(path, other)
        obj = scanned(os.stat(path))
        result = reaped(obj)
        assert (result.outcome, result.freed_bytes) == ("unlinked", 0), result
        assert "hard link" in result.detail
        assert os.path.exists(other) ^ os.path.exists(path)  # one name went, one stays
        assert os.stat(other if os.path.exists(other) else path).st_ino == st.st_ino


def test_the_last_link_frees_its_pages() -> None:
    with planted_orphan(256 << 10) as (_pid, path, st):
        result = reaped(scanned(st))
        assert (result.outcome, result.freed_bytes) == ("removed", st.st_blocks * 512)
        assert result.freed_bytes >= 256 << 10 and not os.path.exists(path)


# -- reach: what the operator asked ------------------------------------------------------


def test_reap_reaches_only_its_own_mount_namespace_by_default() -> None:
    """A dry run over the whole host: another namespace's orphan is left alone, and
    named why."""
    with planted_orphan() as (_pid, path, _st):
        out = hostpool("reap", "--json", "--min-age", "0")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert path not in [o["path"] for o in doc["objects"]]
        [mine] = [s for s in doc["skipped"] if s["path"] == path]
        assert mine["reason"] == "another mount namespace (--all-namespaces)"
        wide = json.loads(hostpool("reap", "--json", "--min-age", "0", "--all-namespaces").stdout)
        assert path in [o["path"] for o in wide["objects"]] and wide["dry_run"]
        assert os.path.exists(path)


def test_another_mount_namespace_only_with_all_namespaces() -> None:
    with planted_orphan() as (_pid, _path, st):
        obj = dataclasses.replace(scanned(st), area="dev_shm")
        view = dataclasses.replace(scan.scan_host(), objects=(obj,))
        default = reap.plan(view, ANY_AGE)
        assert default.candidates == ()
        assert [s.reason for s in default.skipped] == ["another mount namespace (--all-namespaces)"]
        wide = reap.plan(view, dataclasses.replace(ANY_AGE, all_namespaces=True))
        assert wide.candidates == (obj,)
        named = reap.plan(
            view, dataclasses.replace(ANY_AGE, dirs=(reap.reap_dir(os.path.dirname(_path)),))
        )
        assert named.candidates == (obj,)  # a --dir reaches what it names


@pytest.mark.parametrize(
    ("area", "reason"),
    [("kubelet_volume", "kubelet_volume files are never reaped"),
     ("system", "system files are never reaped"), (None, "area unknown")],
)  # fmt: skip
def test_unknown_is_never_reaped_outside_orphan_areas(area: Area | None, reason: str) -> None:
    """A service-account token in a projected volume, a file in /run: whatever the
    flags."""
    with planted_orphan() as (_pid, _path, st):
        obj = dataclasses.replace(scanned(st), area=area, engine="unknown")
        view = dataclasses.replace(scan.scan_host(), objects=(obj,))
        everything = reap.Selection(
            min_age=0.0, engines=frozenset({"unknown"}), all_namespaces=True, sysv=True
        )
        planned = reap.plan(view, everything)
        assert planned.candidates == () and [s.reason for s in planned.skipped] == [reason]
        with pytest.raises(InvalidRequestError, match="never reaped"):
            reap.reap([obj])  # whoever planned it
        assert os.path.exists(_path)


# -- the command, and run --reap ---------------------------------------------------------


def test_a_system_tmpfs_is_never_reaped_whatever_the_flags() -> None:
    """A tmpfs at /run (a private namespace's own): its unheld files, of any name, stay."""
    with private_tmpfs("/run") as (_pid, run):
        names = sorted([orphan_name(), "token"])
        for name in names:
            plant(f"{run}/{name}")
        out = hostpool("reap", "--json", "--yes", "--min-age", "0", "--engine", "unknown",
                       "--engine", "vllm", "--all-namespaces", "--dir", run)  # fmt: skip
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["objects"] == [] and sorted(os.listdir(run)) == names
        mine = [s for s in doc["skipped"] if (s["path"] or "").startswith(f"{run}/")]
        # not orphans to the scan (`system` is no ORPHAN_AREAS area), or left alone by reap
        assert all(s["reason"] == "system files are never reaped" for s in mine), mine


def test_reap_yes_keeps_what_it_cannot_prove_and_exits_1() -> None:
    """The CLI as uid 65534 in the planted namespace (a child forked after its imports,
    which enters the namespace as root, then drops: no interpreter of 65534's has to read
    this checkout): the file it may not lease is KEPT, said, and the exit status is 1."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from hostpool import cli

    with planted_orphan() as (pid, path, _st):
        ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

        def enter() -> None:
            if ctypes.CDLL(None, use_errno=True).setns(ns, 0) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            # a dry run as root first: it imports what the run as 65534 will need
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                cli.main(["--log-format", "json", "reap", "--min-age", "0", "--dir", "/dev/shm"])

        def run() -> str:
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                code = cli.main(["--log-format", "json", "reap", "--yes", "--min-age", "0",
                                 "--dir", "/dev/shm"])  # fmt: skip
            return json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()})

        try:
            code, written = helpers.run_forked(run, uid=NOBODY, prepare=enter)
        finally:
            os.close(ns)
        assert code == 0, written
        done = json.loads(written)
        assert done["code"] == 1, done
        assert done["out"].startswith("KEPT") and "EACCES" in done["out"], done
        assert "kept 1 the kernel could not prove unheld" in done["out"].splitlines()[-1]
        assert "hostpool.reap_unprovable" in done["err"]
        assert os.path.exists(path)


def test_hard_links_in_json_count_no_bytes() -> None:
    with planted_orphan() as (pid, path, _st):
        os.link(path, f"{path}.link")
        out = hostpool("reap", "--json", "--yes", "--min-age", "0", "--dir",
                       f"/proc/{pid}/root/dev/shm")  # fmt: skip
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        [obj] = doc["objects"]
        assert (obj["outcome"], obj["freed_bytes"], obj["links"]) == ("unlinked", 0, 2)
        assert doc["totals"]["removed_bytes"] == 0


_LIST = "import os; print(sorted(os.listdir('/dev/shm')))"


def test_run_reap_keeps_a_file_a_process_it_cannot_see_holds() -> None:
    """`run --reap` in a container without the host's PID namespace: the sidecar holding
    the file is invisible to it; the lease keeps the file, CMD runs."""
    with planted_orphan() as (pid, path, _st), driven(path, "map"):
        out = blind(pid, "run", "--reap", "--", PY, "-c", _LIST)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip() == str([os.path.basename(path)])
        assert "hostpool.reaped" not in out.stderr


def test_run_reap_removes_an_unheld_orphan_in_its_namespace() -> None:
    with planted_orphan() as (pid, path, _st):
        out = blind(pid, "--log-format", "json", "run", "--reap", "--", PY, "-c", _LIST)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip() == "[]" and not os.path.exists(path)
        events = [json.loads(li) for li in out.stderr.splitlines() if li.startswith("{")]
        [event] = [e for e in events if e["event"] == "hostpool.reaped"]
        assert event["bytes"] == 64 << 10
