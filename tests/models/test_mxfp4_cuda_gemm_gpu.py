"""The CUDA MXFP4 GEMM (:func:`pdflash.models.mxfp4_cuda_gemm.grouped_mxfp4_gemm`)
on a GPU against a torch fp32 reference (dequantize, matmul, bias, epilogue)
and against the Triton ``grouped_qgemm(mxfp4_dot="scaled")``: both
epilogues (and SiLU), 1..256 tokens, block_m 16/32/64, every variant that
takes the block_m and runs on the device, a dead tile mid-list, rows outside
every tile left untouched, extreme scale bytes (subnormal weights, inf /
NaN), and CUDA-graph capture / replay (a shape first launched inside the
capture). The wgmma variant (sm_90a; skipped elsewhere) gets the probe's
whole suite at block_m 64 (``bench/h200/mxfp4_cuda/probe.py``) plus every
live 8-token sub-tile count 1..8 (each a compiled case of its own), the
policy that picks it, and, on devices where it cannot run, the launcher's
refusal.

Error metric (as the probe, ``bench/h200/mxfp4_cuda/probe.py``): per output
row, max |got - ref| / max |ref| over the row; below 2^-7 (two bf16 ulps at
the row's largest output; bf16 rounding alone gives <= 2^-9); non-finite
reference entries must match exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

TOL = 2.0**-7
ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module", autouse=True)
def _runs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from pdflash.models.mxfp4_cuda_gemm import unavailable

    why = unavailable("cuda")
    if why is not None:
        pytest.skip(why)
    pytest.importorskip("triton")


def _k() -> Any:
    from pdflash.models import fused_moe_triton

    return fused_moe_triton


def _slab(s: int, n: int, k: int, scales: str, seed: int, bias: bool = True) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)
    o: dict[str, Any] = {"generator": g, "device": "cuda"}
    blocks = torch.randint(0, 256, (s, n, k // 32, 16), dtype=torch.uint8, **o)
    lo, hi = {"real": (118, 131), "high": (180, 241), "wide": (2, 129)}.get(scales, (118, 131))
    sc = torch.randint(lo, hi, (s, n, k // 32), dtype=torch.uint8, **o)
    if scales == "extreme":
        for i, v in enumerate([0, 1, 2, 3, 200, 240, 253, 254, 255, 0, 240, 255]):
            sc[i % s, (97 * i + 3) % n, (5 * i + 1) % (k // 32)] = v
    b = (torch.randn(s, n, **o) * 0.1).bfloat16() if bias else None
    return _k().SlabWeight("mxfp4", blocks, sc, b)


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
    order = torch.argsort(e, stable=True)
    x = torch.randn(tokens, 0, generator=g)  # placeholder: x is drawn by the caller
    del x
    return e[order].to(torch.int32).cuda(), (order // top_k).to(torch.int32).cuda()


def _cols(act: int, n: int) -> tuple[int, int, int]:
    return {0: (0, 0, 1), 1: (0, 1, 2), 2: (0, n // 2, 1)}[act]


def _reference(x: Any, x_rows: Any, key: Any, w: Any, act: int) -> torch.Tensor:
    from pdflash.models.layout import dequantize_mxfp4_torch

    n = w.n
    g0, u0, step = _cols(act, n)
    n_out = n if act == 0 else -(-(n - max(g0, u0)) // step)
    out = torch.full((key.numel(), n_out), float("nan"), device="cuda")
    for e in key.unique().tolist():
        rows = (key == e).nonzero().flatten()
        dense = dequantize_mxfp4_torch(w.data[e], w.scale[e], torch.float32)
        h = x[x_rows[rows].long()].float() @ dense.T
        if w.bias is not None:
            h = h + w.bias[e].float()
        if act == 0:
            out[rows] = h
            continue
        cols = torch.arange(n_out, device="cuda")
        gate, up = h[:, g0 + cols * step], h[:, u0 + cols * step]
        if act == 2:
            out[rows] = torch.nn.functional.silu(gate) * up
        else:
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            out[rows] = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    return out


def _row_rel(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    got = got.float()
    fin = torch.isfinite(want)
    nonfinite_ok = bool(
        torch.equal(torch.isnan(got), torch.isnan(want))
        and torch.equal(
            torch.where(torch.isinf(want), want, 0.0), torch.where(torch.isinf(got), got, 0.0)
        )
    )
    diff = torch.where(fin, (got - want).abs(), 0.0)
    diff = torch.where(fin & ~torch.isfinite(got), float("inf"), diff)
    scale = torch.where(fin, want.abs(), 0.0).amax(dim=1).clamp(min=1e-30)
    return float((diff.amax(dim=1) / scale).max()), nonfinite_ok


def _dead_tile(tiles: Any) -> Any:
    slot, start, end = tiles
    mid = slot.numel() // 2
    i32 = {"dtype": torch.int32, "device": "cuda"}
    return (
        torch.cat([slot[:mid], torch.tensor([-1], **i32), slot[mid:]]).contiguous(),
        torch.cat([start[:mid], torch.tensor([7], **i32), start[mid:]]).contiguous(),
        torch.cat([end[:mid], torch.tensor([-3], **i32), end[mid:]]).contiguous(),
    )


def _check(
    w: Any, act: int, tokens: int, experts: int, top_k: int, block_m: int, seed: int,
    variants: list[int | None], triton: bool = True,
) -> None:  # fmt: skip
    key, x_rows = _routing(tokens, experts, top_k, seed)
    x = torch.randn(tokens, w.k, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
    _check_routed(w, act, x, key, x_rows, block_m, variants, triton)


def _check_routed(
    w: Any, act: int, x: torch.Tensor, key: torch.Tensor, x_rows: torch.Tensor, block_m: int,
    variants: list[int | None], triton: bool = True,
) -> None:  # fmt: skip
    """Each variant on the rows sorted by ``key`` (a dead tile inserted mid-list)
    against the fp32 reference and, unless ``triton`` is False, Triton."""
    from pdflash.models.mxfp4_cuda_gemm import grouped_mxfp4_gemm

    k = _k()
    tiles = _dead_tile(k.tile_map(key, int(w.data.shape[0]), block_m, int(w.data.shape[0])))
    want = _reference(x, x_rows, key, w, act)
    kw: dict[str, Any] = {"act": act, "gate_up": _cols(act, w.n), "alpha": ALPHA, "limit": LIMIT}
    tri = (
        k.grouped_qgemm(x, x_rows, tiles, block_m, w, mxfp4_dot="scaled", **kw) if triton else None
    )
    for v in variants:
        got = grouped_mxfp4_gemm(x, x_rows, tiles, block_m, w, variant=v, **kw)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        err, nonfinite_ok = _row_rel(got, want)
        assert err <= TOL and nonfinite_ok, (v, err, nonfinite_ok)
        if tri is not None:
            assert _row_rel(got, tri.float())[0] <= 2 * TOL, v


def _variants_for(block_m: int) -> list[int | None]:
    """None (the policy's pick) and every variant that takes ``block_m`` and
    runs on this device (the wgmma one only where it does)."""
    from pdflash.models.mxfp4_cuda_gemm import WGMMA_KINDS, variants, wgmma_unavailable

    wgmma = wgmma_unavailable("cuda") is None
    return [None] + [
        v.index
        for v in variants()
        if v.max_block_m >= block_m and (v.kind not in WGMMA_KINDS or wgmma)
    ]


@pytest.mark.parametrize(
    ("act", "tokens", "block_m"),
    [(1, 1, 16), (0, 5, 16), (1, 13, 32), (0, 16, 64), (1, 64, 16), (0, 64, 64),
     (1, 256, 64), (0, 256, 32), (2, 16, 16), (2, 64, 64)],
)  # fmt: skip
def test_matches_reference_and_triton(act: int, tokens: int, block_m: int) -> None:
    n = 2 * 2880 if act else 2880
    w = _slab(8, n, 2880, "real", seed=tokens + act, bias=act != 2)
    _check(w, act, tokens, 8, 4, block_m, tokens * 3 + act, _variants_for(block_m))


@pytest.mark.parametrize(
    ("act", "scales"), [(0, "extreme"), (1, "extreme"), (0, "high"), (1, "wide")]
)
def test_extreme_scales(act: int, scales: str) -> None:
    n = 2 * 2880 if act else 2880
    w = _slab(4, n, 2880, scales, seed=11 + act)
    # Triton's tl.dot_scaled differs on inf / NaN rows: the fp32 reference only
    _check(w, act, 16, 4, 2, 16, 5 + act, [None, 4], triton=scales != "extreme")


def test_small_odd_shapes_and_rows_outside_tiles() -> None:
    from pdflash.models.mxfp4_cuda_gemm import grouped_mxfp4_gemm

    w = _slab(4, 200, 96, "real", seed=3)
    _check(w, 1, 16, 4, 2, 16, 3, [None])
    w0 = _slab(4, 192, 96, "real", seed=4, bias=False)
    _check(w0, 0, 9, 4, 2, 16, 4, [None])
    # masked rows (key == width) sort last and no tile covers them: untouched
    k = _k()
    key = torch.tensor([0, 0, 2, 4, 4], dtype=torch.int32, device="cuda")  # width 4: 2 masked
    x = torch.randn(5, 96, device="cuda").bfloat16()
    x_rows = torch.arange(5, dtype=torch.int32, device="cuda")
    tiles = k.tile_map(key, 4, 16, 4)
    got = grouped_mxfp4_gemm(x, x_rows, tiles, 16, w0)
    ref = k.grouped_qgemm(x, x_rows, tiles, 16, w0, mxfp4_dot="scaled")
    assert got.shape == ref.shape == (5, 192)
    assert _row_rel(got[:3], _reference(x, x_rows[:3], key[:3], w0, 0)[:3])[0] <= TOL
    # int64 x_rows are taken (converted), as grouped_qgemm takes them
    got64 = grouped_mxfp4_gemm(x, x_rows.long(), tiles, 16, w0)
    assert torch.equal(got64[:3], got[:3])


def _check_replay_equals_eager(mlp: Any, x: torch.Tensor) -> None:
    """``mlp()`` captured first inside a CUDA graph (on a side stream), then
    replayed with two new inputs written into ``x``: each replay's output
    equals an eager call's."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        out = mlp()
    torch.cuda.current_stream().wait_stream(s)
    for seed in (1, 2):
        x.copy_(torch.randn(*x.shape, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mlp())


def test_cuda_graph_capture_and_replay() -> None:
    """Launched first inside a capture (a K no other test uses: the kernel's
    shared-memory attribute is set during the capture), replayed with new
    inputs: equal to eager launches."""
    from pdflash.models.mxfp4_cuda_gemm import grouped_mxfp4_gemm

    k = _k()
    w = _slab(4, 2 * 1024, 4096, "real", seed=21)
    key, x_rows = _routing(24, 4, 2, 21)
    x = torch.randn(24, 4096, device="cuda").bfloat16()
    tiles = k.tile_map(key, 4, 16, 4)
    rows = torch.arange(key.numel(), dtype=torch.int32, device="cuda")
    down = _slab(4, 4096, 1024, "real", seed=22)
    kw: dict[str, Any] = {"act": 1, "gate_up": (0, 1, 2), "alpha": ALPHA, "limit": LIMIT}

    def mlp() -> torch.Tensor:
        h = grouped_mxfp4_gemm(x, x_rows, tiles, 16, w, **kw)
        return grouped_mxfp4_gemm(h, rows, tiles, 16, down)

    _check_replay_equals_eager(mlp, x)


# ------------------------------------------------------------ the wgmma variant
def _wgmma() -> int:
    """The wgmma variant's index; skips where it cannot run (no sm_90a code
    in this build, or not a compute capability 9.0 device)."""
    from pdflash.models.mxfp4_cuda_gemm import WGMMA_BLOCK_VARIANT, wgmma_unavailable

    why = wgmma_unavailable("cuda")
    if why is not None:
        pytest.skip(why)
    return WGMMA_BLOCK_VARIANT


def _live_tile_rows(key: torch.Tensor, width: int, block_m: int) -> list[int]:
    slot, start, end = _k().tile_map(key, width, block_m, width)
    return [
        min(block_m, e - b)
        for s_, b, e in zip(slot.tolist(), start.tolist(), end.tolist(), strict=True)
        if s_ >= 0
    ]


# (act, tokens, experts routed over, top_k, block_m): the probe's token counts at
# block_m 64 (1 / 5 / 9 / 13 / 16 / 64 / 256 tokens, 1..64 rows a tile, tiles of
# rows not divisible by 8), both epilogues and SiLU, and the variant's NSM 2 / 4
# builds (block_m 16 / 32)
WGMMA_ROUTED = [
    (1, 1, 8, 4, 64), (0, 1, 8, 4, 64), (1, 5, 8, 4, 64), (0, 9, 4, 2, 64),
    (0, 13, 2, 1, 64), (1, 13, 2, 1, 64), (1, 16, 8, 4, 64), (0, 16, 8, 4, 64),
    (1, 64, 8, 4, 64), (0, 64, 8, 4, 64), (0, 256, 8, 4, 64), (1, 256, 8, 4, 64),
    (2, 64, 8, 4, 64), (1, 16, 8, 4, 16), (0, 13, 2, 1, 32),
]  # fmt: skip


@pytest.mark.parametrize(("act", "tokens", "experts", "top_k", "block_m"), WGMMA_ROUTED)
def test_wgmma_matches_reference_and_triton(
    act: int, tokens: int, experts: int, top_k: int, block_m: int
) -> None:
    """gpt-oss-20b's projections (K = 2880: 22 full 128-k chunks and a
    2-block tail), 8 experts, a dead tile mid-list; the wgmma variant and
    the policy's pick against the fp32 reference and Triton."""
    v = _wgmma()
    seed = tokens * 3 + act + 100
    key, _ = _routing(tokens, experts, top_k, seed)
    assert any(r % 8 for r in _live_tile_rows(key, 8, block_m))  # a partial sub-tile
    n = 2 * 2880 if act else 2880
    w = _slab(8, n, 2880, "real", seed=seed, bias=act != 2)
    _check(w, act, tokens, experts, top_k, block_m, seed, [v, None])


def test_chunk_permuted_layouts_give_the_wgmma_variants_bits() -> None:
    """Variant 14 reads the same k order as variant 10 (from a permuted
    copy instead of through registers), so its output equals 10's bit for
    bit: from a natural x (the seam permutes it), from x permuted by the
    caller, and with its output written chunk-permuted (un-permuted, the
    same), also through variant 10's own epilogue. K = 2880 (a partial last
    chunk); 1..64 rows a tile."""
    from pdflash.models import mxfp4_cuda_gemm as g

    _wgmma()
    for act in (0, 1):
        seed = 300 + act
        key, x_rows = _routing(256, 8, 4, seed)
        n = 2 * 2880 if act else 2880
        w = _slab(8, n, 2880, "real", seed=seed)
        x = torch.randn(256, 2880, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
        tiles = _dead_tile(_k().tile_map(key, 8, 64, 8))
        kw: dict[str, Any] = {
            "act": act,
            "gate_up": _cols(act, w.n),
            "alpha": ALPHA,
            "limit": LIMIT,
        }
        base = g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=g.WGMMA_BLOCK_VARIANT, **kw)
        live = _covered_rows(tiles, int(x_rows.numel()))
        px = g.WGMMA_PX_BLOCK_VARIANT
        got = g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=px, **kw)
        assert torch.equal(got[live], base[live])
        xp = g.chunk_permuted(x)
        got = g.grouped_mxfp4_gemm(
            xp, x_rows, tiles, 64, w, variant=px, x_layout=g.CHUNK_PERMUTED, **kw
        )
        assert torch.equal(got[live], base[live])
        n_out = int(base.shape[1])
        pos = torch.tensor([_chunk_position(j) for j in range(n_out)], device="cuda")
        for variant in (g.WGMMA_BLOCK_VARIANT, px):
            perm = g.grouped_mxfp4_gemm(
                x, x_rows, tiles, 64, w, variant=variant, out_layout=g.CHUNK_PERMUTED, **kw
            )
            assert perm.shape[1] == -(-n_out // 128) * 128
            assert torch.equal(perm[live][:, pos], base[live]), variant
    with pytest.raises(ValueError, match="needs a variant of kind KIND_WGMMA_PX"):
        g.grouped_mxfp4_gemm(xp, x_rows, tiles, 64, w, variant=g.WGMMA_BLOCK_VARIANT,
                             x_layout=g.CHUNK_PERMUTED)  # fmt: skip


@pytest.mark.parametrize(("act", "scales"), [(0, "real"), (1, "real"), (2, "extreme"), (1, "wide")])
def test_repacked_codes_give_the_wgmma_variants_bits(act: int, scales: str) -> None:
    """Variant 15 dequantizes repacked codes (``repack_codes``) to the same
    bf16 registers as variant 10 does the natural ones, so its output equals
    10's bit for bit: both scale paths (extreme scales take the slow one),
    K = 2880 (a partial last chunk), 1..64 rows a tile, a dead tile; and the
    seam refuses repacked codes without such a variant, and such a variant
    without them."""
    from pdflash.models import mxfp4_cuda_gemm as g

    _wgmma()
    seed = 400 + act
    key, x_rows = _routing(256, 8, 4, seed)
    n = 2 * 2880 if act else 2880
    w = _slab(8, n, 2880, scales, seed=seed, bias=act != 2)
    x = torch.randn(256, 2880, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
    tiles = _dead_tile(_k().tile_map(key, 8, 64, 8))
    kw: dict[str, Any] = {"act": act, "gate_up": _cols(act, w.n), "alpha": ALPHA, "limit": LIMIT}
    base = g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=g.WGMMA_BLOCK_VARIANT, **kw)
    live = _covered_rows(tiles, int(x_rows.numel()))
    repacked = dataclasses.replace(w, data=g.repack_codes(w.data))
    got = g.grouped_mxfp4_gemm(
        x, x_rows, tiles, 64, repacked, variant=g.WGMMA_RC_VARIANT, codes=g.CODES_REPACKED, **kw
    )
    # bit for bit as raw 16-bit words: torch.equal is False wherever both hold
    # a NaN (extreme scale bytes make them)
    assert got.dtype == base.dtype == torch.bfloat16
    differ = got[live].view(torch.int16) != base[live].view(torch.int16)
    assert not bool(differ.any()), (
        f"{int(differ.sum())} words differ, {int(base[live][differ].isnan().sum())} of them NaN in v10's"
    )
    assert not torch.equal(repacked.data, w.data)
    refused = "repacked codes go with a KIND_WGMMA_RC variant"
    with pytest.raises(ValueError, match=refused):
        g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=g.WGMMA_RC_VARIANT, **kw)
    with pytest.raises(ValueError, match=refused):
        g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, repacked, codes=g.CODES_REPACKED, **kw)
    with pytest.raises(ValueError, match=refused):
        g.grouped_mxfp4_gemm(
            x, x_rows, tiles, 64, repacked, variant=g.WGMMA_BLOCK_VARIANT, codes=g.CODES_REPACKED,
            **kw,
        )  # fmt: skip


def _chunk_position(j: int) -> int:
    """Where the header's chunk-permuted layout puts column j: k = 32 t + 8 w
    + 4 e + 2 h + d of its 128-chunk at 32 w + 16 h + 8 d + 2 t + e."""
    k = j % 128
    t, w, e, h, d = k >> 5, (k >> 3) & 3, (k >> 2) & 1, (k >> 1) & 1, k & 1
    return j - k + 32 * w + 16 * h + 8 * d + 2 * t + e


def _covered_rows(tiles: Any, n: int) -> torch.Tensor:
    """The sorted rows some live tile covers (the rest are left unset)."""
    slot, start, end = (t.cpu() for t in tiles)
    covered = torch.zeros(n, dtype=torch.bool)
    for s, a, b in zip(slot.tolist(), start.tolist(), end.tolist(), strict=True):
        if s >= 0:
            covered[a : min(a + 64, b)] = True
    return covered.cuda()


@pytest.mark.parametrize("act", [0, 1, 2])
@pytest.mark.parametrize("full", [False, True])
def test_wgmma_every_live_subtile_count(act: int, full: bool) -> None:
    """One tile per live sub-tile count 1..8 (each a compiled wgmma N of its
    own): expert e gets 8e + 1 rows (a partial last sub-tile) or 8e + 8."""
    v = _wgmma()
    counts = [8 * e + (8 if full else 1) for e in range(8)]
    key = torch.repeat_interleave(torch.arange(8), torch.tensor(counts)).to(torch.int32).cuda()
    g = torch.Generator().manual_seed(31 + act + 3 * full)
    tokens = 100
    x_rows = torch.randint(0, tokens, (key.numel(),), generator=g).to(torch.int32).cuda()
    x = torch.randn(tokens, 2880, generator=g).bfloat16().cuda()
    assert sorted({(r + 7) // 8 for r in _live_tile_rows(key, 8, 64)}) == list(range(1, 9))
    n = 2 * 2880 if act else 2880
    w = _slab(8, n, 2880, "real", seed=40 + act, bias=act != 2)
    _check_routed(w, act, x, key, x_rows, 64, [v])


@pytest.mark.parametrize(
    ("act", "scales"), [(0, "extreme"), (1, "extreme"), (0, "high"), (1, "wide")]
)
def test_wgmma_extreme_scales(act: int, scales: str) -> None:
    """Scale bytes 0/1/2/3/200/240/253/254/255 (the slow path: subnormal
    weights, inf / NaN rows), 180..240 (fast, D > 0) and 2..128 (fast, D = 0)
    at block_m 64."""
    v = _wgmma()
    n = 2 * 2880 if act else 2880
    w = _slab(4, n, 2880, scales, seed=61 + act)
    # Triton's tl.dot_scaled differs on inf / NaN rows: the fp32 reference only
    _check(w, act, 16, 4, 2, 64, 65 + act, [v, None], triton=scales != "extreme")
    _check(w, act, 64, 4, 2, 64, 67 + act, [v], triton=scales != "extreme")


def test_wgmma_small_odd_slabs() -> None:
    """N = 200 (gate/up, 100 outputs: a partly dead warpgroup) and N = 192
    (no bias), K = 96 (one 128-k chunk of 3 blocks) at block_m 64."""
    v = _wgmma()
    w = _slab(4, 200, 96, "real", seed=71)
    _check(w, 1, 16, 4, 2, 64, 71, [v, None])
    w0 = _slab(4, 192, 96, "real", seed=72, bias=False)
    _check(w0, 0, 9, 4, 2, 64, 72, [v, None])
    _check(w0, 0, 64, 4, 2, 64, 73, [v])


def test_wgmma_policy_picks_it_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where it runs, block_m 64 takes the wgmma variant (the same bits as
    asking for it), ``PDFLASH_MXFP4_CUDA_BM64=mma`` the mma.sync variant 4;
    both agree with the reference."""
    from pdflash.models import mxfp4_cuda_gemm as g

    v = _wgmma()
    monkeypatch.delenv(g.BM64_ENV, raising=False)
    assert g.pick_variant(64) == v and g.pick_variant(64, "cuda") == v
    assert g.pick_variant(16) == g.SMALL_BLOCK_VARIANT
    k = _k()
    w = _slab(8, 2880, 2880, "real", seed=81)
    key, x_rows = _routing(128, 8, 4, 81)
    x = torch.randn(128, 2880, generator=torch.Generator().manual_seed(81)).bfloat16().cuda()
    tiles = k.tile_map(key, 8, 64, 8)
    auto = g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w)
    assert torch.equal(auto, g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=v))
    monkeypatch.setenv(g.BM64_ENV, "mma")
    assert g.pick_variant(64) == g.LARGE_BLOCK_VARIANT
    mma = g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w)
    assert torch.equal(mma, g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=4))
    want = _reference(x, x_rows, key, w, 0)
    assert _row_rel(auto, want)[0] <= TOL and _row_rel(mma, want)[0] <= TOL
    monkeypatch.setenv(g.BM64_ENV, "wgmma")
    assert g.pick_variant(64) == v


def test_wgmma_cuda_graph_capture_and_replay() -> None:
    """The wgmma variant launched first inside a capture (K = 4096, a shared
    memory size no other test gives it), replayed with new inputs: equal to
    eager launches."""
    from pdflash.models.mxfp4_cuda_gemm import grouped_mxfp4_gemm

    v = _wgmma()
    k = _k()
    w = _slab(4, 2 * 1024, 4096, "real", seed=91)
    down = _slab(4, 4096, 1024, "real", seed=92)
    key, x_rows = _routing(96, 4, 2, 91)
    x = torch.randn(96, 4096, device="cuda").bfloat16()
    tiles = k.tile_map(key, 4, 64, 4)
    rows = torch.arange(key.numel(), dtype=torch.int32, device="cuda")
    kw: dict[str, Any] = {"act": 1, "gate_up": (0, 1, 2), "alpha": ALPHA, "limit": LIMIT}

    def mlp() -> torch.Tensor:
        h = grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=v, **kw)
        return grouped_mxfp4_gemm(h, rows, tiles, 64, down, variant=v)

    _check_replay_equals_eager(mlp, x)


def test_wgmma_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without sm_90a code or off compute capability 9.0: the policy keeps
    block_m 64 on variant 4, asking for the wgmma variant raises, and the
    launcher itself refuses it (VARIANT_UNAVAILABLE) before launching."""
    from pdflash.models import mxfp4_cuda_gemm as g

    why = g.wgmma_unavailable("cuda")
    if why is None:
        pytest.skip("the wgmma variant runs on this device")
    monkeypatch.delenv(g.BM64_ENV, raising=False)
    assert g.pick_variant(64) == g.LARGE_BLOCK_VARIANT
    mod = g.native()
    assert mod.variant_available(g.WGMMA_BLOCK_VARIANT, torch.cuda.current_device()) == (
        mod.VARIANT_UNAVAILABLE
    )
    w = _slab(2, 64, 96, "real", seed=5)
    key = torch.tensor([0, 0, 1], dtype=torch.int32, device="cuda")
    x_rows = torch.arange(3, dtype=torch.int32, device="cuda")
    x = torch.randn(3, 96, device="cuda").bfloat16()
    tiles = _k().tile_map(key, 2, 64, 2)
    with pytest.raises(g.WgmmaUnavailableError, match="cannot run"):
        g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w, variant=g.WGMMA_BLOCK_VARIANT)
    out = torch.full((3, 64), 7.0, dtype=torch.bfloat16, device="cuda")
    rc = g._launch(mod, g.WGMMA_BLOCK_VARIANT, x, x_rows, w, w.bias, out, tiles, 64, 64,
                   0, 0, 0, 1, 1.0, 0.0, 1, mod.OUT_NATURAL)  # fmt: skip
    assert rc == mod.VARIANT_UNAVAILABLE
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())  # nothing was launched
    monkeypatch.setenv(g.BM64_ENV, "wgmma")
    with pytest.raises(g.WgmmaUnavailableError, match="PDFLASH_MXFP4_CUDA_BM64=wgmma"):
        g.grouped_mxfp4_gemm(x, x_rows, tiles, 64, w)


@pytest.mark.parametrize("act", [0, 1])
def test_chunk_major_blocks_give_the_natural_layouts_bits(act: int) -> None:
    """The launcher's ``stride_wc`` (bytes from a row's 128-k chunk to its
    next): a chunk-major copy of the blocks (per slot ``[K/128][N][64]``,
    ``stride_wn`` 64, ``stride_wc`` N * 64; K = 2880's partial last chunk
    zero-padded) gives the natural layout's output bit for bit, for the
    mma.sync variant 8 and, where it runs, the wgmma variant 10."""
    from pdflash.models import mxfp4_cuda_gemm as g

    seed = 420 + act
    key, x_rows = _routing(96, 8, 4, seed)
    n = 2 * 2880 if act else 2880
    w = _slab(8, n, 2880, "real", seed=seed)
    x = torch.randn(96, 2880, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
    tiled, stride_ws, stride_wn, stride_wc = g.chunk_major_blocks(w.data)
    cols = _cols(act, n)
    n_out = n // 2 if act else n
    mod = g.native()
    variants = [g.SMALL_BLOCK_VARIANT]
    if g.wgmma_unavailable("cuda") is None:
        variants.append(g.WGMMA_BLOCK_VARIANT)
    for variant in variants:
        block_m = 16 if variant == g.SMALL_BLOCK_VARIANT else 64
        tiles = _k().tile_map(key, 8, block_m, 8)
        kw: dict[str, Any] = {"act": act, "gate_up": cols, "alpha": ALPHA, "limit": LIMIT}
        base = g.grouped_mxfp4_gemm(x, x_rows, tiles, block_m, w, variant=variant, **kw)
        out = torch.full_like(base, float("nan"))
        slot, start, end = tiles
        assert w.bias is not None
        rc = mod.launch(
            variant, x.data_ptr(), x.stride(0), x_rows.data_ptr(),
            tiled.data_ptr(), stride_ws, stride_wn, stride_wc,
            w.scale.data_ptr(), w.scale.stride(0), w.scale.stride(1), 1,
            w.bias.data_ptr(), w.bias.stride(0), out.data_ptr(), out.stride(0),
            slot.data_ptr(), start.data_ptr(), end.data_ptr(), int(slot.numel()),
            block_m, n, 2880, n_out, act, *cols, ALPHA, LIMIT, mod.OUT_NATURAL,
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        assert rc == mod.OK, mod.error_string(rc)
        live = _covered_rows(tiles, int(x_rows.numel()))
        assert torch.equal(out[live].view(torch.int16), base[live].view(torch.int16)), variant
