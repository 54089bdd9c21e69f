"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B).

Routing (``Qwen3MoeTopKRouter``): softmax over all experts in fp32, top-k of
the probabilities, renormalised over the k when ``norm_topk_prob``, cast back
to the logits dtype. Attention: RMSNorm over each head's q and k (``q_norm``,
``k_norm`` of size ``head_dim``) before rotary (rotate-half).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin
from pdflash.models.adapters.base import UnsupportedConfigError


class Qwen3MoeAdapter(SwiGLUExpertsMixin):
    arch = "qwen3_moe"
    modeling: ClassVar[Any] = modeling_qwen3_moe
    rotary_style = "rotate_half"
    router_attr = "gate"
    hf_block_class = "Qwen3MoeSparseMoeBlock"

    @classmethod
    def num_experts_of(cls, config: Any) -> int:
        return int(config.num_experts)

    @classmethod
    def moe_intermediate_size(cls, config: Any) -> int:
        return int(config.moe_intermediate_size)

    @classmethod
    def validate_config(cls, config: Any) -> None:
        super().validate_config(config)
        dense = list(getattr(config, "mlp_only_layers", []) or [])
        step = int(getattr(config, "decoder_sparse_step", 1))
        if dense or step != 1:
            raise UnsupportedConfigError(
                f"qwen3_moe config has dense (non-MoE) layers (mlp_only_layers={dense}, "
                f"decoder_sparse_step={step}); the qwen3_moe adapter runs all-MoE configs only"
            )

    def qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d = x.shape[0], self.head_dim
        q = attn.q_norm(attn.q_proj(x).view(t, -1, d))
        k = attn.k_norm(attn.k_proj(x).view(t, -1, d))
        v = attn.v_proj(x).view(t, -1, d)
        return q, k, v
