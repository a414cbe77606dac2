"""`VersionGate`: the release range a module's use of a foreign internal was read from,
checked once per process, one warning outside it."""

from __future__ import annotations

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
