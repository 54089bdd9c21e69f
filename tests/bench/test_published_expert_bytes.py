"""``--expert-bytes-as`` sizes: bf16 dense published shapes, stored formats, byte counts."""

from __future__ import annotations

import pytest
from pdflash.bench.realtext import published_expert_nbytes


def test_gpt_oss_mxfp4_is_its_stored_layout() -> None:
    dense, dense_source = published_expert_nbytes("gpt-oss-20b")
    mxfp4, source = published_expert_nbytes("gpt-oss-20b-mxfp4")
    h, i = 2880, 2880  # gpt-oss-20b hidden and expert intermediate sizes
    # gate_up: 2i rows of h/32 groups (16 bytes of e2m1 pairs + 1 scale byte each);
    # down: h rows of i/32 groups; bf16 biases 2i + h
    packed = 2 * i * (h // 32) * 17 + h * (i // 32) * 17 + 2 * (2 * i + h)
    bf16 = 2 * (h * 2 * i + 2 * i + i * h + h)
    # each component starts 256-byte aligned
    assert bf16 <= dense < bf16 + 4 * 256
    assert packed <= mxfp4 < packed + 6 * 256
    assert 3.5 < dense / mxfp4 < 4.0
    assert "mxfp4 stored" in source and "bfloat16 dense" in dense_source


@pytest.mark.parametrize("bad", ["gpt-oss-20b-fp3", "0", "", "qwen3-30b-a3b-mxfp4"])
def test_bad_values_raise(bad: str) -> None:
    with pytest.raises(ValueError, match="expert_bytes_as"):
        published_expert_nbytes(bad)


def test_byte_count() -> None:
    assert published_expert_nbytes("123456")[0] == 123456
