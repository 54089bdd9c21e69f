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


#: RMSNorm classes whose arithmetic :class:`StackedRouters` repeats: ``weight
#: * normalized(x)`` (Qwen3-MoE's) and ``(weight * fp32 normalized).to(dtype)``
#: (gpt-oss's), as :func:`pdflash.models.adapters._norms.rms_norm` computes them
_STACKED_NORMS: frozenset[type] = _classes(
    getattr(modeling_qwen3_moe, "Qwen3MoeRMSNorm", None),
    getattr(modeling_gpt_oss, "GptOssRMSNorm", None),
)


class StackedRouters:
    """Every MoE layer's (norm, router) pair over one hidden state in one
    batched product: the route-ahead proxies that feed each layer the same
    residual (the drafter's hidden states, the embeddings) would otherwise run
    ``L`` norm and router calls, a few kernels each, per step.

    The norms are applied exactly as :func:`rms_norm` applies them (the
    normalization once, each layer's weight by broadcasting: the same values),
    the routers as one ``[L, T, H] x [L, H, E]`` batched product (plus each
    bias) instead of ``L`` linear calls: the same products summed in a
    batched kernel's order, so equal to the per-layer logits up to float
    rounding. :meth:`of` builds it only where every layer's norm is one class
    of :data:`_STACKED_NORMS` with one epsilon and every router one known
    linear router class (:data:`_LINEAR_AS_GIVEN`, :data:`_LINEAR_FLATTENED`)
    without hooks, whose shortcut has been checked against the module in this
    process (:func:`router_logits_only`'s first call); else None."""

    def __init__(
        self,
        gpt_oss_norm: bool,
        eps: float,
        norm_weight: torch.Tensor,
        router_weight: torch.Tensor,
        router_bias: torch.Tensor | None,
        sources: list[torch.Tensor],
    ) -> None:
        # the parameters stacked and their versions: a copy made from them is
        # stale once one is replaced or changed in place (:meth:`stale`)
        self._sources = sources
        self._versions = [t._version for t in sources]
        self._with_bias = router_bias is not None
        self.gpt_oss_norm = gpt_oss_norm
        self.eps = eps
        self.norm_weight = norm_weight[:, None, :]  # [L, 1, H]
        self.router_weight_t = router_weight.transpose(1, 2)  # [L, H, E]
        self.router_bias = None if router_bias is None else router_bias[:, None, :]  # [L, 1, E]

    @classmethod
    def of(cls, norms: list[Any], routers: list[Any]) -> StackedRouters | None:
        kinds = {type(n) for n in norms}
        if len(kinds) != 1 or next(iter(kinds)) not in _STACKED_NORMS:
            return None
        eps = {float(n.variance_epsilon) for n in norms}
        router_kinds = {type(r) for r in routers}
        if len(eps) != 1 or len(router_kinds) != 1:
            return None
        kind = next(iter(router_kinds))
        if kind not in _LINEAR_AS_GIVEN and kind not in _LINEAR_FLATTENED:
            return None
        if _CHECKED.get(kind) is not True or any(_has_hooks(r) for r in routers):
            return None
        # only routers whose shortcut adds their bias (F.linear as given) stack one
        present = [r.bias for r in routers if kind in _LINEAR_AS_GIVEN and r.bias is not None]
        if present and len(present) != len(routers):
            return None
        with torch.no_grad():
            return cls(
                next(iter(kinds)) is getattr(modeling_gpt_oss, "GptOssRMSNorm", None),
                eps.pop(),
                torch.stack([n.weight.detach() for n in norms]),
                torch.stack([r.weight.detach() for r in routers]),
                torch.stack([b.detach() for b in present]) if present else None,
                _parameters(norms, routers, bool(present)),
            )

    def stale(self, norms: list[Any], routers: list[Any]) -> bool:
        """Whether a stacked parameter was replaced or changed since, or a
        router has gained hooks (then it must be called)."""
        now = _parameters(norms, routers, self._with_bias)
        return (
            len(now) != len(self._sources)
            or any(
                a is not b or a._version != v
                for a, b, v in zip(now, self._sources, self._versions, strict=False)
            )
            or any(_has_hooks(r) for r in routers)
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[L, T, E]``: layer ``l``'s router logits of its norm of ``hidden [T, H]``."""
        from pdflash.models.adapters._norms import normalized, normalized_fp32

        layers, width = self.norm_weight.shape[0], hidden.shape[-1]
        if self.gpt_oss_norm:
            normed = torch.mul(
                self.norm_weight,
                normalized_fp32(hidden, self.eps)[None],
                out=torch.empty(
                    (layers, hidden.shape[0], width), dtype=hidden.dtype, device=hidden.device
                ),
            )
        else:
            normed = self.norm_weight * normalized(hidden, self.eps)[None]
        if self.router_bias is None:
            return torch.bmm(normed, self.router_weight_t)
        bias = self.router_bias.expand(layers, hidden.shape[0], -1)
        return torch.baddbmm(bias, normed, self.router_weight_t)


def _parameters(norms: list[Any], routers: list[Any], with_bias: bool) -> list[torch.Tensor]:
    """The parameters :class:`StackedRouters` stacks: the norms' weights, the
    routers' weights and, ``with_bias``, their biases, in order."""
    out = [n.weight for n in norms] + [r.weight for r in routers]
    return out + [r.bias for r in routers] if with_bias else out
