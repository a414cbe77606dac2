"""How far `hostpool serve` is in populating its pools: /readyz and three metrics.

`PopulateState` is fed from the allocating thread (a chunk finished) and from populate's
threads (a span of a chunk is resident); HTTP worker threads read it. Every access is a
few integer operations under one lock that nothing slow ever holds, so a scrape or a
probe never waits on the allocation (nor on the ledger).

- `hostpool_serve_populate_target_bytes{pool}`: the bytes the pool will hold;
- `hostpool_serve_populate_done_bytes{pool}`: of those, the bytes populated so far;
- `hostpool_serve_ready`: 1 once every pool is populated (and the service is up), else 0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from hostpool.base.units import format_size


class PopulateState:
    """Per pool: target and populated bytes; whether the service is ready or stopping."""

    def __init__(
        self, pools: Iterable[tuple[str, int]], stop: threading.Event | None = None
    ) -> None:
        """`pools`: (name, bytes) in allocation order; `stop`: set once a stop was asked."""
        self._lock = threading.Lock()
        self._stop = stop
        self._target = dict(pools)
        self._done = dict.fromkeys(self._target, 0)  # bytes of finished chunks
        self._partial = 0  # bytes of the chunk in progress populated so far
        self._current: str | None = None
        self._ready = False

    def chunk_done(self, pool: str, done: int, total: int) -> None:
        """`done` bytes of `pool` are allocated (its chunks so far); done=0 starts it.
        The signature of PoolService's progress callback."""
        with self._lock:
            self._current = pool
            self._target[pool] = total
            self._done[pool] = done
            self._partial = 0

    def populated(self, nbytes: int) -> None:
        """`nbytes` more of the chunk in progress are resident (populate's on_bytes)."""
        with self._lock:
            self._partial += nbytes

    def set_ready(self) -> None:
        with self._lock:
            self._ready = True

    @property
    def stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def progress(self) -> dict[str, tuple[int, int]]:
        """Per pool, (populated bytes, target bytes) now."""
        with self._lock:
            out = {}
            for pool, target in self._target.items():
                done = self._done[pool]
                if pool == self._current and done < target:
                    done += self._partial
                out[pool] = (min(done, target), target)
            return out

    def readiness(self) -> tuple[bool, str]:
        """(ready, the one line /readyz answers): `ready`, `stopping`, what is still
        populating, such as `populating kv: 1.2GiB of 4GiB`, or `starting` once every
        pool is populated and the share socket or demo load are not started yet."""
        if self.stopping:
            return False, "stopping"
        with self._lock:
            ready = self._ready
        if ready:
            return True, "ready"
        left = [
            f"{pool}: {format_size(done)} of {format_size(target)}"
            for pool, (done, target) in self.progress().items()
            if done < target
        ]
        if not left:
            return False, "starting"
        return False, "populating " + ", ".join(left)

    @property
    def ready(self) -> bool:
        with self._lock:
            ready = self._ready
        return ready and not self.stopping


class PopulateCollector(Collector):
    """The three `hostpool_serve_*` metrics of one PopulateState."""

    def __init__(self, state: PopulateState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        target = GaugeMetricFamily(
            "hostpool_serve_populate_target_bytes",
            "Bytes the pool will hold once populated (hostpool serve).",
            labels=["pool"],
        )
        done = GaugeMetricFamily(
            "hostpool_serve_populate_done_bytes",
            "Bytes of the pool populated so far (hostpool serve).",
            labels=["pool"],
        )
        for pool, (populated, total) in self.state.progress().items():
            target.add_metric([pool], total)
            done.add_metric([pool], populated)
        ready = GaugeMetricFamily(
            "hostpool_serve_ready",
            "1 once every pool of hostpool serve is populated and it serves, else 0.",
            value=1 if self.state.ready else 0,
        )
        yield target
        yield done
        yield ready
