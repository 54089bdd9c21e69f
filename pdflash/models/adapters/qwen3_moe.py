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

from pdflash.models.adapters._norms import needs_grad, normalized
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

    def qk_joint(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        """q and k normed as one ``[T, Hq + Hk, D]`` tensor: transformers'
        RMSNorm (the same ops, element by element) with q_norm's weight on
        q's heads and k_norm's on k's, one norm's kernels instead of two."""
        qn, kn = attn.q_norm, attn.k_norm
        norm_cls = modeling_qwen3_moe.Qwen3MoeRMSNorm
        if not (
            type(qn) is norm_cls
            and type(kn) is norm_cls
            and qn.variance_epsilon == kn.variance_epsilon
            and not needs_grad(x, qn.weight, kn.weight)
        ):
            return super().qk_joint(attn, x)
        t, d = x.shape[0], self.head_dim
        q = attn.q_proj(x).view(t, -1, d)
        k = attn.k_proj(x).view(t, -1, d)
        v = attn.v_proj(x).view(t, -1, d)
        qk = normalized(torch.cat([q, k], dim=1), qn.variance_epsilon)
        return self._qk_weight(attn, q.shape[1], k.shape[1]) * qk, q.shape[1], v

    def _qk_weight(self, attn: Any, q_heads: int, k_heads: int) -> torch.Tensor:
        """``[Hq + Hk, D]``: q_norm's weight per q head, then k_norm's per k
        head (kept per attention module while its norms hold the same
        weights; not kept when made inside a CUDA-graph capture, whose
        kernels do not run then)."""
        qw, kw = attn.q_norm.weight, attn.k_norm.weight
        memo: dict[int, tuple[Any, Any, torch.Tensor]] = self.__dict__.setdefault("_qk_w", {})
        held = memo.get(id(attn))
        if (
            held is not None
            and held[0] is qw
            and held[1] is kw
            and held[2].shape[0] == (q_heads + k_heads)
        ):
            return held[2]
        joint = torch.cat([qw.detach().expand(q_heads, -1), kw.detach().expand(k_heads, -1)])
        if not (joint.is_cuda and torch.cuda.is_current_stream_capturing()):
            memo[id(attn)] = (qw, kw, joint)
        return joint
