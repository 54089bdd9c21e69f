"""CPU A/B of PD against B1 on session 39's replayed learned trace
(../../h100/session39-2026-12-05/proxy-approx/trace_gpu_t1.npz: routing,
acceptance, gate lookahead and route-ahead's approximate router **learned,
replayed** on small-qwen3_moe, 4 MoE layers, **synthetic** fp32 weights),
cache 0.2, closed loop of 4 requests a client, 24 new tokens, the link
emulated at LINK_GBPS; arms interleaved and rotated per repeat. Run from the
repository root:

    python3 -P bench/results/cpu/trace-replay-2026-12-07/trace_ab.py CONCURRENCY REPEATS OUT.jsonl LINK_GBPS ARM,ARM,... [ARCH LAYERS]

Arms: :data:`ARMS`. ARCH and LAYERS (default small-qwen3_moe, 4) pick the
target the trace is replayed on (session 53: small-gpt_oss, 8 layers, the
expert count and top-k of the GPU runs' gpt-oss-20b shape).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.suites.matrix import rotated

TRACE = "bench/results/h100/session39-2026-12-05/proxy-approx/trace_gpu_t1.npz"
ARMS: dict[str, dict[str, Any]] = {
    "B1": dict(baseline="B1"),
    "B1f1": dict(baseline="B1", verify_width="fixed:1"),
    "PD": dict(baseline="PD"),
    "PDf1": dict(baseline="PD", verify_width="fixed:1"),
    "PDsched": dict(baseline="PD", rest_batching="scheduler"),
    "PDnoraf1": dict(baseline="PD-no-route-ahead", verify_width="fixed:1"),
    "PDallf1": dict(baseline="PD-all-on", verify_width="fixed:1"),
    "PDf1evra": dict(baseline="PD", verify_width="fixed:1", eviction="route_ahead"),
}
KEYS = (
    "output_tokens_per_s",
    "bytes_per_token",
    "exposed_fetch_s",
    "expert_cache_hit_rate",
    "routeahead_batch_coverage",
    "routeahead_batch_precision",
    "predict_s",
    "wall_s",
    "steps",
    "pd_parts",
    "verify_width",
    "rest_batching",
    "round_latency_p99_s",
    "tpot_p99_s",
    "acceptance_length_mean",
    "routing_source",
    "acceptance_source",
    "weights_source",
    "link_busy_s",
)


def base_spec(conc: int, link_gbps: float, arch: str, layers: int) -> dict[str, Any]:
    """The run spec every arm of the replay starts from (the union-tie study's
    script takes it too)."""
    return dict(
        arch=arch,
        layers=layers,
        device="cpu",
        cache_fraction=0.2,
        concurrency=conc,
        arrivals="closed",
        users=conc,
        num_requests=4 * conc,
        prompt_len=32,
        max_new_tokens=24,
        block_size=16,
        routing_source="trace",
        acceptance="trace",
        trace=TRACE,
        emulated_link_gbps=link_gbps,
    )


def _no_context(name: str) -> AbstractContextManager[object]:
    return nullcontext()


def replay_interleaved(
    base: dict[str, Any],
    arms: Mapping[str, dict[str, Any]],
    names: Sequence[str],
    reps: int,
    out: str,
    fields: Callable[[dict[str, Any]], dict[str, Any]],
    arm_context: Callable[[str], AbstractContextManager[object]] = _no_context,
) -> None:
    """Each repeat runs every arm of ``names`` once, its order rotated per
    repeat: the run spec ``base`` with the arm's changes ``arms[name]``,
    inside ``arm_context(name)``. One JSON line a run is appended to ``out``
    (the arm, repeat, concurrency, ``fields(row)`` and the run's seconds) and
    its tokens/s printed. The replay studies beside this folder run their
    arms through it."""
    with open(out, "a") as f:
        for rep in range(reps):
            for name in rotated(list(names), rep):
                t0 = time.time()
                with arm_context(name):
                    row = run_spec(RunSpec(**{**base, **arms[name]}, repeat=rep)).row
                rec = {
                    "arm": name,
                    "repeat": rep,
                    "concurrency": base["concurrency"],
                    **fields(row),
                    "run_s": time.time() - t0,
                }
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(name, rep, round(row["output_tokens_per_s"], 2), flush=True)


def main(argv: list[str]) -> None:
    conc, reps, out, link_gbps = int(argv[0]), int(argv[1]), argv[2], float(argv[3])
    names = argv[4].split(",")
    arch, layers = (argv[5], int(argv[6])) if len(argv) > 5 else ("small-qwen3_moe", 4)

    def fields(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "link_gbps": link_gbps,
            "arch": arch,
            "layers": layers,
            **{k: row.get(k) for k in KEYS},
        }

    replay_interleaved(base_spec(conc, link_gbps, arch, layers), ARMS, names, reps, out, fields)


if __name__ == "__main__":
    main(sys.argv[1:])
