"""Issue 18's pairs: tokens/s on N GPUs over 1 GPU, one ratio per round.

bench/h200/issue18.sh runs every GPU count once per round (the order
reversed every other round), each round with its own seed, and appends the
rows of ``<tag>_g<N>`` to ``OUT/<tag>_g<N>/rows.jsonl``. A pair is the N-GPU
row and the 1-GPU row of one point (arch, baseline, cache fraction per GPU,
concurrency) and one seed. Per point and N it prints the ratios, their
median, the t-based 95% interval (two or more pairs), whether the 1-GPU runs
were link-bound (their exposed fetch over wall, median) and what the N-GPU
runs' ranks did (aggregate link GB/s, all-to-all share of the wall). The
issue's target, >= 1.8x on 2 GPUs where the 1-GPU run is link-bound, is read
from those lines; nothing here is simulated. No GPU: the rows as written.

Usage: python bench/h200/issue18_pairs.py OUT [--json]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from pdflash.bench.pair_ratios import paired, ratio_verdict

from pdflash.report.stats import interval
from pdflash.report.writers import read_jsonl

_STEP_DIR = re.compile(r"^(?P<tag>.+)_g(?P<n>[0-9]+)$")

Point = tuple[str, str, float, int]


def _rows_file(d: Path) -> Path | None:
    for name in ("rows.jsonl", "rows.jsonl.gz"):
        if (d / name).is_file():
            return d / name
    return None


def load(out: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """``{tag: {gpus: rows}}`` from ``OUT/<tag>_g<N>/rows.jsonl[.gz]``; a row
    that records its GPU count must agree with its folder's."""
    found: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for d in sorted(p for p in out.iterdir() if p.is_dir()):
        m = _STEP_DIR.match(d.name)
        path = _rows_file(d) if m else None
        if m is None or path is None:
            continue
        n = int(m["n"])
        rows = read_jsonl(path)
        for r in rows:
            if r.get("gpus") not in (None, n):
                raise ValueError(f"{path}: a row says gpus={r['gpus']}, its folder {n}")
        found.setdefault(m["tag"], {})[n] = rows
    return found


def _point(row: dict[str, Any]) -> Point:
    cache = (
        row["cache_fraction_per_gpu"] if "cache_fraction_per_gpu" in row else row["cache_fraction"]
    )
    return (str(row["arch"]), str(row["baseline"]), float(cache), int(row["concurrency"]))


def _by_seed(rows: list[dict[str, Any]]) -> dict[Point, dict[int, dict[str, Any]]]:
    out: dict[Point, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r.get("output_tokens_per_s") is None or r.get("seed") is None:
            continue
        out.setdefault(_point(r), {})[int(r["seed"])] = r
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _share(row: dict[str, Any], key: str) -> float | None:
    wall = row.get("wall_s")
    value = row.get(key)
    return value / wall if value is not None and wall else None


def pairs(found: dict[str, dict[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One entry per tag, point and N > 1 with at least one pair."""
    out = []
    for tag, by_n in sorted(found.items()):
        if 1 not in by_n:
            continue
        base = _by_seed(by_n[1])
        for n in sorted(k for k in by_n if k > 1):
            for point, runs in sorted(_by_seed(by_n[n]).items()):
                bases = base.get(point, {})
                matched = paired(
                    {s: r["output_tokens_per_s"] for s, r in runs.items()},
                    {s: r["output_tokens_per_s"] for s, r in bases.items()},
                )
                if not matched:
                    continue
                seeds = [s for s, _ in matched]
                ratios = [x for _, x in matched]
                ones = [bases[s] for s in seeds]
                iv = interval(ratios) if len(ratios) > 1 else None
                exposed = [x for one in ones if (x := _share(one, "exposed_fetch_s")) is not None]
                agg = [
                    float(runs[s]["aggregate_link_gbps"])
                    for s in seeds
                    if runs[s].get("aggregate_link_gbps") is not None
                ]
                a2a = [
                    float(runs[s]["all_to_all_share"])
                    for s in seeds
                    if runs[s].get("all_to_all_share") is not None
                ]
                out.append(
                    {
                        "tag": tag,
                        "point": point,
                        "gpus": n,
                        "seeds": seeds,
                        "ratios": ratios,
                        "median": statistics.median(ratios),
                        "interval": None if iv is None else [iv.low, iv.high],
                        "verdict": None if iv is None else ratio_verdict(iv.low, iv.high),
                        "tokens_per_s_1gpu": _median([o["output_tokens_per_s"] for o in ones]),
                        "tokens_per_s_ngpu": _median(
                            [runs[s]["output_tokens_per_s"] for s in seeds]
                        ),
                        "exposed_fetch_share_1gpu": _median(exposed),
                        "aggregate_link_gbps": _median(agg),
                        "all_to_all_share": _median(a2a),
                    }
                )
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--json"]
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    result = pairs(load(Path(args[0])))
    if not result:
        print(
            "no pairs: no <tag>_g1 and <tag>_g<N> rows with a common point and seed",
            file=sys.stderr,
        )
        return 1
    for p in result:
        arch, baseline, cache, conc = p["point"]
        iv = p["interval"]
        print(
            f"{arch} {baseline} cache/GPU {cache:g} c={conc}: "
            f"g{p['gpus']}/g1 median {p['median']:.3f} "
            + (
                "one pair: no interval"
                if iv is None
                else f"[{iv[0]:.2f}, {iv[1]:.2f}] {p['verdict']}"
            )
            + f" pairs ({', '.join(f'{x:.2f}' for x in p['ratios'])}); tok/s "
            f"{_fmt(p['tokens_per_s_1gpu'], '.1f')} -> {_fmt(p['tokens_per_s_ngpu'], '.1f')}; "
            f"g1 exposed fetch/wall {_fmt(p['exposed_fetch_share_1gpu'], '.2f')}; "
            f"g{p['gpus']} link {_fmt(p['aggregate_link_gbps'], '.1f')} GB/s, "
            f"all-to-all {_fmt(p['all_to_all_share'], '.2f')} of wall"
        )
    if "--json" in argv:
        print(json.dumps({"pairs": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
