"""Issue 14 items 3-4 on the trained cpu-tiny pair: prompts from real text,
experts padded to a published size, and trace replay of routing and
acceptance in the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash import traces as tf

MAX_NEW = 20
PROMPT_LEN = 16


@pytest.fixture(scope="module")
def trace_path(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    from pdflash.bench.proxy.export import export_trace

    out = tmp_path_factory.mktemp("replay") / "trace.npz"
    export_trace(
        trained_target[0],
        trained_drafter[0],
        out,
        num_prompts=2,
        prompt_len=PROMPT_LEN,
        max_new_tokens=MAX_NEW,
        device="cpu",
        log=lambda _m: None,
    )
    return out


def _spec(target: Path, drafter: Path, **kw: Any) -> Any:
    from pdflash.bench.engine_run import RunSpec

    base: dict[str, Any] = dict(
        arch="proxy",
        baseline="B1",
        weights=str(target),
        draft=str(drafter),
        device="cpu",
        concurrency=2,
        num_requests=2,
        prompt_len=PROMPT_LEN,
        max_new_tokens=MAX_NEW,
        block_size=8,
        cache_fraction=0.5,
        acceptance="model",
    )
    base.update(kw)
    return RunSpec(**base)


# ---------------------------------------------------------------- prompts


def test_prompts_from_a_text_file_and_the_heldout_split(
    trained_target: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from pdflash.bench.proxy.target import heldout_prompts
    from pdflash.bench.realtext import load_prompts
    from tokenizers import Tokenizer

    target = trained_target[0]
    text = (
        "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n"
    )
    (tmp_path / "p.txt").write_text(text * 4)
    got = load_prompts(str(tmp_path / "p.txt"), [8, 12], 512, str(target))
    ids = Tokenizer.from_file(str(target / "tokenizer.json")).encode(text * 4).ids
    assert got.prompts == [ids[:8], ids[8:20]]
    assert "p.txt" in got.source and got.trace_requests is None
    # a run and its warm-up read one file version: it is tokenized once,
    # and again once the file changes
    from pdflash.bench import realtext

    misses = realtext._text_tokens.cache_info().misses
    again = load_prompts(str(tmp_path / "p.txt"), [8, 12], 512, str(target))
    assert again.prompts == got.prompts and again.source == got.source
    assert realtext._text_tokens.cache_info().misses == misses
    (tmp_path / "p.txt").write_text("x = 1\n" * 40)
    changed = load_prompts(str(tmp_path / "p.txt"), [8], 512, str(target))
    assert realtext._text_tokens.cache_info().misses == misses + 1
    assert changed.prompts[0] != got.prompts[0] and changed.source != got.source
    (tmp_path / "p.txt").write_text(text * 4)

    held = load_prompts("heldout", [10, 6, 10], 512, str(target))
    ref = heldout_prompts(target, "eval", 3, 10, 0)
    assert [len(p) for p in held.prompts] == [10, 6, 10]
    assert held.prompts[0] == ref[0][0] and held.prompts[1] == ref[1][0][:6]

    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"), [4], 512, str(target))
    with pytest.raises(ValueError, match="tokenizer"):
        load_prompts(str(tmp_path / "p.txt"), [4], 512, None)
    with pytest.raises(ValueError, match="vocabulary"):
        load_prompts(str(tmp_path / "p.txt"), [8], 3, str(target))
    with pytest.raises(ValueError, match="held-out"):
        load_prompts("heldout", [8], 512, str(tmp_path))


def test_trace_prompts_follow_the_trace_sequences(trace_path: Path) -> None:
    from pdflash.bench.realtext import load_prompts

    t = tf.load_trace(trace_path)
    got = load_prompts(str(trace_path), [PROMPT_LEN, 5, PROMPT_LEN], 512, None)
    assert got.trace_requests == [0, 1, 0]
    assert got.prompts[0] == t.request_tokens(0)[:PROMPT_LEN].tolist()
    assert got.prompts[1] == t.request_tokens(1)[:5].tolist()


def test_run_on_text_prompts_at_temperature_one(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
) -> None:
    from pdflash.bench.engine_run import run_spec

    spec = _spec(trained_target[0], trained_drafter[0], prompts="heldout", temperature=1.0)
    row = run_spec(spec).row
    assert row["temperature"] == 1.0 and row["acceptance_source"] == "model"
    assert row["prompts_source"].startswith("held-out 'eval'")
    assert row["expert_bytes_source"].startswith("natural") and row["expert_padding_nbytes"] == 0
    assert row["committed_tokens"] == 2 * MAX_NEW


def test_workload_warm_up_takes_real_text_after_the_runs_prompts(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """A run on real text warms up on the same source's next windows (its
    drafts accepted as the run's are, the measured prompts unseen); a run
    on random ids or a trace keeps random ids."""
    from pdflash.bench.engine_run import (
        RANDOM_WARM_UP_PROMPTS,
        _serving_workload,
        run_spec,
        warm_up_prompts,
    )
    from pdflash.bench.realtext import load_prompts

    target = str(trained_target[0])
    spec = _spec(trained_target[0], trained_drafter[0], prompts="heldout", warmup="workload")
    workload = _serving_workload(spec)
    got, source = warm_up_prompts(spec, workload, [PROMPT_LEN, PROMPT_LEN], 512, target)
    every = load_prompts("heldout", [PROMPT_LEN] * 4, 512, target).prompts
    run = load_prompts("heldout", [PROMPT_LEN] * 2, 512, target).prompts
    assert got == every[2:] and run == every[:2]
    assert not any(p in run for p in got)
    assert source == "prompts 'heldout': the 2 after the run's 2"
    # a text file that holds the run's two windows but not the warm-up's: its
    # windows wrap to the run's own, and the source says so
    text = tmp_path / "short.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 4)
    size = load_prompts(str(text), [1], 512, target).details["tokens_in_file"]
    short = dataclasses.replace(spec, prompts=str(text), prompt_len=size // 2)
    got_short, source_short = warm_up_prompts(
        short, _serving_workload(short), [size // 2], 512, target
    )
    assert got_short == load_prompts(str(text), [size // 2], 512, target).prompts
    assert source_short.endswith("(the source wrapped: some are the run's)")
    for other in (
        dataclasses.replace(spec, prompts=None),
        dataclasses.replace(spec, prompts="t.npz"),
    ):
        assert warm_up_prompts(other, workload, [PROMPT_LEN], 512, target) == (
            None,
            RANDOM_WARM_UP_PROMPTS,
        )
    row = run_spec(spec).row
    assert row["warmup"]["mode"] == "workload" and row["warmup"]["requests"] == 2
    assert row["warmup"]["prompts"] == source
    assert row["committed_tokens"] == 2 * MAX_NEW
    short = run_spec(dataclasses.replace(spec, warmup="short")).row
    assert short["warmup"]["prompts"] == "the run's first prompt"
    # the shared warm-up's pass takes them too, and its record says so
    shared = run_spec(dataclasses.replace(spec, warmup="shared", seed=11)).row["warmup"]
    assert shared["shared"]["ran_now"] and shared["shared"]["prompts"] == source
    # a closed loop of one client (issue 14's width loops): one warm-up request
    closed = dataclasses.replace(spec, arrivals="closed", users=1, concurrency=1)
    looped = run_spec(closed).row
    assert looped["warmup"]["prompts"] == "prompts 'heldout': the 1 after the run's 2"
    assert looped["committed_tokens"] == 2 * MAX_NEW


# ---------------------------------------------------------------- padding


def test_padded_layout_views_ignore_the_padding() -> None:
    from pdflash.models.layout import ALIGN_BYTES, ComponentSpec, ExpertLayout

    lay = ExpertLayout([ComponentSpec("a", (4, 8)), ComponentSpec("b", (3,))], torch.float32)
    pad = lay.padded(10_000)
    assert pad.nbytes == 10_240 and pad.nbytes % ALIGN_BYTES == 0
    assert pad.natural_nbytes == lay.nbytes and pad.padding_nbytes == 10_240 - lay.nbytes
    slab = torch.randint(0, 255, (3, pad.nbytes), dtype=torch.uint8)
    views = pad.slab_views(slab)
    ref = lay.slab_views(slab[:, : lay.nbytes].contiguous())
    for name in ("a", "b"):
        # bitwise (random bytes hold NaN patterns)
        assert torch.equal(views[name].view(torch.int32), ref[name].view(torch.int32))
        assert views[name].stride(0) * views[name].element_size() == pad.nbytes
        assert views[name].data_ptr() % 16 == 0
    with pytest.raises(ValueError, match="cannot pad"):
        lay.padded(lay.nbytes - 1)
    with pytest.raises(TypeError):
        lay.padded(1.5)  # type: ignore[arg-type]


def test_padded_experts_change_bytes_not_outputs(
    trained_target: tuple[Path, dict[str, Any]],
) -> None:
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    target = trained_target[0]
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 300, 12]])
    logits = []
    sizes = []
    paths = []
    for nbytes in (None, 300_000):
        issuer = H2DIssuer(backend="host")
        try:
            extra = {} if nbytes is None else {"expert_nbytes": nbytes}
            ad = load_adapter(
                target, dtype=torch.float32, issuer=issuer, cache_fraction=0.25, **extra
            )
            logits.append(ad.forward_logits(ids))
            paths.append(ad.runtime.path)
            sizes.append((ad.expert_nbytes, ad.layout.natural_nbytes, ad.cache.expert_nbytes))
            ad.close()
        finally:
            issuer.close()
    assert torch.equal(logits[0], logits[1])
    # the grouped GEMM reads the padded slab's views (16-byte aligned strides)
    assert paths == ["grouped", "grouped"]
    (n0, nat0, c0), (n1, nat1, c1) = sizes
    assert n0 == nat0 == c0 and nat1 == nat0 and n1 == c1 == 300_032  # 256-B aligned


def test_padded_run_moves_padded_bytes(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
    trace_path: Path,
) -> None:
    from pdflash.bench.engine_run import run_spec
    from pdflash.bench.realtext import published_expert_nbytes

    results = [
        run_spec(_spec(trained_target[0], trained_drafter[0], prompts=str(trace_path), **kw))
        for kw in ({}, {"expert_bytes_as": "qwen3-30b-a3b"})
    ]
    plain, padded = (r.row for r in results)
    qwen, _ = published_expert_nbytes("qwen3-30b-a3b")
    assert qwen == 9_437_184  # 3 x 2048 x 768 bf16
    assert padded["expert_nbytes"] == qwen and padded["expert_padding_nbytes"] > 0
    assert padded["expert_natural_nbytes"] == plain["expert_nbytes"]
    assert "qwen3-30b-a3b" in padded["expert_bytes_source"]
    # routing and acceptance unchanged; every byte count scales by the padding
    assert all(
        np.array_equal(a, b)
        for a, b in zip(results[0].routing_trace, results[1].routing_trace, strict=True)
    )
    assert [r["acceptance_lengths"] for r in results[0].requests] == [
        r["acceptance_lengths"] for r in results[1].requests
    ]
    assert plain["belady_bytes"] > 0
    assert padded["cache_slots"] == plain["cache_slots"]
    # Belady moves whole padded experts: the same replay (trace, slots, starting
    # cache) in padded bytes. The starting caches can differ: the warm-up's
    # lookahead copies depend on how fast the (bigger) copies land.
    from pdflash.report.belady import belady

    for res, nbytes in ((results[0], plain["expert_nbytes"]), (results[1], qwen)):
        replay = belady(
            res.routing_trace, res.cache_slots, nbytes, initial=res.initial_resident
        ).bytes_moved
        assert res.row["belady_bytes"] == replay and replay % nbytes == 0
    if np.array_equal(results[0].initial_resident, results[1].initial_resident):
        assert padded["belady_bytes"] / qwen == plain["belady_bytes"] / plain["expert_nbytes"]
    with pytest.raises(ValueError, match="expert_bytes_as"):
        _spec(trained_target[0], trained_drafter[0], expert_bytes_as="gpt-5").validate()


# ---------------------------------------------------------------- replay


def test_trace_routing_returns_the_trace_rows(
    trace_path: Path, trained_target: tuple[Path, dict[str, Any]]
) -> None:
    from pdflash.engine.replay import TraceRouting

    t = tf.load_trace(trace_path)
    shape = dict(num_layers=t.provenance["num_layers"], num_experts=16, top_k=4)
    rt = TraceRouting(t, _FakeAdapter(**shape), trace_path)
    rt.assign(7, 1)
    seq = t.request_tokens(1)
    rows, how = rt.trace_rows(7, 0, seq.tolist())
    assert np.array_equal(rows, t.token_topk[t.token_request[1] : t.token_request[2]])
    assert set(how) == {"token"}
    # a verify round at its recorded start: the recorded verified rows, rejected ones too
    first = int(np.flatnonzero(t.round_request == 1)[0])
    row0 = int(t.round_rows[:first].astype(int).sum())
    n = int(t.round_rows[first])
    block = t.verify_tokens[row0 : row0 + n].tolist()
    rows, how = rt.trace_rows(7, int(t.prompt_len[1]), block)
    assert how == ["exact"] * n and np.array_equal(rows, t.verify_topk[row0 : row0 + n])
    # a different token at a position: the trace's routing at that position
    rows, how = rt.trace_rows(7, 3, [int(seq[3]) + 1])
    assert how == ["positional"] and np.array_equal(rows[0], t.token_topk[t.token_request[1] + 3])


def test_trace_routing_maps_layers_and_experts_onto_a_smaller_shape(trace_path: Path) -> None:
    from pdflash.engine.replay import TraceRouting

    t = tf.load_trace(trace_path)
    L = int(t.provenance["num_layers"])
    rt = TraceRouting(t, _FakeAdapter(num_layers=2 * L, num_experts=4, top_k=3), None)
    assert rt.layer_map == [i // 2 for i in range(2 * L)]
    ids = rt.map_experts(t.token_topk[:10].astype(np.int64))
    assert ids.shape == (10, 2 * L, 3) and ids.min() >= 0 and ids.max() < 4
    for row in ids.reshape(-1, 3):
        assert len(set(row.tolist())) == 3
    # the first mapped expert is the trace's first, merged 16 -> 4
    assert np.array_equal(ids[:, 0, 0], t.token_topk[:10, 0, 0] // 4)
    with pytest.raises(ValueError, match="more experts"):
        TraceRouting(t, _FakeAdapter(num_layers=L, num_experts=64, top_k=4), None)


def test_replayed_routing_on_the_same_model_equals_its_own(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
    trace_path: Path,
) -> None:
    from pdflash.bench.engine_run import run_spec

    runs = [
        run_spec(_spec(trained_target[0], trained_drafter[0], prompts=str(trace_path), **kw))
        for kw in ({}, {"routing_source": "trace", "trace": str(trace_path)})
    ]
    own, replay = runs
    assert own.row["routing_source"] == "model" and replay.row["routing_source"] == "trace"
    params = replay.row["routing_params"]
    assert params["layer_map"] == list(range(own.row["layers"]))
    assert params["rows"]["exact"] + params["rows"]["token"] > 0
    assert params["row_layers_with_replayed_weights"] == 0, params
    assert [r["acceptance_lengths"] for r in own.requests] == [
        r["acceptance_lengths"] for r in replay.requests
    ]
    assert len(own.routing_trace) == len(replay.routing_trace)
    for a, b in zip(own.routing_trace, replay.routing_trace, strict=True):
        assert np.array_equal(a, b)
    # the same trace from the same starting cache: the same optimum (the warm-up's
    # lookahead copies can land differently between two runs, so compare like with like)
    if np.array_equal(own.initial_resident, replay.initial_resident):
        assert own.row["belady_bytes"] == replay.row["belady_bytes"]


def test_acceptance_replayed_from_the_trace(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
    trace_path: Path,
) -> None:
    from pdflash.bench.engine_run import run_spec

    t = tf.load_trace(trace_path)
    spec = _spec(
        trained_target[0],
        trained_drafter[0],
        prompts=str(trace_path),
        acceptance="trace",
        trace=str(trace_path),
        block_size=int(t.provenance["block_size"]),
    )
    res = run_spec(spec)
    assert res.row["acceptance_source"] == "trace"
    assert res.row["acceptance_params"]["rounds_replayed"] == t.round_request.size
    for r, req in enumerate(res.requests):
        assert req["acceptance_lengths"] == t.acceptance(r).tolist()
    # a synthetic drafter with a trace: the trace's acceptance, not a forced draw
    auto = dataclasses.replace(spec, acceptance="auto", draft="synthetic")
    from pdflash.bench.engine_run import _acceptance_for

    assert _acceptance_for(auto, "proxy", True).source == "trace"
    assert _acceptance_for(dataclasses.replace(auto, trace=None), "proxy", True).source == "forced"
    with pytest.raises(ValueError, match="needs a trace"):
        dataclasses.replace(spec, trace=None).validate()


class _FakeAdapter:
    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k


class _HFRouters:
    """The router access :class:`pdflash.routeahead.NextLayerLookahead` uses,
    over a transformers qwen3_moe model (its post-attention norms and gates)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_experts = int(cfg.num_experts)
        self.top_k = int(cfg.num_experts_per_tok)

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model.model.layers[layer].post_attention_layernorm(hidden)
        return out

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        return normed @ self.model.model.layers[layer].mlp.gate.weight.T


def test_trace_lookahead_predicts_what_the_trained_models_lookahead_does(
    trace_path: Path, models: tuple[Any, Any]
) -> None:
    """Replayed on the trained model's own shape, the lookahead's predictions
    are the live gate lookahead's (the target's router over the model's own
    hidden states), row set for row set: ids equal, scores to float16."""
    from pdflash.engine.replay import TraceLookahead, TraceRouting
    from pdflash.routeahead import NextLayerLookahead

    target, _ = models
    t = tf.load_trace(trace_path)
    routers = _HFRouters(target)
    rt = TraceRouting(t, routers, trace_path)
    predictor = rt.next_layer_predictor()
    assert isinstance(predictor, TraceLookahead)
    live = NextLayerLookahead(routers)  # type: ignore[arg-type]
    live_share = NextLayerLookahead(routers, score="share")  # type: ignore[arg-type]
    replay_share = rt.next_layer_predictor("share")
    assert replay_share is not None
    seq = t.request_tokens(1).astype(np.int64)
    with torch.no_grad():
        hidden = target(input_ids=torch.from_numpy(seq)[None], output_hidden_states=True)
    rt.assign(0, 1)
    for lo, hi in ((0, 5), (7, 8), (3, seq.size)):  # row sets: a block, one row, a long run
        rt.begin_forward([(0, lo, torch.from_numpy(seq[lo:hi]))])
        for layer in range(routers.num_layers):
            h = hidden.hidden_states[layer + 1][0, lo:hi]
            want_ids, want_scores = live.predict_next(layer, h)
            got_ids, got_scores = predictor.predict_next(layer, h)
            assert sorted(got_ids.tolist()) == sorted(want_ids.tolist()), (lo, hi, layer)
            by_id = dict(zip(want_ids.tolist(), want_scores.tolist(), strict=True))
            np.testing.assert_allclose(
                got_scores, [by_id[i] for i in got_ids.tolist()], rtol=2e-3, atol=2e-3
            )
            assert np.all(np.diff(got_scores) <= 0)  # most confident first
            want_ids, want_scores = live_share.predict_next(layer, h)
            got_ids, got_scores = replay_share.predict_next(layer, h)
            assert sorted(got_ids.tolist()) == sorted(want_ids.tolist())
            by_id = dict(zip(want_ids.tolist(), want_scores.tolist(), strict=True))
            np.testing.assert_allclose(
                got_scores, [by_id[i] for i in got_ids.tolist()], rtol=2e-3, atol=2e-3
            )


def test_trace_lookahead_maps_layers_and_experts_and_checks_its_rows(trace_path: Path) -> None:
    from pdflash.engine.replay import TraceRouting

    t = tf.load_trace(trace_path)
    L = int(t.provenance["num_layers"])
    rt = TraceRouting(t, _FakeAdapter(num_layers=2 * L, num_experts=4, top_k=3), None)
    predictor = rt.next_layer_predictor()
    assert predictor is not None
    with pytest.raises(RuntimeError, match="begin_forward"):
        predictor.predict_next(0, torch.zeros(2, 8))
    seq = t.request_tokens(0).astype(np.int64)
    rt.begin_forward([(0, 0, torch.from_numpy(seq[:2]))])
    assert t.token_lookahead is not None and t.token_lookahead_probs is not None
    for layer in range(2 * L - 1):
        ids, scores = predictor.predict_next(layer, torch.zeros(2, 8))
        nxt, m = layer + 1, rt.layer_map[layer + 1]
        # the first 3 of each row's recorded 4, merged 16 -> 4, summed over the 2 rows
        trace_ids = t.token_lookahead[:2, m, :3].astype(np.int64) * 4 // 16
        trace_p = t.token_lookahead_probs[:2, m, :3].astype(np.float32)
        want = np.bincount(trace_ids.reshape(-1), weights=trace_p.reshape(-1), minlength=4)
        assert np.all(ids // 4 == nxt)
        np.testing.assert_allclose(scores, want[ids - nxt * 4], rtol=1e-6)
        assert set((ids - nxt * 4).tolist()) == set(np.flatnonzero(want > 0).tolist())
    # share: each row's first 3 over its recorded top-k mass
    by_share = rt.next_layer_predictor("share")
    assert by_share is not None
    ids, scores = by_share.predict_next(0, torch.zeros(2, 8))
    m = rt.layer_map[1]
    p_all = t.token_lookahead_probs[:2, m].astype(np.float32)
    share = p_all[:, :3] / p_all.sum(axis=-1, keepdims=True)
    trace_ids = t.token_lookahead[:2, m, :3].astype(np.int64) * 4 // 16
    want = np.bincount(trace_ids.reshape(-1), weights=share.reshape(-1), minlength=4)
    np.testing.assert_allclose(scores, want[ids - 4], rtol=1e-5)
    last = predictor.predict_next(2 * L - 1, torch.zeros(2, 8))
    assert last[0].size == 0 and last[1].size == 0
    with pytest.raises(RuntimeError, match="3 hidden"):
        predictor.predict_next(0, torch.zeros(3, 8))
    # a trace without the arrays: no replayed lookahead (the router predicts)
    for name in tf.LOOKAHEAD_ARRAYS:
        setattr(t, name, None)
    assert TraceRouting(t, _FakeAdapter(L, 16, 4), None).next_layer_predictor() is None


def test_matrix_and_engine_cli_pass_the_new_options(tmp_path: Path) -> None:
    from pdflash.bench import cli
    from pdflash.bench.suites import matrix

    (tmp_path / "t.npz").write_bytes(b"")
    argv = [
        *("matrix", "--arch", "proxy", "--weights", str(tmp_path), "--baselines", "B1,PD"),
        *("--concurrency", "1,4", "--cache-fraction", "0.2", "--repeats", "3"),
    ]
    extra = [
        *("--prompts", "heldout", "--temperature", "1.0", "--expert-bytes-as", "gpt-oss-20b"),
        *("--trace", str(tmp_path / "t.npz"), "--routing-source", "trace"),
    ]
    plain = matrix.plan(cli.build_parser().parse_args(argv))
    args = cli.build_parser().parse_args([*argv, *extra])
    specs = matrix.plan(args)
    assert not {"prompts", "temperature", "expert_bytes_as", "trace"} & set(plain[0])
    assert {
        (s["prompts"], s["temperature"], s["expert_bytes_as"], s["routing_source"]) for s in specs
    } == {("heldout", 1.0, "gpt-oss-20b", "trace")}
    # repeats interleave: every baseline of a repeat before the next repeat,
    # the baselines' order rotated by one each repeat
    assert [(s["repeat"], s["baseline"]) for s in specs[:4]] == [
        (0, "B1"),
        (0, "PD"),
        (1, "PD"),
        (1, "B1"),
    ]
    assert matrix.spec_key(specs[0]) != matrix.spec_key(plain[0])
    command = matrix.matrix_command(args, tmp_path / "out")
    for flag in ("--prompts heldout", "--temperature 1.0", "--expert-bytes-as gpt-oss-20b"):
        assert flag in command
    assert "--routing-source trace" in command
    eng = cli.build_parser().parse_args(
        ["engine", "--acceptance", "trace", "--trace", "x.npz", "--expert-bytes-as", "12345"]
    )
    assert (eng.acceptance, eng.trace, eng.expert_bytes_as) == ("trace", "x.npz", "12345")


def test_route_ahead_source_reaches_the_spec_key_and_command(tmp_path: Path) -> None:
    from bench_fixtures import check_a_matrix_option_keys_its_runs
    from pdflash.bench.engine_run import RunSpec

    argv = [
        *("matrix", "--arch", "proxy", "--weights", str(tmp_path), "--baselines", "PD"),
        *("--concurrency", "1", "--cache-fraction", "0.2"),
    ]
    check_a_matrix_option_keys_its_runs(
        argv, "--route-ahead-source", "token_prior", "route_ahead_source", tmp_path / "o"
    )
    with pytest.raises(ValueError, match="route_ahead_source"):
        RunSpec(arch="tiny", baseline="PD", route_ahead_source="oracle").validate()


def test_routeahead_scores_predictors_on_learned_routing(
    trained_target: tuple[Path, dict[str, Any]],
) -> None:
    from pdflash.bench import cli
    from pdflash.bench.suites import routeahead

    args = cli.build_parser().parse_args(
        [
            *("routeahead", "--weights", str(trained_target[0]), "--device", "cpu"),
            *("--sequences", "3", "--blocks-per-sequence", "3", "--tokens", "8"),
            *("--requests", "4", "--native-reps", "2", "--reference-reps", "1"),
            *("--layers", "4", "--experts", "16", "--top-k", "2"),
        ]
    )
    res = routeahead.run(args)
    learned = res["predictor_model"]
    assert learned["synthetic"] is False and learned["sequences"] == 3
    assert learned["prompts_source"].startswith("held-out 'eval'")
    names = set(res["predictors"])
    assert {"approx_router", "previous_round", "pd_engine_union", "next_layer"} <= names
    for name, row in res["predictors"].items():
        # 3 texts x (3 blocks - the first of each)
        assert row["blocks_scored"] == (6 if name != "next_layer" else 9), name
        assert 0.0 <= row["coverage"] <= 1.0 and 0.0 <= row["precision"] <= 1.0
        assert len(learned["per_layer"][name]) == learned["layers"]
    rec = res["recommendation"]
    assert rec["trust"] in names and rec["trust"] != "next_layer"
    cov, prec = (res["predictors"][rec["trust"]][k] for k in ("coverage", "precision"))
    assert rec["meets_target"] == (cov >= 0.9 and prec >= 0.8)


def test_routeahead_warmup_sequences_are_learned_from_not_scored(
    trained_target: tuple[Path, dict[str, Any]],
) -> None:
    from pdflash.bench import cli
    from pdflash.bench.suites import routeahead

    base = [
        *("routeahead", "--weights", str(trained_target[0]), "--device", "cpu"),
        *("--sequences", "2", "--blocks-per-sequence", "3", "--tokens", "8"),
        *("--requests", "2", "--native-reps", "1", "--reference-reps", "1"),
        *("--layers", "2", "--experts", "16", "--top-k", "2"),
    ]
    cold = routeahead.run(cli.build_parser().parse_args(base))
    warm = routeahead.run(cli.build_parser().parse_args([*base, "--prior-warmup-sequences", "2"]))
    assert cold["predictor_model"]["prior_warmup_sequences"] == 0
    assert warm["predictor_model"]["prior_warmup_sequences"] == 2
    for res in (cold, warm):
        assert res["predictors"]["token_prior"]["blocks_scored"] == 4  # 2 texts x (3 - 1)
    # the stateless router is untouched by the warm-up; the learners see more
    assert (
        cold["predictors"]["approx_router"]["coverage"]
        == warm["predictors"]["approx_router"]["coverage"]
    )


def test_recommendation_rule() -> None:
    from pdflash.bench.suites.routeahead import recommend

    rows = {
        "a": {"coverage": 0.95, "precision": 0.85},
        "b": {"coverage": 0.99, "precision": 0.81},
        "c": {"coverage": 1.0, "precision": 0.2},
        "next_layer": {"coverage": 1.0, "precision": 1.0},
    }
    rec = recommend(rows)
    assert rec["trust"] == "b" and rec["meets_target"] and rec["reaching_target"] == ["a", "b"]
    rec = recommend({"c": rows["c"], "d": {"coverage": 0.8, "precision": 0.7}})
    assert rec["trust"] == "d" and not rec["meets_target"] and "none reaches" in rec["reason"]
    assert recommend({"e": {"coverage": None, "precision": None}})["trust"] is None


def test_replayed_weights_are_the_routers_softmax_over_the_replayed_ids(
    trace_path: Path,
) -> None:
    from pdflash.engine.replay import TraceRouting

    t = tf.load_trace(trace_path)
    L, E, k = (int(t.provenance[n]) for n in ("num_layers", "num_experts", "top_k"))
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(0))
    fake = _FakeAdapter(num_layers=L, num_experts=E, top_k=k)
    fake.router_logits = lambda layer, normed: logits  # type: ignore[attr-defined]
    rt = TraceRouting(t, fake, None)
    seq = t.request_tokens(0)
    rt.begin_forward([(0, 0, torch.as_tensor(seq[:3].astype(np.int64)))])
    replay = torch.as_tensor(t.token_topk[:3, 1].astype(np.int64))
    # row 0: the router chose the replayed set (other order) -> its own ids and weights stay
    ids = replay.clone()
    ids[0] = replay[0].flip(0)
    ids[1:] = (replay[1:] + 1) % E
    weights = torch.rand(3, k)
    got_ids, got_w = rt.route(1, torch.zeros(3, 4), ids, weights)
    assert torch.equal(got_ids[0], ids[0]) and torch.equal(got_w[0], weights[0])
    assert torch.equal(got_ids[1:], replay[1:])
    expect = torch.softmax(logits[1:].gather(1, replay[1:]), dim=-1)
    assert torch.allclose(got_w[1:], expect)
    assert rt.describe()["row_layers_with_replayed_weights"] == 2
    with pytest.raises(RuntimeError, match="begin_forward"):
        rt.route(1, torch.zeros(5, 4), torch.zeros(5, k, dtype=torch.int64), torch.rand(5, k))


def _tiny_replay_spec(trace_path: Path, **kw: Any) -> Any:
    """The trace replayed on the tiny gpt-oss preset (synthetic: 2 layers,
    8 experts top-2; the trace: 16 top-4), routing from the trace."""
    from pdflash.bench.engine_run import RunSpec

    t = tf.load_trace(trace_path)
    base: dict[str, Any] = dict(
        arch="tiny-gpt_oss",
        device="cpu",
        prompt_len=8,
        max_new_tokens=12,
        block_size=int(t.provenance["block_size"]),
        routing_source="trace",
        trace=str(trace_path),
    )
    base.update(kw)
    return RunSpec(**base)


@pytest.mark.parametrize("score", ["share", "every"])
def test_trace_replayed_on_another_shape_without_the_weights(trace_path: Path, score: str) -> None:
    from pdflash.bench.engine_run import run_spec

    t = tf.load_trace(trace_path)
    # acceptance auto: a synthetic drafter + a trace replays the trace's acceptance
    spec = _tiny_replay_spec(
        trace_path, baseline="PD", concurrency=2, acceptance="auto", lookahead_score=score
    )
    res = run_spec(spec)
    row = res.row
    assert row["lookahead_score"] == score
    assert (row["routing_source"], row["acceptance_source"]) == ("trace", "trace")
    # the trace records the trained model's lookahead: the stream replays it
    assert row["lookahead_source"] == "trace"
    assert "replayed from the trace" in row["routing_params"]["predictors"]
    # ... and route-ahead's approximate router
    assert row["route_ahead_approx_source"] == "trace"
    assert "approximate router is replayed" in row["routing_params"]["predictors"]
    params = row["routing_params"]
    assert params["layer_map"] == [0, t.provenance["num_layers"] // 2]
    assert params["expert_map"].startswith("e * 8 // 16")
    assert params["rows"]["positional"] > 0  # random prompts: positions, not tokens
    assert row["acceptance_params"]["rounds_replayed"] > 0
    # per request, the accepted lengths are its trace request's, in order
    for r, req in enumerate(res.requests):
        rounds = t.acceptance(r % t.num_requests).tolist()
        got = req["acceptance_lengths"]
        assert got[:-1] == rounds[: len(got) - 1]  # the last round may be cut by the length cap


def test_each_repeat_replays_the_next_trace_requests(trace_path: Path) -> None:
    """Without trace prompts, request i of repeat r replays trace request
    (i + r x requests) mod R: a one-request run does not replay trace request
    0 at every repeat."""
    from pdflash.bench.engine_run import run_spec

    t = tf.load_trace(trace_path)
    assert t.num_requests == 2
    for repeat, want in ((0, 0), (1, 1), (2, 0)):
        spec = _tiny_replay_spec(
            trace_path, baseline="B1", concurrency=1, acceptance="trace", repeat=repeat
        )
        res = run_spec(spec)
        assert res.row["acceptance_params"]["trace_requests_replayed"] == [want]
        assert res.row["lookahead_source"] == "trace"  # B1's gate lookahead replays it too
        (req,) = res.requests
        got = req["acceptance_lengths"]
        assert got[:-1] == t.acceptance(want).tolist()[: len(got) - 1]


def test_a_trace_without_the_lookahead_leaves_it_to_the_router(
    trace_path: Path, tmp_path: Path
) -> None:
    """Traces written before the lookahead arrays (every committed GPU trace
    of sessions 20-35) still replay; the gate lookahead then runs the
    target's router, and rows say so."""
    from pdflash.bench.engine_run import run_spec

    t = tf.load_trace(trace_path)
    for name in tf.LOOKAHEAD_ARRAYS:
        setattr(t, name, None)
    old = tf.save_trace(t, tmp_path / "old.npz")
    res = run_spec(_tiny_replay_spec(old, baseline="B1", concurrency=1, acceptance="trace"))
    assert res.row["lookahead_source"] == "router"
    assert "runs the target's router" in res.row["routing_params"]["predictors"]
    assert res.row["route_ahead_approx_source"] is None  # B1 runs no route-ahead
    res = run_spec(_tiny_replay_spec(old, baseline="B3", concurrency=1, acceptance="trace"))
    assert res.row["lookahead_source"] is None  # every expert resident: no lookahead


def test_trace_acceptance_streams_per_request() -> None:
    from pdflash.engine.replay import TraceAcceptance

    # request 0 commits 3 then 2 tokens per round, request 1 commits 4
    trace = _small_trace(acc=[3, 2, 4], req=[0, 0, 1])
    acc = TraceAcceptance(trace)
    acc.assign(10, 1)
    acc.assign(11, 0)
    assert acc.source == "trace" and acc.num_trace_requests == 2
    assert [acc.forced_accepts(11, 7) for _ in range(3)] == [2, 1, 2]  # wraps after 2 rounds
    assert acc.forced_accepts(10, 7) == 3 and acc.forced_accepts(10, 1) == 1  # capped
    assert acc.forced_accepts(12, 7) == 2  # unassigned: request id mod R -> 0
    p = acc.params()
    assert (p["wraps"], p["rounds_replayed"], p["rounds_capped_by_drafts"]) == (2, 6, 1)
    acc.forget(11)
    assert acc.forced_accepts(11, 7) == 3  # forgotten: id mod R -> 1, from its first round
    with pytest.raises(ValueError):
        acc.assign(1, 2)
    with pytest.raises(ValueError):
        acc.forced_accepts(1, -1)


def _small_trace(acc: list[int], req: list[int]) -> tf.ProxyTrace:
    L, k, E, rows = 2, 2, 8, 4
    plen = [4, 5]
    commits = [1 + sum(a for a, r in zip(acc, req, strict=True) if r == i) for i in range(2)]
    lengths = [p + c for p, c in zip(plen, commits, strict=True)]
    T, V = sum(lengths), rows * len(acc)
    rng = np.random.default_rng(0)
    return tf.ProxyTrace(
        tokens=rng.integers(0, 500, T).astype(np.uint16),
        token_request=np.array([0, lengths[0], T], dtype=np.int64),
        prompt_len=np.array(plen, dtype=np.int32),
        token_topk=rng.integers(0, E, (T, L, k)).astype(np.uint8),
        round_request=np.array(req, dtype=np.int32),
        round_accepted=np.array(acc, dtype=np.int16),
        round_rows=np.full(len(acc), rows, dtype=np.int16),
        verify_topk=rng.integers(0, E, (V, L, k)).astype(np.uint8),
        verify_tokens=rng.integers(0, 500, V).astype(np.uint16),
        provenance={
            "format": tf.FORMAT,
            "version": tf.VERSION,
            "num_experts": E,
            "top_k": k,
            "num_layers": L,
            "block_size": rows,
            "temperature": 0.0,
            "target_weights_sha256": "t",
            "drafter_weights_sha256": "d",
            "target_preset": "test",
            "prompts_source": "test",
        },
    )


def _map_reference(row: list[int], num_experts: int, trace_experts: int, k: int) -> list[int]:
    seen: list[int] = []
    for e in row:
        m = e * num_experts // trace_experts
        if m not in seen and len(seen) < k:
            seen.append(m)
    nxt = seen[-1]
    while len(seen) < k:
        nxt = (nxt + 1) % num_experts
        if nxt not in seen:
            seen.append(nxt)
    return seen


@pytest.mark.parametrize(("experts", "top_k"), [(4, 3), (8, 2), (16, 6), (2, 2)])
def test_expert_map_matches_the_reference(experts: int, top_k: int) -> None:
    from pdflash.engine.replay import TraceRouting

    trace = _small_trace(acc=[3, 2, 4], req=[0, 0, 1])
    trace.provenance.update(num_experts=16, top_k=4)
    rng = np.random.default_rng(experts * 10 + top_k)
    rows = np.stack([rng.permutation(16)[:4] for _ in range(2 * 30)]).reshape(30, 2, 4)
    rt = TraceRouting(trace, _FakeAdapter(num_layers=2, num_experts=experts, top_k=top_k), None)
    got = rt.map_experts(rows.astype(np.int64))
    for i in range(30):
        for layer in range(2):
            ref = _map_reference(rows[i, layer].tolist(), experts, 16, top_k)
            assert got[i, layer].tolist() == ref, (i, layer)


def test_a_trace_without_the_approx_router_leaves_route_ahead_to_the_router(
    trace_path: Path, tmp_path: Path
) -> None:
    """Traces written before the approximate-router arrays replay with the
    union's router pass over the target's own router, and rows say so."""
    from pdflash.bench.engine_run import run_spec

    t = tf.load_trace(trace_path)
    assert t.has_approx
    for name in tf.APPROX_ARRAYS:
        setattr(t, name, None)
    old = tf.save_trace(t, tmp_path / "old.npz")
    res = run_spec(_tiny_replay_spec(old, baseline="PD", concurrency=1, acceptance="trace"))
    assert res.row["route_ahead_approx_source"] == "router"
    assert "predict the router, not the trace" in res.row["routing_params"]["predictors"]


def _block(
    rid: int, start: int, tokens: Any, horizon: int | None = None, hidden: Any = None
) -> Any:
    from pdflash.protocols import DraftedBlock

    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    return DraftedBlock(
        request_id=rid,
        token_ids=ids,
        positions=torch.arange(start, start + ids.numel()),
        drafter_hidden=hidden,
        horizon=horizon,
    )


def test_trace_approx_router_predicts_what_the_trained_models_router_pass_does(
    trace_path: Path, models: tuple[Any, Any]
) -> None:
    """Replayed on the trained model's own shape, token rows give what the
    live approximate router predicts (``drafter`` proxy) over the drafter's
    teacher-forced hidden states for those positions, block by block, to
    float16; the live pass still runs (charged). The embedding-proxy arrays
    hold the router over the tokens' embeddings."""
    from pdflash.bench.proxy.decode import teacher_forced_drafter_hidden
    from pdflash.bench.proxy.drafter import capture_features, features_of

    from pdflash.engine.replay import TraceApproxRouter, TraceRouting
    from pdflash.routeahead import ApproxRouterPredictor

    target, drafter = models
    t = tf.load_trace(trace_path)
    routers = _HFRouters(target)
    rt = TraceRouting(t, routers, trace_path)
    live = ApproxRouterPredictor(routers, proxy="drafter")  # type: ignore[arg-type]

    class Counting:
        name = "charge"
        calls = 0

        def predict_batch(self, blocks: Any) -> Any:
            Counting.calls += 1
            return live.predict_batch(blocks)

    replay = rt.approx_router_predictor(charge=Counting())  # type: ignore[arg-type]
    assert isinstance(replay, TraceApproxRouter)
    rt.assign(0, 1)
    seq = t.request_tokens(1).astype(np.int64)
    ids_layers = drafter.target_layer_ids
    with torch.no_grad(), capture_features(target, ids_layers) as got:
        target(input_ids=torch.from_numpy(seq)[None], use_cache=False)
    hidden = teacher_forced_drafter_hidden(
        target, drafter, seq.tolist(), features_of(got, ids_layers)
    )
    blocks = [
        _block(0, 0, seq[:5], hidden=hidden[:5]),
        _block(0, 7, seq[7:8], hidden=hidden[7:8]),
        _block(0, 3, seq[3:19], horizon=4, hidden=hidden[3:19]),
    ]
    with torch.no_grad():
        want = live.predict_batch(blocks)
    got_scores = replay.predict_batch(blocks)
    assert Counting.calls == 1
    assert got_scores.shape == want.shape
    assert np.array_equal(got_scores > 0, want > 0)
    np.testing.assert_allclose(got_scores, want, rtol=2e-3, atol=2e-3)
    # the embedding proxy's arrays: the router over the tokens' embeddings
    assert t.token_approx_embed is not None and t.token_approx_embed_probs is not None
    embed = ApproxRouterPredictor(_EmbedRouters(target), proxy="embed")  # type: ignore[arg-type]
    base = int(t.token_request[1])
    with torch.no_grad():
        by_embed = embed.predict_batch([_block(0, 0, seq[:1])])[0]
    for layer in range(routers.num_layers):
        ids = t.token_approx_embed[base, layer].astype(np.int64)
        np.testing.assert_allclose(
            by_embed[layer, ids],
            t.token_approx_embed_probs[base, layer].astype(np.float32),
            rtol=2e-3,
            atol=2e-3,
        )
        assert (by_embed[layer] > 0).sum() == ids.size


class _EmbedRouters(_HFRouters):
    """:class:`_HFRouters` with the token embeddings (the ``embed`` proxy)."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model.model.embed_tokens(token_ids)
        return out


def test_trace_approx_router_maps_experts_and_replays_exact_verify_rows(trace_path: Path) -> None:
    """A block whose rows match a recorded round replays that round's
    verify rows (the drafter's hidden states); others their token rows;
    layers and experts mapped as the routing is, scores summed over the
    block's first ``horizon`` rows."""
    from pdflash.engine.replay import TraceRouting

    t = tf.load_trace(trace_path)
    assert t.token_approx is not None and t.verify_approx is not None
    assert t.token_approx_probs is not None and t.verify_approx_probs is not None
    L = int(t.provenance["num_layers"])
    rt = TraceRouting(t, _FakeAdapter(num_layers=2 * L, num_experts=4, top_k=3), None)
    predictor = rt.approx_router_predictor()
    assert predictor is not None
    rt.assign(0, 0)
    # the request's first recorded round: its anchor sits right after the prompt
    first = int(np.flatnonzero(t.round_request == 0)[0])
    row0 = int(t.round_rows[:first].astype(np.int64).sum())
    rows = int(t.round_rows[first])
    start = int(t.prompt_len[0])
    tokens = t.verify_tokens[row0 : row0 + rows].astype(np.int64)
    seq = t.request_tokens(0).astype(np.int64)

    def want(ids: Any, probs: Any) -> Any:
        out = np.zeros((2 * L, 4))
        for layer in range(2 * L):
            m = rt.layer_map[layer]
            e = ids[:, m, :3].astype(np.int64) * 4 // 16
            out[layer] = np.bincount(
                e.reshape(-1), weights=probs[:, m, :3].astype(np.float32).reshape(-1), minlength=4
            )
        return out

    n = min(3, rows)
    exact, by_token = predictor.predict_batch(
        [_block(0, start, tokens, horizon=n), _block(0, 2, seq[2:4])]
    )
    v = slice(row0, row0 + n)
    np.testing.assert_allclose(exact, want(t.verify_approx[v], t.verify_approx_probs[v]), rtol=1e-6)
    base = int(t.token_request[0])
    tok = slice(base + 2, base + 4)
    np.testing.assert_allclose(
        by_token, want(t.token_approx[tok], t.token_approx_probs[tok]), rtol=1e-6
    )
    # the two recordings agree: the first draft row of the request's first
    # round (decoded) is the teacher-forced row of the position after its anchor
    assert rows > 1
    tf_row = base + start + 1
    assert np.array_equal(
        np.sort(t.verify_approx[row0 + 1], axis=-1), np.sort(t.token_approx[tf_row], axis=-1)
    )
    np.testing.assert_allclose(
        np.sort(t.verify_approx_probs[row0 + 1].astype(np.float32), axis=-1),
        np.sort(t.token_approx_probs[tf_row].astype(np.float32), axis=-1),
        atol=2e-3,
    )
    # a trace without the arrays: none replayed
    for name in tf.APPROX_ARRAYS:
        setattr(t, name, None)
    assert TraceRouting(t, _FakeAdapter(L, 16, 4), None).approx_router_predictor() is None


def test_the_embedding_proxy_replays_each_positions_token_row(trace_path: Path) -> None:
    """``route_ahead_proxy=embed`` replays the router over the trace tokens'
    embeddings by position (wrapped), whatever the block's tokens; an engine
    run records the proxy, and a trace without those arrays falls back to
    the router."""
    from pdflash.bench.engine_run import run_spec

    from pdflash.engine.replay import TraceRouting

    t = tf.load_trace(trace_path)
    assert t.token_approx_embed is not None and t.token_approx_embed_probs is not None
    L = int(t.provenance["num_layers"])
    rt = TraceRouting(t, _FakeAdapter(num_layers=L, num_experts=4, top_k=3), None)
    predictor = rt.approx_router_predictor(proxy="embed")
    assert predictor is not None and predictor.proxy == "embed"
    rt.assign(0, 0)
    size = int(t.token_request[1] - t.token_request[0])
    (scores,) = predictor.predict_batch([_block(0, size - 1, [0, 0])])  # wraps to position 0
    rows = [size - 1, 0]
    for layer in range(L):
        e = t.token_approx_embed[rows, layer, :3].astype(np.int64) * 4 // 16
        p = t.token_approx_embed_probs[rows, layer, :3].astype(np.float32)
        want = np.bincount(e.reshape(-1), weights=p.reshape(-1), minlength=4)
        np.testing.assert_allclose(scores[layer], want, rtol=1e-6)
    row = run_spec(
        _tiny_replay_spec(
            trace_path, baseline="PD", concurrency=1, acceptance="trace", route_ahead_proxy="embed"
        )
    ).row
    assert (row["route_ahead_proxy"], row["route_ahead_approx_source"]) == ("embed", "trace")
    t.token_approx_embed = t.token_approx_embed_probs = None
    assert (
        TraceRouting(t, _FakeAdapter(L, 16, 4), None).approx_router_predictor(proxy="embed") is None
    )
