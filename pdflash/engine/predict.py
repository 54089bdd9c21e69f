"""A batched union of route-ahead predictors for the engine's per-step call.

:class:`pdflash.routeahead.CombinedPredictor` predicts block by block; the
engine predicts all drafted blocks of a step at once, so it combines members
through :func:`pdflash.routeahead.predict_batch` (one router pass over every
block for :class:`~pdflash.routeahead.ApproxRouterPredictor`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pdflash.protocols import DraftedBlock, ExpertPredictor


class BatchedUnionPredictor:
    """Union of members' predicted sets: each member's per-block scores are
    scaled to [0, 1] by that block's maximum, times the member's weight, and
    the maximum over members is the score (> 0: predicted)."""

    def __init__(
        self, members: Sequence[tuple[ExpertPredictor, float]], *, name: str = "union"
    ) -> None:
        if not members:
            raise ValueError("BatchedUnionPredictor needs at least one member")
        for predictor, weight in members:
            if not weight > 0:
                raise ValueError(f"weight of {predictor.name!r} must be positive, got {weight}")
        self.members = list(members)
        self.name = name

    def predict(self, block: DraftedBlock) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = self.predict_batch([block])[0]
        return out

    def predict_batch(self, blocks: Sequence[DraftedBlock]) -> npt.NDArray[np.float32]:
        from pdflash.routeahead import predict_batch

        combined: npt.NDArray[np.float32] | None = None
        for predictor, weight in self.members:
            scores = np.asarray(predict_batch(predictor, blocks), dtype=np.float32)
            peak = scores.reshape(scores.shape[0], -1).max(axis=1) if scores.size else np.zeros(0)
            scale = np.where(peak > 0, weight / np.where(peak > 0, peak, 1.0), 0.0).astype(
                np.float32
            )
            part = np.maximum(scores * scale[:, None, None], 0.0).astype(np.float32)
            combined = part if combined is None else np.maximum(combined, part)
        assert combined is not None
        return combined

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        for predictor, _ in self.members:
            predictor.observe(request_id, routed)

    def forget(self, request_id: int) -> None:
        for predictor, _ in self.members:
            predictor.forget(request_id)
