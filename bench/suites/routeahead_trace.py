"""History-based route-ahead predictors replayed over a proxy trace.

A proxy trace (:mod:`pdflash.traces`) holds every verify round's block: the
verified rows' token ids (``verify_tokens``) and each row's learned top-k
routing (``verify_topk``). That is all a history-based predictor needs, so
``previous_round``, ``frequency_prior`` and ``token_prior`` are scored here
without weights or a GPU, as the engine would run them:

* rounds are replayed in engine steps: ``order="interleaved"`` runs every
  live request's next round per step (all requests concurrent, as a batch
  of ``R`` requests would), ``"sequential"`` one request after another;
* a step first predicts every block of the step, then scores the
  predictions against the blocks' needed sets (the union over every verified
  row of the round, rejected drafts included: the verify routes them all),
  then hands the observed routing to the predictors; a prediction never
  sees the routing of its own round or any later one;
* a request's first round is not scored (previous_round has nothing yet);
* ``prefill=True`` also feeds each request's prompt routing
  (``token_topk`` of its prompt positions, what the prefill forward routes)
  to the token table when the request starts.

Per predictor: coverage/precision over every scored block and per layer
(``RouteAheadStats``), predict µs per step (median), and for score-ranked
predictors a hindsight curve: the best coverage any single global threshold
on the raw score reaches at a precision floor (labelled ``hindsight``: it
picks the threshold after seeing the answers, so it bounds what an online
threshold can do).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from pdflash.traces import ProxyTrace

ORDERS = ("interleaved", "sequential")
FLOORS = (0.7, 0.8, 0.9)


def trace_rounds(trace: ProxyTrace, order: str) -> list[list[int]]:
    """Round indices grouped into engine steps."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    per_request = [
        np.flatnonzero(trace.round_request == r).tolist() for r in range(trace.num_requests)
    ]
    if order == "sequential":
        return [[i] for rounds in per_request for i in rounds]
    depth = max((len(r) for r in per_request), default=0)
    return [[rounds[t] for rounds in per_request if t < len(rounds)] for t in range(depth)]


def hindsight_curve(
    scores: npt.NDArray[np.float32], needed: npt.NDArray[np.bool_], floors: tuple[float, ...]
) -> dict[str, Any]:
    """Best coverage of one global threshold on ``scores`` at each precision
    floor, and the precision at coverage 0.9 (both over the pooled blocks)."""
    s = scores.reshape(-1)
    u = needed.reshape(-1)
    total = int(u.sum())
    if not total:
        return {"not_measured": "no needed expert"}
    order = np.argsort(-s, kind="stable")
    hits = np.cumsum(u[order])
    # a threshold can only cut between distinct scores: keep the last rank of each run
    ends = np.flatnonzero(np.r_[np.diff(s[order]) != 0, True])
    cov = hits[ends] / total
    prec = hits[ends] / (ends + 1)
    out: dict[str, Any] = {}
    for floor in floors:
        ok = prec >= floor
        out[f"coverage_at_precision_{floor}"] = float(cov[ok].max()) if ok.any() else 0.0
    reach = np.flatnonzero(cov >= 0.9)
    out["precision_at_coverage_0.9"] = float(prec[reach[0]]) if reach.size else None
    if not reach.size:
        out["not_measured"] = {"precision_at_coverage_0.9": "coverage 0.9 never reached"}
    return out


def score_trace(
    trace: ProxyTrace,
    *,
    order: str = "interleaved",
    prefill: bool = True,
    token_prior_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import torch

    from pdflash.protocols import DraftedBlock
    from pdflash.routeahead import (
        FrequencyPriorPredictor,
        PreviousRoundPredictor,
        RouteAheadStats,
        TokenPriorPredictor,
    )

    prov = trace.provenance
    L, E, B = int(prov["num_layers"]), int(prov["num_experts"]), int(prov["block_size"])
    freq_stats = RouteAheadStats(L, E, 1, decay=0.9)
    options = dict(token_prior_options or {})
    predictors: dict[str, Any] = {
        "previous_round": PreviousRoundPredictor(L, E),
        # as in the suite: the 2B most frequent experts per layer
        "frequency_prior": FrequencyPriorPredictor(freq_stats, per_layer=2 * B),
        "token_prior": TokenPriorPredictor(L, E, **options),
        # the token table alone (no request recency): what the token ids buy
        "token_prior_tokens_only": TokenPriorPredictor(
            L, E, **{**options, "request_weight": 0.0}, name="token_prior_tokens_only"
        ),
    }
    # raw scores kept for the hindsight curves
    ranked: dict[str, Callable[[list[Any]], npt.NDArray[np.float32]]] = {
        "frequency_prior": lambda blocks: np.broadcast_to(
            freq_stats.frequency(), (len(blocks), L, E)
        ).astype(np.float32),
        "token_prior": predictors["token_prior"].raw_scores,
        "token_prior_tokens_only": predictors["token_prior_tokens_only"].raw_scores,
    }
    token_learners = [p for p in predictors.values() if hasattr(p, "observe_tokens")]
    stats = {name: RouteAheadStats(L, E, 1) for name in predictors}
    times: dict[str, list[float]] = {name: [] for name in predictors}
    raw_scores: dict[str, list[npt.NDArray[np.float32]]] = {name: [] for name in ranked}
    needed_sets: list[npt.NDArray[np.bool_]] = []
    offsets = np.concatenate([[0], np.cumsum(trace.round_rows.astype(np.int64))])
    started: set[int] = set()
    layer_index = np.arange(L)[None, :, None]
    for step in trace_rounds(trace, order):
        requests = [int(trace.round_request[i]) for i in step]
        if prefill:
            for r in requests:
                if r in started:
                    continue
                lo = int(trace.token_request[r])
                hi = lo + int(trace.prompt_len[r])
                for learner in token_learners:
                    learner.observe_tokens(trace.tokens[lo:hi], trace.token_topk[lo:hi])
        blocks = []
        needed = np.zeros((len(step), L, E), dtype=np.bool_)
        for j, i in enumerate(step):
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            tokens = torch.from_numpy(trace.verify_tokens[rows].astype(np.int64))
            blocks.append(DraftedBlock(requests[j], tokens, torch.arange(tokens.numel())))
            topk = trace.verify_topk[rows].astype(np.int64)  # [rows, L, k]
            needed[j][np.broadcast_to(layer_index, topk.shape), topk] = True
        scored = np.array([r in started for r in requests])
        for name, predictor in predictors.items():
            if name in ranked and scored.any():
                raw_scores[name].append(
                    ranked[name]([b for b, s in zip(blocks, scored, strict=True) if s])
                )
            start = time.perf_counter_ns()
            if hasattr(predictor, "predict_batch"):
                scores = predictor.predict_batch(blocks)
            else:
                scores = np.stack([predictor.predict(b) for b in blocks])
            times[name].append((time.perf_counter_ns() - start) / 1e3)
            if scored.any():
                stats[name].update(scores[scored] > 0, needed[scored])
        if scored.any():
            needed_sets.append(needed[scored])
        for j, i in enumerate(step):
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            for predictor in predictors.values():
                predictor.observe(requests[j], needed[j])
            for learner in token_learners:
                learner.observe_tokens(trace.verify_tokens[rows], trace.verify_topk[rows])
        freq_stats.update(np.zeros_like(needed), needed)
        started.update(requests)
    all_needed = np.concatenate(needed_sets) if needed_sets else np.zeros((0, L, E), np.bool_)
    groups = _layer_groups(L)
    out: dict[str, Any] = {}
    for name, st in stats.items():
        snap = st.snapshot()
        row = snap.request.to_json()
        per_layer = [counts.to_json() for counts in snap.request_layers]
        out[name] = {
            "coverage": row["coverage"],
            "precision": row["precision"],
            # per scored block: an interleaved step scores several blocks in
            # one update, so the divisor is the blocks (requests), not the steps
            "predicted_per_block_layer": snap.request.predicted / max(snap.requests, 1) / L,
            "routed_per_block_layer": snap.request.routed / max(snap.requests, 1) / L,
            "predict_us_per_step": statistics.median(times[name]),
            "per_layer": [
                {"layer": i, "coverage": c["coverage"], "precision": c["precision"]}
                for i, c in enumerate(per_layer)
            ],
            "layer_groups": {
                group: _pooled(snap.request_layers[lo:hi]) for group, (lo, hi) in groups.items()
            },
        }
        if name in ranked and raw_scores[name]:
            s = np.concatenate(raw_scores[name])
            out[name]["hindsight"] = hindsight_curve(s, all_needed, FLOORS)
            out[name]["hindsight_layer_groups"] = {
                group: hindsight_curve(s[:, lo:hi], all_needed[:, lo:hi], FLOORS)
                for group, (lo, hi) in groups.items()
            }
    token_prior = predictors["token_prior"]
    return {
        "synthetic": False,
        "routing": "learned: replayed from the trace (every verified row's top-k)",
        "order": order,
        "prefill_fed": prefill,
        "layers": L,
        "experts": E,
        "block": B,
        "requests": trace.num_requests,
        "rounds": int(trace.round_request.size),
        "blocks_scored": int(all_needed.shape[0]),
        "token_prior_table_nbytes": token_prior.table_nbytes,
        "token_prior_options": {
            k: getattr(token_prior, k)
            for k in (
                "buckets",
                "smoothing",
                "request_decay",
                "request_weight",
                "precision_target",
                "calibration_bins",
                "calibration_decay",
                "min_calibration",
                "count_cap",
            )
        },
        "hindsight_note": "best coverage of one global threshold on the raw score, chosen "
        "after seeing every block (an upper bound for an online threshold)",
        "predictors": out,
    }


def _layer_groups(layers: int) -> dict[str, tuple[int, int]]:
    """Early / middle / late thirds of the layers (early gets the remainder)."""
    third = layers // 3
    early = layers - 2 * third
    return {
        "early": (0, early),
        "middle": (early, early + third),
        "late": (early + third, layers),
    }


def _pooled(layer_counts: Any) -> dict[str, Any]:
    hits = sum(c.hits for c in layer_counts)
    predicted = sum(c.predicted for c in layer_counts)
    routed = sum(c.routed for c in layer_counts)
    return {
        "coverage": hits / routed if routed else None,
        "precision": hits / predicted if predicted else None,
    }
