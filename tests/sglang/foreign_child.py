"""A fresh process for the foreign-allocator test: sglang's real mooncake, UMBP and
tensorcast allocator classes imported lazily, after the integration is on (by sglang's own
`get_allocator_from_storage`), so nothing in the test process can have imported them first.

`python -m tests.sglang.foreign_child env|install` (activation by HOSTPOOL_INSTRUMENT before
sglang loads, or `install()` after its host-pool modules loaded); prints one JSON line.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

COMMON = "sglang.srt.mem_cache.pool_host.common"
MOONCAKE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"
UMBP = "sglang.srt.mem_cache.storage.umbp.umbp_host_allocator"
TENSORCAST = "sglang.srt.mem_cache.storage.tensorcast_store.host_allocator"
LABEL = "mha_mooncake"


def _mapping_of(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else ""
    return ""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _bases() -> dict[str, str]:
    """The class each foreign allocator class (imported now, if not yet) inherits from."""
    mooncake = sys.modules[MOONCAKE].MooncakeHostTensorAllocator
    umbp = importlib.import_module(UMBP).UMBPHostTensorAllocator
    tensorcast = importlib.import_module(TENSORCAST).TensorcastHostTensorAllocator
    return {
        "mooncake": _name(mooncake.__mro__[1]),
        "umbp": _name(umbp.__mro__[1]),
        "tensorcast": _name(tensorcast.__mro__[1]),
    }


def main(mode: str) -> dict[str, Any]:
    from hostpool.core.ledger import get_ledger
    from hostpool.integrations import sglang as integration
    from hostpool.metrics import measure
    from tests.sglang.cpu_import import load_sglang
    from tests.sglang.pools import buffers, mha

    load_sglang()
    if mode == "install":
        integration.install()
    out: dict[str, Any] = {"installed": integration.installed()}
    out["imported_before"] = [m for m in (MOONCAKE, UMBP, TENSORCAST) if m in sys.modules]
    common = sys.modules[COMMON]
    base = common.HostTensorAllocator
    out["base"] = _name(base)

    # sglang's dispatch imports the real mooncake class here, and the real mooncake
    # library (mooncake-transfer-engine) maps the memory.
    pool = mha("layer_first", "mooncake", LABEL)
    allocator = pool.allocator
    out["allocator_class"] = _name(type(allocator))
    out["bases_while_installed"] = _bases()
    (buffer,) = buffers(pool)
    out["buffer_bytes"] = buffer.numel() * buffer.element_size()
    out["buffer_mapping"] = _mapping_of(buffer.data_ptr())
    records = [r for r in get_ledger().snapshot() if r.pool == LABEL]
    out["records"] = [
        {"backend": r.backend, "allocator": r.allocator, "fd": r.fd, "address": r.address}
        for r in records
    ]
    out["buffer_address"] = buffer.data_ptr()
    samples = measure(get_ledger())["hostpool_allocated_bytes"]
    out["gauge"] = sum(v for labels, v in samples.items() if labels[0] == LABEL)
    # Where mori (UMBP) is not installed sglang falls back to its default allocator:
    # that one is sglang's own class, so hostpool's stand-in, tracked as hostpool's.
    fallback = common.get_allocator_from_storage("mori")
    out["mori_fallback_tracked"] = getattr(fallback, "hostpool_kind", None)

    pool.destroy()
    del pool, allocator, buffer
    import gc

    gc.collect()
    ledger = get_ledger()
    ledger.drain()
    out["records_after_destroy"] = len([r for r in ledger.snapshot() if r.pool == LABEL])
    out["releases"] = {how: n for (p, how), n in ledger.releases_total.items() if p == LABEL}

    integration.uninstall()
    out["base_after_uninstall"] = _name(common.HostTensorAllocator)
    out["bases_after_uninstall"] = _bases()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
