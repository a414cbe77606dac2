"""sglang's real server entry point, instrumented, as far as this CPU-only host allows
(issue 25 point 2).

`python -m sglang.launch_server` with a tiny local Llama config, `--load-format dummy`,
`--device cpu` and the HiCache options docs/sglang.md shows, run plain, with
`HOSTPOOL_INSTRUMENT=sglang` and under `hostpool run --`. On this host the real server
stops in its launcher process, before any scheduler process exists:

- as installed (the pinned closure, `requirements/sglang-test.txt`): resolving the server
  arguments imports sglang's model configs, which import `torchvision.transforms`; no
  torchvision wheel loads beside the CPU torch (DESIGN.md), so `ModuleNotFoundError: No
  module named 'torchvision'`;
- with the test's torchvision stand-ins (`launch_with_standin.py`): the arguments
  resolve (CPU platform, torch_native attention) and the launcher imports sglang's HTTP
  server, which needs uvicorn and more of sglang's serving dependencies that the pinned
  closure leaves out. (With those added by hand, not here: the scheduler process starts
  and dies building the model, sglang's CPU rotary embedding importing
  `vllm._custom_ops`, before any KV or host pool exists; see docs/testing.md.)

The test: the same exit code and the very same traceback with and without hostpool, and
no line of hostpool's anywhere in what the server printed. It asserts the stop point
too, so a setup where sglang gets further fails here and must check the host pools.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).with_name("launch_with_standin.py")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(model: Path, port: int) -> list[str]:
    """docs/sglang.md's server options, on the tiny local model (nothing downloaded)."""
    return [
        "--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
        "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        "--enable-hierarchical-cache", "--hicache-storage-backend", "shm",
        "--hicache-size", "1", "--enable-metrics",
    ]  # fmt: skip


def _launch(argv: list[str], env_extra: dict[str, str], tmp: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    env.update(env_extra)
    # sglang's own multiprocess metrics directory: where hostpool would publish.
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp)
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=tmp, start_new_session=True,
    )  # fmt: skip
    try:
        _, err = process.communicate(timeout=300)
    finally:
        # Whatever it started (none today) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process.returncode, err


def _traceback(stderr: str) -> list[str]:
    """The final traceback (no timestamps or pids in it), up to the error line."""
    lines = stderr.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    assert starts, stderr[-3000:]
    return lines[starts[-1] :]


WAYS = ["plain", "HOSTPOOL_INSTRUMENT", "hostpool-run"]


def _argv(way: str, entry: list[str]) -> tuple[list[str], dict[str, str]]:
    if way == "plain":
        return [sys.executable, *entry], {}
    if way == "HOSTPOOL_INSTRUMENT":
        return [sys.executable, *entry], {"HOSTPOOL_INSTRUMENT": "sglang"}
    return [sys.executable, "-m", "hostpool", "run", "--", sys.executable, *entry], {}


@pytest.mark.parametrize(
    ("entry", "stop"),
    [
        (["-m", "sglang.launch_server"], "ModuleNotFoundError: No module named 'torchvision'"),
        ([str(STANDIN)], "ModuleNotFoundError: No module named 'uvicorn'"),
    ],
    ids=["as-installed", "torchvision-stand-in"],
)
def test_real_launch_server_ends_the_same_with_and_without_hostpool(
    entry: list[str], stop: str, tmp_path: Path
) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = server_args(model, _free_port())
    results = {}
    for way in WAYS:
        argv, env = _argv(way, [*entry, *args])
        workdir = tmp_path / way
        workdir.mkdir()
        results[way] = _launch(argv, env, workdir)
    code, stderr = results["plain"]
    assert code == 1, stderr[-3000:]
    plain = _traceback(stderr)
    assert plain[-1] == stop, stderr[-3000:]
    # Before that, sglang's own code ran: argument resolution, and with the stand-in the
    # CPU platform choice and the HTTP server's import.
    frames = "\n".join(plain)
    assert "in resolve_once" in frames or "in run_server" in frames, frames
    for way in WAYS[1:]:
        code_i, stderr_i = results[way]
        assert code_i == code, (way, stderr_i[-3000:])
        assert _traceback(stderr_i) == plain, way
        assert "hostpool" not in stderr_i, (way, stderr_i[-3000:])
        # Nothing got as far as a host pool: no worker published anything.
        assert list((tmp_path / way).glob("*.db")) == [], way
