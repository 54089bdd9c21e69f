"""Expert-parallel offload on CPU: 2 gloo ranks produce the single-process
engine's greedy tokens on tiny qwen3-moe and gpt-oss checkpoints, each rank
packing, caching and copying only the experts it owns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdflash.distributed import distributed_available, launch
from pdflash.distributed.worker import GreedyRunSpec, run_greedy_all

pytestmark = [
    pytest.mark.skipif(not distributed_available(), reason="torch.distributed with gloo needed"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdflash.engine.drafter import write_synthetic_drafter
    from pdflash.models import write_synthetic_checkpoint

    tmp = tmp_path_factory.mktemp(f"ep-{request.param}")
    write_synthetic_checkpoint(
        tmp / "target", request.param, "tiny", num_layers=3, dtype=torch.float32, seed=3
    )
    cfg = json.loads((tmp / "target" / "config.json").read_text())
    write_synthetic_drafter(tmp / "drafter", cfg, "tiny", seed=4, dtype=torch.float32)
    return tmp


def _shape(tmp: Path) -> tuple[int, int]:
    cfg = json.loads((tmp / "target" / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    return int(cfg["num_hidden_layers"]), int(experts)


def _spec(tmp: Path, baseline: str, cache_slots: int) -> GreedyRunSpec:
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((tmp / "target" / "config.json").read_text())["vocab_size"]
    prompts = tuple(tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in (3, 7, 5))
    return GreedyRunSpec(
        target=str(tmp / "target"),
        drafter=str(tmp / "drafter"),
        baseline=baseline,
        prompts=prompts,
        max_new_tokens=8,
        cache_slots=cache_slots,
    )


def test_two_gloo_ranks_match_single_process(checkpoint: Path) -> None:
    # 6 slots per rank: fewer than one rank's share of two consecutive layers,
    # so both ranks evict and copy on demand. One launch runs both baselines.
    specs = [_spec(checkpoint, b, cache_slots=6) for b in ("B1", "PD")]
    # PD again with a frequency-balanced placement of a skewed (measured-like) frequency
    layers, experts = _shape(checkpoint)
    freq = np.random.default_rng(1).zipf(1.5, size=(layers, experts)).astype(np.float64)
    specs.append(dataclasses.replace(specs[1], placement="frequency", frequency=freq))
    # PD with tight per-rank budgets (3-5 experts a link): the scheduler's total
    # (N x M) takes batches that put more than M on one rank, which the repair cuts
    specs += [
        dataclasses.replace(specs[1], rank_budget_experts=k, max_running=3) for k in (3, 4, 5)
    ]
    # PD+host with a forced plan (every other miss of a layer on the host): a
    # rank's host computes from its own store, which packs only its experts
    specs.append(dataclasses.replace(specs[1], baseline="PD+host", host_every=2))
    singles = run_greedy_all(None, specs)
    per_rank = launch(run_greedy_all, 2, specs, device="cpu")
    deferrals = 0
    for i, (spec, single) in enumerate(zip(specs, singles, strict=True)):
        baseline = spec.baseline
        assert [f for f, _ in single["finish"]] == ["length"] * len(spec.prompts)
        assert all(len(o) == spec.max_new_tokens for o in single["outputs"])
        ranks = [got[i] for got in per_rank]
        for r, got in enumerate(ranks):
            assert got["finish"] == single["finish"], (baseline, r)
            assert got["outputs"] == single["outputs"], (baseline, r)
            assert got["pins_left"] == 0
            assert got["resident_foreign"] == 0  # a rank never caches another's experts
            assert got["misses"] > 0 and got["bytes_in"] > 0  # each rank used its own link
            ex = got["exchange"]
            assert ex["rows_remote"] > 0 and ex["rows_received"] > 0
            assert ex["all_to_all_s"] > 0.0
            assert got["residency_syncs"] >= got["steps"] // 2
        # replicated control: every rank made the same decisions
        assert ranks[0]["steps"] == ranks[1]["steps"]
        assert ranks[0]["rank_missing_bytes"] == ranks[1]["rank_missing_bytes"]
        if spec.placement == "frequency":
            assert ranks[0]["placement"] == "frequency_balanced"
        if baseline == "B1":  # FCFS ignores residency: the single process's schedule too
            assert ranks[0]["steps"] == single["steps"]
        else:  # the 2-D scheduler charged missing bytes on both ranks' links
            assert min(ranks[0]["rank_missing_bytes"]) > 0
        books = ranks[0]["rank_books"]
        assert all(r["rank_books"] == books for r in ranks)  # the same cuts everywhere
        assert all(r["batch_sizes"] == ranks[0]["batch_sizes"] for r in ranks)
        if baseline == "B1":
            assert books["rank_byte_budget"] is None and books["rank_budget_deferrals"] == 0
        if spec.rank_budget_experts is not None:
            budget = books["rank_byte_budget"]
            assert budget is not None and budget > 0
            deferrals += books["rank_budget_deferrals"]
            # a cut step is followed by one carry step (no carried request leaves)
            assert books["rank_budget_carry_steps"] == books["rank_budget_repaired_steps"]
            # every executed batch fits M on every rank unless it is one request
            sizes, busiest = ranks[0]["batch_sizes"], ranks[0]["busiest_rank_bytes"]
            assert len(sizes) == len(busiest) > 0
            assert all(b <= budget or n == 1 for n, b in zip(sizes, busiest, strict=True))
        # each link carried only its own experts: less than the one link did
        assert max(r["bytes_in"] for r in ranks) < single["bytes_in"]
        # each rank's host store packed only its own experts: the ranks'
        # stores partition the single process's
        assert single["host_packed_bytes"] == single["host_model_bytes"]
        assert all(r["host_packed_foreign"] == 0 for r in ranks)
        assert sum(r["host_packed_bytes"] for r in ranks) == single["host_packed_bytes"]
        assert max(r["host_packed_bytes"] for r in ranks) < single["host_packed_bytes"]
        if baseline == "PD+host":
            # the host's rows equal the device's: the tokens are plain PD's too
            assert single["outputs"] == singles[1]["outputs"]
            assert single["host_books"]["experts"] > 0
            for got, pd in zip(ranks, (g[1] for g in per_rank), strict=True):
                assert got["host_books"]["experts"] > 0 and got["host_books"]["bytes_saved"] > 0
                # a host-served miss is not copied: fewer bytes than PD's on this rank
                assert got["bytes_in"] < pd["bytes_in"]
    assert deferrals > 0  # the per-rank budget bound (and the greedy tokens held)


def test_every_engine_setting_reaches_each_rank(checkpoint: Path) -> None:
    """A non-default setting the run spec has no field of its own for
    (``host_ahead_min_exposed``, default 0.2) reaches every rank's engine."""
    spec = dataclasses.replace(
        _spec(checkpoint, "PD+host", cache_slots=6),
        host_every=2,
        max_new_tokens=2,
        engine_settings={"host_ahead_min_exposed": 0.5},
    )
    single = run_greedy_all(None, [spec])[0]
    per_rank = launch(run_greedy_all, 2, [spec], device="cpu")
    assert single["config"].host_ahead_min_exposed == 0.5
    assert [got[0]["config"].host_ahead_min_exposed for got in per_rank] == [0.5, 0.5]
    assert all(got[0]["outputs"] == single["outputs"] for got in per_rank)
