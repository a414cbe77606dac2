"""What a host memory request must be: dims of positive ints, at most MAX_REQUEST_BYTES;
for a tensor, a torch dtype that can live in a host buffer, on the CPU. Only the tensor
checks import torch (hostpool never installs it: `hostpool._lazy.require_torch`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from hostpool._lazy import require_torch
from hostpool.errors import InvalidRequestError

# Anything past this is a typo or an overflow, not a KV cache (64 TiB).
MAX_REQUEST_BYTES = 1 << 46

_QUANTIZED_DTYPES = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")


def request_bytes(dims: object, dtype: object) -> tuple[tuple[int, ...], int]:
    """Validate (dims, dtype) and return (dims as a tuple, bytes). Raises
    TorchUnavailableError without torch (a dtype is torch's)."""
    torch = require_torch("a host tensor (dims and a torch dtype)")
    shape = request_dims(dims)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype in _quantized_dtypes(torch):
        raise InvalidRequestError(f"dtype {dtype} cannot live in a host pool buffer")
    return shape, _within_limit(math.prod(shape) * dtype.itemsize, f"dims {shape} and {dtype}")


@functools.cache
def _quantized_dtypes(torch: Any) -> frozenset[Any]:
    return frozenset(getattr(torch, n) for n in _QUANTIZED_DTYPES if hasattr(torch, n))


def buffer_bytes(nbytes: object) -> int:
    """Validate a byte count for a buffer (no torch): a positive int, at most
    MAX_REQUEST_BYTES."""
    (n,) = request_dims((nbytes,))
    return _within_limit(n, f"{n} bytes")


def _within_limit(nbytes: int, what: str) -> int:
    if nbytes > MAX_REQUEST_BYTES:
        raise InvalidRequestError(
            f"request of {nbytes} bytes for {what} is beyond any host "
            f"({MAX_REQUEST_BYTES} bytes max): check the dims"
        )
    return nbytes


def request_dims(dims: object) -> tuple[int, ...]:
    """Validate dims (an int, or a non-empty sequence of positive ints: a tuple, a list,
    a torch.Size) and return them as a tuple."""
    if type(dims) is not tuple:  # the common case skips the ABC checks below
        if isinstance(dims, int) and not isinstance(dims, bool):
            dims = (dims,)
        elif isinstance(dims, list):
            dims = tuple(dims)
        elif not isinstance(dims, Sequence) or isinstance(dims, str | bytes):
            raise InvalidRequestError(
                f"dims must be a non-empty sequence of positive ints, got {dims!r}"
            )
    if len(dims) == 0:
        raise InvalidRequestError(
            f"dims must be a non-empty sequence of positive ints, got {dims!r}"
        )
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise InvalidRequestError(
                f"every dim must be a positive int (not bool, float or <= 0); got {dims!r}"
            )
    return tuple(dims)


def check_device(device: object) -> None:
    """InvalidRequestError unless `device` is the CPU (torch parses any other spelling)."""
    if device == "cpu":
        return
    torch = require_torch("a device other than 'cpu'")
    if isinstance(device, str | torch.device):
        try:
            if torch.device(device).type == "cpu":
                return
        except RuntimeError:
            pass
    raise InvalidRequestError(
        f"host pool allocators only make CPU tensors; got device={device!r} "
        "(copy to the GPU from the host pool instead)"
    )
