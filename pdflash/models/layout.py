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

import os
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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class ComponentSpec:
    """One packed tensor of an expert (e.g. ``gate_up`` ``[2I, H]``).

    ``dtype`` overrides the layout's dtype for this component (e.g. uint8
    MXFP4 blocks and scales beside bf16 biases)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


class ExpertLayout:
    """The packed byte layout of one expert; ``dtype`` is the compute dtype
    and the storage dtype of every component that does not name its own.

    Components are stored in order, each starting at a multiple of
    :data:`ALIGN_BYTES`; :attr:`nbytes` (the size of one copy and of one
    cache slot) is padded to that alignment too. ``format`` names how the
    experts are stored (``dense``, ``mxfp4``, ``fp8``), for reports.
    """

    def __init__(
        self, components: Sequence[ComponentSpec], dtype: torch.dtype, format: str = "dense"
    ) -> None:
        if not components:
            raise ValueError("an expert layout needs at least one component")
        self.components = tuple(components)
        self.dtype = dtype
        self.format = format
        offsets: dict[str, int] = {}
        numels: dict[str, int] = {}
        dtypes: dict[str, torch.dtype] = {}
        offset = 0
        for comp in self.components:
            if comp.name in offsets:
                raise ValueError(f"duplicate expert component {comp.name!r}")
            numel = 1
            for d in comp.shape:
                numel *= int(d)
            cdt = comp.dtype if comp.dtype is not None else dtype
            offsets[comp.name] = offset
            numels[comp.name] = numel
            dtypes[comp.name] = cdt
            offset = _align(offset + numel * _itemsize(cdt))
        self.offsets = offsets
        self.numels = numels
        self.dtypes = dtypes
        self.itemsize = _itemsize(dtype)
        #: bytes the components need (aligned); :attr:`nbytes` adds padding
        self.natural_nbytes = offset
        self.nbytes = offset

    @property
    def padding_nbytes(self) -> int:
        """Unused bytes at the end of each packed expert (see :meth:`padded`)."""
        return self.nbytes - self.natural_nbytes

    def padded(self, nbytes: int) -> ExpertLayout:
        """This layout with each expert padded to ``nbytes`` (rounded up to
        :data:`ALIGN_BYTES`): copies, cache slots and byte counts then move
        that size while the views read only the components at the front.

        Used to replay a small (e.g. trained proxy) model at a published
        expert size. Raises ``ValueError`` when ``nbytes`` is smaller than
        the components need."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < self.natural_nbytes:
            raise ValueError(
                f"cannot pad an expert of {self.natural_nbytes} bytes down to {nbytes} bytes"
            )
        out = ExpertLayout(self.components, self.dtype, format=self.format)
        out.nbytes = _align(nbytes)
        return out

    def component_nbytes(self, name: str) -> int:
        return self.numels[name] * _itemsize(self.dtypes[name])

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
            nbytes = self.component_nbytes(comp.name)
            out[comp.name] = (
                buf[start : start + nbytes].view(self.dtypes[comp.name]).view(comp.shape)
            )
        return out

    def slab_views(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[slots, *shape]`` views of every component over a slab of packed
        experts (``[slots, nbytes]`` uint8, one expert per row). No copies:
        each view has slot stride ``nbytes`` (a multiple of
        :data:`ALIGN_BYTES`) and the component's own contiguous inner
        strides, which is what a grouped GEMM reads directly."""
        if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] != self.nbytes:
            raise ValueError(
                f"slab must be [slots, {self.nbytes}] uint8, got {slab.dtype} {tuple(slab.shape)}"
            )
        slots = int(slab.shape[0])
        out: dict[str, torch.Tensor] = {}
        for comp in self.components:
            start = self.offsets[comp.name]
            part = slab[:, start : start + self.component_nbytes(comp.name)]
            out[comp.name] = part.view(self.dtypes[comp.name]).view(slots, *comp.shape)
        return out


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_fp8(w: torch.Tensor, out_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2-D) -> (e4m3 values, fp32 scale per output channel along
    ``out_axis``): ``w ~= values * scale``, each channel's largest magnitude
    mapped to :data:`FP8_MAX`."""
    wf = w.float()
    amax = wf.abs().amax(dim=1 - out_axis, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    values = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scale.reshape(-1)


def dequantize_fp8(
    values: torch.Tensor, scale: torch.Tensor, out_axis: int, dtype: torch.dtype
) -> torch.Tensor:
    """``values [..., R, C]`` e4m3, ``scale [..., R or C]`` -> dense ``dtype``."""
    s = scale.unsqueeze(-1) if out_axis == 0 else scale.unsqueeze(-2)
    return (values.to(torch.float32) * s).to(dtype)


def fp8_layout(layout: ExpertLayout, out_axes: dict[str, int]) -> ExpertLayout:
    """``layout`` with each component of ``out_axes`` stored as e4m3 plus an
    fp32 ``<name>_scale`` per output channel (other components unchanged)."""
    comps: list[ComponentSpec] = []
    for c in layout.components:
        if c.name in out_axes:
            comps.append(ComponentSpec(c.name, c.shape, FP8_DTYPE))
            comps.append(
                ComponentSpec(f"{c.name}_scale", (c.shape[out_axes[c.name]],), torch.float32)
            )
        else:
            comps.append(c)
    return ExpertLayout(comps, layout.dtype, format="fp8")


@dataclass(frozen=True)
class SourcePart:
    """Where (part of) one packed component comes from in a checkpoint.

    ``checkpoint[key][index]`` (or the whole tensor when ``index`` is None)
    must have shape ``shape``; it lands in rows ``row_offset:`` of the
    component. ``transform="mxfp4"`` reads MXFP4 ``blocks`` (``key``) and
    ``scales`` (``scales_key``), dequantizes and transposes them (gpt-oss);
    ``transform="fp8_rows"`` / ``"fp8_cols"`` quantizes the tensor to e4m3
    with one scale per row / column (the output channels), written to the
    component and its ``<component>_scale``.
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


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if (
        blocks.dim() < 3
        or tuple(blocks.shape[:-1]) != tuple(scales.shape)
        or blocks.shape[-1] != 16
    ):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    if blocks.device != scales.device:
        raise ValueError(f"MXFP4 blocks on {blocks.device} but scales on {scales.device}")


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """MXFP4 ``blocks [..., R, G, 16]`` (uint8, two e2m1 codes per byte, low
    nibble first) and ``scales [..., R, G]`` (uint8 e8m0, bias 127) ->
    ``[..., R, G * 32]`` on the blocks' device.

    Same arithmetic as transformers' ``convert_moe_packed_tensors`` (before its
    final transpose); the tests check it against that function. CUDA tensors
    go through the one-pass Triton kernel when :func:`mxfp4_dequantizer` says
    so (bit-identical to the torch path), everything else through
    :func:`dequantize_mxfp4_torch`.
    """
    _check_mxfp4(blocks, scales)
    if dtype in _TRITON_DTYPES and blocks.device.type == "cuda" and _use_triton(blocks.device):
        from pdflash.models.mxfp4_triton import dequantize_mxfp4_triton

        _DEQUANT_CALLS["triton"] += 1
        return dequantize_mxfp4_triton(blocks, scales, dtype)
    _DEQUANT_CALLS["torch"] += 1
    return dequantize_mxfp4_torch(blocks, scales, dtype)


def dequantize_mxfp4_torch(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_mxfp4` in plain torch (any device)."""
    _check_mxfp4(blocks, scales)
    lead = tuple(int(d) for d in scales.shape[:-1])
    groups = int(scales.shape[-1])
    # NOTE: one gather through a 256-entry byte -> (low, high) value table
    # writes both codes of a byte interleaved (low nibble first), then one
    # multiply applies the scale: two passes over the output. 2^(s-127) is a
    # power of two, exact in fp32 and bf16, so the product is the same value
    # transformers' ldexp gives.
    lut = _byte_table(dtype, blocks.device)
    out = lut.index_select(0, blocks.reshape(-1).long()).view(-1, 32)
    factor = _e8m0_to_float32(scales.reshape(-1, 1)).to(dtype)
    out.mul_(factor)
    return out.reshape(*lead, groups * 32)


#: ``PDFLASH_MXFP4_DEQUANT`` / :func:`set_mxfp4_dequantizer` values.
MXFP4_DEQUANTIZERS = ("auto", "torch", "triton")
_DEQUANT_CALLS = {"triton": 0, "torch": 0}
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel writes
_dequant_mode: str | None = None  # None: read PDFLASH_MXFP4_DEQUANT on first use
# CUDA device -> None (the Triton kernel runs and agrees) or why it cannot be used
_TRITON_PROBES: dict[str, str | None] = {}


def set_mxfp4_dequantizer(mode: str) -> None:
    """How CUDA MXFP4 tensors are dequantized: ``auto`` (the Triton kernel
    where ``triton`` imports and the kernel compiles and agrees with the torch
    path on the current device, torch otherwise), ``torch``, or ``triton``
    (never falls back: a clear error here when it cannot run). CPU tensors
    always take the torch path. The default comes from the environment
    variable ``PDFLASH_MXFP4_DEQUANT`` (``auto`` when unset)."""
    if mode not in MXFP4_DEQUANTIZERS:
        raise ValueError(f"MXFP4 dequantizer must be one of {MXFP4_DEQUANTIZERS}, got {mode!r}")
    if mode == "triton":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the Triton MXFP4 dequantizer needs a CUDA device; none is available"
            )
        reason = _triton_unavailable(torch.device("cuda", torch.cuda.current_device()))
        if reason is not None:
            raise RuntimeError(f"the Triton MXFP4 dequantizer cannot run: {reason}")
    global _dequant_mode
    _dequant_mode = mode


def _mode() -> str:
    global _dequant_mode
    if _dequant_mode is None:
        mode = os.environ.get("PDFLASH_MXFP4_DEQUANT", "auto")
        if mode not in MXFP4_DEQUANTIZERS:
            raise ValueError(
                f"PDFLASH_MXFP4_DEQUANT must be one of {MXFP4_DEQUANTIZERS}, got {mode!r}"
            )
        _dequant_mode = mode
    return _dequant_mode


def mxfp4_dequantizer(device: torch.device | str = "cuda") -> str:
    """``"triton"`` or ``"torch"``: what :func:`dequantize_mxfp4` runs for
    tensors on ``device`` (see :func:`set_mxfp4_dequantizer`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return "triton" if device.type == "cuda" and _use_triton(device) else "torch"


def mxfp4_triton_unavailable(device: torch.device | str = "cuda") -> str | None:
    """Why the Triton kernel is not used on ``device`` (None: it is usable)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the Triton kernel runs on CUDA devices, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _triton_unavailable(device)


def mxfp4_dequant_calls() -> dict[str, int]:
    """How many :func:`dequantize_mxfp4` calls each path ran in this process."""
    return dict(_DEQUANT_CALLS)


def _use_triton(device: torch.device) -> bool:
    mode = _mode()
    if mode == "torch":
        return False
    reason = _triton_unavailable(device)
    if reason is not None and mode == "triton":
        raise RuntimeError(f"the Triton MXFP4 dequantizer was requested but cannot run: {reason}")
    return reason is None


def _triton_unavailable(device: torch.device) -> str | None:
    """Import the kernel and run it once on ``device`` over every byte value
    and the edge scales, against the torch path (cached per device)."""
    key = str(device)
    if key not in _TRITON_PROBES:
        _TRITON_PROBES[key] = _probe_triton(device)
    return _TRITON_PROBES[key]


def _probe_triton(device: torch.device) -> str | None:
    try:
        from pdflash.models.mxfp4_triton import dequantize_mxfp4_triton
    except Exception as exc:  # not installed, or an install that does not load
        return f"triton does not import ({type(exc).__name__}: {exc})"
    try:
        blocks = torch.arange(256, dtype=torch.uint8, device=device).view(2, 8, 16)
        scales = torch.tensor(
            [[0, 1, 100, 126, 127, 128, 200, 254]] * 2, dtype=torch.uint8, device=device
        )
        # fp16: scales it represents (beyond them both paths give inf/NaN)
        for dtype, s in (
            (torch.bfloat16, scales),
            (torch.float32, scales),
            (torch.float16, scales.clamp(103, 142)),
        ):
            got = dequantize_mxfp4_triton(blocks, s, dtype)
            want = dequantize_mxfp4_torch(blocks, s, dtype)
            if not torch.equal(got, want) or not torch.equal(got.signbit(), want.signbit()):
                return f"the Triton kernel disagrees with the torch path in {dtype} on {device}"
    except Exception as exc:  # any compile or launch failure means: not usable here
        return f"the Triton kernel failed on {device}: {type(exc).__name__}: {exc}"
    return None


def _e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """``2^(s - 127)`` for uint8 ``s``, built from its fp32 bits: exact on every
    device (CUDA's ``exp2`` rounds the subnormal ``2^-127`` of ``s = 0``)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    return bits.view(torch.float32)


_BYTE_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 2]``: the e2m1 values of a byte's low and high nibble."""
    key = (dtype, str(device))
    table = _BYTE_TABLES.get(key)
    if table is None:
        values = torch.tensor(FP4_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        pairs = torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1)
        table = _BYTE_TABLES[key] = pairs.to(device=device, dtype=dtype)
    return table
