"""The `.pth` hook ships in the wheel and in editable installs, and costs nothing when off."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PTH = "hostpool-instrument.pth"


@pytest.mark.slow
def test_the_wheel_carries_the_hook_at_its_root(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and egg-info next to the sources.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", PTH, "README.md"):
        shutil.copy(ROOT / name, source / name)
    for tree in ("hostpool", "build_support"):
        shutil.copytree(ROOT / tree, source / tree,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("hostpool-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert PTH in names  # the root of the wheel: site-packages once installed
        assert zf.read(PTH) == (ROOT / PTH).read_bytes()
        assert "hostpool/integrations/sglang/__init__.py" in names


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
