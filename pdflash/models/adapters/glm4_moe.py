"""GLM-4.5 / GLM-4.6 MoE (``glm4_moe``): dense first layers, a shared expert,
DeepSeek-V3-style grouped routing.

Routing (transformers' ``Glm4MoeTopkRouter``, implemented here so it does
not depend on where a transformers version puts it): logits in fp32 with
the fp32 router weight, ``scores = sigmoid(logits)``; the choice adds the
``e_score_correction_bias``; experts are split into ``n_group`` groups, each
group scored by the sum of its two best biased scores, the best
``topk_group`` groups kept, then the top-k biased scores among their
experts are chosen; the weights are the *unbiased* scores of the chosen
experts, renormalised when ``norm_topk_prob`` (+1e-20), times
``routed_scaling_factor`` (fp32). The first ``first_k_dense_replace`` layers
(or the ``"dense"`` entries of ``mlp_layer_types``) have a plain SwiGLU MLP,
kept resident. Every MoE layer adds an ungated shared expert
(``shared_experts``, ``n_shared_experts * moe_intermediate_size`` wide),
kept resident. Attention: optional q/k biases, optional per-head q/k RMSNorm
(``use_qk_norm``), rotate-half rotary over the first ``partial_rotary_factor``
of each head. Multi-token-prediction layers past ``num_hidden_layers`` in a
checkpoint are not used and not loaded.

Chosen over ``deepseek_v3`` for the dense-layer architecture: the routing is
the same, but DeepSeek-V3's multi-head latent attention (low-rank q/kv,
different q/k and v head sizes) has no place in pdflash's attention spec or
paged KV, while GLM's attention is standard GQA.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.glm4_moe import modeling_glm4_moe

from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin
from pdflash.models.adapters.base import UnsupportedConfigError
from pdflash.models.offload import RouteOutput

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeAdapter(SwiGLUExpertsMixin):
    arch = "glm4_moe"
    modeling: ClassVar[Any] = modeling_glm4_moe
    router_attr = "gate"
    hf_block_class = "Glm4MoeMoE"
    shared_expert_attr = "shared_experts"

    @classmethod
    def num_experts_of(cls, config: Any) -> int:
        return int(config.n_routed_experts)

    @classmethod
    def moe_intermediate_size(cls, config: Any) -> int:
        return int(config.moe_intermediate_size)

    @classmethod
    def moe_layer_indices(cls, config: Any) -> list[int]:
        n = int(config.num_hidden_layers)
        kinds = getattr(config, "mlp_layer_types", None)
        if kinds is not None:
            return [i for i, kind in enumerate(kinds[:n]) if kind == "sparse"]
        return list(range(int(getattr(config, "first_k_dense_replace", 0)), n))

    @classmethod
    def validate_config(cls, config: Any) -> None:
        super().validate_config(config)
        e, groups = cls.num_experts_of(config), int(config.n_group)
        if groups < 1 or e % groups or not 1 <= int(config.topk_group) <= groups:
            raise UnsupportedConfigError(
                f"glm4_moe: n_group={groups} must divide the {e} experts and "
                f"1 <= topk_group={config.topk_group} <= n_group"
            )
        per_group = e // groups
        if per_group < 2:
            raise UnsupportedConfigError(
                f"glm4_moe: groups of {per_group} expert(s); group scores sum each group's top 2"
            )
        if int(config.num_experts_per_tok) > int(config.topk_group) * per_group:
            raise UnsupportedConfigError(
                f"glm4_moe: num_experts_per_tok={config.num_experts_per_tok} exceeds the "
                f"{int(config.topk_group) * per_group} experts of the kept groups"
            )

    @classmethod
    def ignore_checkpoint_key(cls, key: str, config: Any) -> bool:
        # multi-token-prediction layers follow the decoder layers
        m = _LAYER_KEY.match(key)
        return m is not None and int(m.group(1)) >= int(config.num_hidden_layers)

    def route_tokens(self, router: nn.Module, x: torch.Tensor) -> RouteOutput:
        cfg = self.config
        e, groups, k = self.num_experts, int(cfg.n_group), self.top_k
        weight, bias = router.weight, router.e_score_correction_bias
        assert isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)
        logits = torch.nn.functional.linear(x.float(), weight.float())
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=int(cfg.topk_group), dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        return logits, weights, ids

    def qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d = x.shape[0], self.head_dim
        q = attn.q_proj(x).view(t, -1, d)
        k = attn.k_proj(x).view(t, -1, d)
        v = attn.v_proj(x).view(t, -1, d)
        if getattr(attn, "use_qk_norm", False):
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v
