"""OLMoE (OLMoE-1B-7B).

Routing (``OlmoeTopKRouter``): softmax in fp32 over all experts, top-k,
renormalised only when ``norm_topk_prob`` (False for OLMoE-1B-7B). Attention:
RMSNorm over the *whole* q and k projections (``q_norm`` of size
``hidden``, ``k_norm`` of size ``kv_heads * head_dim``), then the optional
``clip_qkv`` clamp of q, k, v, then rotary (rotate-half).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.models.olmoe import modeling_olmoe

from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin


class OlmoeAdapter(SwiGLUExpertsMixin):
    arch = "olmoe"
    modeling: ClassVar[Any] = modeling_olmoe
    rotary_style = "rotate_half"
    router_attr = "gate"
    hf_block_class = "OlmoeSparseMoeBlock"

    @classmethod
    def num_experts_of(cls, config: Any) -> int:
        return int(config.num_experts)

    def qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d = x.shape[0], self.head_dim
        q = attn.q_norm(attn.q_proj(x))
        k = attn.k_norm(attn.k_proj(x))
        v = attn.v_proj(x)
        clip = getattr(self.config, "clip_qkv", None)
        if clip is not None:
            q, k, v = (z.clamp(min=-clip, max=clip) for z in (q, k, v))
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
