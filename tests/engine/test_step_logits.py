"""The step's logits stay in ``lm_head``'s dtype (no fp32 copy): greedy
acceptance's argmax on them equals the argmax on their fp32 upcast, ties
included, and sampling's distribution is the same."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.engine.sampling import SamplingParams, target_probs
from pdflash.engine.target import step_logits
from pdflash.engine.verify import Verifier


def test_bf16_argmax_equals_fp32_argmax_with_ties_hand_made() -> None:
    rows = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # tie at 1 and 2: the first
            [5.0, 5.0, 5.0, 5.0],  # all tied: 0
            [-1.0, -2.0, -1.0, -3.0],  # tie at 0 and 2: 0
            [0.0, 0.0, 0.0, 7.0],
        ],
        dtype=torch.bfloat16,
    )
    assert torch.argmax(rows, dim=-1).tolist() == [1, 0, 0, 3]
    assert torch.equal(torch.argmax(rows, dim=-1), torch.argmax(rows.float(), dim=-1))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 40),
    vocab=st.integers(2, 300),
    levels=st.integers(1, 6),
)
def test_bf16_argmax_equals_fp32_argmax_random_with_many_ties(
    seed: int, rows: int, vocab: int, levels: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # few distinct values per row: ties for the maximum are the common case
    ints = torch.randint(0, levels, (rows, vocab), generator=gen)
    scale = torch.randn(rows, 1, generator=gen) * 30
    logits = (ints * scale).to(torch.bfloat16)
    assert torch.equal(torch.argmax(logits, dim=-1), torch.argmax(logits.float(), dim=-1))


def _req(anchor: int, drafts: list[int], temperature: float = 0.0) -> Any:
    return SimpleNamespace(
        anchor=anchor,
        drafts=torch.tensor(drafts, dtype=torch.int64),
        params=SamplingParams(temperature=temperature),
    )


def test_greedy_host_rows_are_the_same_for_bf16_and_its_fp32_upcast() -> None:
    gen = torch.Generator().manual_seed(5)
    batch = [(_req(1, [4, 2, 7]), 4), (_req(2, [1]), 2), (_req(3, [0, 5]), 3)]
    flat = (torch.randint(0, 3, (9, 50), generator=gen) * 1.5).to(torch.bfloat16)
    parts = list(torch.split(flat, [4, 2, 3]))
    for joint in (flat, None):  # the one-argmax path and the per-request one
        low = Verifier._greedy_to_host(SimpleNamespace(), batch, parts, joint)  # type: ignore[arg-type]
        high = Verifier._greedy_to_host(
            SimpleNamespace(),  # type: ignore[arg-type]
            batch,
            [p.float() for p in parts],
            None if joint is None else joint.float(),
        )
        assert set(low) == set(high) == {0, 1, 2}
        for i in low:
            assert torch.equal(low[i][0], high[i][0]) and torch.equal(low[i][1], high[i][1])


def test_target_probs_are_the_same_for_bf16_and_its_fp32_upcast() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(6, 80, generator=gen) * 4).to(torch.bfloat16)
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
    ):
        low, high = target_probs(logits, params), target_probs(logits.float(), params)
        assert low.dtype == torch.float32
        assert torch.equal(low, high)


def test_step_logits_keep_lm_head_dtype_and_values() -> None:
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(16).to(torch.bfloat16)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    adapter = SimpleNamespace(final_norm=norm, lm_head=head)
    x = torch.randn(7, 16).to(torch.bfloat16)
    out = step_logits(adapter, x)  # type: ignore[arg-type]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, head(norm(x)))
    assert torch.equal(torch.argmax(out, -1), torch.argmax(head(norm(x)).float(), -1))
