"""Acceptance rules: greedy prefix + bonus, and lossless rejection sampling
(a statistical test with a fixed seed and a stated tolerance)."""

from __future__ import annotations

import math

import pytest
import torch

from pdflash.engine.acceptance import ForcedAcceptance, expected_tau, solve_alpha
from pdflash.engine.sampling import (
    SamplingParams,
    greedy_accept,
    rejection_accept,
    sample_from,
    target_probs,
)


def test_greedy_accept_prefix_and_bonus() -> None:
    argmax = torch.tensor([5, 6, 7, 8])
    assert greedy_accept(torch.tensor([5, 6, 7]), argmax) == (3, 8)
    assert greedy_accept(torch.tensor([5, 9, 7]), argmax) == (1, 6)
    assert greedy_accept(torch.tensor([1, 6, 7]), argmax) == (0, 5)
    assert greedy_accept(torch.tensor([], dtype=torch.int64), torch.tensor([4])) == (0, 4)
    with pytest.raises(ValueError, match="expected 3"):
        greedy_accept(torch.tensor([1, 2]), argmax)


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1.0, top_k=-2)


def test_target_probs_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[5 / 7, 2 / 7, 0.0, 0.0, 0.0]]))
    # nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is kept too (it crosses 0.8)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.2, 0.15, 0.0, 0.0]]) / 0.85)


def _chi2_sf_upper(df: int) -> float:
    """Critical chi-square value at p = 0.001 (Wilson-Hilferty approximation)."""
    z = 3.090232  # standard normal quantile for 0.999
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_rejection_sampling_reproduces_target_distribution() -> None:
    """Three drafted positions with position-wise target p_j and draft q_j (no
    context dependence): every committed position must be distributed as p_j.
    Tolerance: chi-square goodness of fit at p = 0.001 per position, 12000
    rounds, fixed seed."""
    gen = torch.Generator().manual_seed(1234)
    vocab, n = 5, 3
    p = torch.tensor(
        [
            [0.4, 0.3, 0.2, 0.1, 0.0],
            [0.05, 0.05, 0.1, 0.3, 0.5],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.7, 0.1, 0.1, 0.05, 0.05],
        ]
    )
    q = torch.tensor(
        [[0.1, 0.1, 0.1, 0.2, 0.5], [0.3, 0.3, 0.2, 0.1, 0.1], [0.6, 0.1, 0.1, 0.1, 0.1]]
    )
    counts = torch.zeros(n + 1, vocab)
    seen = torch.zeros(n + 1)
    rounds = 12000
    for _ in range(rounds):
        drafts = sample_from(q, gen)
        acc, bonus = rejection_accept(drafts, q, p, gen)
        committed = [*drafts[:acc].tolist(), bonus]
        for j, tok in enumerate(committed):
            counts[j, tok] += 1
            seen[j] += 1
    for j in range(n + 1):
        expected = p[j] * seen[j]
        support = expected > 0
        assert counts[j][~support].sum() == 0, f"position {j} produced a zero-probability token"
        chi2 = float((((counts[j] - expected) ** 2)[support] / expected[support]).sum())
        df = int(support.sum()) - 1
        assert chi2 < _chi2_sf_upper(df), (j, chi2, counts[j] / seen[j], p[j])
    assert seen[1] > 1000 and seen[3] > 100  # all positions were really exercised


def test_forced_acceptance_mean_matches_configuration() -> None:
    alpha = solve_alpha(4.68, 16)
    assert expected_tau(alpha, 15) == pytest.approx(4.68, abs=1e-9)
    forced = ForcedAcceptance(mean_tau=4.68, block_size=16, seed=3)
    draws = [forced.forced_accepts(0, 15) + 1 for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(4.68, rel=0.03)
    assert max(draws) <= 16 and min(draws) >= 1
    assert forced.forced_accepts(0, 0) == 0
    assert forced.params()["distribution"] == "truncated_geometric"
    with pytest.raises(ValueError, match="mean_tau"):
        ForcedAcceptance(mean_tau=17.0, block_size=16)


def test_forced_acceptance_is_per_request_and_cap_independent() -> None:
    a = ForcedAcceptance(mean_tau=5.0, block_size=16, seed=9)
    b = ForcedAcceptance(mean_tau=5.0, block_size=16, seed=9)
    seq_a = {1: [], 2: []}
    for _ in range(50):  # interleaved 1, 2
        for rid in (1, 2):
            seq_a[rid].append(a.forced_accepts(rid, 15))
    seq_b = {2: [b.forced_accepts(2, 15) for _ in range(50)], 1: []}
    c = ForcedAcceptance(mean_tau=5.0, block_size=16, seed=9)
    capped = [c.forced_accepts(1, 3) for _ in range(50)]
    seq_b[1] = [b.forced_accepts(1, 15) for _ in range(50)]
    assert seq_a == seq_b  # same draws whatever the interleaving
    assert capped == [min(x, 3) for x in seq_a[1]]  # trimming only caps the same draw
    assert seq_a[1] != seq_a[2]


def test_an_assigned_stream_key_draws_as_that_id_would() -> None:
    """A request keyed by its place in a workload draws what the request with
    that id draws, whatever its own id (warm-ups of different lengths shift
    the ids; the bench keys the measured requests by place and repeat)."""
    plain = ForcedAcceptance(mean_tau=5.0, block_size=16, seed=9)
    keyed = ForcedAcceptance(mean_tau=5.0, block_size=16, seed=9)
    keyed.assign_stream(40, 1)
    want = [plain.forced_accepts(1, 15) for _ in range(30)]
    assert [keyed.forced_accepts(40, 15) for _ in range(30)] == want
    other = ForcedAcceptance(mean_tau=5.0, block_size=16, seed=9)
    assert [other.forced_accepts(40, 15) for _ in range(30)] != want
    with pytest.raises(ValueError, match="drawn already"):
        keyed.assign_stream(40, 2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="stream key"):
            keyed.assign_stream(41, bad)  # type: ignore[arg-type]
    keyed.forget(40)
    assert [keyed.forced_accepts(40, 15) for _ in range(30)] != want  # its own id again
