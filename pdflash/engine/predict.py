"""The route-ahead union predictor the engine calls once per step.

The engine predicts all drafted blocks of a step at once, so members are
asked through :func:`pdflash.routeahead.predict_batch` (one router pass over
every block for :class:`~pdflash.routeahead.ApproxRouterPredictor`); the
scaling and the union are :class:`pdflash.routeahead.CombinedPredictor`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdflash.protocols import DraftedBlock, ExpertPredictor
from pdflash.routeahead.predictors import CombinedPredictor, ScoreArray


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
