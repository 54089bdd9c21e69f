"""bench/h200/mxfp4moe_summary.py: per step rc, wall, phases and autotuning
from run.sh's results.jsonl and log, and where a cut step was."""

from __future__ import annotations

from types import ModuleType

from bench_fixtures import load_bench_script


def _module() -> ModuleType:
    return load_bench_script("mxfp4moe_summary.py")


LOG = """== step row: timeout 60 pdflash-bench moe ...
moe [   0.00 s] checkpoint ...
moe [   0.01 s] checkpoint done in 0.01 s
moe [   2.00 s] mxfp4_kernel_probes ...
Triton autotuning for function _grouped_qgemm_kernel,
with key as (48, 96, 16, 0, 0, True, 'torch.bfloat16'),
finished after 0.50s,
best config selected: BLOCK_N: 64;
Triton autotuning for function _grouped_qgemm_kernel,
with key as (2880, 2880, 16, 0, 1, True, 'torch.bfloat16'),
finished after 4.25s,
best config selected: BLOCK_N: 32;
== step row rc=124 in 60 s
== step row_warm: timeout 40 pdflash-bench moe ...
moe [   0.00 s] checkpoint ...
== step row_warm rc=0 in 20 s
"""


def test_summary_reads_phases_autotuning_and_where_a_cut_step_was() -> None:
    mod = _module()
    row = {
        "per_layer": [{}],
        "checkpoint": "reused",
        "run_s": 12.5,
        "close_adapter_s": 0.5,
        "setup_s": {"before_run": 4.0, "load": 2.0},
        "phases_s": {"measure": 3.0},
        "all_hit": [{"layer": 0, "tokens": 16, "setup_s": {"first_call": 0.1, "point": 1.0}}],
    }
    results = [
        {"step": "row", "rc": 124, "result": None},
        {"step": "row_warm", "rc": 0, "result": row},
    ]
    out = mod.summarize(results, LOG)
    cut, warm = out["row"], out["row_warm"]
    assert (cut["rc"], cut["wall_s"], cut["autotune_keys"]) == (124, 60, 2)
    assert cut["autotune_s"] == 4.75
    assert cut["autotune"][1]["key"].startswith("(2880, 2880, 16")
    assert cut["last_phase_line"] == "moe [   2.00 s] mxfp4_kernel_probes ..."
    assert "row" not in cut
    assert (warm["rc"], warm["wall_s"], warm["autotune_keys"]) == (0, 20, 0)
    assert "last_phase_line" not in warm
    assert warm["row"]["all_hit_points_s"] == [
        {"layer": 0, "tokens": 16, "first_call": 0.1, "point": 1.0}
    ]
    assert warm["after_row_s"] == 20 - 4.0 - 12.5 - 0.5
