"""Run a transformers MoE model with pdflash's offloaded experts, keeping
the unchanged ``model.generate()``.

    from pdflash.integrations.transformers import offload
    model = offload("path/to/checkpoint", cache_fraction=0.2, device="cuda")
    out = model.generate(input_ids, max_new_tokens=64, do_sample=False)
    model.pdflash.close()   # frees the device cache and the pinned host experts

:func:`offload` takes a checkpoint directory, or a transformers model of a
supported architecture (``qwen3_moe``, ``gpt_oss``, ``mixtral``, ``olmoe``)
loaded from one, e.g. on the ``meta`` device or with its experts on the host.
Every sparse MoE block is replaced by an
:class:`~pdflash.models.offload.OffloadedMoEBlock` (keeping the model's
router); the experts are packed into pinned host memory
(:class:`~pdflash.models.store.ExpertStore`, read from the checkpoint's
safetensors) and run from a device :class:`~pdflash.cache.ExpertCache`
filled by the H2D issuer in priority bands: the forward's own misses
``ON_DEMAND``, and with ``route_ahead`` the next layer's experts predicted
from each layer's output (layer ``l+1``'s router over layer ``l``'s
residual) copied ``ROUTE_AHEAD`` while layer ``l`` computes. Everything else
(attention, KV cache, sampling, ``generate``) is transformers' own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pdflash.cache.expert_cache import quiesce
from pdflash.protocols import Band


class OffloadHandle:
    """What :func:`offload` attached to the model (``model.pdflash``): the
    adapter (store, routers), the expert cache and the issuer. :meth:`close`
    stops copies and frees the cache and the pinned host experts; the model
    cannot run afterwards."""

    def __init__(self, model: nn.Module, adapter: Any, cache: Any, issuer: Any) -> None:
        self.model = model
        self.adapter = adapter
        self.cache = cache
        self.issuer = issuer
        self.route_ahead_bytes = 0
        self._remove_hooks: list[Callable[[], None]] = []
        self.closed = False

    def stats(self) -> dict[str, Any]:
        """Expert-cache counters (hits, misses, bytes copied, hit rate) and the
        bytes copied ahead of need by route-ahead."""
        out = dict(self.cache.stats())
        out["route_ahead_bytes"] = self.route_ahead_bytes
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for remove in self._remove_hooks:
            remove()
        quiesce(self.issuer, self.cache)
        self.adapter.detach_cache()
        self.issuer.close()
        self.adapter.close()
        self.cache = None

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checkpoint_of(model: nn.Module, checkpoint: str | os.PathLike[str] | None) -> Path:
    if checkpoint is not None:
        path = Path(checkpoint)
    else:
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"pdflash reads the experts from the checkpoint's safetensors, but {str(path)!r} "
            "is not a local checkpoint directory: pass checkpoint=DIR (for a hub model, "
            "huggingface_hub.snapshot_download gives one)"
        )
    return path


def _route_ahead_hook(handle: OffloadHandle) -> Callable[[int, torch.Tensor], None]:
    from pdflash.routeahead import NextLayerLookahead

    predictor = NextLayerLookahead(handle.adapter)

    def hook(layer: int, hidden: torch.Tensor) -> None:
        cache = handle.cache
        if cache is None or layer + 1 >= handle.adapter.num_layers:
            return
        ids, _ = predictor.predict_next(layer, hidden)
        if ids.size == 0:
            return
        missing = ids[~np.asarray(cache.is_resident(ids), dtype=np.bool_)]
        # NOTE: most confident first; half the usable slots stay free for the
        # forward's own (on-demand) misses, as in the engine's lookahead
        missing = missing[: max(0, int(cache.free_capacity()) // 2)]
        if missing.size:
            handle.route_ahead_bytes += int(missing.size) * int(cache.expert_nbytes)
            cache.prefetch(missing, Band.ROUTE_AHEAD)

    return hook


def offload(
    model_or_path: nn.Module | str | os.PathLike[str],
    *,
    cache_fraction: float | None = None,
    cache_gb: float | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    route_ahead: bool = True,
    checkpoint: str | os.PathLike[str] | None = None,
    eviction: str = "layer_cyclic",
) -> Any:
    """The transformers model with its experts offloaded, ready for
    ``generate``; ``model.pdflash`` is its :class:`OffloadHandle`.

    Args:
        model_or_path: a checkpoint directory, or a model of a supported
            architecture loaded from one (its expert weights, wherever they
            are, are dropped; every other weight is (re)loaded from the
            checkpoint onto ``device``).
        cache_fraction / cache_gb: the device expert cache, as a fraction of
            all experts or in GB (default 0.2 on CUDA, 1.0 on the CPU).
        device: where the model runs (default CUDA if available).
        dtype: compute dtype (default: the model's, else the checkpoint's).
        route_ahead: prefetch each next layer's predicted experts.
        checkpoint: the checkpoint directory when the model's
            ``config._name_or_path`` is not one.
        eviction: the cache's eviction policy: ``layer_cyclic`` (default:
            Belady at layer granularity for the layer-cyclic access of a
            transformers forward, the policy of every offloaded baseline of
            the engine), ``lru``, ``lfu`` or ``route_ahead``.
    """
    from pdflash.h2d import H2DIssuer
    from pdflash.models import get_adapter_class, read_model_type
    from pdflash.models.offload import decoder_layers, install_offloaded_blocks
    from pdflash.models.store import SafetensorsCheckpoint

    if cache_fraction is not None and cache_gb is not None:
        raise ValueError("give cache_fraction or cache_gb, not both")
    dev = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    model: Any
    if isinstance(model_or_path, nn.Module):
        model = model_or_path
        path = _checkpoint_of(model, checkpoint)
        cls = get_adapter_class(read_model_type(path))
        if getattr(model.config, "model_type", None) != cls.arch:
            raise ValueError(
                f"the model is {type(model).__name__} ({model.config.model_type!r}) but "
                f"{path} holds a {cls.arch!r} checkpoint"
            )
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        # NOTE: the adapter's own copy of the non-expert weights stays on the
        # host and is dropped below; the user's model gets them on ``dev``.
        adapter = cls(path, device="cpu", dtype=dtype)
        blocks = install_offloaded_blocks(model, None, spec=adapter.block_spec())
        adapter.device = dev
        adapter._load_non_experts(model, SafetensorsCheckpoint(path))
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            adapter.close()
            raise ValueError(f"{left[0]!r} is on the meta device and not in the checkpoint")
        model.to(dev)
        model.eval()
        adapter.hf_model = model
        adapter.blocks = blocks
        adapter._layers = decoder_layers(model)
        adapter._inner = model.model
    else:
        path = Path(model_or_path)
        cls = get_adapter_class(read_model_type(path))
        adapter = cls(path, device=dev, dtype=dtype)
        model = adapter.hf_model
        if (path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(str(path))
    issuer = H2DIssuer(backend="cuda" if dev.type == "cuda" else "host")
    try:
        if cache_fraction is None and cache_gb is None:
            cache_fraction = 0.2 if dev.type == "cuda" else 1.0
        cache = adapter.attach_new_cache(
            issuer,
            fraction=cache_fraction,
            capacity_bytes=None if cache_gb is None else int(cache_gb * 1e9),
            policy=eviction,
        )
    except BaseException:
        issuer.close()
        adapter.close()
        raise
    handle = OffloadHandle(model, adapter, cache, issuer)
    # a layer-aware policy (layer_cyclic) ranks victims from the layer running now
    before_layer = getattr(cache.policy, "before_layer", None)
    if before_layer is not None:
        handle._remove_hooks.append(adapter.add_layer_input_hook(before_layer))
    if route_ahead:
        handle._remove_hooks.append(adapter.add_layer_output_hook(_route_ahead_hook(handle)))
    model.pdflash = handle
    return model


@contextlib.contextmanager
def offloaded(model_or_path: nn.Module | str | os.PathLike[str], **kwargs: Any) -> Iterator[Any]:
    """``with offloaded(path, cache_fraction=0.2) as model:`` — :func:`offload`,
    closed on exit."""
    model = offload(model_or_path, **kwargs)
    try:
        yield model
    finally:
        model.pdflash.close()
