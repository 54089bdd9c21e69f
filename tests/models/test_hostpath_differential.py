"""The offloaded block's miss path against the code it replaced
(:mod:`hostpath_reference`): the phase rows chosen on the host from the host
routing (one upload per group, no device gather) and the rows' slots
gathered once per group, versus the per-group ``[2, experts]`` table
gathered on the device and the slots gathered per phase (the staging and
event changes are CUDA-only: tests/models/test_hostpath_gpu.py). Over
random prompts on small caches (several groups per layer, evictions within
a layer), the logits, the slot table after each forward and the copies
submitted (experts, slots, band, in order) are the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostpath_reference import drive, install_old_path

from pdflash.models import offload
from pdflash.models.offload import OffloadedMoE

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("slots", [4, 6])
def test_miss_path_equals_the_gathered_one(
    arch: str,
    slots: int,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"new": 0}
    new_phase_rows = OffloadedMoE._phase_rows

    def counted(self: OffloadedMoE, *args: Any) -> torch.Tensor:
        calls["new"] += 1
        return new_phase_rows(self, *args)

    for seed in (1, 2):
        with monkeypatch.context() as m:
            install_old_path(m)
            old = drive(tiny_checkpoints[arch], host_issuer, slots, seed)
        with monkeypatch.context() as m:
            m.setattr(OffloadedMoE, "_phase_rows", counted)
            new = drive(tiny_checkpoints[arch], host_issuer, slots, seed)
        for a, b in zip(old["logits"], new["logits"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(old["tables"], new["tables"], strict=True):
            assert np.array_equal(a, b)
        assert old["copies"] == new["copies"] and old["copies"]
    assert calls["new"] > 0  # partial groups ran (the rows selection was used)
