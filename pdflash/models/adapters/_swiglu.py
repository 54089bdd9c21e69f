"""Shared pieces of the SwiGLU-expert architectures (qwen3_moe, olmoe, mixtral,
qwen2_moe, glm4_moe; public as :class:`pdflash.models.SwiGLUAdapter`):
experts stored as ``gate``/``up``/``down`` projections per expert on the hub,
fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` in transformers 5."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdflash.models.adapters.base import MoEAdapterBase, SlabExperts
from pdflash.models.layout import ComponentSpec, ExpertFormat, ExpertLayout, SourcePart
from pdflash.models.offload import grouped_mm


class SwiGLUGroupedExperts(SlabExperts):
    """``down(act(gate x) * up x)`` for many experts: two grouped GEMMs over
    ``[G, 2I, H]`` / ``[G, H, I]`` weights read as ``[G, K, N]`` (transposed
    views, no copies). No per-expert bias: the row groups are never read."""

    uses_row_groups = False

    def __init__(self, act: Any, unpack: Any = None, fused: Any = None) -> None:
        super().__init__(unpack, fused)
        self.act = act

    def forward(
        self,
        x: torch.Tensor,
        w: dict[str, torch.Tensor],
        offs: torch.Tensor,
        group_of_row: torch.Tensor,
    ) -> torch.Tensor:
        gate, up = grouped_mm(x, w["gate_up"].transpose(1, 2), offs).chunk(2, dim=-1)
        return grouped_mm(self.act(gate) * up, w["down"].transpose(1, 2), offs)


class SwiGLUExpertsMixin(MoEAdapterBase):
    """Packed expert: ``gate_up [2I, H]`` (gate rows first, as transformers 5
    fuses them) then ``down [H, I]``; ``down(act(gate x) * up x)``.

    Reads the hub naming (one ``gate``/``up``/``down`` tensor per expert under
    :attr:`hub_expert_prefix`, names :attr:`hub_names`) or transformers 5's
    fused ``gate_up_proj``/``down_proj`` under :attr:`fused_prefix`
    (``{l}`` is the decoder layer); ``moe_intermediate_size`` gives ``I``."""

    #: per-expert hub names: (prefix with {l} {e}, gate, up, down)
    hub_expert_prefix = "model.layers.{l}.mlp.experts.{e}."
    hub_names = ("gate_proj", "up_proj", "down_proj")
    fused_prefix = "model.layers.{l}.mlp.experts."

    @classmethod
    def moe_intermediate_size(cls, config: Any) -> int:
        return int(config.intermediate_size)

    @classmethod
    def expert_layout(cls, config: Any, dtype: torch.dtype) -> ExpertLayout:
        i, h = cls.moe_intermediate_size(config), int(config.hidden_size)
        return ExpertLayout(
            [ComponentSpec("gate_up", (2 * i, h)), ComponentSpec("down", (h, i))], dtype
        )

    @classmethod
    def expert_formats(cls, config: Any) -> list[ExpertFormat]:
        i, h = cls.moe_intermediate_size(config), int(config.hidden_size)
        gate, up, down = cls.hub_names
        # the store numbers MoE layers; checkpoint names use decoder layers
        decoder = cls.moe_layer_indices(config)

        def hub(layer: int, expert: int) -> list[SourcePart]:
            p = cls.hub_expert_prefix.format(l=decoder[layer], e=expert)
            return [
                SourcePart(f"{p}{gate}.weight", "gate_up", (i, h)),
                SourcePart(f"{p}{up}.weight", "gate_up", (i, h), row_offset=i),
                SourcePart(f"{p}{down}.weight", "down", (h, i)),
            ]

        def fused(layer: int, expert: int) -> list[SourcePart]:
            p = cls.fused_prefix.format(l=decoder[layer])
            return [
                SourcePart(f"{p}gate_up_proj", "gate_up", (2 * i, h), index=expert),
                SourcePart(f"{p}down_proj", "down", (h, i), index=expert),
            ]

        return [ExpertFormat("hub", hub), ExpertFormat("fused", fused)]

    def _activation(self) -> Any:
        if not hasattr(self, "_act"):
            from transformers.activations import ACT2FN

            # NOTE: SiLU (every shipped SwiGLU config) as the plain function:
            # HF's activation module computes exactly F.silu but costs a module
            # call per expert, and this runs once per routed expert per layer.
            act = self.config.hidden_act
            self._act = F.silu if act in ("silu", "swish") else ACT2FN[act]
        return self._act

    def expert_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        w = self.dense_expert_weights(w)
        gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
        out: torch.Tensor = F.linear(self._activation()(gate) * up, w["down"])
        return out

    def grouped_experts(self) -> SwiGLUGroupedExperts:
        act = self._activation()
        # the fused epilogue computes SiLU; other activations keep the dequant path
        fused, reason = None, None
        if act is F.silu:
            fused, reason = self.fused_slab_mlp("silu")
        elif self.layout.format != "dense":
            reason = "dequant: the fused epilogue computes SiLU, not this activation"
        experts = SwiGLUGroupedExperts(act, self.slab_unpack(), fused)
        experts.gemm_reason = reason
        return experts
