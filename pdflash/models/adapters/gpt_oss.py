"""gpt-oss (gpt-oss-20b, gpt-oss-120b).

Routing (``GptOssTopKRouter``): logits with a bias, top-k of the *logits*,
then softmax over the k selected logits (softmax after top-k, in the logits
dtype). Experts: ``gate_up = x @ W[H, 2I] + b`` with gate/up *interleaved*
(even/odd columns), ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``,
``glu = gate * sigmoid(alpha * gate)``, ``out = ((up + 1) * glu) @ W_down[I, H]
+ b_down``. Attention: learned per-head sinks; layers alternate sliding
window (``config.layer_types``) and full attention; rotary on halves
(``_apply_rotary_emb``), no q/k norms.

Checkpoints: fused 3-D ``mlp.experts.gate_up_proj [E, H, 2I]`` etc. in bf16
(what transformers and pdflash's synthetic writer save), or the released
MXFP4 ``*_blocks``/``*_scales``. MXFP4 experts stay MXFP4 in host memory,
over the link and in the cache slab (a quarter of the bf16 bytes plus one
scale byte per 32 values), and are dequantized on the compute device right
before the GEMMs, with transformers' arithmetic (``expert_dtype="dense"``
dequantizes them at pack time instead).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from pdflash.models.adapters.base import MoEAdapterBase, SlabExperts
from pdflash.models.layout import (
    ComponentSpec,
    ExpertFormat,
    ExpertLayout,
    SourcePart,
    dequantize_mxfp4,
    mxfp4_dequantizer,
)
from pdflash.models.offload import grouped_mm

MXFP4_GROUP = 32  # values per scale


def unpack_mxfp4_experts(w: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """MXFP4-packed expert views (``[..., R, G, 16]`` blocks, ``[..., R, G]``
    scales) -> dense ``gate_up [..., H, 2I]`` and ``down [..., I, H]`` in
    ``dtype`` (transposed views of the dequantized ``[R, K]`` weights, as
    transformers' ``convert_moe_packed_tensors`` returns them)."""
    return {
        "gate_up": dequantize_mxfp4(w["gate_up_blocks"], w["gate_up_scales"], dtype).transpose(
            -1, -2
        ),
        "gate_up_bias": w["gate_up_bias"],
        "down": dequantize_mxfp4(w["down_blocks"], w["down_scales"], dtype).transpose(-1, -2),
        "down_bias": w["down_bias"],
    }


class GptOssGroupedExperts(SlabExperts):
    """gpt-oss's clamped SwiGLU with biases for many experts: two grouped
    GEMMs over ``[G, H, 2I]`` / ``[G, I, H]``, biases gathered per row."""

    def __init__(self, alpha: float, limit: float, unpack: Any = None, fused: Any = None) -> None:
        super().__init__(unpack, fused)
        self.alpha, self.limit = alpha, limit

    def forward(
        self,
        x: torch.Tensor,
        w: dict[str, torch.Tensor],
        offs: torch.Tensor,
        group_of_row: torch.Tensor,
    ) -> torch.Tensor:
        gate_up = grouped_mm(x, w["gate_up"], offs) + w["gate_up_bias"][group_of_row]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        out = grouped_mm((up + 1) * glu, w["down"], offs) + w["down_bias"][group_of_row]
        return out


class GptOssAdapter(MoEAdapterBase):
    arch = "gpt_oss"
    modeling: ClassVar[Any] = modeling_gpt_oss
    router_attr = "router"
    hf_block_class = "GptOssMLP"
    hf_expert_params: ClassVar[dict[str, str]] = {
        "gate_up": "gate_up_proj",
        "gate_up_bias": "gate_up_proj_bias",
        "down": "down_proj",
        "down_bias": "down_proj_bias",
    }
    returns_router_scores = True
    expert_out_axes: ClassVar[dict[str, int]] = {"gate_up": 1, "down": 1}
    # NOTE: sdpa has no sinks; transformers refuses it for gpt-oss.
    default_attn_implementation = "eager"
    rotary_style = "halves"

    @classmethod
    def expert_layout(cls, config: Any, dtype: torch.dtype) -> ExpertLayout:
        i, h = int(config.intermediate_size), int(config.hidden_size)
        return ExpertLayout(
            [
                ComponentSpec("gate_up", (h, 2 * i)),
                ComponentSpec("gate_up_bias", (2 * i,)),
                ComponentSpec("down", (i, h)),
                ComponentSpec("down_bias", (h,)),
            ],
            dtype,
        )

    @classmethod
    def expert_formats(cls, config: Any) -> list[ExpertFormat]:
        i, h = int(config.intermediate_size), int(config.hidden_size)

        def bf16(layer: int, expert: int) -> list[SourcePart]:
            p = f"model.layers.{layer}.mlp.experts."
            return [
                SourcePart(f"{p}gate_up_proj", "gate_up", (h, 2 * i), index=expert),
                SourcePart(f"{p}gate_up_proj_bias", "gate_up_bias", (2 * i,), index=expert),
                SourcePart(f"{p}down_proj", "down", (i, h), index=expert),
                SourcePart(f"{p}down_proj_bias", "down_bias", (h,), index=expert),
            ]

        def mxfp4(layer: int, expert: int) -> list[SourcePart]:
            p = f"model.layers.{layer}.mlp.experts."
            return [
                SourcePart(
                    f"{p}gate_up_proj_blocks",
                    "gate_up",
                    (2 * i, h // MXFP4_GROUP, 16),
                    index=expert,
                    transform="mxfp4",
                    scales_key=f"{p}gate_up_proj_scales",
                ),
                SourcePart(f"{p}gate_up_proj_bias", "gate_up_bias", (2 * i,), index=expert),
                SourcePart(
                    f"{p}down_proj_blocks",
                    "down",
                    (h, i // MXFP4_GROUP, 16),
                    index=expert,
                    transform="mxfp4",
                    scales_key=f"{p}down_proj_scales",
                ),
                SourcePart(f"{p}down_proj_bias", "down_bias", (h,), index=expert),
            ]

        return [ExpertFormat("bf16", bf16), ExpertFormat("mxfp4", mxfp4, quantized=True)]

    @classmethod
    def stored_layout(
        cls, config: Any, dtype: torch.dtype, fmt: ExpertFormat, expert_dtype: str | None
    ) -> tuple[ExpertLayout, ExpertFormat]:
        if fmt.name != "mxfp4" or expert_dtype is not None:
            return super().stored_layout(config, dtype, fmt, expert_dtype)
        i, h = int(config.intermediate_size), int(config.hidden_size)
        u8 = torch.uint8
        layout = ExpertLayout(
            [
                ComponentSpec("gate_up_blocks", (2 * i, h // MXFP4_GROUP, 16), u8),
                ComponentSpec("gate_up_scales", (2 * i, h // MXFP4_GROUP), u8),
                ComponentSpec("gate_up_bias", (2 * i,)),
                ComponentSpec("down_blocks", (h, i // MXFP4_GROUP, 16), u8),
                ComponentSpec("down_scales", (h, i // MXFP4_GROUP), u8),
                ComponentSpec("down_bias", (h,)),
            ],
            dtype,
            format="mxfp4",
        )

        def packed(layer: int, expert: int) -> list[SourcePart]:
            p = f"model.layers.{layer}.mlp.experts."
            return [
                SourcePart(
                    f"{p}gate_up_proj_blocks",
                    "gate_up_blocks",
                    (2 * i, h // MXFP4_GROUP, 16),
                    index=expert,
                ),
                SourcePart(
                    f"{p}gate_up_proj_scales",
                    "gate_up_scales",
                    (2 * i, h // MXFP4_GROUP),
                    index=expert,
                ),
                SourcePart(f"{p}gate_up_proj_bias", "gate_up_bias", (2 * i,), index=expert),
                SourcePart(
                    f"{p}down_proj_blocks", "down_blocks", (h, i // MXFP4_GROUP, 16), index=expert
                ),
                SourcePart(
                    f"{p}down_proj_scales", "down_scales", (h, i // MXFP4_GROUP), index=expert
                ),
                SourcePart(f"{p}down_proj_bias", "down_bias", (h,), index=expert),
            ]

        return layout, ExpertFormat("mxfp4", packed, quantized=True)

    def _swiglu_params(self) -> tuple[float, float]:
        # NOTE: transformers < 5.2x hard-codes alpha=1.702, limit=7.0 (the
        # gpt-oss values); newer versions read them from the config.
        limit = float(getattr(self.config, "swiglu_limit", 7.0))
        alpha = float(getattr(self.config, "swiglu_alpha", 1.702))
        return alpha, limit

    def dense_expert_weights(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.layout.format == "mxfp4":
            return unpack_mxfp4_experts(w, self.dtype)
        return super().dense_expert_weights(w)

    def grouped_experts(self) -> GptOssGroupedExperts:
        alpha, limit = self._swiglu_params()
        if self.layout.format == "mxfp4":
            # NOTE: probe (and compile) the Triton dequantizer now, not inside the first forward
            mxfp4_dequantizer(self.device)
        fused, reason = self.fused_slab_mlp("gptoss", alpha=alpha, limit=limit)
        experts = GptOssGroupedExperts(alpha, limit, self.slab_unpack(), fused)
        experts.gemm_reason = reason
        return experts

    def expert_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        alpha, limit = self._swiglu_params()
        w = self.dense_expert_weights(w)
        gate_up = x @ w["gate_up"] + w["gate_up_bias"]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        out: torch.Tensor = ((up + 1) * glu) @ w["down"] + w["down_bias"]
        return out

    def attention_sinks(self, layer: int) -> torch.Tensor | None:
        sinks: torch.Tensor = self._attn(layer).sinks
        return sinks
