"""The one seam between hostpool and the CUDA runtime: page-locking host ranges.

`cudaHostRegister` is called per chunk (`pin_chunk_bytes`, aligned to the region's page)
so one huge call does not stall the driver, and a failure at chunk k rolls back chunks
k-1..0 in reverse. Tests install a fake runtime with `set_runtime`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Protocol

from hostpool.base.units import page_spans


class CudaRuntime(Protocol):
    def available(self) -> bool: ...

    def host_register(self, address: int, length: int) -> None:
        """Page-lock [address, address+length); raise RuntimeError on failure."""

    def host_unregister(self, address: int) -> None:
        """Undo a host_register made at `address`."""


class TorchCudaRuntime:
    """cudaHostRegister through torch's bundled cudart (no extra dependency)."""

    def available(self) -> bool:
        """Whether torch is installed, built with CUDA, and sees a device. Where torch is
        first imported here (`hostpool doctor`), its warning about a missing NumPy, which
        it never needs for this, is not printed."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
                import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())

    def host_register(self, address: int, length: int) -> None:
        import torch

        # cudaHostRegisterDefault = 0; cudaSuccess = 0.
        rc = torch.cuda.cudart().cudaHostRegister(address, length, 0)  # type: ignore[no-untyped-call]
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister({address:#x}, {length}) failed: {rc}")

    def host_unregister(self, address: int) -> None:
        import torch

        rc = torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostUnregister({address:#x}) failed: {rc}")


_lock = threading.Lock()
_runtime: CudaRuntime = TorchCudaRuntime()


def get_runtime() -> CudaRuntime:
    return _runtime


def set_runtime(runtime: CudaRuntime) -> CudaRuntime:
    """Install a runtime (a fake in tests); returns the previous one."""
    global _runtime
    with _lock:
        previous, _runtime = _runtime, runtime
    return previous


def pin(
    runtime: CudaRuntime, address: int, length: int, chunk: int, page_size: int
) -> list[tuple[int, int]]:
    """Register every chunk or none: on failure at chunk k, unregister k-1..0 and re-raise."""
    done: list[tuple[int, int]] = []
    try:
        for start, n in page_spans(address, length, chunk, page_size):
            runtime.host_register(start, n)
            done.append((start, n))
    except BaseException:
        unpin(runtime, done)
        raise
    return done


def unpin(runtime: CudaRuntime, chunks: list[tuple[int, int]]) -> None:
    """Unregister in reverse order; keep going past a failure so no chunk stays locked."""
    first_error: BaseException | None = None
    while chunks:
        start, _ = chunks.pop()
        try:
            runtime.host_unregister(start)
        except Exception as exc:  # a dead context must not leave the rest registered
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
