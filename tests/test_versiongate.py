"""`VersionGate`: the release range a module's use of a foreign internal was read from,
checked once per process, one warning outside it."""

from __future__ import annotations

import pytest
import structlog

from hostpool.base.versiongate import UNTESTED_VERSION, VersionGate, release_of

GATE = VersionGate("somepkg", (0, 32), (0, 33), relies_on="its internals", fallback="none")


def test_release_numbers_decide() -> None:
    assert release_of("0.32.0+cpu") == (0, 32, 0)
    assert release_of("0.32.1.dev3+g1234") == (0, 32, 1)
    assert release_of("v1.2") == (1, 2)
    assert release_of("main") is None and release_of(None) is None
    assert GATE.tested == ">=0.32,<0.33"
    assert GATE.allows("0.32") and GATE.allows("0.32.0+cpu") and GATE.allows("0.32.9")
    assert not GATE.allows("0.31.9") and not GATE.allows("0.33.0") and not GATE.allows(None)


def test_outside_the_range_one_warning_names_it_all() -> None:
    gate = VersionGate("otherpkg", (1,), (2,), relies_on="its private thing", fallback="skip")
    with structlog.testing.capture_logs() as logs:
        assert gate.check("1.5.0")
        assert not gate.check("2.0.0")
        assert not gate.check("2.0.0")  # checked once: no second line
        assert not gate.check(None)
    warned = [e for e in logs if e["event"] == UNTESTED_VERSION]
    assert [(e["installed"], e["log_level"]) for e in warned] == [
        ("2.0.0", "warning"),
        ("unknown", "warning"),
    ]
    assert warned[0] | {"installed": None} == {
        "event": UNTESTED_VERSION,
        "log_level": "warning",
        "package": "otherpkg",
        "installed": None,
        "tested": ">=1,<2",
        "relies_on": "its private thing",
        "fallback": "skip",
    }


def test_waitress_is_a_gate_not_a_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    """hostpool requires `waitress>=3.0` with no upper bound (an engine's environment may
    hold a later one); the listener's reliance on its internals warns once outside 3.x."""
    import socket
    import tomllib
    from pathlib import Path

    from hostpool.net import listener

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "waitress>=3.0" in project["project"]["dependencies"]
    assert listener.WAITRESS.allows(listener.distribution_version("waitress"))
    monkeypatch.setattr(listener, "distribution_version", lambda name: "4.0.0")
    listener.check_waitress.cache_clear()  # read once per process: read again here
    try:
        with socket.socket() as sock, structlog.testing.capture_logs() as logs:
            listener.Listener(sock)
    finally:
        listener.check_waitress.cache_clear()
    (warned,) = [e for e in logs if e["event"] == UNTESTED_VERSION]
    assert (warned["package"], warned["installed"], warned["tested"]) == (
        "waitress",
        "4.0.0",
        ">=3.0,<4",
    )
