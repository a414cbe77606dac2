"""pytest plugin: a test that leaves shared memory open or mapped fails.

Registered through the `pytest11` entry point `hostpool`; disable with `-p no:hostpool`.

- fixture `hostpool_leak_check`: request it in a test (it yields the `LeakCheck`);
- marker `@pytest.mark.hostpool_leak_check`, optionally `(prefixes=[...])`, or
  `(enabled=False)` to exempt one test from a suite-wide check;
- ini `hostpool_leak_check = true`: check every test;
- ini `hostpool_leak_prefixes = hostpool. sglang_host_pool_` (default `hostpool.`).

The baseline is taken when the fixture is set up (as an autouse or first requested
function fixture: after session/module fixtures, so their long-lived pools are not
leaks) and checked after the test's function-scoped fixtures are torn down. A leak is
reported as an error in the test's teardown, naming every fd and mapping with its pool,
size and allocation stack: while a checked test runs, hostpool's ledger records where
each region is allocated, and the report shows the test's own frames, not pytest's.
Tests that already failed are not checked (their traceback holds the frames that hold
the memory). Loading this plugin imports neither torch nor hostpool's allocators.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from hostpool.testing.leakcheck import DEFAULT_PREFIXES, LeakCheck, ShmLeakError, as_prefixes

MARKER = "hostpool_leak_check"
INI_ENABLE = "hostpool_leak_check"
INI_PREFIXES = "hostpool_leak_prefixes"

_call_failed = pytest.StashKey[bool]()
_running = pytest.StashKey[LeakCheck]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        INI_ENABLE,
        type="bool",
        default=False,
        help="hostpool: fail every test that leaves shared-memory fds or mappings behind",
    )
    parser.addini(
        INI_PREFIXES,
        type="args",
        default=list(DEFAULT_PREFIXES),
        help="hostpool: shm name prefixes the leak check watches (default: hostpool.)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(prefixes=None, enabled=True): fail the test if it leaves shared-memory "
        "fds or mappings named with these prefixes behind (hostpool plugin)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_call_failed] = True
    return report


@pytest.fixture
def hostpool_leak_check(request: pytest.FixtureRequest) -> Iterator[LeakCheck]:
    """Fail the test if it leaves shared-memory fds or mappings behind (see the plugin)."""
    running = request.node.stash.get(_running, None)
    if running is not None:  # the marker or ini option already checks this test
        yield running
        return
    yield from _checked(request)


@pytest.fixture(autouse=True)
def _hostpool_leak_check_auto(request: pytest.FixtureRequest) -> Iterator[None]:
    """Checks marked tests, or all with the ini option: itself, not through
    getfixturevalue, whose machinery would cost as much as the check's reads."""
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None:
        wanted = bool(marker.kwargs.get("enabled", True))
    else:
        wanted = bool(request.config.getini(INI_ENABLE))
    if wanted:
        for _ in _checked(request):
            yield
    else:
        yield


def _checked(request: pytest.FixtureRequest) -> Iterator[LeakCheck]:
    check = LeakCheck(_prefixes(request))
    request.node.stash[_running] = check
    # Stacks cost a traceback per allocation: taken only while a checked test runs. The
    # ledger (no torch, no allocators) is imported here, at the first checked test.
    from hostpool.core.ledger import get_ledger

    ledger = get_ledger()
    before, ledger.track_stacks = ledger.track_stacks, True
    try:
        yield check
    finally:
        ledger.track_stacks = before
    if request.node.stash.get(_call_failed, False):
        return
    leaks = check.leaks()
    if leaks:
        pytest.fail(f"hostpool leak check: {ShmLeakError(leaks)}", pytrace=False)


def _prefixes(request: pytest.FixtureRequest) -> tuple[str, ...]:
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None and marker.kwargs.get("prefixes"):
        return as_prefixes(marker.kwargs["prefixes"])  # a str is one prefix
    configured: list[str] = request.config.getini(INI_PREFIXES)
    return tuple(configured) or DEFAULT_PREFIXES
