"""The buffer a region's tensors are built over: a ctypes array over the mapping (or over
memory torch or another allocator owns), and tensors over it that keep it alive."""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any


@functools.lru_cache(maxsize=512)
def holder_type(nbytes: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    """The ctypes array type of a region's holder of `nbytes` bytes. It carries a
    `__dict__`, so a holder over memory torch or another allocator owns can keep that
    memory's owner alive (`holder._owner = tensor`)."""
    return type("RegionBuffer", (ctypes.c_ubyte * nbytes,), {})


def tensor_over(holder: Any, dims: tuple[int, ...], dtype: Any) -> Any:
    """A tensor of `dims`/`dtype` over a Region's holder (the tensor keeps it alive)."""
    import torch

    count = math.prod(dims)
    if count == 0:
        return torch.frombuffer(holder, dtype=dtype, count=1)[:0].reshape(dims)
    return torch.frombuffer(holder, dtype=dtype, count=count).reshape(dims)
