"""Tiny MoE models of all four architectures (random weights, written here)
for the predictor tests.

Each arch gets a synthetic checkpoint (``pdflash.models.write_synthetic_
checkpoint``: 4 layers, 64 experts, top-2), a ``pdflash.models`` adapter over
it (what predictors read: embeddings, norms, routers, attention) and the
plain transformers model loaded from the same files, whose real forward
gives the exact routed sets (captured by hooks on the router modules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from issuer_fixtures import reference_model

ARCHS = ("qwen3_moe", "gpt_oss", "mixtral", "olmoe")
LAYERS = 4
EXPERTS = 64
TOP_K = 2
VOCAB = 128  # the "tiny" presets' vocabulary
_EXPERT_COUNT_KEY = {
    "qwen3_moe": "num_experts",
    "olmoe": "num_experts",
    "mixtral": "num_local_experts",
    "gpt_oss": "num_local_experts",
}


@dataclass
class RealForward:
    """What one real forward did, per layer."""

    routed_ids: list[torch.Tensor]  # [T, k] per layer, exactly as the router chose
    moe_input: list[torch.Tensor]  # [T, hidden] residual entering each MoE (pre-norm)
    layer_output: list[torch.Tensor]  # [T, hidden] residual after each layer

    def routed_mask(self, rows: slice | None = None) -> npt.NDArray[np.bool_]:
        """(L, E) union over the selected positions."""
        mask = np.zeros((len(self.routed_ids), EXPERTS), dtype=np.bool_)
        for layer, ids in enumerate(self.routed_ids):
            sel = ids if rows is None else ids[rows]
            mask[layer, sel.reshape(-1).long().numpy()] = True
        return mask


@dataclass
class TinyMoE:
    arch: str
    path: Path
    adapter: Any  # pdflash.models adapter (MoEModelAdapter)
    _resident: Any = field(default=None, repr=False)

    layers: int = LAYERS
    experts: int = EXPERTS
    top_k: int = TOP_K
    vocab: int = VOCAB

    def resident(self, fresh: bool = False) -> torch.nn.Module:
        """The transformers model of the same checkpoint (``fresh``: a new
        copy a test may modify)."""
        if self._resident is not None and not fresh:
            return self._resident
        model = reference_model(self.path)
        if not fresh:
            self._resident = model
        return model

    def real_forward(self, token_ids: torch.Tensor, model: Any = None) -> RealForward:
        """Run the transformers model on one sequence; capture its routing."""
        model = self.resident() if model is None else model
        router_attr = type(self.adapter).router_attr
        routed: list[torch.Tensor] = []
        moe_in: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        hooks = []

        def on_router(_m: Any, _args: Any, output: tuple[torch.Tensor, ...]) -> None:
            routed.append(output[2].detach().reshape(-1, output[2].shape[-1]).clone())

        def on_moe_norm(_m: Any, args: tuple[torch.Tensor, ...]) -> None:
            moe_in.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

        def on_layer(_m: Any, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            outs.append(hidden.detach().reshape(-1, hidden.shape[-1]).clone())

        for layer in model.model.layers:
            hooks.append(getattr(layer.mlp, router_attr).register_forward_hook(on_router))
            hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(on_moe_norm))
            hooks.append(layer.register_forward_hook(on_layer))
        try:
            with torch.inference_mode():
                model(input_ids=token_ids[None, :], use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        assert len(routed) == len(moe_in) == len(outs) == self.layers
        return RealForward(routed, moe_in, outs)

    def tokens(self, count: int, length: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(3, self.vocab, (length,), generator=gen) for _ in range(count)]


def zero_experts(model: torch.nn.Module) -> None:
    """Make every expert output 0 (down projection and its bias)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name, param in layer.mlp.experts.named_parameters():
                if name.startswith("down_proj"):
                    param.zero_()


def zero_attention(model: torch.nn.Module) -> None:
    """Make every attention output 0 (output projection and its bias)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for param in layer.self_attn.o_proj.parameters():
                param.zero_()


@pytest.fixture(scope="session")
def tiny_moes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyMoE]:
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("routeahead_ckpts")
    built: dict[str, TinyMoE] = {}

    def get(arch: str) -> TinyMoE:
        if arch not in built:
            path = write_synthetic_checkpoint(
                root / arch,
                arch,
                "tiny",
                num_layers=LAYERS,
                dtype=torch.float32,
                seed=7,
                config_overrides={_EXPERT_COUNT_KEY[arch]: EXPERTS, "num_experts_per_tok": TOP_K},
            )
            adapter = load_adapter(path, dtype=torch.float32)
            assert (adapter.num_layers, adapter.num_experts, adapter.top_k) == (
                LAYERS,
                EXPERTS,
                TOP_K,
            )
            built[arch] = TinyMoE(arch, path, adapter)
        return built[arch]

    return get


@pytest.fixture(params=ARCHS)
def tiny(request: pytest.FixtureRequest, tiny_moes: Callable[[str], TinyMoE]) -> TinyMoE:
    return tiny_moes(str(request.param))


@pytest.fixture(scope="session")
def helpers() -> Any:
    """Module-level helpers for the tests (``--import-mode=importlib`` keeps a
    test module from importing conftest)."""

    @dataclass(frozen=True)
    class Helpers:
        zero_experts: Callable[[torch.nn.Module], None] = zero_experts
        zero_attention: Callable[[torch.nn.Module], None] = zero_attention

    return Helpers()
