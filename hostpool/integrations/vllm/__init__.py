"""vLLM on hostpool, with no change to vLLM's source. Two ways in:

- `HostpoolOffloadingSpec` (`spec.py`), loaded by vLLM's own `kv_connector_extra_config`
  (`spec_module_path="hostpool.integrations.vllm"`, `spec_name="HostpoolOffloadingSpec"`)
  for the `OffloadingConnector`: the CPU offload memory is a hostpool memfd pool.
- `install()` / `uninstall()` (`instrument.py`; or `HOSTPOOL_INSTRUMENT=vllm`): vLLM's
  own offload region is recorded in the ledger by identity and released at `cleanup()`.

Importing this package imports nothing of vLLM: the spec class is built on first access.
"""

from __future__ import annotations

from typing import Any

from hostpool.integrations.vllm.instrument import install, installed, uninstall

__all__ = ["HostpoolOffloadingSpec", "install", "installed", "uninstall"]


def __getattr__(name: str) -> Any:
    if name == "HostpoolOffloadingSpec":
        from hostpool.integrations.vllm.spec import HostpoolOffloadingSpec

        return HostpoolOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
