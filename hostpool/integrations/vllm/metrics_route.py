"""hostpool's metrics on vLLM's own `/metrics`, while the memory lives in the Worker.

vLLM serves `/metrics` from the API-server process (its in-process registry, unless
`PROMETHEUS_MULTIPROC_DIR` is set, which vLLM does itself only for `api_server_count > 1`);
the offload memory lives in the `VLLM::Worker` process, two processes below it. The route:

- Worker: after the region is made, a daemon thread writes the worker's ledger, measured
  exactly as `HostPoolCollector` does (`hostpool.metrics.collector.measure`), to
  `<dir>/<pid>.json` every `PUBLISH_INTERVAL_S` seconds and at once on each region change
  (atomic replace). The file is removed when the worker's last region is released; files
  of processes that no longer exist (a SIGKILLed worker) are removed by the next worker
  start or scrape.
- API server: vLLM calls the spec's `build_metric_definitions` while it builds its
  Prometheus stat logger, in this process only; that call registers `VllmWorkersCollector`
  in vLLM's registry (`vllm.v1.metrics.prometheus.get_prometheus_registry()`). At scrape
  it reads the files of its own live descendant processes only (a dead worker's series
  vanish with it; another server's files are never read) and sums them as prometheus_client's
  multiprocess mode does (`livesum`; `livemax` for host-wide values), under the contract's
  names and labels: no pid, no vLLM labels.

Why not vLLM's KV-connector stats pipeline (`KVConnectorStats` -> `KVConnectorPromMetrics`)?
It only moves when the scheduler steps (an idle server would show stale or no gauges), it
adds vLLM's `model_name`/`engine` labels, and it carries deltas, not gauges measured at
scrape. Why not prometheus_client's multiprocess directory? vLLM's single-API-server
`/metrics` does not read one, and turning it on is a vLLM setting. When vLLM sets
`PROMETHEUS_MULTIPROC_DIR` itself (several API servers), the worker publishes there
instead (`hostpool.metrics.multiprocess.ensure_publisher()`), which vLLM's collector reads.

`<dir>` is `kv_connector_extra_config["hostpool_metrics_dir"]`, else
`$XDG_RUNTIME_DIR/hostpool-vllm` or `<tempdir>/hostpool-vllm-<uid>`; it must be a real
directory of this uid, mode 0700 (`metrics_dir` raises ConfigError otherwise).

The route never fails vLLM: a problem with it (that directory taken by another user, a
full disk, a bug) disables hostpool's series in that process with one warning
(`hostpool.vllm_metrics_disabled`); `get_worker`, the engine and vLLM's `/metrics` go on.
The reader reads only what workers wrote (`metrics_files`: odd files are skipped and
counted). A forked child neither publishes nor removes its parent's file, and a release
racing a new region never removes the new region's file (both under one lock).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hostpool.base import events, fork
from hostpool.core.ledger import get_ledger
from hostpool.integrations.vllm import metrics_files
from hostpool.integrations.vllm.metrics_files import metrics_dir, prune_dead
from hostpool.metrics.collector import METRICS, count_publish_error, measure
from hostpool.metrics.multiprocess import current_publisher, ensure_publisher, error_kind

PUBLISH_INTERVAL_S = 5.0
# Host-wide or per-process values: a sum across workers would mean nothing.
LIVEMAX = frozenset(
    {
        "hostpool_hugepages_free",
        "hostpool_build_info",
        "hostpool_scrape_duration_seconds",
        "hostpool_budget_bytes",
    }
)


_disabled: set[str] = set()  # the sides ("worker", "server") turned off in this process


def _disable(side: str, exc: BaseException, **fields: Any) -> None:
    """Turn the route off on this side of this process, with one warning."""
    if side in _disabled:
        return
    _disabled.add(side)
    events.warning(
        "hostpool.vllm_metrics_disabled",
        side=side,
        error=f"{type(exc).__name__}: {exc}",
        action="hostpool's series are left out of vLLM's /metrics; vLLM itself goes on "
        "(set kv_connector_extra_config.hostpool_metrics_dir, or XDG_RUNTIME_DIR, to a "
        "directory of this user)",
        **fields,
    )


# -- worker side -------------------------------------------------------------------------
class _WorkerPublisher:
    def __init__(self, directory: Path) -> None:
        self.pid = os.getpid()
        self.path = directory / metrics_files.file_name(self.pid)
        self.regions = 0
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="hostpool-vllm-metrics", daemon=True)

    def publish(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child: the file is its parent's
        data = json.dumps(metrics_files.document(measure(get_ledger())))
        tmp = self.path.with_suffix(f".{threading.get_ident()}.tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, self.path)

    def run(self) -> None:
        while not self.stop.is_set():
            # A failed publish must not kill the worker; the next one retries.
            self.publish_guarded()
            self.wake.wait(PUBLISH_INTERVAL_S)
            self.wake.clear()

    def publish_guarded(self) -> None:
        try:
            self.publish()
        except Exception as exc:
            count_publish_error(error_kind(exc))
            _publish_failed(exc, self.path)

    def remove(self) -> None:
        """Stop publishing and remove this process's file (never a parent's)."""
        self.stop.set()
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        if os.getpid() == self.pid:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


_failed_publish: list[bool] = [False]


def _publish_failed(exc: Exception, path: Path) -> None:
    # A publish that fails is retried (a full disk may clear); logged once.
    if not _failed_publish[0]:
        _failed_publish[0] = True
        events.warning(
            "hostpool.vllm_metrics_publish_failed",
            path=str(path),
            error=f"{type(exc).__name__}: {exc}",
            action="counted in hostpool_publish_errors_total; retried every interval",
        )


_lock = threading.Lock()
_publisher: _WorkerPublisher | None = None


def _after_fork_in_child() -> None:
    # The child has the parent's publisher object but not its thread or its file: it
    # starts with none (and a fresh lock, which another parent thread may have held).
    global _lock, _publisher
    _lock = threading.Lock()
    _publisher = None


fork.on_fork(__name__, after_in_child=_after_fork_in_child)


def _guarded(side: str, fn: Callable[[], None]) -> None:
    if side in _disabled:
        return
    try:
        fn()
    except Exception as exc:
        _disable(side, exc)


def worker_region_made(extra_config: Mapping[str, Any]) -> None:
    """Called in the worker after each offload region is made: start (or refresh)
    publishing. Never raises: a problem disables the route with one warning."""
    _guarded("worker", lambda: _region_made(extra_config))


def _region_made(extra_config: Mapping[str, Any]) -> None:
    global _publisher
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # vLLM's own multiprocess mode: its collector reads that directory, where
        # hostpool's multiprocess publisher writes (never raising into the caller).
        publisher = ensure_publisher()
        if publisher is not None:
            publisher.publish_guarded()
        return
    directory = metrics_dir(extra_config)
    with _lock:
        if _publisher is None or _publisher.path.parent != directory:
            if _publisher is not None:
                _publisher.remove()
            prune_dead(directory)
            _publisher = _WorkerPublisher(directory)
            _publisher.thread.start()
        _publisher.regions += 1
        _publisher.publish_guarded()


def worker_region_released() -> None:
    """Called after a region is released: publish now; after the last one, stop and remove
    this worker's file (the process is going away with nothing left to show). Never
    raises."""
    _guarded("worker", _region_released)


def _region_released() -> None:
    global _publisher
    mp = current_publisher()
    if mp is not None:
        mp.publish_guarded()
    # All under the lock: a region made meanwhile waits, so the file removed here is
    # never the one its new publisher writes.
    with _lock:
        pub = _publisher
        if pub is None or pub.pid != os.getpid():
            return
        pub.regions -= 1
        if pub.regions > 0:
            pub.publish_guarded()
            return
        _publisher = None
        pub.remove()


# -- API-server side ---------------------------------------------------------------------
class VllmWorkersCollector(Collector):
    """The contract's hostpool metrics, summed over this process's live descendant workers.

    Never raises into the registry (vLLM's /metrics would fail): a scrape that meets an
    error yields nothing from here, with one warning per process."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.skips = metrics_files.SkipCounts()
        self._warned = False

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: families depend on what workers publish

    def _worker_samples(self) -> list[dict[str, metrics_files.Rows]]:
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            return []
        out = []
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        dir_fd = os.open(self.directory, flags)
        try:
            for child in sorted(children, key=lambda p: p.pid):
                start = metrics_files.process_start(child.pid)
                if start is None:
                    continue  # gone since listed
                try:
                    samples = metrics_files.read(dir_fd, child.pid, start)
                except metrics_files.Skipped as skipped:
                    self.skips.count(skipped, str(self.directory / f"{child.pid}.json"))
                    continue
                if samples is not None:  # None: not a hostpool worker
                    out.append(samples)
        finally:
            os.close(dir_fd)
        return out

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            prune_dead(self.directory, self.skips)
            merged = _merge(self._worker_samples(), self.skips)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                events.warning(
                    "hostpool.vllm_metrics_scrape_failed",
                    directory=str(self.directory),
                    error=f"{type(exc).__name__}: {exc}",
                    action="hostpool's series are left out of this scrape; vLLM's own are "
                    "served (logged once)",
                )
            return
        if merged is not None:
            yield from _families(merged, started)
        if merged is not None or self.skips.any():
            skipped = CounterMetricFamily(
                metrics_files.SKIPPED_METRIC,
                "Files in the vLLM metrics directory that the reader skipped, by reason.",
                labels=("reason",),
            )
            for reason, n in self.skips.counts().items():
                skipped.add_metric([reason], float(n))
            yield skipped


def _merge(
    workers: list[dict[str, metrics_files.Rows]], skips: metrics_files.SkipCounts
) -> dict[str, metrics_files.Rows] | None:
    """The workers' samples summed as multiprocess mode does; None without workers."""
    if not workers:
        return None
    merged: dict[str, metrics_files.Rows] = {}
    for samples in workers:
        for name, rows in samples.items():
            target = merged.setdefault(name, {})
            for key, value in rows.items():
                if METRICS[name][0] == "histogram":
                    buckets, total = value
                    if key in target:
                        old_buckets, old_total = target[key]
                        if [b for b, _ in old_buckets] != [b for b, _ in buckets]:
                            continue  # a worker with other bounds: not summable
                        buckets = [
                            (b, n + m) for (b, n), (_, m) in zip(old_buckets, buckets, strict=True)
                        ]
                        total += old_total
                    target[key] = (buckets, total)
                elif name in LIVEMAX:
                    target[key] = max(target.get(key, value), value)
                else:
                    target[key] = target.get(key, 0.0) + value
    return merged


def _families(merged: dict[str, metrics_files.Rows], started: float) -> Iterator[Metric]:
    for name, (kind, labelnames, doc) in METRICS.items():
        family: Any
        if kind == "counter":
            family = CounterMetricFamily(name, doc, labels=labelnames)
        elif kind == "histogram":
            family = HistogramMetricFamily(name, doc, labels=labelnames)
        else:
            family = GaugeMetricFamily(name, doc, labels=labelnames)
        if name == "hostpool_scrape_duration_seconds":
            family.add_metric([], time.perf_counter() - started)
        else:
            for labels, value in merged.get(name, {}).items():
                if kind == "histogram":
                    family.add_metric(list(labels), value[0], value[1])
                else:
                    family.add_metric(list(labels), value)
        yield family


_served: set[int] = set()


def serve_on_vllm_metrics(extra_config: Mapping[str, Any]) -> None:
    """Register `VllmWorkersCollector` in vLLM's Prometheus registry, once per registry.

    Called from the spec's `build_metric_definitions`, which vLLM runs in the process that
    serves `/metrics`. In vLLM's multiprocess mode its own collector reads the workers'
    files, so nothing is registered. Never raises: a problem (the directory taken by
    another user) leaves hostpool's series out, with one warning."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    def register() -> None:
        registry = get_prometheus_registry()
        with _lock:
            if id(registry) in _served:
                return
            registry.register(VllmWorkersCollector(metrics_dir(extra_config)))
            _served.add(id(registry))

    _guarded("server", register)
