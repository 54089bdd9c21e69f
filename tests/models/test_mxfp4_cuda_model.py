"""The CUDA MXFP4 GEMM's algorithm on the CPU: ``mxfp4_cuda_model.py`` runs
the kernel's per-lane index math, dequant bits, mma fragment layouts, scale
range paths and epilogues literally (float64 accumulation) against a float64
dequantize-then-matmul reference, and checks the shared-memory bank pattern
(the pure-Python reference of ``cuda/src/mxfp4_moe_gemm.cu``; the kernel
itself is compared with torch in ``test_mxfp4_cuda_gemm_gpu.py``). Both
kinds: mma.sync, and wgmma (x staged as core matrices, B read through the
matrix descriptor); each mutation of the wgmma layout (descriptor fields,
k-step regions, staging order, accumulator order) must make the comparison
fail. The model's variant table and wgmma layout constants must match the
kernel source's. The wgmma kind reading x chunk-permuted (kind 2) stages the
same bytes as the register path, and the library's ``chunk_permuted`` is the
header's formula."""

from __future__ import annotations

import importlib.util
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

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
def test_kernel_model_equals_reference(name: str, kw: dict, cfg: tuple[int, ...]) -> None:
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


_desc = model.wgmma_desc
_store_offset = model.wgmma_x_store_offset
_store_values = model.wgmma_x_store_values

#: (what is mutated, model function, its mutated replacement)
WGMMA_MUTATIONS: list[tuple[str, str, Callable[..., Any]]] = [
    (
        "descriptor LBO / SBO fields swapped",
        "smem_desc",
        lambda addr: ((addr & 0x3FFFF) >> 4) | ((256 >> 4) << 16) | ((128 >> 4) << 32),
    ),
    (
        "descriptor start without the >> 4",
        "smem_desc",
        lambda addr: (addr & 0x3FFF) | ((128 >> 4) << 16) | ((256 >> 4) << 32),
    ),
    (
        "k-step regions without the 16-byte bank spread",
        "wgmma_desc",
        lambda base, ks, xreg: _desc(base, ks, xreg - 16),
    ),
    ("A k-step paired with the other B k-step", "wgmma_desc", lambda b, ks, x: _desc(b, ks ^ 1, x)),
    (
        "k halves swapped in the staging",
        "wgmma_x_store_offset",
        lambda ks, half, tok, xreg: _store_offset(ks, 1 - half, tok, xreg),
    ),
    (
        "token groups at the LBO instead of the SBO",
        "wgmma_x_store_offset",
        lambda ks, half, tok, xreg: ks * xreg + (tok >> 3) * 128 + half * 256 + (tok & 7) * 16,
    ),
    (
        "tokens reversed inside a core matrix",
        "wgmma_x_store_offset",
        lambda ks, half, tok, xreg: _store_offset(ks, half, tok ^ 7, xreg),
    ),
    (
        "pairs (x[i], x[i + 4]) staged as (x[i + 4], x[i])",
        "wgmma_x_store_values",
        lambda v, h, half: [
            y for a, b in zip(*[iter(_store_values(v, h, half))] * 2, strict=True) for y in (b, a)
        ],
    ),
    (
        "k-steps staged in the other order (h swapped)",
        "wgmma_x_store_values",
        lambda v, h, half: _store_values(v, 1 - h, half),
    ),
    (
        "accumulator columns swapped in a fragment",
        "wgmma_acc_index",
        lambda ns, e: 4 * ns + (e ^ 1),
    ),
    ("accumulator sub-tiles swapped", "wgmma_acc_index", lambda ns, e: 4 * (ns ^ 1) + e),
]


@pytest.mark.parametrize(
    ("what", "attr", "mutated"), WGMMA_MUTATIONS, ids=[m[0] for m in WGMMA_MUTATIONS]
)
def test_wgmma_layout_mutations_are_caught(
    what: str, attr: str, mutated: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wgmma comparison is not vacuous: with one piece of its layout
    changed the model stops matching the reference (a wrong value, a row left
    unset, or the model's own check that wgmma reads only staged bytes)."""
    name = "wg act=0 K=160 bm64 >32 rows"
    kw, cfg = next((c[1], c[2]) for c in model.CASES if c[0] == name)
    monkeypatch.setattr(model, attr, mutated)
    try:
        r = model.run_case(np.random.default_rng(zlib.crc32(name.encode())), kw, cfg)
    except AssertionError:
        return  # the model caught it (an unstaged, overlapping or out-of-range access)
    assert r["err"] > 1e-3 or r["unset"] or not r["nonfinite_match"], (what, r["err"])


def test_chunk_permuted_x_stages_the_bytes_the_register_path_stages() -> None:
    """Kind 2's cp.async units from the chunk-permuted rows land the same
    bytes where the wgmma kind's load_x / store_x put them (every live
    sub-tile, a partial last chunk included), for K = 160 and 96."""
    rng = np.random.default_rng(7)
    for K, nrows in ((160, 37), (96, 5)):
        x_bits = rng.integers(0, 1 << 16, size=(nrows + 3, K), dtype=np.uint16)
        xp_bits = model.chunk_permuted_bits(x_bits)
        s_xrow = [int(v) for v in rng.permutation(nrows + 3)[:64]]
        nsl, XTOK, THREADS = (nrows + 7) >> 3, 64, 256
        XREG = model.wgmma_region_bytes(XTOK)
        for c in range(-(-K // 128)):
            reg = np.full(8 * XREG, 0xFF, dtype=np.uint8)
            px = reg.copy()
            w_reg = np.zeros(len(reg) // 16, dtype=bool)
            w_px = w_reg.copy()
            model.stage_x_wgmma({"K": K}, reg, w_reg, [], (0, 0, c), x_bits, s_xrow, nrows,
                                nsl, 128 * c, THREADS, 1, XTOK, XREG)  # fmt: skip
            model.stage_x_wgmma_px(px, w_px, xp_bits, s_xrow, nrows, nsl, c, K, THREADS, 4,
                                   XTOK * 16, XREG)  # fmt: skip
            assert np.array_equal(w_reg, w_px), (K, c)
            assert np.array_equal(reg, px), (K, c)


def test_chunk_permuted_mutation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kind 2's comparison is not vacuous: another placement of k within a
    chunk (e and d swapped) makes the model stop matching the reference."""
    name = "wgpx act=0 K=160 bm64 >32 rows"
    kw, cfg = next((c[1], c[2]) for c in model.CASES if c[0] == name)
    original = model.chunk_permuted_position

    def swapped(k_in: int) -> int:
        e, d = (k_in >> 2) & 1, k_in & 1
        return original((k_in & ~0b101) | (d << 2) | e)

    monkeypatch.setattr(model, "chunk_permuted_position", swapped)
    r = model.run_case(np.random.default_rng(zlib.crc32(name.encode())), kw, cfg)
    assert r["err"] > 1e-3, r["err"]


def test_library_chunk_permuted_is_the_headers_layout() -> None:
    """pdflash.models.mxfp4_cuda_gemm.chunk_permuted (torch) equals the
    model's elementwise formula at every position of a k < K (the rest is
    never read); and refuses what it cannot permute."""
    import torch

    from pdflash.models.mxfp4_cuda_gemm import chunk_permuted

    rng = np.random.default_rng(3)
    for K in (96, 128, 160, 2880):
        x_bits = rng.integers(0, 1 << 15, size=(5, K), dtype=np.uint16)
        x = torch.from_numpy(x_bits.astype(np.int16)).view(torch.bfloat16)
        got = chunk_permuted(x[:, :])
        assert got.is_contiguous() and got.shape == (5, -(-K // 128) * 128)
        want = model.chunk_permuted_bits(x_bits)
        live = model.chunk_permuted_bits(np.ones((1, K), dtype=np.uint16))[0] == 1
        got_bits = got.view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got_bits[:, live], want[:, live]), K
        assert int(live.sum()) == K
    strided = torch.zeros(4, 256, dtype=torch.bfloat16)[:, :128]
    assert chunk_permuted(strided).shape == (4, 128)
    with pytest.raises(ValueError, match="K % 32"):
        chunk_permuted(torch.zeros(2, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[rows, K\]"):
        chunk_permuted(torch.zeros(2, 3, 32, dtype=torch.bfloat16))


def _kernel_source() -> str:
    return (REPO / "cuda" / "src" / "mxfp4_moe_gemm.cu").read_text()


def _le_words(blocks: np.ndarray) -> list[int]:
    """``blocks``' bytes as little-endian 32-bit words."""
    return [int(v) for v in blocks.reshape(-1).view("<u4")]


def test_repacked_codes_give_the_natural_pairs_bits() -> None:
    """The kind-3 layout: the library's table is the header's, a bijection
    of a word's 32 bits; the kernel's ``repacked_pair_bits`` (rotations and
    masks, pinned in its source) of a repacked word equal the natural
    dequant's bits of the natural word, pair by pair; a swapped table entry
    is caught; and the library's ``repack_codes`` (torch, bytes) equals the
    model's word repack."""
    import torch

    from pdflash.models import mxfp4_cuda_gemm as g

    header = (REPO / "cuda" / "include" / "pdflash" / "mxfp4_moe_gemm.h").read_text()
    rows = dict(
        (int(i), tuple(int(b) for b in bits.split(", ")))
        for i, bits in re.findall(r"i = (\d): (\d+, \d+, \d+, \d+)", header)
    )
    assert tuple(rows[i] for i in range(8)) == g.REPACKED_BIT
    assert sorted(b for row in g.REPACKED_BIT for b in row) == list(range(32))
    src = _kernel_source()
    for line in (
        "return q & 0x81C081C0u;",
        "return __funnelshift_r(q, q, 4) & 0x81C081C0u;",
        "return __funnelshift_r(q, q, 10) & 0x81C081C0u;",
        "return (__funnelshift_l(q, q, 2) & 0x80C080C0u) | (__funnelshift_r(q, q, 6) & 0x01000100u);",
    ):
        assert line in src, line
    rng = np.random.default_rng(7)
    assert model.check_repacked_pair_bits(rng, g.REPACKED_BIT)
    swapped = list(g.REPACKED_BIT)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    assert not model.check_repacked_pair_bits(rng, tuple(swapped))
    blocks = rng.integers(0, 256, size=(3, 5, 16), dtype=np.uint8)
    got = g.repack_codes(torch.from_numpy(blocks)).numpy()
    want = [model.repack_word(q, g.REPACKED_BIT) for q in _le_words(blocks)]
    assert _le_words(got) == want and got.shape == blocks.shape
    with pytest.raises(ValueError, match="multiple of 4"):
        g.repack_codes(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        g.repack_codes(torch.zeros(2, 16, dtype=torch.int32))


def test_wgmma_layout_constants_match_the_kernel() -> None:
    """The model's LBO / SBO, region pitch and descriptor bit fields are the
    kernel source's."""
    src = _kernel_source()
    lbo = re.search(r"constexpr uint32_t kWgmmaLboBytes = (\d+);", src)
    sbo = re.search(r"constexpr uint32_t kWgmmaSboBytes = (\d+);", src)
    assert lbo and sbo
    assert (int(lbo.group(1)), int(sbo.group(1))) == (model.WGMMA_LBO, model.WGMMA_SBO)
    assert "XREG_BYTES = XTOK * 32 + 16;" in src and model.wgmma_region_bytes(8) == 8 * 32 + 16
    assert (
        "(uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(kWgmmaLboBytes >> 4) << 16) |" in src
        and "((uint64_t)(kWgmmaSboBytes >> 4) << 32)" in src
    )
    assert "desc0 + (uint64_t)((ks * C::XREG_BYTES) >> 4)" in src
    # one offset function for both wgmma kinds' staging: the model's wgmma_x_store_offset
    assert "const int row = (tok >> 3) * kWgmmaSboBytes + (tok & 7) * 16;" in src
    assert "return ks * C::XREG_BYTES + half * kWgmmaLboBytes + row;" in src
    assert "x_stage_offset<C>(2 * w + h, d, tok)" in src
    assert model.smem_desc(0x1230) == (0x123 | (8 << 16) | (16 << 32))
    # kind 2's cp.async destination and partial-chunk source size (issue_x)
    assert "x_stage_offset<C>(u >> 1, u & 1, tok)" in src
    assert "min(4, (p.K - 128 * c) >> 5)" in src and "live ? 4 * live_blocks : 0" in src
    assert "8 * (id & 15)" in src
    # the epilogue's out_column: its bit expression is the model's placement
    expr = (
        "(j & ~127) | (((k >> 3) & 3) << 5) | (((k >> 1) & 1) << 4) | ((k & 1) << 3) |\n"
        "         ((k >> 5) << 1) | ((k >> 2) & 1)"
    )
    assert expr in src
    for k in range(128):
        kernel = (((k >> 3) & 3) << 5) | (((k >> 1) & 1) << 4) | ((k & 1) << 3)
        kernel |= ((k >> 5) << 1) | ((k >> 2) & 1)
        assert kernel == model.chunk_permuted_position(k), k
    assert sorted(model.chunk_permuted_position(k) for k in range(128)) == list(range(128))


def test_variant_table_matches_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel source's variants 8, 4 and 10 are what
    :func:`pdflash.models.mxfp4_cuda_gemm.pick_variant` documents, and the
    policy picks as documented (the wgmma variant at block_m 64 only where it
    runs; ``PDFLASH_MXFP4_CUDA_BM64`` overrides, loudly validated)."""
    from pdflash.models import mxfp4_cuda_gemm as g

    src = _kernel_source()
    rows = {
        int(m[0]): tuple(int(v) for v in m[1:])
        for m in re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", src)
    }
    assert len(rows) == int(re.search(r"kNumVariants = (\d+)", src).group(1))  # type: ignore[union-attr]
    # (warps, m-tiles, stages, min blocks, max 8-token sub-tiles, L2 prefetch, kind)
    assert rows[g.SMALL_BLOCK_VARIANT] == (8, 1, 4, 2, 8, 256, g.KIND_MMA_SYNC)
    assert rows[g.LARGE_BLOCK_VARIANT] == (16, 1, 4, 1, 8, 0, g.KIND_MMA_SYNC)
    assert rows[g.WGMMA_BLOCK_VARIANT] == (8, 1, 4, 2, 8, 256, g.KIND_WGMMA)
    assert rows[g.WGMMA_PX_BLOCK_VARIANT] == (8, 1, 4, 2, 8, 256, g.KIND_WGMMA_PX)
    assert rows[g.WGMMA_RC_VARIANT] == (8, 1, 4, 2, 8, 256, g.KIND_WGMMA_RC)
    # the policy's wgmma variant first; the others are timed beside it (the probe)
    assert [v for v, row in rows.items() if row[6] == g.KIND_WGMMA] == [10, 11, 12, 13]
    assert [v for v, row in rows.items() if row[6] == g.KIND_WGMMA_PX] == [14]
    assert [v for v, row in rows.items() if row[6] == g.KIND_WGMMA_RC] == [15]
    monkeypatch.delenv(g.BM64_ENV, raising=False)
    # off CUDA the wgmma variant never runs: the mma.sync variants
    assert [g.pick_variant(b, "cpu") for b in (1, 16, 32, 33, 64)] == [8, 8, 8, 4, 4]
    assert "not cpu" in str(g.wgmma_unavailable("cpu"))
    with pytest.raises(ValueError, match=r"block_m 1\.\.64"):
        g.pick_variant(128)
    # where it runs: 10 at block_m 33..64 unless the environment says mma
    monkeypatch.setattr(g, "wgmma_unavailable", lambda device=None: None)
    assert [g.pick_variant(b, "cuda") for b in (16, 32, 33, 64)] == [8, 8, 10, 10]
    for setting, want in (("", 10), ("auto", 10), ("wgmma", 10), ("wgmma_px", 14), ("mma", 4)):
        monkeypatch.setenv(g.BM64_ENV, setting)
        assert (g.pick_variant(64, "cuda"), g.pick_variant(16, "cuda")) == (want, 8), setting
    # where it does not: auto and mma take 4, a forced wgmma is an error
    monkeypatch.setattr(g, "wgmma_unavailable", lambda device=None: "not sm_90a here")
    for setting in ("auto", "mma"):
        monkeypatch.setenv(g.BM64_ENV, setting)
        assert g.pick_variant(64, "cuda") == 4
    monkeypatch.setenv(g.BM64_ENV, "wgmma")
    with pytest.raises(g.WgmmaUnavailableError, match=r"PDFLASH_MXFP4_CUDA_BM64=wgmma .*sm_90a"):
        g.pick_variant(64, "cuda")
    monkeypatch.setenv(g.BM64_ENV, "wgmma_px")
    with pytest.raises(g.WgmmaUnavailableError, match=r"BM64=wgmma_px cannot run: .*sm_90a"):
        g.pick_variant(64, "cuda")
    assert g.pick_variant(32, "cuda") == 8  # block_m <= 32 is not its business
    for bad in ("WGMMA", "mma.sync", "v10", "1"):
        monkeypatch.setenv(g.BM64_ENV, bad)
        for block_m in (16, 64):
            with pytest.raises(ValueError, match="PDFLASH_MXFP4_CUDA_BM64 must be one of"):
                g.pick_variant(block_m, "cuda")
