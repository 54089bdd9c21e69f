"""Re-read every committed rows file with the report's paired verdicts
(pdflash.report.evaluate's verdicts[].pairs, pdflash.report.ablation's
pairs): print each comparison where the interleaved repeats' ratios call a
side faster while the two configurations' intervals overlap ("within
noise"), or the other way round. CPU only; the rows are read as committed.

    python bench/results/cpu/pairs-reread-2026-12-04/reread.py > reread.txt
"""

from __future__ import annotations

import glob
import gzip
import json
import os

from pdflash.report.ablation import ablation_table
from pdflash.report.evaluate import evaluate

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def main() -> None:
    for f in sorted(glob.glob(os.path.join(ROOT, "**", "rows.jsonl*"), recursive=True)):
        opener = gzip.open if f.endswith(".gz") else open
        with opener(f, "rt") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        if not rows or "repeat" not in rows[0] or "baseline" not in rows[0]:
            continue
        rel = os.path.relpath(f, ROOT)
        for v in evaluate(rows).get("verdicts", []):
            p = v.get("pairs") or {}
            if p.get("verdict") not in (None, v.get("verdict")):
                print(
                    f"{rel}: {v['arch']} c={v['concurrency']} cache {v['cache_fraction']} "
                    f"{v['workload']}: {v['a']} / {v['b']}: intervals {v['verdict']}; pairs "
                    f"{p['verdict']} ({p['median']:.3f} [{p['low']:.3f}, {p['high']:.3f}], "
                    f"n={p['n']})"
                )
        for e in ablation_table(rows):
            t = e["output_tokens_per_s"]
            p = t.get("pairs") or {}
            if p.get("verdict") not in (None, t["verdict"]):
                print(
                    f"{rel}: ablation {e['point']} PD / {e['variant']}: intervals {t['verdict']}; "
                    f"pairs {p['verdict']} ({p['median']:.3f} [{p['low']:.3f}, {p['high']:.3f}], "
                    f"n={p['n']})"
                )


if __name__ == "__main__":
    main()
