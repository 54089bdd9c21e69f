"""How the grouped path multiplies by compressed (MXFP4, FP8) slab experts.

Two paths compute the same MLP:

* ``fused``: :class:`FusedSlabMLP`, two Triton launches per layer (gate/up
  with bias and activation in the epilogue, then down with bias) that read
  the compressed slab directly and dequantize in registers
  (:mod:`pdflash.models.fused_moe_triton`). CUDA only (the CPU runs it only
  under Triton's interpreter, in tests).
* ``dequant``: gather the used slots, dequantize them to the compute dtype
  (:func:`pdflash.models.layout.dequantize_mxfp4`,
  :func:`~pdflash.models.layout.dequantize_fp8`), then torch's grouped GEMM.

The setting comes from :func:`set_compressed_gemm` or the environment
variable ``PDFLASH_COMPRESSED_GEMM`` (``auto`` when unset), read once per
adapter build (one mode per process unless changed):

* ``auto`` (default): ``fused`` where it can run (a CUDA device, triton
  imports, and the kernel's first-use probe agrees with
  dequantize-then-matmul), ``dequant`` otherwise; :func:`choose_compressed_gemm`
  says which and why (engine rows: ``compressed_gemm`` and
  ``compressed_gemm_reason``).
* ``fused`` forces the kernel and never falls back silently: where it cannot
  run, building the adapter raises :class:`FusedGemmUnavailableError` naming why.
* ``dequant`` forces the dequantize-first path.

MXFP4 tiles with bf16 activations are multiplied as
``PDFLASH_FUSED_MXFP4_DOT`` says (fp32 activations always take
``registers``):

* ``cuda``: the hand-written CUDA kernel
  (:func:`pdflash.models.mxfp4_cuda_gemm.grouped_mxfp4_gemm`,
  ``cuda/src/mxfp4_moe_gemm.cu``; the tile map stays Triton's; its variant
  per block_m: :func:`~pdflash.models.mxfp4_cuda_gemm.pick_variant`, the
  wgmma one at block_m 64 on sm_90a unless ``PDFLASH_MXFP4_CUDA_BM64=mma``).
  The default on a CUDA device where ``pdflash_native._mxfp4gemm`` was built
  with the kernel and its first-use probe (of the variants it will use)
  agrees with dequantize-then-matmul.
* ``scaled``: ``tl.dot_scaled`` (the default on CUDA where ``cuda`` cannot
  run, the reason recorded; the register variant slows down sharply at a
  few hundred rows).
* ``registers``: values built from bits, then ``tl.dot`` (the default off
  CUDA, where only Triton's interpreter runs the kernel and it has no
  ``tl.dot_scaled``).

A ``cuda`` set in the environment that cannot run is an error
(:class:`FusedGemmUnavailableError` where the fused path would run), never
a silent fallback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pdflash.models.fused_moe_triton import RowPlan

#: the settings; ``auto`` resolves to ``fused`` or ``dequant`` per device
COMPRESSED_GEMM_MODES = ("auto", "dequant", "fused")
_mode: str | None = None  # None: read PDFLASH_COMPRESSED_GEMM on first use
_PROBES: dict[str, str | None] = {}


class FusedGemmUnavailableError(RuntimeError):
    """``fused`` was asked for where the fused kernel cannot run."""


def set_compressed_gemm(mode: str | None) -> None:
    """``auto``, ``dequant`` or ``fused`` for adapters built from now on
    (None: back to the environment's ``PDFLASH_COMPRESSED_GEMM``)."""
    if mode is not None and mode not in COMPRESSED_GEMM_MODES:
        raise ValueError(
            f"compressed GEMM mode must be one of {COMPRESSED_GEMM_MODES}, got {mode!r}"
        )
    global _mode
    _mode = mode


def compressed_gemm_mode() -> str:
    """The setting adapters use for compressed experts: ``auto``, ``dequant``
    or ``fused`` (see the module docstring)."""
    if _mode is not None:
        return _mode
    mode = os.environ.get("PDFLASH_COMPRESSED_GEMM", "auto") or "auto"
    if mode not in COMPRESSED_GEMM_MODES:
        raise ValueError(
            f"PDFLASH_COMPRESSED_GEMM must be one of {COMPRESSED_GEMM_MODES}, got {mode!r}"
        )
    return mode


#: ``PDFLASH_FUSED_MXFP4_DOT`` values: how the fused kernel multiplies MXFP4
#: tiles (see :class:`FusedSlabMLP`).
MXFP4_DOTS = ("registers", "scaled", "cuda")


def fused_mxfp4_dot_choice(device: torch.device | str | None = None) -> tuple[str, str]:
    """The MXFP4 dot and why: ``PDFLASH_FUSED_MXFP4_DOT`` when set; unset,
    ``cuda`` on a CUDA ``device`` where the CUDA kernel runs and its probe
    agrees (:func:`fused_gemm_unavailable`), else ``scaled`` there (the
    reason says why not ``cuda``), and ``registers`` off CUDA (the
    interpreter; no device)."""
    dot = os.environ.get("PDFLASH_FUSED_MXFP4_DOT", "")
    if dot:
        if dot not in MXFP4_DOTS:
            raise ValueError(f"PDFLASH_FUSED_MXFP4_DOT must be one of {MXFP4_DOTS}, got {dot!r}")
        return dot, f"PDFLASH_FUSED_MXFP4_DOT={dot}"
    if device is None or torch.device(device).type != "cuda":
        return "registers", "default off CUDA"
    why = fused_gemm_unavailable(device, "cuda")
    if why is None:
        return "cuda", "default on CUDA: the CUDA kernel is built and its probe agreed"
    return "scaled", f"default on CUDA where the CUDA kernel cannot run ({why})"


def fused_mxfp4_dot(device: torch.device | str | None = None) -> str:
    """The MXFP4 dot for ``device`` (:func:`fused_mxfp4_dot_choice`)."""
    return fused_mxfp4_dot_choice(device)[0]


def fused_gemm_unavailable(device: torch.device | str, mxfp4_dot: str = "registers") -> str | None:
    """Why the fused kernel (with ``mxfp4_dot``) cannot run on ``device``
    (None: it can). On CUDA it is compiled once and checked against
    dequantize-then-matmul on small MXFP4 and FP8 cases (cached per device).
    The CPU counts only under ``TRITON_INTERPRET=1`` set before triton is
    imported (dry runs; ``registers`` only). ``cuda``: the CUDA kernel
    (:mod:`pdflash.models.mxfp4_cuda_gemm`) must be built and run on the
    device (sm_80+), and its probe covers the variants
    :func:`~pdflash.models.mxfp4_cuda_gemm.pick_variant` picks there at
    block_m 16 and 64 (the cache is per variant pair, so a changed
    ``PDFLASH_MXFP4_CUDA_BM64`` is probed again; a forced ``wgmma`` that
    cannot run raises :class:`~pdflash.models.mxfp4_cuda_gemm.WgmmaUnavailableError`,
    an invalid value ValueError)."""
    if mxfp4_dot not in MXFP4_DOTS:
        raise ValueError(f"mxfp4_dot must be one of {MXFP4_DOTS}, got {mxfp4_dot!r}")
    device = torch.device(device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        if mxfp4_dot == "scaled":
            return "tl.dot_scaled does not run under Triton's interpreter"
        if mxfp4_dot == "cuda":
            return "the CUDA MXFP4 GEMM runs on CUDA devices, not the interpreter"
    elif device.type != "cuda":
        return f"the fused kernel runs on CUDA devices, not {device.type}"
    elif not torch.cuda.is_available():
        return "no CUDA device"
    elif device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = f"{device}/{mxfp4_dot}"
    if mxfp4_dot == "cuda" and device.type == "cuda":
        from pdflash.models.mxfp4_cuda_gemm import pick_variant

        key += f"/variants {pick_variant(16, device)},{pick_variant(64, device)}"
    if key not in _PROBES:
        _PROBES[key] = _probe(device, mxfp4_dot)
    return _PROBES[key]


def _probe(device: torch.device, mxfp4_dot: str) -> str | None:
    if mxfp4_dot == "cuda":
        from pdflash.models.mxfp4_cuda_gemm import unavailable

        why = unavailable(device)
        if why is not None:
            return why
    try:
        from pdflash.models import fused_moe_triton as kernels
    except Exception as exc:  # not installed, or an install that does not load
        return f"triton does not import ({type(exc).__name__}: {exc})"
    try:
        err = probe_error(kernels, device, mxfp4_dot)
    except Exception as exc:  # any compile or launch failure means: not usable here
        return f"the fused kernel failed on {device}: {type(exc).__name__}: {exc}"
    if err is not None:
        return f"the fused kernel disagrees with dequantize-then-matmul on {device}: {err}"
    return None


def probe_error(
    kernels: ModuleType, device: torch.device, mxfp4_dot: str = "registers"
) -> str | None:
    """Run ``kernels`` (the fused module, or an interpreted copy) on a small
    MXFP4 and FP8 case against dequantize-then-matmul in fp32; the first
    disagreement beyond 1e-4 of the largest output, or None. ``scaled``
    (``tl.dot_scaled`` takes bf16 activations) and ``cuda`` (the CUDA
    kernel, :func:`~pdflash.models.mxfp4_cuda_gemm.grouped_mxfp4_gemm`, at
    block_m 16 and 64, each with the variant
    :func:`~pdflash.models.mxfp4_cuda_gemm.pick_variant` picks on ``device``:
    at 64 the wgmma one where it runs): the MXFP4 case with bf16 activations
    (exact in fp32), within one bf16 rounding (2^-8)."""
    from pdflash.models.layout import dequantize_mxfp4_torch, quantize_fp8

    g = torch.Generator().manual_seed(0)
    slots, n, k = 3, 48, 96
    blocks = torch.randint(0, 256, (slots, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (slots, n, k // 32), generator=g, dtype=torch.uint8)
    dense = torch.randn(slots, n, k, generator=g)
    q = [quantize_fp8(dense[s], 0) for s in range(slots)]
    values, fp8_scales = torch.stack([v for v, _ in q]), torch.stack([s for _, s in q])
    x = torch.randn(5, k, generator=g)
    key = torch.tensor([0, 0, 2, 2, 2, 3])  # slot 1 empty, one masked row
    x_rows = torch.tensor([0, 1, 2, 3, 4, 0])
    mxfp4 = (
        kernels.SlabWeight("mxfp4", blocks, scales),
        dequantize_mxfp4_torch(blocks, scales, torch.float32),
    )
    fp8 = (kernels.SlabWeight("fp8", values, fp8_scales), values.float() * fp8_scales[..., None])
    cases: list[tuple[Any, torch.Tensor]] = [mxfp4, fp8]
    rel = 1e-4
    block_ms = [16]
    if mxfp4_dot in ("scaled", "cuda"):
        x, cases, rel = x.bfloat16(), [mxfp4], 2.0**-8
    if mxfp4_dot == "cuda":
        block_ms = [16, 64]
    for block_m in block_ms:
        slot, start, end = (t.to(device) for t in tile_map(key, slots, block_m, slots))
        tiles = (slot, start, end)
        for w, dense_w in cases:
            w = kernels.SlabWeight(w.fmt, w.data.to(device), w.scale.to(device))
            variant = None
            if mxfp4_dot == "cuda":
                from pdflash.models.mxfp4_cuda_gemm import grouped_mxfp4_gemm, pick_variant

                variant = pick_variant(block_m, device)
                got = grouped_mxfp4_gemm(
                    x.to(device), x_rows.to(device), tiles, block_m, w, variant=variant
                )
            else:
                got = kernels.grouped_qgemm(
                    x.to(device), x_rows.to(device), tiles, block_m, w, mxfp4_dot=mxfp4_dot
                )
            want = torch.einsum("rk,rnk->rn", x[x_rows[:5]].float(), dense_w[key[:5]])
            err = float((got[:5].cpu().float() - want).abs().max())
            if not err <= rel * max(1.0, float(want.abs().max())):
                which = f", variant {variant}" if variant is not None else ""
                return f"{w.fmt} (block_m {block_m}{which}): max abs error {err:.3g}"
    return None


def pick_block_m(rows: int, max_groups: int) -> int:
    """BLOCK_M for ``rows`` sorted rows over at most ``max_groups`` groups:
    1.5x the mean rows per used group (routed counts spread around the mean),
    rounded up to 16/32/64. Each tile of a group dequantizes that group's
    weights again, so fewer, fuller tiles save work; tl.dot's smallest M is
    16, and 64 keeps two fp32 accumulators in registers."""
    typical = 1.5 * rows / max(1, min(max_groups, rows))
    return 16 if typical <= 16 else 32 if typical <= 32 else 64


def tile_map(
    key_sorted: torch.Tensor, width: int, block_m: int, max_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile map's reference (plain torch; the kernels module builds the
    same tiles in two launches). Cut rows sorted by group key (``key_sorted [n]``, keys in
    ``[0, width]``; ``width`` = a masked row, sorted last) into tiles of at
    most ``block_m`` rows of one group each. Returns int32 ``slot``,
    ``start``, ``end`` per tile over a fixed count ``cdiv(n, block_m) +
    min(width, n, max_groups)`` (an upper bound known without reading the
    routing; ``max_groups`` bounds the distinct keys, e.g. the layer's
    experts); tiles past the last live one have slot -1."""
    if width < 1 or block_m < 1:
        raise ValueError(f"tile_map needs width >= 1 and block_m >= 1, got {width}, {block_m}")
    n = int(key_sorted.numel())
    device = key_sorted.device
    bound = -(-n // block_m) + min(width, n, max(0, max_groups))
    groups = torch.arange(width, device=device, dtype=key_sorted.dtype)
    starts = torch.searchsorted(key_sorted, groups, right=False)
    ends = torch.searchsorted(key_sorted, groups, right=True)
    tiles = (ends - starts + block_m - 1) // block_m  # per group
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(bound, device=device, dtype=tile_ends.dtype)
    g = torch.searchsorted(tile_ends, t, right=True)  # each tile's group (width: past the end)
    gc = g.clamp(max=width - 1)
    start = starts[gc] + (t - (tile_ends[gc] - tiles[gc])) * block_m
    slot = torch.where(g < width, gc, -1)
    return slot.to(torch.int32), start.to(torch.int32), ends[gc].to(torch.int32)


def _kernels() -> ModuleType:
    from pdflash.models import fused_moe_triton

    return fused_moe_triton


class FusedSlabMLP:
    """An expert MLP over the compressed slab in two fused launches.

    ``fmt``: ``mxfp4`` (gpt-oss's released layout: ``gate_up_blocks``/
    ``_scales``, ``down_blocks``/``_scales``, rows = output channels) or
    ``fp8`` (``gate_up``/``down`` e4m3 with ``<name>_scale``; ``out_axis``
    says which axis of the packed ``[R, C]`` weight is the output channel).
    ``act``: ``gptoss`` (gate/up interleaved, biases, clamped SwiGLU with
    ``alpha``/``limit``) or ``silu`` (gate rows then up rows, no biases).
    ``mxfp4_dot``: ``registers`` (values built from bits in registers, then
    ``tl.dot``; runs under the interpreter), ``scaled`` (``tl.dot_scaled``,
    Triton's own MXFP4 upcast) or ``cuda`` (the CUDA kernel,
    :func:`pdflash.models.mxfp4_cuda_gemm.grouped_mxfp4_gemm`); ``scaled``
    and ``cuda`` take bf16 activations on a GPU, fp32 activations take
    ``registers``.
    ``kernels``: the kernel module (tests pass an interpreted copy)."""

    def __init__(
        self,
        fmt: str,
        act: str,
        *,
        out_axis: int = 0,
        alpha: float = 1.0,
        limit: float = 0.0,
        mxfp4_dot: str = "registers",
        kernels: ModuleType | None = None,
    ) -> None:
        if fmt not in ("mxfp4", "fp8"):
            raise ValueError(f"fused slab MLP formats: mxfp4, fp8; got {fmt!r}")
        if act not in ("gptoss", "silu"):
            raise ValueError(f"fused slab MLP activations: gptoss, silu; got {act!r}")
        if mxfp4_dot not in MXFP4_DOTS:
            raise ValueError(f"mxfp4_dot must be one of {MXFP4_DOTS}, got {mxfp4_dot!r}")
        self.fmt, self.act, self.out_axis = fmt, act, out_axis
        self.mxfp4_dot = mxfp4_dot
        self.alpha, self.limit = alpha, limit
        self.k = kernels if kernels is not None else _kernels()
        self._row_ids: dict[tuple[int, str], torch.Tensor] = {}

    def _weight(self, views: dict[str, torch.Tensor], name: str) -> Any:
        bias = views.get(f"{name}_bias") if self.act == "gptoss" else None
        if self.fmt == "mxfp4":
            return self.k.SlabWeight(
                "mxfp4", views[f"{name}_blocks"], views[f"{name}_scales"], bias
            )
        # the packed [R, C] weight is [S, R, C] in the slab; N is its output axis
        return self.k.SlabWeight(
            "fp8", views[name], views[f"{name}_scale"], bias, n_axis=1 + self.out_axis
        )

    def _rows(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, str(device))
        ids = self._row_ids.get(key)
        if ids is None:
            ids = self._row_ids[key] = torch.arange(n, dtype=torch.int32, device=device)
        return ids

    def forward_slab(
        self,
        x: torch.Tensor,
        x_rows: torch.Tensor,
        key_sorted: torch.Tensor | None,
        width: int,
        views: dict[str, torch.Tensor],
        max_groups: int,
        *,
        plan: RowPlan | None = None,
    ) -> torch.Tensor:
        """``out[r] = mlp(slot key_sorted[r])(x[x_rows[r]])`` for the rows
        sorted by slot key (``width`` = a masked row: its output is left
        unset); ``views``: the slab's ``[width, ...]`` component views;
        ``max_groups`` bounds the distinct keys (the layer's experts).
        ``plan``: the rows' tile map made already (the kernels'
        ``row_plan``; its ``token`` is ``x_rows``, ``key_sorted`` is unused)."""
        k = self.k
        if plan is not None:
            block_m, tiles = plan.block_m, plan.tiles
        elif key_sorted is None:
            raise ValueError("forward_slab needs the rows' sorted keys or their plan")
        else:
            block_m = pick_block_m(int(key_sorted.numel()), max_groups)
            # the kernels' two-launch tile map (same tiles as :func:`tile_map`)
            tiles = k.tile_map(key_sorted, width, block_m, max_groups)
        gate_up = self._weight(views, "gate_up")
        if self.act == "gptoss":
            act, cols = k.ACT_GPTOSS, (0, 1, 2)
        else:
            act, cols = k.ACT_SILU, (0, gate_up.n // 2, 1)
        dot = self.mxfp4_dot if x.dtype == torch.bfloat16 else "registers"
        down = self._weight(views, "down")
        if dot == "cuda" and self.fmt == "mxfp4":
            from pdflash.models import mxfp4_cuda_gemm as cg

            # the first GEMM writes the second's x in the layout the picked
            # variant reads (an MXFP4 width is a multiple of 32, as it needs)
            permuted = cg.reads_chunk_permuted(block_m, x.device)
            layout = cg.CHUNK_PERMUTED if permuted else cg.NATURAL
            h = cg.grouped_mxfp4_gemm(
                x, x_rows, tiles, block_m, gate_up, act=act, gate_up=cols, alpha=self.alpha,
                limit=self.limit, out_layout=layout,
            )  # fmt: skip
            rows = self._rows(int(h.shape[0]), x.device)
            return cg.grouped_mxfp4_gemm(h, rows, tiles, block_m, down, x_layout=layout)
        # FP8 under ``cuda``: the Triton kernel (the dot is for MXFP4 tiles)
        gemm: Callable[..., torch.Tensor] = partial(
            k.grouped_qgemm, mxfp4_dot="registers" if dot == "cuda" else dot
        )
        h = gemm(
            x, x_rows, tiles, block_m, gate_up, act=act, gate_up=cols, alpha=self.alpha,
            limit=self.limit,
        )  # fmt: skip
        rows = self._rows(int(h.shape[0]), x.device)
        return gemm(h, rows, tiles, block_m, down)


#: how each MXFP4 dot is named in a choice's reason
_DOT_NAMES = {
    "registers": "registers + tl.dot",
    "scaled": "tl.dot_scaled",
    "cuda": "the CUDA kernel (pdflash_native._mxfp4gemm)",
}


@dataclass(frozen=True)
class CompressedGemmChoice:
    """How an adapter's compressed experts are multiplied: ``mode``
    (``fused`` or ``dequant``), the MXFP4 dot for ``fused`` MXFP4 (None
    otherwise: ``registers``, ``scaled`` or ``cuda``) and ``reason`` (the
    setting, why it resolved so, and which MXFP4 dot runs and why)."""

    mode: str
    mxfp4_dot: str | None
    reason: str


def _setting_source() -> str:
    if _mode is not None:
        return "set_compressed_gemm"
    return "PDFLASH_COMPRESSED_GEMM" if os.environ.get("PDFLASH_COMPRESSED_GEMM") else "default"


def choose_compressed_gemm(device: torch.device | str, fmt: str) -> CompressedGemmChoice:
    """The mode for ``fmt`` (``mxfp4`` or ``fp8``) experts on ``device``
    under the current setting (:func:`compressed_gemm_mode`): ``dequant``
    and ``fused`` as forced (``fused`` raises
    :class:`FusedGemmUnavailableError` where it cannot run); ``auto``:
    ``fused`` on a CUDA device where the kernel runs and its probe agrees,
    ``dequant`` elsewhere, with the reason. MXFP4's dot:
    :func:`fused_mxfp4_dot_choice`; a ``PDFLASH_FUSED_MXFP4_DOT=cuda`` that
    cannot run raises :class:`FusedGemmUnavailableError` (under ``fused``,
    and under ``auto`` on a CUDA device)."""
    if fmt not in ("mxfp4", "fp8"):
        raise ValueError(f"compressed expert formats: mxfp4, fp8; got {fmt!r}")
    setting = compressed_gemm_mode()
    source = _setting_source()
    device = torch.device(device)
    if setting == "dequant":
        return CompressedGemmChoice("dequant", None, f"dequant forced ({source})")
    if fmt == "mxfp4":
        dot, dot_why = fused_mxfp4_dot_choice(device)
        how = f"MXFP4 via {_DOT_NAMES[dot]} ({dot_why})"
        if dot == "cuda" and dot_why.startswith("PDFLASH_FUSED_MXFP4_DOT"):
            # forced: where it cannot run, an error (never a silent fallback)
            why = fused_gemm_unavailable(device, "cuda")
            if why is not None and (setting == "fused" or device.type == "cuda"):
                raise FusedGemmUnavailableError(f"PDFLASH_FUSED_MXFP4_DOT=cuda cannot run: {why}")
    else:
        dot, how = "registers", "FP8 dequantized in registers"
    if setting == "fused":
        why = fused_gemm_unavailable(device, dot)
        if why is not None:
            raise FusedGemmUnavailableError(
                f"PDFLASH_COMPRESSED_GEMM=fused (MXFP4 dot: {dot}) cannot run: {why}"
            )
        return CompressedGemmChoice(
            "fused", dot if fmt == "mxfp4" else None, f"fused forced ({source}); {how}"
        )
    if device.type != "cuda":
        why = f"not a CUDA device ({device.type})"
    else:
        why = fused_gemm_unavailable(device, dot)
    if why is not None:
        return CompressedGemmChoice("dequant", None, f"auto: dequant, the fused kernel: {why}")
    return CompressedGemmChoice(
        "fused",
        dot if fmt == "mxfp4" else None,
        f"auto: fused on {device.type} (triton imports, the kernel's probe agreed); {how}",
    )


def fused_mlp_for(
    device: torch.device | str,
    fmt: str,
    act: str,
    *,
    out_axis: int = 0,
    alpha: float = 1.0,
    limit: float = 0.0,
) -> tuple[FusedSlabMLP | None, CompressedGemmChoice]:
    """The fused MLP where :func:`choose_compressed_gemm` picks ``fused``
    (raises :class:`FusedGemmUnavailableError` where it is forced and cannot
    run), else None; and the choice with its reason."""
    choice = choose_compressed_gemm(device, fmt)
    if choice.mode != "fused":
        return None, choice
    dot = choice.mxfp4_dot or "registers"
    mlp = FusedSlabMLP(fmt, act, out_axis=out_axis, alpha=alpha, limit=limit, mxfp4_dot=dot)
    return mlp, choice
