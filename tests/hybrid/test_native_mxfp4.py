"""The native host kernel on MXFP4 experts (the ``native_mxfp4`` host format).

The kernel dequantizes MXFP4 codes inside the tile loops and then runs the
bf16 kernel's own products, so its outputs must equal, bit for bit, the bf16
kernel's on the same experts dequantized by the library's dequantizer
(:func:`pdflash.models.layout.dequantize_mxfp4`, itself checked against
transformers'), for every ISA this CPU runs, row counts on both sides of the
register and AMX row limits, and hidden sizes over more than one block of
pairs. The packing is checked against the pure-Python reference
(:mod:`pdflash._reference.hostmlp`), and the reference's dequantization of
the packed bytes against the bf16 packing of the dequantized experts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from issuer_fixtures import evicting_adapter, forced_host_service, token_ids
from native_fixtures import ALPHA, ISAS, LIMIT, needs_avx

from pdflash._reference import hostmlp as ref
from pdflash.hybrid import host_kernel_for, host_weights_for, kernels, native
from pdflash.hybrid.native import NativeHostKernel
from pdflash.models.layout import dequantize_mxfp4

pytestmark = pytest.mark.native

Views = dict[str, torch.Tensor]


def _mxfp4_views(hidden: int, inter: int, seed: int, scales: tuple[int, int] = (118, 130)) -> Views:
    """One gpt-oss expert as an MXFP4 store holds it: every code (all 256
    byte values) and scales drawn from ``scales``."""
    g = torch.Generator().manual_seed(seed)

    def blocks(rows: int, k: int) -> torch.Tensor:
        return torch.randint(0, 256, (rows, k // 32, 16), generator=g, dtype=torch.uint8)

    def sc(rows: int, k: int) -> torch.Tensor:
        return torch.randint(*scales, (rows, k // 32), generator=g, dtype=torch.uint8)

    return {
        "gate_up_blocks": blocks(2 * inter, hidden),
        "gate_up_scales": sc(2 * inter, hidden),
        "down_blocks": blocks(hidden, inter),
        "down_scales": sc(hidden, inter),
        "gate_up_bias": torch.randn(2 * inter, generator=g).to(torch.bfloat16),
        "down_bias": torch.randn(hidden, generator=g).to(torch.bfloat16),
    }


def _dense_split(views: Views) -> tuple[torch.Tensor | None, ...]:
    """The same expert dequantized by the library (gate, up, down as
    ``[out, in]``), for the bf16 kernel."""
    gu = dequantize_mxfp4(views["gate_up_blocks"], views["gate_up_scales"], torch.bfloat16)
    down = dequantize_mxfp4(views["down_blocks"], views["down_scales"], torch.bfloat16)
    b = views["gate_up_bias"]
    return gu[0::2], gu[1::2], down, b[0::2], b[1::2], views["down_bias"]


def _kernels(hidden: int, inter: int, isa: str) -> tuple[NativeHostKernel, NativeHostKernel]:
    kw = {"hidden": hidden, "inter": inter, "alpha": ALPHA, "limit": LIMIT, "threads": 2}
    dense = NativeHostKernel("gpt_oss", _dense_split, isa=isa, **kw)  # type: ignore[arg-type]
    mx = NativeHostKernel(
        "gpt_oss",
        native._split_gpt_oss_mxfp4,
        isa=isa,
        weights="mxfp4",
        **kw,  # type: ignore[arg-type]
    )
    return dense, mx


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("hidden,inter", [(64, 32), (96, 64), (320, 288)])
def test_mxfp4_packing_equals_the_reference_and_dequantizes_to_the_bf16_packing(
    hidden: int, inter: int
) -> None:
    v = _mxfp4_views(hidden, inter, seed=hidden)
    gb, gs = v["gate_up_blocks"], v["gate_up_scales"]
    q1, s1 = native.pack_mxfp4_w1(gb[0::2], gb[1::2], gs[0::2], gs[1::2])
    q2, s2 = native.pack_mxfp4_w2(v["down_blocks"], v["down_scales"])
    rq1, rs1 = ref.pack_mxfp4_w1(gb[0::2], gb[1::2], gs[0::2], gs[1::2])
    rq2, rs2 = ref.pack_mxfp4_w2(v["down_blocks"], v["down_scales"])
    assert np.array_equal(q1.numpy(), rq1) and np.array_equal(s1.numpy(), rs1)
    assert np.array_equal(q2.numpy(), rq2) and np.array_equal(s2.numpy(), rs2)
    mod = native._native()
    w1n, w2n = mod.w1_elems(hidden, inter), mod.w2_elems(hidden, inter)
    assert q1.numel() == mod.mxfp4_code_bytes(w1n) and s1.numel() == mod.mxfp4_scale_bytes(w1n)
    assert q2.numel() == mod.mxfp4_code_bytes(w2n) and s2.numel() == mod.mxfp4_scale_bytes(w2n)
    # what the kernel makes of the bytes is the bf16 packing of the experts
    # the library dequantizes
    gate, up, down, *_ = _dense_split(v)
    assert gate is not None and up is not None and down is not None
    assert np.array_equal(ref.dequantize_packed_mxfp4(rq1, rs1), _bits(native.pack_w1(gate, up)))
    assert np.array_equal(ref.dequantize_packed_mxfp4(rq2, rs2), _bits(native.pack_w2(down)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hidden,inter", [(64, 32), (320, 288)])
def test_mxfp4_kernel_equals_the_bf16_kernel_on_the_dequantized_experts(
    isa: str, hidden: int, inter: int
) -> None:
    dense, mx = _kernels(hidden, inter, isa)
    experts = [_mxfp4_views(hidden, inter, seed=s) for s in (1, 2, 3)]
    wd = [dense.prepare(v) for v in experts]
    wm = [mx.prepare(v) for v in experts]
    gen = torch.Generator().manual_seed(5)
    try:
        for rows in (1, 3, 8, 9, 16, 17):  # registers, K-blocks, > one chunk
            x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
            for w_d, w_m in zip(wd, wm, strict=True):
                assert np.array_equal(_bits(mx.forward(x, w_m)), _bits(dense.forward(x, w_d)))
            # a batch of all three, float32 out
            counts = [rows, 2, 1]
            xs = torch.randn(sum(counts), hidden, generator=gen).to(torch.bfloat16)
            bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
            got = torch.empty(sum(counts), hidden)
            want = torch.empty(sum(counts), hidden)
            mx.forward_many(xs, wm, bounds, got)
            dense.forward_many(xs, wd, bounds, want)
            assert torch.equal(got, want)
        assert mx.last_isa() == isa
        assert mx.describe()["kernel"] == "native_mxfp4"
    finally:
        dense.close()
        mx.close()


@pytest.mark.parametrize("bad", [1, 253, 255])
def test_mxfp4_scales_outside_the_exact_range_are_refused(bad: int) -> None:
    v = _mxfp4_views(64, 32, seed=4)
    v["down_scales"][3, 0] = bad
    _, mx = _kernels(64, 32, "scalar")
    with pytest.raises(ValueError, match=r"leave \[2, 252\]"):
        mx.prepare(v)
    for edge in (2, 252):  # the range's ends are exact
        v["down_scales"][3, 0] = edge
        dense, ok = _kernels(64, 32, "scalar")
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        assert np.array_equal(
            _bits(ok.forward(x, ok.prepare(v))), _bits(dense.forward(x, dense.prepare(v)))
        )


def test_mxfp4_kernel_refuses_other_prepared_weights_and_shapes() -> None:
    dense, mx = _kernels(64, 32, "scalar")
    v = _mxfp4_views(64, 32, seed=6)
    x = torch.randn(1, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="not prepared by a native_mxfp4 kernel"):
        mx.forward(x, dense.prepare(v))
    with pytest.raises(ValueError, match="not prepared by a native kernel"):
        dense.forward(x, mx.prepare(v))
    with pytest.raises(ValueError, match="multiples of 32"):
        NativeHostKernel("gpt_oss", _dense_split, hidden=48, inter=32, weights="mxfp4")
    with pytest.raises(ValueError, match="unknown weights"):
        NativeHostKernel("gpt_oss", _dense_split, hidden=64, inter=32, weights="int4")
    with pytest.raises(ValueError, match="do not match"):
        _kernels(96, 32, "scalar")[1].prepare(v)


@needs_avx
def test_native_mxfp4_format_on_an_mxfp4_store(
    mxfp4_checkpoint: Path, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.models import load_adapter

    ad = load_adapter(mxfp4_checkpoint, issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16)
    assert ad.layout.format == "mxfp4"
    mx = host_kernel_for(ad, "native_mxfp4")
    dense = host_kernel_for(ad, "native")
    assert isinstance(mx, NativeHostKernel) and isinstance(dense, NativeHostKernel)
    gen = torch.Generator().manual_seed(8)
    for g in (0, ad.num_experts + 1):
        views = ad.store.views(g)
        x = torch.randn(5, ad.hidden_size, generator=gen).to(torch.bfloat16)
        assert np.array_equal(
            _bits(mx.forward(x, mx.prepare(views))), _bits(dense.forward(x, dense.prepare(views)))
        )
    mx.close()
    dense.close()
    hw = host_weights_for(ad, "native_mxfp4", budget_bytes=1 << 34)
    # codes and scales (the store's bytes, repacked) and float32 biases, at
    # most (a repacking that moves nothing shares the store's memory)
    mod = native._native()
    inter = mx.inter
    w1n, w2n = mod.w1_elems(ad.hidden_size, inter), mod.w2_elems(ad.hidden_size, inter)
    codes = sum(mod.mxfp4_code_bytes(n) + mod.mxfp4_scale_bytes(n) for n in (w1n, w2n))
    per_expert = codes + 4 * (2 * mod.inter_pad(inter) + ad.hidden_size)
    assert 0 < hw.nbytes <= ad.store.num_ids * per_expert
    dense_hw = host_weights_for(ad, "native", budget_bytes=1 << 34)
    assert dense_hw.nbytes > 3 * hw.nbytes
    auto = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    assert isinstance(auto.candidates["native_mxfp4"], float)
    # a dense store has no MXFP4 bytes to compute from
    bf16 = load_adapter(
        tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16
    )
    assert host_kernel_for(bf16, "native_mxfp4") is None
    assert "not MXFP4" in kernels.unavailable_reason(bf16, "native_mxfp4")


@needs_avx
def test_offloaded_forward_with_native_mxfp4_equals_native(
    mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    # the engine's path: an offloaded forward whose misses the host computes;
    # the same experts' outputs bit for bit, so the same logits
    ad = evicting_adapter(mxfp4_checkpoint, host_issuer, dtype=torch.bfloat16)
    assert ad.layout.format == "mxfp4"
    ids = token_ids(9, 3)
    logits = {}
    for fmt in ("native", "native_mxfp4"):
        with forced_host_service(ad, fmt) as svc:
            logits[fmt] = ad.forward_logits(ids)
            assert svc.describe()["host_weights"]["host_format"] == fmt
        assert svc.books.experts > 0
    assert torch.equal(logits["native"], logits["native_mxfp4"])


@needs_avx
def test_an_mxfp4_store_with_scales_outside_the_range_is_left_to_other_formats(
    mxfp4_checkpoint: Path, host_issuer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.models import load_adapter

    ad = load_adapter(mxfp4_checkpoint, issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16)
    low = min(
        int(ad.store.views(int(g))[k].min())
        for g in ad.store.packed_ids()
        for k in ("gate_up_scales", "down_scales")
    )
    # a range the synthetic store's scales leave (its lowest scale below it)
    monkeypatch.setattr(native, "MXFP4_SCALE_RANGE", (low + 1, 252))
    assert host_kernel_for(ad, "native_mxfp4") is None
    why = kernels.unavailable_reason(ad, "native_mxfp4")
    assert f"{low}.." in why and f"leave [{low + 1}, 252]" in why
    hw = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    assert hw.candidates["native_mxfp4"] == why and hw.format != "native_mxfp4"
