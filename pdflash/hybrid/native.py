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

#: ISA requests (``pdflash_native._hostmlp.ISA_*`` by name)
ISAS: tuple[str, ...] = ("auto", "scalar", "avx512_bf16", "amx_bf16")
#: with AMX, row chunks of fewer rows run the AVX-512 loops
DEFAULT_AMX_MIN_ROWS = 1


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
    is its reference)."""
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
        tiles, hp // 2, 2, 16, 2, dtype=torch.bfloat16, device=gate.device
    )
    dest = out.permute(2, 0, 3, 1, 4)  # [g, T, 16, P, 2]
    for g, m in enumerate((gate, up)):
        dest[g, : inter // 16, :, : hidden // 2].copy_(m.view(inter // 16, 16, hidden // 2, 2))
    return out.view(-1)


def _pack_w1_two_pass(gate: torch.Tensor, up: torch.Tensor, ip: int, hp: int) -> torch.Tensor:
    """:func:`pack_w1` for the shapes whose padding splits a tile or a pair."""
    inter, hidden = gate.shape
    tiles = ip // 16
    both = torch.zeros(2, ip, hp, dtype=torch.bfloat16, device=gate.device)
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
        w = torch.zeros(tiles * 32, ip, dtype=torch.bfloat16, device=down.device)
        w[:hidden, :inter] = down
        return w.view(tiles, 32, ip // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)
    # out[t, p, c, e] = down[32t + c, 2p + e], one strided copy
    out = (torch.zeros if ip != inter else torch.empty)(
        tiles, ip // 2, 32, 2, dtype=torch.bfloat16, device=down.device
    )
    out.permute(0, 2, 1, 3)[:, :, : inter // 2].copy_(down.view(tiles, 32, inter // 2, 2))
    return out.view(-1)


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
            matrices, any strides; biases None when the arch has none).
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
    """

    name = "native"
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
    ) -> None:
        mod = _native()
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
        )

    # -- weights ---------------------------------------------------------------

    def prepare(self, views: Weights) -> Weights:
        gate, up, down, bg, bu, bd = self.split(views)
        assert gate is not None and up is not None and down is not None
        want = ((self.inter, self.hidden), (self.inter, self.hidden), (self.hidden, self.inter))
        got = (tuple(gate.shape), tuple(up.shape), tuple(down.shape))
        if got != want:
            raise ValueError(f"expert matrices {got} do not match (gate, up, down) {want}")
        # packed where the views are (prepare_all brings a device's result
        # to the host)
        w: Weights = {"w1": pack_w1(gate, up), "w2": pack_w2(down)}
        if bg is not None and bu is not None:
            w["b1"] = pack_b1(bg, bu)
        if bd is not None:
            w["b2"] = bd.to(torch.float32).contiguous()
        return w

    def _check(self, w: Weights) -> None:
        if w["w1"].numel() != self._w1_elems or w["w2"].numel() != self._w2_elems:
            raise ValueError("weights were not prepared by a native kernel of this shape")
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
            "kernel": "native",
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
        ptrs = np.zeros((4, n), dtype=np.uint64)
        for j, w in enumerate(ws):
            ptrs[0, j] = w["w1"].data_ptr()
            ptrs[2, j] = w["w2"].data_ptr()
            if "b1" in w:
                ptrs[1, j] = w["b1"].data_ptr()
            if "b2" in w:
                ptrs[3, j] = w["b2"].data_ptr()
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
    adapter: Any, *, arch: str, threads: int | None = None, isa: str = "auto"
) -> NativeHostKernel:
    """The native kernel for ``adapter``'s experts; ``arch``: ``gpt_oss`` or
    ``swiglu_silu`` (the caller, :func:`pdflash.hybrid.kernels.host_kernel_for`,
    decided which expert function the adapter computes)."""
    dense = adapter.dense_expert_weights
    hidden = int(adapter.hidden_size)
    w = dense(adapter.store.views(int(adapter.store.packed_ids()[0])))
    if arch == "gpt_oss":
        alpha, limit = adapter._swiglu_params()
        inter = int(w["gate_up"].shape[1]) // 2
        return NativeHostKernel(
            "gpt_oss",
            _split_gpt_oss(dense),
            hidden=hidden,
            inter=inter,
            alpha=alpha,
            limit=limit,
            threads=threads,
            isa=isa,
        )
    inter = int(w["gate_up"].shape[0]) // 2
    return NativeHostKernel(
        "swiglu_silu", _split_swiglu(dense), hidden=hidden, inter=inter, threads=threads, isa=isa
    )


__all__ = [
    "ISAS",
    "MlpBackend",
    "NativeHostKernel",
    "cpu_has_amx_bf16",
    "cpu_has_avx512_bf16",
    "native_kernel_for",
    "native_unavailable_reason",
    "pack_b1",
    "pack_w1",
    "pack_w2",
]
