"""Belady's offline-optimal expert replacement over a recorded routing trace.

The trace is what the engine's forward layers actually needed, in execution
order: ``trace[t]`` holds the flat expert ids (``layer * E + expert``)
that forward-layer step ``t`` routed to. The simulated cache has ``slots``
equal-sized slots and starts empty, or holding a given initial set (the
engine's cache at the moment its clock started).

Model (demand paging, the same one the engine's cache obeys):

* every expert of a step must be resident *together* while the step runs, so
  at step ``t`` only experts not needed by ``t`` may be evicted;
* a miss loads one expert (``expert_nbytes`` bytes); with equal sizes,
  minimising loads minimises bytes, and prefetching earlier never saves a
  load, so demand loading is without loss of generality;
* a step that needs more distinct experts than there are slots cannot hold
  them together; it streams: each of its missing experts is loaded once, and
  afterwards the cache holds at most ``slots`` experts out of what was
  resident plus what the step loaded.

The policy: on a miss, evict the resident expert (not needed by the current
step) whose next use is farthest in the future (never used again first);
after a streamed step keep the ``slots`` experts used soonest. Step-granular
farthest-in-future is optimal under this model; ``tests/report/test_belady.py``
checks it against exhaustive search on small traces.

Runs in O(A log A) for A total accesses (a lazy max-heap keyed by next use).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class ReplayResult:
    """What a replacement policy moved over one trace."""

    policy: str
    loads: int  # experts copied in
    bytes_moved: int  # loads * expert_nbytes
    accesses: int  # distinct (step, expert) pairs in the trace
    distinct_experts: int  # compulsory loads (first touches)
    slots: int

    @property
    def hit_rate(self) -> float | None:
        """Hits / accesses; None for an empty trace (nothing observed)."""
        if self.accesses == 0:
            return None
        return 1.0 - self.loads / self.accesses


def _steps(trace: Sequence[npt.ArrayLike]) -> list[npt.NDArray[np.int64]]:
    steps = []
    for t, ids in enumerate(trace):
        arr = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        if arr.size and arr[0] < 0:
            raise ValueError(f"routing trace step {t} has a negative expert id {int(arr[0])}")
        steps.append(arr)
    return steps


def _next_use(
    steps: list[npt.NDArray[np.int64]],
) -> tuple[list[npt.NDArray[np.int64]], dict[int, int]]:
    """For each step and each of its ids, the next step that uses the id;
    and each id's first use."""
    upcoming: dict[int, int] = {}
    out: list[npt.NDArray[np.int64]] = [np.empty(0, np.int64)] * len(steps)
    for t in range(len(steps) - 1, -1, -1):
        ids = steps[t].tolist()
        out[t] = np.fromiter((upcoming.get(g, _NEVER) for g in ids), np.int64, len(ids))
        for g in ids:
            upcoming[g] = t
    return out, upcoming


def _initial(initial: npt.ArrayLike | None, slots: int) -> list[int]:
    if initial is None:
        return []
    ids = np.unique(np.asarray(initial, dtype=np.int64).reshape(-1))
    if ids.size > slots:
        raise ValueError(f"initial resident set has {ids.size} experts, more than {slots} slots")
    if ids.size and ids[0] < 0:
        raise ValueError(f"initial resident set has a negative expert id {int(ids[0])}")
    return [int(g) for g in ids.tolist()]


def _check(slots: int, expert_nbytes: int) -> None:
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise ValueError(f"slots must be a positive integer, got {slots!r}")
    if isinstance(expert_nbytes, bool) or not isinstance(expert_nbytes, (int, np.integer)):
        raise ValueError(f"expert_nbytes must be an integer, got {expert_nbytes!r}")
    if expert_nbytes < 0:
        raise ValueError(f"expert_nbytes must be >= 0, got {expert_nbytes}")


def _result(
    policy: str,
    steps: list[npt.NDArray[np.int64]],
    loads: int,
    slots: int,
    expert_nbytes: int,
) -> ReplayResult:
    """What a replay of ``steps`` under ``policy`` that loaded ``loads``
    experts moved."""
    return ReplayResult(
        policy=policy,
        loads=loads,
        bytes_moved=loads * int(expert_nbytes),
        accesses=sum(int(s.size) for s in steps),
        distinct_experts=len({g for s in steps for g in s.tolist()}),
        slots=int(slots),
    )


def belady(
    trace: Sequence[npt.ArrayLike],
    slots: int,
    expert_nbytes: int,
    initial: npt.ArrayLike | None = None,
) -> ReplayResult:
    """Loads and bytes of the offline-optimal replacement for ``trace``,
    starting from the ``initial`` resident experts (default: an empty cache)."""
    _check(slots, expert_nbytes)
    steps = _steps(trace)
    next_use, first_use = _next_use(steps)
    # expert -> its next use (the heap's truth)
    resident: dict[int, int] = {g: first_use.get(g, _NEVER) for g in _initial(initial, slots)}
    heap: list[tuple[int, int]] = [(-nu, g) for g, nu in resident.items()]
    heapq.heapify(heap)
    loads = 0
    for t, ids_arr in enumerate(steps):
        ids = ids_arr.tolist()
        missing = [g for g in ids if g not in resident]
        loads += len(missing)
        if len(ids) > slots:
            # streamed step: afterwards keep the `slots` experts used soonest
            for g, nu in zip(ids, next_use[t].tolist(), strict=True):
                resident[g] = nu
            keep = sorted(resident.items(), key=lambda item: (item[1], item[0]))[:slots]
            resident = dict(keep)
            heap = [(-nu, g) for g, nu in resident.items()]
            heapq.heapify(heap)
            continue
        # Every id of this step currently has next use == t (the smallest
        # possible), so popping farthest-first never reaches them while an
        # evictable expert remains; |ids| <= slots guarantees one does.
        evict = len(resident) + len(missing) - slots
        while evict > 0:
            neg_nu, g = heapq.heappop(heap)
            if resident.get(g) != -neg_nu:
                continue  # stale entry
            del resident[g]
            evict -= 1
        for g, nu in zip(ids, next_use[t].tolist(), strict=True):
            resident[g] = nu
            heapq.heappush(heap, (-nu, g))
        if len(heap) > 4 * slots + 64:  # drop stale entries now and then
            heap = [(-nu, g) for g, nu in resident.items()]
            heapq.heapify(heap)
    return _result("belady", steps, loads, slots, expert_nbytes)


def lru(
    trace: Sequence[npt.ArrayLike],
    slots: int,
    expert_nbytes: int,
    initial: npt.ArrayLike | None = None,
) -> ReplayResult:
    """The same replay under least-recently-used replacement (a reference
    point: Belady never moves more)."""
    _check(slots, expert_nbytes)
    steps = _steps(trace)
    # expert -> last step used; dict order is the LRU order
    order: dict[int, int] = dict.fromkeys(_initial(initial, slots), -1)
    loads = 0
    for t, ids_arr in enumerate(steps):
        for g in ids_arr.tolist():
            if g not in order:
                loads += 1
            else:
                del order[g]
            order[g] = t
        excess = len(order) - slots
        if excess > 0:
            # evict least recently used; within a streamed step, its own
            # experts are the most recent and go last
            for g in list(order)[:excess]:
                del order[g]
    return _result("lru", steps, loads, slots, expert_nbytes)


def free_start_loads(result: ReplayResult) -> int:
    """Loads of the optimum when it may also choose the cache's initial
    contents for free: Belady's loads from an empty cache minus the loads
    that filled empty slots (``min(slots, distinct experts)``). A lower bound
    on what any policy moves from any starting state."""
    return max(0, result.loads - min(result.slots, result.distinct_experts))


#: How a row's Belady replay chose its starting cache contents.
INITIAL_STATE_ENGINE = "engine"  # the engine's resident set when its clock started
INITIAL_STATE_EMPTY = "empty"  # the engine did not report it (e.g. an older engine)
INITIAL_STATE_NONE = "none"  # nothing was replayed (empty trace)


def trace_metrics(
    routing_trace: Sequence[npt.ArrayLike],
    cache_slots: int,
    expert_nbytes: int,
    committed_tokens: object,
    initial_resident: npt.ArrayLike | None = None,
) -> dict[str, object]:
    """The routing-trace fields of a bench row (JSON-ready; unmeasured ones
    ``None`` with a reason under ``not_measured``).

    * ``routed_expert_bytes``: bytes of every expert each forward layer routed
      to (distinct per step), summed over the trace;
    * ``belady_bytes`` / ``belady_bytes_per_token``: what the offline optimum
      moves for the same trace with the same ``cache_slots``, starting from
      ``initial_resident`` (the engine's cache contents when its clock
      started) so the optimum and the engine start alike; from an empty
      cache when that is not given (``belady_initial_state`` says which);
    * ``belady_free_start_bytes``: the optimum with a free choice of starting
      contents (a lower bound on any policy from any state);
    * ``initial_resident_experts``: how many experts the replay started with.
    """
    from pdflash.metrics import NotMeasured, metrics_to_json

    steps = _steps(routing_trace)
    metrics: dict[str, float | NotMeasured] = {
        "routed_expert_bytes": float(sum(int(s.size) for s in steps) * int(expert_nbytes)),
    }
    start = _initial(initial_resident, int(cache_slots)) if initial_resident is not None else []
    if not steps:
        reason = "empty routing trace: no forward layer recorded"
        for name in ("belady_bytes", "belady_bytes_per_token", "belady_free_start_bytes"):
            metrics[name] = NotMeasured(reason)
        initial_state = INITIAL_STATE_NONE
    else:
        cold = belady(steps, int(cache_slots), int(expert_nbytes))
        metrics["belady_free_start_bytes"] = float(free_start_loads(cold) * int(expert_nbytes))
        if initial_resident is not None:
            replay = belady(steps, int(cache_slots), int(expert_nbytes), initial=start)
            initial_state = INITIAL_STATE_ENGINE
        else:
            replay = cold
            initial_state = INITIAL_STATE_EMPTY
        metrics["belady_bytes"] = float(replay.bytes_moved)
        if (
            isinstance(committed_tokens, (int, float))
            and not isinstance(committed_tokens, bool)
            and committed_tokens > 0
        ):
            metrics["belady_bytes_per_token"] = replay.bytes_moved / committed_tokens
        else:
            metrics["belady_bytes_per_token"] = NotMeasured("no committed tokens")
    out: dict[str, object] = dict(metrics_to_json(metrics))
    out["trace_forward_layers"] = len(steps)
    out["cache_slots"] = int(cache_slots)
    out["expert_nbytes"] = int(expert_nbytes)
    out["belady_initial_state"] = initial_state
    out["initial_resident_experts"] = len(start) if initial_resident is not None else None
    if initial_resident is None:
        reasons = out.setdefault("not_measured", {})
        assert isinstance(reasons, dict)
        reasons["initial_resident_experts"] = "the engine did not report its starting cache"
    return out


def bytes_per_token_vs_belady(
    bytes_per_token: object, belady_bytes_per_token: object
) -> tuple[float | None, str | None]:
    """``bytes_per_token / belady_bytes_per_token``, or ``(None, reason)``."""
    bpt, bel = bytes_per_token, belady_bytes_per_token
    number = (int, float)
    if isinstance(bpt, number) and isinstance(bel, number) and bel > 0:
        return float(bpt) / float(bel), None
    if bel == 0:
        return None, "Belady moves no bytes for this trace"
    if not isinstance(bpt, number):
        return None, "bytes_per_token not measured"
    return None, "Belady bytes per token not measured"
