"""Target and drafter presets, from a laptop CPU to one H200.

``gpu``: qwen3_moe with 8 layers, hidden 512, 128 experts top-8 and expert
width 192 (Qwen3-30B-A3B's expert count, top-k and expert-width/hidden ratio
768/2048), vocabulary 16384: ~42M active parameters (of which 16.8M are the
embedding and LM head), ~330M in total. ``cpu-tiny``: the same structure
shrunk until a laptop CPU trains it in a couple of minutes; the tests run it
with a budget of seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TargetPreset:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    seq_len: int
    batch_size: int  # sequences per step
    lr: float
    weight_decay: float
    warmup_frac: float  # of the time budget
    min_lr_frac: float
    router_aux_coef: float  # load-balance loss weight
    router_z_coef: float  # router z-loss weight
    time_budget_s: float
    heldout_permille: int
    max_corpus_bytes: int | None
    tokenizer_train_bytes: int
    eval_every_s: float
    eval_windows: int  # held-out windows for the held-out loss and routing stats
    save_dtype: str

    def model_config(self) -> dict[str, Any]:
        """Qwen3MoeConfig keyword arguments."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": 4 * self.hidden_size,  # unused: every layer is MoE
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": max(4096, 4 * self.seq_len),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "router_aux_loss_coef": self.router_aux_coef,
            "bos_token_id": None,
            "eos_token_id": 0,
            "pad_token_id": 1,
        }

    def active_params(self) -> int:
        h, layers = self.hidden_size, self.num_layers
        attn = h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        experts = self.top_k * 3 * h * self.moe_intermediate_size
        router = self.num_experts * h
        return layers * (attn + experts + router) + 2 * self.vocab_size * h

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DrafterPreset:
    name: str
    num_layers: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...] | None  # None: z-lab's default spacing
    loss_decay_gamma: float  # weight of block row k: exp(-(k - 1) / gamma)
    anchors_per_seq: int
    batch_size: int  # sequences per step
    lr: float
    warmup_frac: float
    time_budget_s: float
    data_prompts: int  # held-out "draft" prompts the target continues
    prompt_len: int
    continuation_len: int
    data_temperature: float
    gen_batch: int
    eval_prompts: int
    eval_new_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


TARGET_PRESETS: dict[str, TargetPreset] = {
    "cpu-tiny": TargetPreset(
        name="cpu-tiny",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=16,
        top_k=4,
        moe_intermediate_size=32,
        seq_len=64,
        batch_size=16,
        lr=3e-3,
        weight_decay=0.01,
        warmup_frac=0.05,
        min_lr_frac=0.1,
        router_aux_coef=0.01,
        router_z_coef=1e-3,
        time_budget_s=120.0,
        heldout_permille=50,
        max_corpus_bytes=4 << 20,
        tokenizer_train_bytes=1 << 20,
        eval_every_s=30.0,
        eval_windows=32,
        save_dtype="float32",
    ),
    "gpu": TargetPreset(
        name="gpu",
        vocab_size=16384,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=192,
        seq_len=512,
        batch_size=128,
        lr=2e-3,
        weight_decay=0.05,
        warmup_frac=0.05,
        min_lr_frac=0.1,
        router_aux_coef=0.01,
        router_z_coef=1e-3,
        time_budget_s=240.0,
        heldout_permille=20,
        max_corpus_bytes=256 << 20,
        tokenizer_train_bytes=32 << 20,
        eval_every_s=60.0,
        eval_windows=128,
        save_dtype="bfloat16",
    ),
}

DRAFTER_PRESETS: dict[str, DrafterPreset] = {
    "cpu-tiny": DrafterPreset(
        name="cpu-tiny",
        num_layers=2,
        intermediate_size=128,
        block_size=8,
        target_layer_ids=(1, 2),
        loss_decay_gamma=4.0,
        anchors_per_seq=8,
        batch_size=8,
        lr=3e-3,
        warmup_frac=0.05,
        time_budget_s=60.0,
        data_prompts=512,
        prompt_len=32,
        continuation_len=64,
        data_temperature=1.0,
        gen_batch=128,
        eval_prompts=4,
        eval_new_tokens=48,
    ),
    "gpu": DrafterPreset(
        name="gpu",
        num_layers=3,
        intermediate_size=1536,
        block_size=16,
        target_layer_ids=None,
        loss_decay_gamma=7.0,
        anchors_per_seq=32,
        batch_size=32,
        lr=1e-3,
        warmup_frac=0.05,
        time_budget_s=140.0,
        data_prompts=3072,
        prompt_len=128,
        continuation_len=256,
        data_temperature=1.0,
        gen_batch=512,
        eval_prompts=16,
        eval_new_tokens=192,
    ),
}


def target_preset(name: str) -> TargetPreset:
    try:
        return TARGET_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown target preset {name!r}; choose from {sorted(TARGET_PRESETS)}"
        ) from None


def drafter_preset(name: str) -> DrafterPreset:
    try:
        return DRAFTER_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown drafter preset {name!r}; choose from {sorted(DRAFTER_PRESETS)}"
        ) from None
