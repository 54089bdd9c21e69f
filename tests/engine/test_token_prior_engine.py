"""PD's engine with the token-conditioned route-ahead source: lossless, and
the token prior learns exactly the rows each prefill and verify routed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.drafter import load_drafter
from pdflash.engine.engine import Engine
from pdflash.engine.predict import (
    ROUTE_AHEAD_SOURCES,
    BatchedUnionPredictor,
    TokenRoutingRecorder,
    route_ahead_predictor,
)
from pdflash.protocols import ExpertPredictor
from pdflash.routeahead import PreviousRoundPredictor, TokenPriorPredictor

from .conftest import greedy_cases, layer_cyclic_offload, oracle_drafts, write_target_and_drafter

MAX_NEW = 12


class _Spy(TokenPriorPredictor):
    """A token prior that records what the engine hands it, in order."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[str, Any]] = []

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        self.calls.append(("observe", np.array(routed)))
        super().observe(request_id, routed)

    def observe_tokens(self, token_ids: Any, topk_ids: Any) -> None:
        self.calls.append(("tokens", (np.array(token_ids), np.array(topk_ids))))
        super().observe_tokens(token_ids, topk_ids)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("tokenprior")
    write_target_and_drafter(tmp, "qwen3_moe", 3, target_seed=7, drafter_seed=8)
    return tmp, greedy_cases(tmp / "target", (5, 8, 3), MAX_NEW, seed=1)


def test_route_ahead_sources() -> None:
    class _Shape:
        num_layers, num_experts, top_k = 2, 8, 2

    assert ROUTE_AHEAD_SOURCES == ("union", "token_prior", "previous_round")
    assert isinstance(route_ahead_predictor(_Shape(), "token_prior"), TokenPriorPredictor)
    assert isinstance(route_ahead_predictor(_Shape(), "previous_round"), PreviousRoundPredictor)
    assert isinstance(route_ahead_predictor(_Shape()), BatchedUnionPredictor)
    with pytest.raises(ValueError, match="route-ahead source"):
        route_ahead_predictor(_Shape(), "oracle")


def test_recorder_keeps_one_whole_forward() -> None:
    rec = TokenRoutingRecorder(2)
    rec.after_layer(0, torch.zeros(3, 4), torch.tensor([[1, 2]] * 3))
    assert rec.take() is None  # layer 1 never ran: nothing to learn
    for layer in (0, 1):
        rec.after_layer(layer, torch.zeros(3, 4), torch.full((3, 2), layer))
    got = rec.take()
    assert got is not None and got.shape == (3, 2, 2)
    np.testing.assert_array_equal(got[:, 1], np.ones((3, 2)))


def _run_pd_lossless(
    pair: tuple[Path, list[Any]], make_predictor: Callable[[Any], ExpertPredictor]
) -> tuple[Engine, Any]:
    """PD-all-on over the pair's greedy cases with the predictor
    ``make_predictor(adapter)`` returns; asserts every output equals plain
    greedy decoding. Returns the finished engine and its adapter."""
    from pdflash.routeahead import RouteAheadStats

    tmp, cases = pair
    adapter, issuer, cache = layer_cyclic_offload(tmp / "target", num_slots=6)
    config = EngineConfig.preset(
        "PD-all-on", block_size=5, max_running=3, token_budget=15, batching="fcfs"
    )
    eng = Engine(
        adapter,
        config,
        drafter=load_drafter(tmp / "drafter"),
        predictor=make_predictor(adapter),
        expert_cache=cache,
        route_stats=RouteAheadStats.for_adapter(adapter),
        max_seq_len=64,
    )
    try:
        ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
        oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=2)
        done = eng.run_until_done(max_steps=200)
        for rid, (_, ref) in zip(ids, cases, strict=True):
            assert done[rid].output == ref
    finally:
        issuer.close()
    return eng, adapter


def test_pd_with_token_prior_is_lossless_and_learns_every_routed_row(
    pair: tuple[Path, list[Any]],
) -> None:
    _, cases = pair
    eng, adapter = _run_pd_lossless(
        pair, lambda adapter: _Spy(adapter.num_layers, adapter.num_experts, min_calibration=0)
    )
    spy = eng.predictor
    assert isinstance(spy, _Spy)
    kinds = [k for k, _ in spy.calls]
    # the prefill's rows first: the prompts, one call
    first_tokens = spy.calls[kinds.index("tokens")][1][0]
    np.testing.assert_array_equal(first_tokens, np.concatenate([p for p, _ in cases]))
    assert kinds.index("tokens") < kinds.index("observe")
    # every verify: its requests' routed sets, then their rows' top-k, whose
    # union over the rows is exactly the union of those routed sets
    routed_since: list[npt.NDArray[np.bool_]] = []
    verifies = 0
    for kind, payload in spy.calls[kinds.index("tokens") + 1 :]:
        if kind == "observe":
            routed_since.append(payload)
            continue
        tokens, topk = payload
        assert routed_since and topk.shape == (tokens.size, adapter.num_layers, adapter.top_k)
        union = np.zeros((adapter.num_layers, adapter.num_experts), dtype=np.bool_)
        union[np.arange(adapter.num_layers)[None, :, None], topk] = True
        np.testing.assert_array_equal(union, np.logical_or.reduce(routed_since))
        routed_since = []
        verifies += 1
    assert verifies == eng.verify_forwards
    rows = sum(p[0].size for k, p in spy.calls if k == "tokens")
    assert int(spy._occurrences.sum()) == rows  # no halving at this size: every row counted
    assert eng.route_stats is not None
    assert eng.route_stats.snapshot().request.predicted > 0  # it did predict before verifies


def test_pd_with_previous_round_is_lossless_and_predicts_after_the_first_round(
    pair: tuple[Path, list[Any]],
) -> None:
    """The ``previous_round`` source: greedy output unchanged, and once a
    request has verified it predicts that verify's experts for the next."""
    eng, _ = _run_pd_lossless(
        pair, lambda adapter: route_ahead_predictor(adapter, "previous_round")
    )
    assert eng.route_stats is not None
    snap = eng.route_stats.snapshot().request
    assert snap.predicted > 0 and snap.hits > 0
