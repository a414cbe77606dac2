"""Fail when a hostpool module uses another module's private names.

ruff's PLC2701 (preview) does not flag imports inside one package, so this check parses
every module of the package with `ast` and reports, as `path:line: message`:
- `from hostpool.x import _name` (a private name of another module);
- `module._name` where `module` is a hostpool module bound by an import;
- `obj._name` (obj not `self`/`cls`) where `_name` is private to another hostpool module:
  defined there (module level, class level or as `self._name`) and not in this one.
Dunder names are public. Exit status 1 when anything is reported, else 0.

Usage: python tools/check_private_names.py [PACKAGE_DIR] (default: hostpool)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: module and class level, and `self._x = ...`."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            found.add(node.attr)
    return {n for n in found if _private(n)}


def check(root: Path) -> list[str]:
    """Every violation under the package directory `root`, as `path:line: message`."""
    package = root.name
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))}
    modules = {module_name(root, path) for path in trees}
    privates = {path: defined_privates(tree) for path, tree in trees.items()}
    problems: list[str] = []
    for path, tree in trees.items():
        mine = privates[path]
        others = set().union(*(p for q, p in privates.items() if q != path)) - mine
        bound: set[str] = set()  # local names bound to hostpool modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module != package and not node.module.startswith(package + "."):
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        problems.append(
                            f"{path}:{node.lineno}: imports {alias.name} from {node.module}"
                        )
                    elif f"{node.module}.{alias.name}" in modules:
                        bound.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package and alias.asname:
                        bound.add(alias.asname)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in bound:
                problems.append(f"{path}:{node.lineno}: uses {receiver.id}.{node.attr}")
            elif isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue
            elif node.attr in others:
                problems.append(
                    f"{path}:{node.lineno}: uses .{node.attr}, private to another module"
                )
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "hostpool").resolve()
    problems = check(root)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
