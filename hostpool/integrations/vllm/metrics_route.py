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
directory of this uid, mode 0700 (a `ConfigError` otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
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

from hostpool.core.ledger import get_ledger
from hostpool.errors import ConfigError
from hostpool.metrics.collector import METRICS, measure
from hostpool.metrics.multiprocess import current_publisher, ensure_publisher

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


def metrics_dir(extra_config: Mapping[str, Any] | None = None) -> Path:
    """The directory workers publish into (created 0700 if missing; checked)."""
    configured = (extra_config or {}).get("hostpool_metrics_dir")
    if configured:
        path = Path(str(configured))
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "hostpool-vllm"
    else:
        path = Path(tempfile.gettempdir()) / f"hostpool-vllm-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"hostpool metrics dir {path} is not a directory (or is a symlink)")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"hostpool metrics dir {path} must belong to uid {os.getuid()} with mode 0700 "
            f"(uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})"
        )
    return path


def encode(samples: Mapping[str, Mapping[tuple[str, ...], Any]]) -> dict[str, Any]:
    """`measure()` output as JSON: {name: [[labels...], value], ...}."""
    return {
        name: [[list(labels), value] for labels, value in values.items()]
        for name, values in samples.items()
    }


def prune_dead(directory: Path) -> list[int]:
    """Remove the files of workers that no longer exist (a SIGKILLed worker, e.g. under
    vLLM's default `--shutdown-timeout 0`, never removes its own). A file whose pid is
    alive is left alone, whoever that process is. Returns the pids removed."""
    removed: list[int] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        stem, dot, ext = name.partition(".")
        if not stem.isdigit() or ext != "json" or not dot:
            continue
        if psutil.pid_exists(int(stem)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / name)
            removed.append(int(stem))
    return removed


# -- worker side -------------------------------------------------------------------------
class _WorkerPublisher:
    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}.json"
        self.regions = 0
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="hostpool-vllm-metrics", daemon=True)

    def publish(self) -> None:
        samples = encode(measure(get_ledger()))
        data = json.dumps({"pid": os.getpid(), "samples": samples})
        tmp = self.path.with_suffix(f".{threading.get_ident()}.tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, self.path)

    def pid_changed(self) -> bool:
        """A forked child inherits the object, not the thread: it publishes anew."""
        return self.path.name != f"{os.getpid()}.json"

    def run(self) -> None:
        while not self.stop.is_set():
            # A failed publish must not kill the worker; the next one retries.
            with contextlib.suppress(Exception):
                self.publish()
            self.wake.wait(PUBLISH_INTERVAL_S)
            self.wake.clear()


_lock = threading.Lock()
_publisher: _WorkerPublisher | None = None


def worker_region_made(extra_config: Mapping[str, Any]) -> None:
    """Called in the worker after each offload region is made: start (or refresh) publishing."""
    global _publisher
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # vLLM's own multiprocess mode: its collector reads that directory, where
        # hostpool's multiprocess publisher writes (never raising into the caller).
        publisher = ensure_publisher()
        if publisher is not None:
            publisher.publish_guarded()
        return
    with _lock:
        if (
            _publisher is None
            or _publisher.path.parent != metrics_dir(extra_config)
            or _publisher.pid_changed()
        ):
            directory = metrics_dir(extra_config)
            prune_dead(directory)
            _publisher = _WorkerPublisher(directory)
            _publisher.thread.start()
        _publisher.regions += 1
        _publisher.publish()


def worker_region_released() -> None:
    """Called after a region is released: publish now; after the last one, stop and remove
    this worker's file (the process is going away with nothing left to show)."""
    global _publisher
    mp = current_publisher()
    if mp is not None:
        mp.publish_guarded()
    with _lock:
        pub = _publisher
        if pub is None:
            return
        pub.regions -= 1
        if pub.regions > 0:
            pub.publish()
            return
        _publisher = None
    pub.stop.set()
    pub.wake.set()
    pub.thread.join(timeout=30)
    with contextlib.suppress(FileNotFoundError):
        pub.path.unlink()


# -- API-server side ---------------------------------------------------------------------
class VllmWorkersCollector(Collector):
    """The contract's hostpool metrics, summed over this process's live descendant workers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: families depend on what workers publish

    def _worker_samples(self) -> list[dict[str, Any]]:
        try:
            pids = {p.pid for p in psutil.Process().children(recursive=True)}
        except psutil.Error:
            return []
        out = []
        for pid in sorted(pids):
            try:
                data = json.loads((self.directory / f"{pid}.json").read_text())
            except (OSError, ValueError):
                continue  # not a hostpool worker, or mid-replace on a platform without atomicity
            if isinstance(data, dict) and data.get("pid") == pid:
                out.append(data["samples"])
        return out

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        prune_dead(self.directory)
        workers = self._worker_samples()
        if not workers:
            return
        merged: dict[str, dict[tuple[str, ...], Any]] = {}
        for samples in workers:
            for name, rows in samples.items():
                if name not in METRICS:
                    continue
                target = merged.setdefault(name, {})
                for labels, value in rows:
                    key = tuple(labels)
                    if METRICS[name][0] == "histogram":
                        buckets, total = value
                        if key in target:
                            old_buckets, old_total = target[key]
                            buckets = [
                                (b, n + m)
                                for (b, n), (_, m) in zip(old_buckets, buckets, strict=True)
                            ]
                            total += old_total
                        target[key] = ([(b, float(n)) for b, n in buckets], total)
                    elif name in LIVEMAX:
                        target[key] = max(target.get(key, value), value)
                    else:
                        target[key] = target.get(key, 0.0) + value
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
    files, so nothing is registered."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    registry = get_prometheus_registry()
    with _lock:
        if id(registry) in _served:
            return
        registry.register(VllmWorkersCollector(metrics_dir(extra_config)))
        _served.add(id(registry))
