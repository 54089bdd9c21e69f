"""The Triton MXFP4 dequantizer against the torch path, bit for bit, on the
CPU through Triton's interpreter (skips where triton is not installed), and
the dispatch between the two (no triton or CUDA needed)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from pdflash.models import layout
from pdflash.models.layout import (
    dequantize_mxfp4,
    dequantize_mxfp4_torch,
    mxfp4_dequant_calls,
    mxfp4_dequantizer,
    mxfp4_triton_unavailable,
    set_mxfp4_dequantizer,
)

# the interpreter runs the kernel in numpy, which warns on the inf/NaN the
# extreme scales (e8m0 255, fp16 overflow) give in both paths
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh copy of the kernel module whose kernels were decorated under
    ``TRITON_INTERPRET=1`` (triton picks the interpreter at decoration time),
    so they run on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.find_spec("pdflash.models.mxfp4_triton")
    assert spec is not None and spec.origin is not None
    fresh = importlib.util.spec_from_file_location("_mxfp4_triton_interpreted", spec.origin)
    assert fresh is not None and fresh.loader is not None
    module = importlib.util.module_from_spec(fresh)
    fresh.loader.exec_module(module)
    return module


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    # NaN (fp16 0 * inf scale, e8m0 255) payloads may differ: same places only
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    ints = _INT_VIEW[want.dtype]
    assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_byte_and_edge_scale_bit_identical(
    interpreted: ModuleType, dtype: torch.dtype
) -> None:
    # every byte value (all 16 codes in both nibbles, both signs of zero) under
    # every scale class: 0 (fp32 subnormal 2^-127), small, 127 (x1), fp16's
    # overflow/underflow edges, 254 (2^127), 255 (inf in the torch path)
    edge = [0, 1, 2, 100, 102, 103, 126, 127, 128, 142, 143, 200, 253, 254, 255]
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(len(edge), 16, 16)
    scales = torch.tensor(edge, dtype=torch.uint8).view(-1, 1).expand(len(edge), 16)
    got = interpreted.dequantize_mxfp4_triton(blocks, scales, dtype)
    want = dequantize_mxfp4_torch(blocks, scales, dtype)
    _assert_same_bits(got, want)
    # the scale-127 row is the e2m1 table itself, low nibble first, signed zeros kept
    row = got[edge.index(127)].reshape(256, 2).float()
    values = torch.tensor(layout.FP4_VALUES)
    codes = torch.arange(256)
    assert torch.equal(row[:, 0], values[codes & 15]) and torch.equal(row[:, 1], values[codes >> 4])
    assert torch.equal(row.signbit(), values[torch.stack((codes & 15, codes >> 4), 1)].signbit())


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (3, 7), (2, 5, 7), (1, 2, 3, 5), (131, 1), (7, 45)],  # [..., R, G]; 131, 315 groups
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_blocks_and_scales_bit_identical(
    interpreted: ModuleType, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    got = interpreted.dequantize_mxfp4_triton(blocks, scales, dtype)
    assert got.shape == (*shape[:-1], shape[-1] * 32)
    _assert_same_bits(got, dequantize_mxfp4_torch(blocks, scales, dtype))
    # realistic scales (as checkpoints hold): no inf or NaN, exact equality
    scales = torch.randint(110, 140, shape, generator=g, dtype=torch.uint8)
    got = interpreted.dequantize_mxfp4_triton(blocks, scales, dtype)
    assert torch.equal(got, dequantize_mxfp4_torch(blocks, scales, dtype))


def test_strided_slab_views_and_gathered_slots(interpreted: ModuleType) -> None:
    # slab-like views: each slot's bytes padded to a stride (not contiguous
    # across slots), then a gathered subset of slots as the grouped path does
    g = torch.Generator().manual_seed(5)
    slots, r, groups = 6, 4, 3
    raw = torch.randint(0, 256, (slots, r * groups * 16 + 64), generator=g, dtype=torch.uint8)
    raw_scales = torch.randint(100, 150, (slots, r * groups + 32), generator=g, dtype=torch.uint8)
    blocks = raw[:, : r * groups * 16].view(slots, r, groups, 16)
    scales = raw_scales[:, : r * groups].view(slots, r, groups)
    assert not blocks.is_contiguous() and not scales.is_contiguous()
    for b, s in ((blocks, scales), (blocks[1::2], scales[1::2])):
        got = interpreted.dequantize_mxfp4_triton(b, s, torch.bfloat16)
        assert torch.equal(got, dequantize_mxfp4_torch(b, s, torch.bfloat16))
    picked = torch.tensor([4, 0, 3])
    b, s = blocks.index_select(0, picked), scales.index_select(0, picked)
    got = interpreted.dequantize_mxfp4_triton(b, s, torch.bfloat16)
    assert torch.equal(got, dequantize_mxfp4_torch(b, s, torch.bfloat16))


def test_empty_and_unsupported_dtype(interpreted: ModuleType) -> None:
    blocks = torch.zeros((0, 3, 16), dtype=torch.uint8)
    scales = torch.zeros((0, 3), dtype=torch.uint8)
    got = interpreted.dequantize_mxfp4_triton(blocks, scales, torch.bfloat16)
    assert got.shape == (0, 96) and got.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        interpreted.dequantize_mxfp4_triton(blocks, scales, torch.float64)


# --- dispatch (no triton or CUDA needed) -------------------------------------


@pytest.fixture
def restore_mode() -> Iterator[None]:
    mode, probes = layout._dequant_mode, dict(layout._TRITON_PROBES)
    yield
    layout._dequant_mode = mode
    layout._TRITON_PROBES.clear()
    layout._TRITON_PROBES.update(probes)


def test_cpu_tensors_take_the_torch_path(restore_mode: None) -> None:
    assert mxfp4_dequantizer("cpu") == "torch"
    assert "CUDA" in (mxfp4_triton_unavailable("cpu") or "")
    before = mxfp4_dequant_calls()
    blocks = torch.randint(0, 256, (2, 3, 16), dtype=torch.uint8)
    scales = torch.full((2, 3), 127, dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(out, dequantize_mxfp4_torch(blocks, scales, torch.float32))
    after = mxfp4_dequant_calls()
    assert after["torch"] == before["torch"] + 1 and after["triton"] == before["triton"]


def test_bad_modes_and_forced_triton_without_it_raise(
    restore_mode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="must be one of"):
        set_mxfp4_dequantizer("fast")
    layout._dequant_mode = None
    monkeypatch.setenv("PDFLASH_MXFP4_DEQUANT", "fast")
    with pytest.raises(ValueError, match="PDFLASH_MXFP4_DEQUANT"):
        mxfp4_dequantizer("cuda:0")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            set_mxfp4_dequantizer("triton")
    # a CUDA device where the kernel is unusable: auto falls back (and says
    # so), a forced Triton path refuses rather than falling back silently
    layout._TRITON_PROBES["cuda:0"] = "triton does not import (test)"
    cuda0 = torch.device("cuda", 0)
    layout._dequant_mode = "auto"
    assert mxfp4_dequantizer(cuda0) == "torch"
    layout._dequant_mode = "triton"
    with pytest.raises(RuntimeError, match="requested but cannot run: triton does not import"):
        mxfp4_dequantizer(cuda0)
    layout._TRITON_PROBES["cuda:0"] = None
    assert mxfp4_dequantizer(cuda0) == "triton"
    layout._dequant_mode = "torch"
    assert mxfp4_dequantizer(cuda0) == "torch"
    set_mxfp4_dequantizer("auto")
    assert layout._dequant_mode == "auto"
