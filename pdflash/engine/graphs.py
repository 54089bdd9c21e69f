"""CUDA graphs for the target forward: record a step's kernels once per shape
bucket, replay them for every later step of that bucket.

A verify step of a few hundred tokens launches thousands of small kernels;
on a fast GPU the host issuing them, not the GPU, sets the step's time. A
:class:`GraphRunner` takes the steps it can (see :meth:`GraphRunner.forward`)
and runs each as one replay of a recorded graph:

* **Buckets.** A step of ``R`` requests with at most ``Nq`` tokens each and at
  most ``Lk`` keys each is padded to the bucket ``(R_b, Nq_b, Lp_b)``: the
  next request count in :attr:`GraphRunner.request_buckets`, the next power
  of two of ``Nq`` and the next key width in :func:`key_buckets` above
  ``Lk`` (``Lp_b`` includes the sink column; see
  :class:`~pdflash.engine.attention.AttentionBatch`). Every request gets
  ``Nq_b`` flat rows (request ``i``'s at ``i * Nq_b ..``), so the padded
  batch is always ``uniform`` and the attention never gathers queries.
* **Padding.** Padded rows are invalid queries (each sees key 0 only, so
  its softmax is finite; its output is dropped), write their K/V to the KV
  cache's scratch row (:attr:`~pdflash.engine.kv_cache.PagedKVCache.scratch_slot`,
  never read), and count their routing against a dummy chunk (row ``R_b``
  of the routing grid, never read back). Padded keys read the null slot
  (always zero) and are masked. The real rows' results do not depend on the
  padding (tested exactly on the CPU in fp32).
* **Static buffers.** Each bucket owns one int64 device buffer for every
  index the step needs (positions, KV slots, the attention batch's index
  tensors, each row's chunk), filled by one host->device copy per step, and
  the token-id buffer; the graph reads only these, its weights, the KV and
  the expert slab. Its outputs (last residual, routing grid, each MoE
  layer's top-k ids, the captured hidden states) are the tensors the
  capture returned: a replay overwrites them, so everything that leaves the
  step is gathered out of them (a new tensor) before the next replay.
* **Outside the graph.** The host plan (the KV's growth only: the static
  buffers are filled from its block tables, vectorised) and the one copy
  in from a page-locked buffer the bucket reuses, the final norm and
  ``lm_head`` over the wanted rows, the routing grid's read-back, the
  expert cache's books (:meth:`~pdflash.models.offload.OffloadedMoE.pin_resident`
  before, :meth:`~pdflash.models.offload.OffloadedMoE.book_resident` after:
  the pins, access records and one slot event, for every layer in one
  pass), and all sampling and randomness.
* **Host syncs of a replayed step**, and why each remains: the routing
  grid's read-back (the scheduler, the caches' books and the Belady trace
  need the routed union on the host; the engine then reads the logits it
  accepts with, outside this module); that is the only one in steady
  state. Its copy is queued right behind the replay, before the gathers,
  the final norm and ``lm_head``, and the host waits for that copy only
  (an event): the expert cache's books and the split of the outputs run
  on the host while the device still runs ``lm_head``. Before a bucket's next fill the
  host waits for the event after its last index copy, which that
  read-back has already passed (it waits only after a step that failed
  between the two). A new graph's capture and its first-replay check
  (``outputs_agree`` reads the comparison) sync, which
  :meth:`GraphRunner.prepare` moves out of the steps; dropping a graph to
  make room drains the stream. The cache's deferred accesses are read
  back only when it must choose a victim (never under B3).
* **Whole-step graphs** need every expert resident and no host code that
  sees a layer's tensors (observers, routed hooks); the host-only
  ``before_moe_hooks`` (e.g. the layer-cyclic eviction policy's) are called
  for every layer right before the replay. Otherwise the step runs as
  pieces (below). The expert cache's device slot table is baked into a
  graph: if the cache replaced it (a load or eviction), that bucket's graph
  is dropped and captured again.
* **Eager fallback**, counted per reason in :attr:`GraphRunner.stats`,
  whenever a step cannot be replayed: a prefill (rows without logits), a
  routing source, a KV cache without the scratch row, a step larger than
  the largest bucket, a capture that failed for the bucket (never
  retried), or (with ``piecewise`` off) the reasons above. At most
  ``max_graphs`` buckets are kept; the least recently used makes room.

**Piecewise steps** (:meth:`GraphRunner.piecewise_forward`): where the
whole step cannot be one graph because of the experts or the layer hooks
(:data:`PIECEWISE_REASONS`: the offloaded baselines), each MoE layer's
attention and router, with the dense layers before it, is a piece
(:func:`layer_spans`) recorded per bucket; between the replayed pieces the
before-MoE hooks, the routed hooks, the MoE block (its copies, host syncs and
books as in the eager forward), the residual and the observers run eagerly
on the real rows only, so padded rows never route to an expert that would
be copied. The residual entering the next piece is written into its static
input buffer.

**Pre-capture** (:meth:`GraphRunner.prepare`, through
:meth:`~pdflash.engine.engine.Engine.prepare_graphs`): before any request,
every whole-step bucket a run can meet (:meth:`GraphRunner.verify_buckets`:
its request counts, row counts and key widths from the prompt and output
lengths) is recorded and checked on a synthetic step over temporary KV
sequences, within a bound on graphs held and bytes, so no later step pays
a capture or a first-replay check. Where a step can only run as pieces
(``piecewise`` on, a :data:`PIECEWISE_REASONS` blocker), the bucket's
pieces are recorded and checked the same way instead (the MoE blocks, which
run eagerly between them, are not run: no copy, no cache book), up to
``max_piecewise_buckets``; the drafter's likewise
(:meth:`GraphRunner.draft_buckets`, :meth:`GraphRunner.prepare_drafts`:
every new-context bucket a draft of so many requests can have).

**Check.** With ``validate`` (default), every new graph's first replay is
compared with an eager run of the same step on the same static inputs
(:func:`outputs_agree`); a graph that disagrees is dropped and its bucket
runs eagerly from then on (reason ``replay_mismatch``).

The drafter's forward (:meth:`GraphRunner.draft_forward`) is replayed the
same way with its own buckets ``(R_b, Nq_b, C_b, Lp_b)``: ``C_b``, the new
context rows of the step (the target features of the tokens the last
verify accepted, all requests together), is the next power of two of at
least 16; padded context rows write their K/V to the drafter's scratch row
and are nobody's keys. It has no hooks and no expert books, so it is
replayed under every baseline. Its counters are :attr:`GraphRunner.draft_stats`.

The backend is a :class:`GraphBackend`: :class:`CudaGraphBackend` wraps
``torch.cuda.CUDAGraph`` (an eager warm-up on a side stream, then the
capture into one memory pool shared by every graph of the runner);
:class:`EagerBackend` calls the step again on "replay" and copies its results
into the first call's tensors, so the bucketing, padding, static buffers,
books and fallbacks run (and are tested) on a CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from pdflash.engine.attention import KEY_ALIGN, AttentionBatch
from pdflash.engine.target import step_logits
from pdflash.models.offload import shared_routing_reads

if TYPE_CHECKING:
    from pdflash.engine.drafter import DFlashDrafter, DraftPlan
    from pdflash.engine.kv_cache import PagedKVCache
    from pdflash.engine.target import Chunk, ForwardOutput, StepPlan, TargetRunner
    from pdflash.models.offload import OffloadedMoE

#: a step's static outputs, in a fixed order (see :class:`_Entry`)
Outputs = tuple[torch.Tensor, ...]

#: why a whole-step graph is refused where a piecewise step still runs: the
#: experts (offloaded, hooked or on the host) or layer hooks need the host
#: between layers, which the pieces leave to eager code
PIECEWISE_REASONS = frozenset(
    {
        "layer_hooks",
        "moe_loop_path",
        "grouped_mm_fallback",
        "moe_route_hooks",
        "host_experts",
        "experts_not_resident",
    }
)

#: request-count buckets (a step of ``R`` requests runs in the first >= R)
REQUEST_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def key_buckets(limit: int = 1 << 16) -> tuple[int, ...]:
    """Padded key widths: multiples of 64 up to 256, then 1.5x and 2x steps
    (64, 128, 192, 256, 384, 512, 768, 1024, ...) up to ``limit``; each a
    multiple of :data:`~pdflash.engine.attention.KEY_ALIGN`. The padding adds
    at most half the keys (masked; the attention is a small part of a step)."""
    out = [64, 128, 192, 256]
    while out[-1] * 2 <= limit:
        base = out[-1]
        out += [base * 3 // 2, base * 2]
    widths = tuple(w for w in out if w <= limit)
    assert all(w % KEY_ALIGN == 0 for w in widths)
    return widths


class Replayable(Protocol):
    """A recorded step: ``replay()`` reruns it into its static outputs."""

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Records a step function. ``capture(fn)`` returns the recording and the
    tensors ``fn`` returned during it (the static outputs every replay
    overwrites). The step has not necessarily run when ``capture`` returns:
    the caller replays it."""

    @property
    def name(self) -> str: ...

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]: ...


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after.

    A capture must not run into a collection: torch (since it stopped
    collecting before each capture) lets cyclic garbage be freed whenever
    an allocation triggers the collector, and garbage holding an earlier
    run's graphs then destroys them mid-capture, which CUDA forbids: the
    capture is invalidated, and a pinned tensor freed with it can abort the
    process from its destructor (seen on the H200 with piecewise graphs,
    one engine run after another in one process). Deferred, that garbage is
    collected after the capture.

    Pauses may overlap (captures in several threads): the collector comes
    back, if it was on before the first, when the last one ends.
    """
    books = _GC_PAUSES
    with books.lock:
        if books.active == 0:
            books.was_enabled = gc.isenabled()
            gc.disable()
        books.active += 1
    try:
        yield
    finally:
        with books.lock:
            books.active -= 1
            if books.active == 0 and books.was_enabled:
                gc.enable()


class _CollectorPauses:
    """:func:`gc_paused`'s books: the pauses active and whether the
    collector was on before the first of them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.was_enabled = False


_GC_PAUSES = _CollectorPauses()


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` per bucket, all in one memory pool.

    ``capture``: ``warmup_runs`` eager runs of the step on a side stream
    (lazy initialisation: cuBLAS/cuDNN plans, Triton compiles, cached index
    tensors), then the capture into the shared pool. Capture errors mode
    ``thread_local``: the copy issuer's thread keeps issuing its own copies
    meanwhile. The garbage collector is paused during the capture
    (:func:`gc_paused`). Graphs sharing the pool never run concurrently (one
    stream) and keep their outputs alive, so no graph's outputs are
    another's scratch.
    """

    name = "cuda"

    def __init__(self, device: torch.device | str, *, warmup_runs: int = 1) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if warmup_runs < 1:
            raise ValueError(f"warmup_runs must be >= 1, got {warmup_runs}")
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(self.warmup_runs):
                    fn()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with (
                    gc_paused(),
                    torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
                ):
                    out = fn()
            except BaseException:
                # a capture that failed leaves its pool unusable for the next
                # capture (torch's allocator asserts on it): start a new one
                self.pool = torch.cuda.graph_pool_handle()
                raise
        return graph, out


class _EagerReplay:
    def __init__(self, fn: Callable[[], Outputs], out: Outputs) -> None:
        self.fn = fn
        self.out = out

    def replay(self) -> None:
        fresh = self.fn()
        for static, new in zip(self.out, fresh, strict=True):
            static.copy_(new)


class EagerBackend:
    """A stand-in for CUDA graphs on any device: ``capture`` runs the step
    twice (a warm-up, then the "capture"); ``replay`` runs it again and
    copies the results into the captured outputs, which is what a replayed
    graph's outputs see. Counts the step calls (``calls``)."""

    name = "eager"

    def __init__(self) -> None:
        self.calls = 0

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        def counted() -> Outputs:
            self.calls += 1
            return fn()

        counted()  # the warm-up, as the CUDA backend
        out = counted()
        return _EagerReplay(counted, out), out


class _PaddedGrid:
    """The padded query grid a graph shape declares (its dataclass holds the
    fields): ``requests`` x ``queries`` rows against ``key_width`` key columns,
    the last of which is the sink column (a draft graph leaves it unused)."""

    requests: int
    queries: int
    key_width: int

    @property
    def rows(self) -> int:
        """Query rows, all requests together."""
        return self.requests * self.queries

    @property
    def keys(self) -> int:
        """``Lk``: key columns before the sink column."""
        return self.key_width - 1


@dataclass(frozen=True)
class BucketKey(_PaddedGrid):
    """A graph's shape: padded requests, rows per request, key width (with
    the sink column)."""

    requests: int
    queries: int
    key_width: int


@dataclass(frozen=True)
class DraftKey(_PaddedGrid):
    """A draft graph's shape: padded requests, block rows per request, new
    context rows (all requests together), key width (no sink column is
    used), and the context features' width and dtype."""

    requests: int
    queries: int
    context: int
    key_width: int
    features: int
    dtype: str


@dataclass
class GraphStats:
    """What the runner did: graphs captured (and recaptured after the
    expert slot table changed), steps replayed, captures that failed, and
    steps run eagerly, per reason."""

    captures: int = 0
    recaptures: int = 0
    replays: int = 0
    capture_failures: int = 0
    #: new graphs whose first replay was checked against an eager run of
    #: the same step, and those that disagreed (dropped, bucket eager)
    validated: int = 0
    replay_mismatches: int = 0
    #: steps run as pieces (the dense parts replayed, the experts eager)
    piecewise_steps: int = 0
    #: buckets dropped (least recently used) to stay within the graph limit
    evicted: int = 0
    #: graphs recorded (and checked) ahead of any request by
    #: :meth:`GraphRunner.prepare` (also counted in ``captures``/``validated``)
    prepared: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        """Every counter by its field name, in field order; the fallbacks as
        their total (``eager_fallbacks``) and per reason, sorted."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name != "fallbacks"
        }
        out["eager_fallbacks"] = sum(self.fallbacks.values())
        out["eager_fallback_reasons"] = dict(sorted(self.fallbacks.items()))
        return out


class _Staging:
    """A bucket's int64 index values on the host, reused every step: on
    CUDA page-locked, so the one copy to the device is asynchronous, with
    the event after that copy (the next step's values are written only once
    it ran; the step's routing read-back has normally waited for it)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.tensor = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.array: np.ndarray = self.tensor.numpy()
        self.copied: Any = None  # torch.cuda.Event after the last copy, on CUDA
        #: the token counts per request whose row layout :attr:`array`
        #: holds (the fields that depend on them alone, and the padding),
        #: with that layout's per-row request, index within it and flat row
        #: (None: nothing held; set only by a fill that completed)
        self.lens: tuple[int, ...] | None = None
        self.row_layout: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def _writable(entry: _Entry | _PieceEntry | _DraftEntry) -> np.ndarray:
    """The entry's host index values, once its last copy has run."""
    staging = entry.host
    if staging.copied is not None:
        staging.copied.synchronize()  # a no-op unless a step ended before its read-back
        staging.copied = None
    return staging.array


def _upload(entry: _Entry | _PieceEntry | _DraftEntry) -> None:
    """One copy of the entry's host index values into its device buffer."""
    staging = entry.host
    if entry.packed.is_cuda:
        entry.packed.copy_(staging.tensor, non_blocking=True)
        staging.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        staging.copied.record(torch.cuda.current_stream(entry.packed.device))
    else:
        entry.packed.copy_(staging.tensor)


class _PackedLayout:
    """Offsets of named index fields laid end to end, in the given order,
    in one packed int64 buffer (one host->device copy per step)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for name, size in sizes.items():
            self.offsets[name] = (at, at + size)
            at += size
        self.size = at

    def view(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        lo, hi = self.offsets[name]
        return packed[lo:hi]


class _Layout(_PackedLayout):
    """Offsets of the index fields in a bucket's packed int64 buffer."""

    def __init__(self, key: BucketKey) -> None:
        t, r = key.rows, key.requests
        super().__init__(
            {
                "positions": t,
                "slots": t,
                "row_chunk": t,
                "q_pos": t,
                "q_valid": t,
                "kv_slots": r * key.key_width,
                "k_pos": r * key.keys,
                "k_valid": r * key.keys,
                "real_rows": t,
            }
        )


@dataclass
class _Entry:
    key: BucketKey
    layout: _Layout
    packed: torch.Tensor  # int64 [layout.size], on the device
    ids: torch.Tensor  # int64 [rows], on the device
    host: _Staging  # the step's index values before the copy
    graph: Replayable | None = None
    #: (last residual [rows, H], routing grid [R_b + 1, L, E], top-k ids
    #: [L, rows, k], captured residuals [rows, H] each)
    outputs: Outputs = ()
    #: the expert cache's device slot table the graph reads (kept alive)
    slot_table: torch.Tensor | None = None
    #: the first replay was checked against an eager run (or need not be)
    checked: bool = False
    #: the routing grid's host copy (page-locked on CUDA), made at the first
    #: replay and reused (:class:`_RoutedRead`)
    routed_host: torch.Tensor | None = None


class _RoutedRead:
    """The real requests' rows of a replay's routing grid, copied to the
    host as soon as it is launched (on CUDA asynchronously, into the entry's
    page-locked buffer, with an event behind the copy), so that the
    stream's later work (the gathers, the final norm, ``lm_head``) is not
    waited for. :meth:`result` waits for that copy only and returns an
    array of its own (the buffer and the grid are overwritten by later
    steps)."""

    def __init__(self, entry: _Entry, routed: torch.Tensor, requests: int) -> None:
        rows = routed[:requests]
        self.event: Any = None
        if not rows.is_cuda:
            self.host = rows
            return
        buf = entry.routed_host
        if buf is None or buf.shape != routed.shape:
            buf = torch.empty(routed.shape, dtype=routed.dtype, pin_memory=True)
            entry.routed_host = buf
        self.host = buf[:requests]
        self.host.copy_(rows, non_blocking=True)
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.event.record(torch.cuda.current_stream(rows.device))

    def result(self) -> np.ndarray:
        """The rows on the host (the step's one sync on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return np.array(self.host.numpy(), copy=True)


@dataclass
class _PieceEntry:
    """A piecewise bucket: the index and id buffers of :class:`_Entry`, the
    residual entering every piece after the first, the routing grid, and
    one graph (with its outputs) per piece of :func:`layer_spans`."""

    key: BucketKey
    layout: _Layout
    packed: torch.Tensor
    ids: torch.Tensor
    host: _Staging
    x_in: torch.Tensor  # [rows, H]
    routed: torch.Tensor  # [R_b + 1, layers, experts] bool
    pieces: list[Replayable | None]
    outputs: list[Outputs]
    checked: list[bool]


class _DraftLayout(_PackedLayout):
    """Offsets of a draft bucket's index fields in its packed int64 buffer:
    the K/V rows' slots and positions (block rows, then context rows), the
    queries' positions and validity, the attention's key slots, positions
    and validity, and the real block rows."""

    def __init__(self, key: DraftKey) -> None:
        t, r, c = key.rows, key.requests, key.context
        super().__init__(
            {
                "kv_slots": t + c,
                "kv_pos": t + c,
                "q_pos": t,
                "q_valid": t,
                "key_slots": r * key.key_width,
                "k_pos": r * key.keys,
                "k_valid": r * key.keys,
                "real_rows": t,
            }
        )


@dataclass
class _DraftEntry:
    key: DraftKey
    layout: _DraftLayout
    packed: torch.Tensor  # int64 [layout.size]
    host: _Staging
    context: torch.Tensor  # [context, features]: the new context rows' features
    embeddings: torch.Tensor  # [rows, hidden]: the block rows' embeddings
    graph: Replayable | None = None
    outputs: Outputs = ()  # (final-normed hidden [rows, hidden],)
    checked: bool = False


class GraphRunner:
    """Replays recorded target forwards per shape bucket (module docstring).

    Args:
        backend: :class:`CudaGraphBackend` on CUDA; :class:`EagerBackend` to
            run the same machinery without graphs (tests, CPU).
        request_buckets: ascending request counts a step is padded to.
        max_queries: the most tokens per request a graphed step may have
            (rows per request are the next power of two).
        max_key_width: the widest padded key axis (longer steps run eagerly).
        max_graphs: whole-step buckets kept at most (the least recently
            used is dropped for a new one); room for what :meth:`prepare`
            records for a bench's c=16 run (block 16: 6 request buckets x 5
            row buckets).
        max_draft_graphs: the drafter's buckets kept at most (likewise).
        max_draft_context: the most new context rows a graphed draft step has.
        validate: check every new graph's first replay against an eager run
            of the same step on the same static inputs (:func:`outputs_agree`);
            a graph that disagrees is dropped, its bucket runs eagerly from
            then on, and that step returns the eager run's results.
        piecewise: steps the whole-step graph cannot take because of the
            experts or layer hooks (:data:`PIECEWISE_REASONS`) run as pieces:
            each MoE layer's attention and router (and any dense layers
            before it) replayed, its experts and hooks eager in between, on
            the real rows only (:meth:`piecewise_forward`).
        max_piecewise_buckets: piecewise buckets kept at most (each holds
            one graph per MoE layer; likewise). As many as ``max_graphs``:
            where the pre-capture stops short, the steps of the buckets past
            it record their pieces inside the clock.
    """

    def __init__(
        self,
        backend: GraphBackend,
        *,
        request_buckets: Sequence[int] = REQUEST_BUCKETS,
        max_queries: int = 64,
        max_key_width: int = 1 << 14,
        max_graphs: int = 48,
        max_draft_graphs: int = 64,
        max_draft_context: int = 4096,
        validate: bool = True,
        piecewise: bool = True,
        max_piecewise_buckets: int = 48,
    ) -> None:
        buckets = tuple(int(b) for b in request_buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"request_buckets must be ascending positive ints, got {buckets}")
        if max_queries < 1 or max_graphs < 1:
            raise ValueError("max_queries and max_graphs must be >= 1")
        self.backend = backend
        self.request_buckets = buckets
        self.max_queries = int(max_queries)
        self.key_widths = key_buckets(max_key_width)
        if not self.key_widths:
            raise ValueError(f"max_key_width {max_key_width} is below the smallest bucket")
        self.max_graphs = int(max_graphs)
        self.max_draft_graphs = int(max_draft_graphs)
        self.max_draft_context = int(max_draft_context)
        self.validate = bool(validate)
        self.piecewise = bool(piecewise)
        self.max_piecewise_buckets = int(max_piecewise_buckets)
        self._piece_entries: dict[BucketKey, _PieceEntry] = {}
        self.stats = GraphStats()
        #: the drafter's steps (:meth:`draft_forward`)
        self.draft_stats = GraphStats()
        self._entries: dict[BucketKey, _Entry] = {}
        #: buckets whose graph failed (a piecewise bucket as ("piecewise", key))
        self._failed: dict[BucketKey | DraftKey | tuple[str, BucketKey], str] = {}
        self._draft_entries: dict[DraftKey, _DraftEntry] = {}

    @property
    def num_graphs(self) -> int:
        """Target-forward graphs held."""
        return sum(1 for e in self._entries.values() if e.graph is not None)

    @property
    def num_piecewise_buckets(self) -> int:
        """Piecewise buckets held (each holds one recorded piece per MoE
        layer, recorded as its steps reach them)."""
        return len(self._piece_entries)

    @property
    def num_draft_graphs(self) -> int:
        """Drafter graphs held."""
        return sum(1 for e in self._draft_entries.values() if e.graph is not None)

    def reset_stats(self) -> None:
        """Zero the counters (the graphs are kept)."""
        self.stats = GraphStats()
        self.draft_stats = GraphStats()

    # -- decisions ---------------------------------------------------------------

    def bucket(self, plan: StepPlan) -> BucketKey | str:
        """The bucket of a step, or why it has none."""
        r = len(plan.lens)
        i = bisect.bisect_left(self.request_buckets, r)
        if i == len(self.request_buckets):
            return "too_many_requests"
        nq = max(plan.lens)
        if nq > self.max_queries:
            return "too_many_tokens_per_request"
        queries = 1 << (nq - 1).bit_length()
        # each request's keys (its new rows included): the key lists' lengths
        # where the plan has them, else (a replayed step's plan) start + tokens
        lk = (
            max(len(k) for k in plan.k_slots)
            if plan.k_slots
            else max(s + n for s, n in zip(plan.starts, plan.lens, strict=True))
        )
        j = bisect.bisect_left(self.key_widths, lk + 1)
        if j == len(self.key_widths):
            return "too_many_keys"
        return BucketKey(self.request_buckets[i], queries, self.key_widths[j])

    def blocker(self, runner: TargetRunner, chunks: Sequence[Chunk]) -> str | None:
        """Why ``runner`` must run this step eagerly (before bucketing), or None."""
        if not chunks:
            return "empty"
        if not all(c.all_logits for c in chunks):
            return "prefill"
        if runner.kv.scratch_slot is None:
            return "kv_without_scratch_slot"
        hooked = runner.hooked
        if hooked is not None:
            return hooked
        moe = runner.offloaded_runtime
        if moe is None:
            return "adapter_without_offloaded_runtime"
        return moe.graph_blocker()

    # -- the step ------------------------------------------------------------------

    def forward(
        self, runner: TargetRunner, chunks: Sequence[Chunk], plan: StepPlan
    ) -> ForwardOutput | None:
        """Run the planned step as a replay and return its output, or None
        (counted) when it must run eagerly. Raises what the replay raises
        (the caller rolls the KV back; the cache's pins are undone here)."""
        reason = self.blocker(runner, chunks)
        if reason in PIECEWISE_REASONS and self.piecewise:
            return self.piecewise_forward(runner, chunks, plan)
        key: BucketKey | str = reason if reason is not None else self.bucket(plan)
        if isinstance(key, str):
            self.stats.fallbacks[key] += 1
            return None
        if key in self._failed:
            self.stats.fallbacks[_failure_reason(self._failed[key])] += 1
            return None
        moe = runner.offloaded_runtime
        assert moe is not None
        entry = _recent(self._entries, key)
        table = moe.cache.device_slot_table()
        if entry is not None and entry.graph is not None and entry.slot_table is not table:
            # the graph reads a slot table the cache has since replaced
            entry.graph, entry.outputs, entry.slot_table = None, (), None
            self.stats.recaptures += 1
        if entry is None:
            _make_room(self._entries, self.max_graphs, self.stats)
            entry = self._new_entry(runner, key)
        self._fill(runner, entry, chunks, plan)
        # pinned (and copies still in flight waited for, on the stream) before
        # any of the step's kernels, the warm-up and capture's included
        try:
            pinned = moe.pin_resident()
        except ValueError:  # a copy failed since the check: that layer is not resident
            self.stats.fallbacks["experts_not_resident"] += 1
            return None
        try:
            if entry.graph is None and not self._capture(runner, moe, entry):
                moe.unpin_resident()
                self.stats.fallbacks["capture_failed"] += 1
                return None
            return self._replay(runner, moe, entry, chunks, plan)
        except BaseException:
            moe.abort_pins(pinned)
            raise

    def _new_entry(self, runner: TargetRunner, key: BucketKey) -> _Entry:
        layout = _Layout(key)
        dev = runner.device
        entry = _Entry(
            key=key,
            layout=layout,
            packed=torch.zeros(layout.size, dtype=torch.int64, device=dev),
            ids=torch.zeros(key.rows, dtype=torch.int64, device=dev),
            host=_Staging(layout.size, dev),
        )
        self._entries[key] = entry
        return entry

    def _fill(
        self,
        runner: TargetRunner,
        entry: _Entry | _PieceEntry,
        chunks: Sequence[Chunk],
        plan: StepPlan,
    ) -> None:
        """The step's indices into the bucket's static buffers (one host->
        device copy) and its tokens into the id buffer. The indices come
        from the KV's block tables (the plan has grown every chunk's KV;
        its index lists need not be built): request ``i``'s real rows are
        ``i * Nq ..``, at positions ``start_i ..``, with keys ``0 ..
        start_i + n_i``; vectorised over the requests."""
        key, lay = entry.key, entry.layout
        host = _writable(entry)
        staging = entry.host
        kv = runner.kv
        assert kv.scratch_slot is not None

        def field_of(name: str) -> np.ndarray:
            lo, hi = lay.offsets[name]
            return host[lo:hi]

        r = len(plan.lens)
        lens_key = tuple(plan.lens)
        same_rows = staging.lens == lens_key and staging.row_layout is not None
        staging.lens = None  # until this fill completes
        starts = np.asarray(plan.starts, dtype=np.int64)
        total = plan.total
        # every real key's slot, request by request (the keys include the new rows)
        keys = kv.slot_matrix([c.seq_id for c in chunks], key.keys, kv.null_slot)
        lens = np.asarray(plan.lens, dtype=np.int64)
        if same_rows:
            assert staging.row_layout is not None
            req, within, rows = staging.row_layout
        else:
            req = np.repeat(np.arange(r, dtype=np.int64), lens)  # each real row's request
            within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            rows = req * key.queries + within
        pos = starts[req] + within
        positions, slots, q_pos = field_of("positions"), field_of("slots"), field_of("q_pos")
        kv_slots = field_of("kv_slots").reshape(key.requests, key.key_width)
        k_pos = field_of("k_pos").reshape(key.requests, key.keys)
        k_valid = field_of("k_valid").reshape(key.requests, key.keys)
        if not same_rows:
            # the padding and the fields of the row layout alone; a fill of
            # the same token counts leaves them as they are and rewrites the
            # real rows' and real requests' values only
            row_chunk, q_valid = field_of("row_chunk"), field_of("q_valid")
            real_rows = field_of("real_rows")
            positions[:] = 0
            slots[:] = kv.scratch_slot
            row_chunk[:] = key.requests  # the dummy chunk
            row_chunk[rows] = req
            q_pos[:] = 0
            q_valid[:] = 0
            q_valid[rows] = 1
            kv_slots[:] = kv.null_slot
            k_valid[:] = 0
            k_pos[:] = 0
            real_rows[:] = 0
            real_rows[:total] = rows
        positions[rows] = pos
        slots[rows] = keys[req, pos]
        q_pos[rows] = pos
        kv_slots[:r, : key.keys] = keys
        key_index = np.arange(key.keys)[None, :]
        valid = key_index < (starts + lens)[:, None]
        k_valid[:r] = valid
        np.multiply(key_index, valid, out=k_pos[:r])
        staging.row_layout = (req, within, rows)
        staging.lens = lens_key
        _upload(entry)
        dev = entry.ids.device
        if all(c.tokens.device == dev for c in chunks):  # a verify's: one cat, no copies
            tokens = torch.cat([c.tokens for c in chunks])
        else:
            tokens = torch.cat([c.tokens.to(dev) for c in chunks])
        if total == key.rows:
            entry.ids.copy_(tokens)
        else:
            rows_t = lay.view(entry.packed, "real_rows")[:total]
            entry.ids.index_copy_(0, rows_t, tokens)

    def _step_fn(self, runner: TargetRunner, moe: OffloadedMoE, entry: _Entry) -> Outputs:
        """The recorded work: the layers over the bucket's static buffers.
        Every view is made inside, so memos keyed on tensor identity (the
        adapters' rotary tables) are recomputed in the recording."""
        key, lay, packed = entry.key, entry.layout, entry.packed
        batch = _static_batch(key, lay, packed)
        ad = runner.adapter
        routed = torch.zeros(
            (key.requests + 1, ad.num_layers, ad.num_experts),
            dtype=torch.bool,
            device=packed.device,
        )
        topk: list[torch.Tensor] = []
        with moe.unbooked():
            x, captured = runner.run_layers(
                entry.ids,
                lay.view(packed, "positions"),
                lay.view(packed, "slots"),
                batch,
                lay.view(packed, "row_chunk"),
                routed,
                topk,
                host_hooks=False,
            )
        stacked = torch.stack(topk) if topk else routed.new_zeros(0, dtype=torch.int64)
        return (x, routed, stacked, *(captured[i] for i in runner.capture_layers))

    def _capture(self, runner: TargetRunner, moe: OffloadedMoE, entry: _Entry) -> bool:
        """Record the bucket's graph; False (the bucket never retried) if
        the backend raised."""
        timer, runner.region_timer = runner.region_timer, None  # no events in a recording
        try:
            recorded = self._record(
                lambda: self._step_fn(runner, moe, entry), self._entries, entry.key, self.stats
            )
        finally:
            runner.region_timer = timer
        if recorded is None:
            return False
        entry.graph, entry.outputs = recorded
        entry.slot_table = moe.cache.device_slot_table()
        return True

    def _record(
        self,
        step: Callable[[], Outputs],
        entries: dict[Any, Any],
        key: Any,
        stats: GraphStats,
        failed_as: Any = None,
    ) -> tuple[Replayable, Outputs] | None:
        """``step`` recorded by the backend; None if the backend raised: the
        entry ``key`` is then dropped from ``entries`` and its bucket marked
        failed (as ``failed_as``, default ``key``; never retried: it runs
        eagerly)."""
        try:
            recorded = self.backend.capture(step)
        except Exception as exc:  # any capture failure: the bucket runs eagerly
            self._failed[key if failed_as is None else failed_as] = f"{type(exc).__name__}: {exc}"
            entries.pop(key, None)
            stats.capture_failures += 1
            return None
        stats.captures += 1
        return recorded

    # -- pre-capture --------------------------------------------------------------

    def verify_buckets(
        self,
        *,
        max_requests: int,
        max_tokens: int,
        min_prompt_len: int,
        min_seq_len: int,
        max_seq_len: int,
        full_width: bool = True,
    ) -> list[BucketKey]:
        """Every whole-step bucket a verify of up to ``max_requests``
        requests can fall in, the likeliest first (:meth:`prepare`'s order).

        A request with prompt ``p`` and output limit ``N`` that has output
        ``g`` tokens verifies ``n = min(B, N - g)`` tokens (``B`` =
        ``max_tokens``: the block, 1 without a drafter) against ``p + g - 1 +
        n`` keys. So the bucket of the full row count (``B`` rounded up to a
        power of two) sees keys in ``[min_prompt_len + 1, max_seq_len - 1]``;
        with ``full_width`` (every draft verified), a smaller row bucket
        only holds requests in their last block, whose keys are ``p + N -
        1``: ``[min_seq_len - 1, max_seq_len - 1]``. Without it (a verify
        width policy trims blocks anywhere) every row bucket takes the full
        key range. ``min_seq_len``/``max_seq_len``: the shortest and longest
        prompt + output limit. Order: the full row bucket (requests
        descending, keys ascending), then the smaller ones (rows
        descending, requests descending, keys ascending). Buckets past the
        runner's limits (rows, keys) are left out: those steps run eagerly."""
        for name, value in (
            ("max_requests", max_requests),
            ("max_tokens", max_tokens),
            ("min_prompt_len", min_prompt_len),
            ("min_seq_len", min_seq_len),
        ):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not min_prompt_len < min_seq_len <= max_seq_len:
            raise ValueError(
                "need min_prompt_len < min_seq_len <= max_seq_len, got "
                f"{min_prompt_len}, {min_seq_len}, {max_seq_len}"
            )
        last_r = min(
            bisect.bisect_left(self.request_buckets, max_requests), len(self.request_buckets) - 1
        )
        requests = self.request_buckets[: last_r + 1][::-1]

        def widths(lo: int, hi: int) -> list[int]:
            a = bisect.bisect_left(self.key_widths, lo + 1)
            b = min(bisect.bisect_left(self.key_widths, hi + 1), len(self.key_widths) - 1)
            return list(self.key_widths[a : b + 1])

        full_q = 1 << (max_tokens - 1).bit_length()
        full_keys = widths(min_prompt_len + 1, max_seq_len - 1)
        tail_keys = widths(min_seq_len - 1, max_seq_len - 1) if full_width else full_keys
        out: list[BucketKey] = []
        q = full_q
        while q >= 1:
            if q <= self.max_queries:
                for r in requests:
                    out += [BucketKey(r, q, w) for w in (full_keys if q == full_q else tail_keys)]
            q //= 2
        return out

    @torch.no_grad()
    def prepare(
        self,
        runner: TargetRunner,
        keys: Sequence[BucketKey],
        *,
        limit: int | None = None,
        max_bytes: int | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Record the whole-step graph of each bucket in ``keys`` (in order)
        ahead of any request, so steps that later fall in them replay at
        once: a synthetic step per bucket (random tokens over temporary KV
        sequences of the bucket's key count, freed after; padded as a real
        step) is captured and, with :attr:`validate`, its first replay
        checked against an eager run as :meth:`forward` does. Nothing is
        booked in the expert cache and no hook runs. Needs the KV pages of
        the bucket's smallest request count at its widest key count free
        (else the bucket is skipped: ``kv_pages``). Never evicts a graph:
        at most ``limit`` (default and at most :attr:`max_graphs`) graphs
        are held after it; with ``max_bytes``, a bucket whose estimated
        bytes would take the held graphs' total past it is skipped (a
        graph's bytes: its static buffers and outputs, or on CUDA the growth
        of the reserved memory while it was recorded if larger; a new
        bucket's estimate: the most bytes per padded row of those held).
        Returns a report: buckets asked, already held, prepared, skipped per
        reason, failed (capture error or replay mismatch: those buckets then
        run eagerly), the bytes the prepared ones took, the graphs held and
        the seconds taken; ``blocker`` when
        no whole-step graph can run at all (nothing is prepared). With
        :attr:`piecewise` on, a bucket whose steps can only run as pieces
        has its pieces recorded instead (:meth:`_prepare_pieces`; counted in
        ``prepared_piecewise``, held in ``piecewise_buckets_held``; never
        evicting: past :attr:`max_piecewise_buckets` a bucket is skipped,
        ``piecewise_limit``)."""
        t0 = time.perf_counter()
        cap = self.max_graphs if limit is None else min(int(limit), self.max_graphs)
        if cap < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        report = _prepare_report(len(keys))
        report["bytes"] = 0
        report["prepared_piecewise"] = 0
        gen = torch.Generator().manual_seed(seed)
        held = [e for e in self._entries.values() if e.graph is not None]
        # bytes per padded row, the estimate of a bucket not yet recorded
        per_row = max((_entry_bytes(e) / e.key.rows for e in held), default=0.0)
        used = sum(_entry_bytes(e) for e in held)
        moe = runner.offloaded_runtime
        table = moe.cache.device_slot_table() if moe is not None else None
        timer, runner.region_timer = runner.region_timer, None  # not a measured step
        try:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.graph is not None and entry.slot_table is table:
                    report["already_held"] += 1
                    continue
                if key in self._failed or ("piecewise", key) in self._failed:
                    report["skipped"]["failed_before"] += 1
                    continue
                pieces = self._piece_entries.get(key)
                if pieces is not None and all(p is not None for p in pieces.pieces):
                    report["already_held"] += 1
                    continue
                if self.num_graphs >= cap:
                    report["skipped"]["graph_limit"] += 1
                    continue
                if max_bytes is not None and used + per_row * key.rows > max_bytes:
                    report["skipped"]["memory"] += 1
                    continue
                before = _reserved_bytes(runner.device)
                outcome = self._prepare_bucket(runner, key, gen)
                if outcome == "prepared_piecewise":
                    report["prepared_piecewise"] += 1
                    continue
                if outcome == "prepared":
                    made = self._entries[key]
                    nbytes = max(_entry_bytes(made), _reserved_bytes(runner.device) - before)
                    report["prepared"] += 1
                    report["bytes"] += nbytes
                    used += nbytes
                    per_row = max(per_row, nbytes / key.rows)
                    self.stats.prepared += 1
                elif _count_outcome(report, outcome, PREPARE_BLOCKERS):
                    break
        finally:
            runner.region_timer = timer
        report["piecewise_buckets_held"] = self.num_piecewise_buckets
        return _finish_report(report, self.num_graphs, t0)

    def draft_buckets(
        self,
        *,
        max_requests: int,
        max_tokens: int,
        min_prompt_len: int,
        max_prompt_len: int,
        min_seq_len: int,
        max_seq_len: int,
        features: int,
        dtype: torch.dtype,
        full_width: bool = True,
    ) -> list[DraftKey]:
        """The drafter's buckets a run of those bounds can meet (as
        :meth:`verify_buckets`; the drafter's keys and block rows follow the
        same rules), with every new-context bucket a draft of ``R`` requests
        can have: each request brings at least one context row and at most
        its prompt (its first draft, which has the full block unless the
        output limit is shorter) or a block (later ones). The likeliest
        first: the full block, requests descending, context and keys
        ascending; then the smaller blocks."""
        if not min_prompt_len <= max_prompt_len < max_seq_len:
            raise ValueError(
                "need min_prompt_len <= max_prompt_len < max_seq_len, got "
                f"{min_prompt_len}, {max_prompt_len}, {max_seq_len}"
            )
        target = self.verify_buckets(
            max_requests=max_requests,
            max_tokens=max_tokens,
            min_prompt_len=min_prompt_len,
            min_seq_len=min_seq_len,
            max_seq_len=max_seq_len,
            full_width=full_width,
        )
        out: list[DraftKey] = []
        full_q = 1 << (max_tokens - 1).bit_length()
        per_request = max(max_prompt_len, max_tokens)
        # a request's first draft (its prompt as context) has the full block
        # unless its output limit is shorter than a block
        first_in_tail = not full_width or min_seq_len - max_prompt_len - 1 < max_tokens
        per_tail_request = per_request if first_in_tail else max_tokens
        for key in target:
            fewest = self._fewest_requests(key.requests)
            lo = max(16, 1 << (fewest - 1).bit_length())
            rows = per_request if key.queries == full_q else per_tail_request
            hi = min(
                max(16, 1 << (key.requests * rows - 1).bit_length()),
                max(16, 1 << (self.max_draft_context - 1).bit_length()),
            )
            c = lo
            while c <= hi:
                out.append(
                    DraftKey(key.requests, key.queries, c, key.key_width, int(features), str(dtype))
                )
                c *= 2
        return out

    @torch.no_grad()
    def prepare_drafts(
        self,
        drafter: DFlashDrafter,
        kv: PagedKVCache,
        keys: Sequence[DraftKey],
        *,
        embed_dim: int,
        limit: int | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """:meth:`prepare` for the drafter's buckets: a synthetic draft step
        per bucket (random context features and block embeddings over
        temporary sequences of ``kv``, freed after) through
        :meth:`draft_forward`, which records and checks it. At most
        ``limit`` (default and at most :attr:`max_draft_graphs`) draft
        graphs are held after it; none is evicted. Returns the same report
        as :meth:`prepare` (no bytes)."""
        t0 = time.perf_counter()
        cap = self.max_draft_graphs if limit is None else min(int(limit), self.max_draft_graphs)
        if cap < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        report = _prepare_report(len(keys))
        gen = torch.Generator().manual_seed(seed)
        for key in keys:
            entry = self._draft_entries.get(key)
            if entry is not None and entry.graph is not None:
                report["already_held"] += 1
                continue
            if key in self._failed:
                report["skipped"]["failed_before"] += 1
                continue
            if self.num_draft_graphs >= cap:
                report["skipped"]["graph_limit"] += 1
                continue
            outcome = self._prepare_draft_bucket(drafter, kv, key, gen, embed_dim)
            if outcome == "prepared":
                report["prepared"] += 1
                self.draft_stats.prepared += 1
            elif _count_outcome(report, outcome, DRAFT_PREPARE_BLOCKERS):
                break
        return _finish_report(report, self.num_draft_graphs, t0)

    def _fewest_requests(self, bucket: int) -> int:
        """The fewest requests a step in request bucket ``bucket`` has (one
        more than the bucket below it)."""
        i = self.request_buckets.index(bucket)
        return self.request_buckets[i - 1] + 1 if i else 1

    def _narrower_width(self, width: int) -> int:
        """The key width below ``width`` (1 below the narrowest): a step in
        the bucket of ``width`` has more keys than it."""
        j = self.key_widths.index(width)
        return self.key_widths[j - 1] if j else 1

    def _prepare_draft_bucket(
        self,
        drafter: DFlashDrafter,
        kv: PagedKVCache,
        key: DraftKey,
        gen: torch.Generator,
        embed_dim: int,
    ) -> str:
        """One bucket of :meth:`prepare_drafts`: ``prepared``, ``failed`` or
        why it was skipped."""
        from pdflash.engine.drafter import DraftItem

        if kv.scratch_slot is None:
            return "kv_without_scratch_slot"
        requests = self._fewest_requests(key.requests)
        # the fewest context rows of the bucket, spread over the requests
        context = max(requests, key.context // 2 + 1 if key.context > 16 else 1)
        if context > key.context:
            return "shape"
        per = [context // requests + (1 if r < context % requests else 0) for r in range(requests)]
        fewest_keys = max(self._narrower_width(key.key_width), max(per) + key.queries)
        keys = min(key.keys, kv.free_pages // requests * kv.page_size)
        if keys < fewest_keys:
            return "kv_pages"
        dtype = getattr(torch, key.dtype.removeprefix("torch."))
        dev = drafter.norm.weight.device
        with _scratch_sequences(kv, [keys - c - key.queries for c in per]) as seq_ids:
            items = [DraftItem(s, c, key.queries) for s, c in zip(seq_ids, per, strict=True)]
            ctx = torch.randn(context, key.features, generator=gen).to(dev, dtype)
            emb = torch.randn(requests * key.queries, embed_dim, generator=gen).to(dev, dtype)
            drafter.forward_blocks(ctx, emb, items, kv, graphs=self)
            if key in self._failed:
                return "failed"
            entry = self._draft_entries.get(key)
            if entry is None or entry.graph is None:
                return "not_graphed"
            if entry.packed.is_cuda:
                torch.cuda.current_stream(entry.packed.device).synchronize()
            return "prepared"

    def _prepare_bucket(self, runner: TargetRunner, key: BucketKey, gen: torch.Generator) -> str:
        """One bucket of :meth:`prepare`: ``prepared``, ``failed``, the
        reason no whole-step graph can run, or why this bucket was skipped."""
        from pdflash.engine.target import Chunk

        kv = runner.kv
        # the fewest requests of the bucket, the most keys of its width
        requests = self._fewest_requests(key.requests)
        fewest_keys = max(self._narrower_width(key.key_width), key.queries)
        keys = min(key.keys, kv.free_pages // requests * kv.page_size)
        if keys < fewest_keys:
            return "kv_pages"
        with _scratch_sequences(kv, [keys - key.queries] * requests) as seq_ids:
            vocab = runner.adapter.vocab_size
            chunks = [
                Chunk(
                    s,
                    torch.randint(0, vocab, (key.queries,), generator=gen).to(runner.device),
                    True,
                )
                for s in seq_ids
            ]
            reason = self.blocker(runner, chunks)
            if reason in PIECEWISE_REASONS and self.piecewise:
                return self._prepare_pieces(runner, key, chunks)
            if reason is not None:
                return reason
            plan = runner.plan(chunks, lists=False)
            assert self.bucket(plan) == key, (self.bucket(plan), key)
            moe = runner.offloaded_runtime
            assert moe is not None
            self._entries.pop(key, None)  # a graph over a replaced slot table, if any
            entry = self._new_entry(runner, key)
            self._fill(runner, entry, chunks, plan)
            moe.pin_resident()
            try:
                if not self._capture(runner, moe, entry):
                    return "failed"
                assert entry.graph is not None
                entry.graph.replay()
                self._check(
                    entry, self.stats, lambda: self._step_fn(runner, moe, entry), self._entries
                )
                if entry.graph is None:  # the replay disagreed with eager
                    return "failed"
            finally:
                # a synthetic step: no access to record; the slots it read
                # must not be reused before it ran
                if entry.packed.is_cuda:
                    torch.cuda.current_stream(entry.packed.device).synchronize()
                moe.unpin_resident()
            return "prepared"

    def _prepare_pieces(self, runner: TargetRunner, key: BucketKey, chunks: Sequence[Chunk]) -> str:
        """One piecewise bucket of :meth:`prepare`, over ``chunks`` (the
        synthetic step on temporary KV sequences): every piece recorded and
        its first replay checked as :meth:`piecewise_forward` does, the
        pieces' inputs the bucket's static buffers (the residual entering a
        later piece is whatever they hold: a piece's check compares its
        replay with an eager run on the same inputs). The MoE blocks between
        the pieces are not run, so nothing is copied or booked.
        ``prepared_piecewise``, ``failed``, or why not."""
        why = _pieces_blocker(runner)
        if why is not None:
            return why
        if len(self._piece_entries) >= self.max_piecewise_buckets:
            return "piecewise_limit"
        plan = runner.plan(chunks, lists=False)
        assert self.bucket(plan) == key, (self.bucket(plan), key)
        failed = ("piecewise", key)
        entry = self._new_piece_entry(runner, key)
        self._fill(runner, entry, chunks, plan)
        try:
            for m in range(len(entry.pieces)):
                self._run_piece(runner, entry, m, True)
                if failed in self._failed:
                    self._piece_entries.pop(key, None)
                    return "failed"
        finally:
            entry.routed.zero_()
            if entry.packed.is_cuda:  # the KV the pieces wrote is freed next
                torch.cuda.current_stream(entry.packed.device).synchronize()
        return "prepared_piecewise"

    @property
    def failures(self) -> dict[str, str]:
        """Buckets whose capture failed, with the error (for reports)."""
        return {_key_name(k): v for k, v in self._failed.items()}

    def _replay(
        self,
        runner: TargetRunner,
        moe: OffloadedMoE,
        entry: _Entry,
        chunks: Sequence[Chunk],
        plan: StepPlan,
    ) -> ForwardOutput:
        """Replay the (pinned) step and book it; everything that leaves it is
        gathered out of the static outputs before anything can replay again."""
        assert entry.graph is not None
        for layer in range(moe.cache.num_layers):
            for hook in runner.before_moe_hooks:
                hook(layer)
        timer = runner.region_timer
        if timer is None:
            entry.graph.replay()
        else:
            with timer.region("graphed"):
                entry.graph.replay()
        outputs = entry.outputs
        if not entry.checked:
            outputs = self._check(
                entry, self.stats, lambda: self._step_fn(runner, moe, entry), self._entries
            )
        x, routed, topk, *captured = outputs
        # the routing grid's copy back goes first, right behind the replay:
        # the one sync below then waits for the replay only, and the host's
        # books and finish run while the device gathers and runs lm_head
        routed_read = _RoutedRead(entry, routed, len(chunks))
        real = entry.layout.view(entry.packed, "real_rows")[: plan.total]
        topk_real = topk.index_select(1, real) if topk.numel() else topk
        ad = runner.adapter
        # every row of a graphed step wants its logits (prefills run eagerly:
        # GraphRunner.blocker), so no gather of wanted rows is needed
        logits_all = step_logits(ad, x.index_select(0, real))
        features: list[torch.Tensor] = []
        if captured:
            feat = torch.cat(captured, dim=-1).index_select(0, real)
            features = list(torch.split(feat, plan.lens))
        # host work, while the device runs what was launched above
        moe.book_resident(topk_real)
        self.stats.replays += 1
        return runner.finish(chunks, plan, logits_all, features, routed_read.result())

    def _check(
        self,
        entry: _Entry | _DraftEntry,
        stats: GraphStats,
        eager_fn: Callable[[], Outputs],
        entries: dict[Any, Any],
    ) -> Outputs:
        """The first replay of a new graph against an eager run of the same
        step (:attr:`validate`): returns the outputs to use. On a mismatch
        the graph is dropped and its bucket marked failed; the eager run's
        outputs (same static inputs, so the same step) are returned."""
        entry.checked = True
        if not self.validate:
            return entry.outputs
        stats.validated += 1
        eager = eager_fn()
        if outputs_agree(entry.outputs, eager):
            return entry.outputs
        stats.replay_mismatches += 1
        self._failed[entry.key] = f"{_MISMATCH}: the first replay disagreed with eager"
        entries.pop(entry.key, None)
        entry.graph, entry.outputs = None, ()
        return eager

    # -- piecewise steps -------------------------------------------------------------

    def piecewise_forward(
        self, runner: TargetRunner, chunks: Sequence[Chunk], plan: StepPlan
    ) -> ForwardOutput | None:
        """The step as pieces (:func:`layer_spans`): each piece (attention
        and router of an MoE layer, with the dense layers before it)
        replayed over the padded bucket; between pieces, eagerly and on the
        real rows only, the before-MoE hooks, the routed hooks, the MoE
        block (with its own cache books, copies and host syncs), the
        residual and the observers. None (counted) when it cannot."""
        stats = self.stats
        why = _pieces_blocker(runner)
        if why is not None:
            stats.fallbacks[why] += 1
            return None
        key = self.bucket(plan)
        if isinstance(key, str):
            stats.fallbacks[key] += 1
            return None
        failed = ("piecewise", key)
        if failed in self._failed:
            stats.fallbacks[_failure_reason(self._failed[failed])] += 1
            return None
        entry = _recent(self._piece_entries, key)
        if entry is None:
            _make_room(self._piece_entries, self.max_piecewise_buckets, stats)
            entry = self._new_piece_entry(runner, key)
        self._fill(runner, entry, chunks, plan)
        entry.routed.zero_()
        ad = runner.adapter
        real = entry.layout.view(entry.packed, "real_rows")[: plan.total]
        spans = layer_spans(runner.plan_layers)
        captured: dict[int, torch.Tensor] = {}
        x_final: torch.Tensor | None = None
        graphed = True
        for m, (first, last, layer) in enumerate(spans):
            outs = self._run_piece(runner, entry, m, graphed)
            graphed = graphed and failed not in self._failed
            dense_caps = [
                d
                for d in range(first, last + 1)
                if runner.plan_layers[d] is None and d in runner.capture_layers
            ]
            if layer is None:  # the dense tail
                x_out, *caps = outs
                x_final = x_out.index_select(0, real)
            else:
                x_mid, normed, ids, weights, *caps = outs
                ids_r, x_r = ids.index_select(0, real), x_mid.index_select(0, real)
                for hook in runner.before_moe_hooks:
                    hook(layer)
                # the routed hooks and the MoE block share one read of ids_r
                with shared_routing_reads():
                    for rhook in runner.routed_hooks:
                        rhook(layer, ids_r, x_r)
                    with runner._region("experts"):
                        moe = ad.moe_routed(  # type: ignore[attr-defined]
                            layer,
                            normed.index_select(0, real),
                            ids_r,
                            weights.index_select(0, real),
                        )
                        x_next = x_r + moe
                for obs in runner.observers:
                    obs.after_layer(layer, x_next, ids_r)
                if last in runner.capture_layers:
                    captured[last] = x_next
                if m + 1 < len(spans):
                    entry.x_in.copy_(x_mid)
                    entry.x_in.index_copy_(0, real, x_next)
                else:
                    x_final = x_next
            for d, t in zip(dense_caps, caps, strict=True):
                captured[d] = t.index_select(0, real)
        assert x_final is not None
        if graphed:
            stats.piecewise_steps += 1
        else:
            stats.fallbacks[_failure_reason(self._failed.get(failed, ""))] += 1
        # every row of a graphed step wants its logits (prefills run eagerly:
        # GraphRunner.blocker), so no gather of wanted rows is needed
        logits_all = step_logits(ad, x_final)
        features: list[torch.Tensor] = []
        if runner.capture_layers:
            feat = torch.cat([captured[d] for d in runner.capture_layers], dim=-1)
            features = list(torch.split(feat, plan.lens))
        routed_np = entry.routed[: len(chunks)].cpu().numpy()
        return runner.finish(chunks, plan, logits_all, features, routed_np)

    def _new_piece_entry(self, runner: TargetRunner, key: BucketKey) -> _PieceEntry:
        layout = _Layout(key)
        dev = runner.device
        ad = runner.adapter
        n = len(layer_spans(runner.plan_layers))
        dtype = ad.embed(torch.zeros(1, dtype=torch.int64, device=dev)).dtype
        entry = _PieceEntry(
            key=key,
            layout=layout,
            packed=torch.zeros(layout.size, dtype=torch.int64, device=dev),
            ids=torch.zeros(key.rows, dtype=torch.int64, device=dev),
            host=_Staging(layout.size, dev),
            x_in=torch.zeros((key.rows, ad.hidden_size), dtype=dtype, device=dev),
            routed=torch.zeros(
                (key.requests + 1, ad.num_layers, ad.num_experts), dtype=torch.bool, device=dev
            ),
            pieces=[None] * n,
            outputs=[()] * n,
            checked=[False] * n,
        )
        self._piece_entries[key] = entry
        return entry

    def _piece_fn(self, runner: TargetRunner, entry: _PieceEntry, m: int) -> Outputs:
        """Piece ``m``'s work over the bucket's static buffers: returns its
        last residual (with a router: also the normed input, top-k ids and
        weights), then the residuals of its dense capture layers."""
        first, last, layer = layer_spans(runner.plan_layers)[m]
        lay, packed = entry.layout, entry.packed
        batch = _static_batch(entry.key, lay, packed)
        pos, slots = lay.view(packed, "positions"), lay.view(packed, "slots")
        x = runner.adapter.embed(entry.ids) if m == 0 else entry.x_in
        caps: list[torch.Tensor] = []
        for d in range(first, last + 1):
            x = runner.attention_block(d, x, pos, slots, batch)
            if runner.plan_layers[d] is None:
                x = runner.dense_block(d, x)
                if d in runner.capture_layers:
                    caps.append(x)
        if layer is None:
            return (x, *caps)
        normed, ids, weights = runner.route_block(
            layer, x, lay.view(packed, "row_chunk"), entry.routed, []
        )
        return (x, normed, ids, weights, *caps)

    def _run_piece(
        self, runner: TargetRunner, entry: _PieceEntry, m: int, graphed: bool
    ) -> Outputs:
        """Piece ``m``: replayed (recorded first if new, its first replay
        checked against eager), or run eagerly when ``graphed`` is False or
        its recording fails (the bucket is then marked failed)."""
        key = entry.key
        failed = ("piecewise", key)
        timer, runner.region_timer = runner.region_timer, None  # no events in a piece
        try:
            if not graphed:
                return self._piece_fn(runner, entry, m)
            if entry.pieces[m] is None:
                recorded = self._record(
                    lambda: self._piece_fn(runner, entry, m),
                    self._piece_entries,
                    key,
                    self.stats,
                    failed_as=failed,
                )
                if recorded is None:
                    return self._piece_fn(runner, entry, m)
                entry.pieces[m], entry.outputs[m] = recorded
            piece = entry.pieces[m]
            assert piece is not None
            if timer is None:
                piece.replay()
            else:
                with timer.region("graphed"):
                    piece.replay()
            if entry.checked[m] or not self.validate:
                entry.checked[m] = True
                return entry.outputs[m]
            entry.checked[m] = True
            self.stats.validated += 1
            eager = self._piece_fn(runner, entry, m)
            if outputs_agree(entry.outputs[m], eager):
                return entry.outputs[m]
            self.stats.replay_mismatches += 1
            self._failed[failed] = (
                f"{_MISMATCH}: the first replay of piece {m} disagreed with eager"
            )
            self._piece_entries.pop(key, None)
            return eager
        finally:
            runner.region_timer = timer

    # -- the drafter's step ------------------------------------------------------

    def draft_bucket(self, plan: DraftPlan, features: int, dtype: torch.dtype) -> DraftKey | str:
        """The bucket of a draft step, or why it has none. The new context
        rows are padded to the next power of two (at least 16)."""
        r = len(plan.block_lens)
        if r == 0 or plan.n_blk == 0:
            return "empty"
        i = bisect.bisect_left(self.request_buckets, r)
        if i == len(self.request_buckets):
            return "too_many_requests"
        nq = max(plan.block_lens)
        if nq > self.max_queries:
            return "too_many_tokens_per_request"
        if plan.n_ctx > self.max_draft_context:
            return "too_much_context"
        lk = max(len(k) for k in plan.k_slots)
        j = bisect.bisect_left(self.key_widths, lk + 1)
        if j == len(self.key_widths):
            return "too_many_keys"
        context = max(16, 1 << (max(plan.n_ctx, 1) - 1).bit_length())
        return DraftKey(
            self.request_buckets[i],
            1 << (nq - 1).bit_length(),
            context,
            self.key_widths[j],
            int(features),
            str(dtype),
        )

    def draft_forward(
        self,
        drafter: DFlashDrafter,
        kv: PagedKVCache,
        plan: DraftPlan,
        context_features: torch.Tensor,
        block_embeddings: torch.Tensor,
    ) -> torch.Tensor | None:
        """:meth:`~pdflash.engine.drafter.DFlashDrafter.forward_blocks`'s
        device part as a replay (the KV already grown as ``plan`` says):
        the final-normed hidden states of the real block rows, a new tensor;
        None (counted in :attr:`draft_stats`) when it must run eagerly.
        Padded block rows are invalid queries, padded context rows are not
        queries; both write their K/V to the scratch row."""
        stats = self.draft_stats
        if kv.scratch_slot is None:
            stats.fallbacks["kv_without_scratch_slot"] += 1
            return None
        key = self.draft_bucket(plan, context_features.shape[1], context_features.dtype)
        if isinstance(key, str):
            stats.fallbacks[key] += 1
            return None
        if key in self._failed:
            stats.fallbacks[_failure_reason(self._failed[key])] += 1
            return None
        entry = _recent(self._draft_entries, key)
        if entry is None:
            _make_room(self._draft_entries, self.max_draft_graphs, stats)
            dev = block_embeddings.device
            layout = _DraftLayout(key)
            entry = _DraftEntry(
                key=key,
                layout=layout,
                packed=torch.zeros(layout.size, dtype=torch.int64, device=dev),
                host=_Staging(layout.size, dev),
                context=torch.zeros(
                    (key.context, key.features), dtype=context_features.dtype, device=dev
                ),
                embeddings=torch.zeros(
                    (key.rows, block_embeddings.shape[1]), dtype=block_embeddings.dtype, device=dev
                ),
            )
            self._draft_entries[key] = entry
        self._fill_draft(kv, entry, plan, context_features, block_embeddings)
        if entry.graph is None:
            recorded = self._record(
                lambda: self._draft_step_fn(drafter, kv, entry), self._draft_entries, key, stats
            )
            if recorded is None:
                stats.fallbacks["capture_failed"] += 1
                return None
            entry.graph, entry.outputs = recorded
        entry.graph.replay()
        stats.replays += 1
        outputs: Outputs = entry.outputs
        if not entry.checked:
            outputs = self._check(
                entry, stats, lambda: self._draft_step_fn(drafter, kv, entry), self._draft_entries
            )
        (hidden,) = outputs
        real = entry.layout.view(entry.packed, "real_rows")[: plan.n_blk]
        return hidden.index_select(0, real)

    def _fill_draft(
        self,
        kv: PagedKVCache,
        entry: _DraftEntry,
        plan: DraftPlan,
        context_features: torch.Tensor,
        block_embeddings: torch.Tensor,
    ) -> None:
        key, lay, host = entry.key, entry.layout, _writable(entry)
        assert kv.scratch_slot is not None

        def field_of(name: str) -> np.ndarray:
            lo, hi = lay.offsets[name]
            return host[lo:hi]

        kv_slots, kv_pos = field_of("kv_slots"), field_of("kv_pos")
        q_pos, q_valid, real_rows = field_of("q_pos"), field_of("q_valid"), field_of("real_rows")
        key_slots = field_of("key_slots").reshape(key.requests, key.key_width)
        k_pos = field_of("k_pos").reshape(key.requests, key.keys)
        k_valid = field_of("k_valid").reshape(key.requests, key.keys)
        kv_slots[:] = kv.scratch_slot
        kv_pos[:] = 0
        q_pos[:] = 0
        q_valid[:] = 0
        key_slots[:] = kv.null_slot
        k_pos[:] = 0
        k_valid[:] = 0
        real_rows[:] = 0
        flat = 0
        for i, n in enumerate(plan.block_lens):
            rows = np.arange(i * key.queries, i * key.queries + n)
            kv_slots[rows] = plan.blk_slots[flat : flat + n]
            kv_pos[rows] = plan.blk_pos[flat : flat + n]
            q_pos[rows] = plan.q_pos[i]
            q_valid[rows] = 1
            m = len(plan.k_slots[i])
            key_slots[i, :m] = plan.k_slots[i]
            k_pos[i, :m] = plan.k_pos[i]
            k_valid[i, :m] = 1
            real_rows[flat : flat + n] = rows
            flat += n
        c = plan.n_ctx
        kv_slots[key.rows : key.rows + c] = plan.ctx_slots
        kv_pos[key.rows : key.rows + c] = plan.ctx_pos
        _upload(entry)
        if c:
            entry.context[:c].copy_(context_features)
        if plan.n_blk == key.rows:
            entry.embeddings.copy_(block_embeddings)
        else:
            rows_t = lay.view(entry.packed, "real_rows")[: plan.n_blk]
            entry.embeddings.index_copy_(0, rows_t, block_embeddings)

    def _draft_step_fn(
        self, drafter: DFlashDrafter, kv: PagedKVCache, entry: _DraftEntry
    ) -> Outputs:
        lay, packed = entry.layout, entry.packed
        # the draft layout's kv_slots are its K/V rows' slots; the keys' are key_slots
        batch = _static_batch(entry.key, lay, packed, key_slots="key_slots")
        hidden = drafter.run_blocks(
            entry.context,
            entry.embeddings,
            batch,
            lay.view(packed, "kv_slots"),
            lay.view(packed, "kv_pos"),
            kv,
        )
        return (hidden,)


#: a :meth:`GraphRunner.prepare` outcome that holds for every bucket (the
#: runner's setup, not the bucket): preparing stops
PREPARE_BLOCKERS = frozenset(
    {
        "kv_without_scratch_slot",
        "routing_source",
        "adapter_without_moe_routed",
        "layer_hooks",
        "adapter_without_offloaded_runtime",
        *PIECEWISE_REASONS,
    }
)


#: a :meth:`GraphRunner.prepare_drafts` outcome that holds for every bucket
DRAFT_PREPARE_BLOCKERS = frozenset({"kv_without_scratch_slot"})


@contextlib.contextmanager
def _scratch_sequences(kv: PagedKVCache, lengths: Sequence[int]) -> Iterator[list[int]]:
    """Temporary KV sequences for a synthetic step (negative ids not in use),
    grown to ``lengths`` tokens each and freed on exit."""
    seq_ids: list[int] = []
    sid = -1
    try:
        for length in lengths:
            while kv.has(sid):
                sid -= 1
            kv.add_sequence(sid)
            seq_ids.append(sid)
            kv.grow(sid, length)
            sid -= 1
        yield seq_ids
    finally:
        for s in seq_ids:
            kv.free(s)


def _prepare_report(buckets: int) -> dict[str, Any]:
    """A new report of :meth:`GraphRunner.prepare` / ``prepare_drafts``."""
    return {
        "buckets": buckets,
        "already_held": 0,
        "prepared": 0,
        "skipped": Counter[str](),
        "failed": 0,
    }


def _count_outcome(report: dict[str, Any], outcome: str, blockers: frozenset[str]) -> bool:
    """Count a bucket's ``failed`` or skip outcome in ``report``; True (the
    outcome recorded as ``blocker``) when it stops the preparing."""
    if outcome == "failed":
        report["failed"] += 1
    elif outcome in blockers:
        report["blocker"] = outcome
        return True
    else:
        report["skipped"][outcome] += 1
    return False


def _finish_report(report: dict[str, Any], graphs_held: int, t0: float) -> dict[str, Any]:
    """The report as returned: skips sorted by reason, graphs held, seconds."""
    report["skipped"] = dict(sorted(report["skipped"].items()))
    report["graphs_held"] = graphs_held
    report["s"] = time.perf_counter() - t0
    return report


def _reserved_bytes(device: torch.device) -> int:
    """The CUDA caching allocator's reserved bytes on ``device`` (0 elsewhere)."""
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0


def _entry_bytes(entry: _Entry) -> int:
    """A bucket's static buffers and captured outputs, in bytes."""
    tensors = [entry.packed, entry.ids, *entry.outputs]
    return sum(t.numel() * t.element_size() for t in tensors)


def outputs_agree(replayed: Outputs, eager: Outputs) -> bool:
    """Whether a replay's outputs match an eager run of the same step:
    floating tensors elementwise within ``tol * (1 + max|eager|)`` (``tol``
    1e-3 for fp32, 5e-2 for 16-bit floats: the graph may run other GEMM
    algorithms) except at most 0.1% of the elements; integer and boolean
    tensors (routing) equal except at most 1% of the elements (a router
    logit within rounding of a tie may flip). A capture that read a stale
    or wrong buffer fails this on most elements."""
    if len(replayed) != len(eager):
        return False
    for a, b in zip(replayed, eager, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.numel() == 0:
            continue
        if a.is_floating_point():
            tol = 1e-3 if a.dtype in (torch.float32, torch.float64) else 5e-2
            ref = b.float()
            bound = tol * (1.0 + float(ref.abs().max()))
            bad = ((a.float() - ref).abs() > bound) | ~torch.isfinite(a.float())
            if float(bad.float().mean()) > 1e-3:
                return False
        elif float((a != b).float().mean()) > 1e-2:
            return False
    return True


def _static_batch(
    key: _PaddedGrid, lay: _PackedLayout, packed: torch.Tensor, key_slots: str = "kv_slots"
) -> AttentionBatch:
    """The attention batch over a bucket's static index buffer (views made
    now; the validity masks are converted inside the recording); the keys'
    padded slots are the layout's field ``key_slots``."""
    r, nq, lp, lk = key.requests, key.queries, key.key_width, key.keys
    kv_slots = lay.view(packed, key_slots).view(r, lp)
    rows = torch.arange(key.rows, device=packed.device)
    return AttentionBatch(
        q_rows=rows.view(r, nq),
        q_pos=lay.view(packed, "q_pos").view(r, nq),
        q_valid=lay.view(packed, "q_valid").view(r, nq).bool(),
        k_slots=kv_slots[:, :lk],
        k_pos=lay.view(packed, "k_pos").view(r, lk),
        k_valid=lay.view(packed, "k_valid").view(r, lk).bool(),
        num_tokens=key.rows,
        kv_slots=kv_slots,
        uniform=True,
        q_gather=rows,
        unpad_index=rows,
        zero_padding=True,
    )


def _pieces_blocker(runner: TargetRunner) -> str | None:
    """Why ``runner``'s steps cannot run as pieces at all, or None: a
    routing source replaces the router a piece records, or the adapter takes
    no routing from outside its MoE block."""
    if runner.routing is not None:
        return "routing_source"
    if not runner.takes_routing:
        return "adapter_without_moe_routed"
    return None


def layer_spans(plan_layers: Sequence[int | None]) -> list[tuple[int, int, int | None]]:
    """A piecewise step's pieces: ``(first, last, moe_layer)`` decoder layers
    each, ending with MoE layer ``moe_layer``'s router (its experts run
    eagerly after the piece), or ``moe_layer`` None for the dense layers
    after the last MoE layer."""
    spans: list[tuple[int, int, int | None]] = []
    first = 0
    for d, moe_layer in enumerate(plan_layers):
        if moe_layer is not None:
            spans.append((first, d, moe_layer))
            first = d + 1
    if first < len(plan_layers):
        spans.append((first, len(plan_layers) - 1, None))
    return spans


def _recent(entries: dict[Any, Any], key: Any) -> Any:
    """``entries[key]`` (None if absent), moved to the end: the dict's order
    is least recently used first."""
    entry = entries.pop(key, None)
    if entry is not None:
        entries[key] = entry
    return entry


def _make_room(entries: dict[Any, Any], limit: int, stats: GraphStats) -> None:
    """Drop the least recently used buckets until one more fits. On CUDA the
    stream is drained first: a dropped graph's executable must not be in
    flight when it is destroyed."""
    while entries and len(entries) >= limit:
        old = entries.pop(next(iter(entries)))
        if old.packed.is_cuda:
            torch.cuda.current_stream(old.packed.device).synchronize()
        stats.evicted += 1


_MISMATCH = "replay_mismatch"


def _failure_reason(message: str) -> str:
    """The fallback reason of a bucket whose graph failed."""
    return _MISMATCH if message.startswith(_MISMATCH) else "capture_failed"


def _key_name(key: BucketKey | DraftKey | tuple[str, BucketKey]) -> str:
    if isinstance(key, tuple):
        return f"{key[0]}:{_key_name(key[1])}"
    if isinstance(key, DraftKey):
        return f"draft:{key.requests}x{key.queries}+{key.context}x{key.key_width}"
    return f"{key.requests}x{key.queries}x{key.key_width}"
