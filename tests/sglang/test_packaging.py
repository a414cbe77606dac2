"""The `.pth` hook is in the installed environment, and costs nothing when off (the wheels
that carry it: tests/test_build_support.py)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PTH = "hostpool-instrument.pth"


def test_the_installed_environment_has_the_hook() -> None:
    """`make` installs hostpool editable: the hook must be there too."""
    found = [Path(d) / PTH for d in site.getsitepackages() if (Path(d) / PTH).exists()]
    assert found, site.getsitepackages()
    assert found[0].read_bytes() == (ROOT / PTH).read_bytes()


def _child(env: dict[str, str], code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=env, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_off_the_hook_imports_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('hostpool')))"
    assert _child(env, code) == "[]"
    assert _child({**env, "HOSTPOOL_INSTRUMENT": ""}, code) == "[]"


def test_on_the_hook_installs_the_integration_without_importing_torch() -> None:
    env = {**os.environ, "HOSTPOOL_INSTRUMENT": "sglang"}
    code = (
        "import sys; from hostpool.integrations import sglang; "
        "print(sglang.installed(), 'torch' in sys.modules)"
    )
    assert _child(env, code) == "True False"


def test_hostpool_run_activates_the_integration_in_the_command() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    code = (
        "import os; from hostpool.integrations import sglang; "
        "print(os.environ['HOSTPOOL_INSTRUMENT'], sglang.installed())"
    )
    out = subprocess.run(
        [sys.executable, "-m", "hostpool", "run", "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, env=env, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sglang,vllm True"


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["run"], 2),
        (["run", "--"], 2),
        (["run", "--", "/nonexistent/cmd"], 2),
        (["run", "--", ""], 2),  # an empty command name: execve refuses it (ValueError)
    ],
)
def test_hostpool_run_usage_errors(argv: list[str], code: int) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hostpool", *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == code, out.stderr
    assert out.stderr.startswith("hostpool run: ") and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
