"""Markdown for the host view's benchmark (bench/host_scan.py); `bench/report.py`
registers it (README region `host_scan`)."""

from __future__ import annotations

from typing import Any

from bench.report_tables import machine_line

VERDICT = {True: "pass", False: "**fail**"}
SIDES = {
    "shm": "`hostpool shm --json` (scan + document, in-process)",
    "node": "`exporter --node` scrape (`HostCollector.collect()`)",
}


def render_host_scan(data: dict[str, Any], ctx: object) -> str:
    """The scan and the node scrape against the bare read of the same /proc files."""
    case, targets = data["case"], data["targets"]
    m = case["median"]
    lines = [
        "| side | wall (median) | CPU (median) | ratio to the bare read, wall / CPU "
        "(median of rounds) |",
        "| --- | ---: | ---: | ---: |",
        f"| bare read of the same files, listings and stats | {m['bare_wall_s']:.3f} s "
        f"| {m['bare_cpu_s']:.3f} s | 1 |",
    ]
    verdicts = []
    for side, label in SIDES.items():
        lines.append(
            f"| {label} | {m[f'{side}_wall_s']:.3f} s | {m[f'{side}_cpu_s']:.3f} s "
            f"| {m[f'ratio_{side}_wall']:.2f}x / {m[f'ratio_{side}_cpu']:.2f}x |"
        )
        ratio_ok = m[f"ratio_{side}_cpu"] <= targets["ratio"]
        wall_ok = m[f"{side}_wall_s"] <= targets["wall_s"]
        verdicts.append(
            f"{side}: <= {targets['ratio']:g}x {VERDICT[ratio_ok]}, "
            f"< {targets['wall_s']:g} s {VERDICT[wall_ok]}"
        )
    cli = case["cli"]
    found = case["found"]
    lines += [
        f"| `hostpool shm --json` as a command (imports included), once | {cli['wall_s']:.2f} s "
        "| | |",
        "",
        f"The host: {case['processes']} processes x {case['fds_per_process']} fds, "
        f"{case['files']:,} /dev/shm files ({case['files_held']:,} held), "
        f"{case['segments']} SysV segments, {case['namespaces']} mount namespaces; the scan "
        f"listed {found['objects']:,} objects with {found['holder_rows']:,} holders "
        f"({case['host_processes']} processes on the host). Targets (issue 33): "
        f"{'; '.join(verdicts)}. Ratios are CPU time: other work on the machine "
        f"(`other_cpus` {case['other_cpus']:.2f} of {data['machine'].get('cpus', '?')}, "
        f"load {case['loadavg'][0]:.1f}) stretches wall time on every side. "
        f"{machine_line(data, sglang=False)}; samples and per-round ratios in "
        "`bench/results/host_scan.json`.",
    ]
    return "\n".join(lines)


HOST = {"host_scan": render_host_scan}
