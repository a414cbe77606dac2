"""Independent measurements for tests: /proc, fstat and mincore, never hostpool's own view."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

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


def run_forked(
    fn: object,
    *,
    uid: int | None = None,
    prepare: Callable[[], object] | None = None,
    timeout: float = 60,
) -> tuple[int, str]:
    """Run `fn()` in a forked child (as `uid` if given); returns (exit code, what it wrote).
    `prepare()`, if given, runs in the child before it gives up root.

    Forking after imports lets a child drop to an unprivileged uid even where that uid
    could not exec this interpreter or read its modules (it lives under /root here): what
    `fn` imports lazily, `prepare` imports first.
    """
    import select
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            if prepare is not None:
                prepare()
            enter_child({w}, uid)
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


# -- forked peers, hostpool and Prometheus processes, SysV segments ----------------------
# (shared by the CLI, exporter, serve and share-attack tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def enter_child(keep: set[int], uid: int | None) -> None:
    """In a forked child: close every inherited fd but `keep` (a real peer holds none of
    the parent's), make torch usable after the fork, and become `uid` if given."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 65536)
    if "torch" in sys.modules:  # the parent's OpenMP pool does not survive fork
        sys.modules["torch"].set_num_threads(1)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


class Held:
    """A forked process (as `uid`, if given) that ran `fn`, reported its JSON-able result
    through a pipe, and keeps everything it made (fds, mappings, hugepages) until `end()`.
    `prepare()`, if given, runs in the child before it gives up root (a raised rlimit).

    Forking after imports lets a child drop to an unprivileged uid even where that uid
    could not exec this interpreter (it lives under /root here). The result is read with a
    generous upper bound, never a sleep: the pipe is the event.
    """

    def __init__(
        self,
        fn: Callable[[], object],
        *,
        uid: int | None = None,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        import json
        import select
        import time

        ready_r, ready_w = os.pipe()
        stop_r, stop_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                os.close(ready_r)
                os.close(stop_w)
                if prepare is not None:
                    prepare()
                enter_child({ready_w, stop_r}, uid)
                result = fn()
                os.write(ready_w, json.dumps({"result": result}).encode() + b"\n")
                os.read(stop_r, 1)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.write(ready_w, json.dumps({"error": repr(exc)}).encode() + b"\n")
                code = 1
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(stop_r)
        self.pid, self._stop_w = pid, stop_w
        chunks: list[bytes] = []
        deadline = time.monotonic() + 120
        while not chunks or not chunks[-1].endswith(b"\n"):
            ready, _, _ = select.select([ready_r], [], [], max(0.0, deadline - time.monotonic()))
            data = os.read(ready_r, 65536) if ready else b""
            if not data:
                break
            chunks.append(data)
        os.close(ready_r)
        report = json.loads(b"".join(chunks) or b'{"error": "no report"}')
        if "error" in report:
            self.end()
            raise AssertionError(f"held process failed: {report['error']}")
        self.result: Any = report["result"]

    def end(self) -> int:
        """Let the process exit; its exit code."""
        if self._stop_w >= 0:
            os.close(self._stop_w)
            self._stop_w = -1
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def held_child(fn: Callable[[], object], *, uid: int | None = None) -> Iterator[int]:
    """A `Held` process, alive until the block ends: its pid."""
    process = Held(fn, uid=uid)
    try:
        yield process.pid
    finally:
        process.end()


@contextlib.contextmanager
def public_dir(prefix: str) -> Iterator[str]:
    """A new directory under /tmp every uid can traverse (pytest's tmp_path is 0700),
    removed with what is in it at the end."""
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        os.chmod(top, 0o755)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def hostpool(
    *args: str, prefix: Sequence[str] = (), preexec: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real `hostpool ARGS` from the repository root (behind `prefix`, a wrapper such as
    setpriv), its output captured."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "hostpool", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=preexec,
    )


def start_hostpool(
    log: str, *args: str, url: str, until: str = '/metrics"', python: str = sys.executable
) -> tuple[subprocess.Popen[str], str]:
    """`hostpool ARGS` from the repository root, its stderr into `log`, once its log has
    `until` (by default the URL of its /metrics): the process and the first group of the
    pattern `url` in the log. `python`: the interpreter (another venv's)."""
    import re

    from tests import waiting

    proc = subprocess.Popen(
        [python, "-m", "hostpool", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),  # noqa: SIM115 (the child owns it)
        text=True,
    )
    try:
        text = waiting.wait_for_log(log, until, alive=proc)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{args[0]} did not start: {waiting.log_text(log)}") from None
    match = re.search(url, text)
    assert match is not None, text
    return proc, match.group(1)


@pytest.fixture
def start_exporter() -> Iterator[Callable[..., str]]:
    """Starts `hostpool exporter ARGS --port 0` on each call: its /metrics URL (from its
    log). All stop when the test ends (SIGTERM is a clean stop)."""
    from tests import exporting

    servers: list[exporting.Exporter] = []

    def start(*args: str) -> str:
        servers.append(exporting.start_exporter(*args))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


@contextlib.contextmanager
def prometheus(
    config: str | os.PathLike[str], directory: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real Prometheus on a free loopback port with `config`, its data and log in
    `directory`: the process and its base URL. Stopped with SIGTERM at the end."""
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(directory / "prometheus.log", "w"),  # noqa: SIM115 (the child owns it)
    )
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def prometheus_api(base: str, path: str, **params: str) -> Any:
    """The `data` of Prometheus's answer to GET /api/v1/PATH?PARAMS (asserted a success)."""
    import json
    import urllib.parse
    import urllib.request

    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]
_libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
IPC_PRIVATE, IPC_CREAT, IPC_RMID = 0, 0o1000, 0


@contextlib.contextmanager
def sysv_attached(shmid: int) -> Iterator[int]:
    """SysV segment `shmid` attached to this process while the block runs: its address."""
    addr = _libc.shmat(shmid, None, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        yield addr
    finally:
        assert _libc.shmdt(ctypes.c_void_p(addr)) == 0


@contextlib.contextmanager
def sysv_segment(size: int, touched: int) -> Iterator[int]:
    """A real private SysV segment of `size` bytes, its first `touched` bytes written, with
    no attachment: its id. Removed at the end."""
    shmid = _libc.shmget(IPC_PRIVATE, size, IPC_CREAT | 0o600)
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        with sysv_attached(shmid) as addr:
            ctypes.memset(addr, 1, touched)
        yield shmid
    finally:
        _libc.shmctl(shmid, IPC_RMID, None)


def package_sources(tmp_path: Path, *ignore: str) -> Path:
    """A copy of what a build reads, in `tmp_path`/src (setuptools writes build/ and
    egg-info next to the sources); `ignore`: patterns left out of the package trees."""
    import shutil

    root = Path(ROOT)
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "hostpool-instrument.pth",
                 "README.md"):  # fmt: skip
        shutil.copy(root / name, source / name)
    for tree in ("hostpool", "build_support"):
        shutil.copytree(root / tree, source / tree, ignore=shutil.ignore_patterns(*ignore))
    return source


def in_threads(target: Callable[[], object], count: int) -> None:
    """`target` run in `count` threads started together; returns once every one ended."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
