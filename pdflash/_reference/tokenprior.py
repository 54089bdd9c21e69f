"""A pure-Python token prior, independent of the numpy one.

It mirrors :class:`pdflash.routeahead.TokenPriorPredictor`'s table update
and raw block score with dicts and Python floats, so a differential test can
compare the two. Slow on purpose; never used at run time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class TokenPriorReference:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        buckets: int,
        smoothing: float,
        request_decay: float,
        request_weight: float,
        count_cap: int,
    ) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.buckets = buckets
        self.smoothing = smoothing
        self.request_decay = request_decay
        self.request_weight = request_weight
        self.count_cap = count_cap
        # bucket -> {(layer, expert): count}; bucket -> occurrences
        self.counts: dict[int, dict[tuple[int, int], int]] = {}
        self.occurrences: dict[int, int] = {}
        self.layer_counts = [[0.0] * num_experts for _ in range(num_layers)]
        self.layer_tokens = 0.0
        self.recent: dict[int, list[list[float]]] = {}

    def observe_tokens(
        self, token_ids: Sequence[int], topk: Sequence[Sequence[Sequence[int]]]
    ) -> None:
        touched = []
        for token, per_layer in zip(token_ids, topk, strict=True):
            bucket = int(token) % self.buckets
            row = self.counts.setdefault(bucket, {})
            for layer, experts in enumerate(per_layer):
                for e in experts:
                    row[(layer, int(e))] = row.get((layer, int(e)), 0) + 1
                    self.layer_counts[layer][int(e)] += 1
            self.occurrences[bucket] = self.occurrences.get(bucket, 0) + 1
            self.layer_tokens += 1
            touched.append(bucket)
        # halving happens once per call, after the whole batch
        for bucket in sorted(set(touched)):
            if self.occurrences[bucket] > self.count_cap:
                self.counts[bucket] = {k: v // 2 for k, v in self.counts[bucket].items()}
                self.occurrences[bucket] //= 2

    def observe(self, request_id: int, routed: Sequence[Sequence[bool]]) -> None:
        used = [[1.0 if v else 0.0 for v in row] for row in routed]
        old = self.recent.get(request_id)
        if old is None:
            self.recent[request_id] = used
            return
        d = self.request_decay
        self.recent[request_id] = [
            [o * d + u * (1.0 - d) for o, u in zip(orow, urow, strict=True)]
            for orow, urow in zip(old, used, strict=True)
        ]

    def raw_score(self, request_id: int, token_ids: Sequence[int]) -> list[list[float]]:
        L, E = self.num_layers, self.num_experts
        seen = max(self.layer_tokens, 1.0)
        out = []
        recent = self.recent.get(request_id)
        for layer in range(L):
            row_scores = []
            for e in range(E):
                prior = self.layer_counts[layer][e] / seen
                log_miss = 0.0
                for token in token_ids:
                    bucket = int(token) % self.buckets
                    count = self.counts.get(bucket, {}).get((layer, e), 0)
                    occ = self.occurrences.get(bucket, 0)
                    p = (count + self.smoothing * prior) / (occ + self.smoothing)
                    log_miss += math.log1p(-min(p, 1.0 - 1e-6))
                p_tok = -math.expm1(log_miss)
                r = 0.0 if recent is None else recent[layer][e]
                s = (p_tok + self.request_weight * r) / (1.0 + self.request_weight)
                row_scores.append(min(max(s, 0.0), 1.0))
            out.append(row_scores)
        return out
