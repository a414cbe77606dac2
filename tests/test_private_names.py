"""tools/check_private_names.py: `make lint` fails when a module uses another's private names."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "check_private_names.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_private_names", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "hostpool"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


OWNER = """
_counter = 0
def _helper() -> int:
    return 1
class Box:
    def __init__(self) -> None:
        self._lock = None
"""


def test_each_kind_of_reach_into_another_module_is_reported(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "owner.py": OWNER,
            "by_import.py": "from hostpool.owner import _helper\n",
            "by_module.py": "from hostpool import owner\nvalue = owner._counter\n",
            "by_object.py": "def f(box: object) -> object:\n    return box._lock\n",
        },
    )
    problems = _tool().check(root)
    assert [p.split(": ", 1)[1] for p in sorted(problems)] == [
        "imports _helper from hostpool.owner",
        "uses owner._counter",
        "uses ._lock, private to another module",
    ]
    assert [Path(p.split(":")[0]).name for p in sorted(problems)] == [
        "by_import.py",
        "by_module.py",
        "by_object.py",
    ]


def test_own_privates_dunders_and_self_are_allowed(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "owner.py": OWNER + "value = Box()._lock\n",
            "user.py": (
                "from hostpool import owner\n"
                "from hostpool.owner import Box\n"
                "name = owner.__name__\n"
                "class Mine(Box):\n"
                "    def get(self) -> object:\n"
                "        return self._lock\n"
            ),
        },
    )
    assert _tool().check(root) == []


def test_the_command_fails_on_a_violation_and_passes_on_hostpool(tmp_path: Path) -> None:
    root = _package(
        tmp_path, {"owner.py": OWNER, "user.py": "from hostpool.owner import _helper\n"}
    )
    planted = subprocess.run(
        [sys.executable, str(TOOL), str(root)], capture_output=True, text=True, check=False
    )
    assert planted.returncode == 1
    assert "user.py:1: imports _helper from hostpool.owner" in planted.stdout
    real = subprocess.run(
        [sys.executable, str(TOOL), str(ROOT / "hostpool")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (real.returncode, real.stdout) == (0, "")
