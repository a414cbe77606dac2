"""What a model directory's weights are, for an engine's identity key: a restarted engine
adopts KV blocks only when it computes KV from the same weights (docs/broker.md).

`weights_digest(model)` is a SHA-256 over the directory's weight files (`*.safetensors`,
`*.bin`, `*.pt`, `*.pth`, `*.gguf`, sorted by relative path; the model's config is a field
of its own), each named by what is known of its content without reading gigabytes:

- a file that resolves into a Hugging Face cache's `blobs/` directory (a snapshot's
  symlink, as `huggingface_hub` lays them out) is its blob's name: the SHA-256 of its
  content for LFS files, so a new revision is a new digest;
- any other file is its size, its mtime in nanoseconds and the SHA-256 of its first and
  last MiB (a safetensors header, and values a fine-tune changes everywhere).

A model that is not a local directory (a hub id) has no digest: None, and the identity
key then names the model only (docs/broker.md says what that trusts). An unreadable
weight file is an OSError: the caller adopts nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES: Final = 1 << 20


def weights_digest(model: str) -> str | None:
    """The digest of `model`'s weight files; None if it is not a directory."""
    root = Path(model)
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.name.endswith(WEIGHT_SUFFIXES)):
        relative = path.relative_to(root).as_posix()
        digest.update(relative.encode() + b"\0" + file_identity(path).encode() + b"\n")
    return digest.hexdigest()


def file_identity(path: Path) -> str:
    """One weight file's content identity (the module's rules)."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs":
        return f"blob:{real.name}"
    st = real.stat()
    sample = hashlib.sha256()
    with open(real, "rb") as f:
        sample.update(f.read(SAMPLE_BYTES))
        if st.st_size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, st.st_size - SAMPLE_BYTES))
            sample.update(f.read(SAMPLE_BYTES))
    return f"file:{st.st_size}:{st.st_mtime_ns}:{sample.hexdigest()}"
