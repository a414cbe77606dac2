"""vLLM's offload manager and worker on the broker (`hostpool serve`), driven through
vLLM's own interfaces in real processes: an engine killed by SIGKILL between a store's
start and its completion leaves that chunk unadopted, while the completed ones are adopted
by the next engine and load back byte for byte; an engine of another model adopts
nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import waiting
from tests.test_serve import Served, start_serve
from tests.vllm.server import run_vllm_python

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("broker_manager_child.py")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[Served, str]]:
    sock = str(tmp_path / "run" / "broker.sock")
    served = start_serve(
        tmp_path, "--pool", "kv=2MiB", "--pool", "tiny=64KiB", "--share-socket", sock
    )
    yield served, sock
    served.kill()


def run(
    sock: str, phase: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, object] | None, str]:
    code = f"import runpy, sys; sys.argv = ['child', {sock!r}, {phase!r}]; " + (
        f"runpy.run_path({str(CHILD)!r}, run_name='__main__')"
    )
    proc = run_vllm_python(code, env=env)
    log = proc.stdout + proc.stderr
    match = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    return proc.returncode, json.loads(match.group(1)) if match else None, log


def test_only_completed_stores_survive_a_killed_engine(broker: tuple[Served, str]) -> None:
    served, sock = broker
    code, stored, log = run(sock, "store")
    assert code == -9 and stored is not None, log[-4000:]
    code, adopted, log = run(sock, "adopt")
    assert code == 0 and adopted is not None, log[-4000:]
    # A and B completed: adopted, at the chunks they were stored in; C never completed
    assert adopted["lookup"] == ["HIT", "HIT", "MISS"], log[-3000:]
    assert adopted["chunks"] == stored["chunks"][:2]  # type: ignore[index]
    assert adopted["restored"] is True  # the bytes the killed engine stored, loaded back
    code, other, log = run(sock, "other")
    assert code == 0 and other is not None, log[-4000:]
    assert other["lookup"] == ["MISS", "MISS", "MISS"]
    assert adoptions(served) == [
        (0, {}, "fresh", None),  # the first engine: a new index
        (2, {"unfinished": 1}, None, None),
        (0, {"identity": 2}, "identity", "model"),
    ]
    metrics = served.get("/metrics")[1]
    assert 'hostpool_broker_adopted_blocks_total{pool="kv"} 2.0' in metrics
    assert 'hostpool_broker_discarded_blocks_total{pool="kv",reason="unfinished"} 1.0' in metrics
    assert 'hostpool_broker_discarded_blocks_total{pool="kv",reason="identity"} 2.0' in metrics


def adoptions(served: Served) -> list[tuple[object, ...]]:
    """The broker's hostpool.broker_adopted events: (blocks, discarded, reason, field)."""
    return [
        (e["blocks"], e["discarded"], e["reason"], e["field"])
        for e in (json.loads(x) for x in served.log().splitlines() if x.startswith("{"))
        if e["event"] == "hostpool.broker_adopted"
    ]


def test_another_prefix_hash_seed_adopts_nothing(broker: tuple[Served, str]) -> None:
    """Block hashes made under PYTHONHASHSEED=7 are other keys: the engine adopts nothing
    and says the seed differs; the next engine of the old seed finds nothing either (the
    index was started over: fail closed)."""
    served, sock = broker
    code, _, log = run(sock, "store")
    assert code == -9, log[-4000:]
    code, seeded, log = run(sock, "adopt", env={"PYTHONHASHSEED": "7"})
    assert code == 0 and seeded is not None, log[-4000:]
    assert seeded["lookup"] == ["MISS", "MISS", "MISS"]
    code, again, log = run(sock, "adopt")
    assert code == 0 and again is not None, log[-4000:]
    assert again["lookup"] == ["MISS", "MISS", "MISS"]
    assert adoptions(served)[1:] == [
        (0, {"identity": 2, "unfinished": 1}, "identity", "hash_seed_source"),
        (0, {}, "identity", "hash_seed_source"),
    ]


def test_a_pool_smaller_than_the_worker_needs_is_one_clear_error(
    broker: tuple[Served, str],
) -> None:
    served, sock = broker
    code, small, log = run(sock, "small")
    assert code == 0 and small is not None, log[-4000:]
    error = str(small["error"])
    assert error.startswith("broker pool 'tiny' holds 65536 bytes; this worker needs "), error
    assert "cpu_bytes_to_use" in error
    # the lease was ended with the error (the broker sees the connection close)
    waiting.wait_for(
        lambda: 'hostpool_broker_leases{pool="tiny"} 0.0' in served.get("/metrics")[1],
        "the lease of the too-small pool to end",
    )
