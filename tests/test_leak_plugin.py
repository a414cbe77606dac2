"""The pytest leak check, run on real inner pytest sessions (pytester) and real memfds."""

from __future__ import annotations

import gc
import mmap
import os
import sys
from collections.abc import Iterator

import pytest

from hostpool.proc import procfs
from hostpool.testing import ShmLeakError, assert_no_leaks

pytest_plugins = ["pytester"]

MiB = 1 << 20

# Inner test modules share these helpers: a leak kept alive in a module-global list.
LEAKY_HELPERS = """
import mmap, os
import pytest

KEEP = []

def memfd(name, size):
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    mm[:1] = b"x"
    return fd, mm
"""


def run_inner(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # hypothesis's plugin imports all of hypothesis at session end: ~1 s per inner run
    return pytester.runpytest("-p", "no:hypothesispytest", *args)


@pytest.fixture
def close_inner_leaks() -> Iterator[None]:
    """Inner sessions run in this process: close what their leaking tests kept open."""
    before = {f.fd for f in procfs.shm_fds("self", ("hostpool.", "sglang_host_pool_"))}
    yield
    gc.collect()
    for f in procfs.shm_fds("self", ("hostpool.", "sglang_host_pool_")):
        if f.fd not in before:
            os.close(f.fd)


@pytest.mark.usefixtures("close_inner_leaks")
def test_a_leaking_test_fails_naming_pool_and_size(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        LEAKY_HELPERS
        + """
@pytest.mark.hostpool_leak_check
def test_leaks():
    KEEP.append(memfd(f"hostpool.kvleak.{os.getpid()}.7", 3 * 1024 * 1024))

@pytest.mark.hostpool_leak_check
def test_clean():
    fd, mm = memfd(f"hostpool.kvclean.{os.getpid()}.8", 1024 * 1024)
    mm.close()
    os.close(fd)
"""
    )
    result = run_inner(pytester)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks*",
            "*hostpool leak check: 1 shared-memory object(s) leaked:*",
            "*pool 'kvleak': memfd hostpool.kvleak.*.7, 3MiB; fd *, *; mapped at *-*",
        ]
    )
    assert "kvclean" not in result.stdout.str()


@pytest.mark.usefixtures("close_inner_leaks")
def test_raw_sglang_memfd_is_caught_when_its_prefix_is_configured(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(
        """
[pytest]
hostpool_leak_check = true
hostpool_leak_prefixes = hostpool. sglang_host_pool_
"""
    )
    pytester.makepyfile(
        LEAKY_HELPERS
        + """
def test_raw_sglang_leak():
    KEEP.append(os.memfd_create("sglang_host_pool_x", os.MFD_CLOEXEC))
"""
    )
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*pool '-': memfd sglang_host_pool_x, 0B; fd *"])


@pytest.mark.usefixtures("close_inner_leaks")
def test_default_prefix_ignores_sglang_names(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nhostpool_leak_check = true\n")
    pytester.makepyfile(
        LEAKY_HELPERS
        + """
def test_raw_sglang_leak():
    KEEP.append(os.memfd_create("sglang_host_pool_y", os.MFD_CLOEXEC))
"""
    )
    run_inner(pytester).assert_outcomes(passed=1)


@pytest.mark.usefixtures("close_inner_leaks")
def test_pytest_machinery_and_wider_scoped_fixtures_are_not_leaks(
    pytester: pytest.Pytester,
) -> None:
    """Capture fds, tmp files, a session fixture's pool first set up inside a test, and a
    function fixture that frees in teardown what the test allocated: no false failure."""
    pytester.makeini("[pytest]\nhostpool_leak_check = true\n")
    pytester.makeconftest(
        LEAKY_HELPERS
        + """
@pytest.fixture(scope="session")
def session_pool():
    fd, mm = memfd(f"hostpool.session.{os.getpid()}.1", 1 << 20)
    yield mm
    mm.close(); os.close(fd)

@pytest.fixture
def function_pool():
    held = []
    yield held
    for fd, mm in held:
        mm.close(); os.close(fd)
"""
    )
    pytester.makepyfile(
        """
import os, sys
from conftest import memfd

def test_capfd(capfd, tmp_path):
    (tmp_path / "f").write_text("x")
    print("out"); print("err", file=sys.stderr); os.write(1, b"raw")

def test_capsys(capsys):
    print("out")

def test_session_pool_is_created_here(session_pool):
    session_pool[:1] = b"y"

def test_function_fixture_frees_in_teardown(function_pool):
    function_pool.append(memfd(f"hostpool.fn.{os.getpid()}.2", 1 << 20))

def test_cyclic_garbage_is_collected_not_reported():
    class Cycle:
        pass
    c = Cycle()
    c.self = c
    c.fd, c.mm = memfd(f"hostpool.cycle.{os.getpid()}.3", 1 << 20)
    os.close(c.fd)
"""
    )
    result = run_inner(pytester)
    result.assert_outcomes(passed=5)


@pytest.mark.usefixtures("close_inner_leaks")
def test_a_reused_fd_number_still_counts_as_new(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        LEAKY_HELPERS
        + """
BEFORE = os.memfd_create(f"hostpool.reuse.{os.getpid()}.1", os.MFD_CLOEXEC)

@pytest.mark.hostpool_leak_check
def test_swap():
    os.close(BEFORE)
    again = os.memfd_create(f"hostpool.reuse.{os.getpid()}.2", os.MFD_CLOEXEC)
    assert again == BEFORE
"""
    )
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*pool 'reuse': memfd hostpool.reuse.*.2, 0B; fd *"])


@pytest.mark.usefixtures("close_inner_leaks")
def test_marker_can_exempt_one_test_and_failed_tests_are_not_checked(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nhostpool_leak_check = true\n")
    pytester.makepyfile(
        LEAKY_HELPERS
        + """
@pytest.mark.hostpool_leak_check(enabled=False)
def test_exempt():
    KEEP.append(memfd(f"hostpool.exempt.{os.getpid()}.1", 4096))

def test_fails_and_leaks():
    KEEP.append(memfd(f"hostpool.failed.{os.getpid()}.2", 4096))
    assert False
"""
    )
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, failed=1)
    assert "leak check" not in result.stdout.str()


def test_stack_of_a_hostpool_allocation_is_shown(pytester: pytest.Pytester) -> None:
    """Needs the lead's allocator and ledger (hostpool.ShmHostTensorAllocator)."""
    pytester.makepyfile(
        """
import os
import pytest
KEEP = []

@pytest.mark.hostpool_leak_check
def test_allocates_and_keeps():
    import torch, hostpool
    allocator = hostpool.ShmHostTensorAllocator(pool="p")
    KEEP.append((allocator, allocator.allocate((1024,), torch.uint8)))

@pytest.mark.hostpool_leak_check
def test_allocates_untracked(monkeypatch):
    import torch, hostpool
    from hostpool.core.ledger import get_ledger
    monkeypatch.setattr(get_ledger(), "track_stacks", False)
    allocator = hostpool.ShmHostTensorAllocator(pool="untracked")
    KEEP.append((allocator, allocator.allocate((1024,), torch.uint8)))

@pytest.mark.hostpool_leak_check
def test_raw_memfd_named_like_hostpool():
    KEEP.append(os.memfd_create(f"hostpool.raw.{os.getpid()}.1"))
"""
    )
    env_before = os.environ.get("HOSTPOOL_TRACK_STACKS")
    os.environ["HOSTPOOL_TRACK_STACKS"] = "1"
    try:  # a subprocess: the ledger reads the variable when it is created
        result = pytester.runpytest_subprocess("-p", "no:hypothesispytest")
    finally:
        if env_before is None:
            del os.environ["HOSTPOOL_TRACK_STACKS"]
        else:
            os.environ["HOSTPOOL_TRACK_STACKS"] = env_before
    result.assert_outcomes(passed=3, errors=3)
    out = result.stdout.str()
    errors = out.split("short test summary info")[0]
    tracked, untracked, raw = errors.split("ERROR at teardown of ")[1:4]
    assert "pool 'p': memfd hostpool.p." in tracked and ", 4KiB; fd " in tracked
    assert "allocated at:" in tracked and "in test_allocates_and_keeps" in tracked
    assert "pool 'untracked'" in untracked and "HOSTPOOL_TRACK_STACKS=1" in untracked
    assert "allocated at:" not in untracked
    assert "pool 'raw'" in raw  # not the ledger's: neither a stack nor the hint
    assert "allocated at" not in raw and "HOSTPOOL_TRACK_STACKS" not in raw


def test_the_stack_is_shown_by_default_trimmed_to_the_tests_own_frames(
    pytester: pytest.Pytester,
) -> None:
    """Issue 36.11: no HOSTPOOL_TRACK_STACKS, and the report still says where the region
    was allocated: the test and its helper, none of pytest's or pluggy's frames."""
    pytester.makepyfile(
        """
import pytest
import torch
import hostpool
KEEP = []

def make_pool():
    allocator = hostpool.ShmHostTensorAllocator(pool="deflt")
    KEEP.append((allocator, allocator.allocate((1024,), torch.uint8)))

@pytest.mark.hostpool_leak_check
def test_leaks_through_a_helper():
    make_pool()

def test_unchecked_allocations_take_no_stack():
    from hostpool.core.ledger import get_ledger
    assert get_ledger().track_stacks is False
"""
    )
    env_before = os.environ.pop("HOSTPOOL_TRACK_STACKS", None)
    try:
        result = pytester.runpytest_subprocess("-p", "no:hypothesispytest")
    finally:
        if env_before is not None:
            os.environ["HOSTPOOL_TRACK_STACKS"] = env_before
    result.assert_outcomes(passed=2, errors=1)
    report = result.stdout.str().split("ERROR at teardown of ")[1].split("short test summary")[0]
    assert "pool 'deflt'" in report and "allocated at:" in report, report
    assert "in test_leaks_through_a_helper" in report and "in make_pool" in report, report
    assert "_pytest" not in report and "pluggy" not in report, report
    assert "HOSTPOOL_TRACK_STACKS" not in report


# -- assert_no_leaks outside pytest --------------------------------------------------------


def _memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


def test_assert_no_leaks_as_a_context_manager() -> None:
    with assert_no_leaks():
        fd, mm = _memfd(f"hostpool.cm.{os.getpid()}.1", MiB)
        mm.close()
        os.close(fd)
    with pytest.raises(ShmLeakError) as caught, assert_no_leaks():
        fd, mm = _memfd(f"hostpool.cm.{os.getpid()}.2", 2 * MiB)
    try:
        (leak,) = caught.value.leaks
        assert (leak.pool, leak.size, leak.kind) == ("cm", 2 * MiB, "memfd")
        assert fd in leak.fds and len(leak.mappings) == 1
        assert "pool 'cm'" in str(caught.value) and "2MiB" in str(caught.value)
    finally:
        mm.close()
        os.close(fd)


def test_assert_no_leaks_does_not_mask_the_blocks_own_error() -> None:
    fd, mm = -1, None
    with pytest.raises(KeyError), assert_no_leaks():
        fd, mm = _memfd(f"hostpool.err.{os.getpid()}.1", MiB)
        raise KeyError("the real problem")
    assert mm is not None
    mm.close()
    os.close(fd)


def test_baseline_then_verify_and_gc_only_when_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or real_collect(*a))
    check = assert_no_leaks(prefixes=("sglang_host_pool_",))
    check.verify()
    assert calls == []  # a clean comparison never collects

    class Cycle:
        pass

    c = Cycle()
    c.self = c  # type: ignore[attr-defined]
    c.mm = _memfd(f"sglang_host_pool_gc.{os.getpid()}.1", MiB)  # type: ignore[attr-defined]
    os.close(c.mm[0])  # type: ignore[attr-defined]
    del c
    check.verify()  # only the mapping remained, and gc.collect() freed it
    assert calls == [1]


def test_plugin_import_pulls_in_neither_torch_nor_allocators() -> None:
    code = (
        "import sys, hostpool.testing.plugin;"
        "heavy = ('torch', 'hostpool.core.allocators', 'hostpool.memory');"
        "bad = [m for m in heavy if m in sys.modules];"
        "print(bad)"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_string_prefix_is_one_prefix_not_its_characters() -> None:
    """`prefixes="hostpool."` means the one prefix: split into characters it would take
    a memfd named `o.unrelated` for a leak."""
    check = assert_no_leaks(prefixes="hostpool.")
    assert check.prefixes == ("hostpool.",)
    fd = os.memfd_create("o.unrelated", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, MiB)
        assert check.leaks() == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ["", [""], [b"hostpool."], [7], (), 7])
def test_nonsensical_prefixes_are_invalid_requests(bad: object) -> None:
    from hostpool.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prefix"):
        assert_no_leaks(prefixes=bad)  # type: ignore[arg-type]
