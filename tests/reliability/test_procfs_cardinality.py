"""The cardinality attack on a root exporter: an unprivileged user (uid 65534) names
2,000 memfds `hostpool.p<N>.<its pid>.1` (its own pools: named after another process,
they would count in no pool, tests/reliability/test_procfs_attribution.py). The series
stay bounded, a real pool (one with memory behind it) keeps its own series, and the
folded pools are counted."""

from __future__ import annotations

import json
import mmap
import os
import resource
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hostpool.proc import owners
from tests.exporting import running_exporter, scrape, value
from tests.reliability.results import record_procfs_attack as record

MEMFDS = 2000
MAX_POOLS = 32  # the exporter's default


@contextmanager
def attacker(uid: int, names: list[str]) -> Iterator[int]:
    """A forked child running as `uid` that holds one memfd per name (`PID` in a name is
    its pid) until released."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no inherited fds but its two pipe ends, then a plain user
        code = 1
        try:
            low, high = sorted((ready_w, hold_r))
            os.closerange(3, low)
            os.closerange(low + 1, high)
            os.closerange(high + 1, 65536)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            me = str(os.getpid())
            fds = [os.memfd_create(name.replace("PID", me)) for name in names]
            os.write(ready_w, str(len(fds)).encode())
            os.read(hold_r, 1)  # until the parent closes its end
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(hold_r)
    try:
        made = os.read(ready_r, 64).decode()
        assert made == str(len(names)), f"the attacker made {made!r} memfds"
        yield pid
    finally:
        os.close(hold_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


@pytest.fixture
def real_pool() -> Iterator[str]:
    """A pool with 1 MiB resident in this (root) process: what an operator watches."""
    pool = f"real{secrets.token_hex(3)}"
    fd = os.memfd_create(f"hostpool.{pool}.{os.getpid()}.0", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 1 << 20)
        with mmap.mmap(fd, 1 << 20) as mm:
            mm.write(b"x" * (1 << 20))
            yield pool
    finally:
        os.close(fd)


def test_an_unprivileged_memfd_flood_cannot_explode_the_series(root: None, real_pool: str) -> None:
    # distinct from other pools on this host, in the attack's exact shape
    tag = secrets.token_hex(2)
    names = [f"hostpool.p{tag}x{n}.PID.1" for n in range(MEMFDS)]
    with attacker(65534, names), running_exporter("--match", "hostpool.") as exporter:
        text, samples = scrape(exporter.url)
        log = exporter.stop()
    series = [line for line in text.splitlines() if line.startswith("hostpool_exporter_")]
    pools = {dict(labels)["pool"] for name, labels in samples if name.endswith("_open_fds")}
    # 4 per-pool gauges x at most 32 pools, folded, processes, scrape duration, truncated,
    # the scan count, and the ignored objects by reason
    assert len(series) <= 4 * MAX_POOLS + 5 + len(owners.REASONS), len(series)
    assert len(pools) <= MAX_POOLS and "_other" in pools
    assert real_pool in pools  # memory behind it: never folded under a flood of names
    folded = value(samples, "hostpool_exporter_pools_folded", prefix="hostpool.")
    assert folded >= MEMFDS - (MAX_POOLS - 1)
    other = value(samples, "hostpool_exporter_open_fds", prefix="hostpool.", pool="_other")
    assert other >= MEMFDS - (MAX_POOLS - 1)  # the flood's fds are still counted
    warnings = [json.loads(line) for line in log.splitlines() if "pools_folded" in line]
    assert [w["prefix"] for w in warnings] == ["hostpool."]
    record(
        "cardinality",
        memfds=MEMFDS,
        attacker_uid=65534,
        series=len(series),
        max_pools=MAX_POOLS,
        pools_folded=int(folded),
    )
