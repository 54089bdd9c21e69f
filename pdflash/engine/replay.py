"""Replaying a proxy trace: learned routing and acceptance without the weights.

A trace (:mod:`pdflash.traces`) holds a trained proxy
model's top-k routing of every token and every verified row, and the
accepted length of every verify round. Two policy objects replay it in the
engine on any model shape:

* :class:`TraceRouting` (a :class:`RoutingSource`): the target runner asks it
  for each layer's top-k experts instead of using the router's
  (``routing_source: trace``). Each engine request is assigned a trace
  request; a row at position ``p`` holding token ``t`` gets, in order of
  preference: the routing the trace recorded for that verified row (a trace
  round starting at the same position whose tokens match up to this row:
  ``exact``), the teacher-forced routing of the trace's token at ``p`` when
  it is ``t`` (``token``), else the trace's routing at position ``p`` (wrapped
  into the trace sequence's length: ``positional``). Layer ``l`` of an
  ``L``-layer target replays trace layer ``l * L_trace // L``; expert ``e`` of
  the trace becomes ``e * E // E_trace`` (duplicates dropped, the first ``k``
  distinct kept, a short row filled with the next unused ids); a target with
  more experts than the trace is refused. The mixing weights are the router's
  own where the replayed set equals the router's, else the softmax of the
  router's logits over the replayed ids (renormalised over the top-k).
* :class:`TraceAcceptance` (an :class:`~pdflash.engine.acceptance.AcceptanceModel`,
  ``acceptance_source: trace``): each round of a request accepts the next
  recorded round's accepted drafts of its trace request (capped by the drafts
  available; a request that outlives its trace's rounds starts them again,
  counted as ``wraps``).

Both are pure functions of the trace and the request assignment, so every
baseline replays the same routing and acceptance. Where the trace records
them, the predictions the trained model's own routers would make are
replayed too: the next-layer gate lookahead (:class:`TraceLookahead`) and
route-ahead's approximate router (:class:`TraceApproxRouter`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from pdflash.protocols import DraftedBlock, ExpertPredictor, NextLayerPredictor
from pdflash.routeahead.predictors import (
    ScoreArray,
    _horizon_rows,
    check_lookahead_score,
    predict_batch,
    ranked_next_layer,
)


@runtime_checkable
class RoutingSource(Protocol):
    """Where the target runner's per-layer top-k experts come from."""

    @property
    def name(self) -> str: ...

    def begin_forward(self, chunks: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """The forward's rows: per chunk ``(request id, first position, tokens)``."""
        ...

    def route(
        self, layer: int, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(ids [T, k], weights [T, k])`` for the rows of
        :meth:`begin_forward`, given the router's own."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready description for result rows."""
        ...


@runtime_checkable
class LookaheadRoutingSource(RoutingSource, Protocol):
    """A routing source that also says how the gate lookahead should predict
    the routing it gives (:class:`TraceRouting`: replayed from the trace)."""

    def next_layer_predictor(self, score: str = "prob") -> NextLayerPredictor | None:
        """The predictor for the engine's gate lookahead, scoring as
        ``EngineConfig.lookahead_score`` says (None: the target's router)."""
        ...


def _file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class _TraceRequests:
    """Engine request id -> trace request (assigned, else ``id mod R``)."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests
        self._assigned: dict[int, int] = {}

    def assign(self, request_id: int, trace_request: int) -> None:
        if not 0 <= trace_request < self.num_requests:
            raise ValueError(f"trace request {trace_request} out of range [0, {self.num_requests})")
        self._assigned[int(request_id)] = int(trace_request)

    def of(self, request_id: int) -> int:
        return self._assigned.get(int(request_id), int(request_id) % self.num_requests)

    def forget(self, request_id: int) -> None:
        self._assigned.pop(int(request_id), None)


class TraceAcceptance:
    """Per-round accepted lengths replayed from a trace (see the module doc)."""

    def __init__(self, trace: Any, path: str | Path | None = None) -> None:
        self.trace = trace
        self.path = None if path is None else str(path)
        self.requests = _TraceRequests(trace.num_requests)
        # accepted drafts (committed - 1) of every round, per trace request
        self._rounds = [trace.acceptance(r).astype(np.int64) - 1 for r in range(trace.num_requests)]
        self._cursor: dict[int, int] = {}
        self.wraps = 0
        self.rounds = 0
        self.capped = 0
        self.replayed: set[int] = set()  # trace requests assigned since reset_stats

    @property
    def source(self) -> str:
        return "trace"

    @property
    def num_trace_requests(self) -> int:
        return self.requests.num_requests

    def assign(self, request_id: int, trace_request: int) -> None:
        self.requests.assign(request_id, trace_request)
        self.replayed.add(int(trace_request))

    def reset_stats(self) -> None:
        self.wraps = self.rounds = self.capped = 0
        self.replayed = set()

    def params(self) -> dict[str, object]:
        prov = self.trace.provenance
        acc = self.trace.round_accepted.astype(np.float64)
        return {
            "trace": Path(self.path).name if self.path else None,
            "trace_sha256": _file_sha256(self.path) if self.path else None,
            "trace_block_size": prov.get("block_size"),
            "trace_temperature": prov.get("temperature"),
            "trace_target_preset": prov.get("target_preset"),
            "trace_tau_mean": float(acc.mean()) if acc.size else None,
            "trace_requests_replayed": sorted(self.replayed),
            "rounds_replayed": self.rounds,
            "rounds_capped_by_drafts": self.capped,
            "wraps": self.wraps,
            "stream": "per engine request: its trace request's rounds in order, restarting "
            "when exhausted",
        }

    def forced_accepts(self, request_id: int, num_drafts: int) -> int | None:
        if num_drafts < 0:
            raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
        rounds = self._rounds[self.requests.of(request_id)]
        if rounds.size == 0:
            return 0
        i = self._cursor.get(request_id, 0)
        if i >= rounds.size:
            i = 0
            self.wraps += 1
        self._cursor[request_id] = i + 1
        self.rounds += 1
        got = int(rounds[i])
        if got > num_drafts:
            self.capped += 1
        return min(got, num_drafts)

    def forget(self, request_id: int) -> None:
        self._cursor.pop(request_id, None)
        self.requests.forget(request_id)


class TraceRouting:
    """Per-layer top-k experts replayed from a trace (see the module doc)."""

    name = "trace"

    def __init__(
        self,
        trace: Any,
        adapter: Any,
        path: str | Path | None = None,
    ) -> None:
        prov = trace.provenance
        self.trace = trace
        self.path = None if path is None else str(path)
        self.adapter = adapter
        self.trace_layers = int(prov["num_layers"])
        self.trace_experts = int(prov["num_experts"])
        self.trace_k = int(prov["top_k"])
        self.num_layers = int(adapter.num_layers)
        self.num_experts = int(adapter.num_experts)
        self.top_k = int(adapter.top_k)
        if self.num_experts > self.trace_experts:
            raise ValueError(
                f"the target has {self.num_experts} experts, the trace only "
                f"{self.trace_experts}: routing cannot be replayed onto more experts"
            )
        self.layer_map = [
            layer * self.trace_layers // self.num_layers for layer in range(self.num_layers)
        ]
        self.requests = _TraceRequests(trace.num_requests)
        self._seq = [trace.request_tokens(r).astype(np.int64) for r in range(trace.num_requests)]
        self._seq_off = trace.token_request.astype(np.int64)
        # per trace request: round start position -> (first verify row, rows)
        self._rounds: list[dict[int, tuple[int, int]]] = [{} for _ in range(trace.num_requests)]
        row = 0
        pos = {r: int(trace.prompt_len[r]) for r in range(trace.num_requests)}
        for r, acc, rows in zip(
            trace.round_request.tolist(),
            trace.round_accepted.tolist(),
            trace.round_rows.tolist(),
            strict=True,
        ):
            self._rounds[r].setdefault(pos[r], (row, rows))
            pos[r] += acc
            row += rows
        self._verify_tokens = trace.verify_tokens.astype(np.int64)
        self.counts = {"exact": 0, "token": 0, "positional": 0}
        self.filled_slots = 0
        # NOTE: every trace row (token rows, then verify rows) mapped onto the
        # target's shape once, on first use: ``[:, 0]`` the ids, ``[:, 1]``
        # the same ids sorted (what :meth:`route` compares the router's with),
        # and the slots each row's mapping filled (counted per use)
        self._num_token_rows = int(trace.token_topk.shape[0])
        total_rows = self._num_token_rows + int(trace.verify_topk.shape[0])
        self._mapped = np.empty((total_rows, 2, self.num_layers, self.top_k), dtype=np.int64)
        self._mapped_ok = np.zeros(total_rows, dtype=np.bool_)
        self._mapped_fills = np.zeros(total_rows, dtype=np.int64)
        # rows routed so far; how many kept the router's weights is counted on
        # the device (a per-layer host read would be a sync per layer) and
        # read only when asked (:attr:`router_weight_rows`)
        self._rows_routed = 0
        self._router_rows = 0
        self._same_pending: list[torch.Tensor] = []
        self._same_total: torch.Tensor | None = None
        # [T, 2, L_target, k] (ids, sorted ids) for the current forward
        self._ids: torch.Tensor | None = None
        #: the current forward's trace rows (:meth:`row_sources`' indices;
        #: None between forwards): what :class:`TraceLookahead` replays
        self.forward_rows: npt.NDArray[np.int64] | None = None

    @property
    def num_trace_requests(self) -> int:
        return self.requests.num_requests

    def assign(self, request_id: int, trace_request: int) -> None:
        self.requests.assign(request_id, trace_request)

    def forget(self, request_id: int) -> None:
        self.requests.forget(request_id)

    def reset_stats(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.filled_slots = 0
        self._rows_routed = self._router_rows = 0
        self._same_pending = []
        self._same_total = None

    def _fold_same(self) -> None:
        """Add the pending per-layer "kept the router's set" masks into the
        device total (a few kernels per forward, no host read)."""
        if not self._same_pending:
            return
        pending, self._same_pending = self._same_pending, []
        part = torch.cat(pending).sum()
        self._same_total = part if self._same_total is None else self._same_total + part

    @property
    def router_weight_rows(self) -> int:
        """Row-layers whose replayed set was the router's (its ids and
        weights kept). Reading it is a host sync (the count lives on the
        device)."""
        self._fold_same()
        if self._same_total is not None:
            self._router_rows += int(self._same_total)
            self._same_total = None
        return self._router_rows

    @property
    def replayed_weight_rows(self) -> int:
        """Row-layers given the replayed ids with the router's softmax over
        them (see :attr:`router_weight_rows`: a host sync)."""
        return self._rows_routed - self.router_weight_rows

    # -- the rows' trace routing -------------------------------------------
    def trace_rows(
        self, request_id: int, start: int, tokens: Sequence[int]
    ) -> tuple[npt.NDArray[np.int64], list[str]]:
        """``[n, L_trace, k_trace]`` trace routing of a chunk's rows and how
        each row was matched (``exact``, ``token`` or ``positional``)."""
        r = self.requests.of(request_id)
        seq = self._seq[r]
        base = int(self._seq_off[r])
        toks = [int(t) for t in tokens]
        out = np.empty((len(toks), self.trace_layers, self.trace_k), dtype=np.int64)
        how: list[str] = []
        rnd = self._rounds[r].get(int(start))
        matched = rnd is not None
        for j, t in enumerate(toks):
            p = start + j
            if matched:
                assert rnd is not None
                first, rows = rnd
                matched = j < rows and int(self._verify_tokens[first + j]) == t
                if matched:
                    out[j] = self.trace.verify_topk[first + j]
                    how.append("exact")
                    continue
            if p < seq.size and int(seq[p]) == t:
                out[j] = self.trace.token_topk[base + p]
                how.append("token")
            else:
                out[j] = self.trace.token_topk[base + p % seq.size]
                how.append("positional")
        return out, how

    def map_experts(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``[n, L_trace, k_trace]`` trace ids -> ``[n, L_target, k]`` target ids
        (the slots a short row's mapping filled count in ``filled_slots``)."""
        out, fills = self._map_rows(rows)
        self.filled_slots += int(fills.sum())
        return out

    def _map_rows(
        self, rows: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """:meth:`map_experts` without the books: the mapped ids and the
        slots filled in each row (``[n]``)."""
        picked = rows[:, self.layer_map, :]
        no_fills = np.zeros(picked.shape[0], dtype=np.int64)
        if self.num_experts == self.trace_experts and self.top_k <= self.trace_k:
            return np.ascontiguousarray(picked[:, :, : self.top_k]), no_fills
        mapped = picked * self.num_experts // self.trace_experts
        k = self.top_k
        # the first k distinct ids of each row, in the trace's rank order
        kk = mapped.shape[-1]
        earlier = np.tril(np.ones((kk, kk), dtype=np.bool_), -1)
        dup = ((mapped[..., :, None] == mapped[..., None, :]) & earlier).any(axis=-1)
        order = np.argsort(dup, axis=-1, kind="stable")
        ranked = np.take_along_axis(mapped, order, axis=-1)
        distinct = (~dup).sum(axis=-1)
        if kk >= k:
            out = np.ascontiguousarray(ranked[..., :k])
        else:
            out = np.zeros((*mapped.shape[:2], k), dtype=np.int64)
            out[..., :kk] = ranked
        # rows with fewer than k distinct ids: filled with the next unused ids
        fills = no_fills
        for i, layer in zip(*np.nonzero(distinct < k), strict=True):
            seen = ranked[i, layer, : distinct[i, layer]].tolist()
            nxt = seen[-1]
            while len(seen) < k:
                nxt = (nxt + 1) % self.num_experts
                if nxt not in seen:
                    seen.append(nxt)
                    fills[i] += 1
            out[i, layer] = seen
        return out, fills

    # -- the rows' trace routing, vectorised ---------------------------------
    def row_sources(
        self, request_id: int, start: int, tokens: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], int, int]:
        """The trace rows :meth:`trace_rows` picks for a chunk, as indices
        into the trace's token rows followed by its verify rows (index
        ``num token rows + v``: verify row ``v``), with how many rows matched
        ``exact`` and ``token`` (the rest: ``positional``). The same choice
        as :meth:`trace_rows` (its reference), without a loop over rows."""
        r = self.requests.of(request_id)
        seq = self._seq[r]
        base = int(self._seq_off[r])
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = int(toks.size)
        exact = 0
        exact_idx = np.zeros(0, dtype=np.int64)
        rnd = self._rounds[r].get(int(start))
        if rnd is not None:
            first, rows = rnd
            lim = min(n, rows)
            eq = self._verify_tokens[first : first + lim] == toks[:lim]
            exact = lim if bool(eq.all()) else int(np.argmin(eq))
            exact_idx = self._num_token_rows + first + np.arange(exact, dtype=np.int64)
        pos = int(start) + np.arange(exact, n, dtype=np.int64)
        inside = pos < seq.size
        by_token = inside & (seq[np.where(inside, pos, 0)] == toks[exact:])
        rest_idx = base + np.where(by_token, pos, pos % seq.size)
        return np.concatenate([exact_idx, rest_idx]), exact, int(by_token.sum())

    def position_rows(self, request_id: int, start: int, n: int) -> npt.NDArray[np.int64]:
        """The token rows of positions ``start .. start + n - 1`` of the
        request's trace request (wrapped into its sequence, as positional
        rows are)."""
        r = self.requests.of(request_id)
        size = int(self._seq[r].size)
        pos = (int(start) + np.arange(n, dtype=np.int64)) % size
        out: npt.NDArray[np.int64] = int(self._seq_off[r]) + pos
        return out

    def _mapped_rows(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``[n, 2, L_target, k]`` (ids, sorted ids) of trace rows ``idx``
        (see :meth:`row_sources`), mapping the rows not mapped before."""
        new = np.unique(idx[~self._mapped_ok[idx]])
        if new.size:
            tok = new[new < self._num_token_rows]
            ver = new[new >= self._num_token_rows] - self._num_token_rows
            src = np.concatenate([self.trace.token_topk[tok], self.trace.verify_topk[ver]]).astype(
                np.int64
            )
            ids, fills = self._map_rows(src)
            self._mapped[new, 0] = ids
            self._mapped[new, 1] = np.sort(ids, axis=-1)
            self._mapped_fills[new] = fills
            self._mapped_ok[new] = True
        self.filled_slots += int(self._mapped_fills[idx].sum())
        out: npt.NDArray[np.int64] = self._mapped[idx]
        return out

    # -- RoutingSource ------------------------------------------------------
    def begin_forward(self, chunks: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        self._fold_same()
        if not chunks:
            self._ids = None
            self.forward_rows = None
            return
        device = chunks[-1][2].device
        # NOTE: the one host read (a sync on a device) of the forward: the
        # rows' tokens decide which trace rows they replay
        flat = torch.cat([t.reshape(-1) for _, _, t in chunks]).cpu().numpy()
        parts: list[npt.NDArray[np.int64]] = []
        at = 0
        for rid, start, tokens in chunks:
            n = int(tokens.numel())
            idx, exact, by_token = self.row_sources(rid, start, flat[at : at + n])
            at += n
            self.counts["exact"] += exact
            self.counts["token"] += by_token
            self.counts["positional"] += n - exact - by_token
            parts.append(idx)
        self.forward_rows = np.concatenate(parts)
        host = torch.from_numpy(self._mapped_rows(self.forward_rows))
        if device.type == "cuda":
            # one copy per forward, from page-locked memory: no wait for the stream
            self._ids = host.pin_memory().to(device, non_blocking=True)
        else:
            self._ids = host.to(device)

    def route(
        self, layer: int, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ids is None or self._ids.shape[0] != ids.shape[0]:
            raise RuntimeError("TraceRouting.route called without a matching begin_forward")
        replay = self._ids[:, 0, layer].to(ids.dtype)
        # NOTE: a row whose replayed set is the router's keeps the router's
        # ids and weights as they are (same order, same bits). Every row takes
        # the same path whatever its match (no host read of the match: a
        # sync per layer); the matches are counted on the device.
        same = (self._ids[:, 1, layer].to(ids.dtype) == ids.sort(dim=1).values).all(dim=1)
        self._same_pending.append(same)
        self._rows_routed += int(ids.shape[0])
        logits = self.adapter.router_logits(layer, normed).float()
        w = torch.softmax(logits.gather(1, replay.long()), dim=-1).to(weights.dtype)
        keep = same.unsqueeze(1)
        return torch.where(keep, ids, replay), torch.where(keep, weights, w)

    def next_layer_predictor(self, score: str = "prob") -> TraceLookahead | None:
        """The gate lookahead replayed from the trace (None: the trace does
        not record it; the engine's lookahead then runs the target's router)."""
        return TraceLookahead(self, score=score) if self.trace.has_lookahead else None

    def approx_router_predictor(
        self, *, charge: ExpertPredictor | None = None, proxy: str = "auto"
    ) -> TraceApproxRouter | None:
        """Route-ahead's approximate router replayed from the trace, reading
        ``proxy`` (``auto`` and ``drafter``: :data:`pdflash.traces.APPROX_ARRAYS`;
        ``embed``: :data:`~pdflash.traces.APPROX_EMBED_ARRAYS`); None where
        the trace does not record it. ``charge``: the live approximate router,
        run for its time only (see :class:`TraceApproxRouter`)."""
        recorded = (
            self.trace.token_approx_embed is not None if proxy == "embed" else self.trace.has_approx
        )
        if not recorded:
            return None
        return TraceApproxRouter(self, charge=charge, proxy=proxy)

    def describe(self) -> dict[str, Any]:
        prov = self.trace.provenance
        total = sum(self.counts.values())
        return {
            "trace": Path(self.path).name if self.path else None,
            "trace_sha256": _file_sha256(self.path) if self.path else None,
            "trace_target_preset": prov.get("target_preset"),
            "trace_shape": {
                "layers": self.trace_layers,
                "experts": self.trace_experts,
                "top_k": self.trace_k,
            },
            "layer_map": list(self.layer_map),
            "expert_map": "identity"
            if self.num_experts == self.trace_experts
            else f"e * {self.num_experts} // {self.trace_experts}, first {self.top_k} distinct",
            "rows": dict(self.counts),
            "row_fractions": {k: v / total for k, v in self.counts.items()} if total else None,
            "filled_slots": self.filled_slots,
            "weights": "router's own where the replayed set equals the router's, else softmax of "
            "the router logits over the replayed ids",
            "predictors": (
                (
                    "route-ahead's approximate router is replayed from the trace "
                    "(TraceApproxRouter; the target's router still runs, for its time); "
                    if self.trace.has_approx
                    else "route-ahead predictors that run the target's router (approx_router) "
                    "predict the router, not the trace; "
                )
                + "previous_round observes the replayed routing; "
                + (
                    "the next-layer lookahead is replayed from the trace (TraceLookahead)"
                    if self.trace.has_lookahead
                    else "the next-layer lookahead runs the target's router (the trace does "
                    "not record the trained model's)"
                )
            ),
            "row_layers_with_router_weights": self.router_weight_rows,
            "row_layers_with_replayed_weights": self.replayed_weight_rows,
        }


def load_replay_trace(path: str | Path) -> Any:
    """The :class:`~pdflash.traces.ProxyTrace` at ``path``."""
    from pdflash.traces import load_trace

    return load_trace(path)


class TraceLookahead:
    """The next-layer gate lookahead replayed from a trace
    (:data:`pdflash.traces.LOOKAHEAD_ARRAYS`; a
    :class:`~pdflash.protocols.NextLayerPredictor`): for layer ``l + 1`` of
    the current forward, each row's recorded lookahead of trace layer
    ``layer_map[l + 1]`` (the trace row :class:`TraceRouting` replays for it:
    an exact verify row, the token's, or the position's), its experts mapped
    as the routing is (``e * E // E_trace``), scored by the recorded gate
    probabilities summed over the rows (the first ``min(k, k_trace)`` of each
    row; with ``score="share"`` each row's shares of its recorded top-k
    mass), as :class:`pdflash.routeahead.NextLayerLookahead` scores the
    router's. Host-side only: no router product and no device read.
    """

    def __init__(self, routing: TraceRouting, score: str = "prob") -> None:
        self.score = check_lookahead_score(score)
        trace = routing.trace
        if not trace.has_lookahead:
            raise ValueError("the trace does not record the next-layer lookahead")
        self.routing = routing
        k = min(routing.top_k, routing.trace_k)
        ids = np.concatenate([trace.token_lookahead, trace.verify_lookahead])[..., :k]
        probs = np.concatenate([trace.token_lookahead_probs, trace.verify_lookahead_probs])
        # rows in TraceRouting.row_sources' order: token rows, then verify rows
        self._ids = ids.astype(np.int64) * routing.num_experts // routing.trace_experts
        self._probs = probs[..., :k].astype(np.float32)
        if self.score == "share":
            # the trace's full top-k mass, as the router's top-k is renormalised
            mass = probs.astype(np.float32).sum(axis=-1, keepdims=True)
            self._probs = self._probs / np.maximum(mass, np.float32(1e-12))

    def predict_next(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        rt = self.routing
        L, E = rt.num_layers, rt.num_experts
        if not 0 <= layer < L:
            raise ValueError(f"layer must be in [0, {L}), got {layer}")
        if layer == L - 1 or hidden.shape[0] == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        rows = rt.forward_rows
        if rows is None or rows.size != hidden.shape[0]:
            raise RuntimeError(
                "TraceLookahead.predict_next called without a matching begin_forward "
                f"({None if rows is None else rows.size} trace rows, {hidden.shape[0]} hidden)"
            )
        nxt = layer + 1
        m = rt.layer_map[nxt]
        scores = np.bincount(
            self._ids[rows, m].reshape(-1),
            weights=self._probs[rows, m].reshape(-1),
            minlength=E,
        )
        return ranked_next_layer(scores, nxt)


class TraceApproxRouter:
    """Route-ahead's approximate router replayed from a trace
    (:data:`pdflash.traces.APPROX_ARRAYS`; an
    :class:`~pdflash.protocols.ExpertPredictor` with a batched pass, in
    place of :class:`pdflash.routeahead.ApproxRouterPredictor`): a drafted
    block's first ``horizon`` rows are matched to trace rows as
    :class:`TraceRouting` matches a forward's (:meth:`TraceRouting.row_sources`:
    an exact verify row replays what the trained model's router predicted
    over the drafter's hidden state for it as decoded, a token or positional
    row what it predicted over the drafter's teacher-forced hidden state for
    that position), their recorded top-k mapped onto
    the target's layers and experts as the routing is and scored by the
    recorded gate probabilities summed over the rows, as the live pass
    scores its own.

    With ``proxy="embed"`` it replays the router over the embeddings of the
    trace's tokens instead (:data:`pdflash.traces.APPROX_EMBED_ARRAYS`,
    recorded for token rows only): every row reads the token row at its
    position (wrapped as the routing's positional rows are), so a verify row
    whose drafted token was rejected reads the committed token's.

    ``charge``: the live approximate router over the target (whose router,
    under a replay on synthetic weights, predicts nothing about the replayed
    routing). It still runs on every block and its scores are dropped, so
    a replay charges route-ahead the router pass a live model pays.
    """

    name = "approx_router"

    def __init__(
        self, routing: TraceRouting, charge: ExpertPredictor | None = None, proxy: str = "auto"
    ) -> None:
        trace = routing.trace
        self.by_position = proxy == "embed"
        if self.by_position:
            if trace.token_approx_embed is None or trace.token_approx_embed_probs is None:
                raise ValueError("the trace does not record the embedding proxy")
            ids_all, probs_all = trace.token_approx_embed, trace.token_approx_embed_probs
        else:
            if not trace.has_approx:
                raise ValueError("the trace does not record route-ahead's approximate router")
            ids_all = np.concatenate([trace.token_approx, trace.verify_approx])
            probs_all = np.concatenate([trace.token_approx_probs, trace.verify_approx_probs])
        self.proxy = proxy
        self.routing = routing
        self.charge = charge
        k = min(routing.top_k, routing.trace_k)
        ids = ids_all[..., :k]
        probs = probs_all[..., :k]
        # rows in TraceRouting.row_sources' order: token rows, then verify rows;
        # trace layers picked for the target's (layer_map), experts mapped
        layers = np.asarray(routing.layer_map, dtype=np.int64)
        self._ids = ids[:, layers].astype(np.int64) * routing.num_experts // routing.trace_experts
        self._probs = probs[:, layers].astype(np.float32)

    def predict(self, block: DraftedBlock) -> ScoreArray:
        result: ScoreArray = self.predict_batch([block])[0]
        return result

    def predict_batch(self, blocks: Sequence[DraftedBlock]) -> ScoreArray:
        """Scores ``(len(blocks), L, E)``."""
        rt = self.routing
        L, E = rt.num_layers, rt.num_experts
        if self.charge is not None:
            predict_batch(self.charge, blocks)
        out = np.zeros((len(blocks), L, E), dtype=np.float32)
        if not blocks:
            return out
        flat_layer = np.arange(L, dtype=np.int64)[:, None] * E
        counts = [_horizon_rows(block) for block in blocks]
        # NOTE: one host read for every block's first position and rows'
        # tokens (a device read per block would sync once per block)
        starts = torch.stack([b.positions[0] for b in blocks]).cpu().numpy()
        flat_tokens = (
            torch.cat([b.token_ids[:n] for b, n in zip(blocks, counts, strict=True)])
            .cpu()
            .numpy()
            .astype(np.int64)
        )
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for b, block in enumerate(blocks):
            n, start = counts[b], int(starts[b])
            if self.by_position:
                rows = rt.position_rows(block.request_id, start, n)
            else:
                tokens = flat_tokens[offsets[b] : offsets[b + 1]]
                rows, _, _ = rt.row_sources(block.request_id, start, tokens)
            flat = (flat_layer[None] + self._ids[rows]).reshape(-1)
            out[b] = np.bincount(
                flat, weights=self._probs[rows].reshape(-1), minlength=L * E
            ).reshape(L, E)
        return out

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        """Stateless: nothing to learn from the routed set."""

    def forget(self, request_id: int) -> None:
        """Stateless: nothing to drop."""
