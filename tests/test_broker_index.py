"""The offload index in a broker-held metadata memfd (hostpool.broker.index): a record is
adopted only after its store completed, under the same identity, and never for a chunk a
writer was overwriting when it died (a real process killed with SIGKILL)."""

from __future__ import annotations

import mmap
import os
import signal
import struct

import pytest

from hostpool.broker import index
from hostpool.broker.index import KVIndex, differing_field, index_bytes, valid_records
from hostpool.memory.shm import create_memfd, size_and_seal

IDENTITY = {
    "engine": "vllm",
    "engine_version": "0.32.0",
    "model": "tiny",
    "model_config_digest": "abc",
    "dtype": "bfloat16",
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "tp_rank": 0,
    "tp_size": 1,
    "hash_algo": "sha256",
    "hash_seed": "0",
    "random_seed": False,
}
CAPACITY = 32


def key(n: int) -> bytes:
    return n.to_bytes(32, "big") + (0).to_bytes(4, "big")


@pytest.fixture
def memfd() -> mmap.mmap:
    """The index's memory as the broker makes it: a sealed memfd, mapped shared."""
    shm = create_memfd("hostpool.test-index")
    size_and_seal(shm, index_bytes(CAPACITY), seal=True)
    mm = mmap.mmap(shm.fd, index_bytes(CAPACITY), flags=mmap.MAP_SHARED)
    os.close(shm.fd)
    yield mm
    mm.close()


def reopen(mm: mmap.mmap, identity: dict[str, object] = IDENTITY) -> index.Adoption:
    idx, adoption = KVIndex.open(mm, CAPACITY, identity)
    idx.release()
    return adoption


def test_only_completed_stores_are_adopted(memfd: mmap.mmap) -> None:
    idx, fresh = KVIndex.open(memfd, CAPACITY, IDENTITY)
    assert fresh.reason == "fresh" and fresh.records == {}
    for chunk in range(4):
        idx.begin(chunk)
    idx.publish(0, key(0))
    idx.publish(1, key(1))
    idx.begin(2)  # prepared, never completed (chunk 3 too)
    idx.release()
    adoption = reopen(memfd)
    assert adoption.reason is None
    assert adoption.records == {0: key(0), 1: key(1)}
    assert adoption.discarded == {"unfinished": 2}
    assert valid_records(memfd) == 2
    # the unfinished ones were cleared at adoption: a second start finds them gone
    assert reopen(memfd).discarded == {}


def test_reuse_bumps_the_generation_and_hides_the_old_key(memfd: mmap.mmap) -> None:
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    g1 = idx.begin(5)
    idx.publish(5, key(1))
    g2 = idx.begin(5)  # the chunk is reused for another key: its old key is gone now
    assert g2 == g1 + 1 and idx.state(5) == (g2, index.WRITING)
    idx.release()
    assert reopen(memfd).records == {}
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    g3 = idx.begin(5)
    assert g3 == g2 + 1  # generations never repeat, also across a restart
    idx.publish(5, key(2))
    idx.release()
    assert reopen(memfd).records == {5: key(2)}


def test_a_failed_store_and_publish_without_begin(memfd: mmap.mmap) -> None:
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    idx.begin(1)
    idx.clear(1)  # complete_store(success=False)
    with pytest.raises(index.IndexFormatError, match="without begin"):
        idx.publish(1, key(1))
    with pytest.raises(index.IndexFormatError, match="exceeds"):
        idx.begin(2)
        idx.publish(2, b"x" * 65)
    with pytest.raises(index.IndexFormatError, match="outside"):
        idx.begin(CAPACITY)
    idx.release()
    assert reopen(memfd).records == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 32), ("model_config_digest", "def"), ("dtype", "float16"), ("tp_rank", 1)],
)
def test_another_identity_adopts_nothing_naming_the_field(
    memfd: mmap.mmap, field: str, value: object
) -> None:
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    for chunk in range(3):
        idx.begin(chunk)
        idx.publish(chunk, key(chunk))
    idx.release()
    adoption = reopen(memfd, {**IDENTITY, field: value})
    assert adoption.records == {}
    assert adoption.reason == "identity" and adoption.field == field
    assert adoption.discarded == {"identity": 3}
    assert adoption.recorded == IDENTITY
    # fail closed for good: the index now records the new identity, and the old records
    # are gone even for an engine of the old identity
    again = reopen(memfd, IDENTITY)
    assert again.records == {} and again.field == field


def test_a_field_only_one_side_has_is_named() -> None:
    assert differing_field(IDENTITY, {**IDENTITY, "layout": "x"}) == "layout"
    assert differing_field({**IDENTITY, "pp_size": 1}, IDENTITY) == "pp_size"


def test_a_random_seed_adopts_nothing(memfd: mmap.mmap) -> None:
    random = {**IDENTITY, "random_seed": True, "hash_seed": None}
    idx, _ = KVIndex.open(memfd, CAPACITY, random)
    idx.begin(0)
    idx.publish(0, key(0))
    idx.release()
    adoption = reopen(memfd, random)
    assert adoption.records == {} and adoption.reason == "random_seed"
    assert adoption.discarded == {"random_seed": 1}


def test_a_torn_record_is_ignored(memfd: mmap.mmap) -> None:
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    for chunk in (0, 1):
        idx.begin(chunk)
        idx.publish(chunk, key(chunk))
    idx.release()
    at = index.HEADER_BYTES + 1 * index.record_bytes() + 24  # chunk 1's key
    memfd[at + 31] ^= 0xFF  # a stray write into the key
    adoption = reopen(memfd)
    assert adoption.records == {0: key(0)}
    assert adoption.discarded == {"torn": 1}


def test_another_capacity_adopts_nothing(memfd: mmap.mmap) -> None:
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    idx.begin(0)
    idx.publish(0, key(0))
    idx.release()
    idx, adoption = KVIndex.open(memfd, CAPACITY // 2, IDENTITY)
    idx.release()
    assert adoption.reason == "layout" and adoption.discarded == {"resized": 1}


def test_a_writer_killed_mid_store_leaves_nothing_to_adopt(memfd: mmap.mmap) -> None:
    """A real writer: publishes chunk 0, begins chunk 1 (a reuse of a published chunk),
    writes half of its data, then dies by SIGKILL before the store completes. The next
    engine adopts chunk 0 only."""
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    idx.begin(1)
    idx.publish(1, key(100))  # chunk 1 held key 100 before the crash
    idx.release()
    data = mmap.mmap(-1, 4096)  # the "KV chunk" the store writes, shared with the child
    pid = os.fork()
    if pid == 0:
        child, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
        child.begin(0)
        child.publish(0, key(0))
        child.begin(1)  # prepare_store: the chunk is about to be overwritten
        data[:2048] = b"\xee" * 2048  # half the copy done
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert data[:1] == b"\xee"  # the child did die mid-copy
    adoption = reopen(memfd)
    assert adoption.records == {0: key(0)}  # key 100 is never adopted for chunk 1
    assert adoption.discarded == {"unfinished": 1}
    data.close()


def test_a_header_half_written_is_no_header(memfd: mmap.mmap) -> None:
    idx, _ = KVIndex.open(memfd, CAPACITY, IDENTITY)
    idx.begin(0)
    idx.publish(0, key(0))
    idx.release()
    struct.pack_into("8s", memfd, 0, b"\0" * 8)  # as a writer killed inside _reset leaves it
    assert reopen(memfd).reason == "fresh"
    assert valid_records(memfd) == 0
