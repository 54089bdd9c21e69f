"""Host staging of a forward's index copies (pdflash.engine.attention.HostStaging):
the prefill's prompts go to the device in one copy through the runner's
reused buffers (pinned on CUDA), giving the same tokens as before, and the
buffers are allocated once, not per call. The CPU cannot time the copies;
the GPU's asynchrony is the same code with ``non_blocking``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdflash.engine.attention import HostStaging, device_int64
from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine

from .conftest import greedy_reference, make_batcher_and_predictor

CPU = torch.device("cpu")


def test_staging_copies_rows_and_reuses_its_buffers() -> None:
    staging = HostStaging(CPU, depth=2)
    first = staging.copy([[1, 2, 3], [], [4]])
    assert [t.tolist() for t in first] == [[1, 2, 3], [], [4]]
    assert all(t.dtype == torch.int64 and t.device == CPU for t in first)
    for i in range(50):
        got = staging.copy([[i, i + 1], list(range(i % 7))])
        assert [t.tolist() for t in got] == [[i, i + 1], list(range(i % 7))]
    # one buffer per ring entry, allocated once; earlier results are not views of it
    assert staging.allocations == 2
    assert [t.tolist() for t in first] == [[1, 2, 3], [], [4]]
    # a copy larger than a buffer grows that one buffer (doubling), once
    big = list(range(1000))
    assert staging.copy([big])[0].tolist() == big
    assert staging.copy([big])[0].tolist() == big
    assert staging.copy([big])[0].tolist() == big
    assert staging.allocations == 4
    # nothing to copy: no buffer touched
    assert [t.numel() for t in staging.copy([[], []])] == [0, 0]
    assert staging.allocations == 4


def test_device_int64_through_staging_equals_without() -> None:
    rows = [[5, -1, 7], [2**40], []]
    staging = HostStaging(CPU)
    with_staging = device_int64(rows, CPU, staging)
    plain = device_int64(rows, CPU)
    assert [t.tolist() for t in with_staging] == [t.tolist() for t in plain] == rows
    with pytest.raises(ValueError, match="depth"):
        HostStaging(CPU, depth=0)
    with pytest.raises(ValueError, match="staging for cpu"):
        staging.copy([[1]], torch.device("meta"))


def test_prefill_through_staging_is_lossless_and_pins_once(
    adapter: Any, drafter: Any, hf_target: Any
) -> None:
    cfg = EngineConfig.preset("PD", block_size=4, max_running=3, token_budget=12)
    batcher, predictor = make_batcher_and_predictor(cfg, adapter)
    eng = Engine(
        adapter, cfg, drafter=drafter, batcher=batcher, predictor=predictor, max_seq_len=48
    )
    g = torch.Generator().manual_seed(5)
    vocab = hf_target.config.vocab_size
    staged: list[list[list[int]]] = []
    real_copy = eng.runner.staging.copy

    def spy(rows: list[list[int]], device: Any = None) -> list[torch.Tensor]:
        staged.append([list(r) for r in rows])
        return real_copy(rows, device)

    eng.runner.staging.copy = spy  # type: ignore[method-assign]
    allocations = []
    for _ in range(3):
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 8, 3)]
        ids = [eng.add_request(p, max_new_tokens=6) for p in prompts]
        done = eng.run_until_done(max_steps=100)
        for rid, p in zip(ids, prompts, strict=True):
            assert done[rid].output == greedy_reference(hf_target, p, 6)
        # the prompts went through the staging, all of them in one copy
        assert prompts in staged
        allocations.append(eng.runner.staging.allocations)
    # the same shapes again allocate nothing new: the buffers are reused
    assert allocations[0] > 0 and allocations[1] == allocations[2] == allocations[0]
    assert eng.kv.used_pages == 0
