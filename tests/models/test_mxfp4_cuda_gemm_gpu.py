"""The CUDA MXFP4 GEMM (:func:`pdflash.models.mxfp4_cuda_gemm.grouped_mxfp4_gemm`)
on a GPU against a torch fp32 reference (dequantize, matmul, bias, epilogue)
and against the Triton ``grouped_qgemm(mxfp4_dot="scaled")``: both
epilogues (and SiLU), 1..256 tokens, block_m 16/32/64, every variant that
takes the block_m, a dead tile mid-list, rows outside every tile left
untouched, extreme scale bytes (subnormal weights, inf / NaN), and CUDA-graph
capture / replay (a shape first launched inside the capture).

Error metric (as the probe, ``bench/h200/mxfp4_cuda/probe.py``): per output
row, max |got - ref| / max |ref| over the row; below 2^-7 (two bf16 ulps at
the row's largest output; bf16 rounding alone gives <= 2^-9); non-finite
reference entries must match exactly."""

from __future__ import annotations

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
    from pdflash.models.mxfp4_cuda_gemm import grouped_mxfp4_gemm

    k = _k()
    key, x_rows = _routing(tokens, experts, top_k, seed)
    x = torch.randn(tokens, w.k, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
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
    from pdflash.models.mxfp4_cuda_gemm import variants

    return [None] + [v.index for v in variants() if v.max_block_m >= block_m]


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

    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        out = mlp()
    torch.cuda.current_stream().wait_stream(s)
    for seed in (1, 2):
        x.copy_(torch.randn(24, 4096, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mlp())
