"""``trace_baselines.sh``'s summary: per point (arch, cache fraction,
concurrency, arrivals), every (label, verify width) configuration's tokens/s
(median, t-based 95% interval of the mean over repeats), drafts verified,
tau, MB per token and verify steps per run (in a burst the slowest request
sets them); then PD at its preset width against the best B1/B2
configuration (the one with the highest median): the per-repeat ratios,
their median and their own t-based interval, and the verdict: from the
pairs' interval where two or more repeats pair ("faster"/"slower" where it
excludes 1, the rule the results READMEs state), else from the two
configurations' intervals (``verdict_from`` says which); where another
width of PD ran faster than its preset, that configuration against the
same baseline; and where ``PD+host`` ran (``LABELS=PD,PD+host,B1,B2``), it
at the preset width against the same baseline and against PD. Printed, and
written to ``ROOT/trace_baselines_summary.json``.

    python3 bench/h200/trace_baselines_summary.py ROOT   # ROOT/trace/rows.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from pdflash.bench.pair_ratios import captures_in_clock

from pdflash.report.stats import compare, pair_summary, t_interval
from pdflash.report.writers import read_jsonl

#: the labels PD is held against (issue 14: never slower than their best)
BASELINES = ("B1", "B2")


def interval(values: list[float]) -> dict[str, Any]:
    """n, median and (with two or more values) the t-based 95% interval of
    the mean (:func:`pdflash.report.stats.t_interval`)."""
    out: dict[str, Any] = {"n": len(values), "median": statistics.median(values)}
    if len(values) >= 2:
        iv = t_interval(values)
        out["mean_ci95"] = [iv.low, iv.high]
    return out


def verdict(a: list[float], b: list[float]) -> str:
    """``faster``/``slower`` (tokens/s ``a`` against ``b``) where their t
    intervals do not overlap (:func:`pdflash.report.stats.compare`)."""
    if len(a) < 2 or len(b) < 2:
        return "too few repeats"
    return {"a": "faster", "b": "slower"}.get(compare(t_interval(a), t_interval(b)), "within noise")


def _pair(
    by_repeat: dict[tuple[str, str], dict[int, float]],
    a: tuple[str, str],
    b: tuple[str, str],
) -> dict[str, Any]:
    """Configuration ``a`` against ``b``: per-repeat ratios of tokens/s, their
    median and t-based 95% interval (the pairs' own, where two or more) and
    the verdict: the pairs' where two or more repeats pair, else the two
    configurations' intervals'."""
    ra, rb = by_repeat[a], by_repeat[b]
    pairs = pair_summary(ra, rb)
    ratios = pairs["ratios"]
    if pairs["called"] is not None:
        judged, source = pairs["called"], "pairs"
    else:
        judged, source = verdict(list(ra.values()), list(rb.values())), "configurations"
    return {
        "pd": f"{a[0]} [{a[1]}]",
        "best": f"{b[0]} [{b[1]}]",
        "pair_ratios": ratios,
        # one pair is its own median
        "pair_ratio_median": statistics.median(ratios) if ratios else None,
        "pair_ratio_ci95": None if pairs["called"] is None else [pairs["low"], pairs["high"]],
        "verdict": judged,
        "verdict_from": source,
    }


def summarize(rows: list[dict[str, Any]], pd_width: str = "adaptive") -> list[dict[str, Any]]:
    """The summary's points from the matrix ``rows`` (module docstring)."""
    points: dict[tuple[Any, ...], dict[tuple[str, str], list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in rows:
        workload = r.get("workload") or {}
        key = (
            r["arch"],
            r["cache_fraction"],
            r["concurrency"],
            workload.get("arrivals", "burst"),
            workload.get("num_requests"),
        )
        points[key][(r["baseline"], r["verify_width"]["setting"])].append(r)
    out = []
    for (arch, cache, conc, arrivals, requests), configs in sorted(
        points.items(), key=lambda kv: str(kv[0])
    ):
        entry: dict[str, Any] = {
            "arch": arch,
            "cache_fraction": cache,
            "concurrency": conc,
            "arrivals": arrivals,
            "num_requests": requests,
            "configs": {},
        }
        by_repeat: dict[tuple[str, str], dict[int, float]] = {}
        for (label, width), runs in sorted(configs.items()):
            tps = [float(r["output_tokens_per_s"]) for r in runs]
            widths = [
                r["verify_width"]["mean_width_drafts"]
                for r in runs
                if r["verify_width"].get("mean_width_drafts") is not None
            ]
            entry["configs"][f"{label} [{width}]"] = {
                "tokens_per_s": interval(tps),
                "drafts_verified_mean": statistics.fmean(widths) if widths else None,
                "tau_mean": statistics.fmean(float(r["acceptance_length_mean"]) for r in runs),
                "mb_per_token_median": statistics.median(
                    float(r["bytes_per_token"]) / 1e6 for r in runs
                ),
                "steps_median": (
                    statistics.median(int(r["steps"]) for r in runs)
                    if all("steps" in r for r in runs)
                    else None
                ),
                "sources": sorted(
                    {f"{r['routing_source']}/{r['acceptance_source']}" for r in runs}
                ),
                # runs whose clock held CUDA-graph captures (a pre-capture that
                # did not cover them): their tokens/s are confounded
                "runs_with_captures_in_run": sum(1 for r in runs if captures_in_clock(r)),
            }
            by_repeat[(label, width)] = {
                int(r["repeat"]): float(r["output_tokens_per_s"]) for r in runs
            }
        bases = [c for c in by_repeat if c[0] in BASELINES]
        pds = [c for c in by_repeat if c[0] == "PD"]
        if bases:
            best = max(bases, key=lambda c: statistics.median(by_repeat[c].values()))
            if ("PD", pd_width) in by_repeat:
                entry["pd_vs_best_baseline"] = _pair(by_repeat, ("PD", pd_width), best)
            if pds:
                # PD at whichever width ran fastest: what PD could do if its
                # preset chose that width here (absent where it is the preset)
                pd_best = max(pds, key=lambda c: statistics.median(by_repeat[c].values()))
                if pd_best != ("PD", pd_width):
                    entry["pd_best_vs_best_baseline"] = _pair(by_repeat, pd_best, best)
            host = ("PD+host", pd_width)
            if host in by_repeat:
                entry["pd_host_vs_best_baseline"] = _pair(by_repeat, host, best)
        if ("PD+host", pd_width) in by_repeat and ("PD", pd_width) in by_repeat:
            entry["pd_host_vs_pd"] = _pair(by_repeat, ("PD+host", pd_width), ("PD", pd_width))
        out.append(entry)
    return out


def main(root: Path) -> None:
    rows = read_jsonl(root / "trace" / "rows.jsonl")
    points = summarize(rows)
    for p in points:
        requests = "" if p["num_requests"] is None else f", {p['num_requests']} requests"
        print(
            f"{p['arch']} cache {p['cache_fraction']} c={p['concurrency']} "
            f"({p['arrivals']}{requests})"
        )
        for name, c in p["configs"].items():
            t = c["tokens_per_s"]
            ci = t.get("mean_ci95")
            ci_text = f"[{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "[one repeat]"
            drafts, steps = c["drafts_verified_mean"], c["steps_median"]
            captured = c["runs_with_captures_in_run"]
            print(
                f"  {name:16s} {t['median']:7.1f} {ci_text} n={t['n']} drafts "
                f"{'-' if drafts is None else f'{drafts:.1f}'} tau {c['tau_mean']:.2f} "
                f"MB/tok {c['mb_per_token_median']:.0f} steps "
                f"{'-' if steps is None else f'{steps:g}'} ({', '.join(c['sources'])})"
                + (f" graph captures in the clock: {captured}/{t['n']} runs" if captured else "")
            )
        for key in (
            "pd_vs_best_baseline",
            "pd_best_vs_best_baseline",
            "pd_host_vs_best_baseline",
            "pd_host_vs_pd",
        ):
            cmp_ = p.get(key)
            if cmp_:
                median = cmp_["pair_ratio_median"]
                ci = cmp_["pair_ratio_ci95"]
                ci_text = "" if ci is None else f", pairs' interval [{ci[0]:.2f}, {ci[1]:.2f}]"
                print(
                    f"  {cmp_['pd']} / {cmp_['best']}: median of pairs "
                    f"{'-' if median is None else f'{median:.2f}'} "
                    f"({', '.join(f'{x:.2f}' for x in cmp_['pair_ratios'])}){ci_text}, "
                    f"{cmp_['verdict']} (by the {cmp_['verdict_from']})"
                )
    (root / "trace_baselines_summary.json").write_text(json.dumps({"points": points}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
