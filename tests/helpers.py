"""Independent measurements for tests: /proc, fstat and mincore, never hostpool's own view."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def fd_links(prefix: str = "hostpool.") -> dict[int, str]:
    """fd -> link target for shm fds whose name starts with `prefix`."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        base = target.removeprefix("/memfd:").removeprefix("/dev/shm/")
        if base.startswith(prefix) or f"/{prefix}" in target:
            out[int(name)] = target
    return out


def maps_lines(substring: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if substring in line]


def mapped_ranges() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def range_mapped(address: int, length: int) -> bool:
    """Whether any byte of [address, address+length) is still mapped."""
    end = address + length
    return any(lo < end and address < hi for lo, hi in mapped_ranges())


def mincore_resident(address: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0
    return sum(1 for b in bytes(vec) if b & 1) * page


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def _descendants(root: int) -> list[int]:
    """`root` and every process below it, from each /proc/PID/stat's parent pid."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_shmem_bytes(root: int | None = None) -> int:
    """Shared memory this process and its descendants hold, not the host's: mapped
    (RssShmem) plus shm files held only by fd (st_blocks), each inode once.

    Host-wide Shmem moves with every other process on the host (other tests, other
    users), so a check against it fails for reasons that are not the test's.
    """
    total = 0
    held: dict[tuple[int, int], int] = {}
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssShmem:"):
                        total += int(line.split()[1]) * 1024
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(path)
                if not (target.startswith("/memfd:") or target.startswith("/dev/shm/")):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            held[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return total + sum(held.values())


@contextlib.contextmanager
def memory_cgroup(name: str, limit_bytes: int | None = None) -> Iterator[Path]:
    """A real v1 memory cgroup `name`-PID below this process's own (root), with
    `limit_bytes` if given; skips the test where none can be made. Removed afterwards
    (the test moves nothing it keeps into it)."""
    import pytest

    with open("/proc/self/cgroup") as f:
        own = next((line.split(":", 2)[2].strip() for line in f if ":memory:" in line), None)
    base = Path("/sys/fs/cgroup/memory")
    if own is None or not base.is_dir():
        pytest.skip("no cgroup v1 memory controller")
    group = base / own.lstrip("/") / f"{name}-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup: {exc}")
    try:
        if limit_bytes is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield group
    finally:
        group.rmdir()


@contextlib.contextmanager
def reserved_hugepages(count: int) -> Iterator[int]:
    """Reserve `count` 2 MiB hugepages (root), yield how many the kernel gave, restore."""
    old = int(NR_HUGEPAGES.read_text())
    try:
        NR_HUGEPAGES.write_text(str(count))
        yield int(NR_HUGEPAGES.read_text())
    finally:
        NR_HUGEPAGES.write_text(str(old))


def run_python(
    code: str, *, timeout: float = 120, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter (for cases that could crash the process)."""
    return subprocess.run(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def run_forked(fn: object, *, uid: int | None = None, timeout: float = 60) -> tuple[int, str]:
    """Run `fn()` in a forked child (as `uid` if given); returns (exit code, what it wrote).

    Forking after imports lets a child drop to an unprivileged uid even where that uid
    could not exec this interpreter (it lives under /root here).
    """
    import select
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            # A real peer holds none of the parent's fds: drop every inherited one.
            os.closerange(3, w)
            os.closerange(w + 1, 65536)
            if "torch" in sys.modules:  # the parent's OpenMP pool does not survive fork
                sys.modules["torch"].set_num_threads(1)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            out = fn()  # type: ignore[operator]
            os.write(w, str(out).encode())
        except BaseException as exc:  # report everything, exit non-zero
            os.write(w, f"{type(exc).__name__}: {exc}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, 9)
            break
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


def python_child(
    code: str, *args: str, ready: str = "ready", stdin: bool = True
) -> subprocess.Popen[str]:
    """`python -c code args` from the repository root; returns once it prints `ready`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=root,
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == ready
    return proc


def attached_peer(path: str, pool: str) -> subprocess.Popen[str]:
    """A real peer process attached to `pool` at `path`, holding it until its stdin closes."""
    code = (
        "import sys\nfrom hostpool.share import attach\n"
        f"h = attach({path!r}, {pool!r})\nprint('attached', flush=True)\nsys.stdin.read()\n"
    )
    return python_child(code, ready="attached")


class FakeCuda:
    """Records register/unregister; checks every unregister happens while still mapped."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.log: list[tuple[str, int]] = []
        self.problems: list[str] = []
        self.attempts = 0

    def available(self) -> bool:
        return True

    def host_register(self, address: int, length: int) -> None:
        index = self.attempts
        self.attempts += 1
        if index == self.fail_at:
            raise RuntimeError(f"injected cudaErrorHostMemoryAlreadyRegistered at chunk {index}")
        self.registered[address] = length
        self.log.append(("register", address))

    def host_unregister(self, address: int) -> None:
        length = self.registered.pop(address, None)
        if length is None:
            self.problems.append(f"unregister of unknown {address:#x}")
        elif not range_mapped(address, length):
            self.problems.append(f"unregister after munmap at {address:#x}")
        self.log.append(("unregister", address))


def no_madv_populate(monkeypatch: Any) -> None:
    """Make the kernel look older than 5.14 at the syscall seam: MADV_POPULATE_WRITE is EINVAL."""
    import errno

    from hostpool.memory import syscalls

    real = syscalls.madvise

    def fake(address: int, length: int, advice: int) -> None:
        if advice == syscalls.MADV_POPULATE_WRITE:
            raise OSError(errno.EINVAL, "injected: MADV_POPULATE_WRITE unsupported")
        real(address, length, advice)

    monkeypatch.setattr(syscalls, "madvise", fake)


def no_memfd(monkeypatch: Any) -> None:
    """memfd_create unavailable (ENOSYS) at the syscall seam."""
    import errno

    from hostpool.memory import syscalls

    def fake(name: str, flags: int) -> int:
        raise OSError(errno.ENOSYS, "injected: memfd_create unavailable")

    monkeypatch.setattr(syscalls, "memfd_create", fake)


def hostpool_on_tty(*args: str, timeout: float = 60) -> tuple[int, str]:
    """Run the real `hostpool ARGS` with stdout on a pseudo-terminal: (exit code, output)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "hostpool", *args], stdout=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
