"""Shared logic of every architecture adapter.

Design: an adapter builds the architecture's own transformers model class on
the ``meta`` device (no memory), replaces each sparse MoE block with an
:class:`~pdflash.models.offload.OffloadedMoEBlock` (which keeps the HF router
module), then loads every non-expert tensor from the checkpoint into it on
the target device (``load_state_dict(assign=True)``). Experts go to an
:class:`~pdflash.models.store.ExpertStore` and run from an
:class:`~pdflash.cache.ExpertCache`. The protocol methods call the HF
submodules (norms, projections, q/k norms, rotary, router), so the semantics
are transformers' own; what an arch file adds is small: its expert naming and
packed layout, the expert MLP over packed views, and where its q/k norms go.

So ``adapter.hf_model`` is a plain transformers model whose forward runs
offloaded, and the ``MoEModelAdapter`` methods expose its pieces one by one
for engines that run attention themselves.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy.typing as npt
import torch
from torch import nn

from pdflash.cache.eviction import EvictionPolicy
from pdflash.cache.expert_cache import ExpertCache
from pdflash.models.adapters._norms import rms_norm
from pdflash.models.adapters._routers import StackedRouters, router_logits_only
from pdflash.models.compressed_gemm import FusedSlabMLP, fused_mlp_for
from pdflash.models.config_check import check_model_config, check_raw_keys, read_config_json
from pdflash.models.layout import (
    ExpertFormat,
    ExpertLayout,
    SourcePart,
    dequantize_fp8,
    fp8_layout,
)
from pdflash.models.offload import (
    GroupedExperts,
    MoEBlockSpec,
    OffloadedMoE,
    OffloadedMoEBlock,
    RouteHook,
    RouteOutput,
    decoder_layers,
    install_offloaded_blocks,
)
from pdflash.models.store import (
    CheckpointError,
    ExpertStore,
    SafetensorsCheckpoint,
    detect_format,
    open_checkpoint,
    require_finite,
)
from pdflash.protocols import AttentionSpec, Band, CopyIssuer


class UnsupportedConfigError(ValueError):
    """The checkpoint's config is not one the adapter can run."""


class SlabExperts:
    """The part every arch's grouped expert MLP
    (:class:`~pdflash.models.offload.GroupedExperts`) shares: turning the
    slab's packed views into compute weights. ``unpack`` dequantizes
    compressed views (None: the slab is dense and its views are the weights);
    ``fused``: the same MLP as fused dequantize-GEMM launches over the
    compressed slab (:class:`~pdflash.models.compressed_gemm.FusedSlabMLP`;
    the block then runs it instead of ``weights`` + ``forward``); subclasses
    add ``forward``."""

    def __init__(
        self,
        unpack: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
        fused: FusedSlabMLP | None = None,
    ) -> None:
        if fused is not None and unpack is None:
            raise ValueError("a fused slab MLP reads compressed slabs; this slab is dense")
        self.unpack = unpack
        self.compressed = unpack is not None
        self.fused = fused
        #: why compressed experts take the fused or the dequant path (None: dense)
        self.gemm_reason: str | None = None

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return views if self.unpack is None else self.unpack(views)


class MoEAdapterBase:
    """Implements :class:`pdflash.protocols.MoEModelAdapter` for one checkpoint.

    The public base of every adapter, built-in or not. A subclass sets the
    class attributes (``arch``, ``modeling``, ``hf_block_class``, the block's
    submodule names) and implements :meth:`expert_layout`,
    :meth:`expert_formats` and :meth:`expert_forward` (optionally
    :meth:`grouped_experts`); it overrides :meth:`qkv` when the arch has q/k
    norms, :meth:`route_tokens` when the HF router does not return
    ``(logits, weights, ids)``, and :meth:`moe_layer_indices` when some
    decoder layers are dense. Register it with
    :func:`pdflash.models.register_adapter` or a ``pdflash.adapters`` entry
    point.

    Layer numbering: :attr:`num_layers` counts the **MoE** layers (the expert
    grid the store, cache, scheduler and predictors see, ``layer * E +
    expert``); :attr:`num_decoder_layers` counts every decoder layer and
    :attr:`moe_layers` maps MoE layer ``m`` to its decoder layer. The
    attention methods (``input_norm``, ``attention_spec``, ``project_qkv``,
    ``attention_sinks``, ``project_out``) and :meth:`dense_mlp` take decoder
    layers; the MoE methods (``moe_norm``, ``router_logits``, ``route``,
    ``moe``, ``moe_routed``, ``resident_block``) take MoE layers. With no
    dense layer the two numberings coincide.

    ``owned_experts`` (constructor): pack only some experts into the host
    store (an expert-parallel rank's share, :mod:`pdflash.distributed`): a
    bool ``[num_layers, num_experts]`` mask, or a function of
    ``(num_layers, num_experts)`` returning one (the grid is known only once
    the config is read). None (default): every expert.
    """

    arch: ClassVar[str]  # config.model_type
    modeling: ClassVar[Any]  # transformers.models.<arch>.modeling_<arch>
    router_attr: ClassVar[str] = "gate"  # the router's name inside the MoE block
    experts_attr: ClassVar[str] = "experts"  # the routed experts' module in the block
    #: the block's always-on shared expert (resident, added to the routed
    #: output), e.g. qwen2_moe's ``shared_expert``, deepseek/glm's ``shared_experts``
    shared_expert_attr: ClassVar[str | None] = None
    #: the shared expert's gate (``sigmoid(gate(x)) * shared(x)``), e.g.
    #: qwen2_moe's ``shared_expert_gate``; None: the shared expert is ungated
    shared_expert_gate_attr: ClassVar[str | None] = None
    hf_block_class: ClassVar[str]  # the HF sparse MoE block class in ``modeling``
    #: packed component -> the HF experts module's 3-D parameter
    hf_expert_params: ClassVar[dict[str, str]] = {"gate_up": "gate_up_proj", "down": "down_proj"}
    returns_router_scores: ClassVar[bool] = False  # block returns (hidden, scores)
    #: packed 2-D weight component -> its output-channel axis (the axis
    #: ``expert_dtype="fp8"`` keeps one scale per index of)
    expert_out_axes: ClassVar[dict[str, int]] = {"gate_up": 0, "down": 0}
    default_attn_implementation: ClassVar[str] = "sdpa"
    #: the arch's rotary, when :meth:`project_qkv` may apply it itself (fewer
    #: kernels, bit-exact): ``"rotate_half"`` (``x*cos + rotate_half(x)*sin``,
    #: full head dim) or ``"halves"`` (gpt-oss: ``[x1*cos - x2*sin, x2*cos +
    #: x1*sin]``); None calls the transformers module's ``apply_rotary_pos_emb``
    rotary_style: ClassVar[str | None] = None

    # -- per-arch hooks ------------------------------------------------------

    @classmethod
    def num_experts_of(cls, config: Any) -> int:
        return int(config.num_local_experts)

    @classmethod
    def moe_layer_indices(cls, config: Any) -> list[int]:
        """The decoder layers that hold a sparse MoE block, in order (default:
        all). The others are dense: their HF MLP stays resident on the device."""
        return list(range(int(config.num_hidden_layers)))

    def route_tokens(self, router: nn.Module, x: torch.Tensor) -> RouteOutput:
        """``x [T, H]`` -> (logits ``[T, E]``, weights ``[T, k]``, ids ``[T, k]``)
        with the layer's router module. Default: the HF router's own forward,
        which returns that triple in transformers 5; override to implement the
        arch's routing (e.g. when its HF block, not its router, selects)."""
        logits, weights, ids = router(x)
        return logits, weights, ids

    @classmethod
    def validate_config(cls, config: Any) -> None:
        """Raise :class:`UnsupportedConfigError` for configs the adapter refuses."""
        if cls.num_experts_of(config) < 1:
            raise UnsupportedConfigError(f"{cls.arch}: config has no experts")

    @classmethod
    def expert_layout(cls, config: Any, dtype: torch.dtype) -> ExpertLayout:
        raise NotImplementedError

    @classmethod
    def expert_formats(cls, config: Any) -> list[ExpertFormat]:
        """Checkpoint namings, the hub's canonical one first (the synthetic
        writer writes the first)."""
        raise NotImplementedError

    @classmethod
    def stored_layout(
        cls, config: Any, dtype: torch.dtype, fmt: ExpertFormat, expert_dtype: str | None
    ) -> tuple[ExpertLayout, ExpertFormat]:
        """The packed layout and checkpoint reading for experts found in
        format ``fmt``. ``expert_dtype``: None keeps experts as the checkpoint
        stores them (compressed stays compressed), ``"dense"`` packs them in
        the compute dtype."""
        if expert_dtype not in (None, "dense", "fp8"):
            raise ValueError(f"unknown expert_dtype {expert_dtype!r} (None, 'dense' or 'fp8')")
        if expert_dtype != "fp8":
            return cls.expert_layout(config, dtype), fmt
        if fmt.quantized:
            raise ValueError(
                f"expert_dtype='fp8' re-stores dense checkpoints; this checkpoint's experts "
                f"are {fmt.name}"
            )
        axes = cls.expert_out_axes
        layout = fp8_layout(cls.expert_layout(config, dtype), axes)

        def parts(layer: int, expert: int) -> list[SourcePart]:
            return [
                dataclasses.replace(
                    p, transform="fp8_rows" if axes[p.component] == 0 else "fp8_cols"
                )
                if p.component in axes
                else p
                for p in fmt.parts(layer, expert)
            ]

        return layout, ExpertFormat(f"{fmt.name}+fp8", parts, quantized=True)

    @classmethod
    def checkpoint_to_module_key(cls, key: str) -> str:
        """Checkpoint tensor name -> parameter name in the HF model."""
        return key

    @classmethod
    def module_to_checkpoint_key(cls, key: str) -> str:
        return key

    @classmethod
    def ignore_checkpoint_key(cls, key: str, config: Any) -> bool:
        """True for a checkpoint tensor the model does not use (e.g. extra
        multi-token-prediction layers); every other non-expert tensor must
        match a parameter or loading fails."""
        return False

    def expert_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert's MLP over ``x [n, H]`` with its packed weights ``w``."""
        raise NotImplementedError

    def dense_expert_weights(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Packed expert views (one expert or ``[G, ...]`` stacked) -> the
        dense weights the HF experts module holds (identity unless the
        layout is compressed)."""
        if self.layout.format != "fp8":
            return w
        axes = self.expert_out_axes
        out = {n: t for n, t in w.items() if n not in axes and n.removesuffix("_scale") not in axes}
        for name, axis in axes.items():
            out[name] = dequantize_fp8(w[name], w[f"{name}_scale"], axis, self.dtype)
        return out

    def slab_unpack(
        self,
    ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
        """What a :class:`SlabExperts` unpacks slab views with: None for a
        dense layout, else :meth:`dense_expert_weights`."""
        return None if self.layout.format == "dense" else self.dense_expert_weights

    def grouped_experts(self) -> GroupedExperts | None:
        """The expert MLP over many experts at once (grouped GEMMs over the
        cache slab), or None to run experts one by one."""
        return None

    def fused_slab_mlp(
        self, act: str, *, alpha: float = 1.0, limit: float = 0.0
    ) -> tuple[FusedSlabMLP | None, str | None]:
        """The fused dequantize-GEMM MLP for this adapter's compressed slab
        where :func:`~pdflash.models.compressed_gemm.choose_compressed_gemm`
        picks ``fused`` (``PDFLASH_COMPRESSED_GEMM``: ``auto`` by default;
        ``fused`` raises where it cannot run), else None; and why (None for a
        dense layout). ``act``: ``gptoss`` or ``silu``."""
        fmt = self.layout.format
        if fmt not in ("mxfp4", "fp8"):
            return None, None
        axes = set(self.expert_out_axes.values())
        if len(axes) != 1:
            # one output axis for both projections is what the kernel reads
            return None, "dequant: the projections' output axes differ (the fused kernel reads one)"
        fused, choice = fused_mlp_for(
            self.device, fmt, act, out_axis=axes.pop(), alpha=alpha, limit=limit
        )
        return fused, choice.reason

    def qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[T, heads, D]`` of the HF attention module ``attn``
        before rotary (override to apply the arch's q/k norms)."""
        t = x.shape[0]
        d = self.head_dim
        q = attn.q_proj(x).view(t, -1, d)
        k = attn.k_proj(x).view(t, -1, d)
        v = attn.v_proj(x).view(t, -1, d)
        return q, k, v

    def qk_joint(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        """``(qk, heads, v)``: q and k of :meth:`qkv` as one ``[T, Hq + Hk,
        D]`` tensor (q's ``heads`` first), which the rotary reads at once.
        Override where the arch's q/k norms can run over that tensor once."""
        q, k, v = self.qkv(attn, x)
        return torch.cat([q, k], dim=1), q.shape[1], v

    # -- construction --------------------------------------------------------

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        issuer: CopyIssuer | None = None,
        cache_fraction: float | None = None,
        cache_bytes: int | None = None,
        cache_slots: int | None = None,
        max_batch_tokens: int = 16,
        policy: EvictionPolicy | str | None = None,
        attn_implementation: str | None = None,
        host_allocator: Callable[[int], torch.Tensor] | None = None,
        pack_workers: int | None = None,
        check_finite: bool = True,
        expert_dtype: str | None = None,
        expert_nbytes: int | None = None,
        owned_experts: npt.ArrayLike | Callable[[int, int], npt.ArrayLike] | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = Path(path)
        self.check_finite = check_finite
        cfg_file = self.path / "config.json"
        raw = read_config_json(self.path)
        if raw.get("model_type") not in (None, self.arch):
            raise UnsupportedConfigError(
                f"{self.path}: config.model_type is {raw.get('model_type')!r}, "
                f"not {self.arch!r} ({type(self).__name__})"
            )
        check_raw_keys(raw, cfg_file)
        try:
            config = AutoConfig.from_pretrained(self.path)
        except Exception as exc:
            raise CheckpointError(
                f"{cfg_file}: transformers cannot read it ({type(exc).__name__}: {exc})"
            ) from exc
        if config.model_type != self.arch:
            raise UnsupportedConfigError(
                f"{self.path}: config.model_type is {config.model_type!r}, "
                f"not {self.arch!r} ({type(self).__name__})"
            )
        try:
            self.validate_config(config)
        except UnsupportedConfigError as exc:
            raise UnsupportedConfigError(f"{cfg_file}: {exc}") from exc
        check_model_config(config, self.num_experts_of(config), cfg_file)
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else self.checkpoint_dtype(config)
        self.num_decoder_layers = int(config.num_hidden_layers)
        moe_layers = [int(i) for i in self.moe_layer_indices(config)]
        if not moe_layers:
            raise UnsupportedConfigError(f"{cfg_file}: {self.arch} config has no MoE layer")
        if moe_layers != sorted(set(moe_layers)) or not (
            moe_layers[0] >= 0 and moe_layers[-1] < self.num_decoder_layers
        ):
            raise UnsupportedConfigError(
                f"{cfg_file}: MoE layers {moe_layers} are not increasing decoder layers "
                f"in [0, {self.num_decoder_layers})"
            )
        #: MoE layer m -> its decoder layer
        self.moe_layers: tuple[int, ...] = tuple(moe_layers)
        self._moe_index = {d: m for m, d in enumerate(moe_layers)}
        self.num_layers = len(moe_layers)
        self.num_experts = self.num_experts_of(config)
        self.top_k = int(config.num_experts_per_tok)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )

        checkpoint = open_checkpoint(self.path)
        found = detect_format(checkpoint, self.expert_formats(config))
        self.layout, fmt = self.stored_layout(config, self.dtype, found, expert_dtype)
        if expert_nbytes is not None:
            # padded experts: copies and slots move expert_nbytes, views ignore the tail
            self.layout = self.layout.padded(expert_nbytes)
        if callable(owned_experts):
            owned_experts = owned_experts(self.num_layers, self.num_experts)
        self.store = ExpertStore(
            checkpoint,
            self.layout,
            [fmt],
            self.num_layers,
            self.num_experts,
            # NOTE: page-locked through the issuer (register_host), so it is a
            # valid copy source there; without one, pinning waits for attach_cache.
            pin=False,
            allocator=host_allocator,
            issuer=issuer,
            workers=pack_workers,
            check_finite=check_finite,
            owned=owned_experts,
        )
        self.expert_nbytes = self.store.expert_nbytes

        impl = attn_implementation or self.default_attn_implementation
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, attn_implementation=impl, dtype=self.dtype
            )
        self.blocks = install_offloaded_blocks(model, None, spec=self.block_spec())
        self._stacked_routers: StackedRouters | None = None  # router_logits_all's, once built
        self._load_non_experts(model, checkpoint)
        model.eval()
        self.hf_model: Any = model
        self._layers: Any = decoder_layers(model)
        self._inner: Any = model.model

        #: (positions, its version, (dtype, device), cos, sin[, rotary tables])
        self._rotary_memo: tuple[Any, ...] | None = None
        self.issuer = issuer
        self.cache: ExpertCache | None = None
        self.runtime: OffloadedMoE | None = None
        if issuer is not None:
            if cache_fraction is None and cache_bytes is None and cache_slots is None:
                cache_fraction = 1.0
            self.attach_new_cache(
                issuer,
                num_slots=cache_slots,
                capacity_bytes=cache_bytes,
                fraction=cache_fraction,
                max_batch_tokens=max_batch_tokens,
                policy=policy,
            )

    def block_spec(self) -> MoEBlockSpec:
        """How this arch's HF sparse MoE blocks are replaced (their parts, the
        layers holding them, the routing)."""
        return MoEBlockSpec(
            router_attr=self.router_attr,
            experts_attr=self.experts_attr,
            returns_router_scores=self.returns_router_scores,
            shared_expert_attr=self.shared_expert_attr,
            shared_expert_gate_attr=self.shared_expert_gate_attr,
            route_fn=self.route_tokens,
            moe_layers=self.moe_layers,
        )

    def moe_layer_of(self, layer: int) -> int | None:
        """The MoE layer index of decoder layer ``layer`` (None: a dense layer)."""
        if not 0 <= layer < self.num_decoder_layers:
            raise ValueError(f"decoder layer {layer} out of range [0, {self.num_decoder_layers})")
        return self._moe_index.get(layer)

    @staticmethod
    def checkpoint_dtype(config: Any) -> torch.dtype:
        dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = getattr(torch, dt, None)
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            return dt
        return torch.bfloat16 if getattr(config, "quantization_config", None) else torch.float32

    def attach_new_cache(
        self,
        issuer: CopyIssuer,
        *,
        fraction: float | None = None,
        capacity_bytes: int | None = None,
        num_slots: int | None = None,
        max_batch_tokens: int = 1,
        policy: EvictionPolicy | str | None = None,
        single_band: Band | None = None,
    ) -> ExpertCache:
        """Build an :class:`ExpertCache` over this model's expert store (sized
        by exactly one of ``fraction``, ``capacity_bytes``, ``num_slots``) and
        run the MoE layers from it; the one place a cache of an adapter is
        built. ``policy="layer_cyclic"`` builds a
        :class:`~pdflash.cache.eviction.LayerCyclicPolicy` of this model's
        shape (other names as :func:`~pdflash.cache.eviction.make_policy`).
        The previous cache, if any, is detached first, so its slab can be
        freed before the new one is allocated."""
        if policy == "layer_cyclic":
            from pdflash.cache.eviction import LayerCyclicPolicy

            policy = LayerCyclicPolicy(self.num_layers, self.num_experts)
        self.detach_cache()
        cache = ExpertCache(
            self.store,
            issuer,
            device=self.device,
            num_slots=num_slots,
            capacity_bytes=capacity_bytes,
            fraction=fraction,
            top_k=self.top_k,
            max_batch_tokens=max_batch_tokens,
            policy=policy,
            single_band=single_band,
        )
        self.attach_cache(cache)
        return cache

    def detach_cache(self) -> None:
        """Stop running the MoE layers from the attached cache (drops this
        adapter's references to it and its runtime; the caller quiesces its
        copies first). A no-op without one."""
        for block in self.blocks:
            block.runtime = None
        if self.runtime is not None:
            self.runtime.close()  # its recorded calls read the old cache's slab
        self.cache = None
        self.runtime = None

    def attach_cache(self, cache: ExpertCache) -> OffloadedMoE:
        """Run the MoE layers from ``cache`` (replaces any previous cache)."""
        if cache.num_layers != self.num_layers or cache.num_experts != self.num_experts:
            raise ValueError(
                f"cache is for {cache.num_layers}x{cache.num_experts} experts, "
                f"model has {self.num_layers}x{self.num_experts}"
            )
        self.store.register_with(cache.issuer)
        if self.runtime is not None:
            self.runtime.close()  # its recorded calls read the old cache's slab
        self.cache = cache
        self.runtime = OffloadedMoE(self.store, cache, self.expert_forward, self.grouped_experts())
        for block in self.blocks:
            block.runtime = self.runtime
        return self.runtime

    def _load_non_experts(self, model: Any, ck: SafetensorsCheckpoint) -> None:
        want = {k: v for k, v in model.state_dict(keep_vars=True).items()}
        expert_keys = self.store.expert_keys()
        state: dict[str, torch.Tensor] = {}
        # transformers keeps some modules in fp32 (gpt-oss norms): its
        # _keep_in_fp32_modules under fp16, _keep_in_fp32_modules_strict under
        # fp16 and bf16. Same here, so norms round as in from_pretrained.
        names: set[str] = set()
        if self.dtype == torch.float16:
            names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
        if self.dtype in (torch.float16, torch.bfloat16):
            names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        keep_fp32 = [re.compile(rf"(^|\.){re.escape(n)}(\.|$)") for n in sorted(names)]
        for key in ck.keys():  # noqa: SIM118
            if key in expert_keys or self.ignore_checkpoint_key(key, self.config):
                continue
            mkey = self.checkpoint_to_module_key(key)
            if mkey not in want:
                raise CheckpointError(
                    f"{ck.file_of(key)}: unexpected tensor {key!r} for {self.arch} "
                    "(a dense layer, or a config that does not match the weights?)"
                )
            got = ck.shape(key)
            need = tuple(want[mkey].shape)
            if got != need:
                raise CheckpointError(
                    f"{ck.file_of(key)}: tensor {key!r} has shape {list(got)}, "
                    f"expected {list(need)} from config.json"
                )
            t = ck.read(key)
            if self.check_finite:
                require_finite(t, ck.file_of(key), key)
            dt = self.dtype if t.is_floating_point() else t.dtype
            if t.is_floating_point() and any(p.search(mkey) for p in keep_fp32):
                dt = torch.float32
            state[mkey] = t.to(device=self.device, dtype=dt)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        missing = sorted(k for k in want if k not in state and not (tied and k == "lm_head.weight"))
        if missing:
            raise CheckpointError(
                f"{ck.path}: tensor {self.module_to_checkpoint_key(missing[0])!r} not found "
                f"in the checkpoint ({len(missing)} missing)"
            )
        model.load_state_dict(state, strict=False, assign=True)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        # Non-persistent buffers (rotary inv_freq) were built on meta: rebuild.
        rotary = model.model.rotary_emb
        with torch.device(self.device):
            model.model.rotary_emb = type(rotary)(config=model.config)
        for name, buf in model.named_buffers():
            if buf.is_meta:
                raise RuntimeError(f"{self.arch}: buffer {name!r} was not materialised")

    # -- MoEModelAdapter -------------------------------------------------------

    def _attn(self, layer: int) -> Any:
        return self._layers[layer].self_attn

    def _block(self, layer: int) -> OffloadedMoEBlock:
        return self.blocks[layer]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._inner.embed_tokens(input_ids)
        return out

    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(self._layers[layer].input_layernorm, hidden)

    def dense_mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The MLP output ``[T, H]`` of dense decoder layer ``layer`` for the
        residual ``hidden`` after its attention (its norm applied here)."""
        if layer in self._moe_index:
            raise ValueError(
                f"decoder layer {layer} is MoE layer {self._moe_index[layer]}, not dense"
            )
        block = self._layers[layer]
        out: torch.Tensor = block.mlp(block.post_attention_layernorm(hidden))
        return out

    def attention_spec(self, layer: int) -> AttentionSpec:
        attn = self._attn(layer)
        cfg = self.config
        window = self.sliding_window(layer)
        return AttentionSpec(
            num_heads=int(cfg.num_attention_heads),
            num_kv_heads=int(cfg.num_key_value_heads),
            head_dim=self.head_dim,
            scaling=float(attn.scaling),
            sliding_window=None if window is None else int(window),
            has_sinks=self.attention_sinks(layer) is not None,
        )

    def sliding_window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s attention window (None: full attention):
        the HF attention module's ``sliding_window``, else the config's."""
        window = getattr(self._attn(layer), "sliding_window", None)
        if window is None and not hasattr(self._attn(layer), "sliding_window"):
            window = getattr(self.config, "sliding_window", None)
        return None if window is None else int(window)

    def rotary(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, T, D]`` for 1-D ``positions`` (HF rotary module).

        Every layer of a forward passes the same ``positions`` tensor, so the
        last result is kept and reused while the call gets that very tensor
        object, unmodified (same version), with ``like`` of the same dtype
        and device: one rotary computation per forward instead of per layer.
        """
        cached = self._rotary_memo
        if (
            cached is not None
            and cached[0] is positions
            and cached[1] == positions._version
            and cached[2] == (like.dtype, like.device)
        ):
            cos_c: torch.Tensor = cached[3]
            sin_c: torch.Tensor = cached[4]
            return cos_c, sin_c
        cos, sin = self._inner.rotary_emb(like, positions.reshape(1, -1))
        # NOTE: holding ``positions`` keeps its identity from being reused by
        # another tensor while the memo lives
        self._rotary_memo = (positions, positions._version, (like.dtype, like.device), cos, sin)
        return cos, sin

    def rotary_tables(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cc, ss)`` ``[T, 1, D]`` with ``rope(x) = x * cc + roll(x, D/2) * ss``
        for ``x [T, heads, D]`` (:attr:`rotary_style` archs; kept with the
        :meth:`rotary` memo, so built once per forward)."""
        cos, sin = self.rotary(positions, like)
        memo = self._rotary_memo
        assert memo is not None and memo[3] is cos
        if len(memo) == 6:
            result: tuple[torch.Tensor, torch.Tensor] = memo[5]
            return result
        cos, sin = cos[0], sin[0]  # [T, D] (rotate_half) or [T, D/2] (halves)
        if self.rotary_style == "halves":
            cc = torch.cat([cos, cos], dim=-1)
            ss = torch.cat([-sin, sin], dim=-1)
        else:
            half = sin.shape[-1] // 2
            cc = cos
            ss = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        tables = (cc[:, None, :], ss[:, None, :])
        self._rotary_memo = (*memo[:5], tables)
        return tables

    def project_qkv(
        self, layer: int, normed: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.rotary_style is None:
            q, k, v = self.qkv(self._attn(layer), normed)
            cos, sin = self.rotary(positions, normed)
            q4, k4 = self.modeling.apply_rotary_pos_emb(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin
            )
            return q4[0].transpose(0, 1), k4[0].transpose(0, 1), v
        # NOTE: the arch's rotary in four kernels over q and k at once, bit
        # for bit transformers' (the same products and sums: x1*cos - x2*sin
        # is x1*cos + x2*(-sin) exactly); q and k are views of one tensor
        cc, ss = self.rotary_tables(positions, normed)
        qk, heads, v = self.qk_joint(self._attn(layer), normed)
        half = qk.shape[-1] // 2
        qk = qk * cc + torch.roll(qk, half, dims=-1) * ss
        return qk[:, :heads], qk[:, heads:], v

    def attention_sinks(self, layer: int) -> torch.Tensor | None:
        return None

    def project_out(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._attn(layer).o_proj(attn)
        return out

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """MoE layer ``layer``'s norm before its router (post-attention norm)."""
        return rms_norm(self._layers[self.moe_layers[layer]].post_attention_layernorm, hidden)

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """MoE layer ``layer``'s router logits ``[T, E]`` for ``normed``
        (:meth:`moe_norm`'s output): the first of :meth:`route_tokens`'s
        triple. A known HF router under the default routing gives them
        without the routing it would compute next (the same values)."""
        block = self._block(layer)
        if block.route_fn is None or _default_routing(block.route_fn):
            logits = router_logits_only(block.router_module, normed)
            if logits is not None:
                return logits
        return block.route(normed)[0]

    def router_logits_all(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Every MoE layer's router logits ``[L, T, E]`` for the same
        ``hidden [T, H]`` entering each layer's :meth:`moe_norm` (what
        :meth:`router_logits` gives per layer, up to float rounding), in one
        batched product (:class:`StackedRouters`, rebuilt when a parameter
        changed); None where a layer's norm, router or routing is not one
        whose arithmetic is known, or its router class is not yet checked
        (call per layer then)."""
        blocks = [self._block(m) for m in range(self.num_layers)]
        if any(b.route_fn is not None and not _default_routing(b.route_fn) for b in blocks):
            return None
        norms = [self._layers[d].post_attention_layernorm for d in self.moe_layers]
        routers = [b.router_module for b in blocks]
        stacked = self._stacked_routers
        if stacked is None or stacked.stale(norms, routers):
            stacked = self._stacked_routers = StackedRouters.of(norms, routers)
            if stacked is None:
                return None
        return stacked.logits(hidden)

    def route(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, weights, ids = self._block(layer).route(normed)
        return ids.long(), weights

    def moe(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """MoE layer ``layer``'s output: routed experts (offloaded) plus any
        shared expert (resident)."""
        ids, weights = self.route(layer, normed)
        return self.moe_routed(layer, normed, ids, weights)

    def moe_routed(
        self, layer: int, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`moe` with the routing :meth:`route` returned for ``normed``."""
        if self.runtime is None:
            raise RuntimeError("no expert cache attached: pass issuer= or call attach_cache()")
        block = self._block(layer)
        return block.with_shared(normed, self.runtime.forward_routed(layer, normed, ids, weights))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(self._inner.norm, hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.hf_model.lm_head(hidden)
        return out

    # -- conveniences ------------------------------------------------------------

    def add_route_hook(self, hook: RouteHook) -> Callable[[], None]:
        """``hook(layer, topk_ids)`` on every layer's routing (for prefetchers)."""
        if self.runtime is None:
            raise RuntimeError("no expert cache attached")
        return self.runtime.add_route_hook(hook)

    def add_layer_input_hook(self, hook: Callable[[int], None]) -> Callable[[], None]:
        """``hook(layer)`` as each MoE layer's decoder layer starts, during
        :attr:`hf_model` forwards (``layer`` is the MoE layer index), e.g. an
        eviction policy's ``before_layer``. Returns a function that removes
        the hook."""
        handles = []
        for i, decoder_layer in enumerate(self.moe_layers):
            layer = self._layers[decoder_layer]

            def pre(_m: Any, _a: Any, i: int = i) -> None:
                hook(i)

            handles.append(layer.register_forward_pre_hook(pre))

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove

    def add_layer_output_hook(
        self, hook: Callable[[int, torch.Tensor], None]
    ) -> Callable[[], None]:
        """``hook(layer, hidden [T, H])`` with each MoE layer's output (the
        residual stream; ``layer`` is the MoE layer index) during
        :attr:`hf_model` forwards, e.g. for next-layer gate lookahead (apply
        MoE layer ``l+1``'s router to it and prefetch). Returns a function
        that removes the hook."""
        handles = []
        for i, decoder_layer in enumerate(self.moe_layers):
            layer = self._layers[decoder_layer]

            def post(_m: Any, _a: Any, out: Any, i: int = i) -> None:
                h = out[0] if isinstance(out, tuple) else out
                hook(i, h.reshape(-1, h.shape[-1]))

            handles.append(layer.register_forward_hook(post))

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove

    def install_offloaded(self, hf_model: nn.Module) -> list[OffloadedMoEBlock]:
        """Swap the sparse MoE blocks of another HF model of this arch (e.g. one
        loaded with ``from_pretrained``) for offloaded blocks running from this
        adapter's cache. That model keeps routing with its own routers."""
        if self.runtime is None:
            raise RuntimeError("no expert cache attached")
        return install_offloaded_blocks(hf_model, self.runtime, spec=self.block_spec())

    def resident_block(self, layer: int) -> nn.Module:
        """The architecture's own HF sparse MoE block for MoE layer ``layer``
        with all its experts resident on the device (stacked from the store),
        this adapter's router and shared expert: the resident baseline the
        benchmark compares to."""
        cls = getattr(self.modeling, self.hf_block_class)
        with torch.device("meta"):
            block = cls(self.hf_model.config)
        dense = self.dense_expert_weights(self.store.stacked(layer, self.device))
        state = {
            f"{self.experts_attr}.{self.hf_expert_params[name]}": t.contiguous()
            for name, t in dense.items()
        }
        router = self.blocks[layer].router_module
        # router and shared expert parameters and buffers, under the block's names
        state.update(self.blocks[layer].state_dict())
        block.load_state_dict(state, strict=True, assign=True)
        setattr(block, self.router_attr, router)
        out: nn.Module = block.eval()
        return out

    @contextmanager
    def swapped_blocks(self, blocks: list[nn.Module]) -> Iterator[None]:
        """Run the HF forward with ``blocks`` (one per layer) instead of the
        offloaded blocks, e.g. ``[adapter.resident_block(i) for i in ...]``."""
        if len(blocks) != self.num_layers:
            raise ValueError(
                f"need {self.num_layers} blocks (one per MoE layer), got {len(blocks)}"
            )
        moe = [self._layers[d] for d in self.moe_layers]
        for layer, block in zip(moe, blocks, strict=True):
            layer.mlp = block
        try:
            yield
        finally:
            for layer, block in zip(moe, self.blocks, strict=True):
                layer.mlp = block

    @torch.inference_mode()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one sequence through the HF forward (offloaded)."""
        out = self.hf_model(input_ids=input_ids.reshape(1, -1).to(self.device), use_cache=False)
        logits: torch.Tensor = out.logits[0]
        return logits

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
        self.store.close()


def _default_routing(route_fn: Callable[..., Any]) -> bool:
    """``route_fn`` is an adapter's :meth:`MoEAdapterBase.route_tokens` as
    the base defines it (the HF router's own forward), not an override."""
    return getattr(route_fn, "__func__", None) is MoEAdapterBase.route_tokens
