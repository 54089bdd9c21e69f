"""The fused grouped dequantize-GEMM compiles for the H200 (sm_90a) without a
GPU: Triton's compiler and its bundled ptxas run on the CPU, so code that
only the interpreter ran (which accepts things the compiler refuses) is
compiled here, and the default configuration must not spill registers
(bf16 activations, what the GPU serves).
Skips where triton (or its ptxas) is not installed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the kernels are decorated for the interpreter here", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdflash.models import fused_moe_triton as kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _signature(wfmt: int, dot: Any, act: int, dot_scaled: bool, block_m: int) -> tuple[dict, dict]:
    x = "bf16" if dot == tl.bfloat16 else "fp32"
    w, sc = ("*u8", "*u8") if wfmt == kernels.WFMT_MXFP4 else ("*fp8e4nv", "*fp32")
    sig: dict[str, str] = dict(
        x_ptr=f"*{x}", x_rows_ptr="*i64", stride_xm="i32", stride_xk="i32",
        w_ptr=w, stride_ws="i64", stride_wn="i32", stride_wk="i32",
        sc_ptr=sc, stride_ss="i64", stride_sn="i32", stride_sk="i32",
        bias_ptr="*bf16", stride_bs="i64", out_ptr=f"*{x}", stride_om="i32",
        tile_slot_ptr="*i32", tile_start_ptr="*i32", tile_end_ptr="*i32",
        N="i32", gate_col0="i32", up_col0="i32", col_step="i32", alpha="fp32", limit="fp32",
    )  # fmt: skip
    block_n, block_k, _, _ = kernels.DEFAULT_CONFIG
    constants = dict(
        K=2880, WFMT=wfmt, ACT=act, HAS_BIAS=True, DOT_DTYPE=dot, UPCAST_DOT=False,
        MXFP4_DOT_SCALED=dot_scaled, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    sig.update(dict.fromkeys(constants, "constexpr"))
    return sig, constants


VARIANTS = [
    (kernels.WFMT_MXFP4, tl.bfloat16, kernels.ACT_GPTOSS, False),
    (kernels.WFMT_MXFP4, tl.bfloat16, kernels.ACT_NONE, False),
    (kernels.WFMT_MXFP4, tl.float32, kernels.ACT_GPTOSS, False),
    (kernels.WFMT_MXFP4, tl.bfloat16, kernels.ACT_GPTOSS, True),
    (kernels.WFMT_FP8, tl.bfloat16, kernels.ACT_SILU, False),
    (kernels.WFMT_FP8, tl.bfloat16, kernels.ACT_NONE, False),
]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: str(v))
def test_default_config_compiles_for_sm90_without_spills(
    variant: tuple[Any, ...], block_m: int, tmp_path: Path
) -> None:
    wfmt, dot, act, dot_scaled = variant
    sig, constants = _signature(wfmt, dot, act, dot_scaled, block_m)
    _, _, warps, stages = kernels.DEFAULT_CONFIG
    fn = kernels._grouped_qgemm_kernel.fn  # under the autotuner
    compiled = triton.compile(
        ASTSource(fn, sig, constants),
        target=TARGET,
        options={"num_warps": warps, "num_stages": stages},
    )
    assert compiled.asm["cubin"]
    ptx = compiled.asm["ptx"]
    if dot == tl.bfloat16:  # tensor cores (wgmma from BLOCK_M 64); fp32 "ieee" dots use FMAs
        assert "mma.sync" in ptx or "wgmma" in ptx
    if not PTXAS.exists():
        pytest.skip(f"no ptxas at {PTXAS} to count spills")
    (tmp_path / "k.ptx").write_text(ptx)
    out = subprocess.run(
        [str(PTXAS), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out)]
    assert spills, out
    if dot == tl.bfloat16:  # the fp32 (FMA) variant only serves fp32 models: may spill
        assert max(spills) == 0, out


def test_tile_map_kernels_compile_for_sm90() -> None:
    common = {"starts_ptr": "*i32", "ends_ptr": "*i32", "tile_ends_ptr": "*i32"}
    group = {"key_ptr": "*i64", "n": "i32", "width": "i32", **common}
    group.update(dict.fromkeys(("BLOCK_W", "STEPS_N", "BLOCK_M"), "constexpr"))
    rows = {**common, "width": "i32", "bound": "i32"}
    rows.update({"slot_ptr": "*i32", "start_ptr": "*i32", "end_ptr": "*i32"})
    rows.update(dict.fromkeys(("BLOCK_T", "STEPS_W", "BLOCK_M"), "constexpr"))
    for fn, sig, constants in (
        (kernels._group_tiles_kernel, group, {"BLOCK_W": 1024, "STEPS_N": 12, "BLOCK_M": 16}),
        (kernels._tile_rows_kernel, rows, {"BLOCK_T": 256, "STEPS_W": 11, "BLOCK_M": 16}),
    ):
        assert triton.compile(ASTSource(fn, sig, constants), target=TARGET).asm["cubin"]
