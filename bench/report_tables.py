"""Markdown renderers for the smaller benchmarks (first_alloc, overhead, scrape, share,
leakcheck, soak), and the machine line the larger ones share.

Plain functions over the JSON each benchmark writes; `bench/report.py` registers them.
"""

from __future__ import annotations

from typing import Any

from bench._common import format_size

VERDICT = {True: "pass", False: "**fail**"}


def machine_line(data: dict[str, Any], *, sglang: bool = True) -> str:
    """'Linux 6.18.44, 2 CPUs, 23.54 GiB RAM, Python 3.11.7, torch 2.13.0+cpu, sglang
    0.5.23, 2026-12-04' from a results file's `machine` facts and its `date` (or
    `generated_at`); sglang only when asked for and installed, '?' for a missing fact."""
    m = data.get("machine", {})
    mem = m.get("mem_total_bytes")
    parts = [
        f"Linux {m.get('kernel', '?')}",
        f"{m.get('cpus', '?')} CPUs",
        f"{format_size(mem)} RAM" if mem else None,
        f"Python {m.get('python', '?')}",
        f"torch {m.get('torch', '?')}",
        f"sglang {m['sglang']}" if sglang and m.get("sglang") else None,
        str(data.get("date", data.get("generated_at", "?")))[:10],
    ]
    return ", ".join(p for p in parts if p)


def _us(value: float) -> str:
    return f"{value:.1f} us"


def _ci(pair: list[float]) -> str:
    return f"[{pair[0]:.1f}, {pair[1]:.1f}]"


def overhead(data: dict[str, Any], _ctx: Any) -> str:
    book = data["bookkeeping"]
    return "\n".join(
        [
            f"Bookkeeping per 2 MiB shm allocation ({data['samples']} interleaved samples of "
            f"each, {data['date'][:10]}): the ledger record, validation and event guards "
            "against the raw memory-layer call (memfd, seal, map, populate, tensor).",
            "",
            "| measure | median | 95% interval |",
            "| --- | ---: | ---: |",
            f"| raw memory-layer call | {_us(data['raw']['median_us'])} | "
            f"{_ci(data['raw']['ci95_us'])} |",
            f"| `allocate()` with bookkeeping | {_us(data['tracked']['median_us'])} | "
            f"{_ci(data['tracked']['ci95_us'])} |",
            f"| bookkeeping (paired difference) | {_us(book['median_us'])} | "
            f"{_ci(book['ci95_us'])} |",
            f"| budget reads (/proc/meminfo + cgroup files), separately | "
            f"{_us(data['budget_reads']['median_us'])} | {_ci(data['budget_reads']['ci95_us'])} |",
            "",
            f"Bookkeeping is {data['bookkeeping_ratio']:.1%} of the raw call (target <= "
            f"{data['target_ratio']:.0%}: {VERDICT[data['pass']]}).",
        ]
    )


def scrape(data: dict[str, Any], _ctx: Any) -> str:
    lines = [
        "Collector time per scrape as live 4 KiB shm allocations grow, next to a bare "
        f"`os.fstat` loop over the same fds in the same run ({data['date'][:10]}).",
        "",
        "| live allocations | collect | fstat loop |",
        "| ---: | ---: | ---: |",
    ]
    for row in data["shm"]:
        lines.append(
            f"| {row['allocations']:,} | {row['collect_s'] * 1e3:.2f} ms | "
            f"{row['fstat_loop_s'] * 1e3:.2f} ms |"
        )
    lines += [
        "",
        f"Marginal cost {data['per_allocation_s'] * 1e6:.2f} us per allocation (slope 1,000 to "
        f"5,000) = {data['ratio_to_fstat']:.2f}x one fstat ({data['per_fstat_s'] * 1e6:.2f} us; "
        f"target <= {data['target_ratio']:.0f}x: {VERDICT[data['pass']]}); the fixed cost, "
        f"what a scrape of {data['shm'][0]['allocations']} allocations takes, is "
        f"{data['shm'][0]['collect_s'] * 1e3:.2f} ms. Anonymous regions (mincore): "
        f"{data['anon_per_allocation_s'] * 1e6:.2f} us per allocation.",
    ]
    return "\n".join(lines)


def share(data: dict[str, Any], _ctx: Any) -> str:
    m = data["median"]
    size = data["size_bytes"] >> 20
    return "\n".join(
        [
            f"Handing a {size} MiB pool to another process ({len(data['runs'])} runs, medians, "
            f"{data['date'][:10]}).",
            "",
            "| measure | time |",
            "| --- | ---: |",
            f"| hand-off by fd (`attach()`: connect, manifest, SCM_RIGHTS, checks, mmap) | "
            f"{m['handoff_s'] * 1e3:.2f} ms |",
            f"| sending the bytes over a Unix socket | {m['copy_s'] * 1e3:.0f} ms |",
            f"| pre-fault of the attached mapping (MADV_POPULATE_READ), separately | "
            f"{m['prefault_s'] * 1e3:.0f} ms |",
            f"| full read in the owning process | {m['owner_read_s'] * 1e3:.0f} ms |",
            f"| full read by the peer, pre-faulted | {m['peer_read_warm_s'] * 1e3:.0f} ms |",
            f"| full read by the peer, right after attach | {m['peer_read_cold_s'] * 1e3:.0f} ms |",
            "",
            f"Hand-off is {data['handoff_speedup']:.0f}x faster than copying (target >= 100x: "
            f"{VERDICT[data['pass']['handoff_speedup']]}); the peer reads at "
            f"{data['peer_read_ratio']:.2f}x in-process speed (target >= 0.9x: "
            f"{VERDICT[data['pass']['peer_read_ratio']]}); {m['received_bytes']:.0f} bytes of "
            "manifest crossed the socket.",
        ]
    )


def leakcheck(data: dict[str, Any], _ctx: Any) -> str:
    lines = [
        "Cost of the pytest leak check per clean test, next to the bare /proc reads it needs "
        f"(two listdir + readlink passes over /proc/self/fd, two reads of /proc/self/maps), "
        f"same run ({data['date'][:10]}).",
        "",
        "| open fds | check per test | bare reads | ratio | target <= 1.3x |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for c in data["cases"]:
        lines.append(
            f"| {c['open_fds']:,} | {_us(c['overhead_us'])} | {_us(c['bare_reads_us'])} | "
            f"{c['ratio']:.2f}x | {VERDICT[c['pass']]} |"
        )
    return "\n".join(lines)


def _churn_company(churn: dict[str, Any]) -> str:
    """What ran beside the churn threads, and what held at the end (older files: nothing)."""
    if "scrapes" not in churn:
        return ""
    text = (
        f", beside a thread scraping the collector ({churn['scrapes']:,} scrapes) and one "
        f"forking children that allocate and exit ({churn['forks']:,} forks, all exited 0)"
    )
    if churn.get("gauges_equal_proc"):
        text += "; every gauge equal to /proc at the end,"
    return text


def soak(data: dict[str, Any], _ctx: Any) -> str:
    churn = data.get("churn") or {}
    return "\n".join(
        [
            f"Last soak (`make soak`, {data['date'][:10]}, Linux {data['kernel']}): "
            f"{churn.get('cycles', 0):,} allocate/release cycles over {churn.get('threads', 8)} "
            f"threads{_churn_company(churn)} in {churn.get('seconds', 0):.0f} s; "
            f"{data['faults_injected']} fault and "
            f"kill cases ({', '.join(data['fault_cases'])}); {data['tests_passed']} tests "
            f"passed, {data['tests_failed']} failed.",
        ]
    )


def http_flood(data: dict[str, Any], _ctx: Any) -> str:
    lines = [
        f"Last run (`HOSTPOOL_RECORD_RESULTS=1 pytest tests/reliability/test_http_flood.py`, "
        f"Linux {data['kernel']}):",
        "",
        "| server | half-open held | ulimit -n | scrapes | slowest | median | flood reconnects "
        "| scrapes run for half-open requests | tracebacks |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in sorted(data["servers"].items()):
        lines.append(
            f"| `{name}` | {r['half_open_held']:,} | {r['nofile']:,} | {r['scrapes']} | "
            f"{r['scrape_max_s'] * 1000:.0f} ms | {r['scrape_median_s'] * 1000:.0f} ms | "
            f"{r['flood_reconnects']:,} | {r['application_runs_for_half_open']} | "
            f"{r['tracebacks']} |"
        )
    return "\n".join(lines)


def share_attacks(data: dict[str, Any], _ctx: Any) -> str:
    """The share socket under attack (tests/reliability/test_share_*.py)."""
    attacks = data["attacks"]
    idle, fds = attacks["idle_flood"], attacks["fd_exhaustion"]
    trickle = attacks["trickling_server"]
    dates = sorted(a["date"][:10] for a in attacks.values())
    return "\n".join(
        [
            f"Last run (`HOSTPOOL_RECORD_RESULTS=1 pytest tests/reliability/test_share_*.py`, "
            f"{dates[-1]}, Linux {data['kernel']}):",
            "",
            "| attack | what held | figure |",
            "| --- | --- | ---: |",
            f"| {idle['connections_held']:,} idle connections from an allowed uid "
            f"(`ulimit -n` {idle['rlimit_nofile']:,}) | server kept "
            f"{idle['server_connections_kept']} sockets in all (cap {idle['per_uid_cap']} "
            "per uid) | attach median "
            f"{idle['attach_ms_flood_median']:.1f} ms, slowest {idle['attach_ms_flood_max']:.0f} "
            f"ms of {idle['attaches']} (quiet: {idle['attach_ms_quiet_median']:.1f} ms) |",
            f"| host at its fd limit (`ulimit -n` {fds['rlimit_nofile']}), connections pending "
            f"| accept backs off | server CPU {fds['server_cpu_share_while_exhausted']:.1%} "
            f"of a core; attached peer answered in {fds['existing_peer_answer_ms']:.0f} ms |",
            "| host at its fd limit, idle connections held | idle ones closed for a new peer "
            f"| attach {fds['attach_ms_exhausted_with_idle_connections']:.0f} ms |",
            "| fds back after exhaustion | accepting again | attach within "
            f"{fds['attach_ms_after_fds_return']:.0f} ms |",
            f"| server trickling fd packets, `attach(timeout={trickle['attach_timeout_s']})` "
            f"| one deadline | client released after {trickle['client_held_s']:.1f} s |",
        ]
    )


def first_alloc(data: dict[str, Any], _ctx: Any) -> str:
    m = data["median"]
    n = len([s for s in data["samples"] if "error" not in s])
    return "\n".join(
        [
            f"First allocation in a fresh process ({n} processes, medians, "
            f"{data['date'][:10]}), on top of `import torch` ({m['import_torch_ms']:.0f} ms, "
            "not counted); bytecode cached, as on an installed host.",
            "",
            "| step | median |",
            "| --- | ---: |",
            f"| `from hostpool import ShmHostTensorAllocator` | {m['import_ms']:.1f} ms |",
            f"| construct the allocator | {m['construct_ms']:.2f} ms |",
            f"| first 2 MiB `allocate()` (lazy probes included) | {m['first_call_ms']:.1f} ms |",
            f"| **import + construct + first call** | **{m['total_ms']:.1f} ms** |",
            f"| the same, CPU time of the process | {m['total_cpu_ms']:.1f} ms |",
            f"| second 2 MiB `allocate()`, for contrast | {m['second_call_ms']:.1f} ms |",
            "",
            f"Target < {data['target_ms']:.0f} ms: {VERDICT[bool(data['pass'])]} (range "
            f"{data['min_total_ms']:.1f} to {data['max_total_ms']:.1f} ms; other processes "
            f"used {data['other_cpus_median']:.2f} of {data['machine']['cpus']} CPUs while "
            "a sample ran, median).",
        ]
    )


def procfs_attacks(data: dict[str, Any], _ctx: Any) -> str:
    """The /proc readers' attack tests (tests/reliability/test_procfs_*.py)."""
    attacks = data["attacks"]
    lines = [
        "Last run (`HOSTPOOL_RECORD_RESULTS=1 pytest tests/reliability/test_procfs_*.py`, "
        f"or `make soak`; Linux {data['kernel']}):",
        "",
    ]
    forks = attacks.get("fork_loops")
    if forks:
        lines.append(
            f"- processes exiting mid-read ({forks['date'][:10]}): {forks['loops']} fork loops "
            f"ran {forks['forks']:,} short-lived memfd holders in {forks['seconds']:.0f} s while "
            f"the exporter answered {forks['scrapes']:,} scrapes ({forks['failed_scrapes']} "
            f"failed, slowest {forks['slowest_scrape_s']:.2f} s) and {forks['in_process_scans']:,} "
            "scans ran in the test itself;"
        )
    cardinality = attacks.get("cardinality")
    if cardinality:
        lines.append(
            f"- cardinality ({cardinality['date'][:10]}): uid {cardinality['attacker_uid']} "
            f"named {cardinality['memfds']:,} memfds `hostpool.p<N>.<its pid>.1`; the root "
            f"exporter served {cardinality['series']} `hostpool_exporter_*` series (cap "
            f"{cardinality['max_pools']} pools per prefix), "
            f'{cardinality["pools_folded"]:,} pools folded into `pool="_other"`;'
        )
    attribution = attacks.get("attribution")
    if attribution:
        ignored = ", ".join(f"{n} {reason}" for reason, n in attribution["ignored"].items())
        lines.append(
            f"- attribution by holder ({attribution['date'][:10]}): uid "
            f"{attribution['attacker_uid']} and root held {attribution['forged_objects']} "
            f"memfds ({attribution['forged_bytes'] >> 20} MiB) named after a live serve's "
            f"pool: in no pool, ignored ({ignored}); the serve's "
            f"{attribution['holders_counted']} holders (itself, a forked worker, a uid-65534 "
            "receiver of its fd) counted;"
        )
    renamed = attacks.get("renamed_memfds")
    if renamed:
        lines.append(
            f"- renamed memfds ({renamed['date'][:10]}): {renamed['processes']} processes made "
            f"{renamed['memfds']:,} memfds with new names before each of {renamed['scrapes']} "
            f"scrapes; the exporter's resident set {renamed['max_rss_mib']} MiB at most "
            f"(steady: {renamed['steady_rss_mib']} MiB);"
        )
    advice = attacks.get("permission_advice")
    if advice:
        lines.append(
            f"- permission advice ({advice['date'][:10]}): the missing piece named for "
            + "; ".join(advice["causes_explained"])
            + ";"
        )
    forged = attacks.get("forged_output")
    if forged:
        lines.append(
            f"- forged output ({forged['date'][:10]}): {forged['names']} hostile memfd names "
            f"and a hostile command name through {', '.join(forged['outputs'])}: "
            f"{forged['raw_control_characters']} raw control characters, "
            f"{forged['forged_lines']} forged lines."
        )
    return "\n".join(lines)


def exporter_pod(data: dict[str, Any], _ctx: Any) -> str:
    """One sentence: what the node exporter used at the host-view bench's scale (the
    DaemonSet's requests and limits are checked against this file by a test)."""
    mib = 1 << 20
    return (
        f"Measured {data['when'][:10]} (`bench/results/exporter_pod.json`, "
        f"{data['objects_seen']:,} objects seen): {data['idle_rss_bytes'] / mib:.0f} MiB "
        f"resident idle, a peak of {data['peak_rss_bytes'] / mib:.0f} MiB, at most "
        f"{data['cpu_s_max']:.2f} CPU-seconds and {data['wall_s_max']:.2f} s a scrape "
        f"({len(data['scrapes'])} scrapes, {data['machine']['cpus']} cores)."
    )


TABLES = {
    "first_alloc": first_alloc,
    "overhead": overhead,
    "scrape": scrape,
    "share": share,
    "leakcheck": leakcheck,
    "soak": soak,
    "http-flood": http_flood,
    "share-attacks": share_attacks,
    "procfs-attacks": procfs_attacks,
    "exporter_pod": exporter_pod,
}
