"""The gate lookahead's host path: the router logits without the router's
own routing (:mod:`pdflash.models.adapters._routers`) equal the router's
forward bit for bit; the next-layer lookahead's predictions and the copies
the gate lookahead submits are those of the old path (the router's whole
forward) over random hidden states and cache states; and the lookahead's
torch calls per layer stay within a bound the old path exceeds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from pdflash.bench.op_count import DispatchCounter

from pdflash.cache import ExpertCache
from pdflash.engine.prefetch import GateLookahead
from pdflash.models.adapters import base as adapter_base
from pdflash.routeahead import NextLayerLookahead

#: torch calls of one next-layer lookahead (norm 7, logits 2, softmax, top-k,
#: the scores' zeros, two views, index_add_, the read) on a CPU float32
#: target; the router's whole forward adds its top-k and softmax (and a
#: normalisation on Qwen-style routers) on top
LOOKAHEAD_CALLS = 16


@contextlib.contextmanager
def _old_router_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The router logits through the router's whole forward (the old path)."""
    with monkeypatch.context() as m:
        m.setattr(adapter_base, "router_logits_only", lambda router, x: None)
        yield


def _reference_predict_next(
    adapter: Any, k: int, layer: int, hidden: torch.Tensor
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The next-layer lookahead as it was: the router's forward for the
    logits, its softmax top-k summed per expert, ranked on the host."""
    E = adapter.num_experts
    nxt = layer + 1
    with torch.no_grad():
        logits = adapter._block(nxt).route(adapter.moe_norm(nxt, hidden))[0]
        probs = torch.softmax(logits.float(), dim=-1)
        values, ids = torch.topk(probs, min(k, E), dim=-1)
        scores = torch.zeros(E, dtype=torch.float32)
        scores.index_add_(0, ids.reshape(-1), values.reshape(-1))
        host = scores.numpy()
    order = np.argsort(-host, kind="stable")
    order = order[host[order] > 0]
    return (order + nxt * E).astype(np.int64), host[order].astype(np.float32)


def test_router_logits_equal_the_routers_forward(tiny: Any) -> None:
    adapter = tiny.adapter
    gen = torch.Generator().manual_seed(1)
    hidden = int(adapter.config.hidden_size)
    for layer in range(tiny.layers):
        block = adapter._block(layer)
        for rows in (1, 2, 7, 33):
            x = torch.randn(rows, hidden, generator=gen)
            strided = torch.randn(hidden, rows, generator=gen).t()  # not contiguous
            for normed in (x, strided, adapter.moe_norm(layer, x)):
                with torch.no_grad():
                    got = adapter.router_logits(layer, normed)
                    want = block.route(normed)[0]
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got, want)
        # the logits alone: no top-k, softmax or normalisation dispatched
        calls = DispatchCounter()
        with torch.no_grad(), calls:
            adapter.router_logits(layer, x)
        assert calls.total <= 2, calls.total  # the linear (a transpose and a matmul)


def test_router_logits_call_the_router_when_it_has_hooks(tiny: Any) -> None:
    adapter = tiny.adapter
    seen: list[int] = []
    router = adapter._block(1).router_module
    handle = router.register_forward_hook(lambda m, a, out: seen.append(int(out[0].shape[0])))
    try:
        x = torch.randn(3, int(adapter.config.hidden_size))
        with torch.no_grad():
            got = adapter.router_logits(1, x)
    finally:
        handle.remove()
    assert seen == [3]  # the hook ran: the router was called
    assert torch.equal(got, adapter._block(1).route(x)[0])


def test_router_logits_of_an_overridden_routing_use_it(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter whose ``route_tokens`` is its own (GLM-4's) routes through it."""
    adapter = tiny.adapter
    block = adapter._block(0)
    marker = torch.full((2, tiny.experts), 7.0)
    calls: list[int] = []

    def own_routing(router: Any, x: torch.Tensor) -> Any:
        calls.append(1)
        return marker, None, None

    monkeypatch.setattr(block, "route_fn", own_routing)
    got = adapter.router_logits(0, torch.randn(2, int(adapter.config.hidden_size)))
    assert calls == [1] and got is marker


def test_next_layer_lookahead_equals_the_old_path(tiny: Any) -> None:
    adapter = tiny.adapter
    look = NextLayerLookahead(adapter)
    gen = torch.Generator().manual_seed(2)
    hidden = int(adapter.config.hidden_size)
    compared = 0
    for rows in (1, 2, 5, 16, 40):
        for layer in range(tiny.layers - 1):
            x = 3 * torch.randn(rows, hidden, generator=gen)
            with torch.no_grad():
                ids, scores = look.predict_next(layer, x)
            want_ids, want_scores = _reference_predict_next(adapter, tiny.top_k, layer, x)
            assert ids.dtype == np.int64 and scores.dtype == np.float32
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(scores, want_scores)
            compared += int(ids.size)
    assert compared > 0


def _run_gate_lookahead(
    adapter: Any, issuer: Any, steps: int, seed: int
) -> tuple[list[tuple[int, Any]], npt.NDArray[np.int64], list[npt.NDArray[np.int64]]]:
    """A gate lookahead over a small cache: random hidden states per layer,
    each layer's own routing acquired on demand and released (so the cache
    state moves); returns the submitted copies (key, band), the final
    residency and every prediction."""
    cache = ExpertCache(
        adapter.store, issuer, num_slots=adapter.num_experts + 8, top_k=adapter.top_k
    )
    look = GateLookahead(adapter, cache)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    hidden = int(adapter.config.hidden_size)
    E = adapter.num_experts
    predictions: list[npt.NDArray[np.int64]] = []
    real_predict = look.predictor.predict_next

    def recorded(layer: int, x: torch.Tensor) -> Any:
        ids, scores = real_predict(layer, x)
        predictions.append(ids.copy())
        return ids, scores

    look.predictor.predict_next = recorded  # type: ignore[method-assign]
    with torch.no_grad():
        for _ in range(steps):
            for layer in range(adapter.num_layers):
                routed = layer * E + rng.choice(E, size=int(rng.integers(1, 6)), replace=False)
                cache.acquire(routed)
                cache.release(routed)
                rows = int(rng.integers(1, 5))
                look.after_layer(layer, torch.randn(rows, hidden, generator=gen), None)  # type: ignore[arg-type]
    return list(issuer.submitted), cache.slot_of.copy(), predictions


def test_gate_lookahead_submits_the_old_paths_copies(
    tiny: Any, fake_issuer_cls: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = tiny.adapter
    new = _run_gate_lookahead(adapter, fake_issuer_cls(eager=True), steps=6, seed=3)
    with _old_router_path(monkeypatch):
        old = _run_gate_lookahead(adapter, fake_issuer_cls(eager=True), steps=6, seed=3)
    assert len(new[2]) == len(old[2]) == 6 * (tiny.layers - 1)
    for got, want in zip(new[2], old[2], strict=True):
        np.testing.assert_array_equal(got, want)
    assert any(band.name == "ROUTE_AHEAD" for _, band in new[0])  # the lookahead copied
    assert new[0] == old[0]
    np.testing.assert_array_equal(new[1], old[1])


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_lookahead_torch_calls_per_layer_are_bounded(
    arch: str,
    tiny_moes: Callable[[str], Any],
    fake_issuer_cls: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One gate lookahead layer (prediction, residency, copies) costs at
    most :data:`LOOKAHEAD_CALLS` torch calls; the old path cost more."""
    adapter = tiny_moes(arch).adapter
    cache = ExpertCache(
        adapter.store, fake_issuer_cls(eager=True), num_slots=2 * adapter.num_experts, top_k=2
    )
    look = GateLookahead(adapter, cache)
    x = torch.randn(2, int(adapter.config.hidden_size))

    def calls_per_layer() -> float:
        counter = DispatchCounter()
        with torch.no_grad(), counter:
            for layer in range(adapter.num_layers - 1):
                look.after_layer(layer, x, None)  # type: ignore[arg-type]
        return counter.total / (adapter.num_layers - 1)

    calls_per_layer()  # the router shortcut's one check per class is not counted
    assert calls_per_layer() <= LOOKAHEAD_CALLS
    with _old_router_path(monkeypatch):
        assert calls_per_layer() > LOOKAHEAD_CALLS


def _reference_predict_batch(predictor: Any, blocks: list[Any]) -> npt.NDArray[np.float32]:
    """The route-ahead proxy's step as it was: the router's whole forward
    for the logits and the flat index and flat view made per layer (the
    embedding and block-attention proxies)."""
    from pdflash.routeahead.predictors import _horizon_rows, _topk_gate_scores

    adapter = predictor.adapter
    L, E = adapter.num_layers, adapter.num_experts
    counts = [_horizon_rows(b) for b in blocks]
    segments, start = [], 0
    for b, rows in zip(blocks, counts, strict=True):
        segments.append((start, b.positions[:rows]))
        start += rows
    hidden = adapter.embed(
        torch.cat([b.token_ids[:n] for b, n in zip(blocks, counts, strict=True)])
    )
    owners = torch.repeat_interleave(torch.arange(len(blocks)), torch.tensor(counts))
    out = torch.zeros(len(blocks), L, E, dtype=torch.float32)
    plan = (
        predictor._attention_plan(segments, hidden.device)
        if predictor.proxy == "block_attention"
        else None
    )
    with torch.inference_mode():
        for layer in range(L):
            if plan is not None:
                hidden = predictor._attention_residual(layer, hidden, plan)
            normed = adapter.moe_norm(layer, hidden)
            logits = adapter._block(layer).route(normed)[0]
            ids, probs = _topk_gate_scores(logits, predictor.experts_per_token, E)
            flat = (owners[:, None] * (L * E) + layer * E + ids).reshape(-1)
            out.view(-1).index_add_(0, flat, probs.reshape(-1))
    return out.numpy()


def _drafted(count: int, seed: int, length: int = 16) -> list[Any]:
    from pdflash.protocols import DraftedBlock

    gen = torch.Generator().manual_seed(seed)
    return [
        DraftedBlock(i, torch.randint(3, 128, (length,), generator=gen), torch.arange(length))
        for i in range(count)
    ]


@pytest.mark.parametrize("proxy", ["embed", "block_attention"])
def test_route_ahead_step_equals_the_old_path(tiny: Any, proxy: str) -> None:
    from pdflash.routeahead import ApproxRouterPredictor, predict_batch

    predictor = ApproxRouterPredictor(tiny.adapter, proxy=proxy)
    for count, seed in ((1, 4), (3, 5), (8, 6)):
        blocks = _drafted(count, seed)
        got = predict_batch(predictor, blocks)
        want = _reference_predict_batch(predictor, blocks)
        assert got.shape == want.shape == (count, tiny.layers, tiny.experts)
        assert (got > 0).any()
        np.testing.assert_array_equal(got, want)


#: torch calls of one route-ahead step (embedding proxy, 3 blocks) on the
#: 4-layer tiny targets: 17 per layer (norm 7, logits 2, softmax, top-k, the
#: flat index's two adds and view, the scores' view and ``index_add_``) and
#: 17 per step; the old path made the flat index and flat view per layer
#: (3 more per layer) and called the whole router
ROUTE_AHEAD_STEP_CALLS = 85


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_route_ahead_step_torch_calls_are_bounded(
    arch: str, tiny_moes: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.routeahead import ApproxRouterPredictor, predict_batch

    tiny = tiny_moes(arch)
    predictor = ApproxRouterPredictor(tiny.adapter, proxy="embed")
    blocks = _drafted(3, 7)

    def calls(fn: Callable[[], Any]) -> int:
        counter = DispatchCounter()
        with counter:
            fn()
        return counter.total

    predict_batch(predictor, blocks)  # the router shortcut's one check per class
    assert calls(lambda: predict_batch(predictor, blocks)) <= ROUTE_AHEAD_STEP_CALLS
    with _old_router_path(monkeypatch):
        old = calls(lambda: _reference_predict_batch(predictor, blocks))
    assert old > ROUTE_AHEAD_STEP_CALLS + 3 * tiny.layers


def test_a_router_class_whose_shortcut_differs_is_called_as_it_is(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call per router class checks the shortcut against the
    router (another transformers release may compute its logits otherwise);
    a class that differs is called from then on."""
    from pdflash.models.adapters import _routers

    adapter = tiny.adapter
    router = adapter._block(0).router_module
    x = torch.randn(3, int(adapter.config.hidden_size))
    monkeypatch.setattr(_routers, "_CHECKED", {})
    real = _routers._shortcut
    monkeypatch.setattr(_routers, "_shortcut", lambda r, t: real(r, t) + 1.0)
    with torch.no_grad():
        assert _routers.router_logits_only(router, x) is None
        checked = _routers._CHECKED
        assert checked == {type(router): False}
        assert _routers.router_logits_only(router, x) is None  # no second check
        assert torch.equal(adapter.router_logits(0, x), adapter._block(0).route(x)[0])
    # a class that agrees is checked once, then served by the shortcut alone
    monkeypatch.setattr(_routers, "_CHECKED", {})
    monkeypatch.setattr(_routers, "_shortcut", real)
    with torch.no_grad():
        first = _routers.router_logits_only(router, x)
        checked = _routers._CHECKED
        assert first is not None and checked == {type(router): True}
        calls = DispatchCounter()
        with calls:
            again = _routers.router_logits_only(router, x)
        assert again is not None and torch.equal(first, again)
        assert calls.total <= 2, calls.total
