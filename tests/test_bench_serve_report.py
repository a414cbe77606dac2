"""Docs sections of the serve benchmarks (bench/report_serve.py): every figure and
verdict comes from the results file, a missed target reads as a failure, and the short
summaries in the CLI reference (docs/cli.md) read the same JSON as the full tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import report_serve
from bench._common import RESULTS_DIR, load_verdict, read_json, write_json
from bench.report import RENDERERS, Context, render_region, replace_region

ROOT = Path(__file__).resolve().parents[1]
CTX = Context(results_dir=Path("/nonexistent"), page=None, charts=False)
MACHINE = {"kernel": "6.1.0-test", "cpus": 3, "python": "3.11.0", "torch": "2.0", "sglang": "9"}


def _endpoint(p99: float, statuses: dict[str, int]) -> dict[str, Any]:
    return {
        "probes": sum(statuses.values()),
        "statuses": statuses,
        "p50_s": 0.0012,
        "p99_s": p99,
        "max_s": 0.25,
    }


def probe_data(metrics_p99: float) -> dict[str, Any]:
    return {
        "date": "2031-02-03T04:05:06Z",
        "machine": MACHINE,
        "targets": {"p99_s": 0.1},
        "result": {
            "bytes": 3 << 30,
            "pause_between_rounds_s": 0.02,
            "populate_s": 12.345,
            "pool_ready_seconds": {"kv": 12.3},
            "other_cpus": 1.23,
            "endpoints": {
                "/healthz": _endpoint(0.0456, {"200": 1234}),
                "/readyz": _endpoint(0.0333, {"503": 1233, "200": 1}),
                "/metrics": _endpoint(metrics_p99, {"200": 1233, "0": 1}),
            },
        },
    }


def _case(serve_s: float, bare_s: float, tail_s: float) -> dict[str, Any]:
    serve = [
        {
            "sigterm_to_exit_s": serve_s,
            "sigterm_to_last_release_s": serve_s - tail_s,
            "last_release_to_exit_s": tail_s,
            "serve_stopped_to_exit_s": tail_s,
        }
    ]
    return {
        "bytes": 1 << 30,
        "rounds": 1,
        "serve": serve,
        "bare": [{"sigterm_to_exit_s": bare_s}],
        "ratios": [serve_s / bare_s],
        "other_cpus": 0.12,
        "median": {
            "serve_sigterm_to_exit_s": serve_s,
            "serve_last_release_to_exit_s": tail_s,
            "serve_stopped_to_exit_s": tail_s,
            "bare_sigterm_to_exit_s": bare_s,
            "ratio": serve_s / bare_s,
        },
    }


def stop_data(cases: dict[str, Any], skipped: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "date": "2031-02-03T04:05:06Z",
        "machine": MACHINE,
        "targets": {"ratio": 1.2, "last_release_to_exit_s": 0.5},
        "cases": cases,
        "skipped": skipped or {},
    }


def tls_data(keepalive_auth_ratio: float, cache_ratio: float) -> dict[str, Any]:
    times = {"plain": 0.002, "tls": 0.0025, "tls_auth": 0.0031}
    return {
        "generated_at": "2031-02-03T04:05:06Z",
        "machine": MACHINE,
        "rounds": 17,
        "other_cpus": 0.77,
        "median_s": {"keepalive": times, "fresh": times},
        "median_ratio_to_plain": {
            "keepalive": {"tls": 1.11, "tls_auth": keepalive_auth_ratio},
            "fresh": {"tls": 1.76, "tls_auth": 1.83},
        },
        "auth": {"cache_hit_s": 1.5e-6, "bcrypt_round_s": 0.0604, "ratio": cache_ratio},
        "targets": {"keepalive_tls_auth_ratio": 1.5, "cache_ratio": 0.01},
    }


def rows(text: str) -> dict[str, str]:
    """A markdown table's rows by their first cell."""
    return {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    }


def test_serve_probe_rows_are_the_json_figures_and_a_missed_p99_fails() -> None:
    text = report_serve.serve_probe(probe_data(metrics_p99=0.1234), CTX)
    table = rows(text)
    assert table["`/healthz`"].endswith(
        "| 1,234 | 200 x 1,234 | 1.2 ms | 45.6 ms | 250.0 ms | pass |"
    )
    assert "200 x 1, 503 x 1,233" in table["`/readyz`"]
    assert "timed out x 1" in table["`/metrics`"]
    assert table["`/metrics`"].endswith("| 123.4 ms | 250.0 ms | **fail** |")
    assert "p99 <= 100 ms" in text
    assert "3 GiB (pool `kv`)" in text and "(12.35 s)" in text and "20.0 ms between" in text
    assert "Linux 6.1.0-test, 3 CPUs" in text and "2031-02-03" in text
    assert "sglang" not in text
    assert "used 1.23 of 3 CPUs" in text

    summary = report_serve.serve_probe_summary(probe_data(metrics_p99=0.1234), CTX)
    assert "/metrics 123.4 ms" in summary and summary.endswith("(target 100 ms: **fail**).")
    passing = report_serve.serve_probe_summary(probe_data(metrics_p99=0.0999), CTX)
    assert passing.endswith("(target 100 ms: pass).")


def test_serve_stop_judges_each_size_on_its_own_medians() -> None:
    data = stop_data(
        {"1 GiB": _case(0.5, 0.5, 0.01), "4 GiB": _case(1.3, 1.0, 0.7)},
        skipped={"16 GiB": "MemAvailable 10 GiB < 16 GiB + 2 GiB headroom"},
    )
    text = report_serve.serve_stop(data, CTX)
    table = rows(text)
    assert table["1 GiB"] == (
        "| 1 GiB | 0.50 s | 0.50 s | 1.00x (1.00-1.00x) | pass | 0.49 s | 10.0 ms | pass | 0.12 |"
    )
    assert table["4 GiB"] == (
        "| 4 GiB | 1.30 s | 1.00 s | 1.30x (1.30-1.30x) | **fail** | 0.60 s | 700.0 ms "
        "| **fail** | 0.12 |"
    )
    assert "16 GiB skipped: MemAvailable 10 GiB < 16 GiB + 2 GiB headroom." in text
    assert "| <= 1.2x |" in text and "| <= 500 ms |" in text

    summary = report_serve.serve_stop_summary(data, CTX)
    assert "0.50 s at 1 GiB, 1.30 s at 4 GiB: 1.00x, 1.30x" in summary
    assert "(target <= 1.2x: **fail**)" in summary
    assert "gone 10.0 ms to 700.0 ms after its last release" in summary


def test_serve_stop_without_a_measured_size_says_so() -> None:
    data = stop_data({}, skipped={"1 GiB": "MemAvailable 1 GiB < 1 GiB + 2 GiB headroom"})
    text = report_serve.serve_stop(data, CTX)
    assert text.startswith("Not measured yet: run `bench/serve_stop.py`.")
    assert "1 GiB skipped: MemAvailable 1 GiB < 1 GiB + 2 GiB headroom." in text
    assert "|" not in text
    assert report_serve.serve_stop_summary(data, CTX).startswith("Not measured yet")


@pytest.mark.parametrize(
    ("keep", "cache", "verdicts"),
    [(1.01, 0.001, ("pass", "pass")), (1.51, 0.02, ("**fail**", "**fail**"))],
)
def test_tls_scrape_targets_follow_the_figures(
    keep: float, cache: float, verdicts: tuple[str, str]
) -> None:
    text = report_serve.tls_scrape(tls_data(keep, cache), CTX)
    table = rows(text)
    assert table["kept open (as Prometheus scrapes)"] == (
        f"| kept open (as Prometheus scrapes) | 2.0 ms | 2.5 ms | 3.1 ms | 1.11x | {keep:.2f}x |"
    )
    kept, cached = (line for name, line in table.items() if name.startswith("a "))
    assert kept.endswith(f"| {keep:.2f}x | {verdicts[0]} |") and "<= 1.5x" in kept
    assert cached.endswith(f"({cache:.4%}) | {verdicts[1]} |") and "<= 1% of" in cached
    assert "1.5 us vs 60.4 ms" in cached
    assert "in 17 rounds" in text and "2031-02-03" in text and "used 0.77 of 3 CPUs" in text


def test_every_serve_region_is_registered_with_an_existing_results_file() -> None:
    for name in report_serve.SERVE:
        assert RENDERERS[name] is report_serve.SERVE[name]
        source = report_serve.SOURCES.get(name, name)
        assert (RESULTS_DIR / f"{source}.json").exists(), source


def test_report_writes_a_summary_region_from_its_source_file(tmp_path: Path) -> None:
    """bench/report.py, run as make runs it, fills a summary region from the JSON that
    the region names as its source, and leaves the text around the region alone."""
    results = tmp_path / "results"
    results.mkdir()
    write_json(results / "serve_stop.json", stop_data({"2 GiB": _case(0.9, 1.0, 0.02)}))
    readme = tmp_path / "README.md"
    readme.write_text(
        "before\n<!-- bench:serve_stop-summary:start -->\nold\n"
        "<!-- bench:serve_stop-summary:end -->\nafter\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "report.py"),
            "--results-dir",
            str(results),
            "--page",
            str(readme),
            "--only",
            "serve_stop-summary",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("before\n<!-- bench:serve_stop-summary:start -->\nMeasured by")
    assert "0.90 s at 2 GiB: 0.90x" in text and "old" not in text
    assert text.endswith("<!-- bench:serve_stop-summary:end -->\nafter\n")


@pytest.mark.parametrize("name", sorted(report_serve.SERVE))
def test_the_docs_show_what_the_committed_results_say(name: str) -> None:
    """Each serve region (in README.md or a page under docs/) is what its results file
    renders to now (rerun bench/report.py after a benchmark)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    start = f"<!-- bench:{name}:start -->"
    holders = [p.read_text() for p in pages if start in p.read_text()]
    data = read_json(RESULTS_DIR / f"{report_serve.SOURCES.get(name, name)}.json")
    body = render_region(name, data, CTX)
    assert holders, name
    for text in holders:
        assert replace_region(text, name, body) == text


def _report(results: Path, readme: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "report.py"), "--results-dir", str(results),
         "--page", str(readme), "--no-charts", "--only", "serve_stop", *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("other_cpus", "marked"),
    [(0.12, None), (0.35, "Measured under load: other processes used 0.35")],
)
def test_a_table_from_a_busy_run_is_marked_and_strict_refuses_it(
    tmp_path: Path, other_cpus: float, marked: str | None
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    case = _case(0.9, 1.0, 0.02) | {"other_cpus": other_cpus}
    write_json(results / "serve_stop.json", stop_data({"2 GiB": case}))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:serve_stop:start -->\n<!-- bench:serve_stop:end -->\n")
    done = _report(results, readme)
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    strict = _report(results, readme, "--strict")
    if marked is None:
        assert "color:red" not in text and strict.returncode == 0
    else:
        assert f'<p style="color:red"><b>{marked}' in text
        assert strict.returncode == 1 and "not quiet (marked in red): serve_stop" in strict.stderr


def test_a_run_that_recorded_no_load_is_not_clean() -> None:
    assert load_verdict({"cases": {"a": {"x": 1.0}}}) is not None
    assert "not recorded" in str(load_verdict({"cases": {"a": {"x": 1.0}}}))
    assert load_verdict({"rounds": [{"other_cpus": 0.1}, {"other_cpus": 0.3}]}) is None
    assert "0.25" in str(load_verdict({"rounds": [{"other_cpus": 0.2}, {"other_cpus": 0.3}]}))
