#!/usr/bin/env bash
# A cache with a slot for every expert (EngineConfig.full_cache) on the H200,
# every arm in ONE process (one model load): bench/h200/issue16.py --arms
#   PD      PD at full_cache=auto (default): at cache 1.0 the engine fills
#           the cache before the clock, as B3's, and runs no predictor /
#           router pass, stream, lookahead, background copies, PD
#           controller, nor the bench's shadow token-only scheduler
#   PDoff   PD with full_cache=off: as before the change (cache filled on
#           demand from what the short warm-up left, every part on): the
#           gap session 13 measured (call3-enginegraphs: PD 189 vs B3 414
#           tok/s at cache 1.0 c=4)
#   B1, B2  the offloaded baselines, full_cache=auto (at cache 1.0: filled,
#           gate lookahead off; B1 is then B3's configuration)
#   B3      every expert resident (cache fraction 1.0 whatever the point's)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, MAX_NEW (default 64) new tokens, points cache 1.0 c=4 and
# cache 0.75 c=4 (every arm at both: at 0.75 full_cache changes nothing, so
# PD and PDoff there are one configuration twice, an A/A noise check); every
# repeat runs each arm once per point, the order rotated each repeat and
# point, until BUDGET_S.
# Read: the table printed last (also in the tar's fullcache_summary.json):
#   per arm and point: tokens/s median, the rows' full_cache state and what
#   it switched off, medians of initial_resident_experts, h2d_bytes,
#   prefill_s, verify ms per step, draft_s, router_pass_s,
#   scheduler_us_per_step, exposed_fetch_s, acceptance per round
#   ARM/B3   tokens/s ratio of medians per point (B3 rows record cache
#            1.0 at either point: they pool under 1.0 and every point's
#            ratio reads them)
# Expected at cache 1.0: PD, B1, B2 start with 256 of 256 experts resident,
#   h2d_bytes 0, router_pass_s 0, prefill_s near B3's (~0.025 s); B1/B3 and
#   B2/B3 within noise of 1; PD/B3 within noise of 1 or below it only by
#   what the adaptive verify width (helper `width`'s) and the 2-D
#   scheduler's select (scheduler_us_per_step) cost; PDoff reproduces the
#   ~0.45 of session 13 (115-124 of 256 resident at the start, ~7 GB copied,
#   router_pass_s ~0.07). At 0.75: PD's full_cache state "off" (why_off:
#   the slots), PD/PDoff within noise of 1 (unchanged), PD/B3 the offload
#   cost at that fraction.
# Everything is packed into ONE file, $OUT/fullcache_ab.tgz (after the
# build, after the step, then again with the summary added).
# Expected: build ~30 s; the step's first run loads the model (~40-55 s),
# then 10 runs (5 arms x 2 points) per repeat at ~2-5 s each until BUDGET_S
# (default 300: about 5-8 repeats); the step is killed at BUDGET_S + 50 s:
# under 7 minutes in all.
#   OUT=/path bash bench/h200/fullcache_ab.sh
# BUDGET_S / REPEATS (default 12) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options; default --reference B3) override; SMOKE=1: the tiny
# CPU shape (a local check of the script). The run itself is
# bench/h200/switches_ab.sh's.
set -uo pipefail
export ARMS=${ARMS:-PD,PDoff=PD:full_cache=off,B1,B2,B3}
export NAME=fullcache_ab MAX_NEW=${MAX_NEW:-64} REPEATS=${REPEATS:-12} BUDGET_S=${BUDGET_S:-300}
export EXTRA=${EXTRA:---reference B3}
if [ "${SMOKE:-0}" = 1 ]; then
  export POINTS=${POINTS:-1.0:2,0.75:2}
else
  export POINTS=${POINTS:-1.0:4,0.75:4}
fi
export OUT=${OUT:-$PWD/out}
bash "$(dirname "$0")/switches_ab.sh"
rc=$?
tgz="$OUT/fullcache_ab.tgz"
[ -f "$tgz" ] || exit "$rc"
SUM=$(mktemp -d)
tar xzf "$tgz" -C "$SUM"
python3 - "$SUM" <<'PY'
import json, statistics, sys
from collections import Counter, defaultdict
from pathlib import Path

root = Path(sys.argv[1])
rows_file = root / "engine" / "rows.jsonl"
rows = [json.loads(line) for line in rows_file.open()] if rows_file.is_file() else []
MEDIANS = (
    "initial_resident_experts", "h2d_bytes", "prefill_s", "draft_s", "router_pass_s",
    "scheduler_us_per_step", "exposed_fetch_s", "acceptance_length_mean", "wall_s",
)


def med(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


# NOTE: B3 rows record cache fraction 1.0 whatever the point's (B3 is one
# configuration at every point): its rows of both points pool under 1.0, and
# every point's ARM/B3 reads them
points: dict = defaultdict(lambda: defaultdict(list))
b3_tps: dict = defaultdict(list)
for r in rows:
    points[(r.get("arch"), r.get("cache_fraction"), r.get("concurrency"))][r.get("arm")].append(r)
    if r.get("arm") == "B3":
        b3_tps[(r.get("arch"), r.get("concurrency"))].append(r.get("output_tokens_per_s"))
out = []
print("== fullcache_ab: per arm and point (medians over repeats)")
for (arch, cf, conc), by_arm in sorted(points.items(), key=lambda kv: str(kv[0])):
    entry = {"arch": arch, "cache_fraction": cf, "concurrency": conc, "arms": {}}
    for arm, rs in by_arm.items():
        full = [r.get("full_cache") or {} for r in rs]
        verify_ms = [
            1e3 * r["verify_s"] / r["verify_forwards"]
            for r in rs
            if isinstance(r.get("verify_s"), (int, float)) and r.get("verify_forwards")
        ]
        a = {
            "runs": len(rs),
            "tokens_per_s_median": med(r.get("output_tokens_per_s") for r in rs),
            "full_cache_states": dict(Counter(str(f.get("state")) for f in full)),
            "switched_off": sorted({p for f in full for p in (f.get("switched_off") or {})}),
            "why_off": sorted({str(f["why_off"]) for f in full if f.get("why_off")}),
            "verify_ms_per_forward_median": med(verify_ms),
            **{k + "_median": med(r.get(k) for r in rs) for k in MEDIANS},
        }
        entry["arms"][arm] = a
        m = a["tokens_per_s_median"]
        print(
            f"{arch} cf{cf} c{conc} {arm:>6}: runs {a['runs']} tok/s {'-' if m is None else f'{m:.1f}'} "
            f"full_cache {a['full_cache_states']} off {a['switched_off']} "
            f"| start {a['initial_resident_experts_median']} h2d {a['h2d_bytes_median']} "
            f"prefill {a['prefill_s_median']} verify ms/fwd {a['verify_ms_per_forward_median']} "
            f"draft {a['draft_s_median']} router {a['router_pass_s_median']} "
            f"sched us {a['scheduler_us_per_step_median']} exposed {a['exposed_fetch_s_median']} "
            f"tau {a['acceptance_length_mean_median']}"
        )
    b3 = med(b3_tps[(arch, conc)])
    for arm, a in entry["arms"].items():
        m = a["tokens_per_s_median"]
        if arm != "B3" and m and b3:
            entry.setdefault("over_b3_median", {})[arm] = m / b3
            print(f"{arch} cf{cf} c{conc} {arm}/B3 (medians): {m / b3:.3f}")
    out.append(entry)
(root / "fullcache_summary.json").write_text(json.dumps({"points": out}, indent=1))
PY
tar czf "$tgz.tmp" -C "$SUM" . && mv "$tgz.tmp" "$tgz"
rm -rf "$SUM"
exit "$rc"
