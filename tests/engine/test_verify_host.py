"""The verify step's batched host copy of greedy drafts and argmax rows
(hand-computed), and the batched anchors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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


def test_anchor_tensor_keeps_request_order() -> None:
    reqs = [_req(7, []), _req(2, []), _req(5, [])]
    anchors = anchor_tensor(reqs, torch.device("cpu"))
    assert anchors.dtype == torch.int64 and anchors.tolist() == [7, 2, 5]
