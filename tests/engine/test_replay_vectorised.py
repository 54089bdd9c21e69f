"""TraceRouting's vectorised row choice and per-forward mapping against the
per-row reference (:meth:`TraceRouting.trace_rows` + :meth:`map_experts`),
and its device-side books (no host read per layer)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdflash import traces as tf
from pdflash.engine.replay import TraceRouting


class _Adapter:
    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.calls = 0

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        g = torch.Generator().manual_seed(layer)
        return torch.randn(normed.shape[0], self.num_experts, generator=g)


def _trace(seed: int, *, requests: int = 3, layers: int = 4, experts: int = 16, k: int = 4) -> Any:
    """A trace whose verify rounds start where a request's committed tokens
    reach, with verify tokens that follow the sequence for a while (so a
    replayed chunk matches ``exact`` for a prefix, then ``token`` or
    ``positional``)."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(3, 7, requests)
    acc: list[int] = []
    req: list[int] = []
    for r in range(requests):
        for _ in range(int(rng.integers(2, 5))):
            acc.append(int(rng.integers(1, 5)))
            req.append(r)
    order = rng.permutation(len(acc))  # rounds of requests interleaved
    acc = [acc[i] for i in order]
    req = [req[i] for i in order]
    lengths = [
        int(plen[r]) + 1 + sum(a for a, q in zip(acc, req, strict=True) if q == r)
        for r in range(requests)
    ]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, 50, int(starts[-1]))
    rows = 5
    verify = []
    pos = {r: int(plen[r]) for r in range(requests)}
    for a, r in zip(acc, req, strict=True):
        seq = tokens[starts[r] : starts[r + 1]]
        block = [int(seq[min(pos[r] + j, seq.size - 1)]) for j in range(rows)]
        cut = int(rng.integers(0, rows + 1))
        block[cut:] = rng.integers(0, 50, rows - cut).tolist()
        verify += block
        pos[r] += a
    V = len(verify)
    return tf.ProxyTrace(
        tokens=tokens.astype(np.uint16),
        token_request=starts,
        prompt_len=plen.astype(np.int32),
        token_topk=np.stack([rng.permutation(experts)[:k] for _ in range(int(starts[-1]) * layers)])
        .reshape(-1, layers, k)
        .astype(np.uint8),
        round_request=np.array(req, dtype=np.int32),
        round_accepted=np.array(acc, dtype=np.int16),
        round_rows=np.full(len(acc), rows, dtype=np.int16),
        verify_topk=np.stack([rng.permutation(experts)[:k] for _ in range(V * layers)])
        .reshape(V, layers, k)
        .astype(np.uint8),
        verify_tokens=np.array(verify, dtype=np.uint16),
        provenance={
            "format": tf.FORMAT,
            "version": tf.VERSION,
            "num_experts": experts,
            "top_k": k,
            "num_layers": layers,
            "block_size": rows,
            "temperature": 0.0,
            "target_weights_sha256": "t",
            "drafter_weights_sha256": "d",
            "target_preset": "test",
            "prompts_source": "test",
        },
    )


def _chunks(trace: Any, rng: np.random.Generator) -> list[tuple[int, int, torch.Tensor]]:
    """Random chunks: some at recorded round starts (their verify tokens, cut
    or changed), some at random positions with the trace's or other tokens."""
    out = []
    for rid in range(int(rng.integers(1, 5))):
        r = rid % trace.num_requests
        seq = trace.request_tokens(r).astype(np.int64)
        n = int(rng.integers(1, 9))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            rounds = np.flatnonzero(trace.round_request == r)
            i = int(rng.choice(rounds))
            row0 = int(trace.round_rows[:i].astype(np.int64).sum())
            start = int(trace.prompt_len[r]) + int(
                trace.round_accepted[rounds[rounds < i]].astype(np.int64).sum()
            )
            toks = trace.verify_tokens[row0 : row0 + n].astype(np.int64)
            toks = np.concatenate([toks, rng.integers(0, 50, n - toks.size)])
            if rng.random() < 0.5:
                toks[int(rng.integers(0, n))] += 1
        elif kind == 1:
            start = int(rng.integers(0, seq.size + 4))
            toks = np.array([seq[(start + j) % seq.size] for j in range(n)], dtype=np.int64)
        else:
            start = int(rng.integers(0, 2 * seq.size))
            toks = rng.integers(0, 50, n)
        out.append((rid, start, torch.as_tensor(toks, dtype=torch.int64)))
    return out


@pytest.mark.parametrize(
    ("layers", "experts", "k"),
    [(4, 16, 4), (4, 16, 2), (8, 4, 3), (2, 8, 2), (4, 2, 2), (6, 16, 6)],
)
def test_begin_forward_matches_the_per_row_reference(layers: int, experts: int, k: int) -> None:
    trace = _trace(layers * 100 + experts * 10 + k)
    fast = TraceRouting(trace, _Adapter(layers, experts, k), None)
    ref = TraceRouting(trace, _Adapter(layers, experts, k), None)
    rng = np.random.default_rng(k)
    for _ in range(40):
        chunks = _chunks(trace, rng)
        fast.begin_forward(chunks)
        want = []
        for rid, start, toks in chunks:
            rows, how = ref.trace_rows(rid, start, toks.tolist())
            for h in how:
                ref.counts[h] += 1
            want.append(ref.map_experts(rows))
        expect = np.concatenate(want)
        assert fast._ids is not None
        got = fast._ids.numpy()
        assert np.array_equal(got[:, 0], expect)
        assert np.array_equal(got[:, 1], np.sort(expect, axis=-1))
        assert fast.counts == ref.counts
        assert fast.filled_slots == ref.filled_slots
    assert sum(fast.counts.values()) > 0 and min(fast.counts.values()) > 0


def test_row_sources_pick_the_reference_rows() -> None:
    trace = _trace(7)
    rt = TraceRouting(trace, _Adapter(4, 16, 4), None)
    rng = np.random.default_rng(3)
    ntok = int(trace.token_topk.shape[0])
    both = np.concatenate([trace.token_topk, trace.verify_topk])
    for _ in range(200):
        for rid, start, toks in _chunks(trace, rng):
            idx, exact, by_token = rt.row_sources(rid, start, toks.numpy())
            rows, how = rt.trace_rows(rid, start, toks.tolist())
            assert np.array_equal(both[idx], rows)
            assert (exact, by_token) == (how.count("exact"), how.count("token"))
            assert (idx[:exact] >= ntok).all() and (idx[exact:] < ntok).all()


def test_route_keeps_the_router_rows_and_counts_them_without_a_host_read() -> None:
    trace = _trace(11)
    adapter = _Adapter(4, 16, 4)
    rt = TraceRouting(trace, adapter, None)
    seq = trace.request_tokens(0).astype(np.int64)
    rt.begin_forward([(0, 0, torch.as_tensor(seq[:3]))])
    assert rt._ids is not None
    replay = rt._ids[:, 0, 2].clone()
    ids = (replay + 1) % 16
    ids[1] = replay[1].flip(0)  # row 1: the router's set, in another order
    weights = torch.rand(3, 4)
    got_ids, got_w = rt.route(2, torch.zeros(3, 5), ids, weights)
    assert torch.equal(got_ids[1], ids[1]) and torch.equal(got_w[1], weights[1])
    assert torch.equal(got_ids[[0, 2]], replay[[0, 2]])
    expect = torch.softmax(adapter.router_logits(2, torch.zeros(3, 5)).gather(1, replay), -1)
    assert torch.allclose(got_w[[0, 2]], expect[[0, 2]])
    # every row the router chose: its own ids and weights, bit for bit
    same_ids, same_w = rt.route(1, torch.zeros(3, 5), rt._ids[:, 0, 1].flip(1), weights)
    assert torch.equal(same_ids, rt._ids[:, 0, 1].flip(1)) and torch.equal(same_w, weights)
    # counted on the device, read when asked
    assert len(rt._same_pending) == 2
    assert (rt.router_weight_rows, rt.replayed_weight_rows) == (4, 2)
    assert rt.describe()["row_layers_with_replayed_weights"] == 2
    rt.begin_forward([(0, 0, torch.as_tensor(seq[:2]))])
    rt.route(0, torch.zeros(2, 5), rt._ids[:, 0, 0], torch.rand(2, 4))
    assert (rt.router_weight_rows, rt.replayed_weight_rows) == (6, 2)
    rt.reset_stats()
    assert (rt.router_weight_rows, rt.replayed_weight_rows) == (0, 0)


@pytest.mark.gpu
def test_trace_routing_reads_the_host_once_per_forward_on_cuda() -> None:
    """On CUDA: one host read per forward (the rows' tokens, in
    begin_forward) and none per layer (route)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    from pdflash.bench.eager_host import count_syncs

    trace = _trace(5)
    layers, experts, k = 4, 16, 4
    logits = torch.randn(3, experts, device="cuda")

    class _CudaAdapter(_Adapter):
        def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
            return logits

    rt = TraceRouting(trace, _CudaAdapter(layers, experts, k), None)
    seq = torch.as_tensor(trace.request_tokens(0)[:3].astype(np.int64), device="cuda")
    ids = torch.randint(0, experts, (3, k), device="cuda")
    weights = torch.rand(3, k, device="cuda")
    normed = torch.zeros(3, 5, device="cuda")
    rt.begin_forward([(0, 0, seq)])  # first use: the rows are mapped (host work only)
    assert count_syncs(lambda: rt.begin_forward([(0, 0, seq)])) == 1
    assert count_syncs(lambda: [rt.route(i, normed, ids, weights) for i in range(layers)]) == 0
    assert rt.router_weight_rows + rt.replayed_weight_rows == 3 * layers
