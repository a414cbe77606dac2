"""The offload index an engine keeps across its restart: the broker-held metadata memfd.

A KV offload tier remembers which key each chunk of its host memory holds (vLLM: its
`OffloadKey` -> CPU chunk). The memory outlives the engine (the broker holds it), so the
index must too, and a restarted engine must adopt only what is certainly there:

- a record is VALID only after its store completed (`publish`, from the manager's
  `complete_store`); while a chunk is being written it is WRITING (`begin`, from
  `prepare_store`, before any byte is copied), with its generation bumped: an engine that
  dies mid-store leaves WRITING, never adopted;
- every record carries a CRC-32 of (chunk, generation, key): a record torn by a stray
  write is ignored (counted `torn`);
- the header carries the engine's identity key (engine, version, model, dtypes, block
  size, layout, ranks, hash seed...) as canonical JSON and its SHA-256: a restarted
  engine adopts only when its identity's digest equals the recorded one (fail closed:
  `Adoption.field` names the first field that differs), and only when its prefix-hash
  seed is reproducible (an identity with `random_seed` true adopts nothing).

Layout (little-endian), sized by `index_bytes(capacity)`:

    header (HEADER_BYTES): magic "HPKVIDX\\0", version u32, record_bytes u32,
      capacity u32, key_bytes u32, identity SHA-256 (32 bytes), identity JSON length u32,
      identity JSON (UTF-8, canonical: sorted keys, no spaces)
    records: capacity x record_bytes, record i for chunk i:
      generation u64, state u32 (0 empty, 1 writing, 2 valid), key length u32,
      crc32 u32, pad u32, key (key_bytes)

One writer (the engine's manager); no lock. Readers read only at adoption, when no
writer runs.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"HPKVIDX\0"
VERSION = 1
HEADER_BYTES = 8192
KEY_BYTES = 64  # vLLM's OffloadKey: a 32-byte block hash (sha256) + 4-byte group index
EMPTY, WRITING, VALID = 0, 1, 2
_HEAD = struct.Struct("<8sIIII32sI")
_REC = struct.Struct("<QIIII")
MAX_IDENTITY_JSON = HEADER_BYTES - _HEAD.size

Identity = Mapping[str, Any]


class IndexFormatError(ValueError):
    """A bad argument to the index (a key too long, a chunk out of range, an identity
    that does not fit the header)."""


def canonical(identity: Identity) -> bytes:
    return json.dumps(dict(identity), sort_keys=True, separators=(",", ":")).encode()


def digest(identity: Identity) -> bytes:
    return hashlib.sha256(canonical(identity)).digest()


def record_bytes(key_bytes: int = KEY_BYTES) -> int:
    return -(-(_REC.size + key_bytes) // 8) * 8


def index_bytes(capacity: int, key_bytes: int = KEY_BYTES) -> int:
    """The size of an index of `capacity` records, in whole pages."""
    raw = HEADER_BYTES + capacity * record_bytes(key_bytes)
    return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE


def differing_field(recorded: Identity, mine: Identity) -> str:
    """The first field (sorted) whose value differs, or is in only one of them."""
    for key in sorted(set(recorded) | set(mine)):
        if key not in recorded or key not in mine or recorded[key] != mine[key]:
            return key
    return "(none: same fields, different digest)"


@dataclass
class Adoption:
    """What opening an index found: the records adopted (chunk -> key), the records
    discarded by reason, and, when nothing could be adopted, why (`reason`) and which
    identity field differs (`field`, for `identity`)."""

    records: dict[int, bytes] = field(default_factory=dict)
    discarded: dict[str, int] = field(default_factory=dict)
    reason: str | None = None  # fresh, layout, identity, random_seed
    field: str | None = None
    recorded: dict[str, Any] | None = None  # the identity found in the header, if any


class KVIndex:
    """An index over a writable buffer of `index_bytes(capacity)` bytes (the metadata
    memfd's mapping). `KVIndex.open` adopts what the buffer holds, or starts it fresh."""

    def __init__(self, buffer: Any, capacity: int, key_bytes: int = KEY_BYTES) -> None:
        self.view = memoryview(buffer).cast("B")
        self.capacity = capacity
        self.key_bytes = key_bytes
        self.record_bytes = record_bytes(key_bytes)
        if len(self.view) < index_bytes(capacity, key_bytes):
            raise IndexFormatError(
                f"an index of {capacity} records needs {index_bytes(capacity, key_bytes)} "
                f"bytes, the buffer has {len(self.view)}"
            )

    @classmethod
    def open(
        cls, buffer: Any, capacity: int, identity: Identity, key_bytes: int = KEY_BYTES
    ) -> tuple[KVIndex, Adoption]:
        """Adopt every valid record of `buffer` if its header records `identity` (same
        digest, same layout) and the identity's seed is reproducible; otherwise discard
        every record and start it fresh under `identity`. Records found WRITING or torn
        are cleared either way."""
        index = cls(buffer, capacity, key_bytes)
        mine = canonical(identity)
        if len(mine) > MAX_IDENTITY_JSON:
            raise IndexFormatError(f"identity of {len(mine)} bytes exceeds {MAX_IDENTITY_JSON}")
        adoption = index._adopt(identity)
        if adoption.reason is not None:
            index._reset(identity)
        return index, adoption

    # -- adoption --------------------------------------------------------------------
    def _adopt(self, identity: Identity) -> Adoption:
        magic, version, rec_bytes, capacity, key_bytes, stored, length = _HEAD.unpack_from(
            self.view, 0
        )
        if magic != MAGIC:
            return Adoption(reason="fresh")
        fits = (len(self.view) - HEADER_BYTES) // self.record_bytes
        valid = self._scan(min(capacity, fits) if rec_bytes == self.record_bytes else 0)
        recorded: dict[str, Any] | None = None
        if length <= MAX_IDENTITY_JSON:
            try:
                recorded = json.loads(bytes(self.view[_HEAD.size : _HEAD.size + length]))
            except ValueError:
                recorded = None
        layout = (version, rec_bytes, capacity, key_bytes)
        if layout != (VERSION, self.record_bytes, self.capacity, self.key_bytes):
            count = sum(1 for state, _ in valid.values() if state == VALID)
            return Adoption(
                discarded={"resized": count} if count else {},
                reason="layout",
                field=f"layout {layout} != {(VERSION, self.record_bytes, self.capacity)}",
                recorded=recorded,
            )
        found = {c: k for c, (state, k) in valid.items() if state == VALID and k is not None}
        torn = sum(1 for state, k in valid.values() if state == VALID and k is None)
        unfinished = sum(1 for state, _ in valid.values() if state == WRITING)
        discarded = {r: n for r, n in (("torn", torn), ("unfinished", unfinished)) if n}
        if stored != digest(identity) or not isinstance(recorded, dict):
            if found:
                discarded["identity"] = len(found)
            return Adoption(
                discarded=discarded,
                reason="identity",
                field=differing_field(recorded or {}, identity),
                recorded=recorded,
            )
        if identity.get("random_seed"):
            if found:
                discarded["random_seed"] = len(found)
            return Adoption(discarded=discarded, reason="random_seed", recorded=recorded)
        for chunk, (state, _) in valid.items():
            if chunk not in found and state != EMPTY:
                self.clear(chunk)
        return Adoption(records=found, discarded=discarded, recorded=recorded)

    def _scan(self, capacity: int) -> dict[int, tuple[int, bytes | None]]:
        """chunk -> (state, key if the record checks out else None), non-empty ones."""
        out: dict[int, tuple[int, bytes | None]] = {}
        for chunk in range(capacity):
            at = HEADER_BYTES + chunk * self.record_bytes
            generation, state, length, crc, _ = _REC.unpack_from(self.view, at)
            if state == EMPTY:
                continue
            key: bytes | None = None
            if state == VALID and length <= self.key_bytes:
                raw = bytes(self.view[at + _REC.size : at + _REC.size + length])
                if _crc(chunk, generation, raw) == crc:
                    key = raw
            out[chunk] = (state if state in (WRITING, VALID) else VALID, key)
        return out

    def _reset(self, identity: Identity) -> None:
        """Every record empty (generations kept, so none repeats), then the header."""
        for chunk in range(self.capacity):
            self.clear(chunk)
        body = canonical(identity)
        _HEAD.pack_into(
            self.view,
            0,
            b"\0" * 8,  # the magic last: a header half written is no header
            VERSION,
            self.record_bytes,
            self.capacity,
            self.key_bytes,
            digest(identity),
            len(body),
        )
        self.view[_HEAD.size : _HEAD.size + len(body)] = body
        self.view[0:8] = MAGIC

    # -- the writer's three steps ----------------------------------------------------
    def _at(self, chunk: int) -> int:
        if not 0 <= chunk < self.capacity:
            raise IndexFormatError(f"chunk {chunk} outside 0..{self.capacity - 1}")
        return HEADER_BYTES + chunk * self.record_bytes

    def begin(self, chunk: int) -> int:
        """The chunk is about to be (over)written: WRITING first, then a new generation.
        Call before a byte of the chunk changes. Returns the generation."""
        at = self._at(chunk)
        struct.pack_into("<I", self.view, at + 8, WRITING)
        (generation,) = struct.unpack_from("<Q", self.view, at)
        generation += 1
        struct.pack_into("<Q", self.view, at, generation)
        return int(generation)

    def publish(self, chunk: int, key: bytes) -> None:
        """The chunk's store completed and it holds `key`: key and CRC, then VALID last.
        Only a chunk in WRITING (after `begin`) is published; anything else is a bug."""
        if len(key) > self.key_bytes:
            raise IndexFormatError(f"key of {len(key)} bytes exceeds {self.key_bytes}")
        at = self._at(chunk)
        generation, state, _, _, _ = _REC.unpack_from(self.view, at)
        if state != WRITING:
            raise IndexFormatError(f"chunk {chunk} published without begin (state {state})")
        self.view[at + _REC.size : at + _REC.size + len(key)] = key
        struct.pack_into("<II", self.view, at + 12, len(key), _crc(chunk, generation, key))
        struct.pack_into("<I", self.view, at + 8, VALID)

    def clear(self, chunk: int) -> None:
        """The chunk holds nothing (a failed store, an eviction with no new store)."""
        struct.pack_into("<I", self.view, self._at(chunk) + 8, EMPTY)

    def state(self, chunk: int) -> tuple[int, int]:
        """(generation, state) of a chunk's record."""
        generation, state, _, _, _ = _REC.unpack_from(self.view, self._at(chunk))
        return int(generation), int(state)

    def release(self) -> None:
        self.view.release()


def valid_records(buffer: Any) -> int:
    """How many records of an index buffer are valid by their own header (the broker's
    count when it discards an index whose size changed); 0 for no index."""
    view = memoryview(buffer).cast("B")
    try:
        if len(view) < HEADER_BYTES or bytes(view[:8]) != MAGIC:
            return 0
        _, _, rec_bytes, capacity, key_bytes, _, _ = _HEAD.unpack_from(view, 0)
        if rec_bytes != record_bytes(key_bytes) or HEADER_BYTES + capacity * rec_bytes > len(view):
            return 0
        index = KVIndex(view, capacity, key_bytes)
        try:
            return sum(1 for _, key in index._scan(capacity).values() if key is not None)
        finally:
            index.release()
    finally:
        view.release()


def _crc(chunk: int, generation: int, key: bytes) -> int:
    return zlib.crc32(struct.pack("<QQ", chunk, generation) + key)
