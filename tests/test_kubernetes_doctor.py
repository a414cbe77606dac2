"""`hostpool doctor --kubernetes` through the real CLI (issue [fleet] item 5): the pod
resources the pools of a serve config or an engine command line need, as a patch, and
this node's limits against them, one verdict each; and the engine flags it reads exist in
the pinned engines' own parsers."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
VLLM = ["vllm", "serve", "m", "--tensor-parallel-size", "2"]
SPEC = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_module_path": "hostpool.integrations.vllm",
                                      "spec_name": "HostpoolOffloadingSpec",
                                      "cpu_bytes_to_use": 8 * GIB}}  # fmt: skip


def doctor(
    *args: str, memlock: int | None = None, container: str | None = "engine"
) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))

    named = ["--container", container] if container else []
    return subprocess.run(
        [sys.executable, "-m", "hostpool", "doctor", "--kubernetes", *named, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=limit,
    )  # fmt: skip


def as_json(*args: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    proc = doctor("--json", *args, **kw)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def resources(report: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    spec = report["patch"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    (volume,) = spec["volumes"]
    assert volume["name"] == "dshm" and volume["emptyDir"]["medium"] == "Memory"
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    return container["resources"]["limits"], volume["emptyDir"]


def checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["check"].split()[0]: c for c in report["checks"]}


def test_vllm_native_offload_is_a_dev_shm_file_counted_in_memory() -> None:
    code, report = as_json("--check-host", "--engine-memory", "10GiB", "--shm-extra", "1GiB",
                           "--", *VLLM, "--kv-offloading-size", "4")  # fmt: skip
    (pool,) = report["pools"]
    assert pool["backing"] == "devshm" and pool["size_bytes"] == 4 * GIB
    assert pool["mappings"] == 2  # one per tensor-parallel rank
    limits, dshm = resources(report)
    assert limits == {"memory": "15Gi"}  # the engine, the file and the other /dev/shm files
    assert dshm["sizeLimit"] == "5Gi"
    st = os.statvfs("/dev/shm")
    shm = checks(report)["/dev/shm"]
    assert shm["ok"] == (st.f_blocks * st.f_frsize >= 5 * GIB)
    assert code == (0 if report["ok"] else 1)


def test_hostpool_spec_with_required_hugepages_asks_for_pages_not_memory() -> None:
    spec = json.loads(json.dumps(SPEC))
    extra = spec["kv_connector_extra_config"]
    extra.update(hostpool_hugepages="required", hostpool_hugepage_size="2MB")
    _, report = as_json("--check-host", "--engine-memory", "1GiB", "--", *VLLM,
                        "--kv-transfer-config", json.dumps(spec))  # fmt: skip
    (pool,) = report["pools"]
    assert pool["backing"] == "memfd" and pool["hugepages"] == "required"
    limits, dshm = resources(report)
    assert limits == {"memory": "1Gi", "hugepages-2Mi": "8Gi"}
    assert "sizeLimit" not in dshm  # memfds are not in /dev/shm
    free = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
    resv = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/resv_hugepages").read_text())
    assert checks(report)["hugepages"]["ok"] == (free - resv >= 4096)


def test_serve_config_pools_and_the_checks_that_fail(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        '[pools.kv]\nsize = "1GiB"\nallocator = "shm"\nchunk = "4KiB"\npin = true\n'
        '[pools.huge]\nsize = "1TiB"\nallocator = "shm"\nhugepages = "required"\n'
        '[pools.staging]\nsize = "64MiB"\nallocator = "mmap"\n'
    )
    code, report = as_json("--check-host", "--config", str(config), memlock=1 << 20)
    assert code == 1 and not report["ok"]
    limits, _ = resources(report)
    assert limits == {"memory": "1088Mi", "hugepages-2Mi": "1Ti"}
    got = checks(report)
    assert not got["ulimit"]["ok"] and "1GiB pinned, RLIMIT_MEMLOCK 1MiB" in got["ulimit"]["detail"]
    max_maps = int(Path("/proc/sys/vm/max_map_count").read_text())
    assert got["vm.max_map_count"]["ok"] == (max_maps >= 262144 + 4 + 1)
    assert not got["hugepages"]["ok"]  # nobody has 1 TiB of free hugepages here
    # the text form: a patch that is valid YAML (what it was sized from and the
    # verdicts are comments), one verdict line per check
    text = doctor("--check-host", "--config", str(config), memlock=1 << 20)
    assert text.returncode == 1
    patch = yaml.safe_load(text.stdout)
    assert patch == report["patch"]
    verdicts = [ln for ln in text.stdout.splitlines() if ln.startswith(("# ok ", "# FAIL "))]
    assert len(verdicts) == len(report["checks"]) == 5
    assert any(ln.startswith("# FAIL ulimit -l") for ln in verdicts)


def test_sglang_hicache_size_per_rank() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m",
            "--enable-hierarchical-cache", "--hicache-size", "3", "--tp-size", "2",
            "--hicache-storage-backend", "shm"]  # fmt: skip
    _, report = as_json("--engine-memory", "2GiB", "--", *argv)
    (pool,) = report["pools"]
    assert pool["size_bytes"] == 6 * 10**9 and pool["backing"] == "memfd"
    limits, _ = resources(report)
    assert limits["memory"] == f"{(2 * GIB + 6 * 10**9 + (1 << 20) - 1) >> 20}Mi"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["python", "-m", "sglang.launch_server", "--enable-hierarchical-cache",
          "--hicache-ratio", "2"], "--hicache-size"),
        (["python", "-m", "sglang.launch_server", "--hicache-size", "2"],
         "--enable-hierarchical-cache"),
        (["vllm", "serve", "m"], "asks for no host KV memory"),
        (["vllm", "serve", "m", "--kv-offloading-size", "4", "--kv-offloading-backend",
          "lmcache"], "its own server"),
        (["vllm", "serve", "m", "--kv-transfer-config", "{nope"], "not JSON"),
        (["llama-server", "-m", "x"], "cannot tell the engine"),
    ],
)  # fmt: skip
def test_a_command_line_it_cannot_size_is_bad_input(argv: list[str], says: str) -> None:
    proc = doctor("--", *argv)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr


@pytest.mark.parametrize(
    "args",
    [[], ["--config", "deploy/hostpool/serve.toml", "--", "vllm", "serve"],
     ["--config", "nope.toml"], ["--engine-memory", "lots", "--", "vllm", "serve", "m",
     "--kv-offloading-size", "1"]],
)  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(args: list[str]) -> None:
    proc = doctor(*args)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_without_kubernetes_a_command_line_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hostpool", "doctor", "--", "vllm", "serve"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--kubernetes" in proc.stderr


# ---------------------------------------------------------------- the pod, not this machine

EXAMPLE = ROOT / "deploy" / "kubernetes" / "examples" / "vllm" / "deployment.yaml"
HUGE = ["--", *VLLM, "--kv-offloading-size", "4096"]  # 4 TiB of /dev/shm file


def test_this_machine_is_judged_only_with_check_host() -> None:
    """A laptop's /dev/shm (or this host's) does not fail a patch for a cluster."""
    st = os.statvfs("/dev/shm")
    assert st.f_blocks * st.f_frsize < 4096 * GIB  # this host cannot hold it
    code, report = as_json(*HUGE)
    assert (code, report["checks"], report["ok"]) == (0, [], True)
    limits, dshm = resources(report)
    assert dshm["sizeLimit"] == "4Ti" and limits["memory"] == "4Ti"
    code, report = as_json("--check-host", *HUGE)
    assert code == 1 and not checks(report)["/dev/shm"]["ok"]


def test_container_is_required_unless_the_pod_has_one() -> None:
    proc = doctor(*HUGE, container=None)
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.strip()
        == "hostpool doctor: --container NAME is required: the engine's container"
    )
    proc = doctor("--pod", str(EXAMPLE), container="engine")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--container engine: the pod has no such container (vllm)" in proc.stderr


def test_the_example_pod_is_judged_with_its_own_command(tmp_path: Path) -> None:
    """--pod alone: the container (its only one) and the command come from the manifest,
    and the pod spec as written holds what that command needs."""
    args = ("--pod", str(EXAMPLE), "--engine-memory", "48GiB", "--shm-extra", "4GiB")
    code, report = as_json(*args, container=None)
    assert code == 0, report["checks"]
    (container,) = report["patch"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "vllm"
    (pool,) = report["pools"]
    assert pool["size_bytes"] == 64 * GIB and "HostpoolOffloadingSpec" in pool["source"]
    judged = {c["check"]: c for c in report["checks"]}
    assert set(judged) == {"pod memory", "pod requests", "pod /dev/shm"}
    assert judged["pod memory"]["detail"] == "116GiB needed, limit 116GiB"
    # the same pod, short of memory and of /dev/shm: exit 1, naming both
    doc = yaml.safe_load(EXAMPLE.read_text())
    pod = doc["spec"]["template"]["spec"]
    pod["containers"][0]["resources"]["limits"]["memory"] = "100Gi"
    pod["volumes"][0]["emptyDir"]["sizeLimit"] = "1Gi"
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(doc))
    proc = doctor("--pod", str(short), *args[2:], container=None)
    assert proc.returncode == 1, proc.stderr
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("# FAIL")]
    assert failed == [
        "# FAIL pod memory       116GiB needed, limit 100GiB",
        "# FAIL pod requests     differ from limits: memory",
        "# FAIL pod /dev/shm     4GiB needed, 1GiB",
    ]


@pytest.mark.parametrize(
    ("flag", "value", "offered"),
    [("--engine-memory", "48", "48GiB"), ("--shm-extra", "4", "4GiB"), ("--need", "64", "64GiB"),
     ("--hugepage-size", "2", "2MB")],
)  # fmt: skip
def test_a_size_without_a_unit_is_refused(flag: str, value: str, offered: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hostpool", "doctor", "--kubernetes", "--container", "vllm",
         flag, value, "--", *VLLM, "--kv-offloading-size", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert f"{flag}: {value} has no unit (did you mean {offered}?)" in line
    assert doctor(flag, "0" if flag != "--hugepage-size" else "2MB", *HUGE).returncode == 0


# ---------------------------------------------------------------- the engines' own flags


def test_the_sglang_flags_read_are_sglangs() -> None:
    import argparse

    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = {s: a for a in parser._actions for s in a.option_strings}
    for flag, kind in [("--hicache-size", int), ("--hicache-ratio", float),
                       ("--tp-size", int), ("--pp-size", int), ("--dp-size", int)]:  # fmt: skip
        assert options[flag].type is kind, flag
    for flag in ("--enable-hierarchical-cache", "--enable-hicache", "--enable-dp-attention",
                 "--hicache-storage-backend", "--tensor-parallel-size"):  # fmt: skip
        assert flag in options, flag


VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-venv)")
def test_the_vllm_flags_read_are_vllms() -> None:
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = EngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        "a = p.parse_args(['--kv-offloading-size', '1.5', '--kv-offloading-backend', 'native',"
        " '-tp', '2', '-pp', '1', '--kv-transfer-config', '{}'])\n"
        "print(a.kv_offloading_size, a.kv_offloading_backend, a.tensor_parallel_size,"
        " a.pipeline_parallel_size)\n"
    )
    proc = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1.5", "native", "2", "1"]
