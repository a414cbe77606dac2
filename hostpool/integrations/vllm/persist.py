"""vLLM's offload index kept in the broker (`hostpool serve`), so a restarted engine finds
its host KV cache: `BrokerIndexManager` and the engine's identity key.

`BrokerIndexManager` is vLLM's own `CPUOffloadingManager` (same policy, same chunk
allocation), overriding only public methods of the `OffloadingManager` interface:

- `prepare_store`: each chunk handed out for a store is marked WRITING in the index, with
  its generation bumped, before vLLM's worker copies a byte (the scheduler sends the
  transfer only after this returns);
- `complete_store`: a successful store's chunk is published (VALID, with its key); a
  failed one's cleared;
- `reset_cache`: every record cleared.

At its first use (the scheduler's first `lookup` or `prepare_store`, after vLLM's
`init_none_hash` ran: the engine builds the scheduler before it seeds the prefix hash)
it leases the pool's index from the broker, adopts every valid record whose identity key
equals this engine's, through the manager's own `prepare_store`/`complete_store` (chunk
ids are handed out in order, so the records are offered in chunk order, with placeholder
keys for the holes that are then failed back into the free list), and reports the
adoption to the broker. Anything unexpected adopts nothing (fail closed).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import OffloadKey, PrepareStoreOutput, ReqContext
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from hostpool.broker.client import Lease, lease
from hostpool.broker.index import KVIndex, index_bytes
from hostpool.broker.modelfiles import weights_digest
from hostpool.errors import HostPoolError

logger = init_logger(f"vllm.{__name__}")

HOLE = b"hostpool-hole:"  # placeholder keys: another length than any block hash key


def rank_pool(pool: str, world_size: int, rank: int) -> str:
    """The broker pool of one worker: `pool` alone, `<pool>-rank<k>` with several ranks
    (pool names take no dots)."""
    return pool if world_size <= 1 else f"{pool}-rank{rank}"


def model_digest(model: str) -> str | None:
    """SHA-256 of the model directory's config.json, None for a model that is not a local
    directory (a hub id is identified by its name only)."""
    path = Path(model) / "config.json"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def identity(config: OffloadingConfig, spec: Any) -> dict[str, Any]:
    """This engine's identity key (docs/broker.md): what must be equal for a recorded
    chunk to mean the same KV to this engine. Read once the prefix hash is seeded."""
    import vllm

    seed_from_env = os.getenv("PYTHONHASHSEED") is not None
    seed = kv_cache_utils.get_none_hash_seed()
    none_hash = bytes(kv_cache_utils.NONE_HASH)  # the algorithm applied to the seed
    parallel = config.parallel
    return {
        "engine": "vllm",
        "engine_version": vllm.__version__,
        "model": config.model.name,
        "model_config_digest": model_digest(config.model.name),
        # the weights' files as their content is known (None for a hub id: by name only)
        "weights_digest": weights_digest(config.model.name),
        "kv_cache_dtype": config.model.dtype,
        "tokens_per_block": list(spec.tokens_per_block),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "kv_bytes_per_chunk": spec.kv_bytes_per_chunk,
        "layout": {
            "kv_cache_layout": config.kv_cache_layout,
            "canonical": config.canonical_layout,
            "replicated": spec.replicated_layout,
            "groups": [[g.group_id, g.tokens_per_block, len(g.layer_names)] for g in config.groups],
        },
        "tp_size": parallel.tp_size,
        "pp_size": parallel.pp_size,
        "world_size": parallel.world_size,
        "pcp_size": parallel.pcp_size,
        "dcp_size": parallel.dcp_size,
        "prefix_hash": hashlib.sha256(none_hash).hexdigest(),
        "hash_seed_source": "PYTHONHASHSEED" if seed_from_env else "default",
        # vLLM draws a random seed per process for non-cryptographic hashes
        "random_seed": not seed_from_env and seed != kv_cache_utils.DEFAULT_NONE_HASH_SEED,
    }


class BrokerIndexManager(CPUOffloadingManager):  # type: ignore[misc]  # untyped here
    """vLLM's CPU offload manager with its index in the broker (module doc)."""

    def __init__(
        self, *, broker: str, pool: str, config: OffloadingConfig, spec: Any, **options: Any
    ) -> None:
        super().__init__(**options)
        self.broker, self.pool = broker, pool
        self._config, self._spec = config, spec
        self._chunks = int(options["num_chunks"])
        self.index: KVIndex | None = None
        self.lease: Lease | None = None
        self._pending: dict[OffloadKey, int] = {}
        self._opened = False

    # -- first use: lease the index and adopt ----------------------------------------
    def _open(self) -> None:
        if self._opened:
            return
        self._opened = True
        if self._chunks <= 0:
            return
        size = index_bytes(self._chunks)
        try:
            mine = identity(self._config, self._spec)
        except OSError as exc:  # a weight file it cannot read: no identity, nothing adopted
            logger.warning(
                "hostpool: no broker index for pool %s (the model's files: %s): this "
                "engine's host cache will not be adopted by the next one",
                self.pool,
                exc,
            )
            return
        try:
            self.lease = lease(self.broker, self.pool, memory=False, index_bytes=size)
        except HostPoolError as exc:  # serve on without an index: nothing kept, nothing wrong
            logger.warning(
                "hostpool: no broker index for pool %s (%s): this engine's host cache will "
                "not be adopted by the next one",
                self.pool,
                exc,
            )
            return
        assert self.lease.index is not None
        index, adoption = KVIndex.open(self.lease.index, self._chunks, mine)
        self.index = index
        adopted = self._adopt(adoption.records) if adoption.records else 0
        discarded = dict(adoption.discarded)
        if adoption.records and not adopted:
            discarded["identity"] = discarded.get("identity", 0) + len(adoption.records)
        self.lease.report(adopted, discarded, reason=adoption.reason, field_=adoption.field)
        logger.info(
            "hostpool: broker index of pool %s: adopted %d blocks%s%s",
            self.pool,
            adopted,
            f", discarded {discarded}" if discarded else "",
            f" ({adoption.reason}"
            + (f": field {adoption.field!r} differs" if adoption.field else "")
            + ")"
            if adoption.reason
            else "",
        )

    def _adopt(self, records: dict[int, bytes]) -> int:
        """Offer the records to the manager in chunk order; the number adopted (0, and the
        index cleared, if the manager did not hand out the recorded chunks)."""
        top = max(records) + 1
        keys = [OffloadKey(records.get(c, HOLE + c.to_bytes(8, "big"))) for c in range(top)]
        context = ReqContext(req_id="hostpool-adopt")
        out = super().prepare_store(keys, context)
        if out is None or [int(c) for c in out.store_spec.block_ids] != list(range(top)):
            if out is not None:
                super().complete_store(out.keys_to_store, context, success=False)
            logger.warning(
                "hostpool: broker index of pool %s: the manager did not hand out the recorded "
                "chunks in order (store_threshold?); adopting nothing",
                self.pool,
            )
            assert self.index is not None
            for chunk in records:
                self.index.clear(chunk)
            return 0
        real = [k for k in keys if not k.startswith(HOLE)]
        super().complete_store(real, context, success=True)
        super().complete_store([k for k in keys if k.startswith(HOLE)], context, success=False)
        return len(real)

    # -- the three writer steps ------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        self._open()
        return super().lookup(key, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._open()
        out = super().prepare_store(keys, req_context)
        if out is not None and self.index is not None:
            for key, chunk in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
                self.index.begin(int(chunk))
                self._pending[key] = int(chunk)
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        super().complete_store(keys, req_context, success)
        if self.index is None:
            return
        for key in keys:
            chunk = self._pending.pop(key, None)
            if chunk is None:
                continue
            if success:
                self.index.publish(chunk, bytes(key))
            else:
                self.index.clear(chunk)

    def reset_cache(self) -> None:
        super().reset_cache()
        self._pending.clear()
        if self.index is not None:
            for chunk in range(self._chunks):
                self.index.clear(chunk)
