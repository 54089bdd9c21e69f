"""``--gpus N`` in the benchmark specs and CLIs: what an expert-parallel run
refuses before starting anything, and how the matrix keys and filters it."""

from __future__ import annotations

import argparse

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
