"""The one-launch RMSNorm (:mod:`pdflash.models.rmsnorm_triton`, used on CUDA
with ``PDFLASH_FUSED_NORM=on``) against transformers' modules, on the CPU
through Triton's interpreter (skips where triton is not installed): within an
ulp of the module's output in bf16 and a few fp32 ulps in fp32 (the mean
sums in another order), every style,
dtype and an odd width; bad arguments named; the setting validated and off
by default; off CUDA the adapters' norm stays on the torch path."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from triton_interpreted import interpreted


@pytest.fixture(scope="module")
def norms() -> ModuleType:
    """The module decorated under ``TRITON_INTERPRET=1``, with the rounding
    helper it imports interpreted too."""
    return interpreted(
        ("pdflash.models.fused_moe_triton", "_fused_moe_for_norms"),
        ("pdflash.models.rmsnorm_triton", "_rmsnorm_interpreted"),
    )


@pytest.mark.parametrize("kind", [Qwen3MoeRMSNorm, GptOssRMSNorm])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [96, 200])
def test_one_launch_norm_is_within_an_ulp_of_the_module(
    norms: ModuleType, kind: type, dtype: torch.dtype, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(hidden)
    norm = kind(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + 1)
    norm = norm.to(dtype)
    x = (torch.randn(3, 5, hidden, generator=gen) * 3).to(dtype)
    style = norms.CAST_THEN_WEIGHT if kind is Qwen3MoeRMSNorm else norms.WEIGHT_THEN_CAST
    with torch.no_grad():
        want = norm(x)
        got = norms.rms_norm_rows(x, norm.weight, norm.variance_epsilon, style)
    assert got.shape == x.shape and got.dtype == want.dtype == dtype
    # relative: one bf16 step; in fp32 the mean's other summation order and
    # rsqrt move the result by a few fp32 ulps (2^-23 each)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
    assert float(err.max()) <= ulp, float(err.max())
    if dtype == torch.bfloat16:  # most entries the same bits, the rest one step apart
        assert float((got == want).float().mean()) > 0.9
    # non-contiguous rows (a column slice) and no rows
    wide = torch.cat([x, x], dim=-1)[..., :hidden]
    with torch.no_grad():
        assert torch.equal(
            norms.rms_norm_rows(wide, norm.weight, norm.variance_epsilon, style), got
        )
        empty = x[:0]
        assert (
            norms.rms_norm_rows(empty, norm.weight, norm.variance_epsilon, style).shape
            == empty.shape
        )


def test_one_launch_norm_names_what_it_cannot_take(norms: ModuleType) -> None:
    x = torch.randn(2, 8)
    w = torch.ones(8)
    cases = [
        ((x.half(), w.half(), 0), "bf16 or fp32 rows"),
        ((x, torch.ones(7), 0), "weight must be"),
        ((x, w.double(), 1), "weight must be bf16 or fp32"),
        ((x.bfloat16(), w, norms.CAST_THEN_WEIGHT), "weight of the rows' dtype"),
        ((x, w, 2), "style must be"),
    ]
    for (xs, ws, style), match in cases:
        with pytest.raises(ValueError, match=match):
            norms.rms_norm_rows(xs, ws, 1e-5, style)


def test_fused_norm_setting_is_on_by_default_and_validated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdflash.models.adapters import _norms

    monkeypatch.delenv("PDFLASH_FUSED_NORM", raising=False)
    assert _norms.fused_norm_setting() == "on"
    monkeypatch.setenv("PDFLASH_FUSED_NORM", "off")
    assert _norms.fused_norm_setting() == "off"
    monkeypatch.setenv("PDFLASH_FUSED_NORM", "on")
    # off CUDA the switch changes nothing: the torch path, the module's bits
    norm = GptOssRMSNorm(16, eps=1e-5).to(torch.bfloat16)
    x = torch.randn(4, 16).bfloat16()
    with torch.no_grad():
        assert torch.equal(_norms.rms_norm(norm, x), norm(x))
    monkeypatch.setenv("PDFLASH_FUSED_NORM", "yes")
    with pytest.raises(ValueError, match="PDFLASH_FUSED_NORM must be one of"):
        _norms.fused_norm_setting()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [Qwen3MoeRMSNorm, GptOssRMSNorm])
def test_fused_norm_on_cuda_within_a_bf16_step_of_the_module(
    kind: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapters' norm with ``PDFLASH_FUSED_NORM=on`` on CUDA at a
    published width (gpt-oss-20b's 2880), 256 rows of bf16: one launch,
    within two bf16 steps of the module (Qwen3's module rounds twice: a
    one-step difference in the normalized value's cast can grow by the
    weight product's rounding), most values equal."""
    pytest.importorskip("triton")
    from pdflash.models.adapters import _norms

    monkeypatch.setenv("PDFLASH_FUSED_NORM", "on")
    gen = torch.Generator().manual_seed(3)
    norm = kind(2880, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2880, generator=gen) * 0.5 + 1)
    norm = norm.to("cuda", torch.bfloat16)
    x = (torch.randn(256, 2880, generator=gen) * 3).to("cuda", torch.bfloat16)
    with torch.no_grad():
        want = norm(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = _norms.rms_norm(norm, x)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_rms_norm_kernel"], kernels
    err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
    assert float(err.max()) <= 2.0**-6
    assert float((got == want).float().mean()) > 0.9
