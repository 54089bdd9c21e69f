"""The CUDA MXFP4 GEMM's algorithm on the CPU: ``mxfp4_cuda_model.py`` runs
the kernel's per-lane index math, dequant bits, mma fragment layouts, scale
range paths and epilogues literally (float64 accumulation) against a float64
dequantize-then-matmul reference, and checks the shared-memory bank pattern
(the pure-Python reference of ``cuda/src/mxfp4_moe_gemm.cu``; the kernel
itself is compared with torch in ``test_mxfp4_cuda_gemm_gpu.py``). The
model's variant table must match the kernel source's."""

from __future__ import annotations

import importlib.util
import re
import sys
import zlib
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mxfp4_cuda_model", HERE / "mxfp4_cuda_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mxfp4_cuda_model", module)
    spec.loader.exec_module(module)
    return module


model = _load()


@pytest.mark.parametrize(("name", "kw", "cfg"), model.CASES, ids=[c[0] for c in model.CASES])
def test_kernel_model_equals_reference(name: str, kw: dict, cfg: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    r = model.run_case(rng, kw, cfg)
    assert r["err"] < 1e-9, r["err"]
    assert r["nonfinite_match"] and r["unset"] == 0
    assert r["inexact_fast"] == 0  # the fast path's products are exact bf16 normals
    assert not r["bank_conflicts"], r["bank_conflicts"][:3]
    kinds = {kind for kind, _ in r["paths"]}
    if "slow" in name:
        assert "slow" in kinds
    if "D>0" in name:
        assert max(d for _, d in r["paths"]) > 0


def test_dequant_bits_and_scale_banks() -> None:
    assert model.check_pair_bits(np.random.default_rng(1))
    assert model.scale_banks_gptoss(90) == []


def test_variant_table_matches_the_policy() -> None:
    """The kernel source's variants 8 and 4 are what
    :func:`pdflash.models.mxfp4_cuda_gemm.pick_variant` documents."""
    from pdflash.models import mxfp4_cuda_gemm as g

    src = (REPO / "cuda" / "src" / "mxfp4_moe_gemm.cu").read_text()
    rows = {
        int(m[0]): tuple(int(v) for v in m[1:])
        for m in re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", src)
    }
    assert len(rows) == int(re.search(r"kNumVariants = (\d+)", src).group(1))  # type: ignore[union-attr]
    # (warps, m-tiles, stages, min blocks, max 8-token sub-tiles, L2 prefetch)
    assert rows[g.SMALL_BLOCK_VARIANT] == (8, 1, 4, 2, 8, 256)
    assert rows[g.LARGE_BLOCK_VARIANT] == (16, 1, 4, 1, 8, 0)
    assert [g.pick_variant(b) for b in (1, 16, 32, 33, 64)] == [8, 8, 8, 4, 4]
    with pytest.raises(ValueError, match=r"block_m 1\.\.64"):
        g.pick_variant(128)
