"""OS layer: shared memory, mappings, populate, hugepages, seals, pinning. No policy."""

from hostpool.base.units import format_size, parse_size
from hostpool.memory.create import create_region
from hostpool.memory.holders import tensor_over
from hostpool.memory.hugepages import plan_hugepages
from hostpool.memory.options import RegionOptions
from hostpool.memory.region import Region

__all__ = [
    "Region",
    "RegionOptions",
    "create_region",
    "format_size",
    "parse_size",
    "plan_hugepages",
    "tensor_over",
]
