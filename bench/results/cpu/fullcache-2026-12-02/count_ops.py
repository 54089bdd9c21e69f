"""Per measured engine step: aten compute ops (views and metadata left out,
as bench/op_count.py) and host reads of a layer's routing
(``routed_ids_on_host``: a device sync per call on a GPU), for a few labels
at one point; CPU, counts only (no timing). Run from the repository root
with the package installed:

    python bench/results/cpu/fullcache-2026-12-02/count_ops.py --labels PD,PD:off,B1,B2,B3
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections import Counter
from typing import Any

# the installed package's modules, patched in place (untyped here: a
# results script, not part of the package's checked API)
engine_run: Any = importlib.import_module("pdflash.bench.engine_run")
op_count: Any = importlib.import_module("pdflash.bench.op_count")
prefetch: Any = importlib.import_module("pdflash.engine.prefetch")
offload: Any = importlib.import_module("pdflash.models.offload")


def count(label: str, arch: str, fraction: float, max_new: int) -> dict[str, Any]:
    baseline, _, setting = label.partition(":")
    state = {"measuring": False, "routing_reads": 0}
    counter = op_count.OpCounter()  # one region ("other"): counts by op name
    reset, step = engine_run._reset_measurements, engine_run.Engine.step
    read = offload.routed_ids_on_host

    def reset_and_measure(engine: Any) -> None:
        reset(engine)
        state["measuring"] = True

    def counted_step(self: Any) -> Any:
        if not state["measuring"]:
            return step(self)
        with counter:
            return step(self)

    def counted_read(topk: Any) -> Any:
        if state["measuring"]:
            state["routing_reads"] += 1
        return read(topk)

    engine_run._reset_measurements = reset_and_measure
    engine_run.Engine.step = counted_step
    offload.routed_ids_on_host = prefetch.routed_ids_on_host = counted_read
    try:
        row = engine_run.run_spec(
            engine_run.RunSpec(
                arch=arch,
                baseline=baseline,
                concurrency=4,
                cache_fraction=fraction,
                max_new_tokens=max_new,
                prompt_len=16,
                device="cpu",
                acceptance="forced",
                full_cache=setting or "auto",
            )
        ).row
    finally:
        engine_run._reset_measurements = reset
        engine_run.Engine.step = step
        offload.routed_ids_on_host = prefetch.routed_ids_on_host = read
    ops: Counter[str] = Counter()
    for (_, name), n in counter.counts.items():
        ops[name] += n
    steps = max(1, int(row["steps"]))
    forwards = int(row["verify_forwards"]) + 1  # the prefill
    return {
        "label": label,
        "cache_fraction": fraction,
        "steps": row["steps"],
        "verify_forwards": row["verify_forwards"],
        "compute_ops_per_step": sum(ops.values()) / steps,
        "routing_reads_per_forward": state["routing_reads"] / forwards,
        "initial_resident_experts": row["initial_resident_experts"],
        "h2d_bytes": row["h2d_bytes"],
        "full_cache": (row.get("full_cache") or {}).get("state"),
        "scheduler_us_per_step": row["scheduler_us_per_step"],
        "top_ops": dict(ops.most_common(8)),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--labels", default="PD,PD:off,B1,B2,B3")
    p.add_argument("--arch", default="tiny-gpt_oss")
    p.add_argument("--cache-fraction", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    a = p.parse_args()
    for label in a.labels.split(","):
        print(json.dumps(count(label, a.arch, a.cache_fraction, a.max_new_tokens)), flush=True)


if __name__ == "__main__":
    main()
