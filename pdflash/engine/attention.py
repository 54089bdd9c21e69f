"""Batched attention over paged KV for a flat token batch of many requests.

Queries of all requests are flattened into ``[T, heads, D]``. For one forward
the engine builds an :class:`AttentionBatch` once: each request's query rows
and positions and the flat KV slots of all its keys, padded to the longest
request, plus everything the layers would otherwise rebuild (the visibility
mask of each distinct (causal, window) pair, the additive bias with the sink
column, the gather indices that pad and unpad the queries). It is sent to the
device in one copy. Each layer then gathers its keys in one indexing op and
runs one attention call over the padded batch, honouring causality, a sliding
window and gpt-oss attention sinks, with no host sync.

Two exact implementations: :func:`sdpa_attention` (torch's fused
``scaled_dot_product_attention``; a sink is one extra key whose logit is the
sink value, given through an additive mask, with a zero value row) and
:func:`masked_attention` (the explicit padded softmax in fp32, the reference).
:func:`paged_attention` uses the fused one where torch has it.
"""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdflash.protocols import AttentionSpec

#: the padded key axis of the fused path is a multiple of this: torch's fused
#: SDPA kernels want the bias's last dim aligned (the memory-efficient one to
#: 16) and otherwise pad (copy) the bias on every call
KEY_ALIGN = 16


class HostStaging:
    """Reusable host staging for int64 host->device copies: a ring of
    ``depth`` buffers, pinned on CUDA, each grown (doubling) when a copy needs
    more and otherwise written in place, so a forward's index copies pin no
    new memory once the buffers fit. The copy is asynchronous on CUDA (the
    work that reads its result runs after it on the same stream); a buffer is
    written again only after the copy that last read it has run (an event
    recorded on the stream behind that copy). The device tensors returned
    are fresh, never views of a staging buffer, on every device."""

    def __init__(self, device: torch.device | str, depth: int = 4) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0
        #: staging buffers allocated (pinned on CUDA) so far: a few at first, then none
        self.allocations = 0

    def _buffer(self, index: int, size: int) -> torch.Tensor:
        event = self._events[index]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has run
        buf = self._buffers[index]
        if buf is None or buf.numel() < size:
            capacity = max(256, 1 << (size - 1).bit_length())
            buf = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
            self._buffers[index] = buf
            self.allocations += 1
        return buf

    def copy(self, rows: list[list[int]], device: torch.device | None = None) -> list[torch.Tensor]:
        """``rows`` as int64 tensors on ``device`` (default :attr:`device`;
        one of its type), through one copy."""
        target = self.device if device is None else device
        if target.type != self.device.type:
            raise ValueError(f"staging for {self.device.type}, the copy is to {target}")
        flat: list[int] = []
        for r in rows:
            flat += r
        out = torch.empty(len(flat), dtype=torch.int64, device=target)
        if flat:
            index = self._next
            self._next = (index + 1) % len(self._buffers)
            host = self._buffer(index, len(flat))[: len(flat)]
            host.numpy()[:] = flat
            out.copy_(host, non_blocking=self.pinned)
            if self.pinned:
                event = self._events[index] or torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(target))
                self._events[index] = event
        return list(torch.split(out, [len(r) for r in rows]))


def device_int64(
    rows: list[list[int]], device: torch.device, staging: HostStaging | None = None
) -> list[torch.Tensor]:
    """Several host int lists -> int64 device tensors through ONE host->device
    copy: through ``staging`` (its reused buffers) when given for a device of
    this type, else from a fresh buffer. On CUDA the copy is from pinned
    memory and asynchronous: a ``torch.tensor(..., device=cuda)`` from
    pageable memory makes the host wait until the stream has drained up to
    it. (Without ``staging``, torch's pinned-memory cache keeps the buffer
    until the copy has run.)"""
    if staging is not None and staging.device.type == device.type:
        return staging.copy(rows, device)
    flat: list[int] = []
    for r in rows:
        flat += r
    packed = torch.tensor(flat, dtype=torch.int64)
    if not flat:
        packed = packed.to(device)  # nothing to copy
    elif device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    elif packed.device != device:
        packed = packed.to(device)
    return list(torch.split(packed, [len(r) for r in rows]))


@dataclass
class AttentionBatch:
    """Index tensors for one padded attention call (all int64/bool, on device).

    ``q_rows [R, Nq]``: flat query row of each padded query (``T`` = padding).
    ``q_pos [R, Nq]``: its position. ``k_slots [R, Lk]``: flat KV slot of each
    padded key (padding: the null slot, else 0). ``k_pos [R, Lk]``, ``k_valid [R, Lk]``.
    ``q_valid [R, Nq]``.

    The fused path's own: ``kv_slots [R, Lp]`` is ``k_slots`` padded with slot
    0 to ``Lp`` (a multiple of :data:`KEY_ALIGN`, at least ``Lk + 1``; column
    ``Lk`` is where a layer with sinks puts its zero sink key).
    ``uniform``: every request has ``Nq`` queries, request ``i``'s at flat
    rows ``i*Nq ..`` (padding and unpadding the queries are views then).
    ``q_gather [R*Nq]``: the flat row each padded query reads (padding reads
    row 0; its output is dropped). ``unpad_index [T]``: the padded query of
    each flat row. ``zero_padding``: the padding slots read a KV row that is
    always zero (built with a ``null_slot``). Masks are built on first use and
    kept for the forward.
    """

    q_rows: torch.Tensor
    q_pos: torch.Tensor
    q_valid: torch.Tensor
    k_slots: torch.Tensor
    k_pos: torch.Tensor
    k_valid: torch.Tensor
    num_tokens: int
    kv_slots: torch.Tensor
    uniform: bool
    q_gather: torch.Tensor
    unpad_index: torch.Tensor
    zero_padding: bool = False
    _masks: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    @staticmethod
    def build(
        query_rows: list[list[int]],
        query_positions: list[list[int]],
        key_slots: list[list[int]],
        key_positions: list[list[int]],
        num_tokens: int,
        device: torch.device,
        null_slot: int | None = None,
        staging: HostStaging | None = None,
    ) -> AttentionBatch:
        """``null_slot``: a KV slot that is always zero (e.g.
        :attr:`PagedKVCache.null_slot`); padded keys, and so the sink key,
        read it and need no zeroing. None: padding reads slot 0.
        ``staging``: the reused host buffers of the one copy (see
        :func:`device_int64`)."""
        r = len(query_rows)
        pad_slot = 0 if null_slot is None else null_slot
        nq = max((len(x) for x in query_rows), default=0)
        lk = max((len(x) for x in key_slots), default=0)
        lp = -(-(lk + 1) // KEY_ALIGN) * KEY_ALIGN
        q_rows: list[int] = []
        q_gather: list[int] = []
        q_pos: list[int] = []
        q_valid: list[int] = []
        k_slots: list[int] = []
        k_pos: list[int] = []
        k_valid: list[int] = []
        unpad = [0] * num_tokens
        uniform = True
        for i in range(r):
            rows, n, m = query_rows[i], len(query_rows[i]), len(key_slots[i])
            if len(query_positions[i]) != n or len(key_positions[i]) != m:
                raise ValueError(f"request {i}: rows/positions or slots/positions differ in length")
            uniform = uniform and n == nq and rows == list(range(i * nq, (i + 1) * nq))
            for j, row in enumerate(rows):
                unpad[row] = i * nq + j
            pad_q = nq - n
            q_rows += rows + [num_tokens] * pad_q
            q_gather += rows + [0] * pad_q
            q_pos += list(query_positions[i]) + [0] * pad_q
            q_valid += [1] * n + [0] * pad_q
            k_slots += list(key_slots[i]) + [pad_slot] * (lp - m)
            k_pos += list(key_positions[i]) + [0] * (lk - m)
            k_valid += [1] * m + [0] * (lk - m)
        uniform = uniform and r * nq == num_tokens
        (q_rows_t, q_gather_t, q_pos_t, q_valid_t, kv_slots_t, k_pos_t, k_valid_t, unpad_t) = (
            device_int64(
                [q_rows, q_gather, q_pos, q_valid, k_slots, k_pos, k_valid, unpad], device, staging
            )
        )
        kv_slots = kv_slots_t.view(r, lp)
        return AttentionBatch(
            q_rows=q_rows_t.view(r, nq),
            q_pos=q_pos_t.view(r, nq),
            q_valid=q_valid_t.view(r, nq).bool(),
            k_slots=kv_slots[:, :lk],
            k_pos=k_pos_t.view(r, lk),
            k_valid=k_valid_t.view(r, lk).bool(),
            num_tokens=num_tokens,
            kv_slots=kv_slots,
            uniform=uniform,
            q_gather=q_gather_t,
            unpad_index=unpad_t,
            zero_padding=null_slot is not None,
        )

    @property
    def num_keys(self) -> int:
        """``Lk``: the longest request's key count (the sink key's column)."""
        return int(self.k_slots.shape[1])

    def _visible(self, causal: bool, sliding_window: int | None, width: int) -> torch.Tensor:
        qp = self.q_pos[:, :, None]
        kp = self.k_pos[:, None, :]
        visible = self.k_valid[:, None, :].expand(-1, qp.shape[1], -1)
        if causal:
            visible = visible & (kp <= qp)
        if sliding_window is not None:
            visible = visible & (qp - kp < sliding_window)
            if not causal:
                visible = visible & (kp - qp < sliding_window)
        # padded query rows see key 0 only (results are discarded) so softmax is finite
        first = torch.zeros_like(visible)
        first[:, :, 0] = True
        visible = torch.where(~self.q_valid[:, :, None], first, visible)
        if width > visible.shape[-1]:
            visible = F.pad(visible, (0, width - visible.shape[-1]), value=False)
        return visible[:, None, :, :]

    def mask(self, *, causal: bool, sliding_window: int | None) -> torch.Tensor:
        """``[R, 1, Nq, Lk]`` visibility (built once per (causal, window))."""
        key = ("bool", causal, sliding_window)
        if key not in self._masks:
            self._masks[key] = self._visible(causal, sliding_window, self.num_keys)
        return self._masks[key]

    def padded_mask(self, *, causal: bool, sliding_window: int | None) -> torch.Tensor:
        """``[R, 1, Nq, Lp]`` visibility over :attr:`kv_slots` (padding columns
        invisible)."""
        key = ("padded", causal, sliding_window)
        if key not in self._masks:
            width = int(self.kv_slots.shape[1])
            self._masks[key] = self._visible(causal, sliding_window, width)
        return self._masks[key]

    def attn_bias(
        self, *, causal: bool, sliding_window: int | None, dtype: torch.dtype, sink: bool
    ) -> torch.Tensor:
        """``[R, 1, Nq, Lp]`` additive bias over :attr:`kv_slots`: 0 where
        visible, ``-inf`` elsewhere; with ``sink`` also 0 in the sink column
        ``Lk`` (a layer adds its per-head sink logits there). SDPA would turn a
        boolean mask into this on every call."""
        key = ("bias", causal, sliding_window, dtype, sink)
        if key not in self._masks:
            visible = self.padded_mask(causal=causal, sliding_window=sliding_window)
            if sink:
                visible = visible.clone()
                visible[..., self.num_keys] = True
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = bias.masked_fill_(~visible, float("-inf"))
        return self._masks[key]

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` -> ``[R, H, Nq, D]`` (a view when :attr:`uniform`;
        padding rows repeat row 0 otherwise and are dropped by :meth:`unpad`)."""
        r, nq = self.q_rows.shape
        rows = q if self.uniform else q.index_select(0, self.q_gather)
        return rows.view(r, nq, *q.shape[1:]).permute(0, 2, 1, 3)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """``[R, H, Nq, D]`` -> ``[T, H * D]`` in flat row order."""
        r, h, nq, d = out.shape
        flat = out.permute(0, 2, 1, 3).reshape(r * nq, h * d)
        return flat if self.uniform else flat.index_select(0, self.unpad_index)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [R, H, Nq, D]``, ``k/v [R, KVH, Lk, D]``, ``visible [R, 1, Nq, Lk]``.

    Grouped-query heads share K/V. Softmax runs in fp32. ``sinks`` ``[H]``
    adds one learned logit per head to the softmax denominator (gpt-oss).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not a multiple of {kv_heads} kv heads")
    groups = heads // kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, heads, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


_GQA_NATIVE: dict[tuple[str, torch.dtype, torch.dtype, str], bool] = {}

#: every distinct SDPA call of this process by shape: query, key and mask
#: shapes, dtypes, device and allowed backends. A backend that builds a plan
#: per shape (cuDNN) pays its setup once for each.
_SDPA_SHAPES: set[tuple[object, ...]] = set()


def sdpa_shapes_met() -> int:
    """How many distinct SDPA call shapes this process has run (it only
    grows; the bench reads it around a run's clock)."""
    return len(_SDPA_SHAPES)


#: ``PDFLASH_SDPA_BACKENDS`` names -> torch's SDPA backends
_BACKEND_NAMES = ("cudnn", "efficient", "flash", "math")


#: the environment variable :func:`sdpa_backends` reads
SDPA_BACKENDS_ENV = "PDFLASH_SDPA_BACKENDS"


def sdpa_backends() -> str:
    """The SDPA backends attention may use: ``PDFLASH_SDPA_BACKENDS``, either
    ``auto`` (torch's choice, the default) or a list of ``cudnn``,
    ``efficient``, ``flash``, ``math`` joined by ``,`` or ``+`` (e.g.
    ``efficient,flash,math`` keeps torch off cuDNN, whose attention is set up
    once per new shape), as :func:`canonical_sdpa_backends` spells it.
    Raises ``ValueError`` on an unknown name."""
    return canonical_sdpa_backends(os.environ.get(SDPA_BACKENDS_ENV, "auto"))


@functools.lru_cache(maxsize=8)
def canonical_sdpa_backends(raw: str) -> str:
    """A backends setting in one spelling: ``auto``, or the names in the
    given order joined by ``,`` (every attention call reads the setting; the
    parse runs once per distinct value). Raises ``ValueError`` on an
    unknown name or an empty list."""
    value = raw.strip().lower() or "auto"
    if value != "auto":
        names = [n.strip() for n in value.replace("+", ",").split(",") if n.strip()]
        bad = [n for n in names if n not in _BACKEND_NAMES]
        if bad or not names:
            raise ValueError(
                f"SDPA backends {value!r} (PDFLASH_SDPA_BACKENDS or a run's sdpa_backends): "
                "use 'auto' or a list joined by ',' or '+' of "
                f"{', '.join(_BACKEND_NAMES)} (unknown: {', '.join(bad) or 'none given'})"
            )
        value = ",".join(names)
    return value


def _allowed(value: str) -> AbstractContextManager[None]:
    if value == "auto":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enum = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "math": SDPBackend.MATH,
    }
    ctx: AbstractContextManager[None] = sdpa_kernel([enum[n] for n in value.split(",")])
    return ctx


def _native_gqa(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, backends: str) -> bool:
    """Whether SDPA should get K/V at their kv heads (``enable_gqa=True``)
    rather than expanded: on CUDA only where a fused kernel takes GQA with
    this mask (else SDPA would fall back to its math path, which expands
    anyway, in more kernels); on the CPU where this torch accepts it."""
    key = (q.device.type, q.dtype, mask.dtype, backends)
    if key in _GQA_NATIVE:
        return _GQA_NATIVE[key]
    ok = False
    try:
        if q.device.type == "cuda":
            params = torch.backends.cuda.SDPAParams(q, k, k, mask, 0.0, False, True)
            fused = {"cudnn": "can_use_cudnn_attention", "efficient": "can_use_efficient_attention"}
            allowed = [n for n in fused if backends == "auto" or n in backends.split(",")]
            checks = [getattr(torch.backends.cuda, fused[n], None) for n in allowed]
            ok = any(bool(check(params, False)) for check in checks if check is not None)
        else:
            # (called inside _sdpa's backend restriction)
            F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
            ok = True
    except (RuntimeError, TypeError, AttributeError):
        ok = False
    _GQA_NATIVE[key] = ok
    return ok


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """SDPA with grouped-query K/V ``[R, KVH, L, D]`` (native GQA or expanded)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not a multiple of {kv_heads} kv heads")
    backends = sdpa_backends()
    _SDPA_SHAPES.add((q.shape, k.shape, mask.shape, q.dtype, mask.dtype, q.device.type, backends))
    with _allowed(backends):
        if heads != kv_heads:
            if _native_gqa(q, k, mask, backends):
                out: torch.Tensor = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True
                )
                return out
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`masked_attention` through ``F.scaled_dot_product_attention``.

    With ``sinks`` each head gets one extra key (zeros) whose logit is set by
    an additive mask column to the sink value, and whose value row is zero:
    the softmax denominator gains ``exp(sink)`` and nothing is added to the
    output, which is exactly the sink's definition. Without sinks the boolean
    mask goes to SDPA as is. (:func:`paged_attention` does the same over an
    :class:`AttentionBatch` with the padding and masks built once per forward.)
    """
    heads = q.shape[1]
    mask: torch.Tensor = visible
    if sinks is not None:
        r, _, nq, _ = q.shape
        kvh, d = k.shape[1], k.shape[-1]
        k = torch.cat([k, k.new_zeros((r, kvh, 1, d))], dim=2)
        v = torch.cat([v, v.new_zeros((r, kvh, 1, d))], dim=2)
        logits = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        logits = logits.masked_fill(~visible, float("-inf")).expand(r, heads, nq, -1)
        sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(r, heads, nq, 1)
        mask = torch.cat([logits, sink], dim=-1)
    return _sdpa(q, k, v, mask, scaling)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    *,
    fused: bool = True,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of flat queries ``[T, H, D]`` over paged keys -> ``[T, H * D]``.

    ``fused``: torch's SDPA over the batch's padded key slots (kernels per
    call: two key/value gathers, with sinks a bias add (and two zeroings of
    the sink key unless the batch pads with a null slot), the attention, one
    unpad copy; no host sync). False: the explicit fp32 padded softmax
    (:func:`masked_attention`, the reference). ``causal`` False: keys on
    both sides of a query, within the window (the drafter's full layers).
    """
    qp = batch.pad_queries(q)
    window = spec.sliding_window
    if not fused:
        kp = k_cache[batch.k_slots].permute(0, 2, 1, 3)
        vp = v_cache[batch.k_slots].permute(0, 2, 1, 3)
        visible = batch.mask(causal=causal, sliding_window=window)
        out = masked_attention(
            qp, kp, vp, visible, scaling=spec.scaling, sinks=sinks if spec.has_sinks else None
        )
        return batch.unpad(out)
    k = k_cache[batch.kv_slots]  # [R, Lp, KVH, D]
    v = v_cache[batch.kv_slots]
    mask: torch.Tensor
    if spec.has_sinks and sinks is not None:
        # the sink: a zero key (logit = its bias, the sink) with a zero value
        lk = batch.num_keys
        if not batch.zero_padding:
            k[:, lk] = 0
            v[:, lk] = 0
        bias = batch.attn_bias(causal=causal, sliding_window=window, dtype=q.dtype, sink=True)
        width = bias.shape[-1]
        sink_col = F.pad(sinks.to(q.dtype).view(1, -1, 1, 1), (lk, width - lk - 1))
        mask = bias + sink_col  # [R, H, Nq, Lp]
    else:
        mask = batch.attn_bias(causal=causal, sliding_window=window, dtype=q.dtype, sink=False)
    out = _sdpa(qp, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), mask, spec.scaling)
    return batch.unpad(out)
