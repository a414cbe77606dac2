"""The first allocation in a process pays only for what it uses (timed in bench/first_alloc.py)."""

from __future__ import annotations

import json

from tests import helpers

FIRST_ALLOCATION = """
    import json, sys
    import torch
    before = set(sys.modules)
    from hostpool import ShmHostTensorAllocator
    alloc = ShmHostTensorAllocator("first")
    t = alloc.allocate((2 << 20,), torch.uint8)
    loaded = sorted(set(sys.modules) - before)
    alloc.close()
    print(json.dumps(loaded))
"""


def test_first_allocation_imports_no_logging_or_config_parsers() -> None:
    """structlog (which pulls in rich where it is installed: 30-400 ms) loads at the first
    event that passes the level check, tomllib only for a .toml config."""
    proc = helpers.run_python(FIRST_ALLOCATION)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "hostpool.core.allocators" in loaded  # the import did happen in the measured span
    heavy = {m for m in loaded if m.split(".")[0] in ("structlog", "rich", "tomllib", "yaml")}
    assert heavy == set()
    # ctypes.util.find_library runs ldconfig in a subprocess (~10 ms); secrets pulls in
    # hmac and hashlib (~6 ms): libc is reached through dlopen(NULL), names use os.urandom
    assert {"ctypes.util", "secrets"} & loaded == set()


def test_structlog_loads_when_an_event_is_wanted() -> None:
    proc = helpers.run_python(
        """
        import logging, sys
        import torch
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(message)s")
        from hostpool import ShmHostTensorAllocator
        alloc = ShmHostTensorAllocator("first")
        t = alloc.allocate((2 << 20,), torch.uint8)
        print("structlog loaded:", "structlog" in sys.modules)
        alloc.close()
        """
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("hostpool.alloc" in line and "first" in line for line in lines), lines
    assert "structlog loaded: True" in lines
