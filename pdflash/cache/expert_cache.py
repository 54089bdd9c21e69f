"""A device slab of fixed-size expert slots with pin counts and eviction.

Slot ``s`` is bytes ``[s * expert_nbytes, (s + 1) * expert_nbytes)`` of one
``uint8`` tensor on the device (a CPU tensor on CPU). Copies go through a
:class:`pdflash.protocols.CopyIssuer`; the cache never copies itself.

Residency: ``slot_of[g]`` is expert ``g``'s slot or -1; ``expert_of[s]`` is
slot ``s``'s expert or -1. A slot whose copy was submitted holds its ticket
until the issuer reports it done. An expert is never evicted while pinned
(in use by a forward) or while its copy is in flight.

Minimum size (checked at construction): ``min(num_experts, top_k *
max_batch_tokens)`` slots, the most distinct experts one layer's routing can
touch in a forward of ``max_batch_tokens`` tokens. A forward with more tokens
still runs: the offloaded block then processes the layer's experts in groups
that fit (see :mod:`pdflash.models.offload`).

Books: every step of the bookkeeping over those arrays (a lookup, a pin
update, an eviction's or a load's writes, a capacity count) is one call into
the native :class:`pdflash_native._cachebooks.CacheBooks` (its pure-Python
reference, :class:`pdflash._reference.cachebooks.CacheBooks`, is driven
against it by the differential tests); the decisions (victims, bands,
errors) stay here and in the eviction policy.

NOTE (CUDA): releasing a pin only means the kernels that read the slot were
*enqueued*. The cache records an event on the compute stream at release and,
before a slot is overwritten by a new copy, waits for that event on the host
(it has almost always completed by then, since the victim is the least useful
slot). The :class:`CopyIssuer` protocol has no device-side "copy after event"
dependency, so this host wait is what keeps a copy from overwriting weights a
queued kernel still reads.

Threads: single-threaded. Every method that reads or changes slot state runs
under a :class:`~pdflash._guard.BusyGuard`: a second thread calling in while
one is inside gets :class:`~pdflash._guard.ConcurrentUseError` at once (two
threads acquiring at once used to leak pins). The thread inside may nest
calls (``ensure_resident`` -> ``acquire``).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pdflash._guard import BusyGuard, exclusive
from pdflash._native import load_native
from pdflash.cache.eviction import EvictionPolicy, LRUPolicy, make_policy
from pdflash.cache.slot_events import SlotEvents
from pdflash.cache.staging import StagingRing
from pdflash.metrics import Metric, ratio
from pdflash.protocols import Band, CopyIssuer, TicketState

if TYPE_CHECKING:
    from pdflash.protocols import ExpertCacheView
    from pdflash_native import _cachebooks
else:
    _cachebooks = load_native("_cachebooks")

IdArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_NO_IDS: IdArray = np.zeros(0, dtype=np.int64)
_NO_IDS.flags.writeable = False
_DONE = int(TicketState.DONE)
_RUNNING = int(TicketState.RUNNING)
_QUEUED = int(TicketState.QUEUED)


class CacheBooksCore(Protocol):
    """The books over a cache's arrays: each method is one bookkeeping step
    (see :mod:`pdflash_native._cachebooks` for what each one does); a call
    that raises changes nothing."""

    def first_bad_id(self, ids: IdArray) -> int: ...
    def strictly_increasing(self, ids: IdArray) -> bool: ...
    def inflight(self) -> tuple[IdArray, IdArray]: ...
    def settle(self, busy: IdArray, states: npt.NDArray[np.uint8], done_code: int) -> IdArray: ...
    def available(self, exclude: IdArray) -> int: ...
    def evictable(self, exclude: IdArray) -> IdArray: ...
    def evictable_ids(self, exclude: IdArray) -> IdArray: ...
    def copy_args(
        self, slots: IdArray, first_key: int, base: int, nbytes: int
    ) -> tuple[IdArray, IdArray, IdArray]: ...
    def free_slots(self, n: int) -> IdArray: ...
    def all_held(self, ids: IdArray) -> bool: ...
    def split_present(self, ids: IdArray) -> tuple[IdArray, IdArray]: ...
    def pin_present(self, slots: IdArray, delta: int) -> None: ...
    def commit_access(self, ids: IdArray, slots_before: IdArray) -> tuple[int, int]: ...
    def out_tickets(self, ids: IdArray) -> tuple[IdArray, IdArray]: ...
    def pin_checked(self, ids: IdArray) -> tuple[int, IdArray]: ...
    def unpin_checked(self, ids: IdArray) -> tuple[int, IdArray]: ...
    def promotable(self, slots: IdArray, band: int) -> IdArray: ...
    def evict(self, slots: IdArray) -> tuple[IdArray, int, int]: ...
    def load(
        self,
        ids: IdArray,
        slots: IdArray,
        tickets: IdArray,
        keys: IdArray,
        band: int,
        prefetched: bool,
    ) -> None: ...
    def inflight_row(self, layer: int) -> BoolArray: ...
    def apply_access(
        self, layer: int, routed: IdArray, inflight: BoolArray
    ) -> tuple[IdArray, int, int]: ...


class CacheBooksFactory(Protocol):
    """Builds the books over a cache's arrays (the native class by default)."""

    def __call__(
        self,
        slot_of: IdArray,
        expert_of: IdArray,
        pins: npt.NDArray[np.int32],
        ticket: IdArray,
        key: IdArray,
        band: IdArray,
        used: BoolArray,
        counted: BoolArray,
        by_prefetch: BoolArray,
        num_experts: int,
    ) -> CacheBooksCore: ...


class ExpertSource(Protocol):
    """Where experts live on the host (e.g. :class:`pdflash.models.ExpertStore`)."""

    num_layers: int
    num_experts: int
    expert_nbytes: int

    def host_ptrs(self, flat_ids: npt.NDArray[Any]) -> npt.NDArray[np.int64]: ...


def sorted_unique(ids: IdArray) -> IdArray:
    """``np.unique(ids)`` (sorted, distinct) of a 1-D int64 array. Ids already
    strictly increasing (the offloaded block's groups, a layer's ids) are
    returned as they are: one comparison instead of a sort."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids
    out: IdArray = np.unique(ids)
    return out


def first_occurrences(ids: IdArray) -> IdArray:
    """The distinct ids of a 1-D int64 array in the order they first occur.
    Ids already distinct (a lookahead's ranked prediction) are returned as
    they are, without the two sorts."""
    if ids.size < 2 or len(set(ids.tolist())) == ids.size:
        return ids
    distinct, first = np.unique(ids, return_index=True)
    out: IdArray = distinct[np.argsort(first)]
    return out


def _unregister_destination(issuer_ref: weakref.ReferenceType[Any], ptr: int) -> None:
    issuer = issuer_ref()
    if issuer is None or getattr(issuer, "closed", False):
        return  # a closed issuer has forgotten every region already
    with contextlib.suppress(ValueError):
        issuer.unregister_destination(ptr)


class CacheTooSmallError(ValueError):
    """The cache cannot hold the experts one layer's forward needs at once."""


def _layer_key(layers: Sequence[int]) -> tuple[int, ...]:
    """``layers`` as a tuple of ints (a ``range``, a replayed step's usual
    argument, without a conversion per element)."""
    if isinstance(layers, range):
        return tuple(layers)
    return tuple(int(layer) for layer in layers)


#: deferred accesses (:meth:`ExpertCache.defer_access`) hold their routed ids
#: on the device until the host next needs them; past this many ids (32 MB of
#: int64) they are applied at once, so a run that never needs them (every
#: expert resident, no stats read) does not grow device memory step by step
MAX_DEFERRED_IDS = 1 << 22
#: miss copies' tickets :meth:`ExpertCache.miss_copies` remembers (at least)
MISS_TICKETS_KEPT = 1 << 14


class ExpertCache:
    """Expert slots on ``device``, filled through ``issuer``.

    Size it with exactly one of ``num_slots``, ``capacity_bytes`` or
    ``fraction`` (of all ``num_layers * num_experts`` experts; rounded down).

    Args:
        source: host experts (addresses, sizes).
        issuer: the H2D copy issuer. The slab is registered with its
            ``register_destination`` (when it has one) until the cache is
            collected: the issuer writes only into registered destinations.
        device: where the slab lives (``cuda:N`` or ``cpu``).
        top_k, max_batch_tokens: define the minimum size (module docstring).
        policy: an :class:`EvictionPolicy` or a shipped policy's name
            (``lru`` default, ``lfu``, ``route_ahead``).
        wait_timeout_s: passed to ``issuer.wait`` on the host path.
        single_band: None (default): each copy goes in the band its caller
            names (on-demand misses before route-ahead before background).
            A :class:`~pdflash.protocols.Band`: every copy is submitted in
            that one band, which the issuer serves FIFO (the ``PD-one-band``
            ablation: an on-demand miss waits behind every copy queued before
            it). The cache still records each copy's requested band in
            :attr:`band` (its books: prefetched vs on-demand bytes).
        books: builds the books over the cache's arrays (default: the
            native :class:`pdflash_native._cachebooks.CacheBooks`; the
            differential tests pass the pure-Python reference).
    """

    def __init__(
        self,
        source: ExpertSource,
        issuer: CopyIssuer,
        *,
        device: torch.device | str = "cpu",
        num_slots: int | None = None,
        capacity_bytes: int | None = None,
        fraction: float | None = None,
        top_k: int,
        max_batch_tokens: int = 16,
        policy: EvictionPolicy | str | None = None,
        wait_timeout_s: float | None = None,
        single_band: Band | None = None,
        books: CacheBooksFactory | None = None,
    ) -> None:
        if single_band is not None and not isinstance(single_band, Band):
            raise TypeError(f"single_band must be a Band or None, got {single_band!r}")
        self.single_band = single_band
        self.num_layers = int(source.num_layers)
        self.num_experts = int(source.num_experts)
        self.expert_nbytes = int(source.expert_nbytes)
        self.num_ids = self.num_layers * self.num_experts
        given = [x is not None for x in (num_slots, capacity_bytes, fraction)]
        if sum(given) != 1:
            raise ValueError(
                "size the cache with exactly one of num_slots, capacity_bytes, fraction"
            )
        if fraction is not None:
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"fraction must be in (0, 1], got {fraction}")
            slots = math.floor(fraction * self.num_ids)
        elif capacity_bytes is not None:
            if capacity_bytes < 0:
                raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
            slots = capacity_bytes // self.expert_nbytes
        else:
            assert num_slots is not None
            slots = int(num_slots)
        slots = min(slots, self.num_ids)
        if top_k < 1 or max_batch_tokens < 1:
            raise ValueError(
                f"top_k and max_batch_tokens must be >= 1, got {top_k}, {max_batch_tokens}"
            )
        self.top_k = int(top_k)
        self.max_batch_tokens = int(max_batch_tokens)
        self.min_slots = min(self.num_experts, self.top_k * self.max_batch_tokens)
        if slots < self.min_slots:
            raise CacheTooSmallError(
                f"expert cache of {slots} slots ({slots * self.expert_nbytes} bytes, "
                f"{self.expert_nbytes} bytes per expert) cannot hold one layer's routed experts: "
                f"needs min(num_experts={self.num_experts}, top_k={self.top_k} x "
                f"max_batch_tokens={self.max_batch_tokens}) = {self.min_slots} slots "
                f"({self.min_slots * self.expert_nbytes} bytes)"
            )
        self.num_slots = slots
        self.device = torch.device(device)
        self.source = source
        self.issuer = issuer
        self.wait_timeout_s = wait_timeout_s
        self.policy: EvictionPolicy
        if policy is None:
            self.policy = LRUPolicy()
        elif isinstance(policy, str):
            self.policy = make_policy(policy)
        else:
            self.policy = policy
        self.policy.reset(self.num_ids)

        self.slab = torch.empty((slots, self.expert_nbytes), dtype=torch.uint8, device=self.device)
        # NOTE: the issuer writes only into destinations it was given: the slab
        # is one until the cache is collected (issuers without the method,
        # test doubles, copy anywhere).
        register = getattr(issuer, "register_destination", None)
        if register is not None:
            register(self.slab.data_ptr(), self.slab.numel())
            weakref.finalize(
                self, _unregister_destination, weakref.ref(issuer), self.slab.data_ptr()
            )
        self._is_cuda = self.device.type == "cuda"
        self.slot_of = np.full(self.num_ids, -1, dtype=np.int64)
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.pins = np.zeros(slots, dtype=np.int32)
        self.ticket = np.full(slots, -1, dtype=np.int64)  # in-flight copy, -1 when done
        self.key = np.full(slots, -1, dtype=np.int64)
        self.band = np.full(slots, -1, dtype=np.int64)
        self.used = np.zeros(slots, dtype=np.bool_)  # read by a forward since loaded
        # loaded since the last reset_stats(): only these count in the byte books
        self.counted = np.zeros(slots, dtype=np.bool_)
        self.by_prefetch = np.zeros(slots, dtype=np.bool_)
        # one CUDA event per release call, shared by the slots it released,
        # from a pool (an event is reused once no slot holds it)
        self._slot_events = SlotEvents(slots)
        # the slab never moves: its address once, not a torch call per copy
        self._slab_ptr = int(self.slab.data_ptr())
        factory: CacheBooksFactory = _cachebooks.CacheBooks if books is None else books
        self._books: CacheBooksCore = factory(
            self.slot_of,
            self.expert_of,
            self.pins,
            self.ticket,
            self.key,
            self.band,
            self.used,
            self.counted,
            self.by_prefetch,
            self.num_experts,
        )
        # the device copy of ``slot_of`` (see :meth:`device_slot_table`)
        self._table: torch.Tensor | None = None
        self._table_ring: StagingRing | None = None  # CUDA: its upload's staging
        self._table_dirty = True
        # accesses of layers run without a host sync (see :meth:`defer_access`)
        # (layers, routed [len(layers), n], the first layer's clock, in-flight
        # [len(layers), experts]): one entry per call, of one layer or several
        self._deferred: list[tuple[tuple[int, ...], torch.Tensor, int, npt.NDArray[np.bool_]]] = []
        self._deferred_ids = 0  # routed ids held on the device by those entries
        self._next_key = 0
        self._miss_tickets: set[int] = set()  # copies acquire issued for misses
        self.clock = 0
        #: the experts this cache may hold (None: all); see :meth:`restrict_to`
        self.owned: npt.NDArray[np.bool_] | None = None
        #: :meth:`_layers_ids` per layer sequence (read-only arrays; cleared
        #: when :attr:`owned` changes)
        self._layers_ids_memo: dict[tuple[int, ...], tuple[list[IdArray], IdArray]] = {}
        self._guard = BusyGuard("ExpertCache")
        #: when set (:meth:`settled`), every refresh of the copies' states first
        #: waits for each copy in flight: no choice (victims, free capacity)
        #: then depends on how far the issuer's thread has got
        self.settle_copies = False
        self.reset_stats()

    @exclusive
    def restrict_to(self, owned: npt.ArrayLike) -> None:
        """Hold only the experts of ``owned`` (bool ``[layers, experts]``): an
        expert-parallel rank's share (:mod:`pdflash.distributed`). Copying
        or pinning another expert raises ``ValueError``, and a layer counts as
        resident (:meth:`layer_resident`, :meth:`pin_layer`) once its owned
        experts are. Refused (state unchanged) if the cache already holds an
        expert outside ``owned``."""
        mask = np.asarray(owned)
        if mask.dtype != np.bool_ or mask.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"owned must be a bool ({self.num_layers}, {self.num_experts}) mask, "
                f"got {mask.dtype} {mask.shape}"
            )
        flat = mask.reshape(-1).copy()
        held = np.flatnonzero(self.slot_of >= 0)
        if (~flat[held]).any():
            raise ValueError("the cache already holds experts outside the owned set")
        self.owned = flat
        self._layers_ids_memo.clear()

    def _check_owned(self, ids: IdArray) -> None:
        if self.owned is not None and ids.size and not self.owned[ids].all():
            bad = int(ids[~self.owned[ids]][0])
            raise ValueError(
                f"expert {bad} (layer {bad // self.num_experts}, expert "
                f"{bad % self.num_experts}) is not one this cache holds (restrict_to)"
            )

    def _layer_ids(self, layer: int) -> IdArray:
        """The flat ids of ``layer`` this cache may hold (read-only,
        memoised with :meth:`_layers_ids`: an eager resident layer pins,
        checks and unpins the same ids every call)."""
        key = (int(layer),)
        got = self._layers_ids_memo.get(key)
        return got[1] if got is not None else self._layers_ids(key)[1]

    def _layer_ids_of(self, layer: int) -> IdArray:
        base = int(layer) * self.num_experts
        ids = np.arange(base, base + self.num_experts, dtype=np.int64)
        return ids if self.owned is None else ids[self.owned[ids]]

    def _layers_ids(self, layers: Sequence[int]) -> tuple[list[IdArray], IdArray]:
        """:meth:`_layer_ids` of each of ``layers`` and all of them end to
        end, made once per layer sequence (a replayed step pins and unpins
        the same layers every step); the arrays are read-only."""
        key = _layer_key(layers)
        got = self._layers_ids_memo.get(key)
        if got is None:
            per_layer = [self._layer_ids_of(layer) for layer in key]
            ids = np.concatenate(per_layer) if per_layer else np.zeros(0, dtype=np.int64)
            for a in (*per_layer, ids):
                a.flags.writeable = False
            got = (per_layer, ids)
            self._layers_ids_memo[key] = got
        return got

    # -- counters --------------------------------------------------------------

    @property
    def hits(self) -> int:
        self._flush_deferred()
        return self._hits

    @hits.setter
    def hits(self, value: int) -> None:
        self._hits = value

    @property
    def inflight_hits(self) -> int:
        self._flush_deferred()
        return self._inflight_hits

    @inflight_hits.setter
    def inflight_hits(self, value: int) -> None:
        self._inflight_hits = value

    @property
    def bytes_used(self) -> int:
        self._flush_deferred()
        return self._bytes_used

    @bytes_used.setter
    def bytes_used(self, value: int) -> None:
        self._bytes_used = value

    @exclusive
    def reset_stats(self) -> None:
        self._flush_deferred()  # accesses before the reset are not counted after it
        # NOTE: experts already resident were copied before this reset, so their
        # bytes are not in bytes_in; they must not enter bytes_used or
        # bytes_evicted_unused either (else useful_byte_fraction can exceed 1).
        self.counted[:] = False
        self.hits = 0  # requested by a forward and already resident (or in flight)
        self.inflight_hits = 0  # subset of hits whose copy was still in flight
        self.misses = 0
        self.evictions = 0
        self.copies = 0
        self.bytes_in = 0
        self.bytes_used = 0  # copied bytes read by a forward before eviction
        self.bytes_evicted_unused = 0
        self.prefetch_bytes_in = 0
        self.prefetch_bytes_evicted_unused = 0
        self.prefetch_dropped = 0  # prefetch ids that found no evictable slot
        self.failed_copies = 0  # copies found failed or cancelled; the slot was freed
        self.given_back = 0  # unstarted copies cancelled by give_back_unstarted

    def stats(self) -> dict[str, Any]:
        """Counters and derived ratios (``NotMeasured`` when the denominator is 0)."""
        self._flush_deferred()
        ratios: dict[str, Metric] = {
            "hit_rate": ratio(self.hits, self.hits + self.misses, "no expert requested"),
            "useful_byte_fraction": ratio(self.bytes_used, self.bytes_in, "no bytes copied"),
        }
        return {
            "num_slots": self.num_slots,
            "expert_nbytes": self.expert_nbytes,
            "capacity_bytes": self.num_slots * self.expert_nbytes,
            "hits": self.hits,
            "inflight_hits": self.inflight_hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "copies": self.copies,
            "bytes_in": self.bytes_in,
            "bytes_used": self.bytes_used,
            "bytes_evicted_unused": self.bytes_evicted_unused,
            "prefetch_bytes_in": self.prefetch_bytes_in,
            "prefetch_bytes_evicted_unused": self.prefetch_bytes_evicted_unused,
            "prefetch_dropped": self.prefetch_dropped,
            "failed_copies": self.failed_copies,
            "given_back": self.given_back,
            **ratios,
        }

    # -- queries ---------------------------------------------------------------

    def _ids(self, flat_ids: npt.ArrayLike) -> IdArray:
        """``flat_ids`` as a 1-D int64 array; ``ValueError`` naming the first
        id out of range (the message of :func:`pdflash.protocols.checked_flat_ids`)."""
        ids = np.asarray(flat_ids, dtype=np.int64).reshape(-1)
        bad = self._books.first_bad_id(ids)
        if bad >= 0:
            raise ValueError(f"expert id {int(ids[bad])} out of range [0, {self.num_ids})")
        return ids

    def _sorted_unique(self, ids: IdArray) -> IdArray:
        """:func:`sorted_unique` with the order check in one native call."""
        if self._books.strictly_increasing(ids):
            return ids
        out: IdArray = np.unique(ids)
        return out

    def is_resident(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Has a slot (its copy may still be in flight)."""
        return self.slot_of[self._ids(flat_ids)] >= 0

    def resident_mask(self) -> npt.NDArray[np.bool_]:
        """``(num_layers, num_experts)`` experts holding a slot."""
        return (self.slot_of >= 0).reshape(self.num_layers, self.num_experts)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self.slab[int(slot)]

    @exclusive
    def device_slot_table(self) -> torch.Tensor:
        """``slot_of`` on the cache's device (int64, ``-1``: not resident), for
        routing -> slot lookups in device code. Re-uploaded only after a
        load, eviction or drop changed it, always as a new tensor (callers
        key memos on its identity); on CUDA with a non-blocking copy on the
        current stream (no host sync) out of a reused page-locked buffer
        (:class:`~pdflash.cache.staging.StagingRing`: no pinned allocation
        per upload, a buffer refilled only once its last copy ran)."""
        if self._table is None or self._table_dirty:
            if self._is_cuda:
                if self._table_ring is None:
                    self._table_ring = StagingRing((self.num_ids,), torch.int64, self.device)
                self._table = self._table_ring.upload(self.slot_of)
            else:
                self._table = torch.from_numpy(self.slot_of.copy())
            self._table_dirty = False
        return self._table

    def layer_resident(self, layer: int) -> bool:
        """Every expert of ``layer`` (every owned one, after
        :meth:`restrict_to`) holds a slot (copies may be in flight): a
        forward of that layer needs no copy, whatever its routing."""
        return self._books.all_held(self._layer_ids(layer))

    @exclusive
    def pin_layer(self, layer: int) -> tuple[IdArray, IdArray]:
        """Pin every expert of a layer that :meth:`layer_resident` says is
        resident, without counting accesses (the routing is not known on the
        host: report it with :meth:`defer_access`). Copies still in flight
        are promoted to ON_DEMAND. Returns ``(flat_ids, tickets)``; wait with
        :meth:`wait_ready`, unpin with :meth:`release`."""
        ids = self._layer_ids(layer)
        self._refresh_inflight()  # may drop a failed copy: check residency after it
        bad, slots = self._books.pin_checked(ids)
        if bad >= 0:
            raise ValueError(f"layer {layer} is not fully resident")
        try:
            self._promote(slots, Band.ON_DEMAND)
        except BaseException:
            self._books.pin_present(slots, -1)
            raise
        tickets: IdArray = self.ticket[slots]  # an index array: a copy
        return ids, tickets

    def all_resident(self) -> bool:
        """:meth:`layer_resident` of every layer, in one pass."""
        held = self.slot_of if self.owned is None else self.slot_of[self.owned]
        return bool((held >= 0).all())

    @exclusive
    def pin_layers(self, layers: Sequence[int]) -> list[tuple[IdArray, IdArray]]:
        """:meth:`pin_layer` of each of ``layers`` in one pass (one refresh of
        the copies' states, one pin update, one promotion): a replayed step
        pins every layer at once. Raises ``ValueError`` with nothing pinned
        if a layer is not fully resident."""
        per_layer, tickets = self.pin_layers_joined(layers)
        out: list[tuple[IdArray, IdArray]] = []
        at = 0
        for layer_ids in per_layer:  # slices (np.split costs several times more)
            out.append((layer_ids, tickets[at : at + len(layer_ids)]))
            at += len(layer_ids)
        return out

    @exclusive
    def pin_layers_joined(self, layers: Sequence[int]) -> tuple[list[IdArray], IdArray]:
        """:meth:`pin_layers` returning each layer's ids (read-only) and the
        tickets of all of them end to end, in that order, without a slice
        per layer (a replayed step's pins read the tickets together)."""
        self._refresh_inflight()
        per_layer, ids = self._layers_ids(layers)
        bad, slots = self._books.pin_checked(ids)  # distinct experts hold distinct slots
        if bad >= 0:
            raise ValueError(f"layer {int(ids[bad]) // self.num_experts} is not fully resident")
        try:
            self._promote(slots, Band.ON_DEMAND)
        except BaseException:
            self._books.pin_present(slots, -1)
            raise
        tickets: IdArray = self.ticket[slots]
        return per_layer, tickets

    @exclusive
    def unpin_layers(self, layers: Sequence[int]) -> None:
        """:meth:`unpin_layer` of each of ``layers`` in one pass, with one
        event on the compute stream guarding all their slots."""
        per_layer, ids = self._layers_ids(layers)
        if not per_layer:
            return
        bad, slots = self._books.unpin_checked(ids)
        if bad >= 0:
            raise ValueError(f"layers {list(layers)} are not all pinned")
        self._record_slot_event(slots)

    @exclusive
    def unpin_layer(self, layer: int) -> None:
        """Undo :meth:`pin_layer` (the layer's experts cannot have moved
        while pinned): one event on the compute stream guards their slots."""
        bad, slots = self._books.unpin_checked(self._layer_ids(layer))
        if bad >= 0:
            raise ValueError(f"layer {layer} is not pinned")
        self._record_slot_event(slots)

    @property
    def _events(self) -> npt.NDArray[np.object_]:
        """Per slot, the event an eviction would wait for, or None (a copy)."""
        return self._slot_events.events

    def _record_slot_event(self, slots: npt.NDArray[np.int64]) -> None:
        """CUDA: record one event on the compute stream after the kernels
        that read ``slots``; an eviction of any of them waits for it. The
        event comes from a pool (:class:`~pdflash.cache.slot_events.SlotEvents`):
        one no slot holds any more, so nothing waits on its last record."""
        if self._is_cuda:
            self._slot_events.record(slots, torch.cuda.current_stream(self.device))

    @exclusive
    def defer_access(self, layer: int, routed: torch.Tensor) -> None:
        """Record that a forward of ``layer`` routed to the experts ``routed``
        (a device tensor of expert indices within the layer, any shape),
        without a host sync: hits, bytes used and the policy's access
        records are applied when the host next needs them (an eviction
        choice, :meth:`stats`, a counter read)."""
        layer = int(layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        inflight = self._books.inflight_row(layer)  # [1, experts]
        self.clock += 1
        # NOTE: kept in the caller's shape (flattened when applied) and
        # detached only when it tracks gradients: no dispatch per call
        rows = routed.detach() if routed.requires_grad else routed
        self._deferred.append(((layer,), rows, self.clock, inflight))
        self._bound_deferred(int(rows.numel()))

    @exclusive
    def defer_accesses(self, layers: Sequence[int], routed: torch.Tensor) -> None:
        """:meth:`defer_access` of each of ``layers`` in one record:
        ``routed[j]`` (any shape after the first axis) is layer
        ``layers[j]``'s, and each layer gets its own clock tick, in order,
        as separate calls would."""
        key = _layer_key(layers)
        if int(routed.shape[0]) != len(key):
            raise ValueError(f"{int(routed.shape[0])} routings for {len(key)} layers")
        if not key:
            return
        if key == tuple(range(self.num_layers)):
            slots = self.slot_of.reshape(self.num_layers, self.num_experts)
        else:
            rows = np.asarray(key, dtype=np.int64)[:, None] * self.num_experts
            slots = self.slot_of[rows + np.arange(self.num_experts)]
        inflight = self.ticket[np.maximum(slots, 0)] >= 0
        first = self.clock + 1
        self.clock += len(key)
        per_layer = int(routed[0].numel())
        self._deferred.append((key, routed.detach().reshape(len(key), per_layer), first, inflight))
        self._bound_deferred(len(key) * per_layer)

    def _bound_deferred(self, added: int) -> None:
        """Count ``added`` deferred ids; past :data:`MAX_DEFERRED_IDS`, apply
        them now (one host sync, amortised over the steps that queued them)."""
        self._deferred_ids += added
        if self._deferred_ids > MAX_DEFERRED_IDS:
            self._flush_deferred()

    def _flush_deferred(self) -> None:
        if not self._deferred:
            return
        pending, self._deferred = self._deferred, []
        self._deferred_ids = 0
        # NOTE: the one host sync of layers run without one; it happens only
        # when the host must decide something from these accesses.
        lengths = [int(r.numel()) for _, r, _, _ in pending]
        routed_all = torch.cat([r.reshape(-1) for _, r, _, _ in pending]).cpu().numpy()
        routed_all = routed_all.astype(np.int64, copy=False)
        parts = np.split(routed_all, np.cumsum(lengths)[:-1])
        for (layers, _, first, inflight_all), rows in zip(pending, parts, strict=True):
            per_layer = rows.reshape(len(layers), rows.size // len(layers))
            for j, layer in enumerate(layers):
                self._apply_access(layer, per_layer[j], first + j, inflight_all[j])

    def _apply_access(
        self,
        layer: int,
        r: npt.NDArray[np.int64],
        clock: int,
        inflight: npt.NDArray[np.bool_],
    ) -> None:
        """One deferred access of ``layer`` (expert indices ``r``), applied:
        the distinct routed experts still holding a slot (one dropped since,
        by a failed copy, is not counted) are hits and used."""
        ids, inflight_hits, fresh = self._books.apply_access(layer, r, inflight)
        self._hits += int(ids.size)
        self._inflight_hits += inflight_hits
        self._bytes_used += fresh * self.expert_nbytes
        self.policy.on_access(ids, clock)

    @exclusive
    def set_predicted(self, flat_ids: npt.ArrayLike) -> None:
        """Tell a route-ahead-aware policy which experts to protect."""
        setter = getattr(self.policy, "set_predicted", None)
        if setter is None:
            raise TypeError(f"eviction policy {self.policy.name!r} does not take predictions")
        setter(self._ids(flat_ids))

    # -- slot management -----------------------------------------------------

    def _refresh_inflight(self) -> None:
        """Clear finished copies; forget unpinned slots whose copy failed or
        was cancelled (e.g. ``issuer.cancel(Band.ROUTE_AHEAD)``), so the
        expert is fetched again instead of being read as garbage."""
        busy, tickets = self._books.inflight()
        if busy.size == 0:
            return
        if self.settle_copies:
            # NOTE: failed/cancelled copies raise here; they are dropped below
            with contextlib.suppress(Exception):
                self.issuer.wait(tickets, self.wait_timeout_s)
        bad = self._books.settle(busy, self._copy_states(tickets), _DONE)
        if bad.size:
            self.failed_copies += int(bad.size)
            self._drop(bad)

    def _copy_outcomes(
        self, slots: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """(landed, failed-or-cancelled) for the in-flight copies of ``slots``.

        NOTE: ``poll`` reports failed/cancelled copies as finished; telling
        them apart needs ``issuer.states`` (:class:`pdflash.h2d.H2DIssuer`'s
        :class:`~pdflash.protocols.TicketState` codes: > ``DONE`` means failed
        or cancelled). An issuer
        without ``states`` is trusted to complete what it accepted.
        """
        states = self._copy_states(self.ticket[slots])
        return states == _DONE, states > _DONE

    def _copy_states(self, tickets: IdArray) -> npt.NDArray[np.uint8]:
        """:class:`~pdflash.protocols.TicketState` codes of ``tickets`` (an
        issuer without ``states``: ``DONE`` where ``poll`` says finished,
        else ``RUNNING``)."""
        states_fn = getattr(self.issuer, "states", None)
        if states_fn is None:
            done = np.asarray(self.issuer.poll(tickets), dtype=np.bool_)
            return np.where(done, _DONE, _RUNNING).astype(np.uint8)
        return np.asarray(states_fn(tickets), dtype=np.uint8)

    def _evictable_slots(self, exclude: IdArray) -> npt.NDArray[np.int64]:
        """Held, unpinned slots with no copy in flight, not holding an
        ``exclude`` id (ascending)."""
        return self._books.evictable(exclude)

    def _available(self, exclude: IdArray) -> int:
        """Free slots plus evictable ones (:meth:`_evictable_slots`), counted
        without listing them."""
        return self._books.available(exclude)

    def _reserve(self, n: int, exclude: IdArray) -> npt.NDArray[np.int64]:
        """Up to ``n`` free slots, evicting through the policy; never evicts
        ``exclude`` ids."""
        free = self._books.free_slots(n)
        if free.size >= n:
            return free
        candidates = self._books.evictable_ids(exclude)
        need = min(n - free.size, candidates.size)
        if need == 0:
            return free
        self._flush_deferred()  # the policy must have seen every access first
        victims = self.policy.victims(candidates, need)
        vslots = self.slot_of[victims]
        self._evict(vslots)
        return np.concatenate([free, vslots])

    def _evict(self, slots: npt.NDArray[np.int64]) -> None:
        if self._is_cuda:  # (events are recorded on CUDA only)
            for ev in self._slot_events.take(slots):
                ev.synchronize()  # see the module NOTE: kernels still reading these slots
        ids, unused, unused_prefetch = self._books.evict(slots)
        self.bytes_evicted_unused += unused * self.expert_nbytes
        self.prefetch_bytes_evicted_unused += unused_prefetch * self.expert_nbytes
        self._table_dirty = True
        self.evictions += int(slots.size)
        self.policy.on_evict(ids)

    def _load(self, ids: IdArray, slots: npt.NDArray[np.int64], band: Band) -> IdArray:
        keys, dst, nbytes = self._books.copy_args(
            slots, self._next_key, self._slab_ptr, self.expert_nbytes
        )
        src = self.source.host_ptrs(ids)
        issue_band = band if self.single_band is None else self.single_band
        tickets = np.asarray(self.issuer.submit(src, dst, nbytes, keys, issue_band), dtype=np.int64)
        self._next_key += ids.size
        self._books.load(ids, slots, tickets, keys, int(band), band != Band.ON_DEMAND)
        self._table_dirty = True
        self.copies += int(ids.size)
        self.bytes_in += int(ids.size) * self.expert_nbytes
        if band != Band.ON_DEMAND:
            self.prefetch_bytes_in += int(ids.size) * self.expert_nbytes
        self.policy.on_insert(ids, self.clock)
        return tickets

    def _promote(self, slots: npt.NDArray[np.int64], band: Band) -> None:
        """Resubmit in-flight copies of a lower band at ``band`` (same keys:
        the issuer promotes them instead of copying twice)."""
        low = self._books.promotable(slots, int(band))  # (slots < 0 skipped)
        if low.size == 0:
            return
        if self.single_band is not None:
            # one FIFO band: nothing to promote; the copy keeps its place
            self.band[low] = int(band)
            return
        ids = self.expert_of[low]
        src = self.source.host_ptrs(ids)
        _, dst, nbytes = self._books.copy_args(low, 0, self._slab_ptr, self.expert_nbytes)
        tickets = np.asarray(
            self.issuer.submit(src, dst, nbytes, self.key[low], band), dtype=np.int64
        )
        self.ticket[low] = tickets
        self.band[low] = int(band)

    # -- the two entry points --------------------------------------------------

    @exclusive
    def prefetch(
        self,
        flat_ids: npt.ArrayLike,
        band: Band = Band.ROUTE_AHEAD,
        *,
        protect: npt.ArrayLike | None = None,
    ) -> IdArray:
        """Start copies for the experts that are not resident; best effort.

        Returns one ticket per id (-1: already resident and its copy done, or
        no evictable slot was found — counted in ``prefetch_dropped``). Never
        evicts a pinned expert, an in-flight copy, another id of this call, or
        an id in ``protect`` (e.g. experts a forward needs before these).
        An id whose copy is in flight at a lower band is promoted to ``band``.
        When fewer slots than missing ids are found, the ids that come first
        in ``flat_ids`` get them.
        """
        ids_in = self._ids(flat_ids)
        self._check_owned(ids_in)
        keep = self._ids(protect) if protect is not None else np.zeros(0, dtype=np.int64)
        ids = first_occurrences(ids_in)  # keep the caller's priority order
        self.clock += 1
        self._refresh_inflight()
        slots, missing = self._books.split_present(ids)
        self._promote(slots, band)
        if missing.size:
            exclude = np.concatenate([ids, keep]) if keep.size else ids
            new_slots = self._reserve(int(missing.size), exclude=exclude)
            got = int(new_slots.size)
            self.prefetch_dropped += int(missing.size) - got
            if got:
                self._load(missing[:got], new_slots, band)
        out_slots = self.slot_of[ids_in]
        return np.where(out_slots >= 0, self.ticket[np.maximum(out_slots, 0)], -1).astype(np.int64)

    @exclusive
    def acquire(self, flat_ids: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], IdArray]:
        """Pin the experts and submit ON_DEMAND copies for the missing ones,
        without waiting; returns ``(slots, tickets)`` aligned with ``flat_ids``
        (ticket -1: the slot is ready). Wait with :meth:`wait_ready` before
        reading a slot; the offloaded block waits expert by expert so copies
        overlap compute. Raises :class:`CacheTooSmallError` (state unchanged)
        if the distinct ids do not fit in the slots not pinned by others.
        """
        ids_in = self._ids(flat_ids)
        self._check_owned(ids_in)
        ids = self._sorted_unique(ids_in)
        # NOTE: earlier deferred accesses go to the policy before this one (no
        # extra wait in practice: the caller has just read this layer's routing)
        self._flush_deferred()
        self._refresh_inflight()
        books = self._books
        slots, missing = books.split_present(ids)  # slots: -1 for the missing ids
        if missing.size:  # (nothing missing always fits)
            room = books.available(ids)
            if missing.size > room:
                raise CacheTooSmallError(
                    f"{ids.size} distinct experts requested but only {room} of "
                    f"{self.num_slots} slots are free or evictable (the rest are pinned or "
                    "in flight)"
                )
        books.pin_present(slots, 1)  # so they cannot be chosen as victims below
        try:
            if missing.size:
                new_slots = self._reserve(int(missing.size), exclude=ids)
                assert new_slots.size == missing.size
                self._note_miss_copies(self._load(missing, new_slots, Band.ON_DEMAND))
                books.pin_present(new_slots, 1)
            self._promote(slots, Band.ON_DEMAND)
        except BaseException:
            # e.g. the issuer refused the copies: nothing stays pinned; the
            # slots freed for them stay free (their experts were evicted)
            books.pin_present(slots, -1)
            loaded = self.slot_of[missing]
            self.pins[loaded[loaded >= 0]] = 0
            raise
        self.clock += 1
        self._hits += int(ids.size - missing.size)
        self.misses += int(missing.size)
        inflight_hits, fresh = books.commit_access(ids, slots)
        self._inflight_hits += inflight_hits
        self._bytes_used += fresh * self.expert_nbytes
        self.policy.on_access(ids, self.clock)
        return books.out_tickets(ids_in)

    def _note_miss_copies(self, tickets: IdArray) -> None:
        """Remember the tickets of copies :meth:`acquire` issued for missing
        experts (for :meth:`miss_copies`); the oldest are forgotten past
        :data:`MISS_TICKETS_KEPT`, long after any forward waits on them."""
        self._miss_tickets.update(tickets.tolist())
        if len(self._miss_tickets) > 2 * MISS_TICKETS_KEPT:
            self._miss_tickets = set(sorted(self._miss_tickets)[-MISS_TICKETS_KEPT:])

    @exclusive
    def miss_copies(self, tickets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Which of ``tickets`` are copies :meth:`acquire` issued for a
        missing expert (an on-demand miss, of this access or an earlier one);
        the rest were issued ahead of any access (prefetches) or are -1."""
        t = np.asarray(tickets, dtype=np.int64).reshape(-1)
        kept = self._miss_tickets
        return np.fromiter((x in kept for x in t.tolist()), dtype=np.bool_, count=t.size)

    @exclusive
    def wait_ready(self, tickets: npt.ArrayLike) -> None:
        """Make the experts of ``tickets`` (from :meth:`acquire`) readable:
        on CUDA the current stream waits for the copies (no host sync); on
        the CPU this blocks. Tickets of -1 are skipped."""
        t = np.asarray(tickets, dtype=np.int64).reshape(-1)
        t = t[t >= 0]
        if t.size == 0:
            return
        if self._is_cuda:
            stream = torch.cuda.current_stream(self.device).cuda_stream
            self.issuer.stream_wait(t, stream)
        else:
            self.issuer.wait(t, self.wait_timeout_s)
            # NOTE: the offloaded block waits one expert at a time; an
            # equality test is several times cheaper than isin for one ticket
            done = self.ticket == t[0] if t.size == 1 else np.isin(self.ticket, t)
            self.ticket[done] = -1

    @exclusive
    def ensure_resident(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """:meth:`acquire` + :meth:`wait_ready`: pin the experts, copy the
        missing ones ON_DEMAND, and make them readable (CUDA: the current
        stream waits, no host sync; CPU: blocks). Returns their slots
        (aligned with ``flat_ids``). Match every call with :meth:`release`.
        If a copy fails, the experts are unpinned (failed copies dropped)
        and the error propagates: do not call :meth:`release` then.
        """
        return acquire_and_wait(self, flat_ids, self.wait_ready)

    @exclusive
    def abort(self, flat_ids: npt.ArrayLike) -> None:
        """Undo :meth:`acquire` after a failure: unpin the experts and drop
        those whose copy has not completed (their bytes are not valid)."""
        ids = self._sorted_unique(self._ids(flat_ids))
        slots = self.slot_of[ids]
        slots = slots[slots >= 0]
        self.pins[slots] = np.maximum(self.pins[slots] - 1, 0)
        busy = slots[self.ticket[slots] >= 0]
        if busy.size:
            # a failed or cancelled copy is not valid either (poll calls it done)
            done, _ = self._copy_outcomes(busy)
            self.ticket[busy[done]] = -1
            self._drop(busy[~done])

    def _inflight_unpinned(self, ids: IdArray) -> tuple[IdArray, npt.NDArray[np.int64]]:
        """``(positions in ids, slots)`` of the experts whose copy is in
        flight into an unpinned slot."""
        slots = self.slot_of[ids]
        pick = np.flatnonzero(slots >= 0)
        s = slots[pick]
        keep = (self.ticket[s] >= 0) & (self.pins[s] == 0)
        return pick[keep], s[keep]

    @exclusive
    def unstarted_copies(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Which of the experts ``flat_ids`` have a copy in flight into an
        unpinned slot that has not started: what :meth:`give_back_unstarted`
        could give back (none where the issuer cannot cancel one copy)."""
        ids = self._ids(flat_ids)
        out = np.zeros(ids.size, dtype=np.bool_)
        if getattr(self.issuer, "cancel_unstarted", None) is None:
            return out
        pick, s = self._inflight_unpinned(ids)
        if s.size:
            out[pick] = self._copy_states(self.ticket[s]) == _QUEUED
        return out

    @exclusive
    def give_back_unstarted(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Cancel the copies of the distinct experts ``flat_ids`` that are in
        flight, unpinned and not started yet, and free their slots: those
        experts are then absent, as before their copy was asked for (the
        bytes never crossed the link and count nowhere). Returns True where
        given back; a resident, absent or pinned expert, or one whose copy
        started, is left as it is. An issuer without ``cancel_unstarted``
        gives back nothing."""
        ids = self._ids(flat_ids)
        out = np.zeros(ids.size, dtype=np.bool_)
        cancel = getattr(self.issuer, "cancel_unstarted", None)
        if cancel is None or ids.size == 0:
            return out
        pick, s = self._inflight_unpinned(ids)
        if s.size == 0:
            return out
        gone = np.asarray(cancel(self.ticket[s]), dtype=np.bool_)
        pick, s = pick[gone], s[gone]
        if s.size == 0:
            return out
        out[pick] = True
        # the byte books counted these copies when they were asked for
        # (counted: since the last reset_stats); none of their bytes moved
        booked = s[self.counted[s]]
        self.copies -= int(booked.size)
        self.bytes_in -= int(booked.size) * self.expert_nbytes
        self.prefetch_bytes_in -= int(self.by_prefetch[booked].sum()) * self.expert_nbytes
        self.counted[s] = False
        self.given_back += int(s.size)
        self._drop(s)
        return out

    def _drop(self, slots: npt.NDArray[np.int64]) -> None:
        """Forget slots whose copy failed (their bytes are not valid)."""
        if slots.size == 0:
            return
        ids = self.expert_of[slots]
        self.slot_of[ids] = -1
        self.expert_of[slots] = -1
        self._table_dirty = True
        self.ticket[slots] = -1
        self.pins[slots] = 0
        self.policy.on_evict(ids)

    @exclusive
    def release(self, flat_ids: npt.ArrayLike) -> None:
        """Unpin experts pinned by :meth:`ensure_resident`."""
        ids = self._sorted_unique(self._ids(flat_ids))
        bad, slots = self._books.unpin_checked(ids)
        if bad >= 0:
            raise ValueError(f"expert {int(ids[bad])} is not pinned")
        self._record_slot_event(slots)

    @contextmanager
    def use(self, flat_ids: npt.ArrayLike) -> Iterator[npt.NDArray[np.int64]]:
        """``with cache.use(ids) as slots:`` — ensure_resident ... release."""
        slots = self.ensure_resident(flat_ids)
        try:
            yield slots
        finally:
            self.release(flat_ids)

    @exclusive
    def drain_inflight(self) -> None:
        """Block until every in-flight copy into an unpinned slot finishes
        (so those slots become evictable); failures are handled as in
        :meth:`_refresh_inflight`."""
        busy = np.flatnonzero((self.ticket >= 0) & (self.pins == 0))
        if busy.size:
            # NOTE: failed/cancelled copies raise here; the refresh below drops them.
            with contextlib.suppress(Exception):
                self.issuer.wait(self.ticket[busy], self.wait_timeout_s)
        self._refresh_inflight()

    @contextmanager
    def settled(self) -> Iterator[None]:
        """Within: the cache decides as if every copy had landed by the time
        it looks (:attr:`settle_copies`; it waits for them), so the same
        calls leave the same resident set however fast copies run. An
        in-flight copy is never evictable, so otherwise which experts a
        prefetch or a miss evicts depends on the copy thread's progress (a
        loaded host ends a warm-up with another resident set). For
        warm-ups, not measured runs: it serializes copies with compute."""
        before = self.settle_copies
        self.settle_copies = True
        try:
            yield
        finally:
            self.settle_copies = before

    @exclusive
    def free_capacity(self, protect: npt.ArrayLike | None = None) -> int:
        """Slots a forward could pin now (free or evictable), not counting
        the slots of ``protect`` ids."""
        self._refresh_inflight()
        keep = self._ids(protect) if protect is not None else _NO_IDS
        return self._books.available(keep)

    def inflight_mask(self) -> npt.NDArray[np.bool_]:
        """``(num_layers, num_experts)``: experts whose copy is still in flight
        (as of the last refresh)."""
        out = np.zeros(self.num_ids, dtype=np.bool_)
        busy = np.flatnonzero((self.ticket >= 0) & (self.expert_of >= 0))
        out[self.expert_of[busy]] = True
        return out.reshape(self.num_layers, self.num_experts)

    @exclusive
    def wait_for_capacity(self) -> int:
        """When no slot is free or evictable, wait for every in-flight copy
        to land (pinned or not: a copy that lands settles its slot, a failed
        or cancelled one frees it), one ticket at a time. Returns the free
        capacity; 0 only when every slot stays pinned (or holds a copy that
        never completes): then the cache is really too small."""
        room = self.free_capacity()
        if room > 0:
            return room
        busy = np.flatnonzero(self.ticket >= 0)
        # NOTE: one ticket at a time: ``wait`` raises on the first failed or
        # cancelled copy, which must not stop us waiting for the rest.
        for t in self.ticket[busy].tolist():
            with contextlib.suppress(Exception):
                self.issuer.wait(np.asarray([t], dtype=np.int64), self.wait_timeout_s)
        return self.free_capacity()


if TYPE_CHECKING:
    # mypy: an ExpertCache is the engine's and the prefetcher's cache view
    def _is_cache_view(cache: ExpertCache) -> ExpertCacheView:
        return cache


class _Acquiring(Protocol):
    def acquire(self, flat_ids: npt.ArrayLike) -> tuple[IdArray, IdArray]: ...

    def abort(self, flat_ids: npt.ArrayLike) -> None: ...


def acquire_and_wait(
    cache: _Acquiring, flat_ids: npt.ArrayLike, wait: Callable[[IdArray], None]
) -> IdArray:
    """:meth:`ExpertCache.ensure_resident` with the wait given: ``cache``'s
    ``acquire``, then ``wait(tickets)``, and ``cache.abort`` if the wait
    fails (a wrapper that times the wait passes its own)."""
    slots, tickets = cache.acquire(flat_ids)
    try:
        wait(tickets)
    except BaseException:
        cache.abort(flat_ids)
        raise
    return slots


def quiesce(issuer: CopyIssuer, cache: ExpertCache) -> None:
    """Cancel every copy queued on ``issuer`` and wait for each of the
    cache's copies in flight to land (or fail): before the cache's slab is
    freed, nothing may still write into it. Each ticket is waited for on its
    own, so one failed or cancelled copy does not skip the others' waits."""
    with contextlib.suppress(Exception):
        issuer.cancel(None)
    tickets = np.asarray(cache.ticket)
    for ticket in tickets[tickets >= 0].tolist():
        with contextlib.suppress(Exception):
            issuer.wait(np.asarray([ticket], dtype=np.int64))
