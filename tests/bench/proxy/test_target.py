"""The cpu-tiny proxy target: trains, its loss falls, its checkpoint loads with
transformers and with pdflash's qwen3_moe adapter, provenance and routing
statistics are written; the wall-clock schedule and routing statistics."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pdflash.bench.proxy import routing_stats
from pdflash.bench.proxy.target import (
    heldout_prompts,
    lr_at,
    switch_load_balance_loss,
    weights_sha256,
)

from .conftest import TARGET_STEPS


def test_training_lowers_the_loss_and_records_provenance(
    trained_target: tuple[Path, dict[str, Any]],
) -> None:
    path, prov = trained_target
    assert prov["steps"] == TARGET_STEPS
    assert prov["final_heldout_loss"] < prov["initial_heldout_loss"] - 0.5
    log = [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]
    train = [r["train_loss"] for r in log if "train_loss" in r]
    assert train[-1] < train[0]
    cfg = json.loads((path / "config.json").read_text())
    rec = cfg["pdflash_proxy"]
    for key in (
        "corpus_manifest_sha256",
        "tokenizer_sha256",
        "preset",
        "steps",
        "tokens_seen",
        "train_wall_s",
        "final_train_loss",
        "final_heldout_loss",
        "torch",
        "transformers",
        "device",
    ):
        assert rec[key] is not None, key
    assert rec["tokens_seen"] == TARGET_STEPS * rec["preset_settings"]["batch_size"] * 64
    man = json.loads((path / "corpus_manifest.json").read_text())
    assert man["manifest_sha256"] == rec["corpus_manifest_sha256"]
    assert json.loads((path / "provenance.json").read_text())["weights_sha256"] == weights_sha256(
        path
    )
    stats = json.loads((path / "routing_stats.json").read_text())
    assert len(stats["layers"]) == cfg["num_hidden_layers"]
    assert stats["published"] is None  # no unsourced published figure


def test_checkpoint_loads_with_transformers_and_pdflash(
    trained_target: tuple[Path, dict[str, Any]],
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    path, _ = trained_target
    tok = AutoTokenizer.from_pretrained(str(path))
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2)
    ids = torch.tensor(tok("import os\nfor x in range(3):\n    print(x)\n").input_ids)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    issuer = H2DIssuer(backend="host")
    try:
        adapter = load_adapter(path, issuer=issuer)
        assert (adapter.num_experts, adapter.top_k) == (16, 4)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        torch.testing.assert_close(adapter.forward_logits(ids), ref, rtol=1e-5, atol=1e-5)
        adapter.close()
    finally:
        issuer.close()


def test_heldout_prompts_are_deterministic_and_disjoint_by_role(
    trained_target: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = trained_target
    draft = heldout_prompts(path, "draft", 6, 16, 8)
    evalp = heldout_prompts(path, "eval", 6, 16, 8)
    assert draft and evalp
    assert all(len(p) == 16 for p, _ in draft + evalp)
    assert draft == heldout_prompts(path, "draft", 6, 16, 8)
    assert {s.split(":")[0] for _, s in draft}.isdisjoint({s.split(":")[0] for _, s in evalp})


def test_lr_schedule_follows_the_clock() -> None:
    assert lr_at(0.0, 1.0, 0.1, 0.1) == pytest.approx(0.01)
    assert lr_at(0.05, 1.0, 0.1, 0.1) == pytest.approx(0.5)
    assert lr_at(0.1, 1.0, 0.1, 0.1) == pytest.approx(1.0)
    assert lr_at(1.0, 1.0, 0.1, 0.1) == pytest.approx(0.1)
    mids = [lr_at(f, 1.0, 0.1, 0.1) for f in np.linspace(0.1, 1.0, 20)]
    assert all(a >= b for a, b in itertools.pairwise(mids))


def test_time_budget_stops_training(tmp_path: Path) -> None:
    import time

    from pdflash.bench.proxy.target import train_target

    from .conftest import stdlib_roots, tiny_target_preset

    t0 = time.perf_counter()
    prov = train_target(
        tiny_target_preset(),
        tmp_path / "t",
        tmp_path / "w",
        roots=stdlib_roots(),
        time_budget_s=1.0,
        log=lambda _m: None,
    )
    assert prov["train_wall_s"] < 3.0 and prov["steps"] >= 1
    assert time.perf_counter() - t0 < 20.0
    assert (tmp_path / "t" / "model.safetensors").is_file()


def test_load_balance_loss_is_per_layer() -> None:
    E, K, T = 8, 2, 64
    peaked = torch.full((T, E), -30.0)
    balanced = torch.zeros(T, E)  # uniform router: every expert equally likely
    balanced[torch.arange(T), (torch.arange(T) * K) % E] = 1e-3  # distinct top-k per token
    balanced[torch.arange(T), (torch.arange(T) * K + 1) % E] = 1e-3
    assert float(switch_load_balance_loss([balanced], E, K)) == pytest.approx(K, rel=1e-3)
    # layer 0 uses experts 0-1 only, layer 1 experts 2-3 only: concatenated over
    # layers (transformers' function) half of that imbalance cancels out
    first, second = peaked.clone(), peaked.clone()
    first[:, :2] = 0.0
    second[:, 2:4] = 0.0
    per_layer = float(switch_load_balance_loss([first, second], E, K))
    assert per_layer == pytest.approx(E, rel=1e-3)  # each layer as collapsed as can be
    concatenated = float(switch_load_balance_loss([torch.cat([first, second])], E, K))
    assert concatenated == pytest.approx(E / 2, rel=1e-3)
    # and it trains the router: descent raises the idle experts' logits
    logits = torch.full((T, E), -1.0)
    logits[:, :2] = 0.0
    logits.requires_grad_(True)
    switch_load_balance_loss([logits], E, K).backward()
    assert logits.grad is not None and bool((logits.grad[:, 2:] < 0).all())


def test_routing_stats_on_known_routing() -> None:
    E, k = 8, 2
    # every token routes to experts {0, 1}: union 2, repeat 1, entropy log2/log8
    same = np.tile(np.array([[[0, 1]]]), (64, 1, 1))
    row = routing_stats.layer_stats(same, E)[0]
    assert row["block_union_16"] == 2.0 and row["repeat_rate"] == 1.0
    assert row["load_entropy"] == pytest.approx(np.log(2) / np.log(8))
    assert row["block_union_16_vs_iid_load"] == pytest.approx(1.0)  # iid with that load: same
    # tokens cycling over disjoint pairs: no repeats, a 4-token block touches all 8
    cyc = np.array([[[2 * (t % 4), 2 * (t % 4) + 1]] for t in range(64)])
    row = routing_stats.layer_stats(cyc, E, block_sizes=(4,))[0]
    assert row["repeat_rate"] == 0.0 and row["block_union_4"] == 8.0
    assert row["load_entropy"] == pytest.approx(1.0)
    assert row["block_union_4_vs_iid_uniform"] == pytest.approx(8 / (E * (1 - (1 - k / E) ** 4)))


def test_autocast_grouped_mm_experts_match_eager() -> None:
    from pdflash.bench.proxy import experts
    from pdflash.bench.proxy.presets import target_preset
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**target_preset("cpu-tiny").model_config()))
    model.set_experts_implementation("eager")
    ids = torch.randint(3, 512, (2, 24))
    ref = model(input_ids=ids).logits
    ref.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "experts" in n}
    model.zero_grad()
    calls = []
    inner = experts.autocast_grouped_mm_experts

    def counted(*a: Any) -> Any:
        calls.append(1)
        return inner(*a)

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert experts.use_autocast_grouped_mm(model)
    ALL_EXPERTS_FUNCTIONS.register(experts.NAME, counted)
    try:
        out = model(input_ids=ids).logits
    finally:
        ALL_EXPERTS_FUNCTIONS.register(experts.NAME, inner)
    assert len(calls) == 4  # one per layer: the replacement really ran
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    for n, p in model.named_parameters():
        if "experts" in n:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(input_ids=ids).logits
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.1
