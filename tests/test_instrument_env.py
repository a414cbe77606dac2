"""HOSTPOOL_INSTRUMENT, as the `.pth` hook reads it in a fresh interpreter: a
case-insensitive comma list of known integrations; an unknown name is one stderr line
naming the known ones, never an exception and never silence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hostpool.integrations import ENV, KNOWN, requested

PROBE = (
    "import sys; from hostpool.integrations import sglang, vllm; "
    "print(sglang.installed(), vllm.installed())"
)


def _child(value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ENV: value}
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("value", "known", "unknown"),
    [
        ("sglang", ["sglang"], []),
        ("SGLang", ["sglang"], []),
        (" vllm , sglang,,vllm ", ["vllm", "sglang"], []),
        ("1", [], ["1"]),
        ("sglang,bogus,BOGUS", ["sglang"], ["bogus"]),
        ("", [], []),
    ],
)
def test_the_variable_is_a_case_insensitive_comma_list(
    value: str, known: list[str], unknown: list[str]
) -> None:
    assert requested(value) == (known, unknown)


def test_mixed_case_activates_the_integration_in_a_new_interpreter() -> None:
    out = _child("SGLang")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
    assert out.stderr == ""


@pytest.mark.parametrize("value", ["1", "sglang,vlm"])
def test_an_unknown_name_is_one_warning_line_naming_the_known_ones(value: str) -> None:
    out = _child(value)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert ENV in lines[0] and all(name in lines[0] for name in KNOWN)
    assert out.stdout.split()[0] == str("sglang" in value)
