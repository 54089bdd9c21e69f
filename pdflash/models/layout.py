"""How one expert's weights are named in a checkpoint and packed in memory.

An architecture adapter describes its experts with two things:

* an :class:`ExpertLayout` — the packed tensors of one expert (names, shapes),
  laid out back to back in one byte buffer so that one H2D copy moves one
  expert into one cache slot, and views unpack a slot without copies;
* one or more :class:`ExpertFormat` — how a checkpoint stores those tensors
  (the Hugging Face hub layout with one tensor per expert, the transformers 5
  fused 3-D layout, gpt-oss MXFP4 blocks/scales, ...). The store picks the
  first format whose tensors the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: Byte alignment of every packed component and of the expert stride. 256 B
#: keeps every view aligned for vectorised GEMM loads and DMA.
ALIGN_BYTES = 256

#: MXFP4 (e2m1) code -> value, as in the OCP microscaling spec (and
#: transformers.integrations.mxfp4.FP4_VALUES).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class ComponentSpec:
    """One packed tensor of an expert (e.g. ``gate_up`` ``[2I, H]``)."""

    name: str
    shape: tuple[int, ...]


class ExpertLayout:
    """The packed byte layout of one expert in ``dtype``.

    Components are stored in order, each starting at a multiple of
    :data:`ALIGN_BYTES`; :attr:`nbytes` (the size of one copy and of one
    cache slot) is padded to that alignment too.
    """

    def __init__(self, components: Sequence[ComponentSpec], dtype: torch.dtype) -> None:
        if not components:
            raise ValueError("an expert layout needs at least one component")
        self.components = tuple(components)
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets: dict[str, int] = {}
        numels: dict[str, int] = {}
        offset = 0
        for comp in self.components:
            if comp.name in offsets:
                raise ValueError(f"duplicate expert component {comp.name!r}")
            numel = 1
            for d in comp.shape:
                numel *= int(d)
            offsets[comp.name] = offset
            numels[comp.name] = numel
            offset = _align(offset + numel * itemsize)
        self.offsets = offsets
        self.numels = numels
        self.itemsize = itemsize
        self.nbytes = offset

    def shape(self, name: str) -> tuple[int, ...]:
        for comp in self.components:
            if comp.name == name:
                return comp.shape
        raise KeyError(name)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of one packed expert in ``buf`` (a 1-D uint8 tensor of
        at least :attr:`nbytes` bytes, on any device). No copies."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(
                f"expert buffer must be 1-D uint8 with >= {self.nbytes} bytes, "
                f"got {buf.dtype} shape {tuple(buf.shape)}"
            )
        out: dict[str, torch.Tensor] = {}
        for comp in self.components:
            start = self.offsets[comp.name]
            nbytes = self.numels[comp.name] * self.itemsize
            out[comp.name] = buf[start : start + nbytes].view(self.dtype).view(comp.shape)
        return out


@dataclass(frozen=True)
class SourcePart:
    """Where (part of) one packed component comes from in a checkpoint.

    ``checkpoint[key][index]`` (or the whole tensor when ``index`` is None)
    must have shape ``shape``; it lands in rows ``row_offset:`` of the
    component. ``transform="mxfp4"`` reads MXFP4 ``blocks`` (``key``) and
    ``scales`` (``scales_key``), dequantizes and transposes them (gpt-oss).
    """

    key: str
    component: str
    shape: tuple[int, ...]
    index: int | None = None
    row_offset: int = 0
    transform: str | None = None
    scales_key: str | None = None


@dataclass(frozen=True)
class ExpertFormat:
    """One checkpoint naming of an architecture's experts."""

    name: str
    parts: Callable[[int, int], list[SourcePart]]  # (layer, expert) -> parts
    quantized: bool = False  # the stored dtype is not the packed dtype


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """MXFP4 ``blocks [R, G, 16]`` (uint8, two e2m1 codes per byte, low nibble
    first) and ``scales [R, G]`` (uint8 e8m0, bias 127) -> ``[R, G * 32]``.

    Same arithmetic as transformers' ``convert_moe_packed_tensors`` (before its
    final transpose); the tests check it against that function.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    rows, groups = int(scales.shape[0]), int(scales.shape[1])
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(rows * groups, 32, dtype=dtype)
    flat = blocks.reshape(rows * groups, 16)
    out[:, 0::2] = lut[(flat & 0x0F).long()]
    out[:, 1::2] = lut[(flat >> 4).long()]
    exp = scales.reshape(rows * groups, 1).to(torch.int32) - 127
    torch.ldexp(out, exp, out=out)
    return out.reshape(rows, groups * 32)
