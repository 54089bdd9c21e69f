"""Engine sessions: sampling through the whole engine, aborts, streaming,
stop ids, forced acceptance, validation."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.acceptance import ForcedAcceptance
from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine, RequestState
from pdflash.engine.sampling import SamplingParams, target_probs

from .conftest import greedy_reference


def _chi2_critical(df: int) -> float:
    z = 3.090232  # p = 0.001
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.no_grad()
def test_engine_sampling_matches_target_joint(adapter: Any, drafter: Any, hf_target: Any) -> None:
    """Tokens 1 (prefill) and 2 (first verify round, via rejection sampling
    against the random drafter) follow the target's joint distribution under
    temperature 1 / top-k 3. Tolerance: chi-square at p = 0.001, 1500
    requests, fixed seed."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [3, 14, 15, 92, 65]
    cfg = EngineConfig.preset("B1", block_size=4, max_running=250, token_budget=1024, seed=11)
    eng = Engine(adapter, cfg, drafter=drafter, max_seq_len=32)
    n = 1500
    for _ in range(n):
        eng.add_request(prompt, params, max_new_tokens=2)
    done = eng.run_until_done(max_steps=200)
    joint = Counter(tuple(r.output) for r in done.values())
    p1 = target_probs(hf_target(torch.tensor([prompt])).logits[0, -1:], params)[0]
    expected: dict[tuple[int, int], float] = {}
    for t1 in torch.nonzero(p1).view(-1).tolist():
        p2 = target_probs(hf_target(torch.tensor([[*prompt, t1]])).logits[0, -1:], params)[0]
        for t2 in torch.nonzero(p2).view(-1).tolist():
            expected[(t1, t2)] = float(p1[t1] * p2[t2]) * n
    assert set(joint) <= set(expected), set(joint) - set(expected)
    chi2 = sum((joint.get(c, 0) - e) ** 2 / e for c, e in expected.items())
    assert chi2 < _chi2_critical(len(expected) - 1), chi2
    rounds = [len(r.metrics.acceptance_lengths) for r in done.values()]
    assert all(x == 1 for x in rounds)


def test_hundred_concurrent_requests_with_random_aborts(adapter: Any, drafter: Any) -> None:
    rng = np.random.default_rng(5)
    cfg = EngineConfig.preset("B1", block_size=4, max_running=100, token_budget=256, seed=2)
    eng = Engine(adapter, cfg, drafter=drafter, max_seq_len=40)
    streamed: dict[int, list[int]] = {}

    def on_token(rid: int, tok: int) -> None:
        streamed.setdefault(rid, []).append(tok)

    ids = []
    for i in range(100):
        prompt = rng.integers(0, adapter.vocab_size, size=int(rng.integers(2, 10))).tolist()
        params = SamplingParams() if i % 2 else SamplingParams(temperature=0.8, top_p=0.9)
        ids.append(
            eng.add_request(
                prompt, params, max_new_tokens=int(rng.integers(2, 20)), on_token=on_token
            )
        )
    aborted: set[int] = set()
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
        for rid in eng._running:  # KV invariants between steps
            req = eng.request(rid)
            committed = len(req.prompt) + len(req.output) - 1  # the anchor is not in KV yet
            assert eng.kv.length(rid) == committed
            pending = 0 if req.pending_context is None else int(req.pending_context.shape[0])
            assert eng.draft_kv is not None and eng.draft_kv.length(rid) + pending == committed
        live = [
            rid
            for rid in ids
            if eng.request(rid).state not in (RequestState.FINISHED, RequestState.ABORTED)
        ]
        for rid in live:
            if rng.random() < 0.04:
                assert eng.abort(rid)
                aborted.add(rid)
        assert steps < 500
    assert not eng.abort(ids[0]) or ids[0] in aborted  # a second abort is a no-op
    for rid in ids:
        req = eng.request(rid)
        if rid in aborted:
            assert req.state == RequestState.ABORTED and req.metrics.finish_reason == "abort"
        else:
            assert req.state == RequestState.FINISHED
            assert len(req.output) == req.max_new_tokens
        assert streamed.get(rid, []) == req.output
    assert aborted and len(aborted) < 100
    assert eng.kv.used_pages == 0 and eng.kv.num_sequences == 0
    assert eng.draft_kv is not None and eng.draft_kv.used_pages == 0
    assert eng._committed_pages == 0


def test_stop_ids_and_abort_while_waiting(adapter: Any, drafter: Any, hf_target: Any) -> None:
    prompt = [5, 6, 7]
    ref = greedy_reference(hf_target, prompt, 12)
    stop = ref[4]
    cut = ref.index(stop)
    cfg = EngineConfig.preset("B1", block_size=5, max_running=1)
    eng = Engine(adapter, cfg, drafter=drafter, max_seq_len=32)
    a = eng.add_request(prompt, max_new_tokens=12, stop_ids=[stop])
    b = eng.add_request(prompt, max_new_tokens=12)
    eng.step()  # b waits: max_running is 1
    assert eng.request(b).state == RequestState.WAITING
    assert eng.abort(b)
    eng.run_until_done(max_steps=100)
    assert eng.request(a).output == ref[: cut + 1]
    assert eng.request(a).metrics.finish_reason == "stop"
    assert eng.request(b).output == []
    assert eng.kv.used_pages == 0


def test_forced_acceptance_flows_through_verify(adapter: Any, drafter: Any) -> None:
    forced = ForcedAcceptance(mean_tau=3.0, block_size=6, seed=1)
    cfg = EngineConfig.preset("B1", block_size=6, max_running=4)
    eng = Engine(adapter, cfg, drafter=drafter, acceptance=forced, max_seq_len=64)
    ids = [eng.add_request([1, 2, 3, i], max_new_tokens=30) for i in range(4)]
    eng.run_until_done(max_steps=200)
    lengths = [a for rid in ids for a in eng.request(rid).metrics.acceptance_lengths]
    assert max(lengths) > 1  # the random drafter alone would almost never get here
    assert all(eng.request(rid).metrics.model_rounds == 0 for rid in ids)
    assert all(len(eng.request(rid).output) == 30 for rid in ids)
    assert eng.kv.used_pages == 0


def test_bad_requests_are_rejected_without_state_change(adapter: Any, drafter: Any) -> None:
    eng = Engine(adapter, EngineConfig.preset("B1", block_size=4), drafter=drafter, max_seq_len=16)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    with pytest.raises(ValueError, match="token id 1000"):
        eng.add_request([1, 1000])
    with pytest.raises(ValueError, match="exceeds max_seq_len 16"):
        eng.add_request([1] * 10, max_new_tokens=10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request([1], max_new_tokens=0)
    assert not eng.has_work
    assert not eng.abort(12345)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(adapter, EngineConfig.preset("B1"))
    with pytest.raises(ValueError, match="unknown baseline 'B9'"):
        EngineConfig.preset("B9")


def test_metrics_are_recorded(adapter: Any, drafter: Any) -> None:
    eng = Engine(adapter, EngineConfig.preset("B1", block_size=4), drafter=drafter, max_seq_len=32)
    rid = eng.add_request([1, 2, 3], max_new_tokens=6, slo_s=1e6)
    eng.run_until_done()
    m = eng.request(rid).metrics
    assert m.ttft_s is not None and m.ttft_s >= 0
    assert len(m.round_latencies_s) == len(m.acceptance_lengths) == m.model_rounds
    assert sum(m.acceptance_lengths) + 1 == m.output_tokens == 6
    assert m.met_slo is True


def test_stream_callback_may_abort_requests(adapter: Any, drafter: Any) -> None:
    eng = Engine(
        adapter,
        EngineConfig.preset("B1", block_size=4, max_running=4),
        drafter=drafter,
        max_seq_len=32,
    )
    ids: list[int] = []

    def on_token(rid: int, tok: int) -> None:
        if rid == ids[0] and len(eng.request(rid).output) == 3:
            eng.abort(ids[1])  # another request, possibly later in the same batch
            eng.abort(rid)  # and itself

    ids += [eng.add_request([1, 2, 3], max_new_tokens=12, on_token=on_token)]
    ids += [eng.add_request([4, 5, 6], max_new_tokens=12) for _ in range(2)]
    eng.run_until_done(max_steps=100)
    assert (
        eng.request(ids[0]).state == RequestState.ABORTED and len(eng.request(ids[0]).output) == 3
    )
    assert eng.request(ids[1]).state == RequestState.ABORTED
    assert (
        eng.request(ids[2]).state == RequestState.FINISHED and len(eng.request(ids[2]).output) == 12
    )
    assert eng.kv.used_pages == 0


def test_single_token_request_finishes_at_prefill(
    adapter: Any, drafter: Any, hf_target: Any
) -> None:
    eng = Engine(adapter, EngineConfig.preset("B1", block_size=4), drafter=drafter, max_seq_len=16)
    rid = eng.add_request([9, 8, 7], max_new_tokens=1)
    report = eng.step()
    assert report.admitted == 1 and report.verified == 0
    req = eng.request(rid)
    assert req.state == RequestState.FINISHED and req.output == greedy_reference(
        hf_target, [9, 8, 7], 1
    )
    assert req.metrics.acceptance_lengths == [] and not eng.has_work and eng.kv.used_pages == 0
