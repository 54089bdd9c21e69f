"""A bf16 grouped-GEMM expert forward for training under CUDA autocast.

transformers' grouped_mm experts forward casts the activations to the
weights' dtype, so with fp32 master weights under bf16 autocast the expert
GEMMs (most of a sparse model's FLOPs) would run in fp32 through a slow
path. This forward casts the weights to the autocast dtype instead (the cast
is differentiable: gradients reach the fp32 masters), sorts the routed
(token, expert) pairs by expert and runs one grouped GEMM per projection.
Outside autocast it computes in the weights' dtype, so it is testable
against the eager forward on the CPU.
"""

from __future__ import annotations

from typing import Any

NAME = "pdflash_autocast_grouped_mm"


def _grouped_mm() -> Any:
    import torch

    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError("this torch has no grouped_mm")
    return fn


def autocast_grouped_mm_experts(
    self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> Any:
    """``Qwen3MoeExperts.forward`` replacement (same arguments and result)."""
    import torch

    dev = hidden_states.device.type
    dtype = (
        torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.gate_up_proj.dtype
    )
    num_tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=self.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gmm = _grouped_mm()
    x = hidden_states[token].to(dtype)
    gate_up = gmm(x, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    y = gmm(self.act_fn(gate) * up, self.down_proj.to(dtype).transpose(-2, -1), offs=offs)
    y = y.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, token, y)
    return out.to(hidden_states.dtype)


def use_autocast_grouped_mm(model: Any) -> bool:
    """Switch ``model``'s experts to :func:`autocast_grouped_mm_experts`;
    False (model unchanged) when this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(NAME, autocast_grouped_mm_experts)
    try:
        model.set_experts_implementation(NAME)
    except (AttributeError, ValueError):
        return False
    return True
