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
baseline replays the same routing and acceptance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch


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

    @property
    def source(self) -> str:
        return "trace"

    @property
    def num_trace_requests(self) -> int:
        return self.requests.num_requests

    def assign(self, request_id: int, trace_request: int) -> None:
        self.requests.assign(request_id, trace_request)

    def reset_stats(self) -> None:
        self.wraps = self.rounds = self.capped = 0

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
        self.router_weight_rows = 0
        self.replayed_weight_rows = 0
        self._ids: torch.Tensor | None = None  # [T, L_target, k] for the current forward

    @property
    def num_trace_requests(self) -> int:
        return self.requests.num_requests

    def assign(self, request_id: int, trace_request: int) -> None:
        self.requests.assign(request_id, trace_request)

    def forget(self, request_id: int) -> None:
        self.requests.forget(request_id)

    def reset_stats(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.filled_slots = self.router_weight_rows = self.replayed_weight_rows = 0

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
        """``[n, L_trace, k_trace]`` trace ids -> ``[n, L_target, k]`` target ids."""
        picked = rows[:, self.layer_map, :]
        if self.num_experts == self.trace_experts and self.top_k <= self.trace_k:
            return np.ascontiguousarray(picked[:, :, : self.top_k])
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
        for i, layer in zip(*np.nonzero(distinct < k), strict=True):
            seen = ranked[i, layer, : distinct[i, layer]].tolist()
            nxt = seen[-1]
            while len(seen) < k:
                nxt = (nxt + 1) % self.num_experts
                if nxt not in seen:
                    seen.append(nxt)
                    self.filled_slots += 1
            out[i, layer] = seen
        return out

    # -- RoutingSource ------------------------------------------------------
    def begin_forward(self, chunks: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        parts: list[npt.NDArray[np.int64]] = []
        device = None
        # every chunk's tokens in one device-to-host read (a sync each, else)
        flat = torch.cat([t.reshape(-1) for _, _, t in chunks]).tolist() if chunks else []
        at = 0
        for rid, start, tokens in chunks:
            device = tokens.device
            n = int(tokens.numel())
            rows, how = self.trace_rows(rid, start, flat[at : at + n])
            at += n
            for h in how:
                self.counts[h] += 1
            parts.append(self.map_experts(rows))
        if not parts:
            self._ids = None
            return
        self._ids = torch.from_numpy(np.concatenate(parts)).to(device)

    def route(
        self, layer: int, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ids is None or self._ids.shape[0] != ids.shape[0]:
            raise RuntimeError("TraceRouting.route called without a matching begin_forward")
        replay = self._ids[:, layer, :].to(ids.dtype)
        # NOTE: a row whose replayed set is the router's keeps the router's
        # ids and weights as they are (same order, same bits)
        same = (replay.sort(dim=1).values == ids.sort(dim=1).values).all(dim=1)
        n_same = int(same.sum())
        self.router_weight_rows += n_same
        if n_same == ids.shape[0]:
            return ids, weights
        self.replayed_weight_rows += ids.shape[0] - n_same
        logits = self.adapter.router_logits(layer, normed).float()
        w = torch.softmax(logits.gather(1, replay.long()), dim=-1).to(weights.dtype)
        keep = same.unsqueeze(1)
        return torch.where(keep, ids, replay), torch.where(keep, weights, w)

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
            "predictors": "route-ahead predictors that run the target's router "
            "(approx_router, next-layer lookahead) predict the router, not the trace; "
            "previous_round observes the replayed routing",
            "row_layers_with_router_weights": self.router_weight_rows,
            "row_layers_with_replayed_weights": self.replayed_weight_rows,
        }


def load_replay_trace(path: str | Path) -> Any:
    """The :class:`~pdflash.traces.ProxyTrace` at ``path``."""
    from pdflash.traces import load_trace

    return load_trace(path)
