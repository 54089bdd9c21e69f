"""The native host expert MLP (pdflash_native._hostmlp through
pdflash.hybrid.native) against its pure-Python reference
(pdflash._reference.hostmlp) and against the adapters' own expert function.

Tolerances, per architecture (gpt-oss's clamped SwiGLU with biases; Qwen3's
SiLU SwiGLU without), against the float32 function of the same bf16 weights
and bf16-rounded inputs:

* the reference that rounds g (the activation's output) to bf16 before the
  second product, as the kernel does: max |error| <= 1e-4 * max |reference|
  with a float32 output (accumulation order; now and then a g element
  within float32 noise of a bf16 rounding boundary rounds the other way);
  a bf16 output adds its own rounding, <= 2^-8 of each element;
* the plain float32 function (no g rounding; the adapters in float32):
  max |error| <= 1e-2 * max |reference|, mean <= 2e-3 * max |reference|.

Bit for bit: the scalar and the AVX-512 BF16 variants (same operations in
the same order; AMX sums in its own order, so it is held to the tolerances
only), any thread count, and a batch against one call per expert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import evicting_adapter, forced_host_service, token_ids
from native_fixtures import ALPHA, HAS_AMX, HAS_AVX, ISAS, LIMIT, needs_amx, needs_avx

from pdflash._reference import hostmlp as ref
from pdflash.hybrid import HostExpertExecutor, host_kernel_for, host_weights_for, kernels, native
from pdflash.hybrid.kernels import prepare_all
from pdflash.hybrid.native import NativeHostKernel

pytestmark = pytest.mark.native


def _weights(hidden: int, inter: int, act: str, seed: int) -> tuple[torch.Tensor | None, ...]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    gate, up, down = rnd(inter, hidden), rnd(inter, hidden), rnd(hidden, inter)
    if act == "gpt_oss":
        return gate, up, down, rnd(inter).float(), rnd(inter).float(), rnd(hidden).float()
    return gate, up, down, None, None, None


def _kernel(hidden: int, inter: int, act: str, w: tuple[Any, ...], **kw: Any) -> NativeHostKernel:
    return NativeHostKernel(
        act, lambda _v: w, hidden=hidden, inter=inter, alpha=ALPHA, limit=LIMIT, **kw
    )


def _reference(
    x: torch.Tensor, w: tuple[Any, ...], prepared: dict[str, torch.Tensor], act: str, **kw: Any
) -> torch.Tensor:
    gate, up, down = w[:3]
    hidden, inter = down.shape
    return ref.mlp(
        x,
        ref.pack_w1(gate, up),
        ref.pack_w2(down),
        prepared.get("b1"),
        prepared.get("b2"),
        hidden=hidden,
        inter=inter,
        act=ref.ACT_GPT_OSS_CLAMP if act == "gpt_oss" else ref.ACT_SWIGLU_SILU,
        alpha=ALPHA,
        limit=LIMIT,
        **kw,
    )


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("hidden,inter", [(64, 48), (37, 21), (33, 16), (1, 1), (96, 130)])
def test_packing_equals_the_reference_layout_and_round_trips(hidden: int, inter: int) -> None:
    gate, up, down, *_ = _weights(hidden, inter, "swiglu_silu", seed=hidden + inter)
    assert gate is not None and up is not None and down is not None
    w1, w2 = native.pack_w1(gate, up), native.pack_w2(down)
    mod = native._native()
    assert w1.numel() == mod.w1_elems(hidden, inter) and w2.numel() == mod.w2_elems(hidden, inter)
    assert np.array_equal(_bits(w1), ref.pack_w1(gate, up))
    assert np.array_equal(_bits(w2), ref.pack_w2(down))
    g2, u2 = ref.unpack_w1(ref.pack_w1(gate, up), hidden, inter)
    assert torch.equal(g2, gate.float()) and torch.equal(u2, up.float())
    assert torch.equal(ref.unpack_w2(ref.pack_w2(down), hidden, inter), down.float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ["gpt_oss", "swiglu_silu"])
@pytest.mark.parametrize("hidden,inter", [(64, 48), (37, 21), (130, 100)])
def test_native_equals_reference_for_1_to_16_rows(
    hidden: int, inter: int, act: str, isa: str
) -> None:
    w = _weights(hidden, inter, act, seed=3)
    kernel = _kernel(hidden, inter, act, w, threads=2, isa=isa)
    try:
        prepared = kernel.prepare({})
        gen = torch.Generator().manual_seed(4)
        for n in [*range(1, 17), 19, 33]:  # 17+: more rows than one pass holds
            x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
            want = _reference(x, w, prepared, act)
            plain = _reference(x, w, prepared, act, round_g=False)
            scale = float(want.abs().max())
            out = torch.full((n, hidden), float("nan"))
            kernel.forward_many(x, [prepared], [0, n], out)
            assert float((out - want).abs().max()) <= 1e-4 * scale, n
            err = (out - plain).abs()
            assert float(err.max()) <= 1e-2 * scale and float(err.mean()) <= 2e-3 * scale, n
            out16 = torch.empty(n, hidden, dtype=torch.bfloat16)
            kernel.forward_many(x, [prepared], [0, n], out16)
            assert bool(
                ((out16.float() - want).abs() <= 2**-8 * want.abs() + 1e-4 * scale).all()
            ), n
        assert kernel.last_isa() == isa
    finally:
        kernel.close()


@needs_avx
@pytest.mark.parametrize("act", ["gpt_oss", "swiglu_silu"])
def test_scalar_and_avx512_agree_bit_for_bit(act: str) -> None:
    hidden, inter = 75, 40
    w = _weights(hidden, inter, act, seed=5)
    outs = []
    for isa in ("scalar", "avx512_bf16"):
        kernel = _kernel(hidden, inter, act, w, threads=1, isa=isa)
        prepared = kernel.prepare({})
        x = torch.randn(11, hidden, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
        out = torch.empty(11, hidden)
        kernel.forward_many(x, [prepared], [0, 11], out)
        outs.append(out)
        kernel.close()
    assert torch.equal(outs[0], outs[1])


@needs_amx
def test_amx_runs_row_chunks_from_amx_min_rows() -> None:
    hidden, inter, act = 64, 40, "swiglu_silu"
    w = _weights(hidden, inter, act, seed=10)
    avx = _kernel(hidden, inter, act, w, threads=2, isa="amx_bf16", amx_min_rows=5)
    few, avx = avx, avx.with_isa("avx512_bf16")
    assert (avx.isa, avx.amx_min_rows, avx.threads) == ("avx512_bf16", 5, 2)
    prepared = avx.prepare({})
    gen = torch.Generator().manual_seed(11)
    for n, ran in ((4, "avx512_bf16"), (5, "amx_bf16"), (16, "amx_bf16")):
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        out_avx, out_few = torch.empty(n, hidden), torch.empty(n, hidden)
        avx.forward_many(x, [prepared], [0, n], out_avx)
        few.forward_many(x, [prepared], [0, n], out_few)
        assert few.last_isa() == ran
        if ran == "avx512_bf16":  # below the threshold: the AVX-512 loops
            assert torch.equal(out_few, out_avx)
        else:
            want = _reference(x, w, prepared, act)
            assert float((out_few - want).abs().max()) <= 1e-4 * float(want.abs().max())
    with pytest.raises(ValueError, match="amx_min_rows"):
        _kernel(hidden, inter, act, w, amx_min_rows=0)
    avx.close()
    few.close()


@pytest.mark.parametrize("isa", ISAS)
def test_any_thread_count_and_batching_give_the_same_bits(isa: str) -> None:
    hidden, inter, act = 96, 80, "gpt_oss"
    experts = [_weights(hidden, inter, act, seed=s) for s in range(4)]
    counts = [3, 1, 16, 9]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(7))
    x = x.to(torch.bfloat16)
    results = []
    for threads in (1, 2, 3, 5):
        kernels_ = [_kernel(hidden, inter, act, w, threads=threads, isa=isa) for w in experts]
        ws = [k.prepare({}) for k in kernels_]
        batch = torch.empty(x.shape)
        kernels_[0].forward_many(x, ws, bounds, batch)  # one call, four experts
        single = torch.cat(
            [
                k.forward(x[a:b], w).float()
                for k, w, a, b in zip(kernels_, ws, bounds, bounds[1:], strict=False)
            ]
        )
        # forward() gives bf16: the batch's float32 output rounded equals it
        assert torch.equal(batch.to(torch.bfloat16).float(), single)
        results.append(batch)
        for k in kernels_:
            k.close()
    for r in results[1:]:
        assert torch.equal(r, results[0])


@pytest.mark.parametrize("isa", ISAS)
def test_calls_with_parked_and_late_workers_stay_exact(isa: str) -> None:
    # more threads than cores, idle gaps that park the workers, calls right
    # after one another: every call equals the single-thread result (a
    # worker joining a finished call, or the next one, must not touch
    # either's output)
    import random
    import time

    hidden, inter, act = 48, 40, "gpt_oss"
    w = _weights(hidden, inter, act, seed=12)
    one = _kernel(hidden, inter, act, w, threads=1, isa=isa)
    team = _kernel(hidden, inter, act, w, threads=4, isa=isa, spin_us=20)
    prepared = one.prepare({})
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(13)
    for i in range(150):
        n = rng.randint(1, 17)
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        want, got = torch.empty(n, hidden), torch.full((n, hidden), float("nan"))
        one.forward_many(x, [prepared], [0, n], want)
        if i % 3 == 0:
            time.sleep(rng.random() * 3e-4)
        team.forward_many(x, [prepared], [0, n], got)
        assert torch.equal(got, want), i
    one.close()
    team.close()


def test_bad_input_is_refused_and_the_team_survives() -> None:
    hidden, inter = 32, 16
    w = _weights(hidden, inter, "swiglu_silu", seed=8)
    kernel = _kernel(hidden, inter, "swiglu_silu", w, threads=2, isa="scalar")
    prepared = kernel.prepare({})
    x = torch.randn(4, hidden).to(torch.bfloat16)
    out = torch.zeros(4, hidden)
    with pytest.raises(ValueError, match="do not split"):
        kernel.forward_many(x, [prepared], [0, 3], out)
    with pytest.raises(ValueError, match="not prepared"):
        kernel.forward_many(x, [{"w1": prepared["w1"][:-2], "w2": prepared["w2"]}], [0, 4], out)
    with pytest.raises(ValueError, match=r"not \[rows, 32\]"):
        kernel.forward_many(x[:, :8], [prepared], [0, 4], out[:, :8])
    other = _kernel(48, inter, "swiglu_silu", w)  # weights of another shape
    with pytest.raises(ValueError, match="do not match"):
        other.prepare({})
    with pytest.raises(ValueError, match="unknown activation"):
        NativeHostKernel("gelu", lambda _v: w, hidden=hidden, inter=inter)
    with pytest.raises(ValueError, match="unknown isa"):
        NativeHostKernel("gpt_oss", lambda _v: w, hidden=hidden, inter=inter, isa="avx2")
    assert torch.equal(out, torch.zeros(4, hidden))  # nothing written
    team = kernel.team()
    with pytest.raises(ValueError, match="bounds"):  # the binding's own checks
        team.run(
            0, hidden, inter, 0.0, 0.0, *np.zeros((4, 1), np.uint64), np.array([0], np.int64),
            x.data_ptr(), 1, hidden, out.data_ptr(), 0, hidden,
        )  # fmt: skip
    with pytest.raises(ValueError, match="do not continue"):  # the C++ checks
        team.run(
            0, hidden, inter, 0.0, 0.0, *np.ones((4, 2), np.uint64), np.array([0, 3, 2], np.int64),
            x.data_ptr(), 1, hidden, out.data_ptr(), 0, hidden,
        )  # fmt: skip
    with pytest.raises(ValueError, match="row stride"):
        team.run(
            0, hidden, inter, 0.0, 0.0, *np.ones((4, 1), np.uint64), np.array([0, 2], np.int64),
            x.data_ptr(), 1, 8, out.data_ptr(), 0, hidden,
        )  # fmt: skip
    kernel.forward_many(x, [prepared], [0, 4], out)  # still works
    assert torch.isfinite(out).all() and out.abs().max() > 0
    kernel.close()
    team.close()  # idempotent
    assert team.closed
    with pytest.raises(RuntimeError, match="closed"):
        team.run(
            0, hidden, inter, 0.0, 0.0, *np.zeros((4, 1), np.uint64), np.array([0, 4], np.int64),
            x.data_ptr(), 1, hidden, out.data_ptr(), 0, hidden,
        )  # fmt: skip
    kernel.forward_many(x, [prepared], [0, 4], out)  # a closed kernel makes a new team


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_native_equals_the_adapters_expert_function(
    arch: str, isa: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.models import load_adapter

    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8)  # float32
    kind = "gpt_oss" if arch == "gpt_oss" else "swiglu_silu"
    # the float32 adapter's experts, with weights and inputs rounded to bf16
    # first, are the float32 function the native kernel computes in bf16
    kernel = native.native_kernel_for(ad, arch=kind, threads=2, isa=isa)
    gen = torch.Generator().manual_seed(9)
    for g in (0, 3, ad.num_experts + 1):
        views = ad.store.views(g)
        rounded = {k: v.to(torch.bfloat16).float() for k, v in views.items()}
        if arch == "gpt_oss":  # biases are float32 in the kernel: keep them exact
            rounded["gate_up_bias"] = views["gate_up_bias"]
            rounded["down_bias"] = views["down_bias"]
        prepared = kernel.prepare(views)
        for n in (1, 4, 16):
            x = torch.randn(n, ad.hidden_size, generator=gen).to(torch.bfloat16)
            want = ad.expert_forward(x.float(), rounded)
            out = torch.empty(n, ad.hidden_size)
            kernel.forward_many(x, [prepared], [0, n], out)
            scale = float(want.abs().max())
            err = (out - want).abs()
            assert float(err.max()) <= 1e-2 * scale and float(err.mean()) <= 2e-3 * scale
    kernel.close()


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_native_format_is_offered_for_bf16_models_only(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.models import load_adapter

    fp32 = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8)
    assert host_kernel_for(fp32, "native") is None
    assert "bf16 models only" in kernels.unavailable_reason(fp32, "native")
    bf16 = load_adapter(
        tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16
    )
    kernel = host_kernel_for(bf16, "native")
    if not HAS_AVX:
        assert kernel is None
        assert "AVX-512 BF16" in kernels.unavailable_reason(bf16, "native")
        return
    assert isinstance(kernel, NativeHostKernel) and kernel.dtype == torch.bfloat16
    # the executor, two workers sharing the kernel's one team: as per expert
    hw = host_weights_for(bf16, "native", budget_bytes=1 << 34)
    ids = np.array([1, 2, 5, bf16.num_experts], dtype=np.int64)
    counts = [2, 4, 1, 3]
    x = torch.randn(sum(counts), bf16.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16)
    with HostExpertExecutor(
        hw.weights_of,
        hw.kernel.forward,
        dtype=hw.kernel.dtype,
        workers=2,
        batch_fn=hw.kernel.forward_many,
    ) as ex:
        got = ex.compute(ids, x, counts)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    want = torch.cat(
        [
            hw.kernel.forward(x[a:b], hw.weights_of(int(g)))
            for g, a, b in zip(ids, bounds, bounds[1:], strict=False)
        ]
    )
    assert torch.equal(got, want)
    detail = hw.describe()["host_kernel"]
    assert detail["kernel"] == "native"
    assert detail["isa_ran"] == ("amx_bf16" if HAS_AMX else "avx512_bf16")


def test_without_avx512_bf16_native_is_left_out_with_a_reason(
    tiny_checkpoints: dict[str, Path], host_issuer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.models import load_adapter

    monkeypatch.setattr(native, "cpu_has_avx512_bf16", lambda: False)
    ad = load_adapter(
        tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16
    )
    assert host_kernel_for(ad, "native") is None
    hw = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    assert "no AVX-512 BF16" in hw.candidates["native"]
    assert hw.format != "native"


@needs_avx
def test_auto_times_native_on_a_bf16_model(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.models import load_adapter

    ad = load_adapter(
        tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16
    )
    hw = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    assert isinstance(hw.candidates["native"], float) and hw.candidates["native"] > 0
    timed = {k: v for k, v in hw.candidates.items() if isinstance(v, float)}
    assert hw.format == min(timed, key=lambda k: timed[k])
    prepared = prepare_all(host_kernel_for(ad, "native"), ad.store.views, [0])  # type: ignore[arg-type]
    assert prepared is not None and prepared.nbytes > 0  # a packed copy: new memory


@needs_avx
@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_offloaded_forward_with_native_host_experts(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = evicting_adapter(tiny_checkpoints[arch], host_issuer, dtype=torch.bfloat16)
    ids = token_ids(9, 3)
    want = ad.forward_logits(ids).float()  # every miss copied, the device's experts
    with forced_host_service(ad, "native") as svc:
        got = ad.forward_logits(ids).float()
        described = svc.describe()["host_weights"]
        assert described["host_format"] == "native"
        assert described["host_kernel"]["isa_ran"] == ("amx_bf16" if HAS_AMX else "avx512_bf16")
    assert svc.books.experts > 0
    # bf16 end to end: every layer's experts rounded differently (fp32 vs bf16
    # intermediates); bounded by the logits' scale
    err = (got - want).abs()
    scale = float(want.abs().max())
    assert float(err.max()) <= 5e-2 * scale and float(err.mean()) <= 1e-2 * scale


@pytest.mark.parametrize("hidden,inter", [(64, 48), (64, 64), (32, 16), (37, 21), (96, 130)])
def test_packing_strided_views_equals_the_reference_layout(hidden: int, inter: int) -> None:
    # gpt-oss's split hands the packer strided, transposed views of the
    # interleaved gate_up [H, 2I] and of down [I, H]; the one-copy packing
    # (shapes whose padding splits no tile or pair) and the two-pass one
    # must both give the reference layout from those
    g = torch.Generator().manual_seed(hidden * inter)
    gu = torch.randn(hidden, 2 * inter, generator=g).to(torch.bfloat16)
    gate, up = gu[:, 0::2].t(), gu[:, 1::2].t()
    down = torch.randn(inter, hidden, generator=g).to(torch.bfloat16).t()
    assert not gate.is_contiguous() and not down.is_contiguous()
    w1, w2 = native.pack_w1(gate, up), native.pack_w2(down)
    assert np.array_equal(_bits(w1), ref.pack_w1(gate, up))
    assert np.array_equal(_bits(w2), ref.pack_w2(down))
    mod = native._native()
    ip, hp = mod.inter_pad(inter), 2 * mod.hidden_pairs(hidden)
    assert torch.equal(native._pack_w1_two_pass(gate, up, ip, hp), w1)
