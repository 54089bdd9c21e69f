"""``python -m pdflash.bench.eager_host``: the host parts of an eager
offloaded verify step, and the one routing read a layer's readers share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pdflash.bench.eager_host import PARTS, ExclusiveTimer, count_syncs, measure


def test_exclusive_timer_charges_callees_to_their_own_part() -> None:
    timer = ExclusiveTimer()
    inner = timer.wrap("inner", lambda: sum(range(20000)))
    outer = timer.wrap("outer", lambda: inner() + inner())
    outer()
    assert timer.calls == {"inner": 2, "outer": 1}
    assert timer.seconds["inner"] > 0 and timer.seconds["outer"] >= 0
    # "lookahead" is inclusive: its callees are not split out, but for its router
    router = timer.wrap("lookahead_router", lambda: sum(range(100)))
    look = timer.wrap("lookahead", lambda: (inner(), router()))
    look()
    assert timer.calls["inner"] == 2 and timer.calls["lookahead"] == 1
    assert timer.calls["lookahead_router"] == 1


def test_count_syncs_counts_sync_warnings_not_the_debug_modes_notice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import warnings

    def set_mode(mode: Any) -> None:
        # torch warns once per process, on the mode's first use, that it is a prototype
        if mode == "warn":
            warnings.warn(
                "Synchronization debug mode is a prototype feature", UserWarning, stacklevel=2
            )

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)

    def two_reads() -> None:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)

    assert count_syncs(two_reads) == 2
    assert count_syncs(lambda: None) == 0


def test_eager_host_times_the_parts_of_an_offloaded_verify(tmp_path: Path) -> None:
    out = measure(
        layers=4, requests=2, tokens=2, prompt_len=8, steps=3, warm_steps=1, workdir=tmp_path
    )
    parts = out["parts_us"]
    assert list(parts) == list(PARTS)
    assert out["misses_per_step"] > 0 and out["moe_path"] == "grouped"
    for part in ("attention", "router", "readback", "books", "gemm", "moe_rest"):
        assert parts[part] > 0, part
    assert parts["lookahead_router"] > 0  # the gate lookahead's router pass
    assert parts["trace_begin"] == parts["trace_route"] == 0  # no trace given
    # each step's glue is its forward less its timed parts (medians over steps)
    assert 0 < out["glue_us"] < out["forward_us"]
    lean = measure(
        layers=4,
        requests=1,
        tokens=1,
        prompt_len=8,
        steps=2,
        warm_steps=1,
        lookahead=False,
        workdir=tmp_path,
        detail=True,
    )
    assert lean["parts_us"]["lookahead"] == lean["parts_us"]["lookahead_router"] == 0
    assert "books.acquire" in lean["detail_us_mean"]
    assert out["expert_bytes_source"] == "model"
    # counted on CUDA only: absent here, with the reason
    assert out["syncs"] == {"torch_syncs_per_step": None, "why": "cpu: no device syncs"}
    padded = measure(
        layers=4,
        requests=1,
        tokens=1,
        prompt_len=8,
        steps=1,
        warm_steps=1,
        workdir=tmp_path,
        expert_bytes_as="1048576",
    )
    assert padded["expert_bytes_source"] == "padded" and padded["expert_nbytes"] >= 1 << 20
    assert padded["expert_nbytes"] > out["expert_nbytes"]
    with pytest.raises(ValueError, match="arch"):
        measure(arch="mixtral", workdir=tmp_path)


def test_a_routed_hook_and_the_offloaded_block_share_one_routing_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streaming prefetcher reads a layer's routing right before the
    block does: the block's counts then come from that read (no second
    device read), and equal the routing's bincount."""
    from pdflash.bench.eager_host import _checkpoint

    from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter, offload

    ckpt = _checkpoint(tmp_path, "gpt_oss", 4, 32, 4, torch.float32)
    issuer = H2DIssuer(backend="host")
    try:
        adapter: Any = load_adapter(ckpt, device="cpu")
        adapter.attach_new_cache(issuer, fraction=0.25, policy="layer_cyclic", max_batch_tokens=4)
        kv = kv_cache_for(adapter, page_size=16, num_pages=2, dtype=torch.float32, device="cpu")
        runner = TargetRunner(adapter, kv)
        seen: list[torch.Tensor] = []
        runner.routed_hooks.append(
            lambda layer, topk, x: (seen.append(topk), offload.routed_ids_on_host(topk))
        )
        runtime = adapter.runtime
        counted: list[tuple[int, list[int]]] = []
        real_read = runtime._routing_on_host
        real_cpu = torch.Tensor.cpu

        def counts(topk: torch.Tensor) -> Any:
            reads: list[int] = []

            def cpu(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
                reads.append(1)
                return real_cpu(self, *a, **kw)

            monkeypatch.setattr(torch.Tensor, "cpu", cpu)
            try:
                ids, out = real_read(topk)
            finally:
                monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
            assert topk is seen[-1]
            counted.append((len(reads), out.tolist()))
            ref = torch.bincount(topk.reshape(-1), minlength=adapter.num_experts)
            assert out.tolist() == ref.tolist()
            return ids, out

        runtime._routing_on_host = counts
        kv.add_sequence(0)
        with torch.no_grad():
            runner.forward([Chunk(0, torch.arange(4), True)])
        assert counted and all(n == 0 for n, _ in counted)
    finally:
        issuer.close()


def test_eager_host_times_the_host_parts_pieces_per_hosting_layer(tmp_path: Path) -> None:
    from pdflash.bench.eager_host import HOST_PARTS

    from pdflash.hybrid import block
    from pdflash.hybrid.executor import HostJob

    real = (block.host_rows, block.start_host_part, HostJob.result, block.HostPart.write_into)
    common: dict[str, Any] = {
        "layers": 4,
        "requests": 1,
        "tokens": 2,
        "prompt_len": 8,
        "steps": 3,
        "warm_steps": 1,
        "workdir": tmp_path,
    }
    hosted = measure(host_every=1, **common)["host"]
    assert hosted["hosting_layers_per_step"] > 0 and hosted["steps_with_host"] == 3
    pieces = hosted["pieces_us_per_hosting_layer"]
    assert list(pieces) == list(HOST_PARTS)
    for part in ("host_split", "host_rows", "host_launch", "host_result", "host_write"):
        assert pieces[part] > 0, part
    assert hosted["own_us_per_hosting_layer"] > 0 and hosted["wait_us_per_hosting_layer"] >= 0
    copied = measure(host_every=0, **common)["host"]
    # nothing hosted: nothing measured per hosting layer (absent, not 0)
    assert copied["hosting_layers_per_step"] == 0 and copied["steps_with_host"] == 0
    assert all(v is None for v in copied["pieces_us_per_hosting_layer"].values())
    assert copied["own_us_per_hosting_layer"] is None
    # the class and module patches are undone
    assert real == (
        block.host_rows,
        block.start_host_part,
        HostJob.result,
        block.HostPart.write_into,
    )
    with pytest.raises(ValueError, match="host_every"):
        measure(host_every=-1, **common)


def test_eager_host_times_pds_stream_and_counts_torch_calls(tmp_path: Path) -> None:
    """``stream``: PD's streaming prefetcher in the forward instead of the
    gate lookahead (its routed hook, its lookahead and pump), its books
    between forwards timed apart; every run counts torch calls per part."""
    common: dict[str, Any] = {
        "layers": 4,
        "requests": 1,
        "tokens": 2,
        "prompt_len": 8,
        "steps": 3,
        "warm_steps": 1,
        "workdir": tmp_path,
        "count_steps": 2,
    }
    pd = measure(stream=True, **common)
    assert pd["prefetch"] == "stream" and pd["lookahead"] is False
    parts, calls = pd["parts_us"], pd["torch_calls_per_step"]
    assert parts["stream_routed"] > 0 and parts["lookahead"] > 0
    assert parts["lookahead_router"] > 0  # the stream's gate lookahead
    assert pd["stream_plan_us"] is not None and pd["stream_plan_us"] > 0
    # the stream's routed hook reads the routing the block then reuses
    assert calls["stream_routed"] > 0 and calls["readback"] == 0
    assert calls["lookahead_router"] > 0 and calls["attention"] > 0
    assert calls["total"] >= sum(v for k, v in calls.items() if k != "total")
    b2 = measure(**common)
    assert b2["prefetch"] == "gate_lookahead" and b2["stream_plan_us"] is None
    assert b2["parts_us"]["stream_routed"] == 0 == b2["torch_calls_per_step"]["stream_routed"]
    assert b2["torch_calls_per_step"]["lookahead_router"] == calls["lookahead_router"]
    none = measure(
        lookahead=False, count_steps=0, **{k: v for k, v in common.items() if k != "count_steps"}
    )
    assert none["prefetch"] == "none" and none["torch_calls_per_step"] == {}


def test_eager_host_times_an_idle_cost_model_service_per_step(tmp_path: Path) -> None:
    """The cost-model planner with a costly configured host: the service is
    present, plans every layer with misses, hosts nothing; its split is
    timed per step and adds no torch call."""
    from pdflash.bench.eager_host import HOST_PARTS

    common: dict[str, Any] = {
        "layers": 4,
        "requests": 1,
        "tokens": 4,
        "prompt_len": 8,
        "steps": 3,
        "warm_steps": 1,
        "cache_fraction": 0.5,
        "count_steps": 1,
        "workdir": tmp_path,
    }
    out = measure(host_every=0, host_planner="makespan", host_expert_s=1.0, **common)
    host = out["host"]
    assert host["planner"] == "makespan" and host["forced"] is False
    assert host["host_cost_source"] == "configured" and host["host_expert_s"] == 1.0
    assert host["hosting_layers_per_step"] == 0 and out["misses_per_step"] > 0
    assert list(host["per_step_us"]) == list(HOST_PARTS)
    assert host["per_step_us"]["host_split"] > 0
    assert host["per_step_us"]["host_result"] == 0.0
    calls = out["torch_calls_per_step"]
    assert sum(calls[p] for p in HOST_PARTS) == 0
    with pytest.raises(ValueError, match="host_planner"):
        measure(host_every=0, host_planner="greedy", **common)
