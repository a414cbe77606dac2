"""Reaping: free the orphans it is safe to free (`hostpool reap`, `hostpool run --reap`).

`plan` picks, from one scan (`HostView`), the orphaned regular files on tmpfs (and, only
when asked, the unattached SysV segments) of the selected engines, unchanged for at
least `min_age`, optionally only in some directories. `reap` then removes them, each
only if it is still what the plan saw:

- a file's directory is opened by `safedir` (component by component with `O_NOFOLLOW`:
  a symlink anywhere in the path refuses the file; `/proc/PID/root`, the way into
  another mount namespace, is the one link followed);
- the directory must be on tmpfs (fstatfs of the open fd); the name is stat-ed relative
  to that fd without following it: a regular file with the planned `(st_dev, st_ino)`,
  unchanged for `min_age`;
- holders are read again (`scan.holders_of`: every process's fds and maps) after those
  checks, then each name is stat-ed once more and unlinked relative to the same fd. A
  process that opens or maps the file after the scan keeps it (`kept_held`). The window
  left is between that last read and the unlink: whoever opens the file in it keeps
  its fd and mapping (unlink removes a name, never memory in use);
- memfds and anonymous shared memory have no name to unlink and die with their last
  holder: they are never candidates;
- a SysV segment is removed (IPC_RMID) only when /proc/sysvipc/shm, read again, still
  shows it with no attachment, the same key and size; IPC_RMID on an unattached
  segment frees it.

Outcomes are typed (`Outcome`); each removal is one `hostpool.reaped` event (engine,
kind, bytes, size_bytes, age_seconds, path, name). A failure is a `hostpool.reap_failed`
warning. Nothing here prints.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from hostpool.base import events
from hostpool.base.fsmagic import TMPFS_MAGIC, fs_magic
from hostpool.errors import InvalidRequestError
from hostpool.host import scan, sysv
from hostpool.host.model import ENGINES, Engine, Holder, HostObject, HostView, Identity
from hostpool.host.safedir import TmpfsDirs

Outcome = Literal["removed", "kept_held", "kept_changed", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("removed", "kept_held", "kept_changed", "failed")

DEFAULT_MIN_AGE: Final = 600.0  # seconds: `--min-age` unless given
# every engine the table names; `unknown` (any other file on tmpfs) only when asked
KNOWN_ENGINES: tuple[Engine, ...] = tuple(e for e in ENGINES if e != "unknown")

_IPC_RMID: Final = 0


@dataclass(frozen=True, slots=True)
class ReapDir:
    """A directory reaping is limited to (`--dir`): on tmpfs, checked by `reap_dir`.
    `whole`: it is the root of a tmpfs mount, so every file of that filesystem (`st_dev`)
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
    """What may be reaped: orphans unchanged for `min_age` seconds, of `engines`, in
    `dirs` (None: every tmpfs the scan found; empty: no file), SysV segments only with
    `sysv`."""

    min_age: float = DEFAULT_MIN_AGE
    engines: frozenset[Engine] = frozenset(KNOWN_ENGINES)
    dirs: tuple[ReapDir, ...] | None = None
    sysv: bool = False


@dataclass(frozen=True, slots=True)
class Skipped:
    """An orphan the selection leaves alone, and why (for people: "younger than 10m")."""

    obj: HostObject
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    """What `reap` would remove (`candidates`) and the orphans it leaves (`skipped`).
    `unreadable`: processes the scan could not read; a file only they hold looks
    orphaned (unlinking it frees nothing while they hold it, but a later open by name
    fails), so callers say so."""

    candidates: tuple[HostObject, ...]
    skipped: tuple[Skipped, ...]
    selection: Selection = field(default_factory=Selection)
    unreadable: int = 0


@dataclass(frozen=True, slots=True)
class Result:
    """What happened to one candidate: `removed`; `kept_held` (a process holds it now);
    `kept_changed` (gone, replaced, no longer a regular file, or changed since the scan);
    `failed` (the OS refused: `errno`, or a path that cannot be walked safely). `detail`
    says it for people."""

    obj: HostObject
    outcome: Outcome
    detail: str = ""
    errno: int | None = None


def reap_dir(path: str) -> ReapDir:
    """`path` as a `--dir`: InvalidRequestError unless it is a directory on tmpfs."""
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
    if magic != TMPFS_MAGIC:
        raise InvalidRequestError(
            f"--dir {path} is not on tmpfs (filesystem magic {magic:#x}): only shared "
            "memory is reaped"
        )
    whole = any(m.st_dev == st.st_dev and _same_inode(m.root, st) for m in scan.tmpfs_dirs())
    return ReapDir(os.path.normpath(path), st.st_dev, whole)


def _same_inode(path: str, st: os.stat_result) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def local_dirs() -> tuple[ReapDir, ...]:
    """Every tmpfs mount of this process's own mount namespace (for `run --reap`: the
    engine's container, where nothing of the engine runs at that moment)."""
    return tuple(
        ReapDir(m.root, m.st_dev, whole=True)
        for m in scan.tmpfs_dirs()
        if m.pid is None and not m.hugetlb
    )


def plan(view: HostView, selection: Selection | None = None) -> Plan:
    """The candidates of `view` under `selection` (default: known engines, 10 minutes,
    every tmpfs, no SysV), and every other orphan with the reason it is left alone."""
    sel = selection or Selection()
    candidates: list[HostObject] = []
    skipped: list[Skipped] = []
    for obj in view.objects:
        if not obj.orphan or obj.kind not in ("file", "sysv"):
            continue  # held, or a memfd / anonymous mapping: never an orphan
        # a scan cut short missed holders: what it calls orphans may not be
        reason = _left_alone(obj, sel) if view.complete else "the scan was cut short"
        if reason is None:
            candidates.append(obj)
        else:
            skipped.append(Skipped(obj, reason))
    return Plan(tuple(candidates), tuple(skipped), sel, view.unreadable)


def _left_alone(obj: HostObject, sel: Selection) -> str | None:
    if obj.kind == "sysv" and not sel.sysv:
        return "SysV segment (reaped only with --sysv)"
    if obj.hugetlb:
        return "hugetlb, not tmpfs"
    if obj.engine not in sel.engines:
        return f"engine {obj.engine} not selected"
    if obj.kind == "file" and sel.dirs is not None and not any(d.holds(obj) for d in sel.dirs):
        return "outside --dir"
    if sel.min_age > 0 and (obj.age_seconds is None or obj.age_seconds < sel.min_age):
        return "younger than --min-age" if obj.age_seconds is not None else "age unknown"
    return None


def reap(candidates: Sequence[HostObject], *, min_age: float = 0.0) -> list[Result]:
    """Remove each candidate that is still what the scan saw (see the module's text);
    one Result per candidate, in order. `min_age` is checked again against each file's
    own times. InvalidRequestError for an object that is neither a file nor a SysV
    segment (a memfd is never reaped)."""
    for obj in candidates:
        if obj.kind not in ("file", "sysv"):
            raise InvalidRequestError(f"{obj.kind} {obj.name!r} cannot be reaped")
    done: dict[int, Result] = {}
    files = [(i, o) for i, o in enumerate(candidates) if o.kind == "file"]
    with TmpfsDirs() as dirs:
        staged = _stage(files, dirs, min_age, done)
        wanted = [before[0] for _, _, _, before in staged]
        held = scan.holders_of(wanted) if wanted else {}
        for i, obj, dfd, before in staged:
            done[i] = _unlink(obj, dfd, before, held.get(before[0], ()))
    for i, obj in enumerate(candidates):
        if obj.kind == "sysv":
            done[i] = _remove_segment(obj, min_age)
    results = [done[i] for i in range(len(candidates))]
    for r in results:
        _report(r)
    return results


# (identity, size, mtime_ns, ctime_ns): what must not change between the checks
_Seen = tuple[Identity, int, int, int]


def _seen(st: os.stat_result) -> _Seen:
    return (st.st_dev, st.st_ino), st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _stage(
    files: Iterable[tuple[int, HostObject]],
    dirs: TmpfsDirs,
    min_age: float,
    done: dict[int, Result],
) -> list[tuple[int, HostObject, int, _Seen]]:
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
            staged.append((i, obj, dfd, _seen(st)))
    return staged


def _changed(obj: HostObject, st: os.stat_result, min_age: float) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "no longer a regular file (a symlink or another kind was put in its place)"
    if (st.st_dev, st.st_ino) != obj.identity:
        return "another file has its name now"
    if time.time() - st.st_mtime < min_age:  # the scan's age: since the last write
        return "changed since the scan (younger than --min-age)"
    return None


def _unlink(obj: HostObject, dfd: int, before: _Seen, held: tuple[Holder, ...]) -> Result:
    if held:
        who = ", ".join(f"pid {h.pid} ({h.comm})" for h in held[:3])
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        return Result(obj, "kept_held", f"held by {who}{more} since the scan")
    assert obj.path is not None
    name = os.path.basename(obj.path)
    try:
        if _seen(os.stat(name, dir_fd=dfd, follow_symlinks=False)) != before:
            return Result(obj, "kept_changed", "changed while its holders were read")
        os.unlink(name, dir_fd=dfd)
    except OSError as exc:
        return _os_failure(obj, exc)
    return Result(obj, "removed")


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
    now = next((s for s in sysv.read_segments() if s.shmid == obj.shmid), None)
    if now is None:
        return Result(obj, "kept_changed", "gone since the scan")
    if now.nattch != 0:
        return Result(obj, "kept_held", f"{now.nattch} attachment(s) since the scan")
    if (now.name, now.size) != (obj.name, obj.size_bytes):
        return Result(obj, "kept_changed", "another segment has its id now")
    if min_age > 0 and time.time() - now.changed < min_age:
        return Result(obj, "kept_changed", "changed since the scan (younger than --min-age)")
    if _libc.shmctl(obj.shmid, _IPC_RMID, None) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.EIDRM):
            return Result(obj, "kept_changed", "gone since the scan")
        return _os_failure(obj, OSError(code, os.strerror(code)))
    return Result(obj, "removed")


def _report(result: Result) -> None:
    obj = result.obj
    which: dict[str, object] = {"engine": obj.engine, "kind": obj.kind, "path": obj.path}
    which |= {"name": obj.name, "shmid": obj.shmid}
    if result.outcome == "removed":
        events.info(
            "hostpool.reaped",
            bytes=obj.resident_bytes,
            size_bytes=obj.size_bytes,
            age_seconds=obj.age_seconds,
            **which,
        )
    elif result.outcome == "failed":
        events.warning("hostpool.reap_failed", reason=result.detail, **which)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
