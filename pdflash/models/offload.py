"""The offloaded MoE block: route, fetch the union of routed experts into the
cache, compute each distinct expert once over its tokens, scatter back.

:class:`OffloadedMoE` runs any layer of one model given its routing;
:class:`OffloadedMoEBlock` is an ``nn.Module`` that replaces a Hugging Face
sparse MoE block (it keeps the HF router submodule under its original name,
so the checkpoint's router weights load into it), and
:func:`install_offloaded_blocks` swaps every block of an HF model, so a plain
HF forward runs with experts offloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pdflash.cache.expert_cache import CacheTooSmallError, ExpertCache

if TYPE_CHECKING:
    from pdflash.hybrid.block import HostPart
    from pdflash.hybrid.service import HostExpertService
    from pdflash.models.store import ExpertStore

#: ``hook(layer, topk_ids)``: called with each layer's exact routing
#: (``[T, k]`` int64, on the compute device) before its experts are fetched,
#: so a prefetcher can submit copies for later layers.
RouteHook = Callable[[int, torch.Tensor], None]
ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


class OffloadedMoE:
    """Offloaded expert execution for every MoE layer of one model.

    Args:
        store: the packed host experts (gives the layout for slot views).
        cache: the device expert cache (its slots are filled from ``store``).
        expert_fn: ``(x [n, H], weights) -> [n, H]``, one expert's MLP over
            views of its packed tensors (the adapter's ``expert_forward``).
    """

    def __init__(self, store: ExpertStore, cache: ExpertCache, expert_fn: ExpertFn) -> None:
        if cache.expert_nbytes != store.expert_nbytes:
            raise ValueError(
                f"cache slots are {cache.expert_nbytes} bytes but the store packs "
                f"{store.expert_nbytes} bytes per expert"
            )
        self.store = store
        self.cache = cache
        self.expert_fn = expert_fn
        self.num_experts = store.num_experts
        self.route_hooks: list[RouteHook] = []
        #: the hybrid miss service (:mod:`pdflash.hybrid`): when set, the
        #: host CPU computes the layer's misses it chooses (None: every miss
        #: is copied)
        self.host_service: HostExpertService | None = None
        # NOTE: views per slot are built once; a slot's bytes change, its views do not.
        self._slot_views = [
            store.layout.views(cache.slot_tensor(s)) for s in range(cache.num_slots)
        ]

    def add_route_hook(self, hook: RouteHook) -> Callable[[], None]:
        """Register ``hook(layer, topk_ids)``; returns a function that removes it."""
        self.route_hooks.append(hook)

        def remove() -> None:
            if hook in self.route_hooks:
                self.route_hooks.remove(hook)

        return remove

    def forward_routed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The MoE output ``[T, H]`` of ``x [T, H]`` under the given routing."""
        for hook in self.route_hooks:
            hook(layer, topk_ids)
        num_tokens, k = topk_ids.shape
        if num_tokens == 0:
            return torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        counts_host = counts.cpu().numpy()  # the one host sync: routing decides the copies
        experts = np.flatnonzero(counts_host)
        # NOTE: per-expert work is kept to the expert's own MLP: the tokens are
        # gathered in expert order once and split into one view per expert,
        # the outputs are concatenated once, and the routing weights and the
        # scatter back to tokens are applied once per layer, not per expert.
        # Each token's k rows are distinct, so the un-permute is a plain
        # (deterministic) indexed write; the k-way weighted sum is one
        # reduction in the routing weights' precision, rounded to x's dtype once.
        x_parts = x[order // k].split(counts_host[experts].tolist())
        y_parts: list[torch.Tensor | None] = [None] * int(experts.size)
        host_part = self._start_host_part(layer, x, flat, k, experts, counts_host)
        todo = np.arange(experts.size)  # positions in `experts` computed here
        if host_part is not None:
            todo = np.flatnonzero(~host_part.mask)
            for p in np.flatnonzero(host_part.mask).tolist():
                # NOTE: a placeholder of the right shape (no allocation); the
                # host's rows overwrite these rows below
                y_parts[p] = x_parts[p]
        try:
            self._compute_on_device(layer, experts, todo, x_parts, y_parts)
        except BaseException:
            if host_part is not None:
                host_part.cancel()
            raise
        y_sorted = torch.cat(y_parts)  # type: ignore[arg-type]  # every entry set above
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        if host_part is not None:
            y[host_part.rows] = host_part.result().to(y.dtype)
        weighted = y.view(num_tokens, k, -1) * topk_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(x.dtype)

    def _start_host_part(
        self,
        layer: int,
        x: torch.Tensor,
        flat: torch.Tensor,
        k: int,
        experts: np.ndarray,
        counts_host: np.ndarray,
    ) -> HostPart | None:
        """The hybrid hook: start the host on the misses the service picks."""
        if self.host_service is None:
            return None
        from pdflash.hybrid.block import start_host_part

        return start_host_part(
            self.host_service, self.cache, layer, x, flat, k, experts, counts_host
        )

    def _compute_on_device(
        self,
        layer: int,
        experts: np.ndarray,
        todo: np.ndarray,
        x_parts: Sequence[torch.Tensor],
        y_parts: list[torch.Tensor | None],
    ) -> None:
        """Pin/copy/compute ``experts[todo]`` from the cache, into ``y_parts``."""
        base = layer * self.num_experts
        cache = self.cache
        i = 0
        while i < todo.size:
            room = cache.free_capacity()
            if room <= 0:  # every slot pinned or still being filled by a copy
                # NOTE: wait for in-flight copies to land (they settle or free
                # their slots) instead of failing; only a cache whose every
                # slot is pinned with nothing in flight is too small.
                room = cache.wait_for_capacity()
            if room <= 0:
                raise CacheTooSmallError(
                    f"layer {layer}: no expert slot is free or evictable "
                    f"({cache.num_slots} slots, all pinned with no copy in flight)"
                )
            pos = todo[i : i + room]
            flat_ids = base + experts[pos]
            slots, tickets = cache.acquire(flat_ids)
            # NOTE: ready experts first, then the missing ones in submission
            # order, each waited on just before use: copy j+1 overlaps compute j.
            # A ready expert (ticket -1) needs no wait call at all.
            schedule = np.argsort(tickets, kind="stable").tolist()
            slot_list, ticket_list, pos_list = slots.tolist(), tickets.tolist(), pos.tolist()
            try:
                for j in schedule:
                    if ticket_list[j] >= 0:
                        cache.wait_ready(tickets[j : j + 1])
                    p = pos_list[j]
                    y_parts[p] = self.expert_fn(x_parts[p], self._slot_views[slot_list[j]])
            except BaseException:
                cache.abort(flat_ids)
                raise
            cache.release(flat_ids)
            i += pos.size


class OffloadedMoEBlock(nn.Module):
    """Drop-in replacement for an HF sparse MoE block (``[B, S, H]`` in/out).

    Routes with the HF router it keeps (attribute ``router_attr``), then runs
    :meth:`OffloadedMoE.forward_routed`. ``returns_router_scores`` mirrors
    blocks such as gpt-oss's that return ``(hidden, router_scores)``.
    """

    def __init__(
        self,
        layer: int,
        runtime: OffloadedMoE | None,
        router: nn.Module,
        router_attr: str,
        returns_router_scores: bool = False,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.runtime = runtime
        self.router_attr = router_attr
        self.returns_router_scores = returns_router_scores
        self.add_module(router_attr, router)

    @property
    def router_module(self) -> nn.Module:
        module = getattr(self, self.router_attr)
        assert isinstance(module, nn.Module)
        return module

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (logits ``[T, E]``, weights ``[T, k]``, ids ``[T, k]``)."""
        logits, scores, ids = self.router_module(x)
        return logits, scores, ids

    def forward(self, hidden_states: torch.Tensor) -> Any:
        if self.runtime is None:
            raise RuntimeError(f"offloaded MoE block of layer {self.layer} has no runtime attached")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, scores, ids = self.route(x)
        out = self.runtime.forward_routed(self.layer, x, ids, scores).reshape(shape)
        if self.returns_router_scores:
            return out, scores
        return out


def decoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``)."""
    inner = getattr(hf_model, "model", hf_model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(hf_model).__name__} has no model.layers ModuleList")
    return layers


def install_offloaded_blocks(
    hf_model: nn.Module,
    runtime: OffloadedMoE | None,
    *,
    router_attr: str,
    returns_router_scores: bool = False,
    mlp_attr: str = "mlp",
) -> list[OffloadedMoEBlock]:
    """Replace every decoder layer's sparse MoE block with an
    :class:`OffloadedMoEBlock` that keeps the block's router; the old block's
    expert parameters are dropped. Returns the new blocks (layer order).
    Use :meth:`pdflash.models.MoEAdapterBase.install_offloaded` to take the
    arch's attribute names from its adapter."""
    blocks = []
    for i, layer in enumerate(decoder_layers(hf_model)):
        old = getattr(layer, mlp_attr)
        if isinstance(old, OffloadedMoEBlock):
            old.runtime = runtime
            blocks.append(old)
            continue
        router = getattr(old, router_attr, None)
        if not isinstance(router, nn.Module):
            raise TypeError(
                f"layer {i}: {type(old).__name__} has no router {router_attr!r} "
                "(is this a dense layer?)"
            )
        block = OffloadedMoEBlock(i, runtime, router, router_attr, returns_router_scores)
        setattr(layer, mlp_attr, block)
        blocks.append(block)
    return blocks
