"""Sampling parameters, target/draft distributions and the two acceptance rules.

Greedy acceptance keeps the longest prefix of drafted tokens that equals the
target's argmax and adds the target's next argmax (the bonus token). Lossless
rejection sampling (Leviathan et al. / Chen et al. 2023) accepts drafted token
``x`` with probability ``min(1, p(x) / q(x))`` and, on the first rejection,
samples from the residual ``max(p - q, 0)`` normalised; if every draft is
accepted, the bonus is drawn from the target's next distribution. Either way
the committed tokens are distributed exactly as the target would sample them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples. ``temperature == 0`` means greedy.

    ``top_k == 0`` disables top-k; ``top_p == 1.0`` disables nucleus sampling.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        _check_types(self)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_types(params: SamplingParams) -> None:
    """Numbers only (a bool or a string is a client bug, not a setting)."""
    for name in ("temperature", "top_p"):
        v = getattr(params, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
    k = params.top_k
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"top_k must be an integer, got {type(k).__name__} {k!r}")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``[N, V]`` (fp32) a request samples from, given raw logits.

    Order: temperature, then top-k, then top-p (the smallest prefix of the
    sorted distribution whose mass reaches ``top_p``; the token that crosses
    the threshold is kept), then renormalise.
    """
    if params.greedy:
        raise ValueError("target_probs needs temperature > 0 (greedy has no distribution)")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]`` -> ``[N]`` (int64, on CPU).

    NOTE: sampling runs on the CPU with a CPU generator so a seeded run gives
    the same tokens on every device.
    """
    return torch.multinomial(probs.detach().float().cpu(), 1, generator=generator).view(-1)


def greedy_accept(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """Longest matching prefix + bonus.

    ``draft_tokens`` ``[n]`` are the drafted tokens at block positions 1..n;
    ``target_argmax`` ``[n + 1]`` is the target's argmax after each block
    position 0..n. Returns (number of drafts accepted, bonus token).
    """
    n = int(draft_tokens.numel())
    if target_argmax.numel() != n + 1:
        raise ValueError(f"target_argmax has {target_argmax.numel()} entries, expected {n + 1}")
    if n == 0:
        return 0, int(target_argmax[0])
    match = (draft_tokens.view(-1) == target_argmax[:n].view(-1)).to(torch.int64)
    accepted = int(match.cumprod(0).sum())
    return accepted, int(target_argmax[accepted])


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs_rows: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Lossless speculative sampling over one block.

    ``draft_tokens`` ``[n]`` were sampled from ``draft_probs`` ``[n, V]``;
    ``target_probs_rows`` ``[n + 1, V]`` are the target distributions after
    block positions 0..n. Returns (number of drafts accepted, bonus token).
    """
    n = int(draft_tokens.numel())
    if target_probs_rows.shape[0] != n + 1:
        raise ValueError(
            f"target_probs_rows has {target_probs_rows.shape[0]} rows, expected {n + 1}"
        )
    if n == 0:
        return 0, int(sample_from(target_probs_rows[:1], generator)[0])
    idx = draft_tokens.view(-1, 1)
    p = target_probs_rows[:n].gather(1, idx).view(-1)
    q = draft_probs.gather(1, idx).view(-1)
    u = torch.rand(n, generator=generator).to(p.device)
    # accept while u * q < p, i.e. u < p / q without dividing by a zero q
    ok = (u * q < p).to(torch.int64)
    accepted = int(ok.cumprod(0).sum())
    if accepted == n:
        return n, int(sample_from(target_probs_rows[n : n + 1], generator)[0])
    residual = (target_probs_rows[accepted] - draft_probs[accepted]).clamp_min(0.0)
    total = float(residual.sum())
    # NOTE: a zero residual means p == q on this row; then any rejection had
    # probability 0, but floating point can still land here: fall back to p.
    dist = residual / total if total > 0.0 else target_probs_rows[accepted]
    return accepted, int(sample_from(dist.view(1, -1), generator)[0])
