"""What a host tensor request must be: dims of positive ints, a torch dtype that can live
in a host buffer, at most MAX_REQUEST_BYTES, on the CPU."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hostpool.errors import InvalidRequestError

# Anything past this is a typo or an overflow, not a KV cache (64 TiB).
MAX_REQUEST_BYTES = 1 << 46

_UNSUPPORTED_DTYPES = {
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
}


def request_bytes(dims: object, dtype: object) -> tuple[tuple[int, ...], int]:
    """Validate (dims, dtype) and return (dims as a tuple, bytes)."""
    if type(dims) is not tuple:  # the common case skips the ABC checks below
        if isinstance(dims, int) and not isinstance(dims, bool):
            dims = (dims,)
        elif isinstance(dims, torch.Size | list):
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
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype in _UNSUPPORTED_DTYPES:
        raise InvalidRequestError(f"dtype {dtype} cannot live in a host pool buffer")
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes > MAX_REQUEST_BYTES:
        raise InvalidRequestError(
            f"request of {nbytes} bytes for dims {tuple(dims)} and {dtype} is beyond any host "
            f"({MAX_REQUEST_BYTES} bytes max): check the dims"
        )
    return tuple(dims), nbytes


def check_device(device: object) -> None:
    if device == "cpu":
        return
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
