"""The loader's fast paths keep the old results: the finiteness check
(extrema instead of a mask) and the synthetic generator (in-place scaling)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdflash.models.store import CheckpointError, require_finite
from pdflash.models.synthetic import _fill

FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _mask_count(t: torch.Tensor) -> int:
    """The rule the check implements: how many values are NaN or +-Inf."""
    return int((~torch.isfinite(t)).sum())


@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("size", [1, 15, 16, 17, 257, 4099])
def test_require_finite_refuses_every_non_finite_value_wherever_it_is(
    dtype: torch.dtype, bad: float, size: int
) -> None:
    gen = torch.Generator().manual_seed(size)
    base = (torch.randn(size, generator=gen) * 100).to(dtype)
    require_finite(base, Path("f"), "k")  # finite: accepted
    for pos in sorted({0, size // 2, size - 1}):
        t = base.clone()
        t[pos] = bad
        assert _mask_count(t) == 1
        with pytest.raises(CheckpointError, match=r"'k' has 1 non-finite"):
            require_finite(t, Path("f"), "k")
    # a 2-D, non-contiguous view is checked over its own elements only
    if size >= 16:
        m = base.clone().view(-1, 1).expand(size, 2).t()
        require_finite(m, Path("f"), "k")
        t = base.clone()
        t[size - 1] = bad
        with pytest.raises(CheckpointError, match=r"has 2 non-finite"):
            require_finite(t.view(-1, 1).expand(size, 2).t(), Path("f"), "k")


def test_require_finite_counts_every_bad_value_and_skips_what_it_cannot_check() -> None:
    t = torch.zeros(100, dtype=torch.bfloat16)
    t[[3, 50, 99]] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(t.dtype)
    with pytest.raises(CheckpointError, match=r"has 3 non-finite .* of 100"):
        require_finite(t, Path("f"), "k")
    require_finite(torch.empty(0, dtype=torch.float32), Path("f"), "k")
    require_finite(torch.tensor([1, 2, 3]), Path("f"), "k")  # integers: nothing to check
    # float8 has no extrema kernel: the mask path, as before
    e5 = torch.tensor([1.0, 2.0, float("inf")]).to(torch.float8_e5m2)
    require_finite(e5[:2], Path("f"), "k")
    with pytest.raises(CheckpointError, match=r"has 1 non-finite"):
        require_finite(e5, Path("f"), "k")


def _fill_reference(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, fan_in: int
) -> torch.Tensor:
    """The generator as it was written before its scaling went in place."""
    from pdflash.models.synthetic import _seed_of

    gen = torch.Generator(device="cpu")
    gen.manual_seed(_seed_of(seed, name))
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    base = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        x = 1.0 + 0.1 * x
    elif name.endswith("embed_tokens.weight"):
        pass
    elif base.endswith("bias") or base == "sinks":
        x = 0.1 * x
    else:
        x = x / math.sqrt(max(fan_in, 1))
    return x.to(dtype)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.0.self_attn.sinks",
        "model.layers.0.mlp.experts.down_proj",
        "lm_head.weight",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7,), (33, 17), (2, 64, 48)])
def test_generated_values_are_bit_identical_to_the_out_of_place_generator(
    name: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    fan_in = shape[-1]
    got = _fill(name, shape, dtype, 3, "cpu", fan_in)
    want = _fill_reference(name, shape, dtype, 3, fan_in)
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
