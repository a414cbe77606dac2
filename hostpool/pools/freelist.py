"""Slot free-list of a host pool: whole pages out, slots back, every misuse refused.

sglang's host pools keep a bare tensor of free slots: freeing a slot twice, or one that
was never handed out, silently duplicates it and two requests later share a page. Here
each slot has an allocated bit, so double alloc, double free and foreign slots are
InvalidRequestError and the free-list is unchanged by a refused call.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

import torch

from hostpool.errors import InvalidRequestError


class SlotFreeList:
    """Free slots of a pool of `size` slots in pages of `page_size` slots."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        for name, value in (("size", size), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive int, got {value!r}")
        if size % page_size:
            raise InvalidRequestError(
                f"size {size} is not a whole number of {page_size}-slot pages"
            )
        self.size = size
        self.page_size = page_size
        self._lock = threading.Lock()
        self._allocated = torch.zeros(size, dtype=torch.bool)
        self._free_pages: collections.deque[int] = collections.deque(range(size // page_size))

    def available_size(self) -> int:
        with self._lock:
            return len(self._free_pages) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (whole pages), or None when the pool has fewer free."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size <= 0:
            raise InvalidRequestError(f"need_size must be a positive int, got {need_size!r}")
        if need_size % self.page_size:
            raise InvalidRequestError(
                f"need_size {need_size} is not a multiple of the page size {self.page_size}"
            )
        pages = need_size // self.page_size
        with self._lock:
            if pages > len(self._free_pages):
                return None
            taken = torch.tensor([self._free_pages.popleft() for _ in range(pages)])
            slots = (taken[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
            self._allocated[slots] = True
        return slots

    def alloc_slots(self, slots: torch.Tensor | Iterable[int]) -> torch.Tensor:
        """Claim these whole pages (a restore that must land where it was): refused if any
        slot is already allocated, out of range, repeated, or not a whole free page."""
        idx = self._indices(slots)
        with self._lock:
            taken = idx[self._allocated[idx]]
            if taken.numel():
                raise InvalidRequestError(
                    f"double alloc: slots {_head(taken)} are already allocated"
                )
            pages = torch.unique(idx // self.page_size)
            if pages.numel() * self.page_size != idx.numel():
                raise InvalidRequestError(
                    f"alloc_slots takes whole pages of {self.page_size} slots; got {idx.numel()} "
                    f"slots over {pages.numel()} page(s)"
                )
            wanted = set(pages.tolist())
            self._free_pages = collections.deque(p for p in self._free_pages if p not in wanted)
            self._allocated[idx] = True
        return idx

    def free(self, indices: torch.Tensor | Iterable[int]) -> int:
        """Return slots; a page is reusable once all its slots are back. Returns the count."""
        idx = self._indices(indices)
        with self._lock:
            not_out = idx[~self._allocated[idx]]
            if not_out.numel():
                raise InvalidRequestError(f"double free: slots {_head(not_out)} are not allocated")
            self._allocated[idx] = False
            pages = torch.unique(idx // self.page_size)
            whole = ~self._allocated.view(-1, self.page_size)[pages].any(dim=1)
            self._free_pages.extend(pages[whole].tolist())
        return int(idx.numel())

    def clear(self) -> None:
        with self._lock:
            self._allocated.zero_()
            self._free_pages = collections.deque(range(self.size // self.page_size))

    def _indices(self, indices: torch.Tensor | Iterable[int]) -> torch.Tensor:
        if not isinstance(indices, torch.Tensor):
            indices = list(indices)
            if not indices:
                return torch.empty(0, dtype=torch.int64)
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise InvalidRequestError(f"slot indices must be integers, got {idx.dtype}")
        idx = idx.reshape(-1).to(torch.int64)
        if idx.numel() == 0:
            return idx
        foreign = idx[(idx < 0) | (idx >= self.size)]
        if foreign.numel():
            raise InvalidRequestError(
                f"foreign slots {_head(foreign)}: this pool has slots 0..{self.size - 1}"
            )
        if torch.unique(idx).numel() != idx.numel():
            raise InvalidRequestError("slot indices repeat within one call")
        return idx


def _head(t: torch.Tensor, n: int = 8) -> str:
    values = t.tolist()
    return str(values[:n])[:-1] + (", ...]" if len(values) > n else "]")
