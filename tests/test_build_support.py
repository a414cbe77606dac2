"""setuptools' internal as `build_support/editable_pth.py` relies on it (the one place
that pins it): an editable wheel built by the installed setuptools carries the `.pth`
hook at its root, through `editable_wheel._select_strategy`; so does the regular wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools

from build_support import editable_pth
from tests.helpers import package_sources

ROOT = Path(__file__).resolve().parents[1]
PTH = "hostpool-instrument.pth"


def test_the_installed_setuptools_is_one_it_was_read_from() -> None:
    assert editable_pth.in_range(setuptools.__version__), setuptools.__version__
    assert editable_pth.in_range("68.0.0") and editable_pth.in_range("84.2.1+local")
    assert not editable_pth.in_range("67.8.0") and not editable_pth.in_range("85.0.0")


@pytest.mark.slow
def test_the_wheel_carries_the_hook_at_its_root(tmp_path: Path) -> None:
    source = package_sources(tmp_path, "__pycache__")
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


@pytest.mark.slow
def test_an_editable_wheel_carries_the_hook(tmp_path: Path) -> None:
    # What `pip install -e .` asks setuptools for (PEP 660), from a copy of the sources.
    source = package_sources(tmp_path, "__pycache__", "*.so")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = f"from setuptools import build_meta; print(build_meta.build_editable({str(out_dir)!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=source
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (wheel,) = out_dir.glob("hostpool-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(PTH) == (ROOT / PTH).read_bytes()
        assert any(n.startswith("__editable__") for n in zf.namelist())  # setuptools' own


def test_outside_its_versions_setuptools_own_command_stays(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(setuptools, "__version__", "99.1")
    assert editable_pth.editable_command(PTH) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "setuptools 99.1 is outside >=68,<85" in err
    monkeypatch.undo()
    command = editable_pth.editable_command(PTH)
    assert command is not None and command.__mro__[1].__name__ == "editable_wheel"
