"""Recorded device work of an all-resident offloaded MoE layer, replayed per
call (:class:`ResidentGraphs`).

An eager call of a layer whose experts are all resident issues ~15-25
kernels through ~28-38 torch calls (slot lookup, row sort, gathers, the
grouped MLP, the un-permute and the weighted sum); on a slow host that issue
time, not the device, bounds the call. Replaying a recording of that work
costs four torch calls and one graph launch: the inputs (``x``, the routed
ids, the routing weights) are copied into static buffers, the graph is
replayed, and its output is cloned (so a caller may keep it across calls).
The cache's books (pins, the deferred access record, the slots' event) stay
outside the recording, done by :class:`~pdflash.models.offload.OffloadedMoE`
on every call exactly as the eager path does.

One recording per ``(layer, token bucket, k, dtypes, device, row sort,
MLP)``: a call's token count ``T`` is padded up to the first of
:attr:`~ResidentGraphs.token_buckets` that holds it (an engine's verify
meets nearly every count from 1 to its token budget, and a recording per
exact count is rarely used twice). The padding rows read zero input and
zero weight and are routed to the experts of the call's first token (so
they read no expert the call does not, and the cache's books, kept outside
the recording over the call's own routing, never see them); their output
rows are dropped. A replay gives the bits of an eager run of the padded
inputs; its real rows equal the unpadded eager call's where the kernels are
row-independent (CPU fp32), else within the dtype's rounding (a grouped
GEMM may tile a longer group differently). ``token_buckets=()``: every
count exact, the same kernels and bits as the eager call. A recording is
made on the :attr:`~ResidentGraphs.min_uses`-th call with its key (one-off
token counts stay eager), checked once against an eager run of the same
inputs (``validate``: one that differs is dropped and its key runs eagerly
from then on), and dropped when the layer's experts moved to other slots
(it reads the slot keys and slab window of its capture). The recordings of
one token bucket share one memory pool (they never run concurrently) and
static input buffers; at most :attr:`~ResidentGraphs.max_graphs` are kept
(least recently used dropped first; a bucket whose last recording goes
frees its pool and buffers), and :meth:`ResidentGraphs.close` frees all.

The recorder is the engine's :class:`~pdflash.engine.graphs.GraphBackend`
(:class:`~pdflash.engine.graphs.CudaGraphBackend` on CUDA, one per bucket;
tests pass :class:`~pdflash.engine.graphs.EagerBackend` to run the same
selection, buffers and books on a CPU).

The switch: :func:`set_resident_graphs` or ``PDFLASH_RESIDENT_GRAPHS``
(``off``, the default, or ``on``); :func:`resident_graphs_as` sets it for a
block (the engine bench's ``resident_graphs`` run setting). :attr:`ResidentGraphs.last` says how the
last all-resident call ran (``graph`` or ``eager``) and
:attr:`ResidentGraphs.last_reason` why it ran eagerly.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from pdflash.engine.graphs import GraphBackend, Outputs, Replayable

#: the switch's values (:func:`set_resident_graphs`)
RESIDENT_GRAPH_MODES = ("off", "on")
_mode: str | None = None  # None: read PDFLASH_RESIDENT_GRAPHS on first use


def set_resident_graphs(mode: str | None) -> None:
    """Whether an all-resident layer's call replays a recording of its
    device work where it can (``on``) or always runs eagerly (``off``, the
    default). Both give the same values. None: back to the environment's
    ``PDFLASH_RESIDENT_GRAPHS``."""
    if mode is not None and mode not in RESIDENT_GRAPH_MODES:
        raise ValueError(f"resident graphs must be one of {RESIDENT_GRAPH_MODES}, got {mode!r}")
    global _mode
    _mode = mode


def resident_graphs_mode() -> str:
    """The :func:`set_resident_graphs` setting now (else
    ``PDFLASH_RESIDENT_GRAPHS``, else ``off``)."""
    global _mode
    if _mode is None:
        mode = os.environ.get("PDFLASH_RESIDENT_GRAPHS", "off") or "off"
        if mode not in RESIDENT_GRAPH_MODES:
            raise ValueError(
                f"PDFLASH_RESIDENT_GRAPHS must be one of {RESIDENT_GRAPH_MODES}, got {mode!r}"
            )
        _mode = mode
    return _mode


@contextlib.contextmanager
def resident_graphs_as(mode: str) -> Iterator[None]:
    """Run the block with the switch at ``mode`` (checked first: a bad one
    raises and changes nothing), then put back the setting as it was
    before (an unset one, which reads ``PDFLASH_RESIDENT_GRAPHS``, stays
    unset), also when the block raises."""
    if mode not in RESIDENT_GRAPH_MODES:
        raise ValueError(f"resident graphs must be one of {RESIDENT_GRAPH_MODES}, got {mode!r}")
    global _mode
    before = _mode
    _mode = mode
    try:
        yield
    finally:
        _mode = before


#: ``fn(x, ids, weights) -> (out,)``: a layer's device work over the static
#: buffers it is given (the same tensors on every call)
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "Outputs"]


#: token counts a recorded call is padded up to (:meth:`ResidentGraphs.padded_tokens`)
DEFAULT_TOKEN_BUCKETS: tuple[int, ...] = (
    *(1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128),
    *(160, 192, 256, 320, 384, 448, 512),
)


@dataclass
class _Bucket:
    """The static inputs shared by a token bucket's recordings, and the
    backend (one memory pool) they are recorded with."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    backend: GraphBackend
    graphs: int = 0
    #: rows of ``x`` and ``weights`` from the first that may be nonzero past
    #: the last call's real rows (the padding rows must read zeros)
    dirty: int = 0
    #: per real token count: the views a call of that many tokens writes
    views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def load(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Copy a call's inputs in. Rows past its ``T`` tokens are padding:
        zero input, zero weight, each routed to the experts of the call's
        first token (resident: the layer is all-resident; no expert beyond
        the call's own is read)."""
        tokens, size = x.shape[0], self.x.shape[0]
        if tokens == size:
            self.x.copy_(x)
            self.ids.copy_(ids)
            self.weights.copy_(weights)
            self.dirty = size
            return
        v = self.views.get(tokens)
        if v is None:
            k = self.ids.numel() // size
            v = self.views[tokens] = (
                self.x[:tokens],
                self.ids[: tokens * k],
                self.weights[:tokens],
                self.ids[tokens * k :].view(size - tokens, k),
            )
        x_head, ids_head, w_head, ids_tail = v
        x_head.copy_(x)
        ids_head.copy_(ids)
        w_head.copy_(weights)
        ids_tail.copy_(ids[: ids_tail.shape[1]])  # broadcast over the padding rows
        if self.dirty > tokens:  # an earlier call's real rows lie in this call's padding
            self.x[tokens : self.dirty].zero_()
            self.weights[tokens : self.dirty].zero_()
        self.dirty = tokens


@dataclass
class _Recorded:
    bucket_key: Hashable
    bucket: _Bucket
    graph: Replayable
    out: torch.Tensor
    #: what the recording read at capture: the layer's slot of each expert
    #: (the keys and window it was recorded with follow from these)
    slots: npt.NDArray[np.int64]
    #: tensors the recording reads, kept alive with it
    keep: tuple[Any, ...] = ()
    #: per real token count below the bucket's: the output rows it keeps
    heads: dict[int, torch.Tensor] = field(default_factory=dict)

    def output(self, tokens: int) -> torch.Tensor:
        """A copy of the last replay's output rows of the call's ``tokens``
        real tokens (the padding rows' are dropped)."""
        if tokens == self.out.shape[0]:
            return self.out.clone()
        head = self.heads.get(tokens)
        if head is None:
            head = self.heads[tokens] = self.out[:tokens]
        return head.clone()


@dataclass
class ResidentGraphStats:
    """Counters since the last :meth:`ResidentGraphs.reset_stats`."""

    replays: int = 0
    captures: int = 0
    capture_failures: int = 0
    validated: int = 0
    mismatches: int = 0
    #: recordings dropped to keep at most ``max_graphs``
    evictions: int = 0
    #: recordings dropped because the layer's experts moved to other slots
    stale: int = 0
    #: host seconds spent recording (capture, first replay and the eager
    #: check), failed recordings included
    capture_s: float = 0.0
    #: eager calls by reason
    eager: Counter[str] = field(default_factory=Counter)
    #: the distinct recording keys the calls asked for
    keys: set[Hashable] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "replays": self.replays,
            "captures": self.captures,
            "capture_s": self.capture_s,
            "distinct_keys": len(self.keys),
            "capture_failures": self.capture_failures,
            "validated": self.validated,
            "mismatches": self.mismatches,
            "evictions": self.evictions,
            "stale": self.stale,
            "eager": dict(self.eager),
        }


def _cuda_backend(device: torch.device) -> GraphBackend:
    from pdflash.engine.graphs import CudaGraphBackend

    return CudaGraphBackend(device)


class ResidentGraphs:
    """A bounded set of recorded all-resident layer calls (see the module
    docstring).

    Args:
        backend_factory: ``device -> GraphBackend``, one per token bucket
            (default: :class:`~pdflash.engine.graphs.CudaGraphBackend`, CUDA
            only; any other device then runs eagerly, reason ``not_cuda``).
        max_graphs: recordings kept at most (least recently used dropped).
        max_tokens: larger calls run eagerly (``tokens_over_max``).
        min_uses: a key is recorded on its ``min_uses``-th call (earlier
            calls run eagerly, reason ``warming``).
        token_buckets: a call's token count is padded up to the first of
            these it fits (:meth:`padded_tokens`; past the last one it stays
            exact), so counts that differ a little share one recording; None
            or ``()``: every count exact.
        validate: check each new recording's first replay against an eager
            run of the same inputs, bit for bit.
    """

    def __init__(
        self,
        backend_factory: Callable[[torch.device], GraphBackend] | None = None,
        *,
        max_graphs: int = 128,
        max_tokens: int = 512,
        min_uses: int = 2,
        validate: bool = True,
        token_buckets: tuple[int, ...] | None = DEFAULT_TOKEN_BUCKETS,
    ) -> None:
        if max_graphs < 1 or max_tokens < 1 or min_uses < 1:
            raise ValueError(
                f"max_graphs, max_tokens and min_uses must be >= 1, got "
                f"{max_graphs}, {max_tokens}, {min_uses}"
            )
        self.token_buckets = token_buckets
        self._factory = backend_factory
        self.max_graphs = max_graphs
        self.max_tokens = max_tokens
        self.min_uses = min_uses
        self.validate = validate
        self._recorded: OrderedDict[Hashable, _Recorded] = OrderedDict()
        self._buckets: dict[Hashable, _Bucket] = {}
        self._uses: Counter[Hashable] = Counter()
        #: keys whose recording failed or disagreed with eager: the reason
        self._failed: dict[Hashable, str] = {}
        self.stats = ResidentGraphStats()
        #: how the last all-resident call ran: ``graph`` or ``eager`` (None: none yet)
        self.last: str | None = None
        #: why the last call ran eagerly (None after a replay)
        self.last_reason: str | None = None

    @property
    def num_graphs(self) -> int:
        return len(self._recorded)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def failures(self) -> dict[Hashable, str]:
        return dict(self._failed)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The token counts a call is padded up to (``()``: exact counts).
        Setting them checks them (a bad value raises and changes nothing);
        recordings already made stay under their own keys."""
        return self._token_buckets

    @token_buckets.setter
    def token_buckets(self, token_buckets: tuple[int, ...] | None) -> None:
        buckets = tuple(token_buckets or ())
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"token_buckets must be increasing and >= 1, got {token_buckets!r}")
        self._token_buckets = buckets

    def padded_tokens(self, tokens: int) -> int:
        """The token count a recorded call of ``tokens`` rows runs at: the
        first bucket that holds them (capped at ``max_tokens``), else
        ``tokens``."""
        for bucket in self.token_buckets:
            if bucket >= tokens:
                return bucket if bucket <= self.max_tokens else tokens
        return tokens

    def reset_stats(self) -> None:
        self.stats = ResidentGraphStats()

    def eager(self, reason: str) -> None:
        """Note an eager call and why (the caller runs it eagerly)."""
        self.stats.eager[reason] += 1
        self.last, self.last_reason = "eager", reason

    def _eager(self, reason: str) -> torch.Tensor | None:
        self.eager(reason)
        return None

    def backend_blocker(self, device: torch.device) -> str | None:
        """Why no recording can be made on ``device``, or None."""
        if self._factory is None and device.type != "cuda":
            return "not_cuda"
        return None

    def run(
        self,
        key: Hashable,
        bucket_key: Hashable,
        slots: npt.NDArray[np.int64],
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        make_fn: Callable[[], tuple[StepFn, tuple[Any, ...]]],
        tokens: int | None = None,
    ) -> torch.Tensor | None:
        """The call's output from a replay of ``key``'s recording (made now
        if this is the key's ``min_uses``-th call), or None (noted, with the
        reason) where it runs eagerly. ``slots``: the layer's expert slots
        now (a recording made with others is dropped); ``bucket_key`` names
        the static buffers (shapes, dtypes, device, ``tokens`` rows) of
        ``x``, ``ids`` (int64 ``[T * k]``) and ``weights``; ``tokens``: the
        rows the recording runs over (default ``x``'s ``T``; more: the
        call is padded, see :meth:`_Bucket.load`, and the output keeps its
        ``T`` rows); ``make_fn()`` gives the step over given buffers and the
        tensors it reads (kept alive with the recording)."""
        if tokens is None:
            tokens = x.shape[0]
        elif tokens < x.shape[0]:
            raise ValueError(f"tokens {tokens} < the call's {x.shape[0]} rows")
        self.stats.keys.add(key)
        if key in self._failed:
            return self._eager("capture_failed")
        rec = self._recorded.get(key)
        if rec is not None and not np.array_equal(rec.slots, slots):
            self.stats.stale += 1
            self._drop(key)
            self._uses[key] = 0
            rec = None
        if rec is None:
            self._uses[key] += 1
            if self._uses[key] < self.min_uses:
                if len(self._uses) > 8 * self.max_graphs:  # one-off keys: forget them
                    self._uses.clear()
                return self._eager("warming")
            began = time.perf_counter()
            try:
                rec = self._record(key, bucket_key, slots, x, ids, weights, make_fn, tokens)
            finally:
                self.stats.capture_s += time.perf_counter() - began
            if rec is None:
                return self._eager("capture_failed")
            self.last, self.last_reason = "graph", None
            return rec.output(x.shape[0])
        self._recorded.move_to_end(key)
        rec.bucket.load(x, ids, weights)
        rec.graph.replay()
        self.stats.replays += 1
        self.last, self.last_reason = "graph", None
        return rec.output(x.shape[0])

    def _bucket(
        self,
        bucket_key: Hashable,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        tokens: int,
    ) -> _Bucket:
        """The static buffers of ``bucket_key``: ``tokens`` rows (the
        padded count) of ``x``'s and ``weights``' kind, zeros (padding
        rows read zeros)."""
        b = self._buckets.get(bucket_key)
        if b is None:
            factory = self._factory or _cuda_backend
            k = ids.numel() // x.shape[0]
            b = _Bucket(
                x=x.new_zeros((tokens, *x.shape[1:])),
                ids=torch.zeros(tokens * k, dtype=torch.int64, device=ids.device),
                weights=weights.new_zeros((tokens, *weights.shape[1:])),
                backend=factory(x.device),
            )
            self._buckets[bucket_key] = b
        return b

    def _record(
        self,
        key: Hashable,
        bucket_key: Hashable,
        slots: npt.NDArray[np.int64],
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        make_fn: Callable[[], tuple[StepFn, tuple[Any, ...]]],
        tokens: int,
    ) -> _Recorded | None:
        while len(self._recorded) >= self.max_graphs:
            self._drop(next(iter(self._recorded)))
            self.stats.evictions += 1
        b = self._bucket(bucket_key, x, ids, weights, tokens)
        b.load(x, ids, weights)
        fn, keep = make_fn()
        try:
            graph, outs = b.backend.capture(lambda: fn(b.x, b.ids, b.weights))
            graph.replay()
        except Exception as exc:  # any capture failure: the key runs eagerly
            self._failed[key] = f"{type(exc).__name__}: {exc}"
            self.stats.capture_failures += 1
            self._release_if_empty(bucket_key)
            return None
        (out,) = outs
        self.stats.captures += 1
        if self.validate:
            self.stats.validated += 1
            if not torch.equal(out, fn(b.x, b.ids, b.weights)[0]):
                self.stats.mismatches += 1
                self._failed[key] = "replay_mismatch: the first replay disagreed with eager"
                del graph, outs, out
                self._release_if_empty(bucket_key)
                return None
        rec = _Recorded(bucket_key, b, graph, out, slots.copy(), keep)
        b.graphs += 1
        self._recorded[key] = rec
        return rec

    def _drop(self, key: Hashable) -> None:
        rec = self._recorded.pop(key)
        rec.bucket.graphs -= 1
        self._release_if_empty(rec.bucket_key)

    def _release_if_empty(self, bucket_key: Hashable) -> None:
        b = self._buckets.get(bucket_key)
        if b is not None and b.graphs == 0:
            del self._buckets[bucket_key]  # its pool goes with its last recording

    def clear(self) -> None:
        """Drop every recording, bucket and pool (the failures are kept)."""
        self._recorded.clear()
        self._buckets.clear()
        self._uses.clear()

    def close(self) -> None:
        """Free every recording, its pool and the static buffers."""
        self.clear()
        self._failed.clear()
