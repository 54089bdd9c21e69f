"""Every layer's router over one hidden state in one batched product
(``MoEAdapterBase.router_logits_all``, ``StackedRouters``): the per-layer
norm and router calls' logits, and the route-ahead proxy's scores with it
equal to the per-layer loop's; None (the loop) wherever the arithmetic is
not known."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdflash.protocols import DraftedBlock
from pdflash.routeahead import ApproxRouterPredictor

STACKED = ("qwen3_moe", "gpt_oss")  # the norm classes StackedRouters repeats


def _hidden(adapter: Any, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, adapter.hidden_size, generator=gen).to(adapter.dtype)


def _per_layer(adapter: Any, hidden: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [adapter.router_logits(m, adapter.moe_norm(m, hidden)) for m in range(adapter.num_layers)]
    )


def test_router_logits_all_equals_each_layers_norm_and_router(tiny: Any) -> None:
    adapter = tiny.adapter
    hidden = _hidden(adapter, 7, seed=1)
    with torch.inference_mode():
        want = _per_layer(adapter, hidden)  # also checks the router class's shortcut
        got = adapter.router_logits_all(hidden)
    if tiny.arch not in STACKED:
        assert got is None  # its norm class is called as a module: the per-layer loop
        return
    assert got is not None and got.shape == (tiny.layers, 7, tiny.experts)
    assert got.dtype == want.dtype
    # the same products summed in a batched kernel's order: equal up to rounding
    torch.testing.assert_close(got, want)


def test_the_proxy_scores_are_the_per_layer_loops(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = tiny.adapter
    blocks = [
        DraftedBlock(r, tiny.tokens(1, 16, seed=r)[0], torch.arange(16), horizon=h)
        for r, h in ((0, None), (1, 9), (2, 16))
    ]
    predictor = ApproxRouterPredictor(adapter, proxy="embed")
    with torch.inference_mode():
        _per_layer(adapter, _hidden(adapter, 2, seed=0))  # the router classes checked
    stacked = predictor.predict_batch(blocks)
    monkeypatch.setattr(type(adapter), "router_logits_all", lambda self, hidden: None)
    looped = predictor.predict_batch(blocks)
    assert stacked.shape == looped.shape == (3, tiny.layers, tiny.experts)
    np.testing.assert_allclose(stacked, looped, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stacked > 0, looped > 0)


@pytest.mark.parametrize("arch", STACKED)
def test_a_router_with_a_hook_or_custom_routing_is_called_per_layer(
    arch: str, tiny_moes: Any
) -> None:
    adapter = tiny_moes(arch).adapter
    hidden = _hidden(adapter, 3, seed=2)
    with torch.inference_mode():
        _per_layer(adapter, hidden)
    assert adapter.router_logits_all(hidden) is not None  # built: the conditions below undo it
    block = adapter.blocks[1]
    handle = block.router_module.register_forward_hook(lambda *_: None)
    try:
        assert adapter.router_logits_all(hidden) is None
    finally:
        handle.remove()
    route_fn = block.route_fn
    block.route_fn = lambda normed: route_fn(normed)  # an override of the routing
    try:
        assert adapter.router_logits_all(hidden) is None
    finally:
        block.route_fn = route_fn
    assert adapter.router_logits_all(hidden) is not None


@pytest.mark.parametrize("arch", STACKED)
def test_a_router_weight_changed_after_stacking_is_stacked_again(arch: str, tiny_moes: Any) -> None:
    adapter = tiny_moes(arch).adapter
    hidden = _hidden(adapter, 5, seed=3)
    router = adapter.blocks[0].router_module
    saved = router.weight.detach().clone()
    with torch.inference_mode():
        _per_layer(adapter, hidden)
        assert adapter.router_logits_all(hidden) is not None
    try:
        with torch.no_grad():
            router.weight.mul_(-1.0)  # in place: the stacked copy is stale
        with torch.inference_mode():
            torch.testing.assert_close(
                adapter.router_logits_all(hidden), _per_layer(adapter, hidden)
            )
    finally:
        with torch.no_grad():
            router.weight.copy_(saved)
