"""What the adaptive width's exploration decisions cost and bought, from
recorded rows (``verify_width``: ``width_histogram``,
``exploration_decisions``, ``estimates``).

Rows keep the width histogram, not which decision explored, so the
exploration decisions' drafts are bounded from above by the ``E`` widest
decisions (``E = exploration_decisions``): any ``E`` decisions verify at most
that many drafts. Per row (adaptive width only):

* ``explore_draft_share``: that bound over all verified drafts;
* ``explore_link_share``: the same decisions' share of the modeled link
  seconds of the drafted rows, each decision priced as a lone request's
  ``ℓ(1 + k) - ℓ(1)`` (``row_link_s`` extended to the whole block with the
  row's own ``union_novelty``/``union_saturation``, ``miss_rate``,
  ``link_bytes_per_s``, expert bytes and layers; batch sharing ignored);
* ``tokens_bought``: expected accepted drafts one exploring decision adds
  over the median width of the other decisions, ``Σ_{w0 < j <= w} S(j)``
  (the row's final ``survival_global``, positions past 8 inheriting the
  last continuation, the estimator's rule);
* ``s_per_token_bought``: the exposed modeled link seconds of those extra
  rows (``link_exposed_share`` times the link seconds) per expected token
  bought, against ``s_per_token_run`` (the run's wall over its committed
  tokens).

Modeled, from end-of-run estimates; medians over repeats per point (arch,
concurrency, label). Printed as a table, and written as JSON to ``--out``.

    python3 bench/h200/width_explore_share.py ROWS.jsonl [...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pdflash.engine.verify_width import union_curve


def survival(est: dict[str, Any], depth: int) -> list[float]:
    """``S(1..depth)``: the recorded ones, then the last continuation inherited."""
    s = [float(v) for v in est["survival_global"]][:depth]
    cont = s[-1] / s[-2] if len(s) >= 2 and s[-2] > 0 else 0.0
    while len(s) < depth:
        s.append(s[-1] * cont)
    return s


def analyze_row(row: dict[str, Any]) -> dict[str, Any] | None:
    """One adaptive row's figures (module docstring); None for other widths."""
    vw = row.get("verify_width") or {}
    if vw.get("policy") != "adaptive" or not vw.get("decisions"):
        return None
    hist = list(vw["width_histogram"])
    est = vw["estimates"]
    explored = int(vw.get("exploration_decisions") or 0)
    widths = sorted((k for k, n in enumerate(hist) for _ in range(n)), reverse=True)
    top, rest = widths[:explored], widths[explored:]
    block = len(hist) - 1
    per_expert = 0.0
    if est.get("miss_rate") and est.get("link_bytes_per_s"):
        per_expert = est["miss_rate"] * row["expert_nbytes"] / est["link_bytes_per_s"]
    layers, top_k = int(row["layers"]), int(row["top_k"])
    a, sat = float(est["union_novelty"]), float(est["union_saturation"])

    def link_s(k: int) -> float:  # a lone request's k drafted rows
        return (
            per_expert
            * layers
            * (union_curve(1 + k, a, sat, top_k) - union_curve(1, a, sat, top_k))
        )

    beta = est.get("link_exposed_share")
    beta = 1.0 if beta is None else float(beta)
    s = survival(est, block)
    w0 = int(statistics.median(rest)) if rest else 0
    bought = [sum(s[w0:w]) for w in top]
    extra_s = [beta * (link_s(w) - link_s(w0)) for w in top]
    total_drafts = sum(widths)
    total_link = sum(link_s(k) for k in widths)
    return {
        "decisions": len(widths),
        "exploration_decisions": explored,
        "explored_widths": top,
        "other_median_width": w0,
        "mean_width": total_drafts / len(widths),
        "mean_width_without_explored": sum(rest) / len(rest) if rest else None,
        "explore_draft_share": sum(top) / total_drafts if total_drafts else None,
        "explore_link_share": sum(link_s(k) for k in top) / total_link if total_link else None,
        "tokens_bought": sum(bought) / len(bought) if bought else None,
        "s_per_token_bought": sum(extra_s) / sum(bought) if sum(bought) > 0 else None,
        "s_per_token_run": row["wall_s"] / row["committed_tokens"]
        if row.get("committed_tokens")
        else None,
        "link_exposed_share": beta,
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats per (arch, concurrency, label)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        got = analyze_row(r)
        if got is not None:
            groups[(r["arch"], int(r["concurrency"]), r["baseline"])].append(got)
    out = []
    for (arch, conc, label), items in sorted(groups.items()):
        entry: dict[str, Any] = {"arch": arch, "concurrency": conc, "label": label}
        entry["repeats"] = len(items)
        for key in (
            "exploration_decisions",
            "mean_width",
            "mean_width_without_explored",
            "explore_draft_share",
            "explore_link_share",
            "tokens_bought",
            "s_per_token_bought",
            "s_per_token_run",
        ):
            vals = [i[key] for i in items if i[key] is not None]
            entry[key] = statistics.median(vals) if vals else None
        entry["explored_widths"] = [i["explored_widths"] for i in items]
        out.append(entry)
    return out


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = [json.loads(line) for p in args.rows for line in p.read_text().splitlines() if line]
    table = summarize(rows)
    print(
        "| arch | c | label | n | explore dec. | mean width (w/o explore) | "
        "explore draft share ≤ | explore link share ≤ | tokens bought / explore | "
        "s per token bought | s per token (run) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for e in table:
        print(
            f"| {e['arch']} | {e['concurrency']} | {e['label']} | {e['repeats']} | "
            f"{_fmt(e['exploration_decisions'], '.0f')} | {_fmt(e['mean_width'], '.2f')} "
            f"({_fmt(e['mean_width_without_explored'], '.2f')}) | "
            f"{_fmt(e['explore_draft_share'], '.2f')} | {_fmt(e['explore_link_share'], '.2f')} | "
            f"{_fmt(e['tokens_bought'], '.3f')} | {_fmt(e['s_per_token_bought'], '.3f')} | "
            f"{_fmt(e['s_per_token_run'], '.3f')} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
