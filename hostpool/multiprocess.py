"""Metrics for prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR).

There, a server's parent aggregates workers' metric files and ignores custom collectors,
so each worker publishes the same names as plain metrics: gauges with an explicit
`multiprocess_mode` (`livesum` for bytes, fds and counts, which add up across workers;
`livemax` where a sum is meaningless: host-wide hugepages, the build info, scrape time),
counters fed with the ledger's increments, and the duration histogram fed with the real
observations (the ledger keeps them for the publisher, so `_sum` is the true total). No pid
label is added by hostpool. `start()` publishes at once, then a background thread
refreshes them (resident bytes need measuring).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hostpool.lifecycle import DURATION_BUCKETS, Ledger, get_ledger
from hostpool.metrics import METRICS, measure

# Host-wide or per-process values that must not be summed across workers.
_LIVEMAX = {
    "hostpool_hugepages_free",
    "hostpool_build_info",
    "hostpool_scrape_duration_seconds",
    "hostpool_budget_bytes",
}


class MultiprocessPublisher:
    """Publishes the ledger's metrics as plain metrics every `interval` seconds."""

    def __init__(
        self,
        ledger: Ledger | None = None,
        *,
        interval: float = 5.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.ledger = ledger or get_ledger()
        self.ledger.log_durations()  # from now on; the ledger starts it at import in this mode
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_counts: dict[tuple[str, tuple[str, ...]], float] = {}
        self._metrics: dict[str, Any] = {}
        self._seen_gauges: dict[str, set[tuple[str, ...]]] = {}
        kwargs: dict[str, Any] = {} if registry is None else {"registry": registry}
        for name, (kind, labels, doc) in METRICS.items():
            if kind == "counter":
                self._metrics[name] = Counter(name, doc, labels, **kwargs)
            elif kind == "histogram":
                self._metrics[name] = Histogram(
                    name, doc, labels, buckets=DURATION_BUCKETS, **kwargs
                )
            else:
                if name in _LIVEMAX:
                    gauge = Gauge(name, doc, labels, multiprocess_mode="livemax", **kwargs)
                else:
                    gauge = Gauge(name, doc, labels, multiprocess_mode="livesum", **kwargs)
                self._metrics[name] = gauge

    def publish(self) -> None:
        """Bring every published metric up to date with the ledger, now."""
        import time

        started = time.perf_counter()
        samples = measure(self.ledger)
        for name, values in samples.items():
            kind = METRICS[name][0]
            metric = self._metrics[name]
            if kind == "gauge":
                # clear() is unsupported in multiprocess mode: zero what went away.
                stale = self._seen_gauges.get(name, set()) - set(values)
                for labels in stale:
                    metric.labels(*labels).set(0.0)
                for labels, value in values.items():
                    (metric.labels(*labels) if labels else metric).set(value)
                self._seen_gauges[name] = set(values) | stale
            elif kind == "counter":
                for labels, value in values.items():
                    key = (name, labels)
                    delta = value - self._seen_counts.get(key, 0.0)
                    if delta > 0 or key not in self._seen_counts:
                        metric.labels(*labels).inc(max(delta, 0.0))
                        self._seen_counts[key] = value
        self._publish_durations()
        self._metrics["hostpool_scrape_duration_seconds"].set(time.perf_counter() - started)

    def _publish_durations(self) -> None:
        histogram = self._metrics["hostpool_allocation_duration_seconds"]
        for pool, seconds in self.ledger.take_durations():
            histogram.labels(pool).observe(seconds)

    def start(self) -> MultiprocessPublisher:
        self.publish()
        self._thread = threading.Thread(target=self._run, name="hostpool-metrics", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.publish()
