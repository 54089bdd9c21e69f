"""Route-ahead expert predictors: policies behind :class:`ExpertPredictor`.

Every predictor returns float32 scores ``(num_layers, num_experts)``: > 0
means predicted, larger means more confident. Callers rank by score under a
byte budget (:func:`select_under_budget`, or :class:`CombinedPredictor`).

* :class:`ApproxRouterPredictor` — each layer's real router applied to a cheap
  proxy of that layer's residual stream over the drafted block.
* :class:`PreviousRoundPredictor` — the request's last routed set.
* :class:`FrequencyPriorPredictor` — the most frequently routed experts.
* :class:`NextLayerLookahead` — inside the verify forward: layer l+1's router
  on layer l's output (not a block predictor; the engine calls it per layer).
* :class:`TokenPriorPredictor` — token id -> experts, learned online from
  every verified row's routing, calibrated to a precision floor.
* :class:`CombinedPredictor` — weighted ranking or union of the above.

Predictors need only :class:`RouterAccess` from a model adapter, which every
:class:`pdflash.protocols.MoEModelAdapter` provides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdflash.protocols import AttentionSpec, DraftedBlock, ExpertPredictor

if TYPE_CHECKING:
    import torch

ScoreArray = npt.NDArray[np.float32]


class RouterAccess(Protocol):
    """The part of a model adapter predictors use (its routers and embeddings)."""

    num_layers: int
    num_experts: int
    top_k: int

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class StackedRouterAccess(RouterAccess, Protocol):
    """An adapter that also gives every layer's router logits for one hidden
    state in one batched product (None where it cannot; see
    :meth:`pdflash.models.adapters.base.MoEAdapterBase.router_logits_all`)."""

    def router_logits_all(self, hidden: torch.Tensor) -> torch.Tensor | None: ...


class BlockAttentionAccess(RouterAccess, Protocol):
    """What the ``"block_attention"`` proxy needs besides the routers: each
    layer's attention (a subset of :class:`pdflash.protocols.MoEModelAdapter`)."""

    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_spec(self, layer: int) -> AttentionSpec: ...

    def project_qkv(
        self, layer: int, normed: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attention_sinks(self, layer: int) -> torch.Tensor | None: ...

    def project_out(self, layer: int, attn: torch.Tensor) -> torch.Tensor: ...


class FrequencySource(Protocol):
    """Anything with a per-expert frequency estimate (e.g. RouteAheadStats)."""

    def frequency(self) -> npt.NDArray[np.float32]: ...


_PROXIES = ("auto", "embed", "drafter", "block_attention")


def _horizon_rows(block: DraftedBlock) -> int:
    """Positions to predict for: the first ``block.horizon`` (all if None)."""
    total = int(block.token_ids.shape[0])
    if block.horizon is None:
        return total
    if block.horizon <= 0:
        raise ValueError(f"DraftedBlock.horizon must be positive or None, got {block.horizon}")
    return min(block.horizon, total)


#: how :class:`NextLayerLookahead` scores an expert over a forward's rows:
#: its gate probability (softmax over every expert) summed over the rows
#: (``prob``), or its share of each row's top-k gate mass summed over the
#: rows (``share``); see ``EngineConfig.lookahead_score``
LOOKAHEAD_SCORES = ("prob", "share")


def check_lookahead_score(score: str) -> str:
    if score not in LOOKAHEAD_SCORES:
        raise ValueError(f"score must be one of {LOOKAHEAD_SCORES}, got {score!r}")
    return score


def ranked_next_layer(
    scores: npt.NDArray[Any], next_layer: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """A next-layer prediction from its per-expert ``scores`` ``[E]``: the
    flat ids (``next_layer * E + e``) of the positive-score experts, most
    confident first (a stable descending sort: ties keep the lower id), and
    their scores. The one ranking of :class:`NextLayerLookahead` and
    :class:`pdflash.engine.replay.TraceLookahead`."""
    order = np.argsort(-scores, kind="stable")
    order = order[scores[order] > 0]
    # argsort's ids are int64 already: no copy
    ids = (order + next_layer * scores.shape[0]).astype(np.int64, copy=False)
    return ids, scores[order].astype(np.float32, copy=False)


def _topk_gate_scores(
    logits: torch.Tensor, k: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids ``[..., k]`` by gate probability over the last
    dimension of ``logits [..., E]``, and those probabilities."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, min(k, num_experts), dim=-1)
    return ids, values


def batched_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of G blocks of B consecutive positions, each over
    itself only: q ``[G, B, heads, D]``, k/v ``[G, B, kv_heads, D]`` ->
    ``[G, B, heads * D]``. The same code (:func:`pdflash.models.attention.attend_visible`)
    as :func:`pdflash.models.attention.reference_attention` applied to each
    block."""
    import torch

    from pdflash.models.attention import attend_visible, visible_keys

    pos = torch.arange(q.shape[1], device=q.device)
    delta = pos.reshape(-1, 1) - pos.reshape(1, -1)
    return attend_visible(q, k, v, visible_keys(delta, spec), spec, sinks)


class ApproxRouterPredictor:
    """Each layer's real router over a cheap proxy of the drafted block's
    residual stream; per layer, the union of every position's top-k, scored
    by summed gate probability over positions (up to the block's horizon).

    Proxies (``proxy=``):

    * ``"embed"`` — the attention-free residual proxy: the token embeddings
      carried through the previous layers with attention skipped and the
      expert FFNs replaced by nothing, i.e. the embeddings themselves at every
      layer. One embedding lookup and ``num_layers`` (norm, router) pairs.
    * ``"drafter"`` — the drafter's hidden states (``DraftedBlock.
      drafter_hidden``, ``[B, hidden]`` in the target's hidden size) at every
      layer; a block without them raises.
    * ``"block_attention"`` — the embeddings carried through every previous
      layer's attention, computed over the drafted block itself only (no KV
      cache, so the context before the block is not seen), with the expert
      FFNs replaced by nothing. Needs the adapter's attention
      (:class:`BlockAttentionAccess`); costs one small attention per layer.
      NOTE: measured on synthetic random-weight models (``pdflash-bench
      routeahead``), it did worse than ``"embed"`` on qwen3_moe, mixtral and
      olmoe (a block's first positions see none of their real context) and
      better on gpt_oss (a sliding window of 4 keeps attention local).
    * ``"auto"`` (default) — ``"drafter"`` when the block has drafter hidden
      states, else ``"embed"``.

    ``experts_per_token`` (default: the model's top-k) widens or narrows the
    per-token selection: more coverage for less precision.
    """

    def __init__(
        self,
        adapter: RouterAccess,
        *,
        proxy: Literal["auto", "embed", "drafter", "block_attention"] = "auto",
        experts_per_token: int | None = None,
        name: str = "approx_router",
    ) -> None:
        if proxy not in _PROXIES:
            raise ValueError(f"proxy must be one of {_PROXIES}, got {proxy!r}")
        if proxy == "block_attention" and not all(
            hasattr(adapter, m) for m in ("input_norm", "project_qkv", "project_out")
        ):
            raise TypeError("proxy='block_attention' needs an adapter with attention access")
        k = adapter.top_k if experts_per_token is None else experts_per_token
        if not 1 <= k <= adapter.num_experts:
            raise ValueError(f"experts_per_token must be in [1, {adapter.num_experts}], got {k}")
        self.adapter = adapter
        self.proxy = proxy
        self.experts_per_token = k
        self.name = name
        # checked once: a runtime protocol check walks every member
        self._stacks_routers = isinstance(adapter, StackedRouterAccess)

    def _uses_drafter(self, block: DraftedBlock) -> bool:
        return self.proxy == "drafter" or (
            self.proxy == "auto" and block.drafter_hidden is not None
        )

    def _proxy_hidden(self, block: DraftedBlock, rows: int) -> torch.Tensor:
        """The proxy's residual stream entering layer 0 (or, for the
        drafter, at every layer)."""
        if self._uses_drafter(block):
            if block.drafter_hidden is None:
                raise ValueError(
                    f"proxy='drafter' but request {block.request_id}'s block has no drafter_hidden"
                )
            return block.drafter_hidden[:rows]
        return self.adapter.embed(block.token_ids[:rows])

    @staticmethod
    def _attention_plan(
        segments: Sequence[tuple[int, torch.Tensor]], device: torch.device
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[slice, torch.Tensor]]]:
        """All rows' positions; per block length, the row index ``[G, B]`` of
        the blocks with consecutive positions (one batched attention each);
        the other blocks (row slice, positions), each attended alone."""
        import torch

        positions = torch.cat([p.to(device) for _, p in segments])
        # NOTE: one host copy of the positions for the grouping (not a device
        # sync per block)
        host = positions.cpu().numpy()
        by_length: dict[int, list[int]] = {}
        alone: list[tuple[slice, torch.Tensor]] = []
        for start, pos in segments:
            rows = int(pos.shape[0])
            if rows == 1 or bool((np.diff(host[start : start + rows]) == 1).all()):
                by_length.setdefault(rows, []).append(start)
            else:
                alone.append((slice(start, start + rows), positions[start : start + rows]))
        batched = [
            torch.tensor(starts, device=device)[:, None] + torch.arange(rows, device=device)
            for rows, starts in by_length.items()
        ]
        return positions, batched, alone

    def _attention_residual(
        self,
        layer: int,
        hidden: torch.Tensor,
        plan: tuple[torch.Tensor, list[torch.Tensor], list[tuple[slice, torch.Tensor]]],
    ) -> torch.Tensor:
        """``hidden`` plus layer ``layer``'s attention, each block attending
        over itself only (``plan`` from :meth:`_attention_plan`)."""
        import torch

        # NOTE: the adapters' own reference semantics (GQA, sliding window,
        # sinks), so the proxy's attention is the model's, minus the context.
        from pdflash.models.attention import reference_attention

        adapter = cast(BlockAttentionAccess, self.adapter)  # checked in __init__
        spec = adapter.attention_spec(layer)
        sinks = adapter.attention_sinks(layer) if spec.has_sinks else None
        positions, batched, alone = plan
        q, k, v = adapter.project_qkv(layer, adapter.input_norm(layer, hidden), positions)
        out = torch.empty(
            q.shape[0], spec.num_heads * spec.head_dim, dtype=v.dtype, device=q.device
        )
        for index in batched:
            att = batched_block_attention(q[index], k[index], v[index], spec, sinks)
            out[index.reshape(-1)] = att.reshape(index.numel(), -1)
        for rows, pos in alone:
            out[rows] = reference_attention(q[rows], k[rows], v[rows], spec, pos, pos, sinks)
        return hidden + adapter.project_out(layer, out)

    def predict(self, block: DraftedBlock) -> ScoreArray:
        result: ScoreArray = self.predict_batch([block])[0]
        return result

    def predict_batch(self, blocks: Sequence[DraftedBlock]) -> ScoreArray:
        """Scores ``(len(blocks), L, E)`` from one router pass over all the
        blocks' positions (the engine's per-step call). The proxies without
        attention feed every layer the same residual, so where the adapter
        gives every layer's logits in one batched product
        (:class:`StackedRouterAccess`) the pass is a few kernels in all, not
        a few per layer."""
        import torch

        L, E = self.adapter.num_layers, self.adapter.num_experts
        if not blocks:
            return np.zeros((0, L, E), np.float32)
        counts = [_horizon_rows(block) for block in blocks]
        segments = []
        start = 0
        for block, rows in zip(blocks, counts, strict=True):
            segments.append((start, block.positions[:rows]))
            start += rows
        if any(self._uses_drafter(block) for block in blocks):
            hidden = torch.cat(
                [self._proxy_hidden(b, n) for b, n in zip(blocks, counts, strict=True)]
            )
        else:  # NOTE: one embedding lookup for the whole step, not one per request
            ids = torch.cat([b.token_ids[:n] for b, n in zip(blocks, counts, strict=True)])
            hidden = self.adapter.embed(ids)
        owners = torch.repeat_interleave(
            torch.arange(len(blocks), device=hidden.device),
            torch.tensor(counts, device=hidden.device),
        )
        out = torch.zeros(len(blocks), L, E, dtype=torch.float32, device=hidden.device)
        attending = self.proxy == "block_attention"
        plan = self._attention_plan(segments, hidden.device) if attending else None
        # attention is per decoder layer: MoE layer m's is decoder layer moe_layers[m]
        # (a dense layer in between is skipped, as the proxy skips the context)
        decoder = getattr(self.adapter, "moe_layers", None) or range(L)
        with torch.inference_mode():
            # NOTE: the layer-invariant parts of the flat index and the flat
            # view of the scores, made once per step instead of per layer
            # (integer sums: the same index in any order)
            row_base = owners[:, None] * (L * E)
            out_flat = out.view(-1)
            # every layer sees the same proxy residual: one batched router
            # pass where the adapter has it (a few kernels, not a few per layer)
            stacked = (
                cast(StackedRouterAccess, self.adapter).router_logits_all(hidden)
                if plan is None and self._stacks_routers
                else None
            )
            if stacked is not None:
                ids, probs = _topk_gate_scores(stacked, self.experts_per_token, E)  # [L, T, k]
                layer_base = torch.arange(L, device=hidden.device)[:, None, None] * E
                flat = (row_base[None] + layer_base + ids).reshape(-1)
                out_flat.index_add_(0, flat, probs.reshape(-1))
                return out.cpu().numpy()
            for layer in range(L):
                if plan is not None:
                    hidden = self._attention_residual(decoder[layer], hidden, plan)
                normed = self.adapter.moe_norm(layer, hidden)
                logits = self.adapter.router_logits(layer, normed)
                ids, probs = _topk_gate_scores(logits, self.experts_per_token, E)
                flat = (row_base + layer * E + ids).reshape(-1)
                out_flat.index_add_(0, flat, probs.reshape(-1))
        return out.cpu().numpy()

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        """Stateless: nothing to learn from the routed set."""

    def forget(self, request_id: int) -> None:
        """Stateless: nothing to drop."""


class PreviousRoundPredictor:
    """The experts the request's previous verify routed to (score 1.0); no
    prediction (all zeros) before its first :meth:`observe`."""

    def __init__(self, num_layers: int, num_experts: int, *, name: str = "previous_round") -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.name = name
        self._last: dict[int, npt.NDArray[np.bool_]] = {}

    def predict(self, block: DraftedBlock) -> ScoreArray:
        last = self._last.get(block.request_id)
        if last is None:
            return np.zeros((self.num_layers, self.num_experts), dtype=np.float32)
        return last.astype(np.float32)

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        mask = np.asarray(routed)
        if mask.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"routed must have shape {(self.num_layers, self.num_experts)}, got {mask.shape}"
            )
        self._last[request_id] = mask.astype(np.bool_, copy=True)

    def forget(self, request_id: int) -> None:
        self._last.pop(request_id, None)


class FrequencyPriorPredictor:
    """The ``per_layer`` most frequently routed experts of each layer, scored
    by frequency relative to the largest (in (0, 1]). Reads the estimate from
    ``source`` (e.g. :class:`~pdflash.routeahead.stats.RouteAheadStats`)
    at every call; an expert never routed is never predicted."""

    def __init__(
        self,
        source: FrequencySource | Callable[[], npt.NDArray[np.float32]],
        per_layer: int,
        *,
        name: str = "frequency_prior",
    ) -> None:
        if per_layer <= 0:
            raise ValueError(f"per_layer must be positive, got {per_layer}")
        self._read: Callable[[], npt.NDArray[np.float32]] = (
            source.frequency if hasattr(source, "frequency") else source
        )
        self.per_layer = per_layer
        self.name = name

    def predict(self, block: DraftedBlock) -> ScoreArray:
        freq = np.asarray(self._read(), dtype=np.float32)
        if freq.ndim != 2:
            raise ValueError(f"frequency must be (layers, experts), got shape {freq.shape}")
        k = min(self.per_layer, freq.shape[1])
        top = np.argpartition(-freq, k - 1, axis=1)[:, :k]
        out = np.zeros_like(freq)
        rows = np.arange(freq.shape[0])[:, None]
        out[rows, top] = freq[rows, top]
        peak = float(out.max()) if out.size else 0.0
        return out / peak if peak > 0 else out

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        """The source accumulates routing; nothing to do here."""

    def forget(self, request_id: int) -> None:
        """No per-request state."""


class NextLayerLookahead:
    """Layer l+1's router applied to layer l's output, inside the verify
    forward: as soon as layer l finishes, the engine learns (approximately)
    which experts layer l+1 needs and can promote their copies. The proxy
    skips layer l+1's attention (its input norm and attention residual).
    """

    def __init__(
        self,
        adapter: RouterAccess,
        *,
        experts_per_token: int | None = None,
        score: str = "prob",
    ) -> None:
        k = adapter.top_k if experts_per_token is None else experts_per_token
        if not 1 <= k <= adapter.num_experts:
            raise ValueError(f"experts_per_token must be in [1, {adapter.num_experts}], got {k}")
        self.adapter = adapter
        self.experts_per_token = k
        #: :data:`LOOKAHEAD_SCORES`
        self.score = check_lookahead_score(score)

    def predict_next(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Flat expert ids of layer ``layer + 1`` predicted from the residual
        stream ``hidden`` ``[T, hidden]`` after layer ``layer``, most
        confident first, with their scores summed over the T tokens (gate
        probability, or with ``score="share"`` the share of each token's
        top-k gate mass). The last layer has no next layer: empty arrays."""
        import torch

        L, E = self.adapter.num_layers, self.adapter.num_experts
        if not 0 <= layer < L:
            raise ValueError(f"layer must be in [0, {L}), got {layer}")
        if layer == L - 1 or hidden.shape[0] == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        nxt = layer + 1
        # NOTE: inside a forward autograd is already off: entering inference
        # mode per layer would only cost its context switch
        with torch.inference_mode() if torch.is_grad_enabled() else contextlib.nullcontext():
            logits = self.adapter.router_logits(nxt, self.adapter.moe_norm(nxt, hidden))
            ids, probs = _topk_gate_scores(logits, self.experts_per_token, E)
            if self.score == "share":
                probs = probs / probs.sum(dim=-1, keepdim=True)
            scores = torch.zeros(E, dtype=torch.float32, device=hidden.device)
            scores.index_add_(0, ids.reshape(-1), probs.reshape(-1))
            # NOTE: one read of the E scores, ranked on the host (a stable
            # descending sort, as torch's), instead of a device sort, a
            # boolean-mask index (a sync of its own) and two reads
            host = scores.cpu().numpy()
        return ranked_next_layer(host, nxt)


def select_under_budget(
    scores: npt.ArrayLike, expert_nbytes: int | npt.ArrayLike, byte_budget: int
) -> npt.NDArray[np.int64]:
    """Flat ids of the experts to prefetch: the positive-score experts ranked
    by score (ties: lower flat id first, i.e. earlier layer, needed sooner),
    keeping the longest prefix of that ranking whose bytes fit the budget."""
    flat = np.asarray(scores, dtype=np.float32).reshape(-1)
    if byte_budget < 0:
        raise ValueError(f"byte_budget must be >= 0, got {byte_budget}")
    nbytes = np.broadcast_to(np.asarray(expert_nbytes, dtype=np.int64), np.shape(scores))
    nbytes = nbytes.reshape(-1)
    candidates = np.flatnonzero(flat > 0)
    # lexsort: last key is primary -> by -score, then by flat id
    order = candidates[np.lexsort((candidates, -flat[candidates]))]
    # sizes are >= 0, so the cumulative bytes grow and the fitting ranks are a prefix
    fits = int(np.count_nonzero(np.cumsum(nbytes[order]) <= byte_budget))
    return order[:fits].astype(np.int64)


def _scaled_to_weight(scores: ScoreArray, weight: float) -> ScoreArray:
    """``(blocks, L, E)`` scores with each block scaled by ``weight`` over its
    own maximum (so members' weights compare like with like), negatives
    clipped to 0; a block whose maximum is not positive contributes nothing."""
    peak = scores.reshape(scores.shape[0], -1).max(axis=1) if scores.size else np.zeros(0)
    positive = peak > 0
    # float64 quotient, then float32: the same scale for every block size
    scale = np.where(positive, weight / np.where(positive, peak, 1.0).astype(np.float64), 0.0)
    part = np.maximum(scores * scale.astype(np.float32)[:, None, None], 0, dtype=np.float32)
    part[~positive] = 0
    result: ScoreArray = part
    return result


class CombinedPredictor:
    """Weighted combination of predictors, optionally under a byte budget.

    Each member's scores are first scaled to [0, 1] by their own maximum, so
    weights compare like with like. ``mode="rank"``: score = Σ wᵢ·sᵢ;
    ``mode="union"``: score = maxᵢ wᵢ·sᵢ (anything any member predicts). With
    ``byte_budget``, only the experts :func:`select_under_budget` keeps
    retain their score; the rest are 0.
    """

    def __init__(
        self,
        members: Sequence[tuple[ExpertPredictor, float]],
        *,
        mode: Literal["rank", "union"] = "rank",
        expert_nbytes: int | npt.ArrayLike = 1,
        byte_budget: int | None = None,
        name: str = "combined",
    ) -> None:
        if not members:
            raise ValueError(f"{type(self).__name__} needs at least one member")
        if mode not in ("rank", "union"):
            raise ValueError(f"mode must be 'rank' or 'union', got {mode!r}")
        for predictor, weight in members:
            if not weight > 0:
                raise ValueError(f"weight of {predictor.name!r} must be positive, got {weight}")
        self.members = list(members)
        self.mode = mode
        self.expert_nbytes = expert_nbytes
        self.byte_budget = byte_budget
        self.name = name

    def predict(self, block: DraftedBlock) -> ScoreArray:
        parts = (
            _scaled_to_weight(np.asarray(p.predict(block), dtype=np.float32)[None], w)
            for p, w in self.members
        )
        result: ScoreArray = self._combine(parts)[0]
        return result

    def predict_batch(self, blocks: Sequence[DraftedBlock]) -> ScoreArray:
        """Scores ``(len(blocks), L, E)``, each block combined as by
        :meth:`predict`, the members asked through :func:`predict_batch`
        (one batched pass for members that have one)."""
        parts = (_scaled_to_weight(predict_batch(p, blocks), w) for p, w in self.members)
        return self._combine(parts)

    def _combine(self, parts: Iterable[ScoreArray]) -> ScoreArray:
        """Rank (sum) or union (max) of scaled ``(blocks, L, E)`` parts, then
        the byte budget per block."""
        combined: ScoreArray | None = None
        for part in parts:
            if combined is None:
                combined = part
            elif self.mode == "rank":
                combined = combined + part
            else:
                combined = np.maximum(combined, part)
        assert combined is not None
        if self.byte_budget is None:
            return combined
        out = np.zeros_like(combined)
        for i in range(combined.shape[0]):
            keep = select_under_budget(combined[i], self.expert_nbytes, self.byte_budget)
            out[i].reshape(-1)[keep] = combined[i].reshape(-1)[keep]
        return out

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        for predictor, _ in self.members:
            predictor.observe(request_id, routed)

    def forget(self, request_id: int) -> None:
        for predictor, _ in self.members:
            predictor.forget(request_id)

    def observe_tokens(self, token_ids: npt.ArrayLike, topk_ids: npt.ArrayLike) -> None:
        """Hand per-row routing to the members that learn from it."""
        for learner in token_learners(self):
            learner.observe_tokens(token_ids, topk_ids)


def predict_batch(predictor: ExpertPredictor, blocks: Sequence[DraftedBlock]) -> ScoreArray:
    """Scores ``(len(blocks), L, E)``: the predictor's own batched pass when it
    has one (:meth:`ApproxRouterPredictor.predict_batch`), else one
    :meth:`~pdflash.protocols.ExpertPredictor.predict` per block."""
    batched = getattr(predictor, "predict_batch", None)
    if batched is not None:
        return np.asarray(batched(blocks), dtype=np.float32)
    if not blocks:
        raise ValueError("predict_batch needs at least one block to know the shape")
    return np.stack([np.asarray(predictor.predict(b), dtype=np.float32) for b in blocks])


class TokenRoutingObserver(Protocol):
    """A predictor that learns from each routed row's token id (not only the
    block's routed union): the engine feeds it every verified row."""

    def observe_tokens(self, token_ids: npt.ArrayLike, topk_ids: npt.ArrayLike) -> None:
        """``token_ids`` ``[T]`` and their routing ``topk_ids`` ``[T, L, k]``."""
        ...


class TokenPriorPredictor:
    """Token-conditioned prior: in trained MoEs a token's routing depends
    strongly on its id, so the drafted block's token ids (known before the
    verify) predict the verify's experts.

    State, all learned online from routing the verify already returns:

    * a table ``token -> (layer, expert) counts``: ``buckets`` rows of
      ``uint16`` counts ``(L, E)`` (row ``token_id % buckets``: exact while the
      vocabulary fits, shared beyond), each row with its token's occurrence
      count; a row whose count passes ``count_cap`` is halved (bounded values,
      older rounds weigh less). Memory: ``buckets * L * E * 2`` bytes
      (:attr:`table_nbytes`).
    * each layer's per-token expert frequency (the smoothing prior).
    * per request, an exponential average of its routed sets (``request_decay``).
    * a calibration table: per layer, the hit rate of past predictions
      binned by raw score.

    Raw score of expert ``e`` at layer ``l`` for a block: the probability
    that some row routes to it if rows were independent,
    ``p_tok = 1 - prod_rows (1 - p(e | token))`` with ``p(e | token) =
    (count + smoothing * prior) / (occurrences + smoothing)``, mixed with the
    request's recent routing: ``s = (p_tok + request_weight * recent) / (1 +
    request_weight)`` (a sum ranks experts both sources back above either
    alone; on the proxy traces it covered more at the same precision than a
    noisy-or). Selection: the (layer, score bin) cells ranked by their
    measured hit rate, the longest prefix whose pooled precision is at least
    ``precision_target``; a selected expert's score is its cell's hit rate
    (comparable across layers), the rest 0. Before a layer has
    ``min_calibration`` scored experts it selects ``s >= 0.5``.

    Every row of the block counts (the verify routes all of them), so the
    block's ``horizon`` is ignored. Learns only from :meth:`observe` /
    :meth:`observe_tokens`: a prediction never sees the routing it predicts.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        buckets: int = 4096,
        smoothing: float = 2.0,
        request_decay: float = 0.7,
        request_weight: float = 0.5,
        # NOTE: the calibration lags the routing, so the default aims a little
        # above the 0.8 floor issue 14 targets
        precision_target: float = 0.82,
        calibration_bins: int = 64,
        calibration_decay: float = 0.995,
        min_calibration: int = 2048,
        count_cap: int = 4096,
        name: str = "token_prior",
    ) -> None:
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"bad shape ({num_layers}, {num_experts})")
        if buckets <= 0:
            raise ValueError(f"buckets must be positive, got {buckets}")
        if not smoothing > 0:
            raise ValueError(f"smoothing must be > 0, got {smoothing}")
        if not 0.0 <= request_decay < 1.0:
            raise ValueError(f"request_decay must be in [0, 1), got {request_decay}")
        if not 0.0 <= request_weight <= 1.0:
            raise ValueError(f"request_weight must be in [0, 1], got {request_weight}")
        if not 0.0 < precision_target <= 1.0:
            raise ValueError(f"precision_target must be in (0, 1], got {precision_target}")
        if calibration_bins <= 0:
            raise ValueError(f"calibration_bins must be positive, got {calibration_bins}")
        if not 0.0 < calibration_decay <= 1.0:
            raise ValueError(f"calibration_decay must be in (0, 1], got {calibration_decay}")
        if min_calibration < 0:
            raise ValueError(f"min_calibration must be >= 0, got {min_calibration}")
        if not 2 <= count_cap < np.iinfo(np.uint16).max:
            raise ValueError(f"count_cap must be in [2, 65535), got {count_cap}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.buckets = buckets
        self.smoothing = float(smoothing)
        self.request_decay = float(request_decay)
        self.request_weight = float(request_weight)
        self.precision_target = float(precision_target)
        self.calibration_bins = calibration_bins
        self.calibration_decay = float(calibration_decay)
        self.min_calibration = min_calibration
        self.count_cap = count_cap
        self.name = name
        L, E = num_layers, num_experts
        self._counts = np.zeros((buckets, L, E), dtype=np.uint16)
        self._occurrences = np.zeros(buckets, dtype=np.int64)
        self._layer_counts = np.zeros((L, E), dtype=np.float64)
        self._layer_tokens = 0.0
        self._recent: dict[int, npt.NDArray[np.float32]] = {}
        self._pending: dict[int, npt.NDArray[np.float32]] = {}
        self._cal_total = np.zeros((L, calibration_bins), dtype=np.float64)
        self._cal_hits = np.zeros((L, calibration_bins), dtype=np.float64)
        self._cal_seen = np.zeros(L, dtype=np.int64)
        self._cell_score = np.zeros((L, calibration_bins), dtype=np.float32)
        self._refresh_selection()

    @property
    def table_nbytes(self) -> int:
        """Bytes of the token table (the predictor's only large state)."""
        return int(self._counts.nbytes + self._occurrences.nbytes)

    # ------------------------------------------------------------ learning

    def observe_tokens(self, token_ids: npt.ArrayLike, topk_ids: npt.ArrayLike) -> None:
        """Learn ``token_ids`` ``[T]`` routed to ``topk_ids`` ``[T, L, k]``
        (every row a forward routed: verified drafts, rejected ones too)."""
        tokens = np.asarray(token_ids).reshape(-1).astype(np.int64)
        topk = np.asarray(topk_ids)
        L, E = self.num_layers, self.num_experts
        if topk.ndim != 3 or topk.shape[0] != tokens.size or topk.shape[1] != L:
            raise ValueError(
                f"topk_ids must be [{tokens.size}, {L}, k] for {tokens.size} tokens, "
                f"got {topk.shape}"
            )
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError(f"token ids must be >= 0, got {int(tokens.min())}")
        ids = topk.astype(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= E):
            raise ValueError(f"expert id out of range [0, {E}) in topk_ids")
        if not tokens.size:
            return
        rows = tokens % self.buckets
        # top-k ids are distinct per (row, layer): one increment each; rows of
        # one bucket add up in a bincount over the batch's distinct buckets
        layer = np.arange(L)[None, :, None]
        touched, slot = np.unique(rows, return_inverse=True)
        flat = ((slot.reshape(-1, 1, 1) * L + layer) * E + ids).reshape(-1)
        added = np.bincount(flat, minlength=touched.size * L * E).reshape(touched.size, L, E)
        self._counts[touched] += added.astype(np.uint16)
        self._occurrences[touched] += np.bincount(slot.reshape(-1), minlength=touched.size)
        self._layer_counts += np.bincount((layer * E + ids).reshape(-1), minlength=L * E).reshape(
            L, E
        )
        self._layer_tokens += tokens.size
        over = touched[self._occurrences[touched] > self.count_cap]
        if over.size:
            self._counts[over] >>= 1
            self._occurrences[over] >>= 1
        if self._layer_tokens > float(1 << 40):
            self._layer_counts *= 0.5
            self._layer_tokens *= 0.5

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        """The request's verify routed ``routed`` ``(L, E)``: score the last
        prediction for it (calibration) and update its recent routing."""
        mask = np.asarray(routed)
        L, E = self.num_layers, self.num_experts
        if mask.shape != (L, E):
            raise ValueError(f"routed must have shape {(L, E)}, got {mask.shape}")
        used = mask.astype(np.bool_)
        raw = self._pending.pop(request_id, None)
        if raw is not None:
            cells = self._bins(raw) + np.arange(L)[:, None] * self.calibration_bins
            size = L * self.calibration_bins
            self._cal_total *= self.calibration_decay
            self._cal_hits *= self.calibration_decay
            self._cal_total += np.bincount(cells.reshape(-1), minlength=size).reshape(L, -1)
            self._cal_hits += np.bincount(
                cells.reshape(-1), weights=used.reshape(-1), minlength=size
            ).reshape(L, -1)
            self._cal_seen += E
            self._refresh_selection()
        previous = self._recent.get(request_id)
        fresh = used.astype(np.float32) * np.float32(1.0 - self.request_decay)
        if previous is None:
            # the first round stands in for the whole history
            self._recent[request_id] = used.astype(np.float32)
        else:
            self._recent[request_id] = previous * np.float32(self.request_decay) + fresh

    def forget(self, request_id: int) -> None:
        self._recent.pop(request_id, None)
        self._pending.pop(request_id, None)

    # ---------------------------------------------------------- prediction

    def _bins(self, raw: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        nb = self.calibration_bins
        return np.minimum((raw * nb).astype(np.int64), nb - 1)

    def _refresh_selection(self) -> None:
        """Per (layer, bin) cell: its hit rate when selected, else 0."""
        nb = self.calibration_bins
        cold = self._cal_seen < self.min_calibration
        score = np.zeros((self.num_layers, nb), dtype=np.float32)
        # cold layers: raw score >= 0.5, scored by the bin's centre
        centres = ((np.arange(nb) + 0.5) / nb).astype(np.float32)
        score[cold] = np.where(centres >= 0.5, centres, 0.0)
        warm = ~cold
        if warm.any():
            total = self._cal_total[warm].reshape(-1)
            hits = self._cal_hits[warm].reshape(-1)
            rate = np.divide(hits, total, out=np.zeros_like(hits), where=total > 0)
            order = np.argsort(-rate, kind="stable")
            order = order[total[order] > 0]
            cum_hits = np.cumsum(hits[order])
            cum_total = np.cumsum(total[order])
            # pooled precision only falls along the ranking: the kept cells are a prefix
            keep = order[: int(np.count_nonzero(cum_hits >= self.precision_target * cum_total))]
            chosen = np.zeros(total.size, dtype=np.float32)
            chosen[keep] = rate[keep]
            score[warm] = chosen.reshape(-1, nb)
        self._cell_score = score

    def raw_scores(self, blocks: Sequence[DraftedBlock]) -> ScoreArray:
        """Uncalibrated ``s`` ``(len(blocks), L, E)`` in [0, 1]."""
        L, E = self.num_layers, self.num_experts
        if not blocks:
            return np.zeros((0, L, E), np.float32)
        token_lists = [
            np.asarray(b.token_ids.detach().cpu()).reshape(-1).astype(np.int64) for b in blocks
        ]
        for tokens in token_lists:
            if tokens.size and int(tokens.min()) < 0:
                raise ValueError(f"token ids must be >= 0, got {int(tokens.min())}")
        rows = np.concatenate(token_lists) % self.buckets
        unique, inverse = np.unique(rows, return_inverse=True)
        tokens_seen = max(self._layer_tokens, 1.0)
        prior = (self._layer_counts / tokens_seen).astype(np.float32).reshape(-1)
        alpha = np.float32(self.smoothing)
        counts = self._counts[unique].reshape(unique.size, -1).astype(np.float32)
        occ = self._occurrences[unique].astype(np.float32)[:, None]
        p_row = (counts + alpha * prior) / (occ + alpha)
        log_miss = np.log1p(-np.minimum(p_row, np.float32(1.0 - 1e-6)))
        # each block's rows summed in one segmented reduction (a BLAS matmul
        # over a row-count matrix was as fast alone but stalled on threads
        # under load)
        sizes = np.array([t.size for t in token_lists])
        per_row = log_miss[inverse.reshape(-1)]
        if sizes.min() == sizes.max() > 0:  # the usual case: every block full
            sums = per_row.reshape(len(blocks), int(sizes[0]), L * E).sum(axis=1)
        else:
            filled = np.flatnonzero(sizes)
            sums = np.zeros((len(blocks), L * E), dtype=np.float32)
            if filled.size:
                starts = (np.cumsum(sizes) - sizes)[filled]
                sums[filled] = np.add.reduceat(per_row, starts, axis=0)
        p_tok = -np.expm1(sums).reshape(len(blocks), L, E)
        recent = np.stack(
            [self._recent.get(b.request_id, np.zeros((L, E), np.float32)) for b in blocks]
        )
        w = np.float32(self.request_weight)
        raw = (p_tok + w * recent) / (np.float32(1.0) + w)
        out: ScoreArray = np.clip(raw, 0.0, 1.0).astype(np.float32)
        return out

    def predict_batch(self, blocks: Sequence[DraftedBlock]) -> ScoreArray:
        """Calibrated scores ``(len(blocks), L, E)``; remembers each block's
        raw scores until its request's next :meth:`observe`."""
        raw = self.raw_scores(blocks)
        for block, r in zip(blocks, raw, strict=True):
            self._pending[block.request_id] = r
        layers = np.arange(self.num_layers)[None, :, None]
        out: ScoreArray = self._cell_score[layers, self._bins(raw)]
        return out

    def predict(self, block: DraftedBlock) -> ScoreArray:
        result: ScoreArray = self.predict_batch([block])[0]
        return result


def token_learners(predictor: object) -> list[TokenRoutingObserver]:
    """The predictors in ``predictor`` (itself, or members of a
    :class:`CombinedPredictor`, recursively) that learn from per-row routing;
    empty when none does (then nobody needs the rows' top-k on the host)."""
    members = getattr(predictor, "members", None)
    if members is not None:
        return [learner for member, _ in members for learner in token_learners(member)]
    if callable(getattr(predictor, "observe_tokens", None)):
        return [cast(TokenRoutingObserver, predictor)]
    return []
