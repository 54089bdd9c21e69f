"""The public verify scheduler: validation and bookkeeping around the
native core :class:`pdflash_native._deficit.DeficitCore`."""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from pdflash._native import load_native
from pdflash.scheduler.config import MIN_WEIGHT, SchedulerConfig, check_fixed_step_bytes
from pdflash.scheduler.policies import PolicyInput, WeightPolicy

if TYPE_CHECKING:
    # mypy types every call against the checked stub (_deficit.pyi)
    from pdflash_native import _deficit
else:
    _deficit = load_native("_deficit")

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class UnknownRequestError(KeyError):
    """A request id that is not live was passed where a live one is needed."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown request"


@dataclass(frozen=True)
class StepResult:
    """One step's batch and the ledger after it.

    Per-item arrays are aligned with ``request_ids`` (service order = the
    scan order in which marginal bytes were charged). Per-live arrays are
    aligned with ``live_request_ids`` (ring order).

    NOTE: ``union_ids`` and ``union_mask`` are read-only *views* of the
    scheduler's internal buffers, valid until its next ``step()`` (no per-step
    allocation proportional to the expert grid); copy them to keep them.
    Every other array is a fresh copy.
    """

    step_index: int
    request_ids: npt.NDArray[np.int64]
    requested_tokens: npt.NDArray[np.int64]  # 1 + drafts asked for
    token_grants: npt.NDArray[np.int64]  # a prefix: 1 <= grant <= requested
    marginal_bytes: npt.NDArray[np.int64]  # bytes charged to each item, in order
    costs: npt.NDArray[np.float64]  # dominant cost charged to each item
    union_ids: npt.NDArray[np.int64]  # sorted flat ids of the batch's missing experts
    union_mask: npt.NDArray[np.bool_]  # the same set as a (layers, experts) mask
    live_request_ids: npt.NDArray[np.int64]
    deficits: npt.NDArray[np.float64]  # after the step
    quanta: npt.NDArray[np.float64]  # credit granted during the step
    oversize: bool  # the first item alone exceeds M (alone in the batch unless the marginal rule admitted others)
    cap_reached: bool  # closed by max_requests_per_step with candidates left
    lap: int  # DRR lap counter after the step

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def tokens(self) -> int:
        """Tokens granted in total."""
        return int(self.token_grants.sum())

    @property
    def missing_bytes(self) -> int:
        """Bytes of the union of the batch's missing experts."""
        return int(self.marginal_bytes.sum())

    @property
    def trimmed(self) -> npt.NDArray[np.bool_]:
        """Items granted fewer tokens than requested (trailing drafts dropped)."""
        return self.token_grants < self.requested_tokens


class StepGrants(NamedTuple):
    """What :meth:`VerifyScheduler.step_grants` returns: the decision alone."""

    request_ids: list[int]  # in execution order
    token_grants: list[int]  # aligned with request_ids
    union_ids: npt.NDArray[np.int64]  # sorted flat ids of the batch's missing experts (a copy)


def _check_rid(rid: object) -> int:
    if isinstance(rid, bool) or not isinstance(rid, numbers.Integral):
        raise TypeError(f"request id must be an int, got {rid!r}")
    value = int(rid)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"request id {value} does not fit in int64")
    return value


def _is_request_id(rid: object) -> bool:
    # `type(...) is int` first: the ABC check costs microseconds a call
    return type(rid) is int or (not isinstance(rid, bool) and isinstance(rid, numbers.Integral))


def _check_weight(weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(f"weight must be a number, got {weight!r}")
    w = float(weight)
    if not math.isfinite(w) or w < MIN_WEIGHT:
        raise ValueError(f"weight must be finite and >= {MIN_WEIGHT}, got {weight!r}")
    return w


class VerifyScheduler:
    """The 2-D {tokens, missing-expert-bytes} deficit verify scheduler.

    The rules are in :mod:`pdflash.scheduler`. Every method validates its
    input first and leaves the scheduler unchanged when it raises.

    Args:
        config: budgets and expert grid.
        policy: optional :class:`WeightPolicy` called once per step; ``None``
            keeps each request's base weight (the fair default).
        check_invariants: assert the per-step invariants at the end of every
            ``step()`` (cheap, vLLM style; disabled under ``python -O``).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        policy: WeightPolicy | None = None,
        *,
        check_invariants: bool = True,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.policy = policy
        self.check_invariants = check_invariants
        budget = config.byte_budget
        self._core: Any = _deficit.DeficitCore(
            config.num_flat,
            config.token_budget,
            -1 if budget is None else budget,
            float(config.quantum),
            config.max_requests_per_step or 0,
            fixed_bytes=-1 if config.fixed_step_bytes is None else config.fixed_step_bytes,
        )
        self._fixed_step_bytes = config.fixed_step_bytes if config.marginal_rule else None
        self._total_bytes = 0
        self._num_words = int(self._core.num_words)
        self._no_words = np.zeros(self._num_words, dtype=np.uint64)
        self._no_words.flags.writeable = False
        self._grid = (config.num_layers, config.num_experts)
        self._rids = np.zeros(0, dtype=np.int64)  # ring order
        self._seqs: list[int] = []  # ring order, increasing
        self._seq_of: dict[int, int] = {}
        self._base_weight: dict[int, float] = {}
        self._last_served: dict[int, int] = {}
        self._next_seq = 0
        self._step_index = 0
        self._sizes_given = False

    # ------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, rid: object) -> bool:
        return rid in self._seq_of

    @property
    def request_ids(self) -> npt.NDArray[np.int64]:
        """Live request ids in ring (arrival) order."""
        result: npt.NDArray[np.int64] = self._rids.copy()
        return result

    @property
    def step_index(self) -> int:
        """Number of ``step()`` calls so far (the logical clock)."""
        return self._step_index

    @property
    def lap(self) -> int:
        return int(self._core.lap)

    def deficit(self, rid: int) -> float:
        """Current deficit (credit) of a live request."""
        return float(self._core.deficits()[self._index(rid)])

    def weight(self, rid: int) -> float:
        """Base weight of a live request."""
        self._index(rid)
        return self._base_weight[rid]

    def pending_tokens(self, rid: int) -> int:
        """``1 + drafts`` of the pending demand, or 0 if none."""
        return int(self._core.pending_tokens()[self._index(rid)])

    def _index(self, rid: object) -> int:
        # NOTE: True or 1.0 hash like 1; only what add_request accepts names a request
        seq = self._seq_of.get(rid) if _is_request_id(rid) else None  # type: ignore[call-overload]
        if seq is None:
            raise UnknownRequestError(f"request id {rid!r} is not live")
        return bisect.bisect_left(self._seqs, seq)

    # ------------------------------------------------------------ events
    def add_request(self, rid: int, weight: float = 1.0) -> None:
        """Add a live request at the end of the ring with zero credit."""
        rid = _check_rid(rid)
        w = _check_weight(weight)
        if rid in self._seq_of:
            raise ValueError(f"request id {rid} is already live")
        seq = self._next_seq
        self._core.append(seq, w)
        self._next_seq += 1
        self._seqs.append(seq)
        self._seq_of[rid] = seq
        self._base_weight[rid] = w
        self._rids = np.append(self._rids, np.int64(rid))

    def remove_request(self, rid: int) -> bool:
        """Remove a finished or aborted request; its credit is dropped.

        Unknown or already removed ids are a no-op (returns False).
        """
        seq = self._seq_of.get(rid) if _is_request_id(rid) else None
        if seq is None:
            return False
        forget = getattr(self.policy, "forget", None)
        if forget is not None:  # e.g. DeadlinePolicy: a reused id must not inherit a deadline
            forget(rid)
        index = bisect.bisect_left(self._seqs, seq)
        self._core.remove(index)
        del self._seqs[index]
        del self._seq_of[rid]
        del self._base_weight[rid]
        self._last_served.pop(rid, None)
        self._rids = np.delete(self._rids, index)
        return True

    def set_weight(self, rid: int, weight: float) -> None:
        """Change a live request's base weight (takes effect at its next quantum)."""
        index = self._index(rid)
        w = _check_weight(weight)
        weights = np.array(self._core.weights(), dtype=np.float64)
        weights[index] = w
        self._core.set_weights(weights)
        self._base_weight[rid] = w

    def update_demand(
        self, rid: int, drafted_tokens: int, predicted_experts: npt.ArrayLike | None = None
    ) -> None:
        """Set a request's verify demand: ``1 + drafted_tokens`` tokens and the
        experts it is predicted to route to (flat ids, or a boolean
        ``(num_layers, num_experts)`` mask; None: none, as an empty set).
        Replaces any pending demand."""
        index = self._index(rid)
        if type(drafted_tokens) is not int and (
            isinstance(drafted_tokens, bool) or not isinstance(drafted_tokens, numbers.Integral)
        ):
            raise TypeError(f"drafted_tokens must be an int, got {drafted_tokens!r}")
        tokens = 1 + int(drafted_tokens)
        if drafted_tokens < 0:
            raise ValueError(f"drafted_tokens must be >= 0, got {drafted_tokens!r}")
        limit = self.config.max_tokens_per_item
        if limit is not None and tokens > limit:
            raise ValueError(f"1 + drafted_tokens = {tokens} exceeds max_tokens_per_item={limit}")
        words = (
            self._no_words
            if predicted_experts is None
            else self._to_words(predicted_experts, "predicted_experts")
        )
        self._core.set_demand(index, tokens, words)

    def clear_demand(self, rid: int) -> None:
        """Withdraw a request's pending demand (it stays live, keeps its credit)."""
        self._core.clear_demand(self._index(rid))

    def set_resident(self, experts: npt.ArrayLike) -> None:
        """Set the resident expert set ``R`` (flat ids or a boolean mask)."""
        self._core.set_resident(self._to_words(experts, "resident experts"))

    def set_expert_bytes(self, sizes: npt.ArrayLike) -> None:
        """Per-expert byte sizes, shape ``(num_layers, num_experts)`` or flat."""
        cfg = self.config
        arr = np.asarray(sizes)
        if arr.shape not in ((cfg.num_layers, cfg.num_experts), (cfg.num_flat,)):
            raise ValueError(
                f"expert sizes must have shape ({cfg.num_layers}, {cfg.num_experts}) or "
                f"({cfg.num_flat},), got {arr.shape}"
            )
        if arr.dtype.kind not in "iu":
            raise TypeError(f"expert sizes must be integers (bytes), got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and (arr > _INT64_MAX).any():
            raise ValueError("expert sizes must fit in int64")
        flat = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)
        if (flat < 0).any():
            g = int(np.flatnonzero(flat < 0)[0])
            raise ValueError(f"expert size must be >= 0, got {int(flat[g])} for flat id {g}")
        # NOTE: byte sums are int64 in the hot loop; bound the grid's total.
        if int(flat.max(initial=0)) * cfg.num_flat > 2**62:
            total = sum(map(int, flat))
            if total > 2**62:
                raise ValueError("the expert sizes add up to more than 2**62 bytes")
        else:
            total = int(flat.sum())
        if self._fixed_step_bytes is not None:
            check_fixed_step_bytes(self._fixed_step_bytes, cfg.token_budget, total)
        self._core.set_expert_bytes(flat)
        self._total_bytes = total
        self._sizes_given = True

    @property
    def fixed_step_bytes(self) -> int | None:
        """``F`` of the marginal rule now in force (``None``: ``M`` is hard)."""
        return self._fixed_step_bytes

    def set_fixed_step_bytes(self, fixed_step_bytes: int | None) -> None:
        """Change ``F``, the bytes the link moves in a step's fixed time
        (the engine's step-time model may re-estimate it between steps);
        ``None`` makes ``M`` hard. Takes effect at the next ``step()``; no
        credit or ring position changes."""
        if fixed_step_bytes is not None and self.config.token_only:
            raise ValueError("a token-only scheduler has no byte budget to make soft")
        if fixed_step_bytes is not None:
            fixed_step_bytes = check_fixed_step_bytes(
                fixed_step_bytes, self.config.token_budget, self._total_bytes
            )
        self._core.set_fixed_bytes(-1 if fixed_step_bytes is None else fixed_step_bytes)
        self._fixed_step_bytes = fixed_step_bytes

    def _to_words(self, experts: npt.ArrayLike, what: str) -> npt.NDArray[np.uint64]:
        cfg = self.config
        n = cfg.num_flat
        arr = np.asarray(experts)
        if arr.ndim == 2:
            if arr.shape != (cfg.num_layers, cfg.num_experts):
                raise ValueError(
                    f"{what}: mask shape {arr.shape} != ({cfg.num_layers}, {cfg.num_experts})"
                )
            if arr.dtype != np.bool_ and (
                arr.dtype.kind not in "iu" or ((arr != 0) & (arr != 1)).any()
            ):
                raise ValueError(f"{what}: a mask must be boolean (or 0/1), got {arr.dtype}")
            flat = arr.astype(np.bool_).reshape(-1)
            padded = np.zeros(self._num_words * 64, dtype=np.bool_)
            padded[:n] = flat
        elif arr.ndim == 1 or (arr.ndim == 0 and arr.size == 0):
            if arr.size == 0:
                # the core copies the words: one shared read-only zero set
                return self._no_words
            if arr.dtype.kind not in "iu":
                raise TypeError(
                    f"{what}: flat expert ids must be integers, got dtype {arr.dtype} "
                    "(pass a 2-D (num_layers, num_experts) array for a mask)"
                )
            ids = arr.astype(np.int64, copy=False)
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{what}: expert id {bad} out of range [0, {n})")
            padded = np.zeros(self._num_words * 64, dtype=np.bool_)
            padded[ids] = True
        else:
            raise ValueError(
                f"{what}: expected flat ids (1-D) or a 2-D mask, got shape {arr.shape}"
            )
        packed = np.packbits(padded, bitorder="little")
        return np.ascontiguousarray(packed.view("<u8").astype(np.uint64, copy=False))

    # ------------------------------------------------------------ step
    def step(self) -> StepResult:
        """Choose this step's batch (see :mod:`pdflash.scheduler` for the rules)."""
        self._advance()
        core = self._core
        index, requested, grants, marginal, costs, union_ids, union_mask, deficits, quanta = (
            core.results()
        )
        result = StepResult(
            step_index=self._step_index,
            request_ids=self._rids[index],
            requested_tokens=requested.copy(),
            token_grants=grants.copy(),
            marginal_bytes=marginal.copy(),
            costs=costs.copy(),
            union_ids=_readonly(union_ids),
            union_mask=_readonly(union_mask.view(np.bool_).reshape(self._grid)),
            live_request_ids=self._rids.copy(),
            deficits=deficits.copy(),
            quanta=quanta.copy(),
            oversize=bool(core.oversize),
            cap_reached=bool(core.cap_reached),
            lap=int(core.lap),
        )
        self._finish_step(result.request_ids)
        return result

    def step_grants(self) -> StepGrants:
        """:meth:`step` returning only what an engine executes: the batch's
        request ids and token grants in execution order and the union of its
        missing experts. The same decision, the same state after it; none of
        :class:`StepResult`'s diagnostic copies (the engine's batcher calls
        this every step)."""
        self._advance()
        core = self._core
        index = core.result_index()
        ids = self._rids[index]
        result = StepGrants(
            ids.tolist(), core.result_grant().tolist(), core.result_union_ids().copy()
        )
        self._finish_step(ids)
        return result

    def _advance(self) -> None:
        """The core's step (the policy applied first)."""
        if not self.config.token_only and not self._sizes_given:
            raise RuntimeError(
                "set_expert_bytes() must be called before step() when a byte budget is set"
            )
        if self.policy is not None and len(self._seqs):
            self._apply_policy()
        self._core.step()

    def _finish_step(self, request_ids: npt.NDArray[np.int64]) -> None:
        """The end-of-step asserts and books of a step that served ``request_ids``."""
        core = self._core
        if self.check_invariants:
            # NOTE: vLLM-style end-of-step asserts, computed by the core in C
            # (O(batch + live), ~free); the from-scratch recomputation of every
            # invariant of docs/scheduler.md is in the tests (InvariantTracker).
            assert core.violation == 0, (
                f"scheduler invariant broken at step {self._step_index}: "
                f"{_deficit.VIOLATIONS[core.violation]}"
            )
            cap = self.config.max_requests_per_step
            assert cap is None or len(request_ids) <= cap
        if self.policy is not None:
            for rid in request_ids.tolist():
                self._last_served[rid] = self._step_index
        self._step_index += 1

    def _apply_policy(self) -> None:
        assert self.policy is not None
        core = self._core
        rids = self._rids.copy()
        view = PolicyInput(
            step_index=self._step_index,
            request_ids=rids,
            base_weights=np.array([self._base_weight[r] for r in rids.tolist()], dtype=np.float64),
            deficits=core.deficits().copy(),
            pending_tokens=core.pending_tokens().copy(),
            steps_since_served=np.array(
                [
                    self._step_index - self._last_served[r] if r in self._last_served else -1
                    for r in rids.tolist()
                ],
                dtype=np.int64,
            ),
        )
        weights = np.ascontiguousarray(self.policy.weights(view), dtype=np.float64)
        if weights.shape != rids.shape:
            raise ValueError(
                f"policy returned {weights.shape} weights for {len(rids)} live requests"
            )
        bad = ~np.isfinite(weights) | (weights < MIN_WEIGHT)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"policy weight {float(weights[k])!r} for request {int(rids[k])} is not finite "
                f"and >= {MIN_WEIGHT}"
            )
        core.set_weights(weights)


def _readonly(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    arr.setflags(write=False)
    return arr
