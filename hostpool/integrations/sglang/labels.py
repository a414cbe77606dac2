"""Which hostpool pool an sglang allocation belongs to: sglang's free-text pool label,
found on the stack of the host pool being built, as a pool name."""

from __future__ import annotations

import re
import sys

from hostpool.integrations.sglang import internals

DEFAULT_POOL = "default"
_POOL_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_LABEL_DEPTH = 40  # frames searched for the host pool being built
# sglang's HostKVCache, once its module has loaded (set by the patching).
_host_pool_class: type | None = None


def remember_host_pool_class(cls: type | None) -> None:
    """Record sglang's host pool base class (`HostKVCache`) once its module loads."""
    global _host_pool_class
    _host_pool_class = cls


def host_pool_class() -> type | None:
    """sglang's host pool base class, None until its module has loaded."""
    return _host_pool_class


def pool_name(label: object) -> str:
    """sglang's free-text label as a hostpool pool name ([A-Za-z0-9_-]{1,64})."""
    cleaned = _POOL_CHARS.sub("_", str(label))[:64]
    return cleaned or DEFAULT_POOL


def _class_label(cls: type) -> str:
    name = cls.__name__
    for suffix in ("TokenToKVPoolHost", "PoolHost", "HostPool", "Host"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)].lower()
    return name.lower()


def _label_of(owner: object) -> str:
    state = getattr(owner, "__dict__", {})
    label = next((state[k] for k in internals.POOL_LABELS if state.get(k)), None)
    return pool_name(label) if label else pool_name(_class_label(type(owner)))


def current_pool(allocator: object | None = None) -> str:
    """The label of the sglang host pool being built on this thread's stack.

    sglang never hands the label to its allocator; the pool object is on the stack (it
    is building its buffers), so find it: the frame whose `self` holds `allocator`, else
    the nearest host pool.
    """
    frame = sys._getframe(1)
    fallback: object | None = None
    for _ in range(_LABEL_DEPTH):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        me = frame.f_locals.get("self")
        if me is None or me is allocator:
            continue
        state = getattr(me, "__dict__", None)
        if not isinstance(state, dict):
            continue
        if allocator is not None and state.get(internals.POOL_ALLOCATOR) is allocator:
            return _label_of(me)
        if fallback is None and (
            any(k in state for k in internals.POOL_LABELS)
            or (_host_pool_class is not None and isinstance(me, _host_pool_class))
        ):
            fallback = me
    return _label_of(fallback) if fallback is not None else DEFAULT_POOL
