"""The routing's host reads on CUDA, counted with torch's sync debug mode:
a routed hook and the offloaded block share one read, and the gate lookahead
reads once per layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pdflash.bench.eager_host import count_syncs

from pdflash.models.offload import routed_ids_on_host, shared_routing_reads

pytestmark = pytest.mark.gpu


def test_a_routing_is_read_once_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    ids = torch.randint(0, 32, (2, 4), device="cuda")

    def twice() -> None:
        with shared_routing_reads():
            routed_ids_on_host(ids)
            routed_ids_on_host(ids)

    assert count_syncs(twice) == 1
    assert routed_ids_on_host(ids).tolist() == ids.reshape(-1).tolist()


def test_the_gate_lookahead_reads_once_per_layer(tmp_path: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    from pdflash.models import load_adapter, write_synthetic_checkpoint
    from pdflash.routeahead import NextLayerLookahead

    path = write_synthetic_checkpoint(tmp_path / "g", "gpt_oss", "tiny", num_layers=2)
    adapter = load_adapter(path, device="cuda")
    look = NextLayerLookahead(adapter)
    hidden = torch.randn(3, adapter.hidden_size, device="cuda", dtype=adapter.dtype)
    got: list[Any] = []
    assert count_syncs(lambda: got.append(look.predict_next(0, hidden))) == 1
    ids, scores = got[0]
    assert ids.size > 0 and (scores > 0).all()


def test_eager_host_counts_the_syncs_of_an_offloaded_step_on_cuda(tmp_path: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    from pdflash.bench.eager_host import measure

    out = measure(
        layers=4,
        requests=1,
        tokens=2,
        prompt_len=8,
        steps=3,
        warm_steps=2,
        device="cuda",
        workdir=tmp_path,
    )
    syncs = out["syncs"]["torch_syncs_per_step"]
    # per layer with misses one routing read, per layer but the last one
    # lookahead read, the routing grid, and the cache's deferred flushes
    assert isinstance(syncs, int) and 1 <= syncs <= 4 * 4
    assert out["parts_us"]["readback"] > 0 and out["misses_per_step"] > 0
