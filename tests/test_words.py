"""The vocabulary is typed once (hostpool.words): a misspelled word is a type error, and
each fixed label set is exactly its Literal's values."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from mypy import api

from hostpool import errors, words
from hostpool.core.ledger import Ledger


def _mypy(tmp_path: Path, source: str) -> tuple[str, int]:
    path = tmp_path / "use_words.py"
    path.write_text(source)
    out, err, status = api.run(["--strict", "--no-error-summary", str(path)])
    return out + err, status


def test_a_misspelled_word_is_a_type_error(tmp_path: Path) -> None:
    out, status = _mypy(
        tmp_path,
        "from hostpool.errors import AllocationError\n"
        "from hostpool.core.ledger import get_ledger\n"
        'AllocationError("x", reason="budgett")\n'
        'get_ledger().record_failure("kv", "no_memroy")\n'
        'get_ledger().regions(state="released")\n',
    )
    assert status == 1
    assert out.count("error:") == 3, out
    for wrong in ("budgett", "no_memroy", "released"):
        assert f"Literal['{wrong}']" in out, out


def test_the_right_words_type_check(tmp_path: Path) -> None:
    out, status = _mypy(
        tmp_path,
        "from hostpool.errors import AllocationError\n"
        "from hostpool.core.ledger import get_ledger\n"
        'AllocationError("x", reason="budget")\n'
        'get_ledger().record_failure("kv", "no_memory")\n'
        'get_ledger().regions(state="released_mapped")\n',
    )
    assert status == 0, out


def test_label_sets_are_their_literals() -> None:
    assert get_args(words.FailureReason) == errors.FAILURE_REASONS
    assert words.RELEASE_HOWS == ("explicit", "tensor", "finalizer")
    assert set(words.POPULATE_CHOICES) == {"auto", *words.POPULATE_MODES}


def test_counters_are_a_frozen_copy() -> None:
    ledger = Ledger()
    ledger.record_failure("kv", "budget")
    counters = ledger.counters()
    assert counters.failures_total == {("kv", "budget"): 1}
    counters.failures_total[("kv", "budget")] = 99  # a copy: the ledger is untouched
    assert ledger.counters().failures_total == {("kv", "budget"): 1}
    try:
        counters.known_pools = []  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("LedgerCounters is not frozen")
