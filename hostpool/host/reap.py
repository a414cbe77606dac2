"""Reaping: free the orphans it is safe to free (`hostpool reap`, `hostpool run --reap`).

`plan` picks, from one scan (`HostView`), the orphaned regular files on tmpfs and
hugetlbfs (and, only when asked, the unattached SysV segments) of the selected engines,
unchanged (newest of mtime and ctime) for at least `min_age`. Its reach is what was
asked: files of an `ORPHAN_AREAS` area only (never a kubelet volume's or a `system`
tmpfs's, nor a file whose area is unknown), of this mount namespace unless
`all_namespaces` (a file reached through `/proc/PID/root` of another mount namespace is
another container's), or only those in `dirs` when given. `reap` then removes each only
if it is still what the plan saw and the kernel proves nobody holds it:

- a file's directory is opened by `safedir` (component by component with `O_NOFOLLOW`;
  `/proc/PID/root`, the way into another mount namespace, is the one link followed) and
  must be on tmpfs or hugetlbfs; the name, stat-ed relative to that fd without following it, must be
  a regular file with the planned `(st_dev, st_ino)`, unchanged for `min_age`;
- the holders /proc shows are read again (`scan.holders_of`): one there keeps it
  (`kept_held`); then `lease.unlink_unheld` opens the file, re-checks it, takes a write
  lease (refused while any process of any PID namespace has it open or mapped: those
  /proc cannot show included) and unlinks the name while holding it. `kept_held`,
  `kept_changed` or `kept_unprovable` (the kernel could not answer) otherwise;
- a name whose inode keeps other hard links is `unlinked`: no bytes freed;
- memfds and anonymous shared memory have no name to unlink and die with their last
  holder: they are never candidates;
- a SysV segment is removed (IPC_RMID) only when `shmctl(IPC_STAT)`, read right before,
  shows no attachment, the same key and size.

Outcomes are typed (`Outcome`); each removal is one `hostpool.reaped` event (engine,
kind, bytes freed, size_bytes, age_seconds, path, name, links_left); a failure a
`hostpool.reap_failed` warning, a file kept unproven a `hostpool.reap_unprovable`
warning. Nothing here prints.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from hostpool.base import events
from hostpool.base.fsmagic import fs_magic
from hostpool.errors import InvalidRequestError
from hostpool.host import lease, scan
from hostpool.host.model import ENGINES, ORPHAN_AREAS, Engine, Holder, HostObject, HostView
from hostpool.host.mounts import TmpfsMount, mount_namespaces, pids, superblocks
from hostpool.host.safedir import PROC_ROOT, SHM_FILESYSTEMS, ShmDirs

Outcome = Literal["removed", "unlinked", "kept_held", "kept_changed", "kept_unprovable", "failed"]
OUTCOMES: tuple[Outcome, ...] = (
    "removed",
    "unlinked",
    "kept_held",
    "kept_changed",
    "kept_unprovable",
    "failed",
)

DEFAULT_MIN_AGE: Final = 600.0  # seconds: `--min-age` unless given
# every engine the table names; `unknown` (any other file on tmpfs) only when asked
KNOWN_ENGINES: tuple[Engine, ...] = tuple(e for e in ENGINES if e != "unknown")


@dataclass(frozen=True, slots=True)
class ReapDir:
    """A directory reaping is limited to (`--dir`): on tmpfs or hugetlbfs, checked by
    `reap_dir`. `whole`: it is the root of such a mount, so every file of that filesystem (`st_dev`)
    is in it, whichever path the scan found it by; otherwise files under `path`."""

    path: str
    st_dev: int
    whole: bool

    def holds(self, obj: HostObject) -> bool:
        if obj.identity is None or obj.identity[0] != self.st_dev or obj.path is None:
            return False
        return self.whole or obj.path.startswith(self.path.rstrip("/") + "/")


@dataclass(frozen=True, slots=True)
class Selection:
    """What may be reaped: orphans unchanged for `min_age` seconds, of `engines`; files
    in `dirs` when given (empty: no file), else those of this mount namespace, or of
    every one with `all_namespaces`; SysV segments only with `sysv`."""

    min_age: float = DEFAULT_MIN_AGE
    engines: frozenset[Engine] = frozenset(KNOWN_ENGINES)
    dirs: tuple[ReapDir, ...] | None = None
    sysv: bool = False
    all_namespaces: bool = False


@dataclass(frozen=True, slots=True)
class Skipped:
    """An orphan the selection leaves alone, and why (for people: "younger than 10m")."""

    obj: HostObject
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    """What `reap` would remove (`candidates`) and the orphans it leaves (`skipped`).
    `unreadable`: processes the scan could not read; a file only they hold looks
    orphaned to the scan, and the kernel's lease keeps it at removal time."""

    candidates: tuple[HostObject, ...]
    skipped: tuple[Skipped, ...]
    selection: Selection = field(default_factory=Selection)
    unreadable: int = 0


@dataclass(frozen=True, slots=True)
class Result:
    """What happened to one candidate: `removed` (its last name went: `freed_bytes`
    freed); `unlinked` (the name went, another hard link or a late opener keeps the
    pages: 0 bytes); `kept_held` (a process holds it now: /proc or the kernel's lease
    says so); `kept_changed` (gone, replaced, no longer a regular file, or changed since
    the scan); `kept_unprovable` (the kernel could not prove it unheld: `errno`);
    `failed` (the OS refused: `errno`, or a path that cannot be walked safely). `detail`
    says it for people."""

    obj: HostObject
    outcome: Outcome
    detail: str = ""
    errno: int | None = None
    freed_bytes: int = 0


def reap_dir(path: str) -> ReapDir:
    """`path` as a `--dir`: InvalidRequestError unless it is a directory on tmpfs or
    hugetlbfs."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidRequestError(f"--dir {path}: {exc.strerror}") from exc
    try:
        magic = fs_magic(fd)
        st = os.fstat(fd)
    except OSError as exc:
        raise InvalidRequestError(f"--dir {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if magic not in SHM_FILESYSTEMS:
        raise InvalidRequestError(
            f"--dir {path} is not on tmpfs or hugetlbfs (filesystem magic {magic:#x}): only "
            "shared memory is reaped"
        )
    whole = any(m.st_dev == st.st_dev and _same_inode(m.root, st) for m in shm_mounts())
    return ReapDir(os.path.normpath(path), st.st_dev, whole)


def shm_mounts() -> list[TmpfsMount]:
    """One reachable mount per tmpfs or hugetlbfs superblock, of every mount namespace
    /proc shows (ours first)."""
    return superblocks(mount_namespaces(pids())).mounts


def _same_inode(path: str, st: os.stat_result) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def local_dirs() -> tuple[ReapDir, ...]:
    """Every tmpfs and hugetlbfs mount of this process's own mount namespace (for `run
    --reap`: the engine's container, where nothing of the engine runs at that moment)."""
    return tuple(ReapDir(m.root, m.st_dev, whole=True) for m in shm_mounts() if m.pid is None)


def plan(view: HostView, selection: Selection | None = None) -> Plan:
    """The candidates of `view` under `selection` (default: known engines, 10 minutes,
    this mount namespace, no SysV), and every other orphan with the reason it is left
    alone."""
    sel = selection or Selection()
    candidates: list[HostObject] = []
    skipped: list[Skipped] = []
    foreign = _Namespaces()
    for obj in view.objects:
        if not obj.orphan or obj.kind not in ("file", "sysv"):
            continue  # held, or a memfd / anonymous mapping: never an orphan
        # a scan cut short missed holders: what it calls orphans may not be
        reason = _left_alone(obj, sel, foreign) if view.complete else "the scan was cut short"
        if reason is None:
            candidates.append(obj)
        else:
            skipped.append(Skipped(obj, reason))
    return Plan(tuple(candidates), tuple(skipped), sel, view.unreadable)


def _left_alone(obj: HostObject, sel: Selection, foreign: _Namespaces) -> str | None:
    if obj.kind == "sysv" and not sel.sysv:
        return "SysV segment (reaped only with --sysv)"
    if obj.hugetlb and obj.kind != "file":
        return "hugetlb, not a file"  # a SysV segment of hugepages: never leased here
    if obj.kind == "file" and sel.dirs is not None:
        if not any(d.holds(obj) for d in sel.dirs):
            return "outside --dir"
    elif obj.kind == "file" and not sel.all_namespaces and foreign.of(obj.path):
        return "another mount namespace (--all-namespaces)"
    if obj.kind == "file" and obj.area not in ORPHAN_AREAS:
        # fail closed: a file the scan could not place is nobody's to remove
        return "area unknown" if obj.area is None else f"{obj.area} files are never reaped"
    if obj.engine not in sel.engines:
        return f"engine {obj.engine} not selected"
    if sel.min_age > 0 and (obj.age_seconds is None or obj.age_seconds < sel.min_age):
        return "younger than --min-age" if obj.age_seconds is not None else "age unknown"
    return None


class _Namespaces:
    """Whether a path leads into another mount namespace than ours (`/proc/PID/root` of
    a process in another one, or one that cannot be told: fail closed)."""

    def __init__(self) -> None:
        self.ours = _mnt_ns("self")
        self.seen: dict[str, bool] = {}

    def of(self, path: str | None) -> bool:
        match = PROC_ROOT.match(path or "")
        if match is None:
            return path is None
        pid = match.group(1)
        if pid not in self.seen:
            ns = _mnt_ns(pid)
            self.seen[pid] = ns is None or ns != self.ours
        return self.seen[pid]


def _mnt_ns(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def reap(
    candidates: Sequence[HostObject],
    *,
    min_age: float = 0.0,
    before_unlink: Callable[[HostObject], None] | None = None,
) -> list[Result]:
    """Remove each candidate that is still what the scan saw and the kernel proves
    unheld (see the module's text); one Result per candidate, in order. `min_age` is
    checked again against each file's own times. `before_unlink` (a seam for tests) is
    called with each file after its holders were read again, right before its proof.
    InvalidRequestError for an object that is neither a file nor a SysV segment (a
    memfd is never reaped), and for a file outside `ORPHAN_AREAS` (a kubelet volume's,
    a system tmpfs's, or one whose area is unknown), whoever planned it."""
    for obj in candidates:
        if obj.kind not in ("file", "sysv"):
            raise InvalidRequestError(f"{obj.kind} {obj.name!r} cannot be reaped")
        if obj.kind == "file" and obj.area not in ORPHAN_AREAS:
            raise InvalidRequestError(f"{obj.name!r} is in area {obj.area}: never reaped")
    done: dict[int, Result] = {}
    files = [(i, o) for i, o in enumerate(candidates) if o.kind == "file"]
    with ShmDirs() as dirs:
        staged = _stage(files, dirs, min_age, done)
        wanted = [before[0] for _, _, _, before in staged]
        held = scan.holders_of(wanted) if wanted else {}
        for i, obj, dfd, before in staged:
            if before_unlink is not None:
                before_unlink(obj)
            done[i] = _unlink(obj, dfd, before, held.get(before[0], ()))
    for i, obj in enumerate(candidates):
        if obj.kind == "sysv":
            done[i] = _remove_segment(obj, min_age)
    results = [done[i] for i in range(len(candidates))]
    for r in results:
        _report(r)
    return results


def _stage(
    files: Iterable[tuple[int, HostObject]],
    dirs: ShmDirs,
    min_age: float,
    done: dict[int, Result],
) -> list[tuple[int, HostObject, int, lease.Seen]]:
    """The files that pass every check but the holders' (the others' Result in `done`)."""
    staged = []
    for i, obj in files:
        if obj.path is None or obj.identity is None:  # held and unlinked: no name to remove
            done[i] = Result(obj, "failed", "EINVAL: no path to it", errno.EINVAL)
            continue
        directory, name = os.path.split(obj.path)
        try:
            dfd = dirs.get(directory)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError as exc:
            done[i] = _os_failure(obj, exc)
            continue
        changed = _changed(obj, st, min_age)
        if changed:
            done[i] = Result(obj, "kept_changed", changed)
        else:
            staged.append((i, obj, dfd, lease.seen(st)))
    return staged


def _changed(obj: HostObject, st: os.stat_result, min_age: float) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "no longer a regular file (a symlink or another kind was put in its place)"
    if (st.st_dev, st.st_ino) != obj.identity:
        return "another file has its name now"
    # age is the newest of mtime and ctime: a file restored with old times (cp -a,
    # tar x) has a new ctime
    if time.time() - max(st.st_mtime, st.st_ctime) < min_age:
        return "changed since the scan (younger than --min-age by its mtime or ctime)"
    return None


def _unlink(obj: HostObject, dfd: int, before: lease.Seen, held: tuple[Holder, ...]) -> Result:
    if held:
        who = ", ".join(f"pid {h.pid} ({h.comm})" for h in held[:3])
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        return Result(obj, "kept_held", f"held by {who}{more} since the scan")
    assert obj.path is not None
    try:
        done = lease.unlink_unheld(dfd, os.path.basename(obj.path), before)
    except lease.Kept as kept:
        return Result(obj, kept.outcome, kept.detail, kept.errno)
    except OSError as exc:
        return _os_failure(obj, exc)
    if done.detail:  # another hard link, or a late opener, keeps the pages
        return Result(obj, "unlinked", done.detail)
    return Result(obj, "removed", freed_bytes=done.freed_bytes)


def _os_failure(obj: HostObject, exc: OSError) -> Result:
    if exc.errno == errno.ENOENT:
        return Result(obj, "kept_changed", "gone since the scan")
    code = exc.errno or errno.EIO
    why = exc.strerror or os.strerror(code)
    if code in (errno.ELOOP, errno.ENOTDIR):
        why = "a symlink in its path (never followed)"
    return Result(obj, "failed", f"{errno.errorcode.get(code, code)}: {why}", code)


def _remove_segment(obj: HostObject, min_age: float) -> Result:
    if obj.shmid is None:
        return Result(obj, "failed", "EINVAL: no shmid", errno.EINVAL)
    try:
        now = lease.segment_now(obj.shmid)  # IPC_STAT, right before the IPC_RMID
        if now is None:
            return Result(obj, "kept_changed", "gone since the scan")
        if now.nattch != 0:
            return Result(obj, "kept_held", f"{now.nattch} attachment(s) since the scan")
        if (f"0x{now.key & 0xFFFFFFFF:08x}", now.size) != (obj.name, obj.size_bytes):
            return Result(obj, "kept_changed", "another segment has its id now")
        if min_age > 0 and time.time() - now.changed < min_age:
            return Result(obj, "kept_changed", "changed since the scan (younger than --min-age)")
        if not lease.remove_segment(obj.shmid):
            return Result(obj, "kept_changed", "gone since the scan")
    except OSError as exc:
        return _os_failure(obj, exc)
    return Result(obj, "removed", freed_bytes=obj.resident_bytes)


def _report(result: Result) -> None:
    obj = result.obj
    which: dict[str, object] = {"engine": obj.engine, "kind": obj.kind, "path": obj.path}
    which |= {"name": obj.name, "shmid": obj.shmid}
    if result.outcome in ("removed", "unlinked"):
        events.info(
            "hostpool.reaped",
            bytes=result.freed_bytes,
            size_bytes=obj.size_bytes,
            age_seconds=obj.age_seconds,
            detail=result.detail or None,
            **which,
        )
    elif result.outcome == "failed":
        events.warning("hostpool.reap_failed", reason=result.detail, **which)
    elif result.outcome == "kept_unprovable":
        events.warning("hostpool.reap_unprovable", reason=result.detail, **which)
