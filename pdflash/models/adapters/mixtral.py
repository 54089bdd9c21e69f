"""Mixtral (Mixtral-8x7B).

Routing (``MixtralTopKRouter``): softmax in fp32 over all experts, top-k,
always renormalised over the k (equivalent to a softmax over the top-k
logits), weights left in fp32. Hub checkpoints name experts
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) and the
router ``block_sparse_moe.gate``; transformers 5 calls the block ``mlp``.
No q/k norms; rotary is rotate-half.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers.models.mixtral import modeling_mixtral

from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin


class MixtralAdapter(SwiGLUExpertsMixin):
    arch = "mixtral"
    modeling: ClassVar[Any] = modeling_mixtral
    rotary_style = "rotate_half"
    router_attr = "gate"
    hf_block_class = "MixtralSparseMoeBlock"
    hub_expert_prefix = "model.layers.{l}.block_sparse_moe.experts.{e}."
    hub_names = ("w1", "w3", "w2")

    @classmethod
    def checkpoint_to_module_key(cls, key: str) -> str:
        return key.replace(".block_sparse_moe.", ".mlp.")

    @classmethod
    def module_to_checkpoint_key(cls, key: str) -> str:
        return key.replace(".mlp.", ".block_sparse_moe.")
