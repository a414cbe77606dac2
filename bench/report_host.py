"""Markdown for the host view's benchmark (bench/host_scan.py); `bench/report.py`
registers it (README region `host_scan`)."""

from __future__ import annotations

from typing import Any

from bench._common import RESULTS_DIR, read_json
from bench.report_tables import machine_line

VERDICT = {True: "pass", False: "**fail**"}
SIDES = {
    "shm": "`hostpool shm --json` (scan + document, in-process)",
    "node": "`exporter --node` scrape (`HostCollector.collect()`)",
}


def render_host_scan(data: dict[str, Any], ctx: object) -> str:
    """The scan and the node scrape against the bare read of the same /proc files."""
    targets = data["targets"]
    lines = [
        "| case | side | wall (median) | CPU (median) | ratio to the bare read, wall / CPU "
        "(median of rounds) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    verdicts, notes = [], []
    for name, case in data["cases"].items():
        m = case["median"]
        lines.append(
            f"| {name} | bare read of the same files, listings and stats "
            f"| {m['bare_wall_s']:.3f} s | {m['bare_cpu_s']:.3f} s | 1 |"
        )
        for side, label in SIDES.items():
            lines.append(
                f"| {name} | {label} | {m[f'{side}_wall_s']:.3f} s | {m[f'{side}_cpu_s']:.3f} s "
                f"| {m[f'ratio_{side}_wall']:.2f}x / {m[f'ratio_{side}_cpu']:.2f}x |"
            )
            ratio_ok = m[f"ratio_{side}_cpu"] <= targets["ratio"]
            wall_ok = m[f"{side}_wall_s"] <= targets["wall_s"]
            verdicts.append(
                f"{name} {side}: <= {targets['ratio']:g}x {VERDICT[ratio_ok]}, "
                f"< {targets['wall_s']:g} s {VERDICT[wall_ok]}"
            )
        lines.append(
            f"| {name} | `hostpool shm --json` as a command (imports included), once "
            f"| {case['cli']['wall_s']:.2f} s | | |"
        )
        found = case["found"]
        fds = case["fds_per_process"]
        notes.append(
            f"`{name}`: {case['processes']} processes"
            + (f" x {fds} fds" if fds else "")
            + f" ({case['memfds_per_process']:,} mapped memfds each), "
            f"{case['files']:,} /dev/shm files ({case['files_held']:,} held), "
            f"{case['segments']} SysV segments, "
            f"{case['namespaces']} mount namespaces; the scan listed {found['objects']:,} "
            f"objects with {found['holder_rows']:,} holders ({case['host_processes']} "
            f"processes on the host; other CPUs busy {case['other_cpus']:.2f} of "
            f"{data['machine'].get('cpus', '?')}, load {case['loadavg'][0]:.1f})"
        )
    lines += [
        "",
        f"Targets (issue 33, set for the `host` case; `memfds` shows where a scan does the "
        f"most per fd): {'; '.join(verdicts)}. Ratios are CPU "
        "time (other work on the machine stretches wall time on every side). "
        + "; ".join(notes)
        + f". {machine_line(data, sglang=False)}; samples and per-round ratios in "
        "`bench/results/host_scan.json`.",
    ]
    return "\n".join(lines)


def _exporter_run(run: dict[str, Any]) -> dict[str, Any]:
    """A real exporter's run as a row shows it: its scrape's wall time (a 503 and when
    the figures came, where the first scrape got no scan), the reader's peak."""
    if "error" in run:
        return {**run, "wall": "failed", "vmhwm_mib": float("nan")}
    wall = f"{run['scrape_s']:.1f} s"
    if run.get("status", 200) != 200:
        wall = f"HTTP {run['status']} at {wall} (figures at {run['answered_s']:.0f} s)"
    return {**run, "wall": wall, "seconds": run["scrape_s"], "vmhwm_mib": run["reader_vmhwm_mib"]}


def _wall(run: dict[str, Any]) -> str:
    return str(run["wall"]) if "wall" in run else f"{run['seconds']:.1f} s"


def render_host_scale(data: dict[str, Any], ctx: object) -> str:
    """bench/host_scale.py: each case's node scrape and `shm --json`, wall time and peak
    RSS, beside the same cases run on the code before the bounds (host_scale_old.json)."""
    old_path = RESULTS_DIR / "host_scale_old.json"
    old = read_json(old_path) if old_path.exists() else {"cases": []}
    before = {(c["case"], r["side"]): r for c in old["cases"] for r in c["runs"]}
    limits = data["limits_mib"]
    lines = [
        "| case | side | wall | peak RSS (VmHWM) | truncated (phase) | before the bounds: "
        "wall, peak RSS, truncated |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for case in data["cases"]:
        what = {
            "files": f"{case['count']:,} empty files in one directory",
            "deep": f"{case['count']:,} directories deep, a file every 3 levels",
            "mounts": f"{case['namespaces']} namespaces x {case['count']:,} bind mounts",
        }[case["case"]]
        for run in case["runs"]:
            side = run["side"]
            if side == "exporter":  # the HTTP scrape's time, the reader's peak (it scans)
                run = _exporter_run(run)
            truncated = "yes" if run.get("truncated") else "no"
            if run.get("phase"):
                truncated += f" ({', '.join(run['phase'])})"
            was = before.get((case["case"], side))
            if was is not None and side == "exporter":
                was = _exporter_run(was)
            then = (
                f"{_wall(was)}, {was['vmhwm_mib']:,.0f} MiB, "
                f"{'yes' if was.get('truncated') else 'no'}"
                if was
                else "-"
            )
            truncated = truncated if side != "shm" else "-"
            then = then if side != "shm" or not was else then.rpartition(",")[0]
            lines.append(
                f"| {what} | {side} | {_wall(run)} "
                f"| {run['vmhwm_mib']:,.0f} MiB "
                f"| {truncated} | {then} |"
            )
    lines += [
        "",
        f"node: one `exporter --node` scrape (the reader's `HostCollector.collect()`, 5 s "
        f"budget; the DaemonSet's limit is {limits['node']} MiB); exporter: a real "
        "`hostpool exporter --node`, one /metrics scrape over HTTP, the peak RSS of the "
        "process that scans (its reader); shm: `hostpool shm "
        f"--json` (no budget; at most {limits['shm']} MiB). Each side a fresh process in "
        "a private mount namespace holding the case. "
        f"{machine_line(data, sglang=False)}; `bench/results/host_scale.json` and "
        "`host_scale_old.json`.",
    ]
    return "\n".join(lines)


HOST = {"host_scan": render_host_scan, "host_scale": render_host_scale}
