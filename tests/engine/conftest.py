"""Fixtures for the engine tests: a tiny random HF Qwen3-MoE target behind a
private resident :class:`MoEModelAdapter`, and a tiny synthetic drafter."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from pdflash.engine.drafter import DFlashDrafter, load_drafter, write_synthetic_drafter
from pdflash.engine.engine import Engine
from pdflash.protocols import AttentionSpec

TINY = {
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class HFQwen3MoeAdapter:
    """Resident-expert adapter over ``transformers``' Qwen3MoeForCausalLM (tests only)."""

    arch = "qwen3_moe"

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.head_dim = cfg.head_dim
        self.expert_nbytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
        self.dtype = torch.float32
        self._layers = model.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].input_layernorm(hidden)

    def attention_spec(self, layer: int) -> AttentionSpec:
        c = self.config
        return AttentionSpec(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim**-0.5, None, False
        )

    def project_qkv(
        self, layer: int, normed: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = self._layers[layer].self_attn
        t, d = normed.shape[0], self.head_dim
        q = attn.q_norm(attn.q_proj(normed).view(t, -1, d))
        k = attn.k_norm(attn.k_proj(normed).view(t, -1, d))
        v = attn.v_proj(normed).view(t, -1, d)
        cos, sin = self.model.model.rotary_emb(normed[None], positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attention_sinks(self, layer: int) -> torch.Tensor | None:
        return None

    def project_out(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].self_attn.o_proj(attn)

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].post_attention_layernorm(hidden)

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        return F.linear(normed, self._layers[layer].mlp.gate.weight)

    def route(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, scores, ids = self._layers[layer].mlp.gate(normed)
        return ids, scores

    def moe(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._layers[layer].mlp(normed[None])[0]
        return out

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def make_hf_target(seed: int = 0, **overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                # large enough that logits are far from ties (greedy is stable)
                p.normal_(0.0, 0.35 if p.dim() > 1 else 0.1)
    return model


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    # NOTE: tiny ops on a shared 2-core machine run 20-50x slower with torch's
    # default thread pool (oversubscription); one thread keeps the suite fast.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_target() -> Any:
    return make_hf_target()


@pytest.fixture(scope="session")
def adapter(hf_target: Any) -> HFQwen3MoeAdapter:
    return HFQwen3MoeAdapter(hf_target)


@pytest.fixture(scope="session")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> DFlashDrafter:
    path: Path = tmp_path_factory.mktemp("drafter")
    write_synthetic_drafter(path, TINY, "tiny", seed=1, dtype=torch.float32)
    return load_drafter(path, dtype=torch.float32)


def write_target_and_drafter(
    tmp: Path, arch: str, num_layers: int, *, target_seed: int = 3, drafter_seed: int = 4
) -> None:
    """A tiny fp32 ``arch`` target under ``tmp/target`` and its synthetic
    drafter under ``tmp/drafter`` (the offloaded engine tests' pair)."""
    from pdflash.models import write_synthetic_checkpoint

    write_synthetic_checkpoint(
        tmp / "target", arch, "tiny", num_layers=num_layers, dtype=torch.float32, seed=target_seed
    )
    cfg = json.loads((tmp / "target" / "config.json").read_text())
    write_synthetic_drafter(tmp / "drafter", cfg, "tiny", seed=drafter_seed, dtype=torch.float32)


def layer_cyclic_offload(target: Path, num_slots: int) -> tuple[Any, Any, Any]:
    """The ``target`` checkpoint offloaded on the CPU: ``(adapter, issuer,
    cache)``, the issuer on its host backend, the cache ``num_slots`` slots
    for one token per forward with the layer-cyclic eviction policy (the
    bench's ``auto`` for every offloaded baseline)."""
    from pdflash.cache import ExpertCache
    from pdflash.cache.eviction import LayerCyclicPolicy
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    issuer = H2DIssuer(backend="host")
    adapter = load_adapter(target, device="cpu")
    cache = ExpertCache(
        adapter.store,
        issuer,
        device="cpu",
        num_slots=num_slots,
        top_k=adapter.top_k,
        max_batch_tokens=1,
        policy=LayerCyclicPolicy(adapter.num_layers, adapter.num_experts),
    )
    adapter.attach_cache(cache)
    return adapter, issuer, cache


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A 4-layer qwen3_moe target and its drafter written to a fresh folder,
    and four greedy cases on it (prompt, reference output of 14 tokens)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("offloaded")
    write_target_and_drafter(tmp, "qwen3_moe", 4)
    return tmp, greedy_cases(tmp / "target", (3, 9, 6, 5), 14, seed=1)


def offloaded_pd_engine(
    tmp: Path, baseline: str, controller: Any | None, **changes: Any
) -> tuple[Engine, Any]:
    """An engine of ``baseline`` on the :func:`offloaded` target: a
    six-slot layer-cyclic cache, blocks of 5, four live requests, 12 tokens a
    step, the 2-D scheduler with a token-only shadow and a byte budget of
    three experts (it splits batches the token-only one keeps), the union of
    the approximate router and the previous round as predictor, ``controller``
    (a ``PartsPolicy``, or None: the preset's) and the configuration changed
    by ``changes``. Returns ``(engine, issuer)``: close the issuer after."""
    from pdflash.engine.batching import DeficitBatcher, ShadowComparison
    from pdflash.engine.config import EngineConfig
    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.routeahead import ApproxRouterPredictor, PreviousRoundPredictor

    adapter, issuer, cache = layer_cyclic_offload(tmp / "target", num_slots=6)
    config = EngineConfig.preset(baseline, block_size=5, max_running=4, token_budget=12)

    def deficit(budget: int | None) -> DeficitBatcher:
        return DeficitBatcher(
            token_budget=config.token_budget,
            byte_budget=budget,
            num_layers=adapter.num_layers,
            num_experts=adapter.num_experts,
            expert_nbytes=cache.expert_nbytes,
        )

    batcher = ShadowComparison(deficit(3 * cache.expert_nbytes), deficit(None), cache.expert_nbytes)
    predictor = BatchedUnionPredictor(
        [
            (ApproxRouterPredictor(adapter), 1.0),
            (PreviousRoundPredictor(adapter.num_layers, adapter.num_experts), 0.5),
        ]
    )
    eng = Engine(
        adapter,
        config.replace(byte_budget=3 * cache.expert_nbytes, **changes),
        drafter=load_drafter(tmp / "drafter"),
        batcher=batcher,
        predictor=predictor,
        expert_cache=cache,
        max_seq_len=64,
        controller=controller,
    )
    return eng, issuer


def random_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of 3 to 11 random token ids (lengths and ids drawn from
    one generator seeded ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 12, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def greedy_cases(
    target: Path, lengths: Sequence[int], max_new_tokens: int, *, seed: int
) -> list[tuple[list[int], list[int]]]:
    """Random prompts of ``lengths`` (drawn in order from one generator
    seeded ``seed``) with the ``target`` checkpoint's plain greedy
    continuations (:func:`greedy_reference`, fp32)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for n in lengths:
        prompt = torch.randint(0, ref.config.vocab_size, (n,), generator=gen).tolist()
        cases.append((prompt, greedy_reference(ref, prompt, max_new_tokens)))
    return cases


@torch.no_grad()
def greedy_reference(
    model: Any, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """Plain greedy autoregressive decoding with full recompute (no KV cache)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids:
            break
    return out


def oracle_drafts(engine: Engine, refs: dict[int, list[int]], seed: int) -> None:
    """Replace the (random-weight) drafter's guesses with the reference
    continuation corrupted at a random position, so verify accepts long
    prefixes, rejects mid-block and rolls back — through the real code path."""
    original = engine._draft
    gen = torch.Generator().manual_seed(seed)

    def draft(reqs: list[Any]) -> None:
        original(reqs)
        for req in reqs:
            n = 0 if req.drafts is None else int(req.drafts.numel())
            if n == 0:
                continue
            done = len(req.output)
            truth = refs[req.request_id][done : done + n]
            drafts = torch.tensor(truth + [0] * (n - len(truth)), dtype=torch.int64)
            cut = int(torch.randint(0, n + 1, (1,), generator=gen))
            if cut < n:
                drafts[cut] = (drafts[cut] + 1) % engine.adapter.vocab_size
            req.drafts = drafts

    engine._draft = draft  # type: ignore[method-assign]


def make_batcher_and_predictor(
    config: Any, adapter: Any, byte_budget: int | None = None
) -> tuple[Any, Any]:
    """The deficit batcher (B2 token-only, PD 2-D) and PD's route-ahead predictor."""
    from pdflash.engine.batching import DeficitBatcher
    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.routeahead import ApproxRouterPredictor, PreviousRoundPredictor

    batcher = None
    if config.batching != "fcfs":
        if config.batching == "deficit_2d" and byte_budget is None:
            byte_budget = 6 * adapter.expert_nbytes  # binds: a 6-token block routes to more
        batcher = DeficitBatcher(
            token_budget=config.token_budget,
            byte_budget=byte_budget if config.batching == "deficit_2d" else None,
            num_layers=adapter.num_layers,
            num_experts=adapter.num_experts,
            expert_nbytes=adapter.expert_nbytes,
        )
    predictor = None
    if config.route_ahead:
        predictor = BatchedUnionPredictor(
            [
                (ApproxRouterPredictor(adapter), 1.0),
                (PreviousRoundPredictor(adapter.num_layers, adapter.num_experts), 0.5),
            ]
        )
    return batcher, predictor
