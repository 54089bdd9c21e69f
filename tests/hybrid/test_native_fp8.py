"""The native host kernel on FP8 experts (the ``native_fp8`` host format).

An FP8 store (``expert_dtype="fp8"``) holds e4m3fn weights with one fp32
scale per output channel. The kernel decodes each code exactly to bf16 in
the tile loops and multiplies a column's fp32 accumulator by its scale
before the bias. Checked here: the packing and the decoding against the
pure-Python reference (:mod:`pdflash._reference.hostmlp`, whose e4m3 -> bf16
is torch's own conversion); the kernel against the reference MLP with the
column scales (the native kernel's tolerances,
``tests/hybrid/test_native_mlp.py``); the scalar and AVX-512 loops bit for
bit; and the adapter's own expert function (the store's dense path, which
rounds each scaled weight to bf16 first) within bf16 tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import evicting_adapter, forced_host_service, token_ids
from native_fixtures import ALPHA, ISAS, LIMIT, needs_avx

from pdflash._reference import hostmlp as ref
from pdflash.hybrid import host_kernel_for, host_weights_for, kernels, native
from pdflash.hybrid.native import NativeHostKernel

pytestmark = pytest.mark.native

Parts = tuple[torch.Tensor | None, ...]


def _fp8_expert(hidden: int, inter: int, act: str, seed: int) -> Parts:
    """(gate, up, down) as e4m3fn ``[out, in]`` (every finite code drawn),
    their fp32 column scales, and gpt-oss's biases."""
    g = torch.Generator().manual_seed(seed)

    def codes(rows: int, cols: int) -> torch.Tensor:
        c = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
        c[(c & 0x7F) == 0x7F] = 0  # no NaN codes
        return c.view(torch.float8_e4m3fn)

    def scales(n: int) -> torch.Tensor:
        return torch.rand(n, generator=g) * 2e-3 + 1e-4

    biases: Parts = (None, None, None)
    if act == "gpt_oss":
        biases = tuple(
            torch.randn(n, generator=g).to(torch.bfloat16) for n in (inter, inter, hidden)
        )
    return (
        codes(inter, hidden),
        codes(inter, hidden),
        codes(hidden, inter),
        scales(inter),
        scales(inter),
        scales(hidden),
        *biases,
    )


def _kernel(hidden: int, inter: int, act: str, parts: Parts, **kw: Any) -> NativeHostKernel:
    return NativeHostKernel(
        act,
        lambda _v: parts,
        hidden=hidden,
        inter=inter,
        alpha=ALPHA,
        limit=LIMIT,
        weights="fp8",
        **kw,
    )


def _bf16(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _unpacked_scales(prepared: dict[str, torch.Tensor], inter: int) -> torch.Tensor:
    """W1's packed column scales (per tile: gate's 16, up's 16) in ``b1``'s
    layout (gate's ``inter_pad``, then up's)."""
    return prepared["s1"].view(-1, 2, 16).permute(1, 0, 2).reshape(2 * ref.inter_pad(inter))


@pytest.mark.parametrize("hidden,inter", [(64, 48), (37, 21), (130, 100)])
def test_fp8_packing_decodes_to_the_bf16_packing(hidden: int, inter: int) -> None:
    gate, up, down, gs, us, ds, *_ = _fp8_expert(hidden, inter, "swiglu_silu", seed=hidden)
    assert gate is not None and up is not None and down is not None
    assert gs is not None and us is not None and ds is not None
    q1, c1 = native.pack_fp8_w1(gate, up, gs, us)
    q2, c2 = native.pack_fp8_w2(down, ds)
    mod = native._native()
    assert q1.numel() == mod.w1_elems(hidden, inter) and q2.numel() == mod.w2_elems(hidden, inter)
    # the codes sit in their bf16 elements' places, and decode to the values
    assert np.array_equal(ref.decode_fp8(q1.numpy()), ref.pack_w1(_bf16(gate), _bf16(up)))
    assert np.array_equal(ref.decode_fp8(q2.numpy()), ref.pack_w2(_bf16(down)))
    ip = ref.inter_pad(inter)
    s1 = _unpacked_scales({"s1": c1}, inter)
    assert torch.equal(s1[:inter], gs) and torch.equal(s1[ip : ip + inter], us)
    assert bool((s1[inter:ip] == 1).all()) and bool((s1[ip + inter :] == 1).all())
    assert torch.equal(c2[:hidden], ds) and bool((c2[hidden:] == 1).all())
    assert c2.numel() == 32 * mod.w2_tiles(hidden) and c1.numel() == 32 * mod.w1_tiles(inter)


def test_every_e4m3_code_decodes_exactly() -> None:
    # all 254 finite codes (NaN's two refused) through each ISA's decoder,
    # read back exactly: x = e_0; gate's column 0 is 32 (sigmoid(32) is 1.0
    # in float32, so silu(gate) = 32), up's column 0 holds the codes, down
    # is the identity: out[j] = 32 * value(code j), exact in bf16 and fp32
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    hidden = inter = 32
    one, e4m3_one, e4m3_32 = torch.ones(inter), 0x38, 0x60
    for isa in ISAS:
        for i in range(0, codes.numel(), inter):
            chunk = codes[i : i + inter]
            n = chunk.numel()
            gate = torch.zeros(inter, hidden, dtype=torch.uint8)
            gate[:, 0] = e4m3_32
            up = torch.zeros(inter, hidden, dtype=torch.uint8)
            up[:n, 0] = chunk
            down = torch.eye(hidden, inter, dtype=torch.uint8) * e4m3_one
            weights = (m.view(torch.float8_e4m3fn) for m in (gate, up, down))
            parts: Parts = (*weights, one, one, torch.ones(hidden), None, None, None)
            k = _kernel(hidden, inter, "swiglu_silu", parts, isa=isa, threads=1)
            x = torch.zeros(1, hidden, dtype=torch.bfloat16)
            x[0, 0] = 1
            out = torch.empty(1, hidden)
            k.forward_many(x, [k.prepare({})], [0, 1], out)
            k.close()
            assert torch.equal(out[0, :n], 32 * values[i : i + n]), isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["gpt_oss", "swiglu_silu"])
@pytest.mark.parametrize("hidden,inter", [(64, 48), (37, 21), (130, 100)])
def test_fp8_kernel_equals_the_reference(isa: str, act: str, hidden: int, inter: int) -> None:
    parts = _fp8_expert(hidden, inter, act, seed=hidden * 7 + inter)
    k = _kernel(hidden, inter, act, parts, isa=isa, threads=2)
    w = k.prepare({})
    gate, up, down = parts[:3]
    assert gate is not None and up is not None and down is not None
    gen = torch.Generator().manual_seed(3)
    try:
        for rows in (1, 3, 8, 9, 16, 17):
            x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
            out = torch.empty(rows, hidden)
            k.forward_many(x, [w], [0, rows], out)
            want = ref.mlp(
                x,
                ref.pack_w1(_bf16(gate), _bf16(up)),
                ref.pack_w2(_bf16(down)),
                w.get("b1"),
                w.get("b2"),
                hidden=hidden,
                inter=inter,
                act=ref.ACT_GPT_OSS_CLAMP if act == "gpt_oss" else ref.ACT_SWIGLU_SILU,
                alpha=ALPHA,
                limit=LIMIT,
                scales1=_unpacked_scales(w, inter),
                scales2=w["s2"],
            )
            scale = float(want.abs().max())
            assert float((out - want).abs().max()) <= 1e-4 * scale
        assert k.last_isa() == isa
    finally:
        k.close()


@needs_avx
@pytest.mark.parametrize("act", ["gpt_oss", "swiglu_silu"])
def test_fp8_scalar_and_avx512_agree_bit_for_bit(act: str) -> None:
    parts = _fp8_expert(130, 100, act, seed=11)
    ks = _kernel(130, 100, act, parts, isa="scalar", threads=2)
    ka = _kernel(130, 100, act, parts, isa="avx512_bf16", threads=2)
    ws, wa = ks.prepare({}), ka.prepare({})
    x = torch.randn(17, 130, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for rows in (1, 8, 17):
        assert np.array_equal(_bits(ks.forward(x[:rows], ws)), _bits(ka.forward(x[:rows], wa)))
    ks.close()
    ka.close()


def test_fp8_nan_codes_and_wrong_shapes_are_refused() -> None:
    parts = list(_fp8_expert(64, 32, "swiglu_silu", seed=2))
    bad = parts[0].view(torch.uint8).clone()  # type: ignore[union-attr]
    bad[1, 2] = 0xFF
    with pytest.raises(ValueError, match="NaN codes"):
        _kernel(64, 32, "swiglu_silu", (bad.view(torch.float8_e4m3fn), *parts[1:])).prepare({})
    with pytest.raises(ValueError, match="do not match"):
        _kernel(64, 48, "swiglu_silu", tuple(parts)).prepare({})


@needs_avx
@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_native_fp8_format_on_an_fp8_store(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.models import load_adapter

    ad = load_adapter(
        tiny_checkpoints[arch],
        issuer=host_issuer,
        cache_slots=8,
        expert_dtype="fp8",
        dtype=torch.bfloat16,
    )
    assert ad.layout.format == "fp8"
    k = host_kernel_for(ad, "native_fp8")
    assert isinstance(k, NativeHostKernel) and k.name == "native_fp8"
    gen = torch.Generator().manual_seed(6)
    for g in (0, 3, ad.num_experts + 1):
        views = ad.store.views(g)
        x = torch.randn(5, ad.hidden_size, generator=gen).to(torch.bfloat16)
        got = k.forward(x, k.prepare(views)).float()
        want = ad.expert_forward(x, views).float()  # the dense path: scaled weights in bf16
        scale = float(want.abs().max())
        err = (got - want).abs()
        assert float(err.max()) <= 2e-2 * scale and float(err.mean()) <= 4e-3 * scale
    k.close()
    fp8_hw = host_weights_for(ad, "native_fp8", budget_bytes=1 << 34)
    dense_hw = host_weights_for(ad, "native", budget_bytes=1 << 34)
    assert 0 < fp8_hw.nbytes < dense_hw.nbytes  # codes: half the bf16 bytes
    auto = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    assert isinstance(auto.candidates["native_fp8"], float)
    dense = load_adapter(
        tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16
    )
    assert host_kernel_for(dense, "native_fp8") is None
    assert "not FP8" in kernels.unavailable_reason(dense, "native_fp8")


@needs_avx
def test_offloaded_forward_with_native_fp8_host_experts(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = evicting_adapter(
        tiny_checkpoints["qwen3_moe"], host_issuer, dtype=torch.bfloat16, expert_dtype="fp8"
    )
    ids = token_ids(9, 3)
    want = ad.forward_logits(ids).float()  # every miss copied, the device's experts
    with forced_host_service(ad, "native_fp8") as svc:
        got = ad.forward_logits(ids).float()
        assert svc.describe()["host_weights"]["host_format"] == "native_fp8"
    assert svc.books.experts > 0
    err = (got - want).abs()
    scale = float(want.abs().max())
    assert float(err.max()) <= 5e-2 * scale and float(err.mean()) <= 1e-2 * scale
