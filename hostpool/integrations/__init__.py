"""Server integrations: hostpool stands in for a server's host-allocator entry points while
the server keeps its own pool assembly (`hostpool.integrations.sglang`,
`hostpool.integrations.vllm`).

Activation without code changes: `HOSTPOOL_INSTRUMENT=sglang,vllm` (a case-insensitive
comma list, read by the `.pth` hook the wheel installs, in every Python process) or
`hostpool run -- CMD`.
"""

from __future__ import annotations

import importlib
import os
import sys

ENV = "HOSTPOOL_INSTRUMENT"
# name -> module with install() / uninstall() / installed()
KNOWN = {"sglang": "hostpool.integrations.sglang", "vllm": "hostpool.integrations.vllm"}
_autoloaded = False


def requested(value: str | None = None) -> tuple[list[str], list[str]]:
    """The integrations `value` (default: HOSTPOOL_INSTRUMENT) names, as (known, unknown),
    each in the order given, lower-cased, without repeats."""
    raw = os.environ.get(ENV, "") if value is None else value
    known: list[str] = []
    unknown: list[str] = []
    for part in raw.split(","):
        name = part.strip().lower()
        if not name or name in known or name in unknown:
            continue
        (known if name in KNOWN else unknown).append(name)
    return known, unknown


def autoload() -> None:
    """Called by the `.pth` hook when HOSTPOOL_INSTRUMENT is set: install what it names.
    An unknown name is one line on stderr naming the known ones (never an exception: a
    typo must not stop the server, and must not pass in silence either). Each
    instrumented process says so in one `hostpool.instrumented` info event. Once per
    process: some interpreters process a site directory's `.pth` files twice."""
    global _autoloaded
    if _autoloaded:
        return
    _autoloaded = True
    known, unknown = requested()
    if unknown:
        print(
            f"hostpool: {ENV} names unknown integration(s) {', '.join(unknown)}; "
            f"known: {', '.join(KNOWN)} (ignored)",
            file=sys.stderr,
        )
    for name in known:
        importlib.import_module(KNOWN[name]).install()
    if known:
        from hostpool.base import events

        events.info("hostpool.instrumented", integrations=",".join(known), pid=os.getpid())
