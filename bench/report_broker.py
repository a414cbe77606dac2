"""Markdown renderer for bench/broker_restart.py: what the broker saves an engine at
restart (attaching a populated pool vs populating it; a real vLLM's restart to its first
token with and without the broker). `BROKER` maps the page region to its renderer;
`bench/report.py` registers it. Every figure comes from the JSON."""

from __future__ import annotations

from typing import Any

from bench._common import format_size
from bench.report_tables import VERDICT, machine_line


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def broker_restart(data: dict[str, Any], _ctx: Any) -> str:
    """Attach vs populate, then the engine restarts where the run measured them."""
    a = data["attach_vs_populate"]
    target = a["target_share"]
    lines = [
        f"A populated {format_size(a['bytes'])} broker pool: `hostpool serve` populating it "
        f"vs a new process leasing it (`hostpool.broker.lease`: connect, manifest, "
        f"SCM_RIGHTS, checks, the chunks mapped), median of {len(a['rounds'])} lessees; "
        f"other processes used {a['other_cpus']:.2f} CPUs meanwhile; "
        f"{machine_line(data, sglang=False)}.",
        "",
        f"| populate | lease | lease / populate | <= {target:.0%} | lease + prefault "
        "| (lease + prefault) / populate |",
        "| ---: | ---: | ---: | --- | ---: | ---: |",
        f"| {a['populate_s']:.2f} s | {_ms(a['lease_s'])} "
        f"| {a['lease_share_of_populate']:.2%} | {VERDICT[bool(a['meets_target'])]} "
        f"| {_ms(a['lease_and_prefault_s'])} | {a['lease_and_prefault_share_of_populate']:.1%} |",
        "",
        "Prefault (MADV_POPULATE_WRITE over the leased mapping) is for a lessee that wants no "
        "page fault later; none needs it: a first touch is a minor fault on a page the broker "
        "already holds.",
    ]
    runs = data.get("engine_restart")
    if runs:
        lines += [
            "",
            "A real vLLM OpenAI server (the CPU build, the tiny model of tests/vllm) restarted "
            "after SIGKILL of its process group, then asked for a prompt whose 384-token "
            "prefix it had stored before the kill:",
            "",
            "| broker | start to first token | prefix tokens from the host tier | other CPUs |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in runs:
            lines.append(
                f"| {'yes' if r['broker'] else 'no (the stock spec)'} "
                f"| {r['restart_to_first_token_s']:.1f} s "
                f"| {r['prefix_tokens_from_host_tier']:.0f} / {r['prefix_tokens']} "
                f"| {r['other_cpus']:.2f} |"
            )
        lines += [
            "",
            "On this tiny model prefill is cheap and vLLM's own start dominates the time to "
            "first token: the rows show the mechanism (the prefix loaded back), not a large "
            "model's saving.",
        ]
    lines += ["", "Raw figures: `bench/results/broker_restart.json` "
              "(`python bench/broker_restart.py --engine`)."]  # fmt: skip
    return "\n".join(lines)


BROKER = {"broker_restart": broker_restart}
