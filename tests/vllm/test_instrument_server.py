"""The real OpenAI server, stock native KV offloading, with and without
`HOSTPOOL_INSTRUMENT=vllm`: the outcome is vLLM's own, unchanged by hostpool.

On this CPU host vLLM's stock offloading worker refuses to start (`CPUOffloadingSpec.
get_worker`: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"),
before any `SharedOffloadRegion` or fallback tensor exists, and the server exits. So this
test checks what an instrumented deployment must never change: the exit code, the root
cause and the error lines (the final one included) are the same, and no frame of
hostpool's is in any traceback. The region itself, built through vLLM's own spec
classes, recorded and released by `cleanup()`, is checked in tests/vllm/test_instrument.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.vllm.server import (
    READY_DEADLINE_S,
    base_env,
    free_port,
    server_command,
    write_tiny_model,
)

REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")
# 64 MiB of host KV offload: the stock native backend, as an operator enables it.
OFFLOAD_ARGS = ("--kv-offloading-size", "0.0625", "--kv-offloading-backend", "native")


def run_server(workdir: Path, env: dict[str, str]) -> tuple[int, str]:
    """Start the server as a user does and wait for it to exit by itself (the deadline is
    an upper bound only); (exit code, log)."""
    workdir.mkdir()
    log_path = workdir / "server.log"
    command = server_command(write_tiny_model(workdir / "model"), free_port(), OFFLOAD_ARGS)
    with log_path.open("wb") as log:
        proc = subprocess.run(
            command,
            env=base_env(env),
            cwd=str(workdir),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=READY_DEADLINE_S,
            check=False,
        )
    return proc.returncode, log_path.read_text(errors="replace")


# vLLM ends the line with the core processes it has seen exit by then ("{}" or
# "{'EngineCore': 1}"): a race with their exit, with or without hostpool.
EXITED_PROCS = re.compile(r"proc\(s\): \{[^{}]*\}$")


def error_lines(log: str) -> list[str]:
    """The `SomeError: message` lines the server printed, in order (racy tail masked)."""
    lines = [x for x in log.splitlines() if ERROR_LINE.match(x)]
    errors = [EXITED_PROCS.sub("proc(s): {...}", x) for x in lines]
    assert errors, log[-4000:]
    return errors


def test_instrumented_server_outcome_is_vllms_own(tmp_path: Path) -> None:
    plain_code, plain = run_server(tmp_path / "plain", {})
    hooked_code, hooked = run_server(tmp_path / "instrumented", {"HOSTPOOL_INSTRUMENT": "vllm"})

    assert plain_code != 0, plain[-4000:]  # vLLM refuses CPU offloading on this host
    assert hooked_code == plain_code, hooked[-4000:]
    assert error_lines(hooked) == error_lines(plain)  # the final one included
    for log in (plain, hooked):
        assert f"Exception: {REFUSAL}" in log, log[-4000:]
    # hostpool stayed out of vLLM's way: none of its frames, events or warnings
    frames = [line for line in hooked.splitlines() if line.lstrip().startswith('File "')]
    assert frames and not [f for f in frames if "/hostpool/" in f]
    assert "hostpool" not in hooked.replace(str(tmp_path), "")
