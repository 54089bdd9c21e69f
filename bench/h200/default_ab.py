"""The bare ``pdflash-bench`` default's own runs, interleaved A/B: the
default suite's specs (tiny synthetic model, forced acceptance, cache 0.25,
``2c`` live requests for a ``c``-block step; on the GPU the real link, on
the CPU the emulated one unless ``--emulated-link-gbps`` says otherwise)
for B1, B2 and PD, plus PD's ablations, every arm once per repeat in an
order rotated each repeat, until ``--repeats`` or ``--budget-s``.

Arms (``--arms``, comma-separated names):
  B1, B2, PD          the default suite's specs as they are
  PDprec              PD with ``route_ahead_gate=precision`` (the gate
                      without its cost bound: the default before it)
  PDnora              PD-no-route-ahead (route-ahead and the stream off)

Writes ``OUT/rows.jsonl`` (each row with its ``arm`` and ``repeat``; read by
``bench/pair_ratios.py OUT/rows.jsonl PD/B1 ...``) and prints the pairs.

    python3 bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --out OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.pair_ratios import pair_ratios
from pdflash.bench.suites import default

#: name: (the default spec it changes, the changes)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "PDprec": ("PD", {"route_ahead_gate": "precision"}),
    "PDnora": ("PD", {"baseline": "PD-no-route-ahead"}),
}


def _arm_specs(names: list[str], base: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for name in names:
        if name in base:
            specs[name] = base[name]
        elif name in VARIANTS:
            of, changes = VARIANTS[name]
            specs[name] = {**base[of], **changes}
        else:
            raise SystemExit(f"unknown arm {name!r}; choose from {[*base, *VARIANTS]}")
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--arms", default="B1,B2,PD,PDprec,PDnora")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--emulated-link-gbps", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    on_gpu = default._cuda_present(args.device)
    names = args.arms.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    start = time.monotonic()
    with rows_path.open("a") as f:
        for rep in range(args.repeats):
            for conc in args.concurrency:
                ns = argparse.Namespace(
                    quick=False,
                    concurrency=[conc],
                    cache_fraction=[0.25],
                    device=args.device,
                    emulated_link_gbps=args.emulated_link_gbps,
                    marginal_rule="verify",
                )
                base = {s["baseline"]: s for s in default.default_specs(ns, on_gpu=on_gpu)}
                specs = _arm_specs(names, base)
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    row = run_spec(RunSpec(**{**specs[name], "repeat": rep})).row
                    row["arm"] = name
                    f.write(json.dumps(row, default=str) + "\n")
                    f.flush()
                    print(
                        f"rep {rep} c={conc} {name}: {row['output_tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
            if time.monotonic() - start > args.budget_s:
                break
    rows = [json.loads(line) for line in rows_path.open()]
    for num in names[1:]:
        for den in names[:1] + (["B2"] if "B2" in names and num != "B2" else []):
            for point in pair_ratios(rows, num, den):
                print(json.dumps({"pair": f"{num}/{den}", **point}, default=str))


if __name__ == "__main__":
    main()
