"""The weights' part of an engine's identity key (hostpool.broker.modelfiles): equal for
the same files, different for another revision, a fine-tune of the same shapes, or an
added shard; content-addressed through a Hugging Face cache's blobs; None for a hub id."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from hostpool.broker.modelfiles import SAMPLE_BYTES, weights_digest


def _model(root: Path, shards: dict[str, bytes]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 128}')
    (root / "tokenizer.json").write_text("{}")  # not a weight file: not in the digest
    for name, data in shards.items():
        (root / name).write_bytes(data)
    return root


def _hf_snapshot(cache: Path, revision: str, blobs: dict[str, bytes]) -> Path:
    """A model as huggingface_hub caches it: snapshots/<rev>/<file> -> ../../blobs/<sha>."""
    snapshot = cache / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (cache / "blobs").mkdir(exist_ok=True)
    for name, data in blobs.items():
        sha = hashlib.sha256(data).hexdigest()
        (cache / "blobs" / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snapshot / name)
    return snapshot


def test_the_same_files_give_the_same_digest(tmp_path: Path) -> None:
    weights = {"model-00001.safetensors": b"a" * 3 * SAMPLE_BYTES, "extra.bin": b"b" * 10}
    model = _model(tmp_path / "m", weights)
    first = weights_digest(str(model))
    assert first is not None and first == weights_digest(str(model))
    (model / "tokenizer.json").write_text('{"changed": true}')
    assert weights_digest(str(model)) == first


def test_a_fine_tune_of_the_same_shapes_is_another_digest(tmp_path: Path) -> None:
    size = 3 * SAMPLE_BYTES
    base = _model(tmp_path / "base", {"model.safetensors": b"\1" * size})
    tuned = _model(tmp_path / "tuned", {"model.safetensors": b"\1" * (size - 1) + b"\2"})
    st = (base / "model.safetensors").stat()
    # copied with its times (cp -a): same size, same mtime, other values
    os.utime(tuned / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_digest(str(base)) != weights_digest(str(tuned))


def test_an_added_shard_is_another_digest(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", {"model-00001.safetensors": b"x" * 100})
    before = weights_digest(str(model))
    (model / "model-00002.safetensors").write_bytes(b"y" * 100)
    assert weights_digest(str(model)) != before


def test_a_hugging_face_snapshot_is_named_by_its_blobs(tmp_path: Path) -> None:
    cache = tmp_path / "models--org--tiny"
    one = _hf_snapshot(cache, "rev1", {"model.safetensors": b"v1" * 1000})
    two = _hf_snapshot(cache, "rev2", {"model.safetensors": b"v2" * 1000})
    same = _hf_snapshot(cache, "rev3", {"model.safetensors": b"v1" * 1000})
    assert weights_digest(str(one)) != weights_digest(str(two))
    # a new snapshot of the same blob: the same weights, whatever the file's times
    assert weights_digest(str(one)) == weights_digest(str(same))


def test_a_hub_id_has_no_digest_and_an_unreadable_shard_is_an_error(tmp_path: Path) -> None:
    assert weights_digest("meta-llama/Llama-3.1-8B") is None
    model = _model(tmp_path / "m", {})
    os.symlink(tmp_path / "nowhere.safetensors", model / "model.safetensors")
    with pytest.raises(OSError):
        weights_digest(str(model))
