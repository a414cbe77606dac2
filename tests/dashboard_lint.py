"""A linter for dashboards/hostpool.json, after Grafana's dashboard-linter, plus helpers.

`lint(dashboard, catalogue)` returns a list of problems (empty when clean). The rules:
- a `datasource` variable of type datasource (prometheus) exists, and every panel, target
  and query variable uses `${datasource}`;
- every range in an expression is `[$__rate_interval]`;
- every counter (`*_total`) and every histogram series (`_bucket`, `_sum`, `_count`)
  appears only directly inside rate() or increase();
- every panel has a title, a description, a unit and targets with expressions; panel ids
  and titles are unique;
- every metric an expression names is in the catalogue tables of metrics/README.md, or
  is `up`, a `process_*` metric or a `node_*` metric;
- selectors filter with `job=~"$job", instance=~"$instance"` (hostpool, process and up),
  `pool=~"$pool"` where the catalogue gives the metric a `pool` label, and node_exporter
  metrics with `instance=~"$node"`;
- the `job`, `instance` and `pool` query variables exist; pool is multi-value with "All"
  and every query variable refreshes on time range change.

`panel_queries()` gives every (panel title, expression) with `$__rate_interval` and the
variables substituted, for tests that run the queries against a real Prometheus;
`optional_panels()` says which panels may be empty and why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_PATH = ROOT / "dashboards" / "hostpool.json"
CATALOGUE_PATH = ROOT / "metrics" / "README.md"

DATASOURCE_UID = "${datasource}"
RATE_INTERVAL = "$__rate_interval"
COUNTER_FUNCTIONS = frozenset({"rate", "increase"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    }
)
KEYWORDS = LABEL_LIST_KEYWORDS | AGGREGATIONS | {"and", "or", "unless", "bool", "offset"}
# Defaults for panel_queries(): every variable at "All".
ALL_VALUES = {"job": ".*", "instance": ".*", "pool": ".*", "node": ".*"}


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Occurrence:
    """One metric named in an expression."""

    name: str
    start: int
    selector: str  # the `{...}` text after the name, "" when there is none
    enclosing: str  # the function whose parentheses directly enclose it ("" at top level)


# ---------------------------------------------------------------- loading


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def load_catalogue(path: Path = CATALOGUE_PATH) -> dict[str, Metric]:
    """Metrics from every markdown table whose header starts `| metric | type | labels |`."""
    catalogue: dict[str, Metric] = {}
    in_table = False
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        if [c.lower() for c in cells[:3]] == ["metric", "type", "labels"]:
            in_table = True
            continue
        if not in_table or set(cells[0]) <= {"-", ":", " "}:
            continue
        name = cells[0].strip("`")
        labels = tuple(x.strip().strip("`") for x in cells[2].split(",") if x.strip())
        catalogue[name] = Metric(name=name, type=cells[1], labels=labels)
    return catalogue


# ---------------------------------------------------------------- dashboard structure


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def content_panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [p for p in iter_panels(dashboard) if p.get("type") != "row"]


def variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def panel_exprs(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, raw expression) for every target."""
    return [
        (panel.get("title", ""), target.get("expr", ""))
        for panel in content_panels(dashboard)
        for target in panel.get("targets", [])
    ]


# ---------------------------------------------------------------- PromQL scanning


def _blank(text: str, start: int, end: int, keep_ends: bool = True) -> str:
    """`text` with [start, end) replaced by spaces (the delimiters kept if keep_ends)."""
    if keep_ends and end - start >= 2:
        return text[: start + 1] + " " * (end - start - 2) + text[end - 1 :]
    return text[:start] + " " * (end - start) + text[end:]


def _mask(expr: str) -> str:
    """expr with string contents, ranges, matchers and label lists blanked, same length."""
    masked = expr
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', expr):
        masked = _blank(masked, m.start(), m.end())
    for pattern in (r"\[[^\]]*\]", r"\{[^}]*\}"):
        for m in re.finditer(pattern, masked):
            masked = _blank(masked, m.start(), m.end())
    keywords = "|".join(sorted(LABEL_LIST_KEYWORDS))
    for m in re.finditer(rf"\b(?:{keywords})\s*(\([^)]*\))", masked):
        masked = _blank(masked, m.start(1), m.end(1))
    numbers = (
        r"(?<![\w:.])(?:\d+(?:ms|[smhdwy]))+(?![\w:])",  # durations (offset 5m)
        r"(?<![\w:.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?",
    )
    for pattern in numbers:
        for m in re.finditer(pattern, masked):
            masked = _blank(masked, m.start(), m.end(), keep_ends=False)
    return masked


def _enclosing_functions(masked: str) -> list[str]:
    """For each position, the name of the innermost named call enclosing it ("" if none)."""
    out: list[str] = []
    stack: list[str] = []
    for i, ch in enumerate(masked):
        if ch == "(":
            m = re.search(r"([A-Za-z_][\w]*)\s*$", masked[:i])
            stack.append(m.group(1) if m else "")
        elif ch == ")" and stack:
            stack.pop()
        named = [name for name in stack if name and name not in LABEL_LIST_KEYWORDS]
        out.append(named[-1] if named else "")
    return out


def _selector_names(selector: str) -> list[str]:
    """Metric names given by a `__name__` matcher (equality or a plain alternation)."""
    for label, op, value in matchers(selector):
        plain = op == "=" or (op == "=~" and re.fullmatch(r"[\w:]+(?:\|[\w:]+)*", value))
        if label == "__name__" and plain:
            return value.split("|")
    return []


def occurrences(expr: str) -> list[Occurrence]:
    """Every metric named in expr, with its selector and the call that encloses it."""
    masked = _mask(expr)
    enclosing = _enclosing_functions(masked)
    found: list[Occurrence] = []
    for m in re.finditer(r"[A-Za-z_:][\w:]*|\{", masked):
        start = m.start()
        if m.group() == "{":
            if re.search(r"[\w:]\s*$", masked[:start]):
                continue  # a metric's selector: handled with the metric
            end = masked.index("}", start) + 1
            for name in _selector_names(expr[start:end]):
                found.append(Occurrence(name, start, expr[start:end], enclosing[start]))
            continue
        token = m.group()
        rest = masked[m.end() :].lstrip()
        if token in KEYWORDS or rest.startswith("("):
            continue  # a keyword, an aggregation or a function call
        selector = ""
        brace = masked[m.end() :]
        if brace.lstrip().startswith("{"):
            open_at = m.end() + (len(brace) - len(brace.lstrip()))
            close_at = masked.index("}", open_at) + 1
            selector = expr[open_at:close_at]
        found.append(Occurrence(token, start, selector, enclosing[start]))
    return found


def metric_names(expr: str) -> set[str]:
    return {o.name for o in occurrences(expr)}


def matchers(selector: str) -> list[tuple[str, str, str]]:
    """(label, operator, value) of each matcher in a `{...}` selector."""
    return [
        (m.group(1), m.group(2), m.group(3))
        for m in re.finditer(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector)
    ]


def ranges(expr: str) -> list[str]:
    """The contents of every `[...]` range (or subquery) outside string literals."""
    masked = re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: '"' + "x" * (len(m.group()) - 2) + '"', expr)
    return [expr[m.start() + 1 : m.end() - 1] for m in re.finditer(r"\[[^\]]*\]", masked)]


def base_metric(name: str, catalogue: Mapping[str, Metric]) -> Metric | None:
    """The catalogue entry for name, histogram series (_bucket, _sum, _count) included."""
    if name in catalogue:
        return catalogue[name]
    for suffix in HISTOGRAM_SUFFIXES:
        base = catalogue.get(name.removesuffix(suffix))
        if name.endswith(suffix) and base is not None and base.type == "histogram":
            return base
    return None


def is_counter_series(name: str, catalogue: Mapping[str, Metric]) -> bool:
    if name.endswith("_total"):
        return True
    base = base_metric(name, catalogue)
    return base is not None and base.type == "histogram" and name != base.name


def allowed_outside_catalogue(name: str) -> bool:
    """Prometheus' `up`, the process and node_exporter collectors', kube-state-metrics'
    `kube_pod_info` (pods' names for the node view): metrics/README.md's "Other metrics"."""
    return name in ("up", "kube_pod_info") or name.startswith(("process_", "node_"))


# ---------------------------------------------------------------- rules


def counter_problems(expr: str, catalogue: Mapping[str, Metric]) -> list[str]:
    """Counters and histogram series used outside rate()/increase()."""
    return [
        f"{o.name} outside rate()/increase() "
        + (f"(inside {o.enclosing}())" if o.enclosing else "(at top level)")
        for o in occurrences(expr)
        if is_counter_series(o.name, catalogue) and o.enclosing not in COUNTER_FUNCTIONS
    ]


def catalogue_problems(
    expr: str, catalogue: Mapping[str, Metric], extra: frozenset[str] = frozenset()
) -> list[str]:
    """Metrics that are neither in the catalogue, nor up/process_*/node_*, nor in extra."""
    return [
        f"{name} is not in the catalogue (metrics/README.md)"
        for name in sorted(metric_names(expr))
        if base_metric(name, catalogue) is None
        and not allowed_outside_catalogue(name)
        and name not in extra
    ]


def expr_problems(expr: str, catalogue: Mapping[str, Metric]) -> list[str]:
    problems = [
        f"range [{r}] instead of [{RATE_INTERVAL}]" for r in ranges(expr) if r != RATE_INTERVAL
    ]
    problems += counter_problems(expr, catalogue)
    problems += catalogue_problems(expr, catalogue)
    for o in occurrences(expr):
        given = set(matchers(o.selector))
        required: list[tuple[str, str, str]] = []
        if o.name == "kube_pod_info":
            pass  # the cluster's pods (kube-state-metrics' job): joined on uid, not filtered
        elif o.name.startswith("node_"):
            required.append(("instance", "=~", "$node"))
        else:
            required += [("job", "=~", "$job"), ("instance", "=~", "$instance")]
            metric = base_metric(o.name, catalogue)
            if metric is not None and "pool" in metric.labels:
                required.append(("pool", "=~", "$pool"))
        for label, op, value in required:
            if (label, op, value) not in given:
                problems.append(f'{o.name} lacks the matcher {label}{op}"{value}"')
    return problems


def datasource_problems(dashboard: Mapping[str, Any]) -> list[str]:
    problems = []
    ds = variables(dashboard).get("datasource")
    if ds is None or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("no datasource variable `datasource` of type datasource (prometheus)")
    for name, var in variables(dashboard).items():
        if (
            var.get("type") == "query"
            and (var.get("datasource") or {}).get("uid") != DATASOURCE_UID
        ):
            problems.append(f"variable {name}: datasource is not {DATASOURCE_UID}")
    for panel in content_panels(dashboard):
        title = panel.get("title", "?")
        if (panel.get("datasource") or {}).get("uid") != DATASOURCE_UID:
            problems.append(f"panel {title!r}: datasource is not {DATASOURCE_UID}")
        for target in panel.get("targets", []):
            if (target.get("datasource") or {}).get("uid") != DATASOURCE_UID:
                problems.append(
                    f"panel {title!r} target {target.get('refId')}: "
                    f"datasource is not {DATASOURCE_UID}"
                )
    return problems


def variable_problems(dashboard: Mapping[str, Any], catalogue: Mapping[str, Metric]) -> list[str]:
    problems = []
    found = variables(dashboard)
    for name in ("job", "instance", "pool"):
        var = found.get(name)
        if var is None or var.get("type") != "query":
            problems.append(f"no query variable `{name}`")
            continue
        if not str(var.get("query", "")).startswith("label_values("):
            problems.append(f"variable {name}: query is not label_values(...)")
    pool = found.get("pool", {})
    if not (pool.get("multi") and pool.get("includeAll")):
        problems.append("variable pool: not multi-value with All")
    for name, var in found.items():
        if var.get("type") != "query":
            continue
        if var.get("refresh") != 2:
            problems.append(f"variable {name}: does not refresh on time range change")
        for metric in sorted(metric_names(variable_selector(var))):
            if base_metric(metric, catalogue) is None and not allowed_outside_catalogue(metric):
                problems.append(f"variable {name}: {metric} is not in the catalogue")
    return problems


def panel_problems(dashboard: Mapping[str, Any], catalogue: Mapping[str, Metric]) -> list[str]:
    problems = []
    ids = [p.get("id") for p in iter_panels(dashboard)]
    for panel_id in sorted({i for i in ids if ids.count(i) > 1}, key=str):
        problems.append(f"panel id {panel_id} is not unique")
    titles = [p.get("title") for p in content_panels(dashboard)]
    for title in sorted({t for t in titles if titles.count(t) > 1}, key=str):
        problems.append(f"panel title {title!r} is not unique")
    for panel in content_panels(dashboard):
        title = panel.get("title") or ""
        label = f"panel {title or panel.get('id')!r}"
        if not title.strip():
            problems.append(f"{label}: no title")
        if not (panel.get("description") or "").strip():
            problems.append(f"{label}: no description")
        if not (panel.get("fieldConfig", {}).get("defaults", {}).get("unit") or "").strip():
            problems.append(f"{label}: no unit")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{label}: no targets")
        for target in targets:
            expr = (target.get("expr") or "").strip()
            if not expr:
                problems.append(f"{label} target {target.get('refId')}: no expression")
            problems += [f"{label}: {p}" for p in expr_problems(expr, catalogue)]
    return problems


def lint(dashboard: Mapping[str, Any], catalogue: Mapping[str, Metric]) -> list[str]:
    return (
        datasource_problems(dashboard)
        + variable_problems(dashboard, catalogue)
        + panel_problems(dashboard, catalogue)
    )


# ---------------------------------------------------------------- helpers for other tests


def variable_selector(variable: Mapping[str, Any]) -> str:
    """The series selector of a `label_values(SELECTOR, label)` variable query."""
    query = variable.get("query", "")
    if isinstance(query, dict):
        query = query.get("query", "")
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", str(query), re.DOTALL)
    return m.group(1) if m else ""


def substitute(expr: str, values: Mapping[str, str], rate_interval: str) -> str:
    """expr with $__rate_interval and $var / ${var} replaced; ValueError if any is left."""

    def replace(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name == "__rate_interval":
            return rate_interval
        if name not in values:
            raise ValueError(f"no value for ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


def panel_queries(
    dashboard: Mapping[str, Any],
    values: Mapping[str, str] | None = None,
    rate_interval: str = "1m",
) -> list[tuple[str, str]]:
    """(panel title, expression) for every target, ready to send to Prometheus.

    `values` overrides the defaults (every variable at "All", i.e. ".*").
    """
    merged = {**ALL_VALUES, **(values or {})}
    return [
        (title, substitute(expr, merged, rate_interval)) for title, expr in panel_exprs(dashboard)
    ]


def optional_panels(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Panels that may be empty, by what they need: every metric they query comes from
    node_exporter ("node_exporter"), from `hostpool exporter` ("exporter"), from its
    node view `hostpool exporter --node` ("node", its pods named by kube_pod_info where
    kube-state-metrics runs), from vLLM's metrics route ("vllm") or
    from `hostpool serve` alone ("serve": servers that embed hostpool have no populate
    phase, and no broker)."""
    needs: dict[str, str] = {}
    for panel in content_panels(dashboard):
        names = set().union(*(metric_names(t.get("expr", "")) for t in panel.get("targets", [])))
        if names and all(n.startswith("node_") for n in names):
            needs[panel["title"]] = "node_exporter"
        elif names and all(n.startswith("hostpool_exporter_") for n in names):
            needs[panel["title"]] = "exporter"
        elif names and all(n.startswith("hostpool_host_") for n in names - {"kube_pod_info"}):
            needs[panel["title"]] = "node"  # pods named by kube-state-metrics where it runs
        elif names and all(n.startswith("hostpool_vllm_") for n in names):
            needs[panel["title"]] = "vllm"
        elif names and all(n.startswith(("hostpool_serve_", "hostpool_broker_")) for n in names):
            needs[panel["title"]] = "serve"
    return needs
