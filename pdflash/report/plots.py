"""PNG plots with matplotlib's Agg backend (no display needed).

Every figure says on its face where its inputs came from (weights,
acceptance with its mean when forced, routing: :func:`inputs_label`) and the
workload of each panel; bars and lines are medians over repeats.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdflash.labels import ABLATIONS
from pdflash.report.schema import RETIRED_LABELS

#: Plot order: PD beside B3, the all-resident bound it is judged against;
#: PD+host, PD's ablations and retired labels (older rows) only where a
#: result set has them.
PLOT_ORDER = ("B0", "B1", "B2", "PD", "PD+host", *ABLATIONS, *RETIRED_LABELS, "B3")
COLORS = {
    "B0": "#9e9e9e",
    "B1": "#1f77b4",
    "B2": "#ff7f0e",
    "B3": "#2ca02c",
    "PD": "#d62728",
    "PD+host": "#9467bd",
    "PD-all-on": "#ff9896",
    "PD-no-route-ahead": "#8c564b",
    "PD-one-band": "#e377c2",
    "PD-token-sched": "#bcbd22",
    "PD-no-stream": "#17becf",
    "PD-full-width": "#aec7e8",
    "PD-adaptive-width": "#c5b0d5",
}

# (arch, block, cache fraction, workload, concurrency, series: the baseline,
# with its settings where a point holds several: schema.series_labels)
Key = tuple[Any, Any, Any, Any, Any, str]

#: how the second, third, ... series of one baseline differ from its first
HATCHES = ("", "//", "..", "xx", "\\\\")
LINESTYLES = ("-", "--", ":", "-.")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _medians(rows: Sequence[Mapping[str, Any]]) -> dict[Key, float]:
    """Median tokens/s per (arch, block, cache fraction, workload,
    concurrency, series) at every comparison point (B3 and B0 rows serve
    several points; each setting of a label is its own series, never pooled)."""
    from pdflash.report.schema import comparison_points, series_labels, serves

    labels = series_labels(rows)
    out: dict[Key, float] = {}
    for point in comparison_points(rows):
        arch, block, conc, cf, load = point
        for baseline in PLOT_ORDER:
            found = [r for r in rows if r.get("baseline") == baseline and serves(r, point)]
            exact = [
                r for r in found if r.get("block_size") == block and r.get("cache_fraction") == cf
            ]
            chosen = exact or found
            for label in sorted({labels[id(r)] for r in chosen}):
                values = [
                    float(r["output_tokens_per_s"])
                    for r in chosen
                    if labels[id(r)] == label
                    and isinstance(r.get("output_tokens_per_s"), (int, float))
                    and not isinstance(r.get("output_tokens_per_s"), bool)
                    and math.isfinite(r["output_tokens_per_s"])
                ]
                if values:
                    out[(arch, block, cf, load, conc, label)] = statistics.median(values)
    return out


def _base(series: str) -> str:
    """The baseline label of a series (``PD [verify_width=full]`` -> ``PD``)."""
    return series.split(" [", 1)[0]


def _nth_of_base(series: str, order: Sequence[str]) -> int:
    """Which series of its baseline ``series`` is (0 for the first)."""
    same = [s for s in order if _base(s) == _base(series)]
    return same.index(series)


def _devices(rows: Sequence[Mapping[str, Any]]) -> str:
    names = sorted({str(r.get("device")) for r in rows if r.get("device")})
    return ", ".join(names) or "unknown device"


def inputs_caption(rows: Sequence[Mapping[str, Any]]) -> str:
    """The distinct input sources of ``rows`` (one line each, at most three
    then a count): what a figure's title must say on its face."""
    from pdflash.report.schema import inputs_label

    labels = sorted({inputs_label(r) for r in rows})
    shown = labels[:3]
    if len(labels) > 3:
        shown.append(f"(+{len(labels) - 3} more input sets)")
    return "\n".join(shown)


def _panels(med: Mapping[Key, float]) -> list[tuple[Any, Any, Any, Any]]:
    return sorted({k[:4] for k in med}, key=repr)


def _panel_title(arch: Any, block: Any, cf: Any, load: Any) -> str:
    tail = "" if load == "burst" else f"\n{load}"
    return f"{arch}  B={block}  cache {cf}{tail}"


def _order(med: Mapping[Key, float]) -> list[str]:
    """The series the rows have, in plot order of their baselines."""
    present = {k[5] for k in med}
    return [s for b in PLOT_ORDER for s in sorted(present) if _base(s) == b]


def _grid(plt: Any, n_panels: int) -> tuple[Any, Any]:
    """A figure with up to three panels per row."""
    ncols = min(3, n_panels)
    nrows = (n_panels + ncols - 1) // ncols
    result: tuple[Any, Any] = plt.subplots(
        nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False
    )
    return result


def _save(plt: Any, fig: Any, axes: Any, n_panels: int, title: str, path: str | Path) -> Path:
    """Blank the unused panels, add the legend and title, write the PNG."""
    for ax in list(axes.flat)[n_panels:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    # the input labels are long: wrap them to the figure's width and make
    # room above the panels, so no label is cut at the edges
    width_chars = max(40, int(fig.get_figwidth() * 13))
    lines = [w for line in title.split("\n") for w in textwrap.wrap(line, width_chars)]
    title_in = 0.15 * len(lines) + 0.1
    fig.set_figheight(fig.get_figheight() + title_in)
    fig.suptitle("\n".join(lines), fontsize=9)
    fig.tight_layout()  # matplotlib leaves room for the suptitle itself
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def money_plot(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Tokens/s per baseline, grouped by concurrency, one panel per
    (arch, block, cache fraction, workload). None if no row has tokens/s."""
    med = _medians(rows)
    if not med:
        return None
    plt = _pyplot()
    panels = _panels(med)
    fig, axes = _grid(plt, len(panels))
    order = _order(med)
    for ax, panel in zip(axes.flat, panels, strict=False):
        concs = sorted({k[4] for k in med if k[:4] == panel})
        width = 0.8 / len(order)
        for i, b in enumerate(order):
            xs = [j + (i - (len(order) - 1) / 2) * width for j in range(len(concs))]
            keys = [(panel[0], panel[1], panel[2], panel[3], c, b) for c in concs]
            have = [(x, med[k]) for x, k in zip(xs, keys, strict=True) if k in med]
            if have:
                ax.bar(
                    [x for x, _ in have],
                    [y for _, y in have],
                    width,
                    label=b,
                    color=COLORS[_base(b)],
                    hatch=HATCHES[_nth_of_base(b, order) % len(HATCHES)],
                )
        ax.set_xticks(range(len(concs)))
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s (median)")
        ax.set_title(_panel_title(*panel), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    b3 = " (B3 = all experts resident)" if "B3" in order else ""
    title = f"pdflash: tokens/s per baseline{b3} on {_devices(rows)}\n{inputs_caption(rows)}"
    return _save(plt, fig, axes, len(panels), title, path)


def concurrency_plot(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Tokens/s vs concurrency, one line per baseline, one panel per
    (arch, block, cache fraction, workload)."""
    med = _medians(rows)
    if not med:
        return None
    plt = _pyplot()
    panels = _panels(med)
    fig, axes = _grid(plt, len(panels))
    order = _order(med)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for b in order:
            pts = sorted((k[4], v) for k, v in med.items() if k[:4] == panel and k[5] == b)
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    linestyle=LINESTYLES[_nth_of_base(b, order) % len(LINESTYLES)],
                    label=b,
                    color=COLORS[_base(b)],
                )
        ax.set_xscale("log", base=2)
        concs = sorted({k[4] for k in med if k[:4] == panel})
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s (median)")
        ax.set_title(_panel_title(*panel), fontsize=9)
        ax.grid(alpha=0.3)
    title = f"pdflash: tokens/s vs concurrency on {_devices(rows)}\n{inputs_caption(rows)}"
    return _save(plt, fig, axes, len(panels), title, path)
