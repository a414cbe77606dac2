"""Markdown renderers for the `hostpool serve` benchmarks: probes while it populates
(serve_probe), SIGTERM to exit (serve_stop), what TLS and basic auth cost a scrape
(tls_scrape), and probes during a flood of wrong passwords (auth_flood).

`SERVE` maps a page region to its renderer; `SOURCES` names the results file of a
region that is not its own name (the short summaries in docs/cli.md read the same JSON
as the full tables in docs/benchmarks.md). `bench/report.py` registers
both. Every figure comes from the JSON; a verdict compares a figure with the target the
same file records.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench._common import format_size
from bench.report_tables import VERDICT, machine_line

STATUS_LABELS = {"0": "timed out"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _limit_ms(seconds: float) -> str:
    """A target in ms as the bench states it: 0.1 -> '100 ms'."""
    return f"{seconds * 1e3:g} ms"


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s"


def _answers(statuses: dict[str, int]) -> str:
    """'200 x 1, 503 x 1,785': each HTTP status (or a timeout) and how often it came."""
    return ", ".join(
        f"{STATUS_LABELS.get(code, code)} x {n:,}"
        for code, n in sorted(statuses.items(), key=lambda kv: int(kv[0]))
    )


def _pools(result: dict[str, Any]) -> str:
    names = list(result["pool_ready_seconds"])
    return f"pool{'s' if len(names) > 1 else ''} {', '.join(f'`{n}`' for n in names)}"


def serve_probe(data: dict[str, Any], _ctx: Any) -> str:
    """bench/serve_probe.py: /healthz, /readyz and /metrics latency during populate."""
    r, target = data["result"], data["targets"]["p99_s"]
    endpoints = r["endpoints"]
    cpus = data.get("machine", {}).get("cpus", "?")
    lines = [
        f"`hostpool serve` populating {format_size(r['bytes'])} ({_pools(r)}), probed from its "
        f"`hostpool.listening` line until /readyz answered 200 ({_s(r['populate_s'])}): "
        "/healthz, /readyz and /metrics in turn, each a GET on a new connection (connect, "
        f"request, whole body), {_ms(r['pause_between_rounds_s'])} between rounds; "
        f"{machine_line(data, sglang=False)}. The rest of the machine, the server's populate "
        f"included, used {r['other_cpus']:.2f} of {cpus} CPUs meanwhile.",
        "",
        f"| endpoint | probes | answers | p50 | p99 | max | p99 <= {_limit_ms(target)} |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for path, e in endpoints.items():
        lines.append(
            f"| `{path}` | {e['probes']:,} | {_answers(e['statuses'])} | {_ms(e['p50_s'])} "
            f"| {_ms(e['p99_s'])} | {_ms(e['max_s'])} | {VERDICT[e['p99_s'] <= target]} |"
        )
    lines += ["", "Raw figures and machine facts are in `bench/results/serve_probe.json`."]
    return "\n".join(lines)


def serve_probe_summary(data: dict[str, Any], _ctx: Any) -> str:
    """One sentence of serve_probe for the CLI section."""
    r, target = data["result"], data["targets"]["p99_s"]
    p99 = ", ".join(f"{path} {_ms(e['p99_s'])}" for path, e in r["endpoints"].items())
    met = all(e["p99_s"] <= target for e in r["endpoints"].values())
    return (
        f"Measured by `bench/serve_probe.py` ({str(data['date'])[:10]}): while `serve` "
        f"populated {format_size(r['bytes'])} for {_s(r['populate_s'])} on a "
        f"{data.get('machine', {}).get('cpus', '?')}-CPU host, the 99th percentile of a probe "
        f"on a new connection was {p99} (target {_limit_ms(target)}: {VERDICT[met]})."
    )


def _median(samples: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(s[key] for s in samples))


def serve_stop(data: dict[str, Any], _ctx: Any) -> str:
    """bench/serve_stop.py: SIGTERM to exit of `hostpool serve` vs a bare memfd process."""
    targets = data["targets"]
    ratio_target, tail_target = targets["ratio"], targets["last_release_to_exit_s"]
    cases = data["cases"]
    skipped = [f"{size} skipped: {why}." for size, why in data.get("skipped", {}).items()]
    if not cases:
        return "\n\n".join(["Not measured yet: run `bench/serve_stop.py`.", *skipped])
    rounds = sorted({c["rounds"] for c in cases.values()})
    lines = [
        "`hostpool serve` holding one populated pool, stopped with SIGTERM once /readyz "
        "answers 200, next to a bare process that has made and populated a memfd of the same "
        "size and on SIGTERM unmaps it, closes it and exits (what the kernel's unmapping "
        f"costs, plus the smallest interpreter exit): {' or '.join(map(str, rounds))} rounds "
        "per size, each "
        "side first in half of them; medians, ratios the median of each round's own; "
        f"{machine_line(data, sglang=False)}. Release and exit times come from `serve`'s "
        "JSON log.",
        "",
        f"| pool | serve: SIGTERM to exit | bare: SIGTERM to exit | ratio, median (rounds) "
        f"| <= {ratio_target:g}x | serve: SIGTERM to last release | last release to exit "
        f"| <= {_limit_ms(tail_target)} | other CPUs busy |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for size, c in cases.items():
        m = c["median"]
        span = f"{min(c['ratios']):.2f}-{max(c['ratios']):.2f}x"
        lines.append(
            f"| {size} | {_s(m['serve_sigterm_to_exit_s'])} | {_s(m['bare_sigterm_to_exit_s'])} "
            f"| {m['ratio']:.2f}x ({span}) | {VERDICT[m['ratio'] <= ratio_target]} "
            f"| {_s(_median(c['serve'], 'sigterm_to_last_release_s'))} "
            f"| {_ms(m['serve_last_release_to_exit_s'])} "
            f"| {VERDICT[m['serve_last_release_to_exit_s'] <= tail_target]} "
            f"| {c['other_cpus']:.2f} |"
        )
    for line in skipped:
        lines += ["", line]
    lines += [
        "",
        "Other CPUs busy: what the rest of the machine used while a size ran, the measured "
        "processes not counted. Samples and machine facts are in "
        "`bench/results/serve_stop.json`.",
    ]
    return "\n".join(lines)


def serve_stop_summary(data: dict[str, Any], _ctx: Any) -> str:
    """One sentence of serve_stop for the CLI section."""
    cases = data["cases"]
    if not cases:
        return "Not measured yet: run `bench/serve_stop.py`."
    ratio_target = data["targets"]["ratio"]
    times = ", ".join(
        f"{_s(c['median']['serve_sigterm_to_exit_s'])} at {size}" for size, c in cases.items()
    )
    ratios = ", ".join(f"{c['median']['ratio']:.2f}x" for c in cases.values())
    tails = [c["median"]["serve_last_release_to_exit_s"] for c in cases.values()]
    met = all(c["median"]["ratio"] <= ratio_target for c in cases.values())
    return (
        f"Measured by `bench/serve_stop.py` ({str(data['date'])[:10]}, medians): SIGTERM to "
        f"exit took {times}: {ratios} the time of a bare process unmapping a memfd of the "
        f"same size (target <= {ratio_target:g}x: {VERDICT[met]}). The process was gone "
        f"{_ms(min(tails))} to {_ms(max(tails))} after its last release; the time before "
        "that is closing the listener and releasing the pools, whose pages the kernel unmaps."
    )


TLS_MODES = {
    "keepalive": "kept open (as Prometheus scrapes)",
    "fresh": "new for each scrape (TCP, and the TLS handshake)",
}


def tls_scrape(data: dict[str, Any], _ctx: Any) -> str:
    """bench/tls_scrape.py: a /metrics scrape in plain HTTP, TLS, and TLS + basic auth."""
    medians, ratios = data["median_s"], data["median_ratio_to_plain"]
    targets, auth = data["targets"], data["auth"]
    cpus = data.get("machine", {}).get("cpus", "?")
    lines = [
        "A scrape of `hostpool serve`'s /metrics in plain HTTP, over TLS, and over TLS with "
        "basic auth (a bcrypt hash, cached once checked): three servers, GET /metrics from "
        f"each in {data['rounds']} rounds whose order rotates; medians, ratios the median of "
        f"each round's own to plain; {machine_line(data, sglang=False)}. The rest of the "
        f"machine, the three servers included, used {data['other_cpus']:.2f} of {cpus} CPUs "
        "meanwhile.",
        "",
        "| connection | plain | TLS | TLS + basic auth | TLS / plain | TLS + auth / plain |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, label in TLS_MODES.items():
        t, q = medians[mode], ratios[mode]
        lines.append(
            f"| {label} | {_ms(t['plain'])} | {_ms(t['tls'])} | {_ms(t['tls_auth'])} "
            f"| {q['tls']:.2f}x | {q['tls_auth']:.2f}x |"
        )
    keep = ratios["keepalive"]["tls_auth"]
    keep_target, cache_target = targets["keepalive_tls_auth_ratio"], targets["cache_ratio"]
    lines += [
        "",
        "| target | measured | result |",
        "| --- | --- | --- |",
        f"| a kept-open scrape with TLS and basic auth <= {keep_target:g}x a plain one "
        f"| {keep:.2f}x | {VERDICT[keep <= keep_target]} |",
        f"| a cached basic-auth check <= {cache_target:.0%} of a bcrypt round "
        f"| {auth['cache_hit_s'] * 1e6:.1f} us vs {_ms(auth['bcrypt_round_s'])} "
        f"({auth['ratio']:.4%}) | {VERDICT[auth['ratio'] <= cache_target]} |",
        "",
        "Samples' medians and machine facts are in `bench/results/tls_scrape.json`.",
    ]
    return "\n".join(lines)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} x {v:,}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def auth_flood(data: dict[str, Any], _ctx: Any) -> str:
    """bench/auth_flood.py: /healthz and /metrics with the right password during a flood
    of wrong ones, on serve and on the exporter."""
    cpus = data.get("machine", {}).get("cpus", "?")
    target = data["p99_target_s"]
    lines = [
        f"Wrong basic-auth passwords, {data['rate_per_s']:g} a second for "
        f"{data['flood_s']:g} s, each new and on a new connection, from {data['sources']} "
        "loopback addresses in turn (so neither remembered failures nor one address's "
        "wait can answer them), against `hostpool serve` and `hostpool exporter` (plain "
        f"HTTP, one user, bcrypt cost {data['bcrypt_cost']}: a round took "
        f"{_ms(data['bcrypt_round_s'])} here). Probes with the right password, each on a "
        f"new connection, {data['quiet_s']:g} s before the flood and during it; "
        f"{machine_line(data, sglang=False)}. The rest of the machine used "
        f"{data['other_cpus']:.2f} of {cpus} CPUs meanwhile.",
        "",
        "| target | probe | answered | p50 quiet | p99 quiet | p50 flood | p99 flood | max flood |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    worst = 0.0
    answered = True
    for name, result in data["targets"].items():
        quiet, flood = result["quiet"], result["flood"]
        for path in ("/healthz", "/metrics"):
            q, f = quiet[path], flood[path]
            worst = max(worst, f["p99_s"])
            answered = answered and f["ok"] == f["probes"]
            lines.append(
                f"| {name} | {path} | {f['ok']:,} of {f['probes']:,} | {_ms(q['p50_s'])} "
                f"| {_ms(q['p99_s'])} | {_ms(f['p50_s'])} | {_ms(f['p99_s'])} "
                f"| {_ms(f['max_s'])} |"
            )
    lines += [
        "",
        "| target | its CPU quiet | its CPU flood | the flood's answers | refusals it logged |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for name, result in data["targets"].items():
        flood = result["flood"]
        lines.append(
            f"| {name} | {result['quiet']['server_cpus']:.2f} | {flood['server_cpus']:.2f} "
            f"| {_counts(flood['flood_answers'])} | {_counts(flood['failed_logins_logged'])} |"
        )
    met = worst <= target and answered
    lines += [
        "",
        "| target | measured | result |",
        "| --- | --- | --- |",
        f"| /healthz and /metrics answered 200 during the flood, p99 <= {target:g} s "
        f"| worst p99 {_ms(worst)}, {'all' if answered else '**not all**'} answered "
        f"| {VERDICT[met]} |",
        "",
        "CPU: seconds of CPU the target used per second. Samples' figures and machine facts "
        "are in `bench/results/auth_flood.json`.",
    ]
    return "\n".join(lines)


def make_run(data: dict[str, Any], _ctx: Any) -> str:
    """bench/make_run.py: `make run` from a fresh clone until /metrics, and its venv."""
    rounds, target = data["rounds"], data["targets"]["metrics_s"]
    warm = rounds[1:] or rounds
    worst = max(r["metrics_s"] for r in warm)
    venv = warm[-1]
    # The machine facts name the bench's own interpreter's torch, not the venv's.
    measured = {**data, "machine": {**data["machine"], "torch": "none in the venv measured"}}
    lines = [
        f"`make run` in a fresh `git clone` (its own .venv: `pip install -e .`, the C "
        f"extension compiled), timed from the start of make until GET /metrics answered "
        f"200, one {data['config']['size']} pool; {len(rounds)} rounds, the first filling "
        f"pip's cache; {machine_line(measured, sglang=False)}.",
        "",
        f"| round | pip cache | /metrics after | <= {target:g} s | venv on disk | packages "
        "| torch |",
        "| ---: | --- | ---: | --- | ---: | ---: | --- |",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {'as found' if i == 0 else 'warm'} | {_s(r['metrics_s'])} "
            f"| {VERDICT[r['metrics_s'] <= target] if i else 'n/a'} "
            f"| {format_size(r['venv_bytes'])} | {len(r['packages'])} "
            f"| {'**yes**' if r['torch'] else 'no'} |"
        )
    lines += [
        "",
        f"Warm, the slowest round reached /metrics in {_s(worst)}; the venv holds "
        f"{', '.join(sorted(venv['packages']))}. Raw figures are in "
        "`bench/results/make_run.json` (`python bench/make_run.py`).",
    ]
    return "\n".join(lines)


SERVE = {
    "make_run": make_run,
    "serve_probe": serve_probe,
    "serve_stop": serve_stop,
    "tls_scrape": tls_scrape,
    "auth_flood": auth_flood,
    "serve_probe-summary": serve_probe_summary,
    "serve_stop-summary": serve_stop_summary,
}
SOURCES = {"serve_probe-summary": "serve_probe", "serve_stop-summary": "serve_stop"}
