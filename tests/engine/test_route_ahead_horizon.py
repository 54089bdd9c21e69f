"""``EngineConfig.route_ahead_horizon``: with ``verified`` the engine drops
the caller's acceptance horizon and predicts for every row the verify will
route; with ``acceptance`` (the default) it keeps it."""

from __future__ import annotations

from typing import Any

import pytest

from pdflash.engine import Engine, EngineConfig, SamplingParams
from pdflash.protocols import DraftedBlock
from pdflash.routeahead import AcceptanceHorizon, PreviousRoundPredictor


class _Recording(PreviousRoundPredictor):
    """The previous-round predictor, keeping every block it was asked about."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(num_layers, num_experts)
        self.blocks: list[DraftedBlock] = []

    def predict(self, block: DraftedBlock) -> Any:
        self.blocks.append(block)
        return super().predict(block)


@pytest.mark.parametrize("setting", ["acceptance", "verified"])
def test_the_predictor_sees_the_horizon_only_under_acceptance(
    setting: str, adapter: Any, drafter: Any
) -> None:
    predictor = _Recording(adapter.num_layers, adapter.num_experts)
    horizon = AcceptanceHorizon(4)
    config = EngineConfig.preset(
        "PD-all-on",
        block_size=4,
        batching="fcfs",
        streaming_prefetch=False,
        background_prefetch=False,
        route_ahead_horizon=setting,
    )
    engine = Engine(
        adapter,
        config,
        drafter=drafter,
        predictor=predictor,
        horizon=horizon,
        max_seq_len=96,
    )
    assert (engine.horizon is horizon) is (setting == "acceptance")
    for seed in range(2):
        engine.add_request([1 + seed, 2, 3, 4, 5], SamplingParams(), max_new_tokens=16)
    engine.run_until_done()
    later = predictor.blocks[2:]  # the first rounds have no acceptance history yet
    assert later
    if setting == "verified":
        assert all(b.horizon is None for b in later)
    else:
        assert any(b.horizon is not None for b in later)
