"""transformers' top-k router modules' logits without their routing: the
gate lookahead, the route-ahead proxy and the trace replay need only the
logits, which these routers compute first with one ``F.linear``; their
top-k, softmax and normalisation (and the module call) are skipped. The
logits are the same call on the same tensors, so the same values. Routers
not listed here, and listed ones with hooks, are called as they are.

transformers' router code changes between its releases (pdflash accepts a
range of them), so the first call per router class also runs the router
and compares the two bit for bit: a class whose logits differ, or that this
transformers does not have, is always called as it is."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe


def _classes(*found: Any) -> frozenset[type]:
    """The router classes this transformers has (None: a release without it)."""
    return frozenset(c for c in found if isinstance(c, type))


#: routers whose forward starts ``F.linear(x, self.weight, self.bias)`` on
#: ``x`` as given
_LINEAR_AS_GIVEN: frozenset[type] = _classes(getattr(modeling_gpt_oss, "GptOssTopKRouter", None))
#: routers whose forward starts ``F.linear(x.reshape(-1, self.hidden_dim), self.weight)``
_LINEAR_FLATTENED: frozenset[type] = _classes(
    getattr(modeling_mixtral, "MixtralTopKRouter", None),
    getattr(modeling_olmoe, "OlmoeTopKRouter", None),
    getattr(modeling_qwen2_moe, "Qwen2MoeTopKRouter", None),
    getattr(modeling_qwen3_moe, "Qwen3MoeTopKRouter", None),
)
#: router class -> whether its shortcut equalled the router's logits on its
#: first call in this process
_CHECKED: dict[type, bool] = {}


def _has_hooks(module: Any) -> bool:
    """The module call would run hooks of its own or global ones."""
    from torch.nn.modules import module as nn_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )


def _shortcut(router: Any, x: torch.Tensor) -> torch.Tensor | None:
    kind = type(router)
    if kind in _LINEAR_AS_GIVEN:
        return F.linear(x, router.weight, router.bias)
    if kind in _LINEAR_FLATTENED:
        hidden = int(router.hidden_dim)
        # a 2-D [T, hidden] input is already what the reshape would give
        flat = x if x.dim() == 2 and x.shape[1] == hidden else x.reshape(-1, hidden)
        return F.linear(flat, router.weight)
    return None


def router_logits_only(router: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``router(x)[0]`` (the logits) of a known router class (not a
    subclass, which may compute otherwise) without its routing, or None:
    call the router. The first call per class checks the shortcut against
    the router (module doc); inside a CUDA graph capture, where that check
    cannot read the device, an unchecked class is called as it is."""
    kind = type(router)
    if kind not in _LINEAR_AS_GIVEN and kind not in _LINEAR_FLATTENED:
        return None
    if _has_hooks(router) or _CHECKED.get(kind) is False:
        return None
    if kind in _CHECKED:
        return _shortcut(router, x)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    logits = _shortcut(router, x)
    expected = router(x)[0]
    same = logits is not None and logits.shape == expected.shape and torch.equal(logits, expected)
    _CHECKED[kind] = same
    return logits if same else None
