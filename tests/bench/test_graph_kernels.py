"""bench/h200/graph_kernels.py (a CUDA-graph replay's kernels, from a
profiler trace): kernels are grouped by the graph launch that ran them, each
distinct replay's per-kernel durations and gaps are medians over its
replays, and kernels outside graphs are totalled apart."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "h200" / "graph_kernels.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("graph_kernels", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(corr: int) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": "cudaGraphLaunch",
        "cat": "cuda_runtime",
        "args": {"correlation": corr},
    }


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr},
    }


def test_replays_are_grouped_by_launch_and_summarized_by_median() -> None:
    gk = _module()
    events = [_launch(1), _launch(2), _launch(3), _launch(4)]
    # three replays of a-b (listed out of order), one of c alone, two loose kernels
    events += [_kernel("b", 17, 3, 1), _kernel("a", 10, 5, 1)]
    events += [_kernel("a", 100, 7, 2), _kernel("b", 109, 5, 2)]
    events += [_kernel("a", 200, 6, 3), _kernel("b", 210, 4, 3)]
    events += [_kernel("c", 300, 9, 4)]
    events += [_kernel("z", 400, 2, 9), _kernel("z", 500, 3, 9), _kernel("y", 600, 1, 8)]
    summary = gk.summarize({"traceEvents": events})
    first, second = summary["graphs"]
    assert first["replays"] == 3 and [k["name"] for k in first["kernels"]] == ["a", "b"]
    assert first["kernels"][0] == {"name": "a", "dur_us": 6.0, "gap_before_us": None}
    assert first["kernels"][1] == {"name": "b", "dur_us": 4.0, "gap_before_us": 2.0}
    assert first["span_us"] == 14.0 and first["busy_us"] == 10.0  # medians over the replays
    assert first["by_kind_us"] == {"other": 10.0} and first["gaps_us"] == 2.0
    assert second["replays"] == 1 and second["span_us"] == 9.0
    assert summary["outside_graphs"] == [
        {"name": "z", "calls": 2, "total_us": 5.0},
        {"name": "y", "calls": 1, "total_us": 1.0},
    ]


def test_kernel_kinds_split_a_replay() -> None:
    gk = _module()
    names = {
        "void mxcuda::mxfp4_moe_kernel<mxcuda::Cfg<8, 1, 8, 4, 2, 256, 1> >(mxcuda::Params)": (
            "expert GEMM (CUDA MXFP4)"
        ),
        "_row_plan_kernel": "row plan",
        "_weighted_combine_kernel": "combine",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
        "nvjet_tst_128x64_64x8_1x1_v_bz_TNT": "dense GEMM",
        "void at::native::vectorized_elementwise_kernel<4>": "other",
    }
    for name, kind in names.items():
        assert gk.kind_of(name) == kind, name
    events = [_launch(1)]
    events += [_kernel(name, 10.0 * i, 2.0 + i, 1) for i, name in enumerate(names)]
    (graph,) = gk.summarize({"traceEvents": events})["graphs"]
    assert graph["by_kind_us"]["expert GEMM (CUDA MXFP4)"] == 2.0
    assert graph["by_kind_us"]["other"] == 7.0
    assert sum(graph["by_kind_us"].values()) == graph["busy_us"]
