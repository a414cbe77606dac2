"""Zero-copy pool sharing with another process over a Unix socket."""

from hostpool.share.client import AttachedPool, attach
from hostpool.share.server import PoolShareServer

__all__ = ["AttachedPool", "PoolShareServer", "attach"]
