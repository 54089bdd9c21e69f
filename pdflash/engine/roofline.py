"""The HBM roofline of a verify forward: the bytes it must read, and the
device's copy bandwidth to divide them by.

A verify forward must read at least, once each:

* the target's non-expert parameters it uses (attention projections, norms,
  routers, shared experts, the final norm, ``lm_head``; attention sinks);
  of the token embedding only the rows it gathers (one per verified token);
* per MoE layer, every DISTINCT expert routed in that forward, at its stored
  bytes (the slab's format: MXFP4 and FP8 experts count their stored bytes,
  scales and biases included);
* the KV cache its attention reads: per layer and request, the keys and
  values of every position a verified token attends to (a sliding-window
  layer reads at most ``window + new - 1`` of them).

Activations, KV writes and the drafter are not counted: the roofline is a
floor on the target forward's weight and KV traffic, not a model of it.

The byte counting is pure (:func:`roofline_model`, :func:`forward_bytes`,
:func:`mean_forward_bytes`) so it can be checked by hand on a tiny model;
:func:`measure_hbm_gbps` is the one device-to-device copy probe
(``pdflash-bench moe`` and the engine rows share it, measured once per
process and device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: what :func:`measure_hbm_gbps` measures, stated on every row that uses it
HBM_PROBE_METHOD = (
    "device-to-device copy of 1 GiB, 5 times between CUDA events after one warm copy, "
    "counted as bytes read + bytes written"
)

_HBM_GBPS: dict[str, float] = {}


def measure_hbm_gbps(device: torch.device | str) -> float | str:
    """The device's HBM bandwidth in GB/s (1e9 bytes/s) from a short
    device-to-device copy (:data:`HBM_PROBE_METHOD`), measured once per
    process and device; on a device that is not CUDA, the reason it is not
    measured (a str; also when the probe's buffers do not fit)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"no CUDA device ({device.type}): HBM bandwidth not measured"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _HBM_GBPS:
        try:
            _HBM_GBPS[key] = _copy_probe(device)
        except torch.cuda.OutOfMemoryError as exc:  # not cached: a later call may fit
            return f"the 2 GiB copy probe did not fit in device memory ({exc})"
    return _HBM_GBPS[key]


def _copy_probe(device: torch.device) -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = float(start.elapsed_time(end)) / 1e3
    del src, dst
    return 5 * 2 * n / seconds / 1e9


@dataclass(frozen=True)
class RooflineModel:
    """What one forward's bytes depend on, in bytes.

    ``dense_bytes``: the non-expert parameters read once per forward (all but
    the input embedding; a tied ``lm_head`` reads the shared matrix in
    full); ``embedding_row_bytes``: one gathered embedding row;
    ``expert_bytes``: one stored expert; ``kv_token_bytes``: per layer, K
    and V of one cached position; ``windows``: per layer, its sliding window
    (None: full causal)."""

    dense_bytes: int
    embedding_row_bytes: int
    expert_bytes: int
    kv_token_bytes: tuple[int, ...]
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.kv_token_bytes) != len(self.windows):
            raise ValueError(
                f"kv_token_bytes has {len(self.kv_token_bytes)} layers, windows {len(self.windows)}"
            )
        for name in ("dense_bytes", "embedding_row_bytes", "expert_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"sliding windows must be >= 1, got {self.windows}")


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(dense_bytes, embedding_row_bytes)`` of ``model``'s parameters (an
    HF causal LM whose experts live elsewhere: what is left in it is what a
    forward reads besides experts and KV). Every distinct parameter counts
    once at its stored size, except the input embedding, which a forward
    reads only row by row, unless ``lm_head`` shares it (tied: read in
    full)."""
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    emb_weight = embedding.weight
    out_layer = model.get_output_embeddings()  # type: ignore[operator]
    tied = out_layer is not None and out_layer.weight is emb_weight
    seen: set[int] = set()
    dense = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb_weight and not tied:
            continue
        dense += p.numel() * p.element_size()
    row = emb_weight.shape[-1] * emb_weight.element_size()
    return dense, int(row)


def roofline_model(adapter: Any, kv: Any, expert_bytes: int) -> RooflineModel:
    """The :class:`RooflineModel` of ``adapter`` (its ``hf_model`` holds the
    non-expert parameters; ``attention_spec(layer)`` gives the windows) with
    KV cache ``kv`` (its dtype, kv heads, head dim) and ``expert_bytes``
    stored bytes per expert (the cache's ``expert_nbytes``)."""
    dense, row = parameter_bytes(adapter.hf_model)
    elem = torch.empty((), dtype=kv.dtype).element_size()
    per_token = 2 * int(kv.num_kv_heads) * int(kv.head_dim) * elem
    layers = int(kv.num_layers)
    windows = tuple(adapter.attention_spec(i).sliding_window for i in range(layers))
    return RooflineModel(dense, row, int(expert_bytes), (per_token,) * layers, windows)


def kv_positions_read(start: int, new: int, window: int | None) -> int:
    """Positions whose K/V a layer reads for ``new`` verified tokens after a
    KV of length ``start``: every one up to the last new token, or with a
    sliding window ``w`` the union of each query's last ``w`` positions."""
    if start < 0 or new < 1:
        raise ValueError(f"need start >= 0 and new >= 1, got {start}, {new}")
    total = start + new
    return total if window is None else min(total, window + new - 1)


def forward_bytes(
    model: RooflineModel,
    distinct_experts: Sequence[int],
    spans: Sequence[tuple[int, int]],
) -> dict[str, int]:
    """The bytes one forward must read, by part: ``distinct_experts`` per MoE
    layer (experts routed by any of its tokens), ``spans`` per request
    ``(kv length before, tokens verified)``. Keys: ``non_expert_params``,
    ``embedding_rows``, ``experts``, ``kv_cache``, ``total``."""
    if any(d < 0 for d in distinct_experts):
        raise ValueError(f"distinct expert counts must be >= 0, got {list(distinct_experts)}")
    tokens = sum(new for _, new in spans)
    kv = sum(
        per_token * kv_positions_read(start, new, window)
        for per_token, window in zip(model.kv_token_bytes, model.windows, strict=True)
        for start, new in spans
    )
    parts = {
        "non_expert_params": model.dense_bytes,
        "embedding_rows": tokens * model.embedding_row_bytes,
        "experts": sum(distinct_experts) * model.expert_bytes,
        "kv_cache": kv,
    }
    parts["total"] = sum(parts.values())
    return parts


def mean_forward_bytes(
    model: RooflineModel,
    distinct_experts: Sequence[Sequence[int]],
    spans: Sequence[Sequence[tuple[int, int]]],
) -> dict[str, float]:
    """:func:`forward_bytes` averaged over forwards (``distinct_experts[f]``
    and ``spans[f]`` of forward ``f``)."""
    if len(distinct_experts) != len(spans):
        raise ValueError(
            f"{len(distinct_experts)} forwards of routing but {len(spans)} of KV spans"
        )
    if not spans:
        raise ValueError("no forward to average")
    sums: dict[str, float] = {}
    for experts, fwd_spans in zip(distinct_experts, spans, strict=True):
        for name, value in forward_bytes(model, experts, fwd_spans).items():
            sums[name] = sums.get(name, 0.0) + value
    return {name: value / len(spans) for name, value in sums.items()}


def distinct_per_forward(
    trace: Sequence[Any], kinds: Sequence[str], kind: str, layers: int
) -> list[list[int]]:
    """Per forward of ``kind``: the distinct experts of each MoE layer, from
    an engine's routing trace (one entry of distinct flat ids per forward
    and layer, in order) and its ``trace_kinds``."""
    if len(trace) != len(kinds):
        raise ValueError(f"{len(trace)} trace entries but {len(kinds)} kinds")
    sizes = [len(t) for t, k in zip(trace, kinds, strict=True) if k == kind]
    if layers < 1 or len(sizes) % layers:
        raise ValueError(f"{len(sizes)} {kind} trace entries are not whole forwards of {layers}")
    return [sizes[i : i + layers] for i in range(0, len(sizes), layers)]


def hbm_seconds(nbytes: float, gbps: float) -> float:
    """Seconds to stream ``nbytes`` at ``gbps`` GB/s."""
    if gbps <= 0:
        raise ValueError(f"bandwidth must be positive, got {gbps}")
    return nbytes / (gbps * 1e9)
