"""docs/benchmarks.md's populate chart, drawn from the committed bench/results/populate.json: every
variant its own colour, the three groups (hostpool, peers, bare-kernel ceilings) told apart
by colour family and hatching, and no value label on top of another."""

from __future__ import annotations

import colorsys
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from bench._common import RESULTS_DIR, read_json
from bench.report import draw_populate_chart, populate_group

DATA: dict[str, Any] = read_json(Path(RESULTS_DIR) / "populate.json")
VARIANTS: list[str] = DATA["config"]["variants"]
SIZES: list[str] = [row["size"] for row in DATA["results"]]


@pytest.fixture(scope="module")
def fig() -> Iterator[Figure]:
    figure = draw_populate_chart(DATA)
    figure.canvas.draw()
    yield figure
    plt.close(figure)


def bars(fig: Figure) -> dict[tuple[str, str], Rectangle]:
    """(variant, size) -> its bar, by the gid the chart gives each bar."""
    found = {}
    for ax in fig.axes:
        for patch in ax.patches:
            gid = patch.get_gid()
            if gid and gid.startswith("populate:") and isinstance(patch, Rectangle):
                _, variant, size = gid.split(":", 2)
                found[(variant, size)] = patch
    return found


def value_labels(fig: Figure) -> list[Text]:
    return [
        t
        for ax in fig.axes
        for t in ax.texts
        if (t.get_gid() or "").startswith("value:") and t.get_text()
    ]


def test_the_committed_results_hold_what_the_chart_is_about() -> None:
    groups = {populate_group(v) for v in VARIANTS}
    assert groups == {"hostpool", "peer", "ceiling"}, groups
    assert len(VARIANTS) >= 10 and len(SIZES) >= 1


def test_every_measured_variant_has_a_bar_per_size(fig: Figure) -> None:
    found = bars(fig)
    expected = {
        (v, row["size"])
        for row in DATA["results"]
        for v, r in row["variants"].items()
        if r.get("status") == "ok"
    }
    assert set(found) == expected
    for (variant, size), bar in found.items():
        row = next(r for r in DATA["results"] if r["size"] == size)
        assert bar.get_width() == pytest.approx(row["variants"][variant]["gib_per_s"])


def test_each_variant_has_its_own_colour_the_same_in_every_panel(fig: Figure) -> None:
    colours: dict[str, set[tuple[float, ...]]] = {}
    for (variant, _), bar in bars(fig).items():
        rgba = to_rgba(bar.get_facecolor())
        colours.setdefault(variant, set()).add(tuple(round(c, 4) for c in rgba))
    assert all(len(c) == 1 for c in colours.values()), colours
    one = {variant: next(iter(c)) for variant, c in colours.items()}
    assert len(set(one.values())) == len(one), "two variants share a colour"


def hsv(bar: Rectangle) -> tuple[float, float, float]:
    return colorsys.rgb_to_hsv(*to_rgb(bar.get_facecolor()))


def test_the_groups_are_apart_by_family_and_hatch(fig: Figure) -> None:
    by_group: dict[str, list[Rectangle]] = {}
    for (variant, _), bar in bars(fig).items():
        by_group.setdefault(populate_group(variant), []).append(bar)
    # ceilings, and only they, are hatched and colourless (grey)
    assert all(b.get_hatch() for b in by_group["ceiling"])
    assert not any(b.get_hatch() for g in ("hostpool", "peer") for b in by_group[g])
    assert all(hsv(b)[1] < 0.05 for b in by_group["ceiling"])
    # hostpool and peers: saturated colours, hues in ranges that do not meet
    hues = {g: [hsv(b)[0] for b in by_group[g]] for g in ("hostpool", "peer")}
    assert all(hsv(b)[1] > 0.3 for g in ("hostpool", "peer") for b in by_group[g])
    lo_hp, hi_hp = min(hues["hostpool"]), max(hues["hostpool"])
    assert all(h < lo_hp - 0.1 or h > hi_hp + 0.1 for h in hues["peer"]), hues
    # and a legend names the groups
    legend = fig.legends[0]
    assert len(legend.get_texts()) == 3
    handles = [h for h in legend.legend_handles if isinstance(h, Rectangle)]
    assert [bool(h.get_hatch()) for h in handles] == [False, False, True]


def test_no_two_value_labels_overlap_and_each_is_inside_the_figure(fig: Figure) -> None:
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    labels = value_labels(fig)
    assert len(labels) == len(VARIANTS) * len(SIZES)
    boxes = [(t.get_gid(), t.get_window_extent(renderer)) for t in labels]
    page = fig.bbox
    for gid, box in boxes:
        assert page.x0 <= box.x0 and box.x1 <= page.x1, gid
        assert page.y0 <= box.y0 and box.y1 <= page.y1, gid
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), (a, b)


def test_each_value_label_sits_at_its_bar_end_inside_its_panel(fig: Figure) -> None:
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    found = bars(fig)
    for ax in fig.axes:
        panel = ax.get_window_extent(renderer)
        for text in ax.texts:
            gid = text.get_gid() or ""
            if not gid.startswith("value:"):
                continue
            box = text.get_window_extent(renderer)
            assert panel.x0 <= box.x0 and box.x1 <= panel.x1, gid
            _, variant, size = gid.split(":", 2)
            bar = found.get((variant, size))
            if bar is None:
                continue
            end = bar.get_window_extent(renderer)
            assert box.x0 >= end.x1, gid  # right of the bar, never over it
            assert end.y0 <= (box.y0 + box.y1) / 2 <= end.y1, gid  # on the bar's row
