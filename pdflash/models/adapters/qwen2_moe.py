"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Routing (``Qwen2MoeTopKRouter``): softmax over all experts in fp32, top-k,
renormalised over the k when ``norm_topk_prob``, cast back to the logits
dtype. A shared expert (``shared_expert``, a SwiGLU MLP of
``shared_expert_intermediate_size``) runs on every token, scaled by
``sigmoid(shared_expert_gate(x))``, and is added to the routed output; it
stays resident on the device. Layers in ``mlp_only_layers`` (or off the
``decoder_sparse_step``) are dense. Attention: q/k/v biases, no q/k norms,
rotate-half rotary.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers.models.qwen2_moe import modeling_qwen2_moe

from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin


class Qwen2MoeAdapter(SwiGLUExpertsMixin):
    arch = "qwen2_moe"
    modeling: ClassVar[Any] = modeling_qwen2_moe
    rotary_style = "rotate_half"
    router_attr = "gate"
    hf_block_class = "Qwen2MoeSparseMoeBlock"
    shared_expert_attr = "shared_expert"
    shared_expert_gate_attr = "shared_expert_gate"

    @classmethod
    def num_experts_of(cls, config: Any) -> int:
        return int(config.num_experts)

    @classmethod
    def moe_intermediate_size(cls, config: Any) -> int:
        return int(config.moe_intermediate_size)

    @classmethod
    def moe_layer_indices(cls, config: Any) -> list[int]:
        # the rule of Qwen2MoeDecoderLayer
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1))
        return [
            i
            for i in range(int(config.num_hidden_layers))
            if i not in dense and (i + 1) % step == 0
        ]

    def sliding_window(self, layer: int) -> int | None:
        # the config's sliding_window applies only to "sliding_attention" layers
        kinds = getattr(self.config, "layer_types", None)
        if kinds is None or kinds[layer] != "sliding_attention":
            return None
        return int(self.config.sliding_window)
