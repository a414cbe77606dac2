"""Turn bench/results/*.json into markdown tables, charts and the docs' bench sections.

Each benchmark has a renderer, `RENDERERS[name]`, that reads `bench/results/<name>.json`
and returns markdown (and writes any charts under docs/assets/, inside the MkDocs site).
The markdown is printed and, where a page (README.md or one under docs/, most of them
docs/benchmarks.md) has a region `<!-- bench:<name>:start -->` ... `<!-- bench:<name>:end
-->`, written between the markers. A region may render another file's JSON
(`report_serve.SOURCES`: the serve summaries). Figures are never typed by hand: rerun the
benchmark, then this script. A table from a run where other processes used more than
`QUIET_OTHER_CPUS` on average (or that recorded no load) is marked in red as such, and
`--strict` exits 1 for it.

Adding a benchmark's section:

    @renderer("overhead")
    def render_overhead(data: dict[str, Any], ctx: Context) -> str:
        return "| ... |"   # markdown; write charts under ctx.charts_dir

No torch import: this runs anywhere the JSON is.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO_ROOT, RESULTS_DIR, format_size, load_verdict, read_json
from bench.report_broker import BROKER
from bench.report_host import HOST
from bench.report_serve import SERVE, SOURCES
from bench.report_tables import TABLES, machine_line

if TYPE_CHECKING:
    from matplotlib.figure import Figure


DOCS_DIR = REPO_ROOT / "docs"
# Charts go inside the docs site: MkDocs shows only files under docs/.
CHARTS_DIR = DOCS_DIR / "assets"


def default_pages() -> list[Path]:
    """The pages whose regions the report fills: README.md and every page under docs/."""
    return [REPO_ROOT / "README.md", *sorted(DOCS_DIR.rglob("*.md"))]


@dataclass(frozen=True)
class Context:
    """Where a renderer reads and writes, and how to link a chart from the page showing it."""

    results_dir: Path
    page: Path | None
    charts: bool
    charts_dir: Path = CHARTS_DIR

    def link(self, path: Path) -> str:
        """A path for a markdown link from the page (relative to its folder)."""
        base = self.page.parent if self.page is not None else REPO_ROOT
        return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()

    def repo_path(self, path: Path) -> str:
        """A file's repository path, for a code span (absolute when outside the repo)."""
        try:
            return path.resolve().relative_to(REPO_ROOT.resolve()).as_posix()
        except ValueError:
            return path.resolve().as_posix()


Renderer = Callable[[dict[str, Any], Context], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    """Register a renderer for bench/results/<name>.json (and page region <name>)."""

    def register(fn: Renderer) -> Renderer:
        RENDERERS[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------------------
# populate
# ---------------------------------------------------------------------------------------
POPULATE_LABELS = {
    "hostpool_shm": "hostpool shm (memfd, threaded MADV_POPULATE_WRITE)",
    "hostpool_shm_2mb": "hostpool shm, 2 MiB hugepages",
    "hostpool_mmap": "hostpool mmap (private anonymous, threaded MADV_POPULATE_WRITE)",
    "sglang_alloc_shm": "sglang `alloc_shm` (memfd + one MADV_POPULATE_WRITE)",
    "sglang_alloc_mmap": "sglang `alloc_mmap` (anonymous shared + madvise)",
    "sglang_alloc_mmap_2mb": "sglang `alloc_mmap`, 2 MiB hugetlb (`SGLANG_HUGEPAGE_SIZE`)",
    "sglang_alloc_mmap_parallel": "sglang `alloc_mmap`, parallel private THP "
    "(`SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS`)",
    "seed_pr_memfd": "the seed PR's allocator, restated (memfd, MAP_POPULATE + madvise)",
    "vllm_devshm_madvise": "vLLM-style /dev/shm file + madvise, restated",
    "torch_empty_zero": "`torch.empty().zero_()` (baseline)",
    "bare_hugetlb_madvise": "bare kernel call: 2 MiB hugetlb memfd + threaded madvise (ceiling)",
    "bare_shm_populate": "bare kernel call: memfd + threaded madvise (ceiling)",
    "bare_anon_populate": "bare kernel call: private anonymous + threaded madvise (ceiling)",
}
POPULATE_SHORT = {
    "hostpool_shm": "hostpool shm",
    "hostpool_shm_2mb": "hostpool shm 2 MiB",
    "hostpool_mmap": "hostpool mmap",
    "sglang_alloc_shm": "sglang alloc_shm",
    "sglang_alloc_mmap": "sglang alloc_mmap",
    "sglang_alloc_mmap_2mb": "sglang alloc_mmap 2 MiB",
    "sglang_alloc_mmap_parallel": "sglang alloc_mmap parallel",
    "seed_pr_memfd": "seed PR (restated)",
    "vllm_devshm_madvise": "vLLM /dev/shm (restated)",
    "torch_empty_zero": "torch zero_",
    "bare_hugetlb_madvise": "bare hugetlb (ceiling)",
    "bare_shm_populate": "bare shm (ceiling)",
    "bare_anon_populate": "bare anon (ceiling)",
}
VERDICT = {True: "pass", False: "**fail**", None: "not measured"}


def _warmup(data: dict[str, Any]) -> str:
    warmup = data["config"].get("warmup_bytes")
    if not warmup:
        return ""
    return f" after one untimed {format_size(warmup)} warm-up call of the same variant"


def _variant_cell(r: dict[str, Any], key: str, fmt: str) -> str:
    if r.get("status") != "ok":
        return str(r.get("status", "-"))
    value = r.get(key)
    return format(value, fmt) if isinstance(value, int | float) else "-"


# Populate chart: one colour per variant, a colour family per group.
POPULATE_GROUPS: dict[str, tuple[str, str, str, tuple[float, float]]] = {
    # group: (legend label, colormap of its family, hatch, span of the colormap used)
    "hostpool": ("hostpool", "Blues", "", (0.45, 0.9)),
    "peer": ("peers: sglang, vLLM, torch, seed PR", "YlOrRd", "", (0.3, 0.95)),
    "ceiling": ("bare kernel call (ceiling)", "Greys", "///", (0.35, 0.7)),
}


def populate_group(variant: str) -> str:
    """The chart group of a populate variant: 'hostpool', 'ceiling' (bare kernel calls)
    or 'peer' (every other allocator it is compared with)."""
    if variant.startswith("hostpool_"):
        return "hostpool"
    if variant.startswith("bare_"):
        return "ceiling"
    return "peer"


def populate_styles(variants: list[str]) -> dict[str, tuple[Any, str]]:
    """variant -> (RGBA colour, hatch): each variant its own shade of its group's family,
    spread evenly over the group's span of the colormap (never white, never black)."""
    from matplotlib import colormaps

    styles: dict[str, tuple[Any, str]] = {}
    for group, (_, cmap_name, hatch, (lo, hi)) in POPULATE_GROUPS.items():
        members = [v for v in variants if populate_group(v) == group]
        cmap = colormaps[cmap_name]
        for k, variant in enumerate(members):
            where = k / (len(members) - 1) if len(members) > 1 else 0.5
            styles[variant] = (cmap(lo + (hi - lo) * where), hatch)
    return styles


def draw_populate_chart(data: dict[str, Any]) -> Figure:
    """The populate chart as a matplotlib Figure (Agg backend): one panel per size, one
    horizontal bar per variant (median GiB/s, whiskers min..max), its value at the whisker's
    end; variants grouped hostpool / peers / ceilings, each group a colour family, ceilings
    hatched. Patches and value texts carry gid `populate:<variant>:<size>` and
    `value:<variant>:<size>`. Raises KeyError on a results file without config/results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    results = data["results"]
    variants: list[str] = data["config"]["variants"]
    order = [v for g in POPULATE_GROUPS for v in variants if populate_group(v) == g]
    styles = populate_styles(order)
    ys: dict[str, float] = {}
    y, previous = 0.0, None
    for variant in order:
        group = populate_group(variant)
        y += 0.0 if previous is None else (1.0 if group == previous else 1.7)
        ys[variant], previous = y, group

    fig, axes = plt.subplots(
        1,
        len(results),
        sharey=True,
        sharex=True,
        squeeze=False,
        figsize=(3.0 + 3.8 * len(results), 1.9 + 0.3 * (y + 1)),
        dpi=120,
    )
    top = max(
        (
            row["size_bytes"] / (1 << 30) / r["min_s"]
            for row in results
            for r in row["variants"].values()
            if r.get("status") == "ok"
        ),
        default=1.0,
    )
    for ax, row in zip(axes[0], results, strict=True):
        n = row["size_bytes"] / (1 << 30)
        for variant in order:
            r = row["variants"].get(variant, {})
            colour, hatch = styles[variant]
            tag = f"{variant}:{row['size']}"
            if r.get("status") != "ok":
                text = ax.annotate(
                    str(r.get("status", "no data")),
                    (0, ys[variant]),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=7,
                    color="0.35",
                )
                text.set_gid(f"value:{tag}")
                continue
            median, fastest, slowest = r["gib_per_s"], n / r["min_s"], n / r["max_s"]
            (bar,) = ax.barh(
                ys[variant],
                median,
                height=0.8,
                xerr=[[median - slowest], [fastest - median]],
                capsize=2,
                color=colour,
                hatch=hatch,
                edgecolor="white" if hatch else colour,
                linewidth=0,
                error_kw={"elinewidth": 0.8},
            )
            bar.set_gid(f"populate:{tag}")
            text = ax.annotate(
                f"{median:.2f}",
                (fastest, ys[variant]),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
            text.set_gid(f"value:{tag}")
        ax.set_title(row["size"], fontsize=9)
        ax.set_xlabel("GiB/s (allocate + populate), higher is better", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.tick_params(labelsize=7)
    first = axes[0][0]
    first.set_xlim(0, top * 1.2)
    first.set_yticks([ys[v] for v in order], [POPULATE_SHORT.get(v, v) for v in order])
    first.invert_yaxis()
    runs = data["config"]["runs"]
    fig.suptitle(
        f"Populate throughput, median of {runs} fresh-process run(s), "
        f"{data['config'].get('pages', 'natural')} pages; whiskers: min..max\n"
        f"{machine_line(data)}",
        fontsize=9,
    )
    handles = []
    for group, (label, _, hatch, _) in POPULATE_GROUPS.items():
        members = [v for v in order if populate_group(v) == group]
        if members:
            colour = styles[members[len(members) // 2]][0]
            edge = "white" if hatch else colour
            handles.append(Patch(facecolor=colour, hatch=hatch, edgecolor=edge, label=label))
    fig.legend(handles=handles, loc="lower center", ncols=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def populate_chart(data: dict[str, Any], out: Path) -> None:
    """Draw the populate chart (draw_populate_chart) and write it to out as PNG."""
    import matplotlib.pyplot as plt

    fig = draw_populate_chart(data)
    fig.savefig(out)
    plt.close(fig)


def _ceilings(data: dict[str, Any]) -> list[str]:
    """For each target not met that names a ceiling: what the kernel's share of the work
    alone reached against the same peer in the same run, and why nothing goes further."""
    out: list[str] = []
    for t in data.get("targets", []):
        checks = [c for c in t["checks"] if "ceiling_ratio" in c]
        if not t.get("ceiling") or not checks or all(c["ok"] for c in t["checks"]):
            continue
        versus = POPULATE_SHORT.get(t["versus"], t["versus"])
        parts = ", ".join(
            f"{c['ceiling_ratio']:.2f}x {versus} at {format_size(c['size_bytes'])} "
            f"(hostpool {c['ratio']:.2f}x, {c['ratio'] / c['ceiling_ratio']:.0%} of it)"
            for c in checks
        )
        below = [c for c in checks if c["ceiling_ratio"] < t["min_ratio"]]
        if below:
            where = ", ".join(format_size(c["size_bytes"]) for c in below)
            verdict = f"the ceiling itself is under {t['min_ratio']:g}x at {where}: {t['why']}"
        else:
            missed = [c["size_bytes"] for c in checks if not c["ok"]]
            spread = "; ".join(
                _sample_ranges(data, n, (t["variant"], t["ceiling"], t["versus"])) for n in missed
            )
            verdict = (
                f"the ceiling is above {t['min_ratio']:g}x, so the gap is not the kernel's "
                f"share: it is hostpool's, or the samples' spread ({spread})"
            )
        out += [
            "",
            f'Ceiling for "{t["text"]}": {POPULATE_SHORT.get(t["ceiling"], t["ceiling"])}, '
            f"which does nothing but the kernel's share of the work, reached {parts}; "
            f"{verdict}.",
        ]
    out += _same_work(data)
    return out


def _ranges(row: dict[str, Any], variants: tuple[str, ...], *, counts: bool = False) -> list[str]:
    """'hostpool mmap 1.516-3.145 s' for each variant measured in this results row."""
    out = []
    for v in variants:
        r = row["variants"].get(v, {})
        if r.get("status") == "ok":
            n = f" (n={len(r['samples_s'])})" if counts else ""
            out.append(f"{POPULATE_SHORT.get(v, v)} {r['min_s']:.3f}-{r['max_s']:.3f} s{n}")
    return out


def _sample_ranges(data: dict[str, Any], size_bytes: int, variants: tuple[str, ...]) -> str:
    """'at 4 GiB, samples: hostpool mmap 1.516-3.145 s, ...' from the same run's results."""
    row = next(r for r in data["results"] if r["size_bytes"] == size_bytes)
    return f"at {row['size']}, samples: " + ", ".join(_ranges(row, variants))


def _same_work(data: dict[str, Any]) -> list[str]:
    """hostpool's 2 MiB allocator against the bare call: the same madvise over the same
    threads and spans, so show how far apart their samples lie, each adjacent pair's own
    ratio, and what hostpool adds outside populate, not a ratio of two medians alone."""
    same = data["config"].get("same_work")
    if not same or not any(t["id"] == "hugepages_vs_bare_kernel" for t in data["targets"]):
        return []
    pair = tuple(same["variants"])
    samples = [s for s in data.get("samples", []) if s.get("variant") in pair and "seconds" in s]
    if {s["variant"] for s in samples} != set(pair):
        return []
    spans = []
    for row in data["results"]:
        ranges = _ranges(row, pair, counts=True)
        ratios = row.get("same_work_paired_ratios", [])
        if ratios:
            ranges.append(
                f"per-pair ratio median {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} pairs)"
            )
        spans.append(f"{row['size']}: " + ", ".join(ranges))
    outside = [
        s["seconds"] - s["details"]["populate_seconds"]
        for s in samples
        if s["variant"] == pair[0] and s.get("details", {}).get("populate_seconds") is not None
    ]
    added = f"; everything hostpool does outside populate took at most {max(outside) * 1e3:.1f} ms"
    return [
        "",
        "hostpool's 2 MiB allocator and the bare kernel call make the same madvise over the "
        "same threads and 64 MiB spans, so they differ by less than run-to-run noise; each "
        f"round runs them as {same['pairs_per_round']} adjacent pairs, each side first in half "
        "of them, for more samples, and the target is judged on the ratio of the medians as every "
        f"other: {'; '.join(spans)}{added if outside else ''}.",
    ]


@renderer("populate")
def render_populate(data: dict[str, Any], ctx: Context) -> str:
    results = data["results"]
    variants: list[str] = data["config"]["variants"]
    runs = data["config"]["runs"]
    lines = [
        f"Allocate + populate a tensor of host memory: median of {runs} run(s), each in a "
        f"fresh process{_warmup(data)}, variants interleaved; {machine_line(data)}. Higher "
        "is better; `x torch` is the speed relative to `torch.empty().zero_()` in the same "
        "run. The sglang rows call the installed package's own allocators.",
        "",
    ]
    others = [x["other_cpus"] for x in data.get("samples", []) if "other_cpus" in x]
    cpus = data.get("machine", {}).get("cpus")
    if others and cpus:
        lines += [
            f"Other processes (kernel workers included) used {statistics.median(others):.2f} "
            f"of {cpus} CPUs while a sample ran (median; most {max(others):.2f}).",
            "",
        ]
    pages = data["config"].get("pages")
    if pages:
        meaning = data["config"].get("pages_meaning", "")
        lines += [f"Page state `{pages}`: {meaning}.", ""]
    header = ["variant"]
    for row in results:
        header += [f"{row['size']} GiB/s", f"{row['size']} x torch"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("| --- |" + " ---: |" * (len(header) - 1))
    for variant in variants:
        cells = [POPULATE_LABELS.get(variant, variant)]
        for row in results:
            r = row["variants"].get(variant, {})
            cells.append(_variant_cell(r, "gib_per_s", ".2f"))
            ratio = _variant_cell(r, "ratio_to_torch", ".2f")
            cells.append(f"{ratio}x" if r.get("status") == "ok" and ratio != "-" else "")
        lines.append("| " + " | ".join(cells) + " |")

    skipped = {
        v: r.get("reason", "")
        for row in results
        for v, r in row["variants"].items()
        if r.get("status") == "skipped"
    }
    for variant, reason in skipped.items():
        lines += ["", f"{POPULATE_SHORT.get(variant, variant)} skipped: {reason}"]

    lines += ["", "| target | measured | result |", "| --- | --- | --- |"]
    for t in data.get("targets", []):
        measured = ", ".join(
            f"{c['ratio']:.2f}x at {format_size(c['size_bytes'])}" for c in t["checks"]
        )
        if t["missing"]:
            measured = "; ".join(filter(None, [measured, *t["missing"]]))
        verdict = VERDICT[t["pass"]]
        if t["kind"] == "aim" and t["pass"] is False:
            verdict = "missed (aim)"
        lines.append(f"| {t['text']} | {measured or '-'} | {verdict} |")

    lines += _ceilings(data)

    if ctx.charts:
        chart = ctx.charts_dir / "populate.png"
        try:
            populate_chart(data, chart)
        except ImportError as exc:
            print(f"populate: no chart ({exc}); install the bench extra", file=sys.stderr)
        else:
            lines += ["", f"![populate throughput]({ctx.link(chart)})"]
    lines += [
        "",
        "Raw samples, machine facts and the hugepage reservation are in "
        f"`{ctx.repo_path(ctx.results_dir / 'populate.json')}`.",
    ]
    return "\n".join(lines)


VLLM_OFFLOAD_LABELS = {
    "hostpool_offload": "hostpool offload region (`HostpoolOffloadingSpec`: memfd, threaded "
    "MADV_POPULATE_WRITE)",
    "vllm_shared_region": "vLLM `SharedOffloadRegion`, stock worker path (one madvise per row)",
    "vllm_shared_region_one": "vLLM `SharedOffloadRegion`, one madvise (tiering scheduler side)",
    "vllm_shared_region_hp": "vLLM `SharedOffloadRegion`, stock path, `HOSTPOOL_INSTRUMENT=vllm`",
    "bare_shm_populate": "bare kernel call: memfd + threaded madvise (ceiling)",
}
VLLM_OFFLOAD_SPREAD = ("hostpool_offload", "bare_shm_populate", "vllm_shared_region")
VLLM_OFFLOAD_RECORDED = ("vllm_shared_region", "vllm_shared_region_hp")


@renderer("vllm_offload")
def render_vllm_offload(data: dict[str, Any], ctx: Context) -> str:
    """bench/vllm_offload.py: hostpool's offload region against vLLM's own class."""
    config, results, target = data["config"], data["results"], data["target"]
    versus = "vllm_shared_region"
    m = data.get("machine", {})
    lines = [
        f"vLLM's CPU offload region, made and populated: median of {config['runs']} run(s), "
        f"each in a fresh process{_warmup(data)}, in a balanced order (each variant in each "
        f"place equally often), pages warm; {machine_line(data)}, vLLM {m.get('vllm', '?')} "
        f"(the installed package's own class). Rows of {format_size(config['row_bytes'])}; "
        f"`x vLLM` is the speed relative to vLLM's stock path in the same run.",
        "",
    ]
    others = [s["other_cpus"] for s in data.get("samples", []) if "other_cpus" in s]
    if others and m.get("cpus"):
        lines += [
            f"Other processes (kernel workers included) used {statistics.median(others):.2f} "
            f"of {m['cpus']} CPUs while a sample ran (median; most {max(others):.2f}).",
            "",
        ]
    head = "| variant |" + "".join(f" {r['size']} GiB/s | {r['size']} x vLLM |" for r in results)
    lines += [head, "| --- |" + " ---: | ---: |" * len(results)]
    for variant in config["variants"]:
        cells = []
        for row in results:
            r, base = row["variants"].get(variant, {}), row["variants"].get(versus, {})
            ok = r.get("status") == "ok" and base.get("status") == "ok"
            cells.append(_variant_cell(r, "gib_per_s", ".2f"))
            cells.append(f"{base['median_s'] / r['median_s']:.2f}x" if ok else "-")
        lines.append(f"| {VLLM_OFFLOAD_LABELS.get(variant, variant)} | " + " | ".join(cells) + " |")
    measured = ", ".join(
        f"{c['ratio']:.2f}x at {format_size(c['size_bytes'])}" for c in target["checks"]
    )
    lines += [
        "",
        "| target | measured | result |",
        "| --- | --- | --- |",
        f"| {target['text']} | {measured or '-'} | {VERDICT[target['pass']]} |",
    ]
    for c in target["checks"]:
        if c["ok"] or c.get("ceiling_ratio") is None:
            continue
        free = (
            f" (other processes left {m['cpus'] - statistics.median(others):.2f} of "
            f"{m['cpus']} CPUs free while it ran, median)"
            if others and m.get("cpus")
            else ""
        )
        bound = (
            f"the ceiling itself is under {target['min_ratio']:g}x: {target['why_ceiling']}{free}"
            if c["ceiling_ratio"] < target["min_ratio"]
            else f"the ceiling is above {target['min_ratio']:g}x: the gap is hostpool's, or "
            f"the samples' spread ({_sample_ranges(data, c['size_bytes'], VLLM_OFFLOAD_SPREAD)})"
        )
        lines += [
            "",
            f"At {format_size(c['size_bytes'])} the bare kernel call with the same threads "
            f"reached {c['ceiling_ratio']:.2f}x vLLM (hostpool {c['ratio']:.2f}x, "
            f"{c['ratio'] / c['ceiling_ratio']:.0%} of it); {bound}.",
        ]
    slow = [
        f"{c['instrumented_slowdown']:.2f}x at {format_size(c['size_bytes'])}"
        for c in target["checks"]
        if c.get("instrumented_slowdown") is not None
    ]
    if slow:
        lines += [
            "",
            "Recording vLLM's region in hostpool's ledger (`HOSTPOOL_INSTRUMENT=vllm`) took "
            f"vLLM's stock path {', '.join(slow)} its plain time (medians of the same run; "
            "the spread of the samples: "
            + "; ".join(
                _sample_ranges(data, r["size_bytes"], VLLM_OFFLOAD_RECORDED) for r in results
            )
            + ").",
        ]
    raw = ctx.repo_path(ctx.results_dir / "vllm_offload.json")
    lines += ["", f"Raw samples and machine facts are in `{raw}`."]
    return "\n".join(lines)


@renderer("exporter_scale")
def render_exporter_scale(data: dict[str, Any], ctx: Context) -> str:
    """`hostpool exporter` over 10 x 9,000 mapped memfds vs reading the same /proc files."""
    targets = data["targets"]
    lines = [
        "| holders | fds | HTTP scrape (median) | scrape, in-process (wall / CPU) "
        "| bare read of maps + fd links (wall / CPU) | ratio (wall / CPU, median of rounds) "
        "| bare read of maps + a stat per fd (CPU) | ratio to it (CPU) | other CPUs busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for name, case in data["cases"].items():
        m = case["median"]
        held = (
            f"{case['processes']} x {case['objects_per_process']:,} mapped memfds, "
            f"{case['fds_per_object']} fd(s) each"
        )
        lines.append(
            f"| {held} | {case['fds']:,} | {m['http_wall_s']:.2f} s "
            f"| {m['scrape_wall_s']:.2f} s / {m['scrape_cpu_s']:.2f} s "
            f"| {m['bare_wall_s']:.2f} s / {m['bare_cpu_s']:.2f} s "
            f"| {m['ratio_wall']:.2f}x / {m['ratio_cpu']:.2f}x "
            f"| {m['bare_stat_cpu_s']:.2f} s | {m['ratio_stat_cpu']:.2f}x "
            f"| {case['other_cpus']:.2f} |"
        )
        wall_ok = m["http_wall_s"] <= targets["http_wall_s"]
        ratio_ok = m["ratio_cpu"] <= targets["ratio"]
        verdicts.append(
            f"{name.replace('_', ' ')}: HTTP scrape <= {targets['http_wall_s']:g} s "
            f"{VERDICT[wall_ok]}, <= {targets['ratio']:g}x the bare read {VERDICT[ratio_ok]}"
        )
    machine = data["machine"]
    lines += [
        "",
        f"Targets (issue 26): {'; '.join(verdicts)}. Run {data['date']} "
        f"(`bench/exporter_scale.py`; {machine['cpus_usable']} CPUs, Linux {machine['kernel']}); "
        "samples, per-round ratios and machine facts are in "
        "`bench/results/exporter_scale.json`.",
        "",
        "What a scrape does beyond the bare read: one `statx` per fd instead of a link read "
        "where mapped objects fill the fd table (it names the object by inode and gives its "
        "pages; a link read gives neither: the kernel's statx costs ~1.1x its readlink "
        "here), the maps lines parsed and summed per object and pool, and every other "
        "process on the host looked at. The per-line, per-fd and per-object loops run in C "
        "(`hostpool/proc/bulkread.c`); Python sees one entry per object and parses each "
        "name once. Residency from smaps instead would cost a page-table walk per scrape "
        "(~70 ms per populated 4 GiB per process).",
    ]
    return "\n".join(lines)


RENDERERS.update(TABLES)
RENDERERS.update(SERVE)
RENDERERS.update(BROKER)
RENDERERS.update(HOST)


def _populate_other_pages(name: str) -> Renderer:
    """The same comparison in another page state (`--pages ...`), without a chart."""

    def render(data: dict[str, Any], ctx: Context) -> str:
        from dataclasses import replace

        return render_populate(data, replace(ctx, charts=False)).replace(
            "populate.json", f"{name}.json"
        )

    return render


for _pages in ("natural", "cold"):
    renderer(f"populate-{_pages}")(_populate_other_pages(f"populate-{_pages}"))


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------
def replace_region(text: str, name: str, body: str) -> str | None:
    """A page's text with the region `name` replaced by body; None when it has no region."""
    pattern = re.compile(
        rf"(<!-- bench:{re.escape(name)}:start -->)(.*?)(<!-- bench:{re.escape(name)}:end -->)",
        re.DOTALL,
    )
    if pattern.search(text) is None:
        return None
    return pattern.sub(lambda m: f"{m.group(1)}\n{body}\n{m.group(3)}", text, count=1)


def render_region(name: str, data: dict[str, Any], ctx: Context) -> str:
    """Region `name` rendered from its results `data`, marked in red (first line) when
    the run was not quiet (`load_verdict`): what a page must hold for it."""
    body = RENDERERS[name](copy.deepcopy(data), ctx)
    verdict = load_verdict(data)
    if verdict is None:
        return body
    return f'<p style="color:red"><b>{verdict[0].upper()}{verdict[1:]}.</b></p>\n\n{body}'


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--page",
        type=Path,
        action="append",
        help="a page whose regions to fill (repeatable; default README.md and docs/**/*.md)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--no-charts", action="store_true", help="skip the PNGs")
    parser.add_argument("--charts-dir", type=Path, default=CHARTS_DIR)
    parser.add_argument("--only", action="append", choices=sorted(RENDERERS), help="repeatable")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a table is not from a quiet run"
    )
    args = parser.parse_args()

    pages = [] if args.no_write else [p for p in args.page or default_pages() if p.exists()]
    texts = {page: page.read_text() for page in pages}
    updated = dict(texts)

    found = {p.stem for p in sorted(args.results_dir.glob("*.json"))}
    for name in sorted(found - set(RENDERERS)):
        print(f"({name}.json has no renderer yet: add one to bench/report.py)", file=sys.stderr)
    rendered = 0
    noisy: list[str] = []
    for name in RENDERERS:
        if args.only and name not in args.only:
            continue
        source = SOURCES.get(name, name)
        path = args.results_dir / f"{source}.json"
        if not path.exists():
            how = "make soak" if source == "soak" else f"bench/{source.split('-')[0]}.py"
            print(f"({path} missing: run {how})", file=sys.stderr)
            continue
        data = read_json(path)
        if load_verdict(data) is not None:
            noisy.append(name)
        # Rendered for each page holding the region (a chart's link is relative to it).
        holders = [p for p in pages if replace_region(updated[p], name, "") is not None]
        body = ""
        for page in holders or [None]:
            ctx = Context(args.results_dir, page, not args.no_charts, args.charts_dir)
            body = render_region(name, data, ctx)
            if page is not None:
                updated[page] = replace_region(updated[page], name, body) or updated[page]
        print(f"## {name}\n\n{body}\n")
        rendered += 1
    for page in pages:
        if updated[page] != texts[page]:
            page.write_text(updated[page])
            print(f"updated {page}", file=sys.stderr)
    if noisy:
        print(f"not quiet (marked in red): {', '.join(noisy)}", file=sys.stderr)
        if args.strict:
            return 1
    return 0 if rendered else 1


if __name__ == "__main__":
    sys.exit(main())
