"""Docs that lead somewhere: every section of the README or a docs/ page, repository file
and `make` target that a file in deploy/, metrics/ or docs/ names exists (the systemd unit
once named a README section and a `make install` that did not). Links between docs/ pages
are MkDocs' to check (`mkdocs build --strict` in `make lint`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
REFERRING = sorted(
    f for d in ("deploy", "metrics", "docs") for f in (ROOT / d).rglob("*") if f.is_file()
)

# README.md#anchor, docs/PAGE.md#anchor (also inside file:///opt/hostpool/...#anchor URLs)
ANCHOR = re.compile(r"(README\.md|docs/[\w/-]+\.md)#([\w-]+)")
# README "Section" / the README's "Section" / README.md, section "Section" /
# docs/PAGE.md, section "Section"
SECTION = re.compile(r"(README|docs/[\w/-]+\.md)(?:'s|\.md)?,? (?:section )?\"([^\"]+)\"")
# a repository file: a top-level folder, then a name with an extension; not part of a
# longer path (/var/lib/grafana/dashboards/hostpool is Grafana's, not ours)
PATH = re.compile(
    r"(?<![\w/.~$-])((?:bench|dashboards|deploy|docs|hostpool|metrics|requirements|tests|tools)"
    r"/[\w./*-]*\.\w+)"
)
MAKE = re.compile(r"`make ([\w-]+)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def mkdocs_anchor(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading of a docs/ page."""
    return slugify(heading.strip(), "-")


def headings(page: str) -> dict[str, str]:
    """A page's heading text (README, README.md or docs/X.md) -> its anchor."""
    name = "README.md" if page == "README" else page
    text = re.sub(r"^```.*?^```", "", (ROOT / name).read_text(), flags=re.M | re.S)
    anchor = github_anchor if name == "README.md" else mkdocs_anchor
    return {h: anchor(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, re.M))


def references(pattern: re.Pattern[str]) -> list[tuple[str, ...]]:
    return [
        (str(f.relative_to(ROOT)), *m.groups())
        for f in REFERRING
        for m in pattern.finditer(f.read_text(errors="replace"))
    ]


def test_the_patterns_find_what_they_are_for() -> None:
    """Each pattern on a sample: a check that finds nothing checks nothing."""
    sample = (
        'see the README\'s "Running as a service" (README.md#running-as-a-service), '
        'docs/operations.md, section "TLS and basic auth", docs/runbook.md#hostpooltargetdown, '
        "deploy/hostpool/serve.toml, /var/lib/grafana/dashboards/hostpool/x.json and "
        "`make install`"
    )
    assert [m.groups() for m in ANCHOR.finditer(sample)] == [
        ("README.md", "running-as-a-service"),
        ("docs/runbook.md", "hostpooltargetdown"),
    ]
    assert [m.groups() for m in SECTION.finditer(sample)] == [
        ("README", "Running as a service"),
        ("docs/operations.md", "TLS and basic auth"),
    ]
    assert [m.group(1) for m in PATH.finditer(sample)] == [
        "docs/operations.md",
        "docs/runbook.md",
        "deploy/hostpool/serve.toml",
    ]
    assert [m.group(1) for m in MAKE.finditer(sample)] == ["install"]
    assert github_anchor("Running it: Prometheus, Grafana, systemd") == (
        "running-it-prometheus-grafana-systemd"
    )
    assert mkdocs_anchor("serve: probes, readiness and stopping") == (
        "serve-probes-readiness-and-stopping"
    )
    # and on the real files: the unit, the alerts and the Grafana provisioning refer
    assert {f for f, *_ in references(ANCHOR)} >= {
        "deploy/systemd/hostpool-serve.service",
        "metrics/alerts.yml",
        "deploy/grafana/provisioning/datasources/hostpool.yaml",
        "deploy/grafana/provisioning/dashboards/hostpool.yaml",
    }


@pytest.mark.parametrize(("source", "page", "anchor"), references(ANCHOR))
def test_every_anchor_exists(source: str, page: str, anchor: str) -> None:
    assert anchor in headings(page).values(), f"{source}: {page}#{anchor} has no heading"


@pytest.mark.parametrize(("source", "page", "section"), references(SECTION))
def test_every_section_named_exists(source: str, page: str, section: str) -> None:
    assert section in headings(page), f'{source}: {page} has no section "{section}"'


@pytest.mark.parametrize(("source", "path"), references(PATH))
def test_every_repository_path_exists(source: str, path: str) -> None:
    # from the repository root, or from the naming file's folder (metrics/README.md: tests/)
    bases = (ROOT, (ROOT / source).parent)
    assert any(any(base.glob(path)) for base in bases), f"{source} names {path}: not there"


@pytest.mark.parametrize(("source", "target"), references(MAKE))
def test_every_make_target_exists(source: str, target: str) -> None:
    assert target in make_targets(), f"{source}: `make {target}` is not a Makefile target"


def test_every_readme_link_resolves() -> None:
    """The README is outside the MkDocs site: its links to files and anchors are checked
    here (a link into docs/ names a page and, after #, one of its headings)."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # a URL
        path, _, anchor = link.partition("#")
        page = path or "README.md"
        assert (ROOT / page).exists(), f"README.md links {link}: no {page}"
        if anchor:
            assert anchor in headings(page).values(), f"README.md links {link}: no such heading"


def test_runbook_urls_point_into_the_runbook_page() -> None:
    alerts = (ROOT / "metrics" / "alerts.yml").read_text()
    urls = re.findall(r"runbook_url: (\S+)", alerts)
    assert urls and all(u.startswith("file:///opt/hostpool/docs/runbook.md#") for u in urls), urls
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    assert runbook.startswith("# Runbook\n")
    sections = {mkdocs_anchor(h) for h in re.findall(r"^## (.+?)\s*$", runbook, re.M)}
    assert {u.split("#", 1)[1] for u in urls} <= sections
