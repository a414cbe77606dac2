"""Metrics for prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR).

There, a server's parent aggregates its workers' metric files and ignores custom
collectors, so each worker writes the same names into its own files: gauges with an
explicit `multiprocess_mode` (`livesum` for bytes, fds and counts, which add up across
workers; `livemax` where a sum is meaningless: host-wide hugepages, the build info, scrape
time, budget limits), counters, and the duration histogram. No pid label is added.

Every publish writes the ledger's *absolute* values: the counts it keeps at its
transitions (births, releases, failures, fallbacks), the histogram's per-bucket counts and
exact sum (observed at each birth), and the gauges, resident bytes measured now. They go
through the per-process storage prometheus_client's own metric classes write through
(`promvalues`: its internals, with the versions they were read from), so a publish is
idempotent: one that fails half-way is
redone whole by the next, and nothing is counted twice or lost. Nothing is registered in a
registry: in this mode the server exposes the directory, and a second set of metrics with
the names `register_metrics()` already registered would collide (DuplicateTimeseries).

Publishing never stops and never raises into an allocation: each publish is guarded, a
failure is counted in `hostpool_publish_errors_total{kind}` (shown by the first publish
that succeeds) and logged once per kind, and the thread tries again every `interval`.
`ensure_publisher()` is the one entry point for server integrations (sglang, vLLM): call it
after an allocation; it starts this process's publisher once and never raises. A forked
child gets its own publisher (its hook in `hostpool.base.fork`): a fork waits for a publish
in flight, so the child never inherits prometheus_client's lock held by a thread it does
not have.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

from hostpool.base import events, fork
from hostpool.base.locks import ForkSafeLock
from hostpool.core.ledger import Ledger, get_ledger
from hostpool.metrics import promvalues
from hostpool.metrics.collector import METRICS, count_publish_error, measure

# Host-wide or per-process values that must not be summed across workers.
_LIVEMAX = {
    "hostpool_hugepages_free",
    "hostpool_build_info",
    "hostpool_scrape_duration_seconds",
    "hostpool_budget_bytes",
}
DEFAULT_INTERVAL = 5.0
# A fork waits at most this long for a publish in flight (one takes milliseconds).
_FORK_WAIT_SECONDS = 10.0

_ERRNO_KINDS = {
    errno.EMFILE: "fd_limit",
    errno.ENFILE: "fd_limit",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EROFS: "permission",
}

# Key of one published sample: (type, multiprocess mode, metric, sample, label names, values).
_Key = tuple[str, str, str, str, tuple[str, ...], tuple[str, ...]]


def error_kind(exc: BaseException) -> str:
    """The `kind` label of a failed publish."""
    if isinstance(exc, OSError):
        return _ERRNO_KINDS.get(exc.errno or 0, "os_error")
    return "other"


class MultiprocessPublisher:
    """Writes the ledger's metrics into this process's multiprocess files every `interval`
    seconds (and once at `start()`). Requires prometheus_client to have been imported with
    PROMETHEUS_MULTIPROC_DIR set, as servers running it in multiprocess mode do."""

    def __init__(self, ledger: Ledger | None = None, *, interval: float = DEFAULT_INTERVAL) -> None:
        self.ledger = ledger or get_ledger()
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = threading.Condition(threading.Lock())
        self.attempts = 0
        self.successes = 0
        self.failures = 0
        self.pid = os.getpid()

    # -- publishing ------------------------------------------------------------------
    def publish(self) -> None:
        """Bring every published sample up to date with the ledger, now. Raises what
        writing raised (`publish_guarded()` is the form that never does)."""
        started = time.perf_counter()
        targets = _targets(measure(self.ledger))
        name = "hostpool_scrape_duration_seconds"
        scrape: _Key = ("gauge", "livemax", name, name, (), ())
        with _values_lock:
            # A gauge series that went away is zeroed (clear() is unsupported here).
            for key in _published:
                if key[0] == "gauge" and key not in targets and key != scrape:
                    targets[key] = 0.0
            for key, value in targets.items():
                _value(key).set(value)
            _value(scrape).set(time.perf_counter() - started)

    def publish_guarded(self) -> bool:
        """`publish()`, with any failure counted and logged (once per kind); True on success."""
        with _publishing:  # a fork waits for this: no prometheus_client lock held at fork
            try:
                self.publish()
                failed: Exception | None = None
            except Exception as exc:  # every failure is counted; the next publish retries
                failed = exc
        if failed is not None:
            _count_failure(failed)
        with self._progress:
            self.attempts += 1
            if failed is None:
                self.successes += 1
            else:
                self.failures += 1
            self._progress.notify_all()
        return failed is None

    # -- the thread ------------------------------------------------------------------
    def start(self) -> MultiprocessPublisher:
        """Publish once now (guarded: a failure is counted, never raised), then every
        `interval` seconds on a daemon thread."""
        self.publish_guarded()
        self._start_thread(publish_first=False)
        return self

    def _start_thread(self, *, publish_first: bool) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(publish_first,), name="hostpool-metrics", daemon=True
        )
        self._thread.start()

    def _run(self, publish_first: bool) -> None:
        if publish_first:
            self.publish_guarded()
        while not self._stop.wait(self.interval):
            self.publish_guarded()

    def stop(self) -> None:
        """Stop the thread and publish a last time."""
        self._stop.set()
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()
        self.publish_guarded()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_attempts(self, n: int, timeout: float) -> bool:
        """Block until `n` publishes were attempted (successful or not); False on timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: self.attempts >= n, timeout)

    def wait_successes(self, n: int, timeout: float) -> bool:
        """Block until `n` publishes succeeded; False on timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: self.successes >= n, timeout)


def _targets(samples: dict[str, dict[tuple[str, ...], Any]]) -> dict[_Key, float]:
    """measure()'s samples as the absolute value of every file entry to write."""
    out: dict[_Key, float] = {}
    for name, series in samples.items():
        kind, labels, _doc = METRICS[name]
        if kind == "counter":
            for labelvalues, value in series.items():
                out[("counter", "", name, name + "_total", labels, labelvalues)] = float(value)
        elif kind == "histogram":
            for labelvalues, (buckets, total) in series.items():
                out[("histogram", "", name, name + "_sum", labels, labelvalues)] = float(total)
                # Files hold per-bucket counts; the collector accumulates them.
                below = 0.0
                for le, cumulative in buckets:
                    # The collector parses `le` as a float and formats it its own way.
                    key = ("histogram", "", name, name + "_bucket", (*labels, "le"))
                    out[(*key, (*labelvalues, le))] = cumulative - below
                    below = cumulative
        else:
            mode = "livemax" if name in _LIVEMAX else "livesum"
            for labelvalues, value in series.items():
                out[("gauge", mode, name, name, labels, labelvalues)] = float(value)
    return out


# One value object per file entry and process, shared by every publisher of the process:
# two objects for one entry would each write their own idea of it. prometheus_client moves
# them to a forked child's own files by itself (it checks the pid on every write).
_published: dict[_Key, promvalues.Value] = {}
_values_lock = ForkSafeLock()


def _value(key: _Key) -> promvalues.Value:
    value = _published.get(key)
    if value is None:
        typ, mode, metric, sample, labelnames, labelvalues = key
        value = promvalues.new_value(
            typ, mode, metric, sample, labelnames, labelvalues, METRICS[metric][2]
        )
        _published[key] = value
    return value


# -- failures: counted always, logged once per kind -------------------------------------
_logged_kinds: set[str] = set()


def _count_failure(exc: Exception) -> None:
    kind = error_kind(exc)
    count_publish_error(kind)
    if kind in _logged_kinds:
        return
    _logged_kinds.add(kind)
    events.warning(
        "hostpool.publish_failed",
        kind=kind,
        error=f"{type(exc).__name__}: {exc}",
        directory=os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
        action="counted in hostpool_publish_errors_total; the publisher keeps retrying "
        "(logged once per kind)",
    )


# -- one publisher per process -----------------------------------------------------------
_current: MultiprocessPublisher | None = None
_current_lock = ForkSafeLock()
_publishing = ForkSafeLock()  # held during each publish; a fork waits for it
_fork_held = [False]
_warned_not_multiprocess = [False]


def current_publisher() -> MultiprocessPublisher | None:
    """This process's publisher started by `ensure_publisher()` (or the fork hook)."""
    return _current


def ensure_publisher(*, interval: float = DEFAULT_INTERVAL) -> MultiprocessPublisher | None:
    """Start this process's publisher if PROMETHEUS_MULTIPROC_DIR is set; the running one
    otherwise. Cheap after the first call; never raises: what goes wrong is counted in
    `hostpool_publish_errors_total` and logged once per kind, and the caller's allocation
    stands. Returns None where there is nothing to publish to."""
    current = _current
    if current is not None:
        return current
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return _start_once(interval)


def _start_once(interval: float) -> MultiprocessPublisher | None:
    global _current
    with _current_lock:
        if _current is not None:
            return _current
        if not promvalues.supported():
            return None  # nothing published (the gate warned once)
        if not promvalues.writes_files():
            # prometheus_client was imported before the variable was set: its metrics
            # (the server's own too) stay in memory, and files would be written by nobody.
            if not _warned_not_multiprocess[0]:
                _warned_not_multiprocess[0] = True
                events.warning(
                    "hostpool.publish_unavailable",
                    why="prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set",
                    action="set PROMETHEUS_MULTIPROC_DIR before the server starts",
                )
            return None
        publisher = MultiprocessPublisher(interval=interval)
        try:
            publisher.start()
        except Exception as exc:  # the thread could not start: count it, retry next call
            _count_failure(exc)
            return None
        _current = publisher
        return publisher


def _before_fork() -> None:
    _fork_held[0] = _publishing.acquire(timeout=_FORK_WAIT_SECONDS)


def _after_fork_in_parent() -> None:
    if _fork_held[0]:
        _fork_held[0] = False
        _publishing.release()


def _after_fork_in_child() -> None:
    # hostpool.base.locks has already given the child fresh locks; the parent's thread is gone.
    global _current
    parent, _current = _current, None
    _fork_held[0] = False
    _logged_kinds.clear()
    if parent is None:
        return
    child = MultiprocessPublisher(parent.ledger, interval=parent.interval)
    try:
        # Only the thread starts here; it publishes first thing, outside the fork hook.
        child._start_thread(publish_first=True)
    except Exception as exc:
        _count_failure(exc)
        return
    _current = child


fork.on_fork(
    __name__,
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
