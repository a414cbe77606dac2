from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests import helpers

# What a run must leave as it found it (compared at session end with session start).
WATCHED_DIRS = ("/tmp", "/dev/shm")
HUGEPAGE_COUNTS = "/sys/kernel/mm/hugepages/*/nr_hugepages"
# A new entry there is this run's when it is named as the suite and what it runs name what
# they make outside tmp_path (docs/testing.md, "What a run leaves"): hostpool's names and
# the suite's (hostpool*), every engine's in the host view's table (sglang_*, vllm_offload_*,
# torch_*, psm_*, ...: the tests run and plant them), multiprocessing's semaphores and
# directories, torch's compile cache. Anything else new was made by another process on
# the host meanwhile: reported, never failing the run.
RUN_NAMES = ("hostpool*", "sem.mp-*", "pymp-*", "torchinductor_*")
# Never this run's: the runtime directories of runs going on beside this one (each run
# removes its own), and the benchmarks' (`make bench`: no test runs one).
NOT_LEFTOVERS = ("hostpool-test-runtime-*", "hostpool-bench-*")
_before = pytest.StashKey[dict[str, set[tuple[str, int]]]]()
_runtime_dir = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path factory reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hugepages: reserves hugetlb pages (root)")
    # The vLLM metrics route writes under $XDG_RUNTIME_DIR, else <tmp>/hostpool-vllm-<uid>
    # (kept for the next server): give this run's processes a runtime directory of its own.
    runtime = tempfile.mkdtemp(prefix="hostpool-test-runtime-")
    config.stash[_runtime_dir] = runtime
    os.environ["XDG_RUNTIME_DIR"] = runtime
    # torch's inductor (`import vllm` loads it) makes <tmp>/torchinductor_<user> unless
    # told where (the Makefile names a directory in the checkout).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(runtime, "torchinductor"))
    if config.option.basetemp is None:
        # tmp_path under this run's own directory: with retention "none" pytest locks no
        # directory of <tmp>/pytest-of-<user>, and a run's clean-up there deletes the
        # tmp_path of any run going on beside it.
        config.option.basetemp = os.path.join(runtime, "t")


def _state() -> dict[str, set[tuple[str, int]]]:
    """Per watched directory its entries as (name, inode): a name deleted and made again
    during the run is new. Per hugepage count file, its value."""
    state: dict[str, set[tuple[str, int]]] = {}
    for d in WATCHED_DIRS:
        if os.path.isdir(d):
            with os.scandir(d) as entries:
                state[d] = {(e.name, e.inode()) for e in entries}
    for path in glob.glob(HUGEPAGE_COUNTS):
        with open(path) as f:
            state[path] = {(f.read().strip(), 0)}
    return state


def run_names() -> tuple[str, ...]:
    """The patterns of what this run makes in /tmp and /dev/shm (RUN_NAMES and the
    engine table's rows)."""
    from hostpool.host.engines import ENGINE_PATTERNS

    return (*RUN_NAMES, *(row.pattern for row in ENGINE_PATTERNS))


def held_outside_the_run(paths: set[str]) -> set[str]:
    """Those of `paths` that a live process holds (an fd, a mapping or its working
    directory at or under it: a directory in use) and no process of this run (this one and
    its descendants) does: another run's files in use, not ours."""
    import psutil

    ours = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    holders: dict[str, set[int]] = {}
    for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        held: set[str] = set()
        with contextlib.suppress(OSError):
            held.add(os.readlink(f"/proc/{pid}/cwd"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            held.update(line.split(None, 5)[-1].strip() for line in maps if "/" in line)
        for path in paths:
            if path in held or any(h.startswith(path + "/") for h in held):
                holders.setdefault(path, set()).add(pid)
    return {path for path, pids in holders.items() if not pids & ours}


def new_entries(
    before: dict[str, set[tuple[str, int]]], after: dict[str, set[tuple[str, int]]]
) -> tuple[list[str], list[str]]:
    """(this run's leftovers, what others made meanwhile): new entries of the watched
    directories named as this run names things (RUN_NAMES) and not held by a process
    outside it alone, and any change of a hugepage count (this run's)."""
    ours, others = [], []
    patterns = run_names()
    for where, entries in after.items():
        if where not in WATCHED_DIRS:
            if entries != before.get(where):
                was = {v for v, _ in before.get(where, set())}
                ours.append(f"{where}: {was} at the start, { ({v for v, _ in entries}) } now")
            continue
        for name in sorted({n for n, _ in entries - before.get(where, set())}):
            if any(fnmatch.fnmatchcase(name, p) for p in NOT_LEFTOVERS):
                continue
            mine = any(fnmatch.fnmatchcase(name, p) for p in patterns)
            (ours if mine else others).append(os.path.join(where, name))
    theirs = held_outside_the_run(set(ours)) if ours else set()
    return [p for p in ours if p not in theirs], others + sorted(theirs)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_before] = _state()


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path clean-up
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Report what this run left in /tmp or /dev/shm, or changed in nr_hugepages, that was
    not so at its start; with HOSTPOOL_LEFTOVER_CHECK=1 (`make test`) the run fails then.
    What other processes on the host made meanwhile (`new_entries`) is listed apart and
    never fails the run."""
    runtime = session.config.stash.get(_runtime_dir, None)
    if runtime is not None:
        shutil.rmtree(runtime, ignore_errors=True)
    before = session.config.stash.get(_before, None)
    if before is None:
        return
    left, others = new_entries(before, _state())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and others:
        reporter.write_sep("-", "made meanwhile by other processes (left alone)")
        for path in others:
            reporter.write_line(path)
    if not left:
        return
    strict = os.environ.get("HOSTPOOL_LEFTOVER_CHECK") == "1"
    if reporter is not None:
        reporter.write_sep(
            "=",
            "left behind by this run" + ("" if strict else " (HOSTPOOL_LEFTOVER_CHECK=1 fails)"),
            red=strict,
            yellow=not strict,
        )
        for path in left:
            reporter.write_line(path)
    if strict:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def no_leaked_fds() -> Iterator[None]:
    """The test must leave no hostpool fd and no hostpool mapping behind."""
    import gc

    from hostpool.core.ledger import get_ledger

    before_fds = set(helpers.fd_links())
    before_maps = len(helpers.maps_lines("hostpool."))
    yield
    gc.collect()
    get_ledger().drain()
    assert set(helpers.fd_links()) - before_fds == set()
    assert len(helpers.maps_lines("hostpool.")) <= before_maps


@pytest.fixture
def root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")


@pytest.fixture
def hugepages_2m(root: None) -> Iterator[int]:
    """2,048 free 2 MiB pages would be 4 GiB: tests ask only for what they use."""
    with helpers.reserved_hugepages(64) as got:
        if got < 8:
            pytest.skip(f"could reserve only {got} hugepages")
        yield got


@pytest.fixture(autouse=True)
def hostpool_events_enabled() -> Iterator[None]:
    """Let every event through the level guard so capture_logs sees info and debug too."""
    import logging

    logger = logging.getLogger("hostpool")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield
    logger.setLevel(old)


@pytest.fixture
def fake_cuda() -> Iterator[helpers.FakeCuda]:
    """A fake CUDA runtime behind hostpool's seam (no GPU is lent to most runs)."""
    from hostpool.memory import cuda

    fake = helpers.FakeCuda()
    previous = cuda.set_runtime(fake)
    try:
        yield fake
    finally:
        cuda.set_runtime(previous)


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A fresh path in /dev/shm for the test to create (a tmpfs file the host view sees as
    a `file` object, an orphan once nothing holds it), removed afterwards."""
    path = f"/dev/shm/hostpool-test-{secrets.token_hex(4)}"
    try:
        yield path
    finally:
        if os.path.exists(path):
            os.unlink(path)
