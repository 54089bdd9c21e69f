"""transformers' top-k router modules' logits without their routing: the
gate lookahead, the route-ahead proxy and the trace replay need only the
logits, which these routers compute first with one ``F.linear``; their
top-k, softmax and normalisation (and the module call) are skipped. The
logits are the same call on the same tensors, so the same values. Routers
not listed here, and listed ones with hooks, are called as they are."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

#: routers whose forward starts ``F.linear(x, self.weight, self.bias)`` on
#: ``x`` as given
_LINEAR_AS_GIVEN: frozenset[type] = frozenset({modeling_gpt_oss.GptOssTopKRouter})
#: routers whose forward starts ``F.linear(x.reshape(-1, self.hidden_dim), self.weight)``
_LINEAR_FLATTENED: frozenset[type] = frozenset(
    {
        modeling_mixtral.MixtralTopKRouter,
        modeling_olmoe.OlmoeTopKRouter,
        modeling_qwen2_moe.Qwen2MoeTopKRouter,
        modeling_qwen3_moe.Qwen3MoeTopKRouter,
    }
)


def _has_hooks(module: Any) -> bool:
    """The module call would run hooks of its own or global ones."""
    from torch.nn.modules import module as nn_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )


def router_logits_only(router: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``router(x)[0]`` (the logits) of a known router class (not a
    subclass, which may compute otherwise) without its routing, or None:
    call the router."""
    kind = type(router)
    if kind in _LINEAR_AS_GIVEN:
        if _has_hooks(router):
            return None
        return F.linear(x, router.weight, router.bias)
    if kind in _LINEAR_FLATTENED:
        if _has_hooks(router):
            return None
        hidden = int(router.hidden_dim)
        # a 2-D [T, hidden] input is already what the reshape would give
        flat = x if x.dim() == 2 and x.shape[1] == hidden else x.reshape(-1, hidden)
        return F.linear(flat, router.weight)
    return None
