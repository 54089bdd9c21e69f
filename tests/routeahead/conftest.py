"""Tiny HF MoE models (random weights, built here) and a minimal adapter.

NOTE: ``HFRouterAdapter`` is the test's own window onto an HF model, just
the parts route-ahead predictors read (embeddings, norms, routers). The
exact routed sets come from the real HF forward, captured by hooks on the
gate modules, so a predictor is always scored against what the model did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

VOCAB = 96
HIDDEN = 64
LAYERS = 4
EXPERTS = 64
TOP_K = 2


def _tiny_config(arch: str, initializer_range: float) -> object:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=initializer_range,
        num_experts_per_tok=TOP_K,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=32, norm_topk_prob=True, **common
        )
    if arch == "olmoe":
        return transformers.OlmoeConfig(num_experts=EXPERTS, **common)
    if arch == "mixtral":
        return transformers.MixtralConfig(num_local_experts=EXPERTS, **common)
    raise ValueError(arch)


_MODEL_CLASSES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
ARCHS = tuple(_MODEL_CLASSES)


def build_tiny_moe(arch: str, seed: int = 0, initializer_range: float = 0.02) -> torch.nn.Module:
    """A random-weight tiny MoE model (HF's own init). 64 experts, top-2,
    so a 16-token block routes to well under half the experts of a layer
    and a prediction can be wrong; attention moves the residual stream about
    as much as the embeddings, so the proxies are not trivially exact."""
    torch.manual_seed(seed)
    cls = getattr(transformers, _MODEL_CLASSES[arch])
    model = cls(_tiny_config(arch, initializer_range)).eval()
    return model


class HFRouterAdapter:
    """The routers, norms and embeddings of an HF Qwen3-MoE/OLMoE/Mixtral model."""

    def __init__(self, model: torch.nn.Module, arch: str) -> None:
        cfg = model.config
        self.model = model
        self.arch = arch
        self.layers = model.model.layers
        self.num_layers = cfg.num_hidden_layers
        self.num_experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        self.top_k = cfg.num_experts_per_tok
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        experts = self.layers[0].mlp.experts
        self.expert_nbytes = (
            sum(p.numel() * p.element_size() for p in experts.parameters()) // self.num_experts
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].input_layernorm(hidden)

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].post_attention_layernorm(hidden)

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        return F.linear(normed, self.layers[layer].mlp.gate.weight)

    def route(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, weights, ids = self.layers[layer].mlp.gate(normed)
        return ids, weights


@dataclass
class RealForward:
    """What one real forward did, per layer."""

    routed_ids: list[torch.Tensor]  # [T, k] per layer, exactly as the gate chose
    moe_input: list[torch.Tensor]  # [T, hidden] residual entering each MoE (pre-norm)
    layer_output: list[torch.Tensor]  # [T, hidden] residual after each layer

    def routed_mask(self, rows: slice | None = None) -> npt.NDArray[np.bool_]:
        """(L, E) union over the selected positions."""
        layers = len(self.routed_ids)
        experts = EXPERTS
        mask = np.zeros((layers, experts), dtype=np.bool_)
        for layer, ids in enumerate(self.routed_ids):
            sel = ids if rows is None else ids[rows]
            mask[layer, sel.reshape(-1).numpy()] = True
        return mask


def real_forward(model: torch.nn.Module, token_ids: torch.Tensor) -> RealForward:
    """Run the HF model on one sequence and capture routing and residuals."""
    routed: list[torch.Tensor] = []
    moe_in: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    hooks = []

    def on_gate(_m: torch.nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
        routed.append(output[2].detach().clone())

    def on_moe_norm(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        moe_in.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

    def on_layer(_m: torch.nn.Module, _args: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        assert isinstance(hidden, torch.Tensor)
        outs.append(hidden.detach().reshape(-1, hidden.shape[-1]).clone())

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(on_gate))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(on_moe_norm))
        hooks.append(layer.register_forward_hook(on_layer))
    try:
        with torch.inference_mode():
            model(token_ids[None, :])
    finally:
        for h in hooks:
            h.remove()
    assert len(routed) == len(moe_in) == len(outs) == len(model.model.layers)
    return RealForward(routed, moe_in, outs)


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass(frozen=True)
class HFToolkit:
    """The helpers above, handed to tests as a fixture (with
    ``--import-mode=importlib`` a test module cannot import conftest)."""

    build: Callable[..., torch.nn.Module]
    adapter: Callable[[torch.nn.Module, str], HFRouterAdapter]
    real_forward: Callable[[torch.nn.Module, torch.Tensor], RealForward]
    vocab: int = VOCAB
    layers: int = LAYERS
    experts: int = EXPERTS
    top_k: int = TOP_K


@pytest.fixture(scope="session")
def hf() -> HFToolkit:
    return HFToolkit(build=build_tiny_moe, adapter=HFRouterAdapter, real_forward=real_forward)
