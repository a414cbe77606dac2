"""The body of a `spawn`ed child: activation comes from HOSTPOOL_INSTRUMENT alone."""

from __future__ import annotations

from typing import Any


def build_pool_and_wait(conn: Any, label: str) -> None:
    import os

    from tests.sglang.cpu_import import load_sglang
    from tests.sglang.pools import buffers, mha

    load_sglang()
    import sglang.srt.mem_cache.pool_host.common as common

    patched = common.get_allocator_from_storage.__module__.startswith(
        "hostpool.integrations.sglang"
    )
    pool = mha("layer_first", "shm", label) if patched else None
    nbytes = sum(b.numel() * b.element_size() for b in buffers(pool)) if pool else 0
    conn.send({"pid": os.getpid(), "patched": patched, "bytes": nbytes})
    conn.recv()  # the parent has looked
    if pool is not None:
        pool.destroy()
    conn.send("done")
