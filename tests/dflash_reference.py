"""The upstream ``dflash`` drafter as the reference for pdflash's (``from
dflash_reference import dflash_twin``; tests/ is on the path, see
conftest.py). Callers skip without the optional ``dflash`` package."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def dflash_twin(drafter_dir: Path, ours: torch.nn.Module) -> tuple[Any, list[list[int]]]:
    """``dflash``'s ``DFlashDraftModel`` of the config in ``drafter_dir`` with
    the weights of ``ours`` (only its rotary buffers are its own), in eval
    mode, and the list each of its draft rounds' greedy tokens is appended
    to (its ``compute_logits`` records them)."""
    import dflash.model as dflash_model
    from transformers import Qwen3Config

    cfg = json.loads((drafter_dir / "config.json").read_text())
    ours_only = ("architectures", "pdflash_proxy", "pdflash_synthetic")
    cfg = {k: v for k, v in cfg.items() if k not in ours_only}
    qcfg = Qwen3Config(**cfg)
    qcfg.num_target_layers = cfg["num_target_layers"]
    qcfg.dflash_config = cfg["dflash_config"]
    ref = dflash_model.DFlashDraftModel(qcfg).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    drafts: list[list[int]] = []
    original = ref.compute_logits

    def record(hidden: torch.Tensor, head: Any) -> torch.Tensor:
        logits = original(hidden, head)
        drafts.append(torch.argmax(logits, dim=-1)[0].tolist())
        return logits

    ref.compute_logits = record
    return ref, drafts
