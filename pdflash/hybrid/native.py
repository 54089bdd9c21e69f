"""The ``native`` host format: a C++ kernel for the expert MLP at few rows.

At 1-16 rows an expert's MLP is memory-bound: the weights are read once
and each weight does a handful of multiply-adds. torch's bf16 path runs two
GEMMs and the activation as separate ops; the native kernel (``cuda/include/pdflash/host_mlp.h``,
bound as :mod:`pdflash_native._hostmlp`) streams each weight byte once for
all rows with AMX BF16 tiles where the CPU and OS offer them, else AVX-512
BF16 dot products (``_mm512_dpbf16_ps``; fp32 accumulation either way; the
ISA is chosen at run time), applies biases and the activation on the
accumulators, and
splits the output columns over a persistent team of threads (the caller plus
``threads - 1`` workers claiming tiles of columns; one barrier between the
two products). The whole
batch of a job is one call without the GIL.

Weights are prepared once into the kernel's packed layout (bf16, zero
padded; gpt-oss's interleaved ``gate_up`` is split into gate and up rows,
each W1 tile holding 16 gate columns beside their 16 up columns). Same bytes
as the bf16 expert, plus float32 biases. The kernel computes in bf16/fp32:
it exists for bf16 models only (``host_kernel_for`` gives None otherwise),
and only where the CPU has AVX-512 BF16 (the portable scalar variant of the
same loops is there for tests and CPUs without it, far too slow to serve).

**MXFP4 experts** (gpt-oss's released format; :data:`WEIGHT_FORMATS`,
the ``native_mxfp4`` host format): the same tiles hold each weight as its
e2m1 code with the MXFP4 block scales (``pack_mxfp4_w1``/``pack_mxfp4_w2``,
layout in host_mlp.h), a quarter of the bf16 bytes plus a scale per 32
values, as the store holds them. The kernel dequantizes each block of a
tile in L1 right before the products, so it reads 3.8x fewer bytes per
call than ``native`` on the same experts dequantized at prepare time, and
its outputs are bit-identical to ``native``'s on those experts (the tests
compare them). Packing refuses block scales outside [2, 252] (the
kernel's exponent add is exact there; a scale outside means a block whose
weights are all below 2^-123, or where nonzero at least 2^125, in
magnitude).

**FP8 experts** (a store made with ``expert_dtype="fp8"``: e4m3fn with one
fp32 scale per output channel; the ``native_fp8`` host format): the tiles
hold each weight's e4m3 byte (``pack_fp8_w1``/``pack_fp8_w2``), half the
bf16 bytes, decoded exactly to bf16 before the products; a column's scale
multiplies its fp32 accumulator before the bias, as the fused GPU kernel
applies them (the store's dense path rounds each scaled weight to bf16
first, so the two agree within bf16 rounding, not bit for bit).

Numerics (checked by ``tests/hybrid/test_native_mlp.py``): against the
float32 function of the same bf16 weights and inputs, the only rounding
beyond float32 accumulation order is g (the activation's output) to bf16
before the second product, as torch's bf16 path also rounds it, and the
output to bf16.

:class:`MlpBackend` is the typed seam to the native module; the kernel
talks to it only through that Protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pdflash._native import load_native

Weights = dict[str, torch.Tensor]
#: a packed matrix's codes and scales
Packed = tuple[torch.Tensor, torch.Tensor]

#: ISA requests (``pdflash_native._hostmlp.ISA_*`` by name)
ISAS: tuple[str, ...] = ("auto", "scalar", "avx512_bf16", "amx_bf16")
#: with AMX, row chunks of fewer rows run the AVX-512 loops
DEFAULT_AMX_MIN_ROWS = 1
#: what the kernel's packed weights hold: bf16 values or MXFP4 codes and scales
WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "mxfp4", "fp8")
#: block scales (e8m0) the MXFP4 kernel computes exactly (host_mlp.h)
MXFP4_SCALE_RANGE = (2, 252)


class MlpBackend(Protocol):
    """The native team (:class:`pdflash_native._hostmlp.HostMlp`)."""

    threads: int

    @property
    def calls(self) -> int: ...

    @property
    def last_isa(self) -> int: ...

    @property
    def worker_tids(self) -> list[int]: ...

    def run(
        self,
        act: int,
        hidden: int,
        inter: int,
        alpha: float,
        limit: float,
        w1: npt.NDArray[np.uint64],
        b1: npt.NDArray[np.uint64],
        w2: npt.NDArray[np.uint64],
        b2: npt.NDArray[np.uint64],
        bounds: npt.NDArray[np.int64],
        x: int,
        x_type: int,
        x_stride: int,
        out: int,
        out_type: int,
        out_stride: int,
        isa: int = 0,
        amx_min_rows: int = 1,
        weights: int = 0,
        q1: npt.NDArray[np.uint64] | None = None,
        s1: npt.NDArray[np.uint64] | None = None,
        q2: npt.NDArray[np.uint64] | None = None,
        s2: npt.NDArray[np.uint64] | None = None,
    ) -> None: ...

    def close(self) -> None: ...


def _native() -> Any:
    return load_native("_hostmlp")


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU runs the native kernel's AVX-512 BF16 loops."""
    return bool(_native().cpu_has_avx512_bf16())


def cpu_has_amx_bf16() -> bool:
    """Whether it also runs its AMX BF16 loops (CPU, OS, permission)."""
    return bool(_native().cpu_has_amx_bf16())


def native_unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the ``native`` format is not offered for a model of ``dtype``
    here (None: it is)."""
    if dtype != torch.bfloat16:
        return f"the native kernel computes bf16 models only (this one is {dtype})"
    if not cpu_has_avx512_bf16():
        return (
            "this CPU has no AVX-512 BF16 (the native kernel's scalar variant is too slow to serve)"
        )
    return None


def pack_w1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate``/``up`` ``[I, H]`` -> the packed W1 (bf16, flat, on their
    device; layout in host_mlp.h; :func:`pdflash._reference.hostmlp.pack_w1`
    is its reference). uint8 matrices (MXFP4 codes) pack to uint8 elements
    in the same places."""
    inter, hidden = gate.shape
    ip = _native().inter_pad(inter)
    hp = 2 * int(_native().hidden_pairs(hidden))
    tiles = ip // 16
    if inter % 16 or hidden % 2:
        return _pack_w1_two_pass(gate, up, ip, hp)
    # one strided copy per matrix straight into the packed layout (no zeroed
    # [2, ip, hp] staging copy): out[t, p, g, c, e] = (gate, up)[g][16t + c, 2p + e]
    padded = (ip, hp) != (inter, hidden)
    out = (torch.zeros if padded else torch.empty)(
        tiles, hp // 2, 2, 16, 2, dtype=_elem_dtype(gate), device=gate.device
    )
    dest = out.permute(2, 0, 3, 1, 4)  # [g, T, 16, P, 2]
    for g, m in enumerate((gate, up)):
        dest[g, : inter // 16, :, : hidden // 2].copy_(m.view(inter // 16, 16, hidden // 2, 2))
    return out.view(-1)


def _pack_w1_two_pass(gate: torch.Tensor, up: torch.Tensor, ip: int, hp: int) -> torch.Tensor:
    """:func:`pack_w1` for the shapes whose padding splits a tile or a pair."""
    inter, hidden = gate.shape
    tiles = ip // 16
    both = torch.zeros(2, ip, hp, dtype=_elem_dtype(gate), device=gate.device)
    both[0, :inter, :hidden] = gate
    both[1, :inter, :hidden] = up
    # [2, T, 16, P, 2] -> [T, P, (2, 16), 2]: gate's 16 columns, then up's
    w = both.view(2, tiles, 16, hp // 2, 2).permute(1, 3, 0, 2, 4)
    return w.contiguous().view(-1)


def pack_w2(down: torch.Tensor) -> torch.Tensor:
    """``down`` ``[H, I]`` -> the packed W2 (bf16, flat)."""
    hidden, inter = down.shape
    ip = _native().inter_pad(inter)
    tiles = -(-hidden // 32)
    if hidden % 32 or inter % 2:
        w = torch.zeros(tiles * 32, ip, dtype=_elem_dtype(down), device=down.device)
        w[:hidden, :inter] = down
        return w.view(tiles, 32, ip // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)
    # out[t, p, c, e] = down[32t + c, 2p + e], one strided copy
    out = (torch.zeros if ip != inter else torch.empty)(
        tiles, ip // 2, 32, 2, dtype=_elem_dtype(down), device=down.device
    )
    out.permute(0, 2, 1, 3)[:, :, : inter // 2].copy_(down.view(tiles, 32, inter // 2, 2))
    return out.view(-1)


def _elem_dtype(m: torch.Tensor) -> torch.dtype:
    """Packed elements: uint8 codes stay uint8, values become bf16."""
    return torch.uint8 if m.dtype == torch.uint8 else torch.bfloat16


def mxfp4_codes(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks [R, G, 16]`` -> the e2m1 codes ``[R, G * 32]`` (uint8,
    one per value, low nibble first: the order of
    :func:`pdflash.models.layout.dequantize_mxfp4`)."""
    rows, groups = int(blocks.shape[0]), int(blocks.shape[1])
    return torch.stack((blocks & 0xF, blocks >> 4), dim=-1).view(rows, groups * 32)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes (64 per pair row) -> 32 bytes per pair row: byte b holds
    element b's code low and element b + 32's high (host_mlp.h)."""
    rows = codes.view(-1, 64)
    return (rows[:, :32] | (rows[:, 32:] << 4)).contiguous().view(-1)


def _check_scales(*scales: torch.Tensor) -> None:
    lo, hi = MXFP4_SCALE_RANGE
    for sc in scales:
        if sc.numel() and (int(sc.min()) < lo or int(sc.max()) > hi):
            raise ValueError(
                f"MXFP4 block scales {int(sc.min())}..{int(sc.max())} leave [{lo}, {hi}], "
                "where the native kernel's dequantization is exact"
            )


def mxfp4_scales_out_of_range(store: Any) -> str | None:
    """Why ``store``'s MXFP4 experts cannot be packed for the kernel (a block
    scale outside :data:`MXFP4_SCALE_RANGE`), or None. One pass over every
    packed expert's scales (1/16 of its bytes), kept on the store."""
    kept = getattr(store, "_pdflash_mxfp4_scales", None)
    if kept is not None:
        return str(kept) or None
    lo, hi = 255, 0
    for g in store.packed_ids().tolist():
        views = store.views(int(g))
        for key in ("gate_up_scales", "down_scales"):
            sc = views[key]
            lo, hi = min(lo, int(sc.min())), max(hi, int(sc.max()))
    a, b = MXFP4_SCALE_RANGE
    why = "" if a <= lo and hi <= b else f"MXFP4 block scales {lo}..{hi} leave [{a}, {b}]"
    store._pdflash_mxfp4_scales = why
    return why or None


def pack_mxfp4_w1(
    gate_blocks: torch.Tensor,
    up_blocks: torch.Tensor,
    gate_scales: torch.Tensor,
    up_scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 gate and up (``[I, H / 32, 16]`` blocks, ``[I, H / 32]``
    scales) -> W1's packed codes and scales (uint8, flat; host_mlp.h;
    :func:`pdflash._reference.hostmlp.pack_mxfp4_w1` is the reference).
    MXFP4 needs H and I multiples of 32, so nothing is padded."""
    _check_scales(gate_scales, up_scales)
    inter, groups = int(gate_scales.shape[0]), int(gate_scales.shape[1])
    q = _nibbles(pack_w1(mxfp4_codes(gate_blocks), mxfp4_codes(up_blocks)))
    # [T, 2, 16, G] -> [T, G, 2, 16]: per tile and group, gate's 16 columns then up's
    both = torch.stack(
        (gate_scales.reshape(inter // 16, 16, groups), up_scales.reshape(inter // 16, 16, groups)),
        dim=1,
    )
    return q, both.permute(0, 3, 1, 2).contiguous().view(-1)


def pack_mxfp4_w2(
    down_blocks: torch.Tensor, down_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 down (``[H, I / 32, 16]`` blocks, ``[H, I / 32]`` scales) ->
    W2's packed codes and scales (uint8, flat)."""
    _check_scales(down_scales)
    hidden, groups = int(down_scales.shape[0]), int(down_scales.shape[1])
    q = _nibbles(pack_w2(mxfp4_codes(down_blocks)))
    s = down_scales.reshape(hidden // 32, 32, groups).permute(0, 2, 1).contiguous().view(-1)
    return q, s


def _fp8_codes(m: torch.Tensor) -> torch.Tensor:
    """An e4m3fn matrix's bytes (uint8, same strides); NaN codes refused."""
    codes = m.view(torch.uint8)
    if bool(((codes & 0x7F) == 0x7F).any()):
        raise ValueError("FP8 expert weights hold NaN codes")
    return codes


def pack_fp8_w1(
    gate: torch.Tensor, up: torch.Tensor, gate_scale: torch.Tensor, up_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 gate and up (e4m3fn ``[I, H]``, fp32 scales ``[I]``) -> W1's
    packed codes (uint8, the bf16 layout's places) and column scales (fp32,
    32 per tile: gate's 16, then up's; 1 where padded); host_mlp.h."""
    inter = int(gate.shape[0])
    ip = _native().inter_pad(inter)
    q = pack_w1(_fp8_codes(gate), _fp8_codes(up))
    c = torch.ones(2, ip, dtype=torch.float32, device=gate.device)
    c[0, :inter] = gate_scale
    c[1, :inter] = up_scale
    return q, c.view(2, ip // 16, 16).permute(1, 0, 2).contiguous().view(-1)


def pack_fp8_w2(down: torch.Tensor, down_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 down (e4m3fn ``[H, I]``, fp32 scales ``[H]``) -> W2's packed codes
    and column scales (32 per tile, 1 where padded)."""
    hidden = int(down.shape[0])
    q = pack_w2(_fp8_codes(down))
    c = torch.ones(int(_native().w2_tiles(hidden)) * 32, dtype=torch.float32, device=down.device)
    c[:hidden] = down_scale
    return q, c


def pack_b1(gate_bias: torch.Tensor, up_bias: torch.Tensor) -> torch.Tensor:
    """Gate and up biases -> float32 ``[2 * inter_pad]`` (zero padded)."""
    inter = gate_bias.shape[0]
    ip = _native().inter_pad(inter)
    b = torch.zeros(2, ip, dtype=torch.float32, device=gate_bias.device)
    b[0, :inter] = gate_bias
    b[1, :inter] = up_bias
    return b.view(-1)


_DTYPE_TAG = {torch.float32: 0, torch.bfloat16: 1}  # DTYPE_F32, DTYPE_BF16


class NativeHostKernel:
    """The ``native`` host format for one architecture's experts
    (:class:`pdflash.hybrid.kernels.HostKernel`).

    Args:
        act: ``"gpt_oss"`` (clamped SwiGLU with biases, ``alpha``/``limit``)
            or ``"swiglu_silu"`` (Qwen3-MoE-style, no biases).
        split: one expert's packed views -> ``(gate [I, H], up [I, H],
            down [H, I], gate_bias, up_bias, down_bias)`` (``[out, in]``
            matrices, any strides; biases None when the arch has none);
            with ``weights="mxfp4"``: ``(gate, up, down blocks, gate, up,
            down scales, gate_bias, up_bias, down_bias)``, each matrix's
            MXFP4 blocks ``[out, in / 32, 16]`` and scales ``[out, in / 32]``;
            with ``weights="fp8"``: the same order, e4m3fn ``[out, in]``
            matrices and fp32 ``[out]`` scales.
        hidden, inter: the expert's sizes.
        threads: the team's size (default: torch's intra-op thread count
            when the kernel is made, which the executor set).
        isa: ``auto`` (the best of the below the CPU has), ``scalar`` (the
            portable loops), ``avx512_bf16`` or ``amx_bf16`` (AMX tiles for
            row chunks of at least ``amx_min_rows`` rows, AVX-512 BF16 for
            the rest; each refused where the CPU lacks it).
        amx_min_rows: see ``isa``.
        spin_us: how long idle workers spin before they park.
        backend: makes the team (tests; default the native module's).
        weights: what :meth:`prepare` packs (:data:`WEIGHT_FORMATS`): bf16
            values (the ``native`` format), MXFP4 codes and scales
            (``native_mxfp4``) or FP8 codes and column scales
            (``native_fp8``).
    """

    dtype = torch.bfloat16
    layout = "native"

    def __init__(
        self,
        act: str,
        split: Callable[[Weights], tuple[torch.Tensor | None, ...]],
        *,
        hidden: int,
        inter: int,
        alpha: float = 0.0,
        limit: float = 0.0,
        threads: int | None = None,
        isa: str = "auto",
        amx_min_rows: int = DEFAULT_AMX_MIN_ROWS,
        spin_us: int = 50,
        backend: Callable[[int, int], MlpBackend] | None = None,
        weights: str = "bf16",
    ) -> None:
        mod = _native()
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weights {weights!r}; choose one of {WEIGHT_FORMATS}")
        self.weights = weights
        self.name = "native" if weights == "bf16" else f"native_{weights}"
        self._weights_code = int(
            {"bf16": mod.WEIGHTS_BF16, "mxfp4": mod.WEIGHTS_MXFP4, "fp8": mod.WEIGHTS_FP8}[weights]
        )
        acts = {"swiglu_silu": mod.ACT_SWIGLU_SILU, "gpt_oss": mod.ACT_GPT_OSS_CLAMP}
        if act not in acts:
            raise ValueError(f"unknown activation {act!r}; choose one of {tuple(acts)}")
        if isa not in ISAS:
            raise ValueError(f"unknown isa {isa!r}; choose one of {ISAS}")
        if isa == "avx512_bf16" and not mod.cpu_has_avx512_bf16():
            raise ValueError("isa='avx512_bf16' but this CPU has no AVX-512 BF16")
        if isa == "amx_bf16" and not mod.cpu_has_amx_bf16():
            raise ValueError("isa='amx_bf16' but this CPU (or OS) offers no AMX BF16")
        if amx_min_rows < 1:
            raise ValueError(f"amx_min_rows must be >= 1, got {amx_min_rows}")
        threads = torch.get_num_threads() if threads is None else int(threads)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if hidden < 1 or inter < 1:
            raise ValueError(f"hidden and inter must be >= 1, got {hidden}, {inter}")
        self.act = act
        self._act_code = int(acts[act])
        self.split = split
        self.hidden, self.inter = int(hidden), int(inter)
        self.alpha, self.limit = float(alpha), float(limit)
        self.threads = threads
        self.isa = isa
        self._isa_code = {
            "auto": mod.ISA_AUTO,
            "scalar": mod.ISA_SCALAR,
            "avx512_bf16": mod.ISA_AVX512_BF16,
            "amx_bf16": mod.ISA_AMX_BF16,
        }[isa]
        self.amx_min_rows = int(amx_min_rows)
        self._isa_names: dict[int, str] = dict(mod.ISA_NAMES)
        self.spin_us = int(spin_us)
        self._backend_factory = backend or mod.HostMlp
        self._team: MlpBackend | None = None
        self._lock = threading.Lock()
        self._w1_elems = int(mod.w1_elems(self.hidden, self.inter))
        self._w2_elems = int(mod.w2_elems(self.hidden, self.inter))
        self._b1_elems = 2 * int(mod.inter_pad(self.inter))
        if weights == "mxfp4":
            if self.hidden % 32 or self.inter % 32:
                raise ValueError(
                    f"MXFP4 needs hidden and inter multiples of 32, got {hidden}, {inter}"
                )
            self._sizes = {
                "q1": int(mod.mxfp4_code_bytes(self._w1_elems)),
                "s1": int(mod.mxfp4_scale_bytes(self._w1_elems)),
                "q2": int(mod.mxfp4_code_bytes(self._w2_elems)),
                "s2": int(mod.mxfp4_scale_bytes(self._w2_elems)),
            }
        elif weights == "fp8":
            self._sizes = {
                "q1": self._w1_elems,
                "s1": 32 * int(mod.w1_tiles(self.inter)),
                "q2": self._w2_elems,
                "s2": 32 * int(mod.w2_tiles(self.hidden)),
            }
        else:
            self._sizes = {"w1": self._w1_elems, "w2": self._w2_elems}

    def with_isa(self, isa: str) -> NativeHostKernel:
        """This kernel running ``isa`` (the same packed weights fit it)."""
        return NativeHostKernel(
            self.act,
            self.split,
            hidden=self.hidden,
            inter=self.inter,
            alpha=self.alpha,
            limit=self.limit,
            threads=self.threads,
            isa=isa,
            amx_min_rows=self.amx_min_rows,
            spin_us=self.spin_us,
            backend=self._backend_factory,
            weights=self.weights,
        )

    # -- weights ---------------------------------------------------------------

    def prepare(self, views: Weights) -> Weights:
        if self.weights == "bf16":
            gate, up, down, bg, bu, bd = self.split(views)
            assert gate is not None and up is not None and down is not None
            h, i = self.hidden, self.inter
            want = ((i, h), (i, h), (h, i))
            got = (tuple(gate.shape), tuple(up.shape), tuple(down.shape))
            if got != want:
                raise ValueError(f"expert matrices {got} do not match (gate, up, down) {want}")
            # packed where the views are (prepare_all brings a device's result
            # to the host)
            w: Weights = {"w1": pack_w1(gate, up), "w2": pack_w2(down)}
        else:
            w, (bg, bu, bd) = self._pack_codes(views)
        if bg is not None and bu is not None:
            w["b1"] = pack_b1(bg, bu)
        if bd is not None:
            w["b2"] = bd.to(torch.float32).contiguous()
        return w

    def _pack_codes(self, views: Weights) -> tuple[Weights, tuple[torch.Tensor | None, ...]]:
        """MXFP4 or FP8: the (gate, up, down) codes and their scales packed
        (``q1``, ``s1``, ``q2``, ``s2``), and the biases as the split gave them."""
        parts = self.split(views)
        codes = [t for t in parts[:6] if t is not None]
        assert len(codes) == 6
        gq, uq, dq, gs, us, ds = codes
        h, i = self.hidden, self.inter
        want: tuple[tuple[int, ...], ...]
        pack1: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Packed]
        pack2: Callable[[torch.Tensor, torch.Tensor], Packed]
        if self.weights == "mxfp4":  # blocks [out, in / 32, 16], scales [out, in / 32]
            want = ((i, h // 32, 16), (i, h // 32, 16), (h, i // 32, 16))
            want += ((i, h // 32), (i, h // 32), (h, i // 32))
            pack1, pack2 = pack_mxfp4_w1, pack_mxfp4_w2
        else:  # e4m3 [out, in], column scales [out]
            want = ((i, h), (i, h), (h, i), (i,), (i,), (h,))
            pack1, pack2 = pack_fp8_w1, pack_fp8_w2
        got = tuple(tuple(t.shape) for t in codes)
        if got != want:
            raise ValueError(
                f"{self.weights.upper()} expert matrices and scales {got} do not match {want}"
            )
        q1, s1 = pack1(gq, uq, gs, us)
        q2, s2 = pack2(dq, ds)
        return {"q1": q1, "s1": s1, "q2": q2, "s2": s2}, tuple(parts[6:])

    def _check(self, w: Weights) -> None:
        if any(k not in w or w[k].numel() != n for k, n in self._sizes.items()):
            raise ValueError(f"weights were not prepared by a {self.name} kernel of this shape")
        if "b1" in w and w["b1"].numel() != self._b1_elems:
            raise ValueError("b1 was not prepared by a native kernel of this shape")

    # -- compute ---------------------------------------------------------------

    def team(self) -> MlpBackend:
        """The thread team (made on first use)."""
        with self._lock:
            if self._team is None:
                self._team = self._backend_factory(self.threads, self.spin_us)
            return self._team

    def thread_ids(self) -> list[int]:
        """The team's worker threads' kernel ids (the team is made if there
        is none yet; Linux, else empty): where a placement pins them
        (:mod:`pdflash.hybrid.affinity`). The caller of a batch is the
        team's other member and is placed on its own."""
        return [int(t) for t in self.team().worker_tids]

    def last_isa(self) -> str | None:
        """The ISA the last batch ran (None before the first)."""
        team = self._team
        if team is None or team.calls == 0:
            return None
        return self._isa_names[int(team.last_isa)]

    def describe(self) -> dict[str, Any]:
        return {
            "kernel": self.name,
            "isa_requested": self.isa,
            "isa_ran": self.last_isa(),
            "threads": self.threads,
            "amx_min_rows": self.amx_min_rows,
            "avx512_bf16_cpu": cpu_has_avx512_bf16(),
            "amx_bf16_cpu": cpu_has_amx_bf16(),
        }

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=self.dtype)
        self.forward_many(x, [w], [0, int(x.shape[0])], out)
        return out

    def forward_many(
        self, x: torch.Tensor, ws: Sequence[Weights], bounds: Sequence[int], out: torch.Tensor
    ) -> None:
        from pdflash.hybrid.kernels import check_forward_many

        b = check_forward_many(x, ws, bounds, out)
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x {tuple(x.shape)} is not [rows, {self.hidden}]")
        if x.device.type != "cpu" or out.device.type != "cpu":
            raise ValueError("the native kernel computes host tensors")
        if not ws or x.shape[0] == 0:
            return
        for w in ws:
            self._check(w)
        xin = x if x.dtype in _DTYPE_TAG and x.stride(1) == 1 else x.to(torch.float32).contiguous()
        dst = out if out.dtype in _DTYPE_TAG and out.stride(1) == 1 else None
        target = dst if dst is not None else torch.empty(out.shape, dtype=torch.float32)
        n = len(ws)
        mx = self.weights != "bf16"  # codes and scales
        ptrs = np.zeros((8 if mx else 4, n), dtype=np.uint64)
        for j, w in enumerate(ws):
            if mx:
                for row, key in enumerate(("q1", "s1", "q2", "s2"), start=4):
                    ptrs[row, j] = w[key].data_ptr()
            else:
                ptrs[0, j] = w["w1"].data_ptr()
                ptrs[2, j] = w["w2"].data_ptr()
            if "b1" in w:
                ptrs[1, j] = w["b1"].data_ptr()
            if "b2" in w:
                ptrs[3, j] = w["b2"].data_ptr()
        quantized = (
            {
                "weights": self._weights_code,
                "q1": ptrs[4],
                "s1": ptrs[5],
                "q2": ptrs[6],
                "s2": ptrs[7],
            }
            if mx
            else {}
        )
        self.team().run(
            self._act_code,
            self.hidden,
            self.inter,
            self.alpha,
            self.limit,
            ptrs[0],
            ptrs[1],
            ptrs[2],
            ptrs[3],
            np.asarray(b, dtype=np.int64),
            xin.data_ptr(),
            _DTYPE_TAG[xin.dtype],
            int(xin.stride(0)),
            target.data_ptr(),
            _DTYPE_TAG[target.dtype],
            int(target.stride(0)),
            self._isa_code,
            self.amx_min_rows,
            **quantized,
        )
        if dst is None:
            out.copy_(target)

    def close(self) -> None:
        """Join the team's threads (a later call makes a new team)."""
        with self._lock:
            team, self._team = self._team, None
        if team is not None:
            team.close()


def _split_gpt_oss(
    dense: Callable[[Weights], Weights],
) -> Callable[[Weights], tuple[torch.Tensor | None, ...]]:
    def split(views: Weights) -> tuple[torch.Tensor | None, ...]:
        w = dense(views)  # gate_up [H, 2I] interleaved, down [I, H]
        gu, b = w["gate_up"], w["gate_up_bias"]
        return gu[:, 0::2].t(), gu[:, 1::2].t(), w["down"].t(), b[0::2], b[1::2], w["down_bias"]

    return split


def _split_gpt_oss_mxfp4(views: Weights) -> tuple[torch.Tensor | None, ...]:
    # rows of gate_up's blocks are gate_up's columns, gate and up interleaved
    gb, gs, b = views["gate_up_blocks"], views["gate_up_scales"], views["gate_up_bias"]
    return (
        gb[0::2],
        gb[1::2],
        views["down_blocks"],
        gs[0::2],
        gs[1::2],
        views["down_scales"],
        b[0::2],
        b[1::2],
        views["down_bias"],
    )


def _split_gpt_oss_fp8(views: Weights) -> tuple[torch.Tensor | None, ...]:
    # gate_up [H, 2I] (columns interleaved) and down [I, H]: [in, out]
    gu, gs, b = views["gate_up"], views["gate_up_scale"], views["gate_up_bias"]
    return (
        gu[:, 0::2].t(),
        gu[:, 1::2].t(),
        views["down"].t(),
        gs[0::2],
        gs[1::2],
        views["down_scale"],
        b[0::2],
        b[1::2],
        views["down_bias"],
    )


def _split_swiglu_fp8(views: Weights) -> tuple[torch.Tensor | None, ...]:
    # gate_up [2I, H] (gate rows first) and down [H, I]: [out, in]
    gu, gs = views["gate_up"], views["gate_up_scale"]
    i = gu.shape[0] // 2
    return gu[:i], gu[i:], views["down"], gs[:i], gs[i:], views["down_scale"], None, None, None


def _split_swiglu(
    dense: Callable[[Weights], Weights],
) -> Callable[[Weights], tuple[torch.Tensor | None, ...]]:
    def split(views: Weights) -> tuple[torch.Tensor | None, ...]:
        w = dense(views)  # gate_up [2I, H] (gate rows first), down [H, I]
        gu = w["gate_up"]
        i = gu.shape[0] // 2
        return gu[:i], gu[i:], w["down"], None, None, None

    return split


def native_kernel_for(
    adapter: Any,
    *,
    arch: str,
    threads: int | None = None,
    isa: str = "auto",
    weights: str = "bf16",
) -> NativeHostKernel:
    """The native kernel for ``adapter``'s experts; ``arch``: ``gpt_oss`` or
    ``swiglu_silu`` (the caller, :func:`pdflash.hybrid.kernels.host_kernel_for`,
    decided which expert function the adapter computes); ``weights="mxfp4"``
    (gpt-oss with an MXFP4 store only) or ``"fp8"`` (an FP8 store) computes
    from the store's own bytes."""
    dense = adapter.dense_expert_weights
    hidden = int(adapter.hidden_size)
    w = dense(adapter.store.views(int(adapter.store.packed_ids()[0])))
    stored = adapter.store.layout.format
    if weights == "mxfp4" and (arch != "gpt_oss" or stored != "mxfp4"):
        raise ValueError("weights='mxfp4' needs gpt-oss experts stored as MXFP4")
    if weights == "fp8" and stored != "fp8":
        raise ValueError("weights='fp8' needs experts stored as FP8 (expert_dtype='fp8')")
    if arch == "gpt_oss":
        alpha, limit = adapter._swiglu_params()
        inter = int(w["gate_up"].shape[1]) // 2
        splits = {"mxfp4": _split_gpt_oss_mxfp4, "fp8": _split_gpt_oss_fp8}
        return NativeHostKernel(
            "gpt_oss",
            splits.get(weights) or _split_gpt_oss(dense),
            hidden=hidden,
            inter=inter,
            alpha=alpha,
            limit=limit,
            threads=threads,
            isa=isa,
            weights=weights,
        )
    inter = int(w["gate_up"].shape[0]) // 2
    return NativeHostKernel(
        "swiglu_silu",
        _split_swiglu_fp8 if weights == "fp8" else _split_swiglu(dense),
        hidden=hidden,
        inter=inter,
        threads=threads,
        isa=isa,
        weights=weights,
    )


__all__ = [
    "ISAS",
    "MXFP4_SCALE_RANGE",
    "WEIGHT_FORMATS",
    "MlpBackend",
    "NativeHostKernel",
    "cpu_has_amx_bf16",
    "cpu_has_avx512_bf16",
    "mxfp4_codes",
    "native_kernel_for",
    "native_unavailable_reason",
    "pack_b1",
    "pack_fp8_w1",
    "pack_fp8_w2",
    "pack_mxfp4_w1",
    "pack_mxfp4_w2",
    "pack_w1",
    "pack_w2",
]
