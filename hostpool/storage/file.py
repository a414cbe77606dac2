"""`file`: pages stored as files in one directory.

- Keys are arbitrary strings (token-prefix hashes, possibly with `/`); file names are
  sha256 of key + rank suffix, so no key can escape the directory or collide with a
  temporary file.
- Writes are atomic: a temporary file in the same directory, written, fsync'd, then
  `os.replace`d over the final name. A reader sees a whole page or none; a crash leaves a
  stray `.tmp` that `clear()` removes.
- As in sglang, an existing key is not rewritten: keys name content.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from typing import Any

import torch

from hostpool import events
from hostpool.errors import ConfigError
from hostpool.storage.base import HiCacheStorage, HiCacheStorageConfig

DEFAULT_DIR = "/tmp/hicache"
ENV_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # sglang's variable, honoured as-is
_OURS = re.compile(r"[0-9a-f]{64}\.bin|\.[0-9a-f]{64}\.[0-9a-f]{12}\.tmp")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


class HiCacheFile(HiCacheStorage):
    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        mem_pool_host: Any | None = None,
        *,
        file_path: str | None = None,
        fsync: bool = True,
    ) -> None:
        config = storage_config or HiCacheStorageConfig()
        extra = config.extra_config or {}
        path = file_path or extra.get("file_path") or os.environ.get(ENV_DIR) or DEFAULT_DIR
        if not isinstance(path, str):
            raise ConfigError(f"file backend: file_path must be a string, got {path!r}")
        self.file_path = path
        self.fsync = fsync
        self.mem_pool_host = mem_pool_host
        model = "-".join((config.model_name or "").split("/"))
        # MLA caches are identical across TP ranks; MHA ranks each hold their heads.
        if config.is_mla_model:
            self.config_suffix = f"_{model}"
        else:
            self.config_suffix = f"_{model}_{config.tp_rank}_{config.tp_size}"
        try:
            os.makedirs(self.file_path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"file backend: cannot create {self.file_path}: {exc.strerror}"
            ) from exc

    def path_of(self, key: str) -> str:
        digest = hashlib.sha256((key + self.config_suffix).encode()).hexdigest()
        return os.path.join(self.file_path, digest + ".bin")

    # -- reads -----------------------------------------------------------------------
    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if target_location is None:
                out = torch.empty(size, dtype=torch.uint8)
                return out if _read_into(fd, _bytes_of(out)) else None
            if not isinstance(target_location, torch.Tensor):
                raise TypeError(f"target_location must be a tensor, got {target_location!r}")
            expected = target_location.numel() * target_location.element_size()
            if size != expected:
                events.warning(
                    "hostpool.storage.size_mismatch", key=key, stored=size, expected=expected
                )
                return None
            if target_location.is_contiguous():
                view = _bytes_of(target_location)
                return target_location if _read_into(fd, view) else None
            staging = torch.empty(size, dtype=torch.uint8)
            if not _read_into(fd, _bytes_of(staging)):
                return None
            restored = staging.view(target_location.dtype).reshape(target_location.shape)
            target_location.copy_(restored)
            return target_location
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path_of(key))

    # -- writes ----------------------------------------------------------------------
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if self.exists(key):
            return True
        if not isinstance(value, torch.Tensor):
            events.warning("hostpool.storage.bad_value", key=key, type=type(value).__name__)
            return False
        final = self.path_of(key)
        directory, name = os.path.split(final)
        tmp = os.path.join(directory, f".{name[:-4]}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            events.warning("hostpool.storage.write_failed", key=key, error=str(exc))
            return False
        try:
            _write_all(fd, _bytes_of(value.detach().contiguous()))
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(tmp)
            events.warning("hostpool.storage.write_failed", key=key, error=str(exc))
            return False
        return True

    def clear(self) -> bool:
        """Remove this backend's pages and stray temporaries; other files are left alone."""
        try:
            names = os.listdir(self.file_path)
        except OSError:
            return False
        for name in names:
            if _OURS.fullmatch(name):
                _unlink_quietly(os.path.join(self.file_path, name))
        return True


def _read_into(fd: int, view: memoryview) -> bool:
    """Fill `view` from `fd`; False on a short file (truncated by someone else)."""
    done = 0
    while done < len(view):
        n = os.readv(fd, [view[done:]])
        if n == 0:
            return False
        done += n
    return True


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
