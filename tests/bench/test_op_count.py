"""The CPU op counter of a B3 verify forward (pdflash.bench.op_count)."""

from __future__ import annotations

import pytest
import torch
from pdflash.bench import op_count

from pdflash.models import offload

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.bfloat16),
    reason="this torch has no CPU bf16 grouped_mm",
)


@needs_grouped
def test_counts_one_verify_forward_by_region() -> None:
    row = op_count.count_verify_ops("qwen3-30b-a3b", layers=2, requests=2, block=4)
    names = row["ops_by_region_and_name"]
    assert row["moe_path"] == "grouped" and row["verify_rows"] == 8
    assert row["slots"] == 2 * 128
    # one grouped call per projection per layer (every expert resident)
    assert names["experts/_grouped_mm"] == 2 * 2
    assert names["attention/_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert sum(names.values()) == row["total_ops"] == sum(row["ops_by_region"].values())
    per_layer = row["ops_per_layer"]
    assert per_layer["total"] == pytest.approx(
        sum(per_layer[r] for r in ("attention", "router", "experts"))
    )
    assert not any(name.split("/")[1] in op_count.VIEW_OPS for name in names)
