"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Plot order: PD beside B3, the all-resident bound it is judged against.
PLOT_ORDER = ("B0", "B1", "B2", "PD", "B3")
COLORS = {"B0": "#9e9e9e", "B1": "#1f77b4", "B2": "#ff7f0e", "B3": "#2ca02c", "PD": "#d62728"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _medians(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], float]:
    """Median tokens/s per (arch, block, cache fraction, concurrency, baseline);
    B3 (cache-independent) is copied to every cache fraction of its arch."""
    values: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    b3: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    fractions: dict[tuple[Any, Any], set[Any]] = defaultdict(set)
    for r in rows:
        tps = r.get("output_tokens_per_s")
        if not isinstance(tps, (int, float)) or isinstance(tps, bool):
            continue
        if r.get("baseline") == "B3":
            b3[(r["arch"], r["block_size"], r["concurrency"])].append(float(tps))
        else:
            fractions[(r["arch"], r["block_size"])].add(r["cache_fraction"])
            key = (r["arch"], r["block_size"], r["cache_fraction"], r["concurrency"], r["baseline"])
            values[key].append(float(tps))
    out = {k: statistics.median(v) for k, v in values.items()}
    for (arch, block, conc), v in b3.items():
        for cf in fractions.get((arch, block)) or {1.0}:
            out[(arch, block, cf, conc, "B3")] = statistics.median(v)
    return out


def _panels(med: Mapping[tuple[Any, ...], float]) -> list[tuple[Any, Any, Any]]:
    return sorted({k[:3] for k in med}, key=repr)


def money_plot(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Tokens/s per baseline, grouped by concurrency, one panel per
    (arch, block, cache fraction). None if no row has tokens/s."""
    med = _medians(rows)
    if not med:
        return None
    plt = _pyplot()
    panels = _panels(med)
    ncols = min(3, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, (arch, block, cf) in zip(axes.flat, panels, strict=False):
        concs = sorted({k[3] for k in med if k[:3] == (arch, block, cf)})
        width = 0.8 / len(PLOT_ORDER)
        for i, b in enumerate(PLOT_ORDER):
            xs = [j + (i - (len(PLOT_ORDER) - 1) / 2) * width for j in range(len(concs))]
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
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("pdflash: tokens/s per baseline (B3 = all experts resident)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def concurrency_plot(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Tokens/s vs concurrency, one line per baseline, one panel per
    (arch, block, cache fraction)."""
    med = _medians(rows)
    if not med:
        return None
    plt = _pyplot()
    panels = _panels(med)
    ncols = min(3, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
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
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
