"""Import the real sglang 0.5.23 host-pool modules on a CPU-only torch.

sglang imports `torchvision.transforms` (and `InterpolationMode`) at import time through
pool_host -> group -> memory_pool -> configs -> multimodal; every torchvision wheel links
libtorch_cuda and cannot load beside the CPU torch. transformers probes torchvision's
availability when it is first imported, so the stand-ins go into `sys.modules` only after
`import transformers` (a stand-in package on sys.path would make transformers believe
torchvision is there). Test support only: the library never does this.
"""

from __future__ import annotations

import enum
import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SGLANG_VERSION = "0.5.23"
# The modules that import sglang's allocator entry points by name.
HOST_POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.unified",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4",
    "sglang.srt.mem_cache.memory_pool_host",
)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _module(name: str, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    sys.modules[name] = mod
    return mod


def install_torchvision_stand_in() -> None:
    """Put the torchvision names sglang imports at import time into sys.modules."""
    import transformers  # noqa: F401  (probes torchvision before the stand-in exists)

    if "torchvision" in sys.modules:
        return
    vision = _module("torchvision", package=True)
    transforms = _module("torchvision.transforms", package=True)
    functional = _module("torchvision.transforms.functional")
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    vision.transforms = transforms  # type: ignore[attr-defined]


def load_sglang() -> Any:
    """The real `sglang.srt.mem_cache.memory_pool_host` module (pinned sglang 0.5.23)."""
    install_torchvision_stand_in()
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"tests expect sglang {SGLANG_VERSION}, found {sglang.__version__}")
    for name in HOST_POOL_MODULES:
        importlib.import_module(name)
    return importlib.import_module("sglang.srt.mem_cache.memory_pool_host")


@contextmanager
def integration_installed() -> Iterator[None]:
    """The real sglang loaded (load_sglang) with hostpool's integration installed; at the
    end the integration is uninstalled again unless it was installed before."""
    # imported here: scripts that take only the stand-ins from this module (launch_with_standin)
    # keep the import order they had, hostpool's integration first imported by whoever runs them
    from hostpool.integrations import sglang as integration

    was = integration.installed()
    load_sglang()
    integration.install()
    try:
        yield
    finally:
        if not was:
            integration.uninstall()
