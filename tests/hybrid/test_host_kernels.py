"""Host weight formats (pdflash.hybrid.kernels / prepare): an expert computed
from its prepared host weights equals the device path over a cache slot
(within the dtype's tolerance) per architecture and stored format; the
offloaded forward with every miss served that way equals the resident model;
the memory budget, the auto choice and its cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from issuer_fixtures import ARCHS, evicting_adapter, forced_host_service, reference_model, token_ids

from pdflash.hybrid import (
    HOST_FORMATS,
    HostExpertExecutor,
    host_kernel_for,
    host_weights_for,
    kernels,
)
from pdflash.hybrid.kernels import (
    batched_kernels,
    batched_kernels_error,
    onednn_available,
    prepare_all,
    prepared_nbytes,
)
from pdflash.hybrid.native import native_unavailable_reason
from pdflash.models import load_adapter

# the formats of dense stores (native_mxfp4 and native_fp8 compute MXFP4 and
# FP8 stores only: tests/hybrid/test_native_mxfp4.py, test_native_fp8.py)
DENSE_FORMATS = tuple(f for f in HOST_FORMATS if f not in ("native_mxfp4", "native_fp8"))
PREPARED = tuple(f for f in DENSE_FORMATS if f != "packed")


def _skip_unavailable(fmt: str, dtype: torch.dtype) -> None:
    if fmt == "onednn" and not onednn_available(dtype):
        pytest.skip(f"no oneDNN matmul in {dtype} on this CPU")
    if fmt == "native" and (why := native_unavailable_reason(dtype)) is not None:
        pytest.skip(why)


def _device_path(ad: object, ids: np.ndarray, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    slots = ad.cache.ensure_resident(ids)  # type: ignore[attr-defined]
    try:
        views = [ad.runtime._slot_views[int(s)] for s in slots]  # type: ignore[attr-defined]
        return torch.cat(
            [ad.expert_forward(p, v) for p, v in zip(x.split(counts), views, strict=True)]  # type: ignore[attr-defined]
        )
    finally:
        ad.cache.release(ids)  # type: ignore[attr-defined]


def _host_path(ad: object, fmt: str, ids: np.ndarray, x: torch.Tensor, counts: list[int]):
    hw = host_weights_for(ad, fmt, budget_bytes=1 << 34)
    assert hw.format == fmt
    store = ad.store  # type: ignore[attr-defined]
    with HostExpertExecutor(
        hw.weights_of,
        hw.kernel.forward,
        dtype=hw.kernel.dtype,
        out_dtype=store.layout.dtype,
        workers=2,
        batch_fn=hw.kernel.forward_many,
    ) as ex:
        return ex.compute(ids, x, counts), hw


@pytest.mark.parametrize("fmt", PREPARED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_prepared_expert_equals_device_expert(
    arch: str,
    dtype: torch.dtype,
    fmt: str,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
) -> None:
    _skip_unavailable(fmt, dtype)
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8, dtype=dtype)
    ids = np.array([0, 3, ad.num_experts + 1], dtype=np.int64)  # two layers
    counts = [3, 1, 5]
    x = torch.randn(sum(counts), ad.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(dtype)
    host, hw = _host_path(ad, fmt, ids, x, counts)
    device = _device_path(ad, ids, x, counts)
    assert host.dtype == device.dtype == dtype
    # same function, other layout (and float32 compute for fp32_*): rounding only
    if dtype == torch.float32:
        torch.testing.assert_close(host, device, atol=1e-5, rtol=1e-5)
    else:
        # bf16 rounds every intermediate: bound the error by the output's
        # scale (an element near 0 may differ by a few of its ulps)
        err = (host.float() - device.float()).abs()
        scale = float(device.float().abs().max())
        assert float(err.max()) <= 2e-2 * scale and float(err.mean()) <= 2e-3 * scale
    assert host.abs().max() > 0
    if fmt.startswith("fp32_") or dtype == torch.float32:
        assert hw.kernel.dtype == torch.float32


def test_prepared_nbytes_counts_only_new_tensors(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    qwen = load_adapter(tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_slots=8)
    views = qwen.store.views(2)
    # a dense SwiGLU expert is already [out, in] in the model dtype: shared
    w = host_kernel_for(qwen, "out_in").prepare(views)  # type: ignore[union-attr]
    assert prepared_nbytes(w, views) == 0
    assert all(
        w[k].data_ptr() == views[n].data_ptr() for k, n in (("w1", "gate_up"), ("w2", "down"))
    )
    w = host_kernel_for(qwen, "in_out").prepare(views)  # type: ignore[union-attr]
    assert prepared_nbytes(w, views) == sum(t.numel() * t.element_size() for t in views.values())
    oss = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    views = oss.store.views(1)
    w = host_kernel_for(oss, "out_in").prepare(views)  # type: ignore[union-attr]
    # the transposed, de-interleaved gate_up and down are new; the biases
    # (gate_up's reordered) partly too
    assert prepared_nbytes(w, views) == sum(
        t.numel() * t.element_size() for k, t in w.items() if k != "b2"
    )


def test_budget_bounds_the_prepared_copy(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    kernel = host_kernel_for(ad, "fp32_out_in")
    assert kernel is not None
    ids = range(ad.store.num_ids)
    full = prepare_all(kernel, ad.store.views, ids)
    assert full is not None and full.nbytes > 0 and len(full.experts) == ad.store.num_ids
    assert prepare_all(kernel, ad.store.views, ids, budget_bytes=full.nbytes - 1) is None
    assert prepare_all(kernel, ad.store.views, ids, budget_bytes=full.nbytes) is not None
    with pytest.raises(ValueError, match="exceeds"):
        host_weights_for(ad, "fp32_out_in", budget_bytes=full.nbytes // 2)
    with pytest.raises(ValueError, match="unknown host format"):
        host_weights_for(ad, "fp16")
    with pytest.raises(ValueError, match="budget_bytes"):
        host_weights_for(ad, "packed", budget_bytes=-1)


def test_auto_times_the_candidates_and_keeps_its_choice(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    hw = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    timed = {k: v for k, v in hw.candidates.items() if isinstance(v, float)}
    # every candidate is timed (oneDNN's prepacked format where torch has it)
    onednn = {"onednn"} if onednn_available() else set()
    assert set(timed) == {"packed", "out_in", "fp32_out_in", "fp32_in_out"} | onednn
    assert all(v > 0 for v in timed.values())
    assert hw.format == min(timed, key=lambda k: timed[k])
    assert hw.select_s is not None and hw.select_s > 0
    assert host_weights_for(ad, "auto", budget_bytes=1 << 34) is hw  # kept with the store
    assert host_weights_for(ad, hw.format) is hw  # the same format, default budget
    default = host_weights_for(ad, "auto")  # the default budget (from MemAvailable) ...
    assert host_weights_for(ad, "auto") is default  # ... is not re-read for a repeat
    # no room for any copy: only the packed views (and zero-copy formats) remain
    none = host_weights_for(ad, "auto", budget_bytes=0)
    assert none.nbytes == 0
    assert all(isinstance(none.candidates[f], str) for f in ("out_in", "fp32_out_in"))
    assert "over the budget" in none.candidates["out_in"]


@pytest.mark.parametrize("fmt", ["out_in", "fp32_in_out"])
@pytest.mark.parametrize("arch", ("qwen3_moe", "gpt_oss"))
def test_offloaded_forward_with_prepared_host_experts_equals_resident(
    arch: str, fmt: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = evicting_adapter(tiny_checkpoints[arch], host_issuer)
    ref = reference_model(tiny_checkpoints[arch])
    ids = token_ids(9, 3)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    with forced_host_service(ad, fmt) as svc:
        got = ad.forward_logits(ids)
        assert svc.host_weights is not None and svc.host_weights["host_format"] == fmt
        assert svc.describe()["host_weights"]["host_format"] == fmt
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert svc.books.experts > 0 and ad.cache.copies == 0


@pytest.mark.parametrize(
    "fmt", ["out_in", "fp32_in_out", *(["onednn"] if onednn_available() else [])]
)
def test_mxfp4_experts_are_dequantized_once(
    fmt: str, mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    from pdflash.models.layout import mxfp4_dequant_calls

    ad = load_adapter(
        mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2, dtype=torch.float32
    )
    assert ad.layout.format == "mxfp4"
    ids = np.array([1, ad.num_experts + 2], dtype=np.int64)
    x = torch.randn(5, ad.hidden_size, generator=torch.Generator().manual_seed(2))
    hw = host_weights_for(ad, fmt, budget_bytes=1 << 34)
    assert hw.nbytes > 0  # dense copies of the compressed experts
    before = sum(mxfp4_dequant_calls().values())
    host, _ = _host_path(ad, fmt, ids, x, [2, 3])
    assert sum(mxfp4_dequant_calls().values()) == before  # nothing dequantized per call
    torch.testing.assert_close(host, _device_path(ad, ids, x, [2, 3]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_fp8_experts_prepared_dense(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8, expert_dtype="fp8")
    assert ad.layout.format == "fp8"
    ids = np.array([0, 5], dtype=np.int64)
    x = torch.randn(4, ad.hidden_size, generator=torch.Generator().manual_seed(7))
    host, hw = _host_path(ad, "out_in", ids, x, [1, 3])
    assert hw.nbytes > 0
    torch.testing.assert_close(host, _device_path(ad, ids, x, [1, 3]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["out_in", "fp32_in_out"])
def test_preparing_on_a_device_gives_the_same_weights(
    fmt: str, mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    # the device path (copy the packed views there, prepare, copy back),
    # here with the CPU as the "device": same values, all of it new memory
    ad = load_adapter(mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2)
    kernel = host_kernel_for(ad, fmt)
    assert kernel is not None
    ids = [0, 3, ad.num_experts + 1]
    here = prepare_all(kernel, ad.store.views, ids)
    there = prepare_all(kernel, ad.store.views, ids, device="cpu")
    assert here is not None and there is not None
    for a, b in zip(here.experts, there.experts, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) and b[k].is_contiguous()
    assert there.nbytes == sum(
        t.numel() * t.element_size() for w in there.experts for t in w.values()
    )


def test_prepare_device_is_the_host_without_cuda(
    tiny_checkpoints: dict[str, Path], mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    from pdflash.hybrid.prepare import prepare_device

    dense = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    mx = load_adapter(mxfp4_checkpoint, issuer=host_issuer, cache_slots=8)
    assert prepare_device(dense, host_kernel_for(dense, "fp32_out_in")) is None
    assert prepare_device(mx) is None  # a CPU adapter prepares on the CPU


@pytest.mark.skipif(not onednn_available(torch.float32), reason="torch without oneDNN")
@pytest.mark.parametrize("arch", ("qwen3_moe", "gpt_oss"))
def test_onednn_weights_are_prepacked_new_memory(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8)
    kernel = host_kernel_for(ad, "onednn")
    assert kernel is not None and kernel.dtype == ad.store.layout.dtype
    views = ad.store.views(1)
    w = kernel.prepare(views)
    # the matrices are oneDNN's opaque reordered copies (never the store's
    # memory, counted in full); the biases stay plain tensors
    assert {k for k, t in w.items() if t.layout != torch.strided} == {"w1", "w2"}
    assert prepared_nbytes(w, views) == sum(t.numel() * t.element_size() for t in w.values()) - (
        w["b2"].numel() * w["b2"].element_size() if arch == "gpt_oss" else 0
    )
    # the same product as the [out, in] layout's GEMM
    x = torch.randn(3, ad.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = host_kernel_for(ad, "out_in")
    assert ref is not None
    torch.testing.assert_close(
        kernel.forward(x, w), ref.forward(x, ref.prepare(views)), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("scripted", [True, False])
@pytest.mark.parametrize("fmt", DENSE_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_many_equals_forward_per_expert(
    arch: str,
    dtype: torch.dtype,
    fmt: str,
    scripted: bool,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the batch loop (TorchScript, or its Python fallback) against its
    # reference, forward per expert: the same ops, so the same bits
    _skip_unavailable(fmt, dtype)
    if scripted:
        assert batched_kernels() is not None, batched_kernels_error()
    else:
        monkeypatch.setattr(kernels, "batched_kernels", lambda: None)
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8, dtype=dtype)
    kernel = host_kernel_for(ad, fmt)
    assert kernel is not None
    prepared = prepare_all(kernel, ad.store.views, range(ad.store.num_ids))
    assert prepared is not None
    ids = [0, 3, ad.num_experts + 1, 2]
    counts = [3, 1, 5, 2]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), ad.hidden_size, generator=gen).to(kernel.dtype)
    ws = [prepared.of(g) for g in ids]
    want = torch.cat(
        [kernel.forward(x[a:b], w) for a, b, w in zip(bounds, bounds[1:], ws, strict=False)]
    )
    for _ in range(3):  # TorchScript profiles the first calls, then optimises
        out = torch.full(x.shape, float("nan"), dtype=ad.store.layout.dtype)
        with torch.inference_mode():
            kernel.forward_many(x, ws, bounds, out)
        torch.testing.assert_close(out, want.to(out.dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not split"):
        kernel.forward_many(x, ws, bounds[:-1], out)
    with pytest.raises(ValueError, match="not ascending"):
        kernel.forward_many(x, ws, [0, 5, 4, 9, 11], out)
    with pytest.raises(ValueError, match="does not match"):
        kernel.forward_many(x, ws, bounds, out[:-1])


def test_executor_batch_path_equals_its_loop_path(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    hw = host_weights_for(ad, "out_in", budget_bytes=1 << 34)
    ids = np.array([1, 2, 5, ad.num_experts], dtype=np.int64)
    counts = [2, 4, 1, 3]
    x = torch.randn(sum(counts), ad.hidden_size, generator=torch.Generator().manual_seed(3))
    outs = []
    for batch_fn in (None, hw.kernel.forward_many):
        with HostExpertExecutor(
            hw.weights_of, hw.kernel.forward, dtype=hw.kernel.dtype, workers=2, batch_fn=batch_fn
        ) as ex:
            outs.append(ex.compute(ids, x, counts))
            job = ex.submit(ids, x, counts)
            torch.testing.assert_close(job.result(), outs[-1], rtol=0, atol=0)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert outs[0].abs().max() > 0


def test_a_kernel_s_optional_describe_and_close_are_used_where_present() -> None:
    from pdflash.hybrid.kernels import (
        ClosableHostKernel,
        DescribedHostKernel,
        PackedKernel,
        kernel_detail,
    )
    from pdflash.hybrid.prepare import _close_kernel

    plain = PackedKernel(lambda x, w: x, torch.float32)
    assert not isinstance(plain, DescribedHostKernel | ClosableHostKernel)
    assert kernel_detail(plain) == {"kernel": "packed"}
    _close_kernel(plain)  # nothing to join: no error

    closed: list[int] = []

    class Owned(PackedKernel):
        def describe(self) -> dict[str, object]:
            return {"kernel": "owned", "threads": 3}

        def close(self) -> None:
            closed.append(1)

    owned = Owned(lambda x, w: x, torch.float32)
    assert isinstance(owned, DescribedHostKernel) and isinstance(owned, ClosableHostKernel)
    assert kernel_detail(owned) == {"kernel": "owned", "threads": 3}
    _close_kernel(owned)
    assert closed == [1]


@pytest.mark.parametrize("fmt", ["out_in", "fp32_in_out"])
def test_auto_keeps_the_chosen_formats_timed_sample_unchanged(
    fmt: str,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one candidate, so the choice is known: the copy `auto` builds from the
    # timed sample plus the rest equals one prepared in a single pass
    from pdflash.hybrid import prepare

    monkeypatch.setattr(prepare, "AUTO_CANDIDATES", (fmt,))
    monkeypatch.setattr(prepare, "SAMPLE_BYTES", 1)  # a sample of 2 x workers experts
    ad = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    hw = host_weights_for(ad, "auto", workers=2, budget_bytes=1 << 34)
    assert hw.format == fmt and hw.sample_reused == 4
    assert hw.describe()["sample_reused"] == 4
    kernel = host_kernel_for(ad, fmt)
    assert kernel is not None
    ids = ad.store.packed_ids().tolist()
    assert len(ids) > hw.sample_reused  # some experts were prepared after the choice
    whole = prepare_all(kernel, ad.store.views, ids)
    assert whole is not None and hw.nbytes == whole.nbytes
    for g, want in zip(ids, whole.experts, strict=True):
        got = hw.weights_of(g)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("fmt", ["out_in", "fp32_in_out"])
def test_preparing_with_threads_gives_the_same_weights(
    fmt: str,
    device: str | None,
    mxfp4_checkpoint: Path,
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "THREADED_PREPARE_BYTES", 0)  # tiny experts: threaded too
    ad = load_adapter(mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2)
    kernel = host_kernel_for(ad, fmt)
    assert kernel is not None
    ids = list(range(ad.store.num_ids))[::-1]  # any order: index = position
    one = prepare_all(kernel, ad.store.views, ids, device=device)
    many = prepare_all(kernel, ad.store.views, ids, device=device, threads=3)
    assert one is not None and many is not None
    assert many.nbytes == one.nbytes and len(many.experts) == len(ids)
    for a, b in zip(one.experts, many.experts, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the budget is still checked after the first expert
    over = one.nbytes - 1
    assert (
        prepare_all(kernel, ad.store.views, ids, budget_bytes=over, device=device, threads=3)
        is None
    )
    with pytest.raises(ValueError, match="threads"):
        prepare_all(kernel, ad.store.views, ids, threads=0)


class _Off:
    """A host kernel whose outputs are ``factor`` times its inner kernel's
    (a kernel that the CPU or the compiler runs wrongly)."""

    def __init__(self, inner: kernels.HostKernel, factor: float) -> None:
        self.inner, self.factor = inner, factor
        self.name, self.dtype = inner.name, inner.dtype

    def prepare(self, views: kernels.Weights) -> kernels.Weights:
        return self.inner.prepare(views)

    def forward(self, x: torch.Tensor, w: kernels.Weights) -> torch.Tensor:
        return self.inner.forward(x, w) * self.factor

    def forward_many(self, x, ws, bounds, out) -> None:  # type: ignore[no-untyped-def]
        kernels._loop_many(self.forward, x, ws, kernels.check_forward_many(x, ws, bounds, out), out)


@pytest.mark.parametrize("factor", [1.2, float("nan")])
def test_a_format_whose_outputs_disagree_is_never_used(
    factor: float,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdflash.hybrid import prepare

    real = prepare.host_kernel_for

    def off_out_in(adapter: object, fmt: str) -> object:
        k = real(adapter, fmt)
        return _Off(k, factor) if fmt == "out_in" and k is not None else k

    monkeypatch.setattr(prepare, "host_kernel_for", off_out_in)
    monkeypatch.setattr(prepare, "AUTO_CANDIDATES", ("out_in", "fp32_out_in"))
    ad = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    hw = host_weights_for(ad, "auto", budget_bytes=1 << 34)
    assert hw.format == "fp32_out_in"  # the only candidate that agrees
    why = hw.candidates["out_in"]
    assert isinstance(why, str) and "differ from the adapter's expert function" in why
    assert isinstance(hw.candidates["fp32_out_in"], float)
    with pytest.raises(ValueError, match="host format 'out_in': its outputs differ"):
        host_weights_for(ad, "out_in", budget_bytes=1 << 34)
    # a rounding-sized difference is within the bound: 1.01 passes by name
    monkeypatch.setattr(prepare, "host_kernel_for", lambda a, f: _Off(real(a, f), 1.01))
    assert host_weights_for(ad, "out_in", budget_bytes=1 << 34).format == "out_in"
