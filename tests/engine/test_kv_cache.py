"""Paged KV cache: block tables, rollback frees pages, full cache errors."""

from __future__ import annotations

import pytest
import torch

from pdflash.engine.attention import AttentionBatch, masked_attention
from pdflash.engine.kv_cache import KVCacheFull, PagedKVCache


def _kv(pages: int = 6, *, layers: int = 2, head_dim: int = 4, page_size: int = 4) -> PagedKVCache:
    """A float32 CPU cache with one KV head."""
    return PagedKVCache(
        num_layers=layers,
        num_kv_heads=1,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=pages,
        dtype=torch.float32,
        device="cpu",
    )


def test_block_tables_rollback_and_free() -> None:
    kv = _kv()
    assert kv.page_nbytes == 2 * 2 * 4 * 1 * 4 * 4
    kv.add_sequence(1)
    kv.add_sequence(2)
    slots = kv.extend(1, 6)  # 2 pages
    assert slots.tolist() == [kv.block_table(1)[p // 4] * 4 + p % 4 for p in range(6)]
    kv.extend(2, 9)  # 3 pages
    assert kv.used_pages == 5 and kv.occupancy_bytes == 5 * kv.page_nbytes
    kv.truncate(2, 4)  # back to one page
    assert kv.length(2) == 4 and kv.used_pages == 3
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate(2, 5)
    kv.free(1)
    kv.free(1)  # unknown now: a no-op
    assert kv.used_pages == 1 and kv.num_sequences == 1
    kv.free(2)
    assert kv.used_pages == 0 and kv.free_pages == 6


def test_full_cache_raises_and_changes_nothing() -> None:
    kv = _kv(pages=2)
    kv.add_sequence(0)
    kv.extend(0, 5)
    with pytest.raises(KVCacheFull, match="needs 1 more KV pages, 0 free"):
        kv.extend(0, 4)
    assert kv.length(0) == 5 and kv.used_pages == 2
    with pytest.raises(ValueError, match="already in the KV cache"):
        kv.add_sequence(0)
    with pytest.raises(ValueError, match="num_pages must be positive"):
        _kv(0, layers=1, head_dim=1, page_size=1)


def test_masked_attention_with_sinks_matches_direct_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g)
    k = torch.randn(1, 1, 5, 4, generator=g)
    v = torch.randn(1, 1, 5, 4, generator=g)
    sinks = torch.tensor([0.5, -1.0])
    batch = AttentionBatch.build(
        [[0, 1, 2]], [[2, 3, 4]], [[0, 1, 2, 3, 4]], [[0, 1, 2, 3, 4]], 3, torch.device("cpu")
    )
    visible = batch.mask(causal=True, sliding_window=2)
    out = masked_attention(q, k, v, visible, scaling=0.5, sinks=sinks)
    for h in range(2):
        for i, qp in enumerate([2, 3, 4]):
            keys = [kp for kp in range(5) if kp <= qp and qp - kp < 2]
            logits = torch.stack([(q[0, h, i] * k[0, 0, kp]).sum() * 0.5 for kp in keys])
            w = torch.softmax(torch.cat([logits, sinks[h : h + 1]]), 0)[:-1]
            expect = (w[:, None] * v[0, 0, keys]).sum(0)
            torch.testing.assert_close(out[0, h, i], expect)


def test_batched_union_predictor_unions_scaled_scores() -> None:
    import numpy as np

    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.protocols import DraftedBlock

    class Fixed:
        def __init__(self, name: str, scores: np.ndarray) -> None:
            self.name, self.scores, self.seen = name, scores, []

        def predict(self, block: DraftedBlock) -> np.ndarray:
            return self.scores

        def observe(self, request_id: int, routed: np.ndarray) -> None:
            self.seen.append(request_id)

        def forget(self, request_id: int) -> None:
            self.seen.remove(request_id)

    a = Fixed("a", np.array([[4.0, 0.0, 2.0]], dtype=np.float32))
    b = Fixed("b", np.array([[0.0, 1.0, 0.0]], dtype=np.float32))
    pred = BatchedUnionPredictor([(a, 1.0), (b, 0.5)])
    block = DraftedBlock(0, torch.tensor([1, 2]), torch.tensor([0, 1]))
    out = pred.predict_batch([block, block])
    np.testing.assert_allclose(out[0], [[1.0, 0.5, 0.5]])
    assert out.shape == (2, 1, 3)
    pred.observe(3, np.zeros((1, 3), dtype=bool))
    assert a.seen == [3] and b.seen == [3]
    with pytest.raises(ValueError, match="at least one member"):
        BatchedUnionPredictor([])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fused_paged_attention_equals_the_padded_softmax(
    window: int | None, with_sinks: bool
) -> None:
    """SDPA (sinks as an extra key through an additive mask) vs the explicit
    fp32 padded softmax: two requests of different lengths (padding), GQA."""
    from pdflash.engine.attention import paged_attention
    from pdflash.protocols import AttentionSpec

    g = torch.Generator().manual_seed(1)
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        scaling=8**-0.5,
        sliding_window=window,
        has_sinks=with_sinks,
    )
    k_cache = torch.randn(20, 2, 8, generator=g)
    v_cache = torch.randn(20, 2, 8, generator=g)
    # request 0: 3 queries at positions 4..6 over keys 0..6 (slots 0..6);
    # request 1: 2 queries at positions 7..8 over keys 0..8 (slots 10..18)
    batch = AttentionBatch.build(
        [[0, 1, 2], [3, 4]],
        [[4, 5, 6], [7, 8]],
        [list(range(7)), list(range(10, 19))],
        [list(range(7)), list(range(9))],
        5,
        torch.device("cpu"),
    )
    q = torch.randn(5, 4, 8, generator=g)
    sinks = torch.randn(4, generator=g) if with_sinks else None
    fused = paged_attention(q, k_cache, v_cache, batch, spec, sinks)
    plain = paged_attention(q, k_cache, v_cache, batch, spec, sinks, fused=False)
    assert fused.shape == plain.shape == (5, 32)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=0)


def test_null_slot_stays_zero_and_belongs_to_no_page() -> None:
    kv = _kv(3, layers=1, head_dim=2, page_size=2)
    assert kv.null_slot == 6 and kv.k[0].shape[0] == 7
    kv.add_sequence(0)
    kv.grow(0, 6)  # every page
    slots = kv.slot_list(0, 0, 6)
    assert kv.null_slot not in slots
    kv.write(0, torch.tensor(slots), torch.ones(6, 1, 2), torch.ones(6, 1, 2))
    assert not kv.k[0][kv.null_slot].any() and not kv.v[0][kv.null_slot].any()
    assert bool(kv.k[0][:6].eq(1).all())


def test_slot_matrix_equals_slot_list_per_sequence() -> None:
    """The vectorised slot lookup (graph steps' index fill) against the
    per-sequence list it replaces, over sequences of uneven lengths whose
    pages interleave."""
    import numpy as np

    kv = _kv(40, layers=1, head_dim=2, page_size=4)
    rng = np.random.default_rng(5)
    for s in range(5):
        kv.add_sequence(s)
    for _ in range(12):  # grow in turns: each sequence's pages are scattered
        for s in range(5):
            kv.grow(s, int(rng.integers(0, 3)))
    kv.truncate(2, 1)
    seqs = [3, 0, 2, 4]
    for width in (1, 7, 40):
        out = kv.slot_matrix(seqs, width, fill=-9)
        assert out.shape == (4, width) and out.dtype == np.int64
        for i, s in enumerate(seqs):
            m = min(kv.length(s), width)
            assert out[i, :m].tolist() == kv.slot_list(s, 0, m)
            assert (out[i, m:] == -9).all()


def test_slot_matrix_uniform_pages_and_empty() -> None:
    """Every sequence holding every page the width spans gives the
    per-sequence lists too; no sequences: an empty matrix (not a reshape error)."""
    import numpy as np

    kv = _kv(40, layers=1, head_dim=2, page_size=4)
    for s in range(3):
        kv.add_sequence(s)
    for _ in range(9):  # interleaved growth: scattered pages
        for s in range(3):
            kv.grow(s, 1 + s)
    seqs = [2, 0, 1]
    for width in (4, 8, 9):  # every sequence has at least 3 pages
        out = kv.slot_matrix(seqs, width, fill=-1)
        assert out.shape == (3, width) and out.dtype == np.int64
        for i, s in enumerate(seqs):
            m = min(kv.length(s), width)
            assert out[i, :m].tolist() == kv.slot_list(s, 0, m)
            assert (out[i, m:] == -1).all()
    empty = kv.slot_matrix([], 8, fill=-1)
    assert empty.shape == (0, 8) and empty.dtype == np.int64
