"""`hostpool.populate_progress` (off a terminal) carries the rate so far and the time left
over every pool, consistent with each other."""

from __future__ import annotations

import io

import pytest
from structlog.testing import capture_logs

from hostpool.cli.progress import PopulateProgress


def test_progress_events_carry_rate_and_eta() -> None:
    stream = io.StringIO()  # not a TTY: events, no bar
    total = 8 << 20
    with capture_logs() as logs, PopulateProgress(2 * total, stream) as progress:
        for pool in ("kv", "swa"):
            progress(pool, 0, total)
            for quarter in range(1, 5):
                progress(pool, quarter * total // 4, total)
    assert stream.getvalue() == ""
    events = [e for e in logs if e["event"] == "hostpool.populate_progress"]
    assert [(e["pool"], e["done"]) for e in events] == [
        (pool, q * total // 4) for pool in ("kv", "swa") for q in range(1, 5)
    ]
    for i, e in enumerate(events):
        assert isinstance(e["rate_bytes_per_s"], int) and e["rate_bytes_per_s"] > 0, e
        done_all = (i + 1) * total // 4
        left = 2 * total - done_all
        # eta_s is what is left over every pool at the rate so far, to 0.1 s
        assert e["eta_s"] == pytest.approx(left / e["rate_bytes_per_s"], abs=0.051), e
    assert events[-1]["eta_s"] == 0.0
