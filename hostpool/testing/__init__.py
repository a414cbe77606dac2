"""Testing helpers: the shared-memory leak check and its pytest plugin.

`hostpool.testing.plugin` is registered as a pytest plugin (entry point `hostpool`): the
`hostpool_leak_check` fixture and marker, and the `hostpool_leak_check` /
`hostpool_leak_prefixes` ini options. Nothing here imports torch.
"""

from hostpool.testing.leakcheck import (
    DEFAULT_PREFIXES,
    Leak,
    LeakCheck,
    ShmLeakError,
    ShmState,
    assert_no_leaks,
)

__all__ = ["DEFAULT_PREFIXES", "Leak", "LeakCheck", "ShmLeakError", "ShmState", "assert_no_leaks"]
