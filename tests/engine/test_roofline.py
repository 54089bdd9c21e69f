"""The verify roofline's byte counting (pdflash.engine.roofline), checked by
hand on tiny gpt-oss and Qwen3 models and on known routings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine import roofline as rl
from pdflash.models import load_adapter, write_synthetic_checkpoint

F32 = 4  # bytes of one fp32 element (the adapters below load in fp32)


def _adapter(tmp: Path, arch: str, issuer: Any, **kw: Any) -> Any:
    path = write_synthetic_checkpoint(tmp / arch, arch, "tiny", seed=1, **kw)
    return load_adapter(path, issuer=issuer, cache_slots=8, max_batch_tokens=2, dtype=torch.float32)


def test_qwen3_parameter_bytes_by_hand(tmp_path: Path, host_issuer: Any) -> None:
    ad = _adapter(tmp_path, "qwen3_moe", host_issuer)
    # tiny qwen3: H=32, 4 heads x D=8 (32), 2 kv heads (16), 8 experts, V=128, 2 layers
    per_layer = (
        32 * 32  # q_proj
        + 32 * 16 * 2  # k_proj, v_proj
        + 32 * 32  # o_proj
        + 8 * 2  # q_norm, k_norm (head_dim)
        + 32 * 2  # input / post-attention RMSNorm
        + 8 * 32  # router
    )
    want_dense = (2 * per_layer + 32 + 128 * 32) * F32  # + final norm + lm_head
    assert rl.parameter_bytes(ad.hf_model) == (want_dense, 32 * F32)


def test_gptoss_parameter_bytes_by_hand(tmp_path: Path, host_issuer: Any) -> None:
    ad = _adapter(tmp_path, "gpt_oss", host_issuer, expert_format="mxfp4")
    per_layer = (
        (32 * 32 + 32)  # q_proj + bias
        + (32 * 16 + 16) * 2  # k_proj, v_proj + biases
        + (32 * 32 + 32)  # o_proj + bias
        + 4  # attention sinks (one per head)
        + 32 * 2  # norms
        + (8 * 32 + 8)  # router + bias
    )
    want_dense = (2 * per_layer + 32 + 128 * 32) * F32
    assert rl.parameter_bytes(ad.hf_model) == (want_dense, 32 * F32)


def test_tied_lm_head_reads_the_shared_matrix_in_full() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.norm = torch.nn.LayerNorm(6)
            self.head = torch.nn.Linear(6, 10, bias=False)

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.emb

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    m = Tied()
    untied = rl.parameter_bytes(m)
    assert untied == ((6 + 6 + 60) * F32, 6 * F32)  # norm weight + bias, head; not the table
    m.head.weight = m.emb.weight
    assert rl.parameter_bytes(m) == ((6 + 6 + 60) * F32, 6 * F32)  # the shared table, once


def test_model_of_a_gptoss_adapter_counts_stored_expert_bytes_and_windows(
    tmp_path: Path, host_issuer: Any
) -> None:
    from pdflash.engine.kv_cache import PagedKVCache

    ad = _adapter(tmp_path, "gpt_oss", host_issuer, expert_format="mxfp4")
    kv = PagedKVCache(
        num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=8,
        dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    model = rl.roofline_model(ad, kv, ad.expert_nbytes)
    assert model.kv_token_bytes == (2 * 2 * 8 * 2,) * 2  # K+V, 2 kv heads x 8, bf16
    assert model.windows == (4, None)  # tiny gpt-oss: sliding layer, then full
    # MXFP4 as stored (one cache slot): gate_up blocks [2I=64, H/32=1, 16 B], its 64
    # scales, its 64 fp32 biases, down blocks [H=32, I/32=1, 16 B], 32 scales, 32 fp32
    # biases (I=H=32), each part aligned to 256 B in the slot
    parts = (64 * 16, 64, 64 * F32, 32 * 16, 32, 32 * F32)
    assert model.expert_bytes == sum(-(-n // 256) * 256 for n in parts) == 2560
    dense = write_synthetic_checkpoint(tmp_path / "dense", "gpt_oss", "tiny", seed=1)
    ad_dense = load_adapter(
        dense, issuer=host_issuer, cache_slots=8, max_batch_tokens=2, dtype=torch.float32
    )
    assert model.expert_bytes < ad_dense.expert_nbytes  # the stored format, not dequantized


def test_kv_positions_read() -> None:
    assert rl.kv_positions_read(10, 4, None) == 14
    assert rl.kv_positions_read(10, 4, 4) == 7  # queries 10..13 read 7..13
    assert rl.kv_positions_read(1, 4, 4) == 5  # fewer than the window allows
    assert rl.kv_positions_read(0, 1, 128) == 1
    with pytest.raises(ValueError, match="new >= 1"):
        rl.kv_positions_read(3, 0, None)


def test_forward_bytes_by_hand() -> None:
    model = rl.RooflineModel(
        dense_bytes=1000, embedding_row_bytes=10, expert_bytes=100,
        kv_token_bytes=(4, 4), windows=(4, None),
    )  # fmt: skip
    spans = [(10, 4), (1, 2)]  # two requests: 4 tokens after 10, 2 after 1
    parts = rl.forward_bytes(model, [3, 5], spans)
    assert parts["non_expert_params"] == 1000
    assert parts["embedding_rows"] == 6 * 10
    assert parts["experts"] == 8 * 100
    # layer 0 (window 4): 7 + 3 positions; layer 1 (full): 14 + 3
    assert parts["kv_cache"] == 4 * (7 + 3) + 4 * (14 + 3)
    assert parts["total"] == 1000 + 60 + 800 + 108
    mean = rl.mean_forward_bytes(model, [[3, 5], [1, 1]], [spans, [(0, 1)]])
    assert mean["experts"] == (800 + 200) / 2
    assert mean["kv_cache"] == (108 + 8) / 2
    with pytest.raises(ValueError, match="forwards"):
        rl.mean_forward_bytes(model, [[3, 5]], [])
    with pytest.raises(ValueError, match="no forward"):
        rl.mean_forward_bytes(model, [], [])
    with pytest.raises(ValueError, match="layers"):
        rl.RooflineModel(1, 1, 1, (4,), (None, None))


def test_distinct_experts_per_verify_forward_from_a_known_routing() -> None:
    # flat id = layer * 8 + expert; each entry is one forward-layer's distinct ids
    trace = [
        np.array([0, 1, 2]), np.array([8]),  # prefill
        np.array([1, 5]), np.array([9, 10, 15]),  # verify 1
        np.array([], dtype=np.int64), np.array([8 + 7]),  # verify 2: layer 0 routed nothing
    ]  # fmt: skip
    kinds = ["prefill"] * 2 + ["verify"] * 4
    assert rl.distinct_per_forward(trace, kinds, "verify", 2) == [[2, 3], [0, 1]]
    with pytest.raises(ValueError, match="whole forwards"):
        rl.distinct_per_forward(trace[:5], kinds[:5], "verify", 2)
    with pytest.raises(ValueError, match="kinds"):
        rl.distinct_per_forward(trace, kinds[:3], "verify", 2)


def test_hbm_bandwidth_is_not_measured_without_cuda() -> None:
    why = rl.measure_hbm_gbps("cpu")
    assert isinstance(why, str) and "no CUDA device" in why
    with pytest.raises(ValueError, match="positive"):
        rl.hbm_seconds(1.0, 0.0)
    assert rl.hbm_seconds(4e9, 2.0) == pytest.approx(2.0)
