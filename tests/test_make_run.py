"""Issue 36.10: `make run` installs only what `hostpool serve` needs, and (issue 41) no
torch: serve's pools are buffers; `make test` and `make lint` still install everything (the
pinned CPU torch first, the test, lint and bench tools, the sglang test closure). Read from
make's own dry run for a venv that does not exist yet, as a fresh clone has none; what
the serve install really holds is tests/test_packaging.py's clean venv."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(target: str, venv: Path) -> str:
    return subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def test_make_run_installs_serve_only(tmp_path: Path) -> None:
    steps = dry_run("run", tmp_path / "venv")
    assert "pip install -q -e .\n" in steps and "torch" not in steps
    assert "[dev" not in steps and "bench" not in steps and "sglang-test" not in steps
    assert steps.rstrip().endswith("serve")


@pytest.mark.parametrize("target", ["test", "lint"])
def test_make_test_and_lint_install_everything(tmp_path: Path, target: str) -> None:
    steps = dry_run(target, tmp_path / "venv")
    assert "pip install -q -e .\n" in steps or "serve-stamp" in steps
    assert '-e ".[dev,bench,torch]"' in steps and "requirements/sglang-test.txt" in steps
    # The pinned CPU wheel goes in before anything that could ask for torch.
    pinned = steps.index('pip install -q "torch==')
    assert pinned < steps.index('-e ".[dev,bench,torch]"')


@pytest.mark.slow
def test_make_run_from_a_fresh_clone_serves_metrics_from_a_venv_without_torch() -> None:
    """What bench/make_run.py times (docs/benchmarks.md has the figures): a `git clone` of
    HEAD, `make run` there until GET /metrics answers 200 (one_round raises otherwise),
    its venv's packages."""
    from bench.make_run import one_round

    result = one_round("8MiB")
    assert not result["torch"], result["packages"]
    assert "hostpool" in result["packages"] and "numpy" not in result["packages"]
