"""The verify step's batched host copy of greedy drafts and argmax rows
(hand-computed), and the batched anchors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdflash.engine.sampling import SamplingParams, greedy_accept
from pdflash.engine.verify import Verifier, anchor_tensor


def _req(anchor: int, drafts: list[int], temperature: float = 0.0) -> Any:
    return SimpleNamespace(
        anchor=anchor,
        drafts=torch.tensor(drafts, dtype=torch.int64),
        params=SamplingParams(temperature=temperature),
    )


def test_greedy_rows_come_back_in_one_copy_hand_computed() -> None:
    a = _req(7, [3, 1, 4])
    b = _req(8, [2, 2], temperature=0.7)  # sampled: not read here
    c = _req(9, [5])
    batch = [(a, 3), (b, 3), (c, 1)]  # a's grant keeps 2 drafts; c's keeps none
    logits = [
        # argmax per row: 3, 9, 0
        torch.tensor(
            [
                [0.0, 0, 0, 5, 0, 0, 0, 0, 0, 0],
                [0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                [2, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ]
        ),
        torch.zeros(3, 10),
        torch.tensor([[0.0, 0, 0, 0, 0, 0, 6, 0, 0, 0]]),  # argmax 6
    ]
    host = Verifier._greedy_to_host(SimpleNamespace(), batch, logits)  # type: ignore[arg-type]
    assert set(host) == {0, 2}
    drafts, argmax = host[0]
    assert drafts.tolist() == [3, 1] and argmax.tolist() == [3, 9, 0]
    assert drafts.device.type == "cpu" and argmax.device.type == "cpu"
    # drafts 3, 1 vs argmax 3, 9: one accepted, bonus 9
    assert greedy_accept(drafts, argmax) == (1, 9)
    drafts, argmax = host[2]
    assert drafts.tolist() == [] and argmax.tolist() == [6]
    assert greedy_accept(drafts, argmax) == (0, 6)
    assert Verifier._greedy_to_host(SimpleNamespace(), [(b, 3)], logits[1:2]) == {}  # type: ignore[arg-type]


def test_an_all_greedy_batch_takes_one_argmax_over_the_flat_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(3)
    reqs = [_req(1, [4, 2, 7]), _req(2, [1]), _req(3, [0, 5])]
    batch = [(reqs[0], 4), (reqs[1], 2), (reqs[2], 2)]
    flat = torch.randn(8, 11, generator=gen)
    flat[1, 3] = flat[1, 7] = flat[1].max() + 1  # a tie: the first index wins either way
    logits = list(flat.split([4, 2, 2]))
    calls: list[int] = []
    real_argmax = torch.argmax

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real_argmax(*a, **kw)

    monkeypatch.setattr(torch, "argmax", counted)
    per_request = Verifier._greedy_to_host(SimpleNamespace(), batch, logits)  # type: ignore[arg-type]
    assert len(calls) == 3
    calls.clear()
    joint = Verifier._greedy_to_host(SimpleNamespace(), batch, logits, flat)  # type: ignore[arg-type]
    assert len(calls) == 1
    assert set(joint) == set(per_request) == {0, 1, 2}
    for i in joint:
        assert torch.equal(joint[i][0], per_request[i][0])
        assert torch.equal(joint[i][1], per_request[i][1])
    assert joint[0][1][1].item() == 3
    # a sampled request in the batch: one argmax per greedy request again
    calls.clear()
    mixed = [(reqs[0], 4), (_req(2, [1], temperature=0.7), 2), (reqs[2], 2)]
    host = Verifier._greedy_to_host(SimpleNamespace(), mixed, logits, flat)  # type: ignore[arg-type]
    assert len(calls) == 2 and set(host) == {0, 2}
    assert torch.equal(host[2][1], per_request[2][1])


def test_anchor_tensor_keeps_request_order() -> None:
    reqs = [_req(7, []), _req(2, []), _req(5, [])]
    anchors = anchor_tensor(reqs, torch.device("cpu"))
    assert anchors.dtype == torch.int64 and anchors.tolist() == [7, 2, 5]
