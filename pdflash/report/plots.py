"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Plot order: PD beside B3, the all-resident bound it is judged against.
PLOT_ORDER = ("B0", "B1", "B2", "PD", "PD+host", "B3")
COLORS = {
    "B0": "#9e9e9e",
    "B1": "#1f77b4",
    "B2": "#ff7f0e",
    "B3": "#2ca02c",
    "PD": "#d62728",
    "PD+host": "#9467bd",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _medians(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], float]:
    """Median tokens/s per (arch, block, cache fraction, concurrency, baseline)
    at every comparison point (B3 and B0 rows serve several points)."""
    from pdflash.report.schema import comparison_points, serves

    out: dict[tuple[Any, ...], float] = {}
    for point in comparison_points(rows):
        arch, block, conc, cf = point
        for baseline in PLOT_ORDER:
            found = [r for r in rows if r.get("baseline") == baseline and serves(r, point)]
            exact = [
                r for r in found if r.get("block_size") == block and r.get("cache_fraction") == cf
            ]
            values = [
                float(r["output_tokens_per_s"])
                for r in exact or found
                if isinstance(r.get("output_tokens_per_s"), (int, float))
                and not isinstance(r.get("output_tokens_per_s"), bool)
                and math.isfinite(r["output_tokens_per_s"])
            ]
            if values:
                out[(arch, block, cf, conc, baseline)] = statistics.median(values)
    return out


def _devices(rows: Sequence[Mapping[str, Any]]) -> str:
    names = sorted({str(r.get("device")) for r in rows if r.get("device")})
    return ", ".join(names) or "unknown device"


def _panels(med: Mapping[tuple[Any, ...], float]) -> list[tuple[Any, Any, Any]]:
    return sorted({k[:3] for k in med}, key=repr)


def _grid(plt: Any, n_panels: int) -> tuple[Any, Any]:
    """A figure with up to three panels per row."""
    ncols = min(3, n_panels)
    nrows = (n_panels + ncols - 1) // ncols
    return plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)


def _save(plt: Any, fig: Any, axes: Any, n_panels: int, title: str, path: str | Path) -> Path:
    """Blank the unused panels, add the legend and title, write the PNG."""
    for ax in list(axes.flat)[n_panels:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def money_plot(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Tokens/s per baseline, grouped by concurrency, one panel per
    (arch, block, cache fraction). None if no row has tokens/s."""
    med = _medians(rows)
    if not med:
        return None
    plt = _pyplot()
    panels = _panels(med)
    fig, axes = _grid(plt, len(panels))
    for ax, (arch, block, cf) in zip(axes.flat, panels, strict=False):
        concs = sorted({k[3] for k in med if k[:3] == (arch, block, cf)})
        # optional baselines (PD+host) take a bar only where a set has them
        order = [b for b in PLOT_ORDER if b != "PD+host" or any(k[4] == b for k in med)]
        width = 0.8 / len(order)
        for i, b in enumerate(order):
            xs = [j + (i - (len(order) - 1) / 2) * width for j in range(len(concs))]
            ys = [med.get((arch, block, cf, c, b), 0.0) for c in concs]
            have = [
                (x, y)
                for x, y, c in zip(xs, ys, concs, strict=True)
                if (arch, block, cf, c, b) in med
            ]
            if have:
                ax.bar([x for x, _ in have], [y for _, y in have], width, label=b, color=COLORS[b])
        ax.set_xticks(range(len(concs)))
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{arch}  B={block}  cache {cf}")
        ax.grid(axis="y", alpha=0.3)
    title = f"pdflash: tokens/s per baseline (B3 = all experts resident) on {_devices(rows)}"
    return _save(plt, fig, axes, len(panels), title, path)


def concurrency_plot(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Tokens/s vs concurrency, one line per baseline, one panel per
    (arch, block, cache fraction)."""
    med = _medians(rows)
    if not med:
        return None
    plt = _pyplot()
    panels = _panels(med)
    fig, axes = _grid(plt, len(panels))
    for ax, (arch, block, cf) in zip(axes.flat, panels, strict=False):
        for b in PLOT_ORDER:
            pts = sorted(
                (k[3], v) for k, v in med.items() if k[:3] == (arch, block, cf) and k[4] == b
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=b, color=COLORS[b])
        ax.set_xscale("log", base=2)
        concs = sorted({k[3] for k in med if k[:3] == (arch, block, cf)})
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{arch}  B={block}  cache {cf}")
        ax.grid(alpha=0.3)
    title = f"pdflash: tokens/s vs concurrency on {_devices(rows)}"
    return _save(plt, fig, axes, len(panels), title, path)
