"""`HOSTPOOL_INSTRUMENT=vllm`: vLLM's own offload region recorded in the ledger.
(Placeholder: being written.)"""

from __future__ import annotations

_installed = False


def installed() -> bool:
    return _installed


def install() -> None:
    """Patch vLLM in this process (now and for modules imported later). Idempotent."""
    global _installed
    _installed = True


def uninstall() -> None:
    """Restore every patched attribute to vLLM's original."""
    global _installed
    _installed = False
