"""CUDA graphs of the target forward on a GPU (skipped without one): captured
and replayed steps against the eager forward (fp32: same tokens, logits
within 1e-4; bf16: logits within BF16_TOL of their scale, greedy tokens equal
wherever the eager top-2 margin exceeds it), shape changes across buckets,
the engine's greedy output with graphs on and off, and the eager fallbacks
(offloaded experts; a capture that fails)."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.drafter import load_drafter, write_synthetic_drafter
from pdflash.engine.engine import Engine
from pdflash.engine.graphs import CudaGraphBackend, GraphRunner
from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for

from .conftest import greedy_reference

pytestmark = pytest.mark.gpu

#: bf16: max |graphed - eager| <= BF16_TOL * (1 + max |eager|) per request's
#: logits (padding changes GEMM shapes, so cuBLAS may sum in another order)
BF16_TOL = 5e-2


def _bf16_bound(ref: torch.Tensor) -> float:
    return BF16_TOL * (1.0 + float(ref.float().abs().max()))


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _checkpoint(tmp: Path, arch: str, dtype: torch.dtype) -> Path:
    from pdflash.models import write_synthetic_checkpoint

    path = tmp / f"{arch}_{str(dtype).split('.')[-1]}"
    if not (path / "config.json").exists():
        write_synthetic_checkpoint(path, arch, "tiny", num_layers=3, dtype=dtype, seed=3)
    return path


@pytest.fixture
def make_adapter(tmp_path: Path) -> Iterator[Any]:
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    issuers: list[Any] = []

    def make(arch: str, dtype: torch.dtype, resident: bool = True) -> Any:
        path = _checkpoint(tmp_path, arch, dtype)
        issuer = H2DIssuer(backend="cuda")
        issuers.append(issuer)
        slots = 1 << 20 if resident else 6  # the cache clamps to every expert
        adapter = load_adapter(
            path, device="cuda", issuer=issuer, cache_slots=slots, max_batch_tokens=1
        )
        if resident:
            ids = np.arange(adapter.num_layers * adapter.num_experts)
            tickets = adapter.cache.prefetch(ids)
            issuer.wait(tickets[tickets >= 0])
        return adapter

    yield make
    torch.cuda.synchronize()
    for issuer in issuers:
        issuer.close()


def _runner(adapter: Any, graphs: GraphRunner | None) -> TargetRunner:
    kv = kv_cache_for(
        adapter, page_size=16, num_pages=64, dtype=adapter.dtype, device="cuda", scratch=True
    )
    runner = TargetRunner(adapter, kv, capture_layers=(0, 2), device="cuda")
    runner.graphs = graphs
    return runner


def _tokens(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).cuda() for n in lengths]


def _steps(eager: TargetRunner, graphed: TargetRunner, vocab: int) -> list[tuple[Any, Any]]:
    """Prefill 3 requests (58 tokens: the verifies' keys cross 64), then
    verify 3, 2 and 1 of them (three request buckets; keys 62 -> 66 -> ...)."""
    prompts = _tokens([58, 20, 9], vocab, seed=1)
    for runner in (eager, graphed):
        for i, p in enumerate(prompts):
            runner.kv.add_sequence(i)
            runner.forward([Chunk(i, p, False)])
    pairs = []
    for step, (n_req, width) in enumerate([(3, 4), (3, 4), (2, 7), (1, 16), (1, 16)]):
        blocks = _tokens([width] * n_req, vocab, seed=10 + step)
        outs = []
        for runner in (eager, graphed):
            outs.append(runner.forward([Chunk(i, b, True) for i, b in enumerate(blocks)]))
        pairs.append((outs[0], outs[1]))
    return pairs


def test_replayed_steps_equal_eager_fp32(make_adapter: Any, arch: str) -> None:
    """fp32: torch's grouped GEMM has no native CUDA kernel (its fallback
    reads the offsets on the host), so each step runs piecewise: attention
    and router replayed, the experts eager between them."""
    eager_ad, graph_ad = make_adapter(arch, torch.float32), make_adapter(arch, torch.float32)
    graphs = GraphRunner(CudaGraphBackend("cuda"))
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    for ref, out in _steps(eager, graphed, eager_ad.vocab_size):
        for a, b in zip(ref.logits, out.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for a, b in zip(ref.features, out.features, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(out.routed, ref.routed)
    s = graphs.stats
    assert s.capture_failures == 0 and s.replay_mismatches == 0, graphs.failures
    assert s.validated == s.captures  # every new graph's first replay checked against eager
    assert s.replays == 0 and s.piecewise_steps == 5 and s.captures >= 3
    assert int(np.asarray(graph_ad.cache.pins).sum()) == 0
    assert graph_ad.cache.stats()["hits"] == eager_ad.cache.stats()["hits"]


def test_replayed_steps_bf16_within_tolerance(make_adapter: Any, arch: str) -> None:
    eager_ad, graph_ad = make_adapter(arch, torch.bfloat16), make_adapter(arch, torch.bfloat16)
    graphs = GraphRunner(CudaGraphBackend("cuda"))
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    for ref, out in _steps(eager, graphed, eager_ad.vocab_size):
        for a, b in zip(ref.logits, out.logits, strict=True):
            bound = _bf16_bound(a)
            # the logits are bf16 (lm_head's dtype): compared in fp32, as before
            assert float((b.float() - a.float()).abs().max()) <= bound
            # greedy tokens equal wherever the eager top-2 margin exceeds the bound twice
            top2 = a.float().topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
            assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
    assert graphs.stats.capture_failures == 0, graphs.failures
    assert graphs.stats.replay_mismatches == 0, graphs.failures
    assert graphs.stats.replays == 5


def test_replayed_step_reads_its_routing_without_an_implicit_sync(
    make_adapter: Any, arch: str
) -> None:
    """A replayed whole step (bf16: the grouped GEMM is capturable) makes
    no implicit host sync: its routing grid comes back through an
    asynchronous copy into page-locked memory queued right behind the
    replay, waited for on an event (not counted by torch's sync debug
    mode); the grid equals the eager forward's."""
    from pdflash.bench.eager_host import count_syncs

    eager_ad, graph_ad = make_adapter(arch, torch.bfloat16), make_adapter(arch, torch.bfloat16)
    graphs = GraphRunner(CudaGraphBackend("cuda"))
    eager, graphed = _runner(eager_ad, None), _runner(graph_ad, graphs)
    prompts = _tokens([20, 20], eager_ad.vocab_size, seed=1)
    for runner in (eager, graphed):
        for i, p in enumerate(prompts):
            runner.kv.add_sequence(i)
            runner.forward([Chunk(i, p, False)])
    outs: list[Any] = []
    for step in range(2):  # the first step captures and checks the bucket's graph
        blocks = _tokens([4, 4], eager_ad.vocab_size, seed=10 + step)
        ref = eager.forward([Chunk(i, b, True) for i, b in enumerate(blocks)])
        chunks = [Chunk(i, b, True) for i, b in enumerate(blocks)]
        syncs = count_syncs(lambda c=chunks: outs.append(graphed.forward(c)))
        np.testing.assert_array_equal(outs[-1].routed, ref.routed)
    assert graphs.stats.replays == 2 and graphs.stats.captures == 1, graphs.failures
    assert syncs == 0


def test_engine_greedy_tokens_equal_with_graphs(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    path = _checkpoint(tmp_path, arch, torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    write_synthetic_drafter(tmp_path / "d", cfg, "tiny", seed=4, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [5, 17, 3, 99, 42, 8]
    expect = greedy_reference(ref, prompt, 12)
    outputs = {}
    for setting in ("off", "auto", "piecewise"):
        issuer = H2DIssuer(backend="cuda")
        try:
            # the bench's eviction policy (a before-MoE hook the replay calls)
            adapter = load_adapter(
                path,
                device="cuda",
                issuer=issuer,
                cache_slots=1 << 20,
                max_batch_tokens=1,
                policy="layer_cyclic",
            )
            eng = Engine(
                adapter,
                EngineConfig.preset("B3", block_size=5, max_running=3, cuda_graphs=setting),
                drafter=load_drafter(tmp_path / "d", device="cuda"),
                expert_cache=adapter.cache,
                max_seq_len=48,
                device="cuda",
            )
            rids = [eng.add_request(prompt, max_new_tokens=12) for _ in range(3)]
            done = eng.run_until_done(max_steps=200)
            outputs[setting] = [done[r].output for r in rids]
            assert int(np.asarray(adapter.cache.pins).sum()) == 0
            if setting != "off":
                graphs = eng.runner.graphs
                assert graphs is not None and graphs.stats.capture_failures == 0, (
                    graphs.failures if graphs is not None else None
                )
                # fp32 has no whole-step graph (see test_replayed_steps_equal_eager_fp32):
                # auto runs the verifies eagerly, piecewise as pieces
                if setting == "piecewise":
                    assert graphs.stats.piecewise_steps > 0
                else:
                    assert graphs.stats.piecewise_steps == 0
                    assert graphs.stats.fallbacks["grouped_mm_fallback"] > 0
                ds = graphs.draft_stats
                assert ds.capture_failures == 0 and ds.replays > 0, graphs.failures
            else:
                assert eng.runner.graphs is None
        finally:
            torch.cuda.synchronize()
            issuer.close()
    assert outputs["off"] == outputs["auto"] == outputs["piecewise"] == [expect] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_draft_steps_equal_eager(tmp_path: Path, dtype: torch.dtype) -> None:
    from pdflash.engine.drafter import DraftItem

    path = _checkpoint(tmp_path, "qwen3_moe", torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    write_synthetic_drafter(tmp_path / "d", cfg, "tiny", seed=4, dtype=torch.float32)
    eager_d = load_drafter(tmp_path / "d", device="cuda", dtype=dtype)
    graph_d = load_drafter(tmp_path / "d", device="cuda", dtype=dtype)
    graphs = GraphRunner(CudaGraphBackend("cuda"))
    kvs = [
        d.new_kv_cache(num_pages=64, page_size=16, device="cuda", dtype=dtype, scratch=True)
        for d in (eager_d, graph_d)
    ]
    for kv in kvs:
        for i in range(3):
            kv.add_sequence(i)
    feat = len(eager_d.target_layer_ids) * eager_d.cfg.hidden_size
    gen = torch.Generator().manual_seed(30)
    fp32 = dtype == torch.float32
    rounds = [
        [(0, 9, 4), (1, 5, 4), (2, 3, 4)],
        [(0, 2, 4), (1, 0, 4), (2, 4, 4)],
        [(0, 2, 4), (1, 3, 4), (2, 1, 4)],  # the first round's bucket again: a replay
        [(0, 1, 3), (2, 3, 2)],
        [(0, 60, 4)],
    ]
    for spec in rounds:
        items = [DraftItem(s, c, b) for s, c, b in spec]
        ctx = torch.randn(sum(c for _, c, _ in spec), feat, generator=gen).to("cuda", dtype)
        emb = torch.randn(sum(b for _, _, b in spec), eager_d.cfg.hidden_size, generator=gen)
        emb = emb.to("cuda", dtype)
        ref = eager_d.forward_blocks(ctx, emb, items, kvs[0])
        out = graph_d.forward_blocks(ctx, emb, items, kvs[1], graphs=graphs)
        if fp32:
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        else:
            assert float((out.float() - ref.float()).abs().max()) <= _bf16_bound(ref)
    ds = graphs.draft_stats
    assert ds.capture_failures == 0 and ds.replay_mismatches == 0, graphs.failures
    assert ds.replays == len(rounds) and ds.captures < len(rounds)


def _assert_offloaded_steps_agree(eager: TargetRunner, graphed: TargetRunner, vocab: int) -> None:
    """fp32 steps of an offloaded model: the graphed runner's logits within
    1e-4 of eager's, the same greedy tokens and the same routing."""
    for ref, out in _steps(eager, graphed, vocab):
        for a, b in zip(ref.logits, out.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        np.testing.assert_array_equal(out.routed, ref.routed)


@pytest.mark.parametrize("piecewise", [False, True])
def test_offloaded_experts_piecewise_or_eager(make_adapter: Any, piecewise: bool) -> None:
    """Fewer slots than experts: without pieces every step runs eagerly;
    with them the attention and router of each layer are replayed and the
    experts (copies, host syncs) run eagerly between them."""
    eager_ad = make_adapter("qwen3_moe", torch.float32, resident=False)
    offloaded = make_adapter("qwen3_moe", torch.float32, resident=False)
    graphs = GraphRunner(CudaGraphBackend("cuda"), piecewise=piecewise)
    eager, graphed = _runner(eager_ad, None), _runner(offloaded, graphs)
    _assert_offloaded_steps_agree(eager, graphed, eager_ad.vocab_size)
    s = graphs.stats
    assert s.replays == 0
    if piecewise:
        assert s.capture_failures == 0 and s.replay_mismatches == 0, graphs.failures
        assert s.piecewise_steps == 5 and s.validated == s.captures > 0
    else:
        assert s.fallbacks["experts_not_resident"] == 5 and s.captures == 0
    assert offloaded.cache.stats()["misses"] == eager_ad.cache.stats()["misses"] > 0
    assert int(np.asarray(offloaded.cache.pins).sum()) == 0


def test_prepared_pieces_on_cuda_leave_no_capture_to_the_steps(make_adapter: Any) -> None:
    """Offloaded experts, piecewise on: GraphRunner.prepare records and
    checks the pieces of every bucket the steps below meet (CUDA graphs,
    synthetic steps, nothing copied), so the steps replay them with no
    capture of their own and give the eager forward's outputs."""
    eager_ad = make_adapter("qwen3_moe", torch.float32, resident=False)
    offloaded = make_adapter("qwen3_moe", torch.float32, resident=False)
    graphs = GraphRunner(CudaGraphBackend("cuda"), max_piecewise_buckets=32)
    eager, graphed = _runner(eager_ad, None), _runner(offloaded, graphs)
    keys = graphs.verify_buckets(
        max_requests=3, max_tokens=16, min_prompt_len=9, min_seq_len=9 + 16, max_seq_len=58 + 80
    )
    misses = offloaded.cache.stats()["misses"]
    report = graphs.prepare(graphed, keys)
    assert report["failed"] == 0 and report["prepared_piecewise"] > 0, (report, graphs.failures)
    assert offloaded.cache.stats()["misses"] == misses and graphed.kv.num_sequences == 0
    graphs.reset_stats()
    _assert_offloaded_steps_agree(eager, graphed, eager_ad.vocab_size)
    s = graphs.stats
    assert s.piecewise_steps == 5 and s.captures == 0 and s.validated == 0, s
    assert int(np.asarray(offloaded.cache.pins).sum()) == 0


def test_failed_capture_falls_back_and_cuda_stays_usable(
    make_adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host sync inside the step makes the capture fail; the step runs
    eagerly, the bucket is not retried, and later work on the device runs."""
    adapter = make_adapter("qwen3_moe", torch.float32)
    eager_ad = make_adapter("qwen3_moe", torch.float32)
    graphs = GraphRunner(CudaGraphBackend("cuda"))
    graphed, eager = _runner(adapter, graphs), _runner(eager_ad, None)
    embed = adapter.embed

    def syncing_embed(ids: torch.Tensor) -> torch.Tensor:
        out = embed(ids)
        _ = float(out.sum())  # a host sync: not capturable
        return out

    monkeypatch.setattr(adapter, "embed", syncing_embed)
    for ref, out in _steps(eager, graphed, adapter.vocab_size):
        for a, b in zip(ref.logits, out.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert graphs.stats.capture_failures >= 1 and graphs.stats.replays == 0
    assert graphs.stats.fallbacks["capture_failed"] >= 2  # the same bucket again: not retried
    assert int(np.asarray(adapter.cache.pins).sum()) == 0
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum()) == 2048.0


def test_prepared_graphs_leave_no_capture_to_the_run(tmp_path: Path, arch: str) -> None:
    """bf16 B3 (whole-step graphs): Engine.prepare_graphs records and checks
    every verify and draft bucket of the run before it, so its steps replay
    without a capture or a first-replay check; fp32 has no whole-step graph
    and the pre-capture says why."""
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    for dtype in (torch.bfloat16, torch.float32):
        path = _checkpoint(tmp_path, arch, dtype)
        cfg = json.loads((path / "config.json").read_text())
        draft = tmp_path / f"d_{str(dtype).split('.')[-1]}"
        write_synthetic_drafter(draft, cfg, "tiny", seed=4, dtype=dtype)
        issuer = H2DIssuer(backend="cuda")
        try:
            adapter = load_adapter(
                path, device="cuda", issuer=issuer, cache_slots=1 << 20, max_batch_tokens=1
            )
            eng = Engine(
                adapter,
                EngineConfig.preset("B3", block_size=5, max_running=3),
                drafter=load_drafter(draft, device="cuda", dtype=dtype),
                expert_cache=adapter.cache,
                max_seq_len=48,
                device="cuda",
            )
            report = eng.prepare_graphs(
                3, 6 + 12, min_prompt_len=6, min_seq_len=18, max_prompt_len=6
            )
            graphs = eng.runner.graphs
            assert graphs is not None
            if dtype == torch.float32:
                assert report["blocker"] == "grouped_mm_fallback" and report["prepared"] == 0
                continue
            assert report["failed"] == 0 and report["prepared"] == graphs.num_graphs > 0, (
                report,
                graphs.failures,
            )
            eng.reset_stats()
            prompt = [5, 17, 3, 99, 42, 8]
            rids = [eng.add_request(prompt, max_new_tokens=12) for _ in range(3)]
            eng.run_until_done(max_steps=200)
            assert all(eng.request(r).error is None for r in rids)
            s = graphs.stats
            assert s.replays > 0 and s.captures == 0 and s.validated == 0, s
            assert set(s.fallbacks) <= {"prefill"}, s.fallbacks
            ds = graphs.draft_stats
            assert report["draft"]["failed"] == 0 and report["draft"]["prepared"] > 0
            assert ds.replays > 0 and ds.captures == 0 and ds.validated == 0, ds
        finally:
            torch.cuda.synchronize()
            issuer.close()


class _Holder:
    """Garbage in a reference cycle: only the collector frees it."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.me = self


def test_capture_defers_collecting_dead_graphs_until_it_ends() -> None:
    """An earlier graph that becomes cyclic garbage during a capture is not
    destroyed there (CUDA forbids it: the capture is invalidated) though the
    capture's allocations, at a collector threshold of 1, would collect it:
    the collector is paused for the capture; the garbage is collected
    afterwards and the new graph replays."""
    backend = CudaGraphBackend("cuda")
    x = torch.arange(16.0, device="cuda")
    old, _ = backend.capture(lambda: (x * 2,))
    keep = [_Holder(old)]
    dead = weakref.ref(keep[0])
    del old
    collector_on: list[bool] = []
    threshold = gc.get_threshold()

    def step() -> tuple[torch.Tensor, ...]:
        collector_on.append(gc.isenabled())
        if len(collector_on) == 2:  # the capture (the first call is the warm-up)
            keep.clear()  # the earlier graph's holder is cyclic garbage from here
            gc.set_threshold(1)
            _ = [[i] for i in range(1000)]  # allocations the collector would act on
        return (x + 1,)

    try:
        graph, (out,) = backend.capture(step)
    finally:
        gc.set_threshold(*threshold)
    assert collector_on == [True, False]
    assert gc.isenabled()
    gc.collect()
    assert dead() is None
    x.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 2.0))
