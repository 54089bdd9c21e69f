"""Recorded all-resident layer calls (:mod:`pdflash.models.resident_graphs`)
on a CPU: which path a call takes and why, the token buckets and static
buffers, the bound on recordings, stale slot maps, failures falling back to
the eager path, and everything freed on close. The recorder here is the
engine's :class:`~pdflash.engine.graphs.EagerBackend` (it reruns the step on
"replay"), so the selection, buffers and books are the real ones; the CUDA
recording itself is tested in ``test_resident_graphs_gpu.py``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import resident_adapter

from pdflash.engine.graphs import EagerBackend
from pdflash.models import offload
from pdflash.models.resident_graphs import (
    ResidentGraphs,
    resident_graphs_as,
    resident_graphs_mode,
    set_resident_graphs,
)

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)


@pytest.fixture
def graphs_on() -> Iterator[None]:
    set_resident_graphs("on")
    yield
    set_resident_graphs(None)


def _eager_graphs(**kw: Any) -> ResidentGraphs:
    return ResidentGraphs(lambda _device: EagerBackend(), **kw)


def _routing(ad: Any, layer: int, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    h = torch.randn(tokens, ad.hidden_size, generator=torch.Generator().manual_seed(seed))
    x = ad.moe_norm(layer, h)
    ids, weights = ad.route(layer, x)
    return x, ids, weights


def test_setting_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        with pytest.raises(ValueError, match="resident graphs must be one of"):
            set_resident_graphs("auto")
        set_resident_graphs(None)
        monkeypatch.delenv("PDFLASH_RESIDENT_GRAPHS", raising=False)
        assert resident_graphs_mode() == "off"  # the default
        set_resident_graphs(None)
        monkeypatch.setenv("PDFLASH_RESIDENT_GRAPHS", "on")
        assert resident_graphs_mode() == "on"
        set_resident_graphs(None)
        monkeypatch.setenv("PDFLASH_RESIDENT_GRAPHS", "bogus")
        with pytest.raises(ValueError, match="PDFLASH_RESIDENT_GRAPHS must be one of"):
            resident_graphs_mode()
    finally:
        set_resident_graphs(None)
    with pytest.raises(ValueError, match="must be >= 1"):
        ResidentGraphs(max_graphs=0)


@needs_grouped
def test_off_by_default_and_not_cuda_without_a_recorder(
    tiny_checkpoints: dict[str, Path], host_issuer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDFLASH_RESIDENT_GRAPHS", raising=False)
    set_resident_graphs(None)
    ad = resident_adapter(tiny_checkpoints["qwen3_moe"], host_issuer)
    runtime = ad.runtime
    x, ids, weights = _routing(ad, 0, 8, 1)
    with torch.inference_mode():
        for _ in range(3):
            runtime.forward_routed(0, x, ids, weights)
    assert runtime.resident_graphs.last == "eager"
    assert runtime.resident_graphs.last_reason == "off"
    assert runtime.resident_graph_blocker(0, x, 8) == "off"
    set_resident_graphs("on")
    try:
        with torch.inference_mode():
            # the default recorder is CUDA graphs: a CPU call runs eagerly
            assert runtime.resident_graph_blocker(0, x, 8) == "not_cuda"
            runtime.forward_routed(0, x, ids, weights)
        assert runtime.resident_graphs.last_reason == "not_cuda"
        assert runtime.resident_graphs.num_graphs == 0
    finally:
        set_resident_graphs(None)
    ad.close()


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_replayed_calls_equal_eager_over_routings_and_token_counts(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object, graphs_on: None
) -> None:
    ad = resident_adapter(tiny_checkpoints[arch], host_issuer)
    runtime = ad.runtime
    # exact token counts: the eager call's kernels on its own shapes
    graphs = runtime.resident_graphs = _eager_graphs(token_buckets=())
    with torch.inference_mode():
        for layer in range(ad.num_layers):
            for tokens in (1, 5, 16):
                for seed in range(3):  # a new routing between replays of one recording
                    x, ids, weights = _routing(ad, layer, tokens, 100 * layer + 10 * tokens + seed)
                    set_resident_graphs("off")
                    want = runtime.forward_routed(layer, x, ids, weights)
                    set_resident_graphs("on")
                    got = runtime.forward_routed(layer, x, ids, weights)
                    assert torch.equal(got, want)
                    # first call of a key: eager (warming); later ones replay
                    assert graphs.last == ("eager" if seed == 0 else "graph")
    # one recording per (layer, token count); one bucket per token count
    assert graphs.num_graphs == ad.num_layers * 3 and graphs.num_buckets == 3
    st = graphs.stats
    assert st.captures == ad.num_layers * 3 and st.replays == ad.num_layers * 3
    assert st.validated == st.captures and st.mismatches == 0
    assert st.eager["warming"] == ad.num_layers * 3
    # the books are the eager path's: every routed id counted, nothing left pinned
    stats = ad.cache.stats()
    assert stats["misses"] == 0 and stats["hits"] > 0
    assert int(ad.cache.pins.sum()) == 0
    ad.close()
    assert graphs.num_graphs == 0 and graphs.num_buckets == 0


@needs_grouped
def test_eager_where_a_recording_cannot_serve(
    tiny_checkpoints: dict[str, Path], host_issuer: object, graphs_on: None
) -> None:
    ad = resident_adapter(tiny_checkpoints["qwen3_moe"], host_issuer)
    runtime = ad.runtime
    graphs = runtime.resident_graphs = _eager_graphs(max_tokens=8, min_uses=1)
    x, ids, weights = _routing(ad, 0, 9, 3)
    with torch.inference_mode():
        assert runtime.resident_graph_blocker(0, x, 9) == "tokens_over_max"
        assert runtime.resident_graph_blocker(0, x[:8], 8) is None
        runtime.forward_routed(0, x, ids, weights)
        assert graphs.last_reason == "tokens_over_max"
        # inside unbooked (an outer capture records the kernels): eager
        with runtime.unbooked():
            assert runtime.resident_graph_blocker(0, x[:8], 8) == "unbooked"
            runtime.forward_routed(0, x[:8], ids[:8], weights[:8])
        # no window: the layer's slots read as not all resident
        monkey = runtime._resident_window
        runtime._resident_window = lambda layer: None  # type: ignore[method-assign]
        try:
            assert runtime.resident_graph_blocker(0, x[:8], 8) == "no_resident_window"
        finally:
            runtime._resident_window = monkey  # type: ignore[method-assign]
    assert graphs.num_graphs == 0
    ad.close()


class _FailingBackend:
    name = "failing"

    def capture(self, fn: Any) -> Any:
        fn()
        raise RuntimeError("operation not permitted when stream is capturing")


class _WrongBackend(EagerBackend):
    """Replays into outputs that differ from the step's (a recording gone wrong)."""

    def capture(self, fn: Any) -> Any:
        graph, out = super().capture(fn)

        class Wrong:
            def replay(self) -> None:
                graph.replay()
                out[0].add_(1.0)

        return Wrong(), out


@needs_grouped
@pytest.mark.parametrize(
    ("backend", "reason"), [(_FailingBackend, "RuntimeError"), (_WrongBackend, "replay_mismatch")]
)
def test_a_failed_or_wrong_recording_falls_back_to_eager_for_good(
    backend: Any,
    reason: str,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    graphs_on: None,
) -> None:
    ad = resident_adapter(tiny_checkpoints["qwen3_moe"], host_issuer)
    runtime = ad.runtime
    graphs = runtime.resident_graphs = ResidentGraphs(lambda _d: backend(), min_uses=1)
    x, ids, weights = _routing(ad, 0, 6, 4)
    with torch.inference_mode():
        set_resident_graphs("off")
        want = runtime.forward_routed(0, x, ids, weights)
        set_resident_graphs("on")
        for _ in range(3):
            assert torch.equal(runtime.forward_routed(0, x, ids, weights), want)
            assert graphs.last_reason == "capture_failed"
    (why,) = graphs.failures.values()
    assert why.startswith(reason)
    assert graphs.num_graphs == 0 and graphs.num_buckets == 0  # nothing kept
    assert int(ad.cache.pins.sum()) == 0
    ad.close()


def _step(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return ((x * 2 + ids[: x.shape[0], None].to(x.dtype)) * w,)


def _run(
    graphs: ResidentGraphs, key: Any, tokens: int, slots: np.ndarray, seed: int = 0
) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 4, generator=gen)
    ids = torch.randint(0, 8, (tokens * 2,), generator=gen)
    w = torch.rand(tokens, 1, generator=gen)
    out = graphs.run(key, (tokens,), slots, x, ids, w, lambda: (_step, ()))
    if out is not None:
        assert torch.equal(out, _step(x, ids, w)[0])
    return out


def test_recordings_are_bounded_least_recently_used_first() -> None:
    graphs = _eager_graphs(max_graphs=2, min_uses=1)
    slots = np.arange(4)
    for layer in range(3):
        assert _run(graphs, ("L", layer), 4, slots) is not None
    assert graphs.num_graphs == 2 and graphs.stats.evictions == 1
    _run(graphs, ("L", 1), 4, slots)  # layer 1 used last: layer 2 goes next
    _run(graphs, ("L", 0), 4, slots)
    assert set(graphs._recorded) == {("L", 0), ("L", 1)}
    # buckets (static buffers and pool) go with their last recording
    _run(graphs, ("L", 3), 6, slots)
    _run(graphs, ("L", 4), 6, slots)
    assert graphs.num_buckets == 1 and graphs.num_graphs == 2


def test_a_recording_made_with_other_slots_is_dropped() -> None:
    graphs = _eager_graphs(min_uses=2)
    slots = np.arange(4)
    assert _run(graphs, "k", 3, slots) is None and graphs.last_reason == "warming"
    assert _run(graphs, "k", 3, slots, seed=1) is not None
    assert _run(graphs, "k", 3, slots, seed=2) is not None and graphs.stats.replays == 1
    moved = slots[::-1].copy()
    assert _run(graphs, "k", 3, moved) is None  # dropped, warming again
    assert graphs.stats.stale == 1 and graphs.num_graphs == 0
    assert _run(graphs, "k", 3, moved) is not None and graphs.stats.captures == 2


def test_close_frees_recordings_pools_and_buffers() -> None:
    graphs = _eager_graphs(min_uses=1)
    _run(graphs, "a", 3, np.arange(4))
    (rec,) = graphs._recorded.values()
    refs = [weakref.ref(t) for t in (rec.out, rec.bucket.x, rec.bucket.ids, rec.bucket.weights)]
    backend = weakref.ref(rec.bucket.backend)
    del rec
    graphs.close()
    gc.collect()
    assert graphs.num_graphs == 0 and graphs.num_buckets == 0
    assert all(r() is None for r in refs) and backend() is None


@needs_grouped
def test_adapter_close_and_a_new_cache_free_the_recordings(
    tiny_checkpoints: dict[str, Path], host_issuer: object, graphs_on: None
) -> None:
    ad = resident_adapter(tiny_checkpoints["qwen3_moe"], host_issuer)
    runtime = ad.runtime
    graphs = runtime.resident_graphs = _eager_graphs(min_uses=1)
    x, ids, weights = _routing(ad, 0, 4, 5)
    with torch.inference_mode():
        runtime.forward_routed(0, x, ids, weights)
    assert graphs.last == "graph" and graphs.num_graphs == 1
    ad.detach_cache()
    assert graphs.num_graphs == 0
    ad.close()


@needs_grouped
def test_autograd_runs_eagerly_and_inference_mode_has_its_own_buffers(
    tiny_checkpoints: dict[str, Path], host_issuer: object, graphs_on: None
) -> None:
    ad = resident_adapter(tiny_checkpoints["qwen3_moe"], host_issuer)
    runtime = ad.runtime
    graphs = runtime.resident_graphs = _eager_graphs(min_uses=1)
    with torch.no_grad():
        x, ids, weights = _routing(ad, 0, 4, 6)
    assert runtime.resident_graph_blocker(0, x, 4) == "grad_enabled"
    runtime.forward_routed(0, x, ids, weights)
    assert graphs.last_reason == "grad_enabled" and graphs.num_graphs == 0
    outs = []
    for ctx in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with ctx():
            outs.append(runtime.forward_routed(0, x, ids, weights))
            assert graphs.last == "graph"
    # a buffer made under inference mode would refuse the no_grad call's copy
    assert graphs.num_graphs == 2 and graphs.num_buckets == 2
    assert all(torch.equal(o, outs[0]) for o in outs)
    ad.close()


def test_token_buckets() -> None:
    graphs = _eager_graphs(token_buckets=(4, 16, 64), max_tokens=32)
    assert [graphs.padded_tokens(t) for t in (1, 4, 5, 16, 17, 40)] == [4, 4, 16, 16, 17, 40]
    exact = _eager_graphs(token_buckets=())
    assert [exact.padded_tokens(t) for t in (1, 5, 17)] == [1, 5, 17]
    assert _eager_graphs().padded_tokens(37) == 40  # the defaults
    for bad in ((4, 2), (0, 4), (4, 4)):
        with pytest.raises(ValueError, match="token_buckets"):
            _eager_graphs(token_buckets=bad)
        with pytest.raises(ValueError, match="token_buckets"):
            graphs.token_buckets = bad
    assert graphs.token_buckets == (4, 16, 64)  # unchanged by the refused values
    graphs.token_buckets = None
    assert graphs.padded_tokens(5) == 5
    with pytest.raises(ValueError, match="tokens 2 < the call's 3 rows"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 4, generator=gen)
        exact.run(
            "k",
            (2,),
            np.arange(4),
            x,
            torch.zeros(6, dtype=torch.int64),
            x[:, :1],
            lambda: (_step, ()),
            2,
        )


def _padded(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, size: int) -> tuple[Any, ...]:
    """A call's inputs padded as the recorder pads them: zero rows of input
    and weight, each routed to the first token's experts."""
    pad = size - x.shape[0]
    return (
        torch.cat([x, x.new_zeros(pad, x.shape[1])]),
        torch.cat([ids, ids[:1].expand(pad, -1)]),
        torch.cat([w, w.new_zeros(pad, w.shape[1])]),
    )


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_padded_calls_share_a_recording_and_keep_their_real_rows(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object, graphs_on: None
) -> None:
    """5, 6, 7 and 8 tokens run one recording of 8: each replay equals the
    eager call over the padded inputs bit for bit and its real rows the
    unpadded eager call's within fp32 rounding (the CPU's grouped MLP is not
    row-independent: a longer group may round differently); the padding
    rows read zeros after a call with more real rows, and the cache's books
    count the real rows only."""
    ad = resident_adapter(tiny_checkpoints[arch], host_issuer)
    runtime = ad.runtime
    graphs = runtime.resident_graphs = _eager_graphs()
    with torch.inference_mode():
        for i, tokens in enumerate((7, 5, 8, 6, 7, 5)):
            x, ids, weights = _routing(ad, 1, tokens, 40 + i)
            set_resident_graphs("off")
            hits = ad.cache.stats()["hits"]
            want = runtime.forward_routed(1, x, ids, weights)
            eager_hits = ad.cache.stats()["hits"] - hits
            want_padded = runtime.forward_routed(1, *_padded(x, ids, weights, 8))
            hits = ad.cache.stats()["hits"]
            set_resident_graphs("on")
            got = runtime.forward_routed(1, x, ids, weights)
            assert ad.cache.stats()["hits"] - hits == eager_hits  # the books: the call's own
            assert graphs.last == ("eager" if i == 0 else "graph"), graphs.last_reason
            assert got.shape == want.shape
            assert torch.equal(got, want_padded[:tokens]), (tokens, i)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if i > 0:  # the bucket's static inputs: the call's rows, then padding
                (rec,) = graphs._recorded.values()
                b, k = rec.bucket, ids.shape[1]
                assert torch.equal(b.x[:tokens], x) and not b.x[tokens:].any()
                assert not b.weights[tokens:].any()
                assert torch.equal(b.ids[tokens * k :].view(-1, k), ids[:1].expand(8 - tokens, k))
    assert graphs.num_graphs == 1 and graphs.num_buckets == 1
    st = graphs.stats
    assert st.captures == 1 and st.replays == 4 and st.eager["warming"] == 1
    assert st.mismatches == 0 and len(st.keys) == 1
    assert int(ad.cache.pins.sum()) == 0
    ad.close()


def test_resident_graphs_as_sets_the_switch_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDFLASH_RESIDENT_GRAPHS", "on")
    set_resident_graphs(None)
    try:
        with resident_graphs_as("off"):
            assert resident_graphs_mode() == "off"
        # back to unset: the environment's setting again
        monkeypatch.setenv("PDFLASH_RESIDENT_GRAPHS", "off")
        assert resident_graphs_mode() == "off"
        set_resident_graphs("on")
        with pytest.raises(RuntimeError, match="boom"), resident_graphs_as("off"):
            assert resident_graphs_mode() == "off"
            raise RuntimeError("boom")
        assert resident_graphs_mode() == "on"
        with (
            pytest.raises(ValueError, match="resident graphs must be one of"),
            resident_graphs_as("auto"),
        ):
            pass
        assert resident_graphs_mode() == "on"
    finally:
        set_resident_graphs(None)
