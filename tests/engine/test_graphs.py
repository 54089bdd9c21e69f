"""The CUDA-graph runner's machinery on the CPU (pdflash.engine.graphs): the
eager stand-in backend runs the same bucketing, padding, static buffers,
cache books and fallbacks the CUDA backend does, so a padded bucketed
forward must give the eager forward's tokens and (fp32) logits."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.drafter import load_drafter
from pdflash.engine.engine import Engine
from pdflash.engine.graphs import (
    PIECEWISE_REASONS,
    BucketKey,
    EagerBackend,
    GraphRunner,
    Outputs,
    Replayable,
    gc_paused,
    key_buckets,
)
from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for

from .conftest import write_target_and_drafter


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(f"graphs_{request.param}")
    write_target_and_drafter(tmp, request.param, 3)
    return tmp


def _adapter(tmp: Path, slots: int = 1 << 20, layer_cyclic: bool = False) -> tuple[Any, Any]:
    """The offloaded adapter on the CPU with a cache of ``slots`` (default:
    every expert resident, B3); ``layer_cyclic``: the bench's eviction policy
    (its ``before_layer`` becomes the runner's before-MoE hook)."""
    from pdflash.cache import ExpertCache
    from pdflash.cache.eviction import LayerCyclicPolicy
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    issuer = H2DIssuer(backend="host")
    adapter = load_adapter(tmp / "target", device="cpu")
    policy = LayerCyclicPolicy(adapter.num_layers, adapter.num_experts) if layer_cyclic else None
    cache = ExpertCache(
        adapter.store, issuer, device="cpu", num_slots=slots, top_k=adapter.top_k, policy=policy
    )
    adapter.attach_cache(cache)
    if slots >= adapter.num_layers * adapter.num_experts:
        ids = np.arange(adapter.num_layers * adapter.num_experts)
        cache.wait_ready(cache.prefetch(ids))
    return adapter, issuer


@pytest.fixture
def stack(checkpoint: Path) -> Iterator[Callable[..., Any]]:
    issuers: list[Any] = []

    def make(slots: int = 1 << 20) -> Any:
        adapter, issuer = _adapter(checkpoint, slots)
        issuers.append(issuer)
        return adapter

    yield make
    for issuer in issuers:
        issuer.close()


def _runner(adapter: Any, graphs: GraphRunner | None) -> TargetRunner:
    kv = kv_cache_for(
        adapter, page_size=4, num_pages=64, dtype=torch.float32, device="cpu", scratch=True
    )
    runner = TargetRunner(adapter, kv, capture_layers=(0, 2))
    runner.graphs = graphs
    return runner


def _prompts(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def _prefill(runner: TargetRunner, prompts: list[torch.Tensor]) -> None:
    for i, p in enumerate(prompts):
        runner.kv.add_sequence(i)
        runner.forward([Chunk(i, p, False)])


def _verify(runner: TargetRunner, blocks: list[torch.Tensor]) -> Any:
    return runner.forward([Chunk(i, b, True) for i, b in enumerate(blocks)])


def _assert_same_forward(ref: Any, out: Any) -> None:
    """A graphed forward's logits (and their argmax), captured features and
    routing grid equal the eager one's (fp32)."""
    for a, b in zip(ref.logits, out.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(ref.features, out.features, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.routed, ref.routed)


# -- decisions ------------------------------------------------------------------------------


def test_key_buckets_are_aligned_growing_and_bounded() -> None:
    widths = key_buckets(4096)
    assert widths[:6] == (64, 128, 192, 256, 384, 512)
    assert widths[-1] == 4096
    assert all(w % 16 == 0 for w in widths)
    assert all(b / a <= 2 for a, b in itertools.pairwise(widths))


@pytest.mark.parametrize("enabled_before", [True, False])
def test_gc_paused_turns_the_collector_off_and_back_as_it_was(enabled_before: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled_before else gc.disable)()
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled_before
        with pytest.raises(RuntimeError, match="inside"), gc_paused():
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()


def test_overlapping_gc_pauses_keep_the_collector_off_until_the_last_ends() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        first, second = gc_paused(), gc_paused()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)  # the first ends while the second runs
        assert not gc.isenabled()
        second.__exit__(None, None, None)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_bucket_pads_requests_rows_and_keys() -> None:
    from pdflash.engine.target import StepPlan

    g = GraphRunner(EagerBackend(), request_buckets=(1, 2, 4, 8))
    plan = StepPlan(starts=[0, 0, 0], lens=[5, 3, 5], total=13)
    plan.k_slots = [list(range(70)), list(range(10)), list(range(40))]
    assert g.bucket(plan) == BucketKey(4, 8, 128)  # 71 columns with the sink -> 128
    plan.k_slots[0] = list(range(63))
    assert g.bucket(plan) == BucketKey(4, 8, 64)
    plan.lens = [1] * 9
    plan.k_slots = [[0]] * 9
    assert g.bucket(plan) == "too_many_requests"
    plan.lens, plan.k_slots = [65], [[0]]
    assert g.bucket(plan) == "too_many_tokens_per_request"
    with pytest.raises(ValueError, match="ascending"):
        GraphRunner(EagerBackend(), request_buckets=(4, 2))


# -- padded, bucketed forwards equal the eager forward ---------------------------------------


@pytest.mark.parametrize(
    ("prompt_lens", "block_lens"),
    [
        ([6, 6, 6], [4, 4, 4]),  # 3 requests -> 4, uniform blocks
        ([5, 9], [3, 5]),  # uneven blocks -> 8 rows per request
        ([60], [6]),  # 66 keys: past the first key bucket (64 with the sink)
        ([58], [4]),  # 62 keys, then 66: the step after crosses into the next bucket
    ],
)
def test_graphed_forward_equals_eager(
    stack: Callable[..., Any], prompt_lens: list[int], block_lens: list[int]
) -> None:
    eager_ad, graph_ad = stack(), stack()
    backend = EagerBackend()
    graphs = GraphRunner(backend)
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    vocab = eager_ad.vocab_size
    prompts = _prompts(prompt_lens, vocab, seed=1)
    _prefill(eager, prompts)
    _prefill(graphed, prompts)
    assert graphs.stats.fallbacks["prefill"] == len(prompts)
    for step in range(3):
        blocks = _prompts(block_lens, vocab, seed=10 + step)
        ref, out = _verify(eager, blocks), _verify(graphed, blocks)
        _assert_same_forward(ref, out)
        for a, b in zip(ref.needed_flat, out.needed_flat, strict=True):
            np.testing.assert_array_equal(a, b)
    assert graphs.stats.replays == 3 and graphs.stats.captures >= 1
    # the real slots hold the same K/V; the null slot stays zero
    kv_e, kv_g = eager.kv, graphed.kv
    for layer in range(kv_e.num_layers):
        n = kv_e.null_slot
        torch.testing.assert_close(kv_g.k[layer][:n], kv_e.k[layer][:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv_g.v[layer][:n], kv_e.v[layer][:n], rtol=1e-5, atol=1e-5)
        assert not kv_g.k[layer][n].any() and not kv_g.v[layer][n].any()
    # the expert cache saw the same accesses, and nothing stays pinned
    se, sg = eager_ad.cache.stats(), graph_ad.cache.stats()
    assert sg["hits"] == se["hits"] and sg["misses"] == se["misses"] == 0
    assert int(np.asarray(graph_ad.cache.pins).sum()) == 0


def test_buffers_are_reused_and_each_bucket_captured_once(stack: Callable[..., Any]) -> None:
    adapter = stack()
    backend = EagerBackend()
    graphs = GraphRunner(backend)
    runner = _runner(adapter, graphs)
    vocab = adapter.vocab_size
    _prefill(runner, _prompts([7, 7], vocab, seed=2))
    _verify(runner, _prompts([4, 4], vocab, seed=3))
    (entry,) = graphs._entries.values()
    ptrs = (entry.packed.data_ptr(), entry.ids.data_ptr(), *(t.data_ptr() for t in entry.outputs))
    calls = backend.calls
    assert calls == 3  # warm-up, capture, the first replay
    out = _verify(runner, _prompts([4, 4], vocab, seed=4))
    assert backend.calls == calls + 1  # one replay, no new capture
    assert graphs.stats.captures == 1 and graphs.stats.replays == 2
    assert list(graphs._entries.values()) == [entry]
    again = (entry.packed.data_ptr(), entry.ids.data_ptr(), *(t.data_ptr() for t in entry.outputs))
    assert again == ptrs
    # what left the step does not alias the static outputs (the next replay overwrites them)
    x_static = entry.outputs[0]
    for f in out.features:
        assert f.untyped_storage().data_ptr() != x_static.untyped_storage().data_ptr()
    # a new request count is a new bucket (2 -> 1 request)
    runner.kv.free(1)
    _verify(runner, _prompts([4], vocab, seed=5))
    assert graphs.stats.captures == 2 and graphs.num_graphs == 2


# -- fallbacks -------------------------------------------------------------------------------


class _FailingBackend:
    name = "failing"

    def __init__(self) -> None:
        self.tries = 0

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        self.tries += 1
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_falls_back_eager_and_is_not_retried(stack: Callable[..., Any]) -> None:
    eager_ad, graph_ad = stack(), stack()
    backend = _FailingBackend()
    graphs = GraphRunner(backend)
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    prompts = _prompts([5, 5], eager_ad.vocab_size, seed=6)
    _prefill(eager, prompts)
    _prefill(graphed, prompts)
    for step in range(2):
        blocks = _prompts([3, 3], eager_ad.vocab_size, seed=20 + step)
        ref, out = _verify(eager, blocks), _verify(graphed, blocks)
        for a, b in zip(ref.logits, out.logits, strict=True):
            assert torch.equal(a, b)  # the eager path itself
    assert backend.tries == 1
    assert graphs.stats.capture_failures == 1 and graphs.stats.fallbacks["capture_failed"] == 2
    assert graphs.stats.replays == 0 and graphs.num_graphs == 0
    assert "stream is capturing" in next(iter(graphs.failures.values()))
    assert int(np.asarray(graph_ad.cache.pins).sum()) == 0


class _WrongReplayBackend(EagerBackend):
    """Replays that leave wrong values in the outputs (as a graph that read
    a stale buffer would)."""

    name = "wrong"

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        replay, out = super().capture(fn)

        class Wrong:
            def replay(self) -> None:
                replay.replay()
                for t in out:
                    if t.is_floating_point():
                        t.add_(1.0)

        return Wrong(), out


def test_first_replay_checked_against_eager(stack: Callable[..., Any]) -> None:
    eager_ad, graph_ad = stack(), stack()
    graphs = GraphRunner(_WrongReplayBackend())
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    prompts = _prompts([5, 5], eager_ad.vocab_size, seed=40)
    _prefill(eager, prompts)
    _prefill(graphed, prompts)
    for step in range(2):
        blocks = _prompts([3, 3], eager_ad.vocab_size, seed=41 + step)
        ref, out = _verify(eager, blocks), _verify(graphed, blocks)
        for a, b in zip(ref.logits, out.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # the eager run's
    s = graphs.stats
    assert s.validated == 1 and s.replay_mismatches == 1 and graphs.num_graphs == 0
    assert s.fallbacks["replay_mismatch"] == 1  # the second step: the bucket runs eagerly
    assert int(np.asarray(graph_ad.cache.pins).sum()) == 0
    # without validation the wrong replay would have gone through
    unchecked = GraphRunner(_WrongReplayBackend(), validate=False)
    graphed.graphs = unchecked
    blocks = _prompts([3, 3], eager_ad.vocab_size, seed=50)
    ref, out = _verify(eager, blocks), _verify(graphed, blocks)
    assert not torch.allclose(out.logits[0], ref.logits[0])
    assert unchecked.stats.validated == 0 and unchecked.stats.replays == 1


def test_hooks_offloaded_layers_and_graph_limit(stack: Callable[..., Any]) -> None:
    adapter = stack()
    graphs = GraphRunner(EagerBackend(), max_graphs=1, piecewise=False)
    runner = _runner(adapter, graphs)
    vocab = adapter.vocab_size
    _prefill(runner, _prompts([5, 5], vocab, seed=7))
    seen: list[int] = []
    runner.routed_hooks.append(lambda layer, ids, x: seen.append(layer))
    _verify(runner, _prompts([2, 2], vocab, seed=8))
    assert graphs.stats.fallbacks["layer_hooks"] == 1 and seen  # the hook ran (eagerly)
    runner.routed_hooks.clear()
    # host-only hooks before each MoE layer: called in layer order around the replay
    before: list[int] = []
    runner.before_moe_hooks.append(before.append)
    _verify(runner, _prompts([2, 2], vocab, seed=9))  # captured: the one graph allowed
    assert graphs.stats.replays == 1 and before == list(range(adapter.num_layers))
    runner.kv.free(1)
    _verify(runner, _prompts([2], vocab, seed=10))  # another bucket: the first makes room
    assert graphs.stats.evicted == 1 and graphs.num_graphs == 1
    assert graphs.stats.captures == 2 and graphs.stats.replays == 2

    offloaded = stack(slots=adapter.num_experts * 2)  # fewer slots than experts
    graphs2 = GraphRunner(EagerBackend(), piecewise=False)
    runner2 = _runner(offloaded, graphs2)
    _prefill(runner2, _prompts([5], vocab, seed=11))
    _verify(runner2, _prompts([3], vocab, seed=12))
    assert graphs2.stats.fallbacks["experts_not_resident"] == 1 and graphs2.num_graphs == 0


def test_kv_without_scratch_row_runs_eagerly(stack: Callable[..., Any]) -> None:
    adapter = stack(slots=10)  # offloaded: would be piecewise
    graphs = GraphRunner(EagerBackend())
    kv = kv_cache_for(adapter, page_size=4, num_pages=32, dtype=torch.float32, device="cpu")
    runner = TargetRunner(adapter, kv)
    runner.graphs = graphs
    _prefill(runner, _prompts([5], adapter.vocab_size, seed=80))
    _verify(runner, _prompts([3], adapter.vocab_size, seed=81))
    assert graphs.stats.fallbacks["kv_without_scratch_slot"] == 1
    assert graphs.stats.piecewise_steps == 0 and graphs.stats.captures == 0


def test_slot_table_change_recaptures(stack: Callable[..., Any]) -> None:
    adapter = stack()
    graphs = GraphRunner(EagerBackend())
    runner = _runner(adapter, graphs)
    vocab = adapter.vocab_size
    _prefill(runner, _prompts([5], vocab, seed=13))
    _verify(runner, _prompts([3], vocab, seed=14))
    cache = adapter.cache
    cache._table_dirty = True  # as after a load or an eviction: the table is uploaded anew
    _verify(runner, _prompts([3], vocab, seed=15))
    assert graphs.stats.recaptures == 1 and graphs.stats.captures == 2
    assert graphs.stats.replays == 2


# -- piecewise: dense parts replayed, experts and hooks eager ------------------------------


def test_layer_spans() -> None:
    from pdflash.engine.graphs import layer_spans

    assert layer_spans([0, 1, 2]) == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
    # leading dense layers join the first piece; a dense tail is its own piece
    assert layer_spans([None, None, 0, 1, None]) == [(0, 2, 0), (3, 3, 1), (4, 4, None)]


@pytest.mark.parametrize(
    ("prompt_lens", "block_lens"), [([6, 6, 6], [4, 4, 4]), ([5, 9], [3, 5]), ([58], [4])]
)
def test_piecewise_forward_equals_eager_with_offloaded_experts(
    stack: Callable[..., Any], prompt_lens: list[int], block_lens: list[int]
) -> None:
    """Fewer slots than experts: the experts run eagerly between replayed
    pieces on the real rows only (copies, evictions and books as eager),
    with a routed hook and an observer seeing the real rows."""
    eager_ad = stack(slots=10)
    graph_ad = stack(slots=10)
    graphs = GraphRunner(EagerBackend())
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    seen: dict[str, list[tuple[int, int]]] = {"eager": [], "graphed": []}
    for name, runner in (("eager", eager), ("graphed", graphed)):
        log = seen[name]
        runner.routed_hooks.append(lambda layer, ids, x, log=log: log.append((layer, x.shape[0])))

        class Obs:
            def __init__(self, log: list[tuple[int, int]]) -> None:
                self.log = log

            def after_layer(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor) -> None:
                self.log.append((layer, int(ids.shape[0])))

        runner.observers.append(Obs(log))
    vocab = eager_ad.vocab_size
    prompts = _prompts(prompt_lens, vocab, seed=60)
    _prefill(eager, prompts)
    _prefill(graphed, prompts)
    for step in range(3):
        blocks = _prompts(block_lens, vocab, seed=61 + step)
        ref, out = _verify(eager, blocks), _verify(graphed, blocks)
        _assert_same_forward(ref, out)
    assert seen["graphed"] == seen["eager"] and seen["eager"]
    s = graphs.stats
    assert s.piecewise_steps == 3 and s.replays == 0
    assert s.captures >= eager_ad.num_layers and s.validated == s.captures
    se, sg = eager_ad.cache.stats(), graph_ad.cache.stats()
    for name in ("hits", "misses", "evictions"):
        assert sg[name] == se[name], name
    assert se["misses"] > 0  # offloading really happened
    assert int(np.asarray(graph_ad.cache.pins).sum()) == 0


def test_piecewise_capture_failure_finishes_the_step_eagerly(stack: Callable[..., Any]) -> None:
    eager_ad, graph_ad = stack(slots=10), stack(slots=10)
    graphs = GraphRunner(_FailingBackend())
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    prompts = _prompts([5, 5], eager_ad.vocab_size, seed=70)
    _prefill(eager, prompts)
    _prefill(graphed, prompts)
    for step in range(2):
        blocks = _prompts([3, 3], eager_ad.vocab_size, seed=71 + step)
        ref, out = _verify(eager, blocks), _verify(graphed, blocks)
        for a, b in zip(ref.logits, out.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    s = graphs.stats
    assert s.capture_failures == 1 and s.piecewise_steps == 0
    assert s.fallbacks["capture_failed"] == 2


# -- the drafter --------------------------------------------------------------------------


def test_draft_capture_failure_runs_eagerly_and_is_not_retried(checkpoint: Path) -> None:
    from pdflash.engine.drafter import DraftItem

    eager_d = load_drafter(checkpoint / "drafter")
    graph_d = load_drafter(checkpoint / "drafter")
    backend = _FailingBackend()
    graphs = GraphRunner(backend)
    kvs = [
        d.new_kv_cache(num_pages=16, page_size=4, device="cpu", dtype=torch.float32, scratch=True)
        for d in (eager_d, graph_d)
    ]
    for kv in kvs:
        kv.add_sequence(0)
    feat = len(eager_d.target_layer_ids) * eager_d.cfg.hidden_size
    gen = torch.Generator().manual_seed(31)
    for _ in range(2):
        items = [DraftItem(0, 3, 4)]
        ctx = torch.randn(3, feat, generator=gen)
        emb = torch.randn(4, eager_d.cfg.hidden_size, generator=gen)
        ref = eager_d.forward_blocks(ctx, emb, items, kvs[0])
        out = graph_d.forward_blocks(ctx, emb, items, kvs[1], graphs=graphs)
        assert torch.equal(out, ref)  # the eager path itself
    ds = graphs.draft_stats
    assert backend.tries == 1 and ds.capture_failures == 1 and ds.captures == 0
    assert ds.fallbacks["capture_failed"] == 2  # the failed step, then the bucket's next
    assert ds.replays == 0 and graphs.num_draft_graphs == 0
    assert "stream is capturing" in next(iter(graphs.failures.values()))


def test_graphed_draft_forward_equals_eager(checkpoint: Path) -> None:
    from pdflash.engine.drafter import DraftItem

    eager_d = load_drafter(checkpoint / "drafter")
    graph_d = load_drafter(checkpoint / "drafter")
    graphs = GraphRunner(EagerBackend())
    kvs = [
        d.new_kv_cache(num_pages=64, page_size=4, device="cpu", dtype=torch.float32, scratch=True)
        for d in (eager_d, graph_d)
    ]
    feat = len(eager_d.target_layer_ids) * eager_d.cfg.hidden_size
    hidden = eager_d.cfg.hidden_size
    for kv in kvs:
        for i in range(3):
            kv.add_sequence(i)
    gen = torch.Generator().manual_seed(30)
    rounds = [
        [(0, 9, 4), (1, 5, 4), (2, 3, 4)],  # prompts' features, 3 requests -> 4
        [(0, 2, 4), (1, 0, 4), (2, 4, 4)],  # a request with no new context
        [(0, 1, 3), (2, 3, 2)],  # uneven blocks, 2 requests
        [(0, 40, 4)],  # 40 new context rows: the next context bucket, keys past 64
    ]
    for items_spec in rounds:
        items = [DraftItem(s, c, b) for s, c, b in items_spec]
        ctx = torch.randn(sum(c for _, c, _ in items_spec), feat, generator=gen)
        emb = torch.randn(sum(b for _, _, b in items_spec), hidden, generator=gen)
        ref = eager_d.forward_blocks(ctx, emb, items, kvs[0])
        out = graph_d.forward_blocks(ctx, emb, items, kvs[1], graphs=graphs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for s, _, _ in items_spec:
            assert kvs[0].length(s) == kvs[1].length(s)
    n = kvs[0].null_slot
    for layer in range(kvs[0].num_layers):
        torch.testing.assert_close(kvs[1].k[layer][:n], kvs[0].k[layer][:n], rtol=1e-5, atol=1e-5)
        assert not kvs[1].k[layer][n].any() and not kvs[1].v[layer][n].any()
    ds = graphs.draft_stats
    assert ds.replays == len(rounds) and ds.captures == len(graphs._draft_entries) >= 3
    assert graphs.stats.replays == 0  # the target's counters are separate
    # a cache without the scratch row: eager, counted
    plain = eager_d.new_kv_cache(num_pages=8, page_size=4, device="cpu", dtype=torch.float32)
    plain.add_sequence(0)
    graph_d.forward_blocks(
        torch.randn(2, feat, generator=gen),
        torch.randn(3, hidden, generator=gen),
        [DraftItem(0, 2, 3)],
        plain,
        graphs=graphs,
    )
    assert ds.fallbacks["kv_without_scratch_slot"] == 1


# -- the engine ------------------------------------------------------------------------------


def test_engine_greedy_tokens_equal_with_and_without_graphs(checkpoint: Path) -> None:
    outputs = []
    stats = None
    for graphs in (None, GraphRunner(EagerBackend())):
        # the bench's eviction policy: a before-MoE hook, called around each replay
        adapter, issuer = _adapter(checkpoint, layer_cyclic=True)
        try:
            eng = Engine(
                adapter,
                EngineConfig.preset("B3", block_size=4, max_running=3, token_budget=12),
                drafter=load_drafter(checkpoint / "drafter"),
                expert_cache=adapter.cache,
                max_seq_len=64,
                graphs=graphs,
            )
            prompts = _prompts([3, 8, 5], adapter.vocab_size, seed=21)
            ids = [eng.add_request(p.tolist(), max_new_tokens=12) for p in prompts]
            done = eng.run_until_done(max_steps=200)
            outputs.append([done[i].output for i in ids])
            assert eng.kv.used_pages == 0
            assert int(np.asarray(adapter.cache.pins).sum()) == 0
            if graphs is not None:
                stats = graphs.stats
        finally:
            issuer.close()
    assert outputs[0] == outputs[1]
    assert stats is not None and stats.replays > 0 and stats.captures >= 1
    assert graphs is not None and graphs.draft_stats.replays > 0
    assert set(stats.fallbacks) <= {"prefill"}, stats.fallbacks


@pytest.mark.parametrize("baseline", ["B0", "B1"])
def test_engine_offloaded_tokens_equal_with_piecewise_graphs(
    checkpoint: Path, baseline: str
) -> None:
    """Offloaded baselines (gate lookahead observers, a layer-cyclic cache
    smaller than the model): piecewise steps, the same greedy tokens."""
    outputs = []
    runners = []
    for graphs in (None, GraphRunner(EagerBackend())):
        adapter, issuer = _adapter(checkpoint, slots=10, layer_cyclic=True)
        try:
            config = EngineConfig.preset(baseline, max_running=3, token_budget=12)
            if config.speculative:
                config = config.replace(block_size=4)
            eng = Engine(
                adapter,
                config,
                drafter=load_drafter(checkpoint / "drafter"),
                expert_cache=adapter.cache,
                max_seq_len=64,
                graphs=graphs,
            )
            assert eng.runner.observers  # the gate lookahead
            prompts = _prompts([3, 8, 5], adapter.vocab_size, seed=22)
            ids = [eng.add_request(p.tolist(), max_new_tokens=10) for p in prompts]
            done = eng.run_until_done(max_steps=300)
            outputs.append([done[i].output for i in ids])
            assert eng.kv.used_pages == 0
            assert int(np.asarray(adapter.cache.pins).sum()) == 0
            assert adapter.cache.stats()["misses"] > 0
            runners.append(graphs)
        finally:
            issuer.close()
    assert outputs[0] == outputs[1]
    graphs = runners[1]
    assert graphs is not None and graphs.stats.piecewise_steps > 0
    assert graphs.stats.replays == 0


def test_cuda_graphs_setting_is_validated_and_off_on_cpu(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig.preset("B3", cuda_graphs="on")
    assert EngineConfig().cuda_graphs == "auto"  # whole-step and drafter graphs on CUDA
    for setting in ("off", "auto", "piecewise"):
        assert EngineConfig.preset("B1", cuda_graphs=setting).cuda_graphs == setting
    adapter, issuer = _adapter(checkpoint)
    try:
        eng = Engine(
            adapter,
            EngineConfig.preset("B3", block_size=4, cuda_graphs="auto"),
            drafter=load_drafter(checkpoint / "drafter"),
            expert_cache=adapter.cache,
            max_seq_len=32,
        )
        assert eng.runner.graphs is None and eng.kv.scratch_slot is None
    finally:
        issuer.close()


def test_grouped_gemm_capturable_only_with_a_native_cuda_kernel() -> None:
    """torch's CUDA grouped GEMM is native in bf16 only; in other dtypes its
    fallback copies the offsets to the host, which a capture refuses, so
    such steps go piecewise (experts eager) instead of failing a capture."""
    from pdflash.models.offload import grouped_mm_capturable

    cuda = torch.device("cuda")
    assert grouped_mm_capturable(cuda, torch.bfloat16)
    assert not grouped_mm_capturable(cuda, torch.float32)
    assert not grouped_mm_capturable(cuda, torch.float16)
    assert grouped_mm_capturable(torch.device("cpu"), torch.float32)
    assert "grouped_mm_fallback" in PIECEWISE_REASONS


# -- pre-capture -------------------------------------------------------------------------------


def test_verify_buckets_cover_what_a_full_width_run_can_meet() -> None:
    graphs = GraphRunner(EagerBackend())
    keys = graphs.verify_buckets(
        max_requests=10, max_tokens=6, min_prompt_len=30, min_seq_len=60, max_seq_len=200
    )
    assert len(keys) == len(set(keys))
    full = [k for k in keys if k.queries == 8]
    tail = [k for k in keys if k.queries < 8]
    assert keys[: len(full)] == full  # the full row bucket first
    # requests 1..10 -> buckets 1, 2, 4, 8, 12, largest first; keys 31..199 -> 64..256
    assert [k.requests for k in full[::4]] == [12, 8, 4, 2, 1]
    assert sorted({k.key_width for k in full}) == [64, 128, 192, 256]
    # a smaller row bucket only holds requests in their last block: keys >= 59
    assert sorted({k.key_width for k in tail}) == [64, 128, 192, 256]
    assert {k.queries for k in tail} == {1, 2, 4}
    narrow = graphs.verify_buckets(
        max_requests=3, max_tokens=4, min_prompt_len=3, min_seq_len=150, max_seq_len=180
    )
    assert {k.key_width for k in narrow if k.queries == 4} == {64, 128, 192}
    assert {k.key_width for k in narrow if k.queries < 4} == {192}
    # a width policy trims blocks anywhere: every row bucket takes every key width
    trimmed = graphs.verify_buckets(
        max_requests=3,
        max_tokens=4,
        min_prompt_len=3,
        min_seq_len=150,
        max_seq_len=180,
        full_width=False,
    )
    assert {k.key_width for k in trimmed if k.queries == 1} == {64, 128, 192}
    # every bucket found is one a step of those bounds falls in
    for k in keys:
        assert k.requests in graphs.request_buckets and k.key_width in graphs.key_widths
    # the drafter's: every context bucket from the fewest requests' rows to
    # the most requests' prompts (first drafts) or blocks
    drafts = graphs.draft_buckets(
        max_requests=3,
        max_tokens=4,
        min_prompt_len=3,
        max_prompt_len=20,
        min_seq_len=150,
        max_seq_len=180,
        features=8,
        dtype=torch.float32,
    )
    assert len(drafts) == len(set(drafts))
    full4 = {k.context for k in drafts if k.queries == 4 and k.requests == 4}
    assert full4 == {16, 32, 64, 128}  # 3..4 requests x up to 20 prompt rows
    # smaller blocks are last blocks: a block of context rows each at most
    assert {k.context for k in drafts if k.queries < 4} == {16}
    assert {(k.features, k.dtype) for k in drafts} == {(8, "torch.float32")}
    with pytest.raises(ValueError, match="min_prompt_len < min_seq_len"):
        graphs.verify_buckets(
            max_requests=1, max_tokens=4, min_prompt_len=9, min_seq_len=9, max_seq_len=20
        )


def _engine(checkpoint: Path, graphs: GraphRunner | None, **kw: Any) -> tuple[Engine, Any]:
    adapter, issuer = _adapter(checkpoint, layer_cyclic=True)
    eng = Engine(
        adapter,
        EngineConfig.preset("B3", block_size=4, max_running=3, token_budget=12, **kw),
        drafter=load_drafter(checkpoint / "drafter"),
        expert_cache=adapter.cache,
        max_seq_len=64,
        graphs=graphs,
    )
    return eng, issuer


def test_prepared_graphs_leave_no_capture_to_the_run_and_change_no_output(
    checkpoint: Path,
) -> None:
    lengths, new = [3, 8, 5, 6], 12
    outputs = []
    graphs = GraphRunner(EagerBackend())
    for runner in (None, graphs):
        eng, issuer = _engine(checkpoint, runner)
        try:
            if runner is not None:
                report = eng.prepare_graphs(
                    3,
                    max(lengths) + new,
                    min_prompt_len=min(lengths),
                    min_seq_len=3 + new,
                    max_prompt_len=max(lengths),
                )
                assert report["state"] == "on" and report["failed"] == 0
                assert report["prepared"] == graphs.num_graphs == graphs.stats.prepared > 0
                assert graphs.stats.captures == graphs.stats.validated == report["prepared"]
                drafts = report["draft"]
                assert drafts["failed"] == 0 and drafts["skipped"] == {}
                assert drafts["prepared"] == graphs.num_draft_graphs == drafts["buckets"] > 0
                assert graphs.draft_stats.validated == drafts["prepared"]
                assert eng.draft_kv is not None and eng.draft_kv.num_sequences == 0
                # nothing of the synthetic steps stays in the KV or the cache's pins
                assert eng.kv.used_pages == 0 and eng.kv.num_sequences == 0
                assert int(np.asarray(eng.adapter.cache.pins).sum()) == 0
                again = eng.prepare_graphs(
                    3,
                    max(lengths) + new,
                    min_prompt_len=min(lengths),
                    min_seq_len=3 + new,
                    max_prompt_len=max(lengths),
                )
                assert again["prepared"] == 0 and again["already_held"] == report["prepared"]
                assert again["draft"]["already_held"] == drafts["prepared"]
                eng.reset_stats()
            prompts = _prompts(lengths, eng.adapter.vocab_size, seed=23)
            ids = [eng.add_request(p.tolist(), max_new_tokens=new) for p in prompts]
            done = eng.run_until_done(max_steps=300)
            outputs.append([done[i].output for i in ids])
            assert eng.kv.used_pages == 0
        finally:
            issuer.close()
    assert outputs[0] == outputs[1]
    stats = graphs.stats
    # every verify replayed a prepared graph: no capture, no check in the run
    assert stats.replays > 0 and stats.captures == 0 and stats.validated == 0
    assert set(stats.fallbacks) <= {"prefill"}, stats.fallbacks
    ds = graphs.draft_stats  # and every draft step
    assert ds.replays > 0 and ds.captures == 0 and ds.validated == 0 and not ds.fallbacks


def test_prepare_graphs_bounds_and_refusals(checkpoint: Path) -> None:
    graphs = GraphRunner(EagerBackend(), max_graphs=3)
    eng, issuer = _engine(checkpoint, graphs)
    try:
        with pytest.raises(ValueError, match="max_running"):
            eng.prepare_graphs(4)
        with pytest.raises(ValueError, match="max_seq_len"):
            eng.prepare_graphs(3, 65)
        assert graphs.num_graphs == 0
        report = eng.prepare_graphs(3, 40, min_prompt_len=2, limit=2)
        assert report["prepared"] == 2 == graphs.num_graphs
        assert report["skipped"]["graph_limit"] == report["buckets"] - 2
        # the byte bound: one more bucket's estimate does not fit
        report = eng.prepare_graphs(3, 40, min_prompt_len=2, max_bytes=report["bytes"])
        assert report["prepared"] == 0 and report["skipped"]["memory"] >= 1
        eng.add_request([1, 2, 3], max_new_tokens=2)
        with pytest.raises(RuntimeError, match="no live request"):
            eng.prepare_graphs()
    finally:
        issuer.close()
    off, issuer = _engine(checkpoint, None)
    try:
        assert off.prepare_graphs() == {"state": "off", "why": "not a CUDA device"}
    finally:
        issuer.close()


def test_prepare_stops_where_no_whole_step_graph_runs(stack: Callable[..., Any]) -> None:
    adapter = stack(slots=10)  # offloaded: not every expert resident
    graphs = GraphRunner(EagerBackend(), piecewise=False)
    runner = _runner(adapter, graphs)
    keys = graphs.verify_buckets(
        max_requests=2, max_tokens=4, min_prompt_len=3, min_seq_len=8, max_seq_len=20
    )
    report = graphs.prepare(runner, keys)
    assert report["blocker"] == "experts_not_resident" and report["prepared"] == 0
    assert report["prepared_piecewise"] == 0
    assert graphs.num_graphs == 0 and runner.kv.num_sequences == 0


def test_the_default_piecewise_bound_covers_a_four_request_run() -> None:
    """The 30 buckets a c=4 run of 16-token blocks, 16-token prompts and 64
    new tokens can meet at any verify width all fit the default bound, so
    its pre-capture leaves no piece to the clock."""
    graphs = GraphRunner(EagerBackend())
    keys = graphs.verify_buckets(
        max_requests=4,
        max_tokens=16,
        min_prompt_len=16,
        min_seq_len=80,
        max_seq_len=80,
        full_width=False,
    )
    assert len(keys) == 30
    assert len(keys) <= graphs.max_piecewise_buckets


def test_prepared_pieces_leave_no_capture_to_the_steps_and_book_nothing(
    stack: Callable[..., Any],
) -> None:
    """With piecewise on, an offloaded bucket's pieces are recorded and
    checked before any request (no copy, no cache book, no KV left); the
    steps that fall in a prepared bucket replay them with no capture or
    check of their own, and give the eager forward's outputs."""
    eager_ad, graph_ad = stack(slots=10), stack(slots=10)
    graphs = GraphRunner(EagerBackend(), max_piecewise_buckets=4)
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    keys = graphs.verify_buckets(
        max_requests=2, max_tokens=4, min_prompt_len=3, min_seq_len=8, max_seq_len=20
    )
    before = graph_ad.cache.stats()
    report = graphs.prepare(graphed, keys)
    assert "blocker" not in report and report["prepared"] == 0 and report["failed"] == 0
    assert report["prepared_piecewise"] == 4 == report["piecewise_buckets_held"]
    assert report["skipped"]["piecewise_limit"] == len(keys) - 4
    from pdflash.engine.graphs import layer_spans

    pieces = len(layer_spans(graphed.plan_layers))
    assert graphs.stats.captures == graphs.stats.validated == 4 * pieces
    assert graphed.kv.num_sequences == 0 and graphed.kv.used_pages == 0
    after = graph_ad.cache.stats()
    for name in ("hits", "misses", "evictions"):
        assert after[name] == before[name], name
    assert int(np.asarray(graph_ad.cache.pins).sum()) == 0
    again = graphs.prepare(graphed, keys[:4])
    assert again["already_held"] == 4 and again["prepared_piecewise"] == 0
    # steps in the prepared buckets: replayed pieces, nothing recorded or checked
    graphs.reset_stats()
    prompts = _prompts([3, 3], eager_ad.vocab_size, seed=90)
    _prefill(eager, prompts)
    _prefill(graphed, prompts)
    # two requests of 2 rows over fewer than 64 keys: the bucket (2, 2, 64)
    assert BucketKey(2, 2, 64) in keys[:4]
    for step in range(2):
        blocks = _prompts([2, 2], eager_ad.vocab_size, seed=91 + step)
        _assert_same_forward(_verify(eager, blocks), _verify(graphed, blocks))
    s = graphs.stats
    assert s.piecewise_steps == 2 and s.captures == 0 and s.validated == 0


def test_fill_of_the_same_token_counts_rewrites_only_the_real_rows(stack: Any) -> None:
    """A bucket's fill keeps the padding and the fields of its row layout
    when the token counts are those of its last fill: every step's host
    index values equal a fill into a fresh buffer, whatever the order of
    layouts (same counts twice, other counts, then back)."""
    adapter = stack()
    graphs = GraphRunner(EagerBackend())
    runner = _runner(adapter, graphs)
    _prefill(runner, _prompts([5, 9, 3], adapter.vocab_size, seed=11))
    kv = runner.kv
    gen = torch.Generator().manual_seed(12)
    held = None
    for lens in ([4, 4, 4], [4, 4, 4], [3, 4, 2], [4, 4, 4], [1, 4, 4], [1, 4, 4]):
        chunks = [
            Chunk(i, torch.randint(0, adapter.vocab_size, (n,), generator=gen), True)
            for i, n in enumerate(lens)
        ]
        plan = runner.plan(chunks, lists=False)
        key = graphs.bucket(plan)
        assert isinstance(key, BucketKey)
        if held is None:
            held = graphs._new_entry(runner, key)
        assert held.key == key
        graphs._fill(runner, held, chunks, plan)
        fresh = graphs._new_entry(runner, key)
        fresh.host.array[:] = -7  # whatever a new buffer holds
        graphs._fill(runner, fresh, chunks, plan)
        np.testing.assert_array_equal(held.host.array, fresh.host.array)
        assert torch.equal(held.packed, fresh.packed)
        # padded rows' token ids are whatever an earlier step left (dropped rows)
        real = held.layout.view(held.packed, "real_rows")[: plan.total]
        assert torch.equal(held.ids[real], fresh.ids[real])
        graphs._entries[key] = held
        for c, n in zip(chunks, lens, strict=True):
            kv.truncate(c.seq_id, kv.length(c.seq_id) - n)


def test_replayed_routing_is_the_callers_own(stack: Any) -> None:
    """A replayed step's routing grid on the host is a copy: the next replay
    of the bucket (which overwrites the static grid) leaves it unchanged."""
    adapter = stack()
    graphs = GraphRunner(EagerBackend())
    runner = _runner(adapter, graphs)
    _prefill(runner, _prompts([6, 6], adapter.vocab_size, seed=13))
    first = _verify(runner, _prompts([4, 4], adapter.vocab_size, seed=14))
    kept = first.routed.copy()
    for i in range(2):
        runner.kv.truncate(i, runner.kv.length(i) - 4)
    second = _verify(runner, _prompts([4, 4], adapter.vocab_size, seed=15))
    assert graphs.stats.replays == 2
    assert not np.shares_memory(first.routed, second.routed)
    np.testing.assert_array_equal(first.routed, kept)
