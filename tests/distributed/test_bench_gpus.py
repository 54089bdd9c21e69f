"""``--gpus N`` in the benchmark specs and CLIs: what an expert-parallel run
refuses before starting anything, and how the matrix keys and filters it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from pdflash.bench.engine_run import RunSpec


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"gpus": 0}, "gpus must be >= 1"),
        ({"gpus": 2, "baseline": "B3"}, "B3"),
        ({"gpus": 2, "arrivals": "poisson", "rate_per_s": 1.0}, "burst arrivals only"),
        ({"gpus": 2, "device": "cuda:1"}, "cuda:r"),
        ({"gpus": 2, "placement": "frequency"}, "--trace"),
        ({"placement": "hash"}, "placement must be"),
    ],
)
def test_expert_parallel_specs_are_checked(over: dict[str, object], match: str) -> None:
    spec = RunSpec(arch="tiny", baseline=str(over.pop("baseline", "PD")), **over)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        spec.validate()


def test_plain_and_expert_parallel_specs_validate() -> None:
    RunSpec(arch="tiny", baseline="PD").validate()
    RunSpec(arch="tiny", baseline="B1", gpus=2).validate()
    # each rank's host serves misses of its own experts (from its own store)
    RunSpec(arch="tiny", baseline="PD+host", gpus=2).validate()


def test_matrix_keys_gpus_and_leaves_plain_specs_unchanged() -> None:
    from pdflash.bench.suites import matrix

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    plain = matrix.plan(parser.parse_args(["--arch", "tiny", "--concurrency", "1"]))
    two = matrix.plan(parser.parse_args(["--arch", "tiny", "--concurrency", "1", "--gpus", "2"]))
    assert all("gpus" not in s and "placement" not in s for s in plain)
    assert any(s["baseline"] == "B3" for s in plain)
    assert two and all(s["gpus"] == 2 and s["baseline"] != "B3" for s in two)
    assert {matrix.spec_key(s) for s in plain}.isdisjoint({matrix.spec_key(s) for s in two})


def test_report_keeps_expert_parallel_rows_apart() -> None:
    from pdflash.report.schema import arch_label, row_key

    one = {"arch": "gpt-oss-20b", "layers": 8, "baseline": "PD", "concurrency": 4}
    two = {**one, "gpus": 2}
    assert arch_label(one) == "gpt-oss-20b L8"
    assert arch_label(two) == "gpt-oss-20b L8 x2 GPUs"
    assert arch_label({**one, "gpus": 1}) == arch_label(one)
    assert row_key(one) != row_key(two)


def test_ranks_without_experts_are_named() -> None:
    from pdflash.distributed import (
        RoundRobinPlacement,
        check_every_rank_owns_experts,
        ranks_without_experts,
    )

    # expert e of layer l on rank (e + l) % N: 2 layers x 4 experts reach ranks 0..4
    assert ranks_without_experts(RoundRobinPlacement(2, 4, 5)) == []
    check_every_rank_owns_experts(RoundRobinPlacement(2, 4, 5), "host experts")
    assert ranks_without_experts(RoundRobinPlacement(2, 4, 7)) == [5, 6]
    with pytest.raises(ValueError) as err:
        check_every_rank_owns_experts(RoundRobinPlacement(2, 4, 7), "host experts")
    assert str(err.value) == (
        "host experts: ranks 5, 6 of 7 own none of the 2 layers x 4 experts under the "
        "round_robin placement (only 5 ranks own experts): run on fewer ranks, or without "
        "host experts"
    )


def test_host_experts_on_a_rank_without_experts_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More ranks than the grid spreads over: a clear error naming the ranks
    and the experts, before a rank starts (it was an IndexError in a rank's
    host-expert preparation); without host experts the check does not apply."""
    from pdflash.bench.distributed_run import expert_grid, run_ranks
    from pdflash.bench.engine_run import synthetic_paths

    import pdflash.distributed as dist
    from pdflash.serve.build import resolve_device

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    started: list[int] = []

    def launch(fn: object, nprocs: int, *args: object, device: str = "auto") -> list[object]:
        started.append(nprocs)
        raise RuntimeError("launched")

    monkeypatch.setattr(dist, "launch", launch)
    probe = RunSpec(arch="tiny", baseline="PD+host", device="cpu")
    layers, experts = expert_grid(synthetic_paths(probe, resolve_device("cpu"))[0])
    ranks = layers + experts  # round robin reaches layers + experts - 1 ranks
    spec = RunSpec(arch="tiny", baseline="PD+host", device="cpu", gpus=ranks)
    match = (
        rf"PD\+host with host experts \(auto\) on {ranks} ranks: rank {ranks - 1} of {ranks} "
        rf"owns none of the {layers} layers x {experts} experts"
    )
    with pytest.raises(ValueError, match=match):
        run_ranks(spec)
    with pytest.raises(ValueError, match="owns none"):
        run_ranks(
            RunSpec(arch="tiny", baseline="B1", host_experts="auto", device="cpu", gpus=ranks)
        )
    assert started == []
    # host experts off: no rank needs experts of its own for the host
    with pytest.raises(RuntimeError, match="launched"):
        run_ranks(RunSpec(arch="tiny", baseline="PD", device="cpu", gpus=ranks))
    with pytest.raises(RuntimeError, match="launched"):
        run_ranks(RunSpec(arch="tiny", baseline="PD+host", device="cpu", gpus=ranks - 1))
    assert started == [ranks, ranks - 1]


def test_a_rank_of_a_group_joined_without_run_ranks_checks_before_packing() -> None:
    from types import SimpleNamespace

    from pdflash.bench.distributed_run import rank_owned_experts

    group: Any = SimpleNamespace(rank=0, world_size=7)
    _, owned = rank_owned_experts(RunSpec(arch="tiny", baseline="PD+host", gpus=7), group)
    with pytest.raises(ValueError, match="ranks 5, 6 of 7 own none of the 2 layers x 4 experts"):
        owned(2, 4)
    _, plain = rank_owned_experts(RunSpec(arch="tiny", baseline="PD", gpus=7), group)
    # rank 0 of 7 owns expert 0 of layer 0 only
    assert plain(2, 4).tolist() == [[True, False, False, False], [False] * 4]
