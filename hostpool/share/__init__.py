"""Zero-copy pool sharing with another process over a Unix socket.

Names load lazily (PEP 562): `hostpool serve --check` validates a share socket path
through `hostpool.share.socketpath` without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostpool._lazy import lazy_exports

__all__ = ["AttachedPool", "PoolShareServer", "attach"]
_EXPORTS = {
    "AttachedPool": "hostpool.share.client",
    "attach": "hostpool.share.client",
    "PoolShareServer": "hostpool.share.server",
}

if TYPE_CHECKING:
    from hostpool.share.client import AttachedPool, attach
    from hostpool.share.server import PoolShareServer

__getattr__, __dir__ = lazy_exports("hostpool.share", _EXPORTS, globals())
