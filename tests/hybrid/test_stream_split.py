"""Splitting the stream's copies (``ahead_from="stream"``,
:mod:`pdflash.hybrid.service`): the gate lookahead's copies of a layer go
through the cost model's split before the stream copies them (the split is
the makespan optimum on constructed cases), the stream copies only the COPY
part, and the pre-verify candidates take the stream's fetch set."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.engine.engine import _with_stream_candidates
from pdflash.hybrid import CostModelPlanner, HostCostModel
from pdflash.hybrid.service import HostExpertService

from .test_host_idle import IdleExecutor

COPY_S = 1e-3  # one expert copy on the link below (1000 bytes at 1 MB/s)


def _service(cost: HostCostModel, num_experts: int = 16) -> HostExpertService:
    planner = CostModelPlanner(cost, 1000, margin=0.0, online=False, max_host_tokens=None)
    return HostExpertService(
        IdleExecutor(),  # type: ignore[arg-type]
        planner,
        num_experts=num_experts,
        expert_nbytes=1000,
        link_bytes_per_s=1e6,
    )


def _brute_force(cost: HostCostModel, tokens: npt.NDArray[np.float64]) -> tuple[int, float]:
    """(experts hosted, modeled wait) of the best split of copies that each
    cost COPY_S: the fewest-token prefix minimising max(host, link), with
    all-COPY (0) among the choices and the cap ``max_host_ratio`` applied."""
    order = np.sort(tokens)
    best_m, best = 0, tokens.size * COPY_S
    for m in range(1, tokens.size + 1):
        host_each = [cost.expert_s(float(t)) for t in order[:m]]
        if max(host_each) > 1.5 * COPY_S:
            break
        wait = max(cost.roundtrip_s + sum(host_each), (tokens.size - m) * COPY_S)
        if wait < best:
            best_m, best = m, wait
    return best_m, best


@pytest.mark.parametrize(
    ("cost", "tokens"),
    [
        # 0.5 ms an expert against a 1 ms copy: 6 of 9 hosted, both resources 3 ms
        (HostCostModel(0.5e-3, 0.0), [1.0] * 9),
        # the round trip and a per-token slope: the fewest-token experts go first
        (HostCostModel(0.3e-3, 0.1e-3, roundtrip_s=0.4e-3), [5, 1, 3, 2, 8, 1, 4, 2, 6, 3]),
        # an expert as costly as a copy: half of them
        (HostCostModel(1e-3, 0.0), [2.0] * 8),
        # beyond the ratio cap (host > 1.5 copies): nothing
        (HostCostModel(2e-3, 0.0), [1.0] * 6),
    ],
)
def test_a_lookahead_layer_is_split_at_the_makespan_optimum(
    cost: HostCostModel, tokens: list[float]
) -> None:
    svc = _service(cost)
    ids = np.arange(3, 3 + len(tokens), dtype=np.int64)
    exp = np.asarray(tokens, dtype=np.float64)
    host = svc.plan_lookahead(2, ids, exp)
    m, _ = _brute_force(cost, exp)
    assert int(host.sum()) == m
    if 0 < m < exp.size:
        # the hosted experts are the fewest-token ones
        assert exp[host].max() <= exp[~host].min()
    # the layer's row of the ahead plan is the split's HOST set
    assert svc._ahead is not None
    assert np.array_equal(np.flatnonzero(svc._ahead[2]), np.sort(ids[host]))
    assert svc.describe()["lookahead_split"] == {"layers": 1, "planned": m}


def test_a_lookahead_split_counts_in_the_ahead_books() -> None:
    """What the layer then routes of the lookahead's HOST set is booked as
    the ahead plans' (seen, routed) are; a switched-off service plans
    nothing."""
    svc = _service(HostCostModel(0.5e-3, 0.0))
    ids = np.arange(9, dtype=np.int64)
    host = svc.plan_lookahead(1, ids, np.ones(9))
    assert int(host.sum()) == 6

    class _Empty:
        slot_of = np.full(64, -1, dtype=np.int64)
        ticket = np.zeros(0, dtype=np.int64)

    routed = 16 + ids[host][:4]  # four of the six, as layer 1's flat ids
    svc.enabled = False  # the layer's own split: nothing hosted, the books still taken
    svc.split(1, routed, np.ones(routed.size, dtype=np.int64), _Empty())
    assert (svc.books.ahead_seen, svc.books.ahead_routed) == (6, 4)
    assert not svc.plan_lookahead(1, ids, np.ones(9)).any()
    assert svc.lookahead_layers == 1


def test_lookahead_splits_of_later_layers_keep_the_earlier_rows() -> None:
    """With no ahead plan hosting anything, each lookahead split adds its
    layer's row (the rows before it stay)."""
    svc = _service(HostCostModel(0.5e-3, 0.0))
    ids = np.arange(9, dtype=np.int64)
    first = svc.plan_lookahead(1, ids, np.ones(9))
    later = svc.plan_lookahead(3, ids, np.ones(9))
    assert svc._ahead is not None and svc._ahead.shape[0] == 4
    assert np.array_equal(svc._ahead[1, :9], first) and np.array_equal(svc._ahead[3, :9], later)
    assert not svc._ahead[[0, 2]].any()


class _Lookahead:
    """A gate lookahead that predicts fixed experts and scores for the next layer."""

    def __init__(self, num_experts: int, local: list[int], scores: list[float]) -> None:
        self.num_experts = num_experts
        self.local = np.asarray(local, dtype=np.int64)
        self.scores = np.asarray(scores, dtype=np.float32)

    def predict_next(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        return self.local + (layer + 1) * self.num_experts, self.scores


def test_the_stream_copies_only_the_copy_part_of_its_lookahead() -> None:
    """Layer 0 released: the lookahead names eight experts of layer 1 (one
    below the copy threshold, one resident); the other six go through the
    split (each expecting score x top_k tokens), the stream copies the COPY
    part only and skips the HOST part."""
    from ..engine.test_prefetch_stream import HeldIssuer, _setup

    L, E = 3, 16
    issuer = HeldIssuer()
    cache, stream, policy = _setup(L, E, slots=40, issuer=issuer, ahead=0)
    stream.adapter = SimpleNamespace(num_layers=L, num_experts=E, top_k=4)  # type: ignore[assignment]
    stream.lookahead_min_score = 0.15
    local = [0, 1, 2, 3, 4, 5, 6, 7]
    scores = [0.9, 0.8, 0.25, 0.25, 0.25, 0.5, 0.3, 0.1]  # 7: below the threshold
    stream._lookahead = _Lookahead(E, local, scores)  # type: ignore[assignment]
    cache.prefetch(np.asarray([E + 1]), stream_band())  # layer 1's expert 1 resident
    issuer.land_all()
    svc = _service(HostCostModel(0.5e-3, 0.0), num_experts=E)
    seen: list[tuple[int, list[int], list[float]]] = []

    def split(layer: int, ids: Any, expected: Any) -> Any:
        seen.append((layer, ids.tolist(), expected.tolist()))
        return svc.plan_lookahead(layer, ids, expected)

    stream.host_split = split
    stream.log_submissions = True
    stream.begin_forward()
    policy.before_layer(0)
    stream.on_routed(0, torch.tensor([[9]]), None)
    cache.ensure_resident([9])
    cache.release([9])
    stream.after_layer(0, torch.zeros(1, 1), torch.tensor([[9]]))
    # the candidates: confident, not resident; expected tokens = score x top_k
    (layer, ids, expected) = seen[0]
    assert layer == 1 and ids == [0, 2, 3, 4, 5, 6]
    assert expected == pytest.approx([3.6, 1.0, 1.0, 1.0, 2.0, 1.2])
    # the makespan optimum of six 1-ms copies against 0.5 ms an expert: 4 hosted
    hosted = sorted(np.flatnonzero(stream.skip[1]).tolist())
    assert len(hosted) == 4
    copied = sorted(g - E for _, g in stream.submit_log if g // E == 1)
    assert copied == sorted(set(ids) - set(hosted))
    assert stream.host_split_layers == 1 and stream.host_split_experts == 4
    assert stream.stats()["stream_host_split_experts"] == 4


def stream_band() -> Any:
    from pdflash.protocols import Band

    return Band.ROUTE_AHEAD


def test_without_a_split_the_lookahead_copies_every_confident_expert() -> None:
    from ..engine.test_prefetch_stream import HeldIssuer, _setup

    L, E = 2, 8
    issuer = HeldIssuer()
    cache, stream, policy = _setup(L, E, slots=24, issuer=issuer, ahead=0)
    stream._lookahead = _Lookahead(E, [0, 1, 2], [0.9, 0.9, 0.9])  # type: ignore[assignment]
    stream.log_submissions = True
    stream.begin_forward()
    policy.before_layer(0)
    stream.on_routed(0, torch.tensor([[5]]), None)
    cache.ensure_resident([5])
    cache.release([5])
    stream.after_layer(0, torch.zeros(1, 1), torch.tensor([[5]]))
    assert sorted(g for _, g in stream.submit_log) == [8, 9, 10]
    assert stream.host_split_layers == 0 and not stream.skip.any()


def test_fetch_if_is_the_fetch_set_set_plan_would_give_and_issues_nothing() -> None:
    from ..engine.test_prefetch_stream import HeldIssuer, _setup

    L, E = 3, 8
    issuer = HeldIssuer()
    _, stream, _ = _setup(L, E, slots=16, issuer=issuer, ahead=1)
    stream.set_plan([0, 1, 9, 17], "prev_round")
    n = len(issuer.submitted)
    stream.precision["prev_round"] = 0.9
    stream.precision["predicted"] = 0.8
    got = stream.fetch_if([2, 10, 18])
    assert len(issuer.submitted) == n  # nothing issued
    assert sorted(np.flatnonzero(got.reshape(-1)).tolist()) == [0, 1, 9, 17]  # the better source
    stream.precision["predicted"] = 0.95
    want = stream.fetch_if([2, 10, 18])
    stream.set_plan([2, 10, 18], "predicted")
    assert np.array_equal(want, stream.fetch)


def test_stream_only_candidates_expect_their_layers_mean_share() -> None:
    expected = np.asarray([[2.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    fetch = np.asarray(
        [[True, False, True, False], [False, True, False, False], [False, False, False, True]]
    )
    out = _with_stream_candidates(expected, fetch)
    # named experts keep their share; a fetch-only one gets the layer's mean
    # (3 tokens), one where nothing is named 1 token, and never below 1
    assert out.tolist() == [[2.0, 4.0, 3.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 1.0]]
    assert expected[0, 2] == 0.0  # the input is not changed
