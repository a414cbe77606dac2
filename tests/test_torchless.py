"""torch is the engine's (issue 41): pools are memory without it, and each tensor API says
what to install. Each check runs in a fresh interpreter where `import torch` fails, as in
an environment that never installed it (tests/test_packaging.py does that for real)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hostpool.core.allocators import ShmHostTensorAllocator
from hostpool.errors import InvalidRequestError
from tests.helpers import ROOT

NO_TORCH = "import sys\nsys.modules['torch'] = None  # `import torch` raises ImportError\n"


def without_torch(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_buffer_is_pool_memory_without_torch() -> None:
    out = without_torch("""
        from hostpool.core.allocators import ShmHostTensorAllocator
        alloc = ShmHostTensorAllocator("kv", retain=True)
        buf = alloc.allocate_buffer(1 << 20)
        with memoryview(buf).cast("B") as view:
            view[4096:8192] = b"x" * 4096
            print(len(view), bytes(view[4095:4097]))
        print(alloc.allocated_bytes, len(alloc.fds))
        print(alloc.release(buf), alloc.allocated_bytes)
        print("torch" in sys.modules and sys.modules["torch"] is not None)
    """)
    assert out.split("\n")[:4] == ["1048576 b'\\x00x'", "1048576 1", "False 0", "False"], out


def test_each_tensor_api_says_what_to_install() -> None:
    out = without_torch("""
        import hostpool
        from hostpool.errors import TorchUnavailableError, UnavailableError
        calls = {
            "allocate": lambda: hostpool.ShmHostTensorAllocator("kv").allocate((4,), "uint8"),
            "alloc_shm": lambda: hostpool.alloc_shm((4,), "uint8"),
            "attach": lambda: __import__("hostpool.share", fromlist=["attach"]).attach(
                "/nonexistent", "kv"),
            "default": lambda: hostpool.create_allocator("default").allocate_buffer(4096),
        }
        for name, call in calls.items():
            try:
                call()
            except TorchUnavailableError as exc:
                assert isinstance(exc, UnavailableError) and isinstance(exc, ImportError)
                print(name, exc)
        print(hostpool.get_ledger().counters().failures_total)
    """)
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["allocate", "alloc_shm", "attach", "default"]
    for line in lines[:4]:
        assert "needs torch: pip install torch (the engine's build" in line, line
    assert lines[4] == "{}", out  # no request was made, so no failure was counted


@pytest.mark.parametrize(
    "module",
    ["hostpool.cli", "hostpool.serve.service", "hostpool.serve.demo", "hostpool.share.server",
     "hostpool.core.allocators", "hostpool.integrations.sglang.shapes", "hostpool.share"],
)  # fmt: skip
def test_the_operator_paths_import_without_torch(module: str) -> None:
    without_torch(f"import {module}")


def test_a_buffer_of_another_allocator_is_refused() -> None:
    with ShmHostTensorAllocator("a") as a, ShmHostTensorAllocator("b") as b:
        buf = a.allocate_buffer(4096)
        with pytest.raises(InvalidRequestError, match="not a live allocation of pool 'b'"):
            b.release(buf)
        assert a.release(buf) is False  # `buf` still maps it: released, still mapped
        del buf


def test_doctor_prints_no_numpy_warning_where_torch_has_no_numpy() -> None:
    """torch without NumPy warns when imported; doctor imports it only to ask about CUDA
    (pinning), which needs no NumPy, so the warning is not printed."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys\nsys.modules['numpy'] = None\n"
         "sys.argv = ['hostpool', 'doctor']\nfrom hostpool.cli import main\nrc = main()\n"
         "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(rc)"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "auto would choose" in done.stdout
    assert "torch imported: True" in done.stderr  # doctor did import it
    assert "NumPy" not in done.stderr, done.stderr
