"""`hostpool serve`'s broker metrics, read from the broker's lease book at scrape time:
`hostpool_broker_leases{pool}`, `hostpool_broker_adopted_blocks_total{pool}`,
`hostpool_broker_discarded_blocks_total{pool,reason}` (metrics/README.md)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hostpool.core.leases import LeaseBook


class BrokerCollector(Collector):
    """Per configured pool; zeros until `book` is set (the broker starts once every pool
    is populated)."""

    def __init__(self, pools: Iterable[str]) -> None:
        self.pools = list(pools)
        self.book: LeaseBook | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        book = self.book
        leases = book.leases() if book is not None else {}
        adopted, discarded = book.counters() if book is not None else ({}, {})
        held = GaugeMetricFamily(
            "hostpool_broker_leases",
            "parts of the pool (memory, index) leased to an engine now",
            labels=["pool"],
        )
        taken = CounterMetricFamily(
            "hostpool_broker_adopted_blocks",
            "index records an engine adopted at its start (blocks it found in the pool)",
            labels=["pool"],
        )
        dropped = CounterMetricFamily(
            "hostpool_broker_discarded_blocks",
            "index records not adopted, by reason",
            labels=["pool", "reason"],
        )
        for pool in self.pools:
            held.add_metric([pool], leases.get(pool, 0))
            taken.add_metric([pool], adopted.get(pool, 0))
        for (pool, reason), n in sorted(discarded.items()):
            dropped.add_metric([pool, reason], n)
        yield held
        yield taken
        yield dropped
