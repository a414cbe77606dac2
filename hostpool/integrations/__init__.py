"""Server integrations: hostpool stands in for a server's host-allocator entry points while
the server keeps its own pool assembly (`hostpool.integrations.sglang`).

Activation without code changes: `HOSTPOOL_INSTRUMENT=sglang` (read by the `.pth` hook the
wheel installs, in every Python process) or `hostpool run -- CMD`.
"""

from __future__ import annotations

import os

ENV = "HOSTPOOL_INSTRUMENT"


def autoload() -> None:
    """Called by the `.pth` hook when HOSTPOOL_INSTRUMENT is set: install what it names."""
    wanted = {part.strip() for part in os.environ.get(ENV, "").split(",")}
    if "sglang" in wanted:
        from hostpool.integrations import sglang

        sglang.install()
