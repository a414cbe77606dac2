"""The post-import hook is invisible (issue 25 point 1): a module loaded through it behaves
as with its own loader for everything Python asks of a loader, on the real sglang and vLLM
packages, and `python -m` of their entry modules gives the same output instrumented.

Each comparison runs the same probe twice in fresh interpreters, once with a
`PostImportHook` over the package and once without, and compares what they saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# What a loader is asked, by whom: the spec's loader before execution (runpy asks
# `get_code` and `is_package`, pkgutil `get_data`, importlib.resources
# `get_resource_reader`), the module's loader after it, and the tools over both.
PROBE = r"""
import hashlib, importlib, importlib.resources, importlib.util, inspect, json, marshal
import os, pkgutil, sys

def digest(data):
    return hashlib.sha256(data if isinstance(data, bytes) else str(data).encode()).hexdigest()

def path(module):
    return getattr(module, "__path__", [])

def attempt(fn):
    try:
        return fn()
    except Exception as exc:  # the same failure both ways is the same behaviour
        return f"raised {type(exc).__name__}"

package, resource, *names = sys.argv[1:]
seen = []
if os.environ.get("PROBE_HOOK") == "1":
    from hostpool.integrations.importhook import PostImportHook, in_package

    PostImportHook(in_package(package), lambda module: seen.append(module.__name__)).add()

out = {"spec_loader": {}, "module": {}}
for name in names:
    fresh = name not in sys.modules  # else find_spec answers the loaded module's spec
    spec = importlib.util.find_spec(name)
    loader = spec.loader
    reader = attempt(lambda: loader.get_resource_reader(name))
    out["spec_loader"][name] = {
        "fresh": fresh,
        "watched": type(spec).__name__ == "_WatchedSpec",
        "loader_type": type(loader).__name__,
        "origin": spec.origin,
        "submodule_search_locations": list(spec.submodule_search_locations or []),
        "is_package": attempt(lambda: loader.is_package(name)),
        "get_filename": attempt(lambda: loader.get_filename(name)),
        "get_source": attempt(lambda: digest(loader.get_source(name))),
        "get_code": attempt(lambda: digest(marshal.dumps(loader.get_code(name)))),
        "get_data": attempt(lambda: digest(loader.get_data(spec.origin))),
        "resource_reader": reader if isinstance(reader, str) else type(reader).__name__,
    }
    module = importlib.import_module(name)
    out["module"][name] = {
        "loader": type(module.__loader__).__name__,
        "spec_loader": type(module.__spec__.loader).__name__,
        "same_loader": module.__loader__ is module.__spec__.loader,
        "getsource": attempt(lambda: digest(inspect.getsource(module))),
        "getsourcefile": attempt(lambda: inspect.getsourcefile(module)),
        "iter_modules": sorted(m.name for m in pkgutil.iter_modules(path(module))),
    }
top = importlib.import_module(package)
out["resources_files"] = digest(importlib.resources.files(package).joinpath(resource).read_bytes())
out["pkgutil_get_data"] = digest(pkgutil.get_data(package, resource))
out["seen"] = seen
print(json.dumps(out))
"""


def _probe(python: Path | str, package: str, resource: str, names: list[str], hooked: bool) -> Any:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    env["PROBE_HOOK"] = "1" if hooked else "0"
    env["PYTHONPATH"] = str(ROOT)  # hostpool itself, also where it is not installed
    out = subprocess.run(
        [str(python), "-c", PROBE, package, resource, *names],
        capture_output=True, text=True, timeout=300, env=env, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


def _compare(python: Path | str, package: str, resource: str, names: list[str]) -> None:
    plain = _probe(python, package, resource, names, hooked=False)
    hooked = _probe(python, package, resource, names, hooked=True)
    # The hook really was there: it found every module's spec (some were looked up before
    # they loaded, others after an earlier one imported them), and saw each module load.
    fresh = [n for n in names if hooked["spec_loader"][n]["fresh"]]
    assert fresh[0] == names[0] and len(fresh) >= len(names) // 2, fresh
    assert all(hooked["spec_loader"][n]["watched"] for n in names)
    assert not any(plain["spec_loader"][n]["watched"] for n in names)
    assert set(names) <= set(hooked["seen"]), set(names) - set(hooked["seen"])
    with_code = {n for n in names if plain["spec_loader"][n]["origin"] is not None}
    for n in names:
        hooked["spec_loader"][n]["watched"] = plain["spec_loader"][n]["watched"]
    hooked["seen"] = plain["seen"]
    assert hooked == plain
    # Nothing answered "raised" in a way that would hide a difference.
    for n in with_code:
        answers = plain["spec_loader"][n]
        assert not str(answers["get_code"]).startswith("raised"), answers
        assert not str(answers["get_source"]).startswith("raised"), answers


TRACEBACK_PROBE = r"""
import importlib, json, os, sys, traceback

seen = []
if os.environ.get("PROBE_HOOK") == "1":
    from hostpool.integrations.importhook import PostImportHook, in_package

    def after(module):
        seen.append([module.__name__, vars(module).get("DONE")])

    PostImportHook(in_package("hookprobe"), after).add()
out = {}
for name in ("hookprobe.good", "hookprobe.bad_import", "hookprobe.bad_runtime", "hookprobe.good"):
    try:
        importlib.import_module(name)
        out[name] = "ok"
    except Exception:
        out[name] = traceback.format_exc()
out["modules"] = sorted(m for m in sys.modules if m.startswith("hookprobe"))
out["seen"] = seen
print(json.dumps(out))
"""


def test_a_module_that_fails_to_import_fails_the_same_and_is_not_called_back(
    tmp_path: Path,
) -> None:
    """No frame of hostpool's around a module's code: an import that fails (ImportError,
    which Python trims importlib's own frames from, or any other error) shows the very
    same traceback with the hook; the callback runs once per module that executed to
    its end (seeing the whole module), and never for one that raised."""
    package = tmp_path / "hookprobe"
    package.mkdir()
    (package / "__init__.py").write_text("DONE = True\n")
    (package / "good.py").write_text("from hookprobe import sub\nDONE = sub.DONE\n")
    (package / "sub.py").write_text("DONE = 'all of it ran'\n")
    (package / "bad_import.py").write_text("import hookprobe.sub\nimport hookprobe_no_such\n")
    (package / "bad_runtime.py").write_text("X = 1\nraise RuntimeError('boom')\n")
    runs = {}
    for hooked in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
        env.update(PROBE_HOOK="1" if hooked else "0", PYTHONPATH=f"{tmp_path}:{ROOT}")
        out = subprocess.run(
            [sys.executable, "-c", TRACEBACK_PROBE], capture_output=True, text=True,
            timeout=120, env=env, cwd="/",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        runs[hooked] = json.loads(out.stdout.splitlines()[-1])
    plain, hooked = runs[False], runs[True]
    assert "No module named 'hookprobe_no_such'" in plain["hookprobe.bad_import"]
    assert "RuntimeError: boom" in plain["hookprobe.bad_runtime"]
    assert plain["seen"] == []
    assert hooked["seen"] == [
        ["hookprobe", True],
        ["hookprobe.sub", "all of it ran"],
        ["hookprobe.good", "all of it ran"],
    ]  # bad_import's `import hookprobe.sub` found it loaded: once each
    hooked["seen"] = []
    assert hooked == plain


def test_two_hooks_over_one_package_both_run_once_per_module(tmp_path: Path) -> None:
    from hostpool.integrations.importhook import PostImportHook, in_package

    package = tmp_path / "hookpair"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("VALUE = 7\n")
    calls: list[tuple[str, str]] = []
    hooks = [
        PostImportHook(in_package("hookpair"), lambda m, k=k: calls.append((k, m.__name__)))
        for k in ("first", "second")
    ]
    sys.path.insert(0, str(tmp_path))
    try:
        for hook in hooks:
            hook.add()
        import hookpair.mod  # type: ignore[import-not-found]

        assert hookpair.mod.VALUE == 7
    finally:
        for hook in hooks:
            hook.remove()
        sys.path.remove(str(tmp_path))
        for name in ("hookpair.mod", "hookpair"):
            sys.modules.pop(name, None)
    assert sorted(calls) == [
        ("first", "hookpair"), ("first", "hookpair.mod"),
        ("second", "hookpair"), ("second", "hookpair.mod"),
    ]  # fmt: skip


SGLANG_MODULES = [
    "sglang",
    "sglang.srt",
    "sglang.srt.mem_cache.storage.mmap",
    "sglang.srt.mem_cache.storage.mmap.mmap_allocator",
    "sglang.cli",
    "sglang.cli.main",
]


def test_sglang_modules_through_the_hook_answer_as_with_their_own_loader() -> None:
    _compare(sys.executable, "sglang", "srt/lora/dense/configs/default.plans.json", SGLANG_MODULES)


VLLM_MODULES = [
    "vllm",
    "vllm.transformers_utils",
    "vllm.transformers_utils.chat_templates",
    "vllm.transformers_utils.chat_templates.registry",
    "vllm.entrypoints",
]


@pytest.mark.slow
def test_vllm_modules_through_the_hook_answer_as_with_their_own_loader() -> None:
    assert VLLM_PYTHON.exists(), "make test creates .venv-vllm"
    _compare(
        VLLM_PYTHON,
        "vllm",
        "transformers_utils/chat_templates/template_chatml.jinja",
        VLLM_MODULES,
    )


# -- python -m of the entry modules --------------------------------------------------------
def _run(argv: list[str], env_extra: dict[str, str], python: Path | str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    env.update({"PYTHONHASHSEED": "0", **env_extra})  # sglang's help varies with the seed
    out = subprocess.run(
        [str(python), *argv], capture_output=True, text=True, timeout=300, env=env, cwd="/"
    )
    return out.returncode, out.stdout, out.stderr


LAUNCH_HELP = ["-m", "sglang.launch_server", "--help"]


@pytest.mark.parametrize(
    "how",
    [
        ("env", {"HOSTPOOL_INSTRUMENT": "sglang"}, LAUNCH_HELP),
        ("run", {}, ["-m", "hostpool", "run", "--", sys.executable, *LAUNCH_HELP]),
    ],
    ids=["HOSTPOOL_INSTRUMENT", "hostpool-run"],
)
def test_instrumented_sglang_launch_server_help_is_identical(
    how: tuple[str, dict[str, str], list[str]],
) -> None:
    """Issue 25: `python -m sglang.launch_server --help` died with AttributeError
    (the hook's loader wrapper had no `get_code`) once instrumented."""
    _, env, argv = how
    plain = _run(LAUNCH_HELP, {}, sys.executable)
    instrumented = _run(argv, env, sys.executable)
    assert plain[0] == 0, plain[2][-2000:]
    assert "--enable-hierarchical-cache" in plain[1]
    assert instrumented == plain


def test_instrumented_python_m_of_a_package_is_identical() -> None:
    """`python -m sglang.cli.main`: runpy imports the parent packages through the hook,
    then asks the entry module's loader for its code."""
    argv = ["-m", "sglang.cli.main", "--help"]
    plain = _run(argv, {}, sys.executable)
    instrumented = _run(argv, {"HOSTPOOL_INSTRUMENT": "sglang"}, sys.executable)
    assert instrumented == plain
    assert plain[0] == 0, plain[2][-2000:]


# vLLM's entry module, run by runpy in an interpreter whose hook covers `vllm` (the vLLM
# integration's install() is another matter; the hook is what makes `-m` work or not).
RUN_HOOKED = r"""
import runpy, sys
from hostpool.integrations.importhook import PostImportHook, in_package

seen = []
PostImportHook(in_package("vllm"), lambda module: seen.append(module.__name__)).add()
name = sys.argv[1]
sys.argv = [name, *sys.argv[2:]]  # run_module sets argv[0] to the file, as `-m` does
try:
    runpy.run_module(name, run_name="__main__", alter_sys=True)
finally:
    assert "vllm.entrypoints.openai" in seen, seen  # the hook really loaded vLLM's modules
"""


@pytest.mark.slow
def test_vllm_api_server_help_through_the_hook_is_identical() -> None:
    assert VLLM_PYTHON.exists(), "make test creates .venv-vllm"
    module = "vllm.entrypoints.openai.api_server"
    env = {"PYTHONPATH": str(ROOT)}
    plain = _run(["-m", module, "--help"], env, VLLM_PYTHON)
    hooked = _run(["-c", RUN_HOOKED, module, "--help"], env, VLLM_PYTHON)
    assert plain[0] == 0, plain[2][-2000:]
    assert "--kv-offloading-size" in plain[1]
    assert hooked == plain
