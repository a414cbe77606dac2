from __future__ import annotations

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
# pytest's per-user directory (a run given no --basetemp elsewhere) and the runtime
# directories of runs going on beside this one (each run removes its own).
NOT_LEFTOVERS = ("pytest-of-*", "hostpool-test-runtime-*")
_before = pytest.StashKey[dict[str, set[str]]]()
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


def _state() -> dict[str, set[str]]:
    state = {d: set(os.listdir(d)) for d in WATCHED_DIRS if os.path.isdir(d)}
    for path in glob.glob(HUGEPAGE_COUNTS):
        with open(path) as f:
            state[path] = {f.read().strip()}
    return state


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_before] = _state()


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path clean-up
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Report what the run left in /tmp or /dev/shm, or changed in nr_hugepages, that was
    not so at its start; with HOSTPOOL_LEFTOVER_CHECK=1 (`make test`) the run fails then.
    Only reported otherwise: on a host where other runs write there at the same time, what
    they made meanwhile is listed too."""
    runtime = session.config.stash.get(_runtime_dir, None)
    if runtime is not None:
        shutil.rmtree(runtime, ignore_errors=True)
    before = session.config.stash.get(_before, None)
    if before is None:
        return
    after = _state()
    left = []
    for where, names in after.items():
        if where in WATCHED_DIRS:
            new = names - before.get(where, set())
            left += [
                os.path.join(where, name)
                for name in sorted(new)
                if not any(fnmatch.fnmatch(name, p) for p in NOT_LEFTOVERS)
            ]
        elif names != before.get(where):
            left.append(f"{where}: {before.get(where)} at the start, {names} now")
    if not left:
        return
    strict = os.environ.get("HOSTPOOL_LEFTOVER_CHECK") == "1"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep(
            "=",
            "left behind by this run"
            + ("" if strict else " (or made meanwhile by others; HOSTPOOL_LEFTOVER_CHECK=1 fails)"),
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
