"""The route-ahead union predictor the engine calls once per step.

The engine predicts all drafted blocks of a step at once, so members are
asked through :func:`pdflash.routeahead.predict_batch` (one router pass over
every block for :class:`~pdflash.routeahead.ApproxRouterPredictor`); the
scaling and the union are :class:`pdflash.routeahead.CombinedPredictor`'s.
:func:`route_ahead_predictor` builds the predictor of a route-ahead source;
:class:`TokenRoutingRecorder` hands predictors that learn from per-row
routing (:class:`pdflash.routeahead.TokenPriorPredictor`) each forward's top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import numpy.typing as npt

from pdflash.protocols import DraftedBlock, ExpertPredictor
from pdflash.routeahead.predictors import CombinedPredictor, ScoreArray

if TYPE_CHECKING:
    import torch


class BatchedUnionPredictor(CombinedPredictor):
    """Union of members' predicted sets: each member's per-block scores are
    scaled to [0, 1] by that block's maximum, times the member's weight, and
    the maximum over members is the score (> 0: predicted).

    :class:`CombinedPredictor` in ``mode="union"`` (one home for the
    scaling and the union); :meth:`predict` here also goes through the
    members' batched pass, as the engine's per-step call does."""

    def __init__(
        self, members: Sequence[tuple[ExpertPredictor, float]], *, name: str = "union"
    ) -> None:
        super().__init__(members, mode="union", name=name)

    def predict(self, block: DraftedBlock) -> ScoreArray:
        result: ScoreArray = self.predict_batch([block])[0]
        return result


#: the route-ahead sources PD's engine can predict with before a verify
ROUTE_AHEAD_SOURCES = ("union", "token_prior", "previous_round")
#: what the union's approximate router reads
#: (:class:`~pdflash.routeahead.ApproxRouterPredictor`'s proxies without
#: attention): ``auto`` (the drafter's hidden states where the drafter
#: exposes them, else the embeddings), ``drafter``, ``embed``
ROUTE_AHEAD_PROXIES = ("auto", "drafter", "embed")
_Proxy = Literal["auto", "drafter", "embed"]


def route_ahead_predictor(
    adapter: Any,
    source: str = "union",
    *,
    approx: ExpertPredictor | None = None,
    proxy: str = "auto",
) -> ExpertPredictor:
    """The predictor PD's engine asks before a verify.

    * ``"union"`` (default): the approximate router (drafter hidden states
      when the drafter exposes them, else the embeddings) united with the
      request's previous round.
    * ``"token_prior"``: :class:`~pdflash.routeahead.TokenPriorPredictor`,
      token id -> experts learned from every routed row, selection
      calibrated to a precision floor (the engine feeds it each prefill's and
      verify's per-row routing).
    * ``"previous_round"``: :class:`~pdflash.routeahead.PreviousRoundPredictor`
      alone, the experts the request's last verify routed to: no router pass
      before the verify, and on learned routing the best coverage/precision
      trade-off ``pdflash-bench routeahead`` found (the union's approximate
      router adds experts at little above the routed share's precision).

    ``proxy`` (:data:`ROUTE_AHEAD_PROXIES`) is what the union's approximate
    router reads; ``approx`` replaces it (a trace replay passes
    :class:`pdflash.engine.replay.TraceApproxRouter`: the trained model's
    predictions instead of the synthetic router's).
    """
    from pdflash.routeahead import (
        ApproxRouterPredictor,
        PreviousRoundPredictor,
        TokenPriorPredictor,
    )

    if source not in ROUTE_AHEAD_SOURCES:
        raise ValueError(f"route-ahead source must be one of {ROUTE_AHEAD_SOURCES}, got {source!r}")
    if proxy not in ROUTE_AHEAD_PROXIES:
        raise ValueError(f"route-ahead proxy must be one of {ROUTE_AHEAD_PROXIES}, got {proxy!r}")
    if source == "token_prior":
        return TokenPriorPredictor(adapter.num_layers, adapter.num_experts)
    if source == "previous_round":
        return PreviousRoundPredictor(adapter.num_layers, adapter.num_experts)
    return BatchedUnionPredictor(
        [
            (approx or ApproxRouterPredictor(adapter, proxy=cast(_Proxy, proxy)), 1.0),
            (PreviousRoundPredictor(adapter.num_layers, adapter.num_experts), 0.5),
        ]
    )


class TokenRoutingRecorder:
    """A forward observer (:class:`pdflash.engine.target.LayerObserver`)
    keeping each MoE layer's top-k ids of the latest forward on the device
    (no sync); :meth:`take` brings them to the host in one copy, for
    predictors that learn from per-row routing."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._layers: list[torch.Tensor] = []

    def after_layer(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if layer == 0:  # a new forward
            self._layers = []
        # a copy on the device (no sync): a replayed CUDA-graph piece may
        # reuse the buffer its routing came in
        self._layers.append(topk_ids.clone())

    def take(self) -> npt.NDArray[np.int64] | None:
        """``[T, L, k]`` top-k ids of the latest forward's rows, or None if
        it did not run every layer (then nothing is learned)."""
        import torch

        layers, self._layers = self._layers, []
        if len(layers) != self.num_layers:
            return None
        result: npt.NDArray[np.int64] = torch.stack(layers, dim=1).to(torch.int64).cpu().numpy()
        return result
