"""Fixtures for the bench/report tests: valid rows and a fake engine that
honours the ``pdflash.bench.engine_run`` contract (RunSpec -> RunResult)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from pdflash.report.belady import belady

if TYPE_CHECKING:  # imported where used: it pulls in the engine
    from pdflash.bench.engine_run import RunSpec

BENCH_H200 = Path(__file__).resolve().parents[1] / "bench" / "h200"

#: a short CPU run of the tiny shape (RunSpec keywords besides the label and
#: the cache): the engine-run tests of the run settings share it
TINY_RUN: dict[str, Any] = {
    "arch": "tiny",
    "concurrency": 2,
    "block_size": 6,
    "max_new_tokens": 10,
    "prompt_len": 6,
}

#: a smaller CPU run with its cache, one client and two requests (RunSpec
#: keywords besides the label): the runs of the route-ahead gate, shadow
#: check and rest batching tests, where :data:`TINY_RUN`'s two clients and
#: block of 6 would change what the controller decides
TINY_ONE_CLIENT_RUN: dict[str, Any] = {
    "arch": "tiny",
    "device": "cpu",
    "concurrency": 1,
    "cache_fraction": 0.25,
    "num_requests": 2,
    "prompt_len": 8,
    "max_new_tokens": 8,
}


def load_bench_script(filename: str) -> ModuleType:
    """A GPU helper script of bench/h200/, loaded from the source tree by path
    (it is not package code: the wheel leaves bench/ out). Loaded once per
    session and registered in ``sys.modules`` (a dataclass looks its module up
    there); bench/h200/ goes on ``sys.path`` for the scripts that import a
    sibling (issue16.py imports diag_host_experts)."""
    path = BENCH_H200 / filename
    name = f"_bench_h200_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCH_H200) not in sys.path:
        sys.path.insert(0, str(BENCH_H200))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


#: a one-point matrix of PD on the tiny shape: the argv the run-setting
#: tests add their option to (:func:`check_a_matrix_option_keys_its_runs`)
PD_MATRIX_ARGV = [
    *("matrix", "--arch", "tiny", "--baselines", "PD"),
    *("--concurrency", "1", "--cache-fraction", "0.2"),
]


def pd_row(**fields: Any) -> dict[str, Any]:
    """A recorded row of PD at that one point (no spec), with ``fields``."""
    return {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2, **fields}


def check_a_matrix_option_keys_its_runs(
    argv: list[str], flag: str, value: str, field: str, out: Path
) -> None:
    """``pdflash-bench matrix ARGV FLAG VALUE`` plans specs whose ``field``
    is ``value`` and whose resume key differs from the plain plan's (which
    carries no ``field``: plain runs keep their specs and keys), and its
    command names the option only when given; a bad value is refused."""
    from pdflash.bench import cli
    from pdflash.bench.suites import matrix

    plain_args = cli.build_parser().parse_args(argv)
    plain = matrix.plan(plain_args)
    args = cli.build_parser().parse_args([*argv, flag, value])
    specs = matrix.plan(args)
    assert field not in plain[0]
    assert specs[0][field] == value
    assert matrix.spec_key(specs[0]) != matrix.spec_key(plain[0])
    assert f"{flag} {value}" in matrix.matrix_command(args, out)
    assert flag not in matrix.matrix_command(plain_args, out)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([*argv, flag, "not-a-choice"])


def check_an_issue16_arm_sets(name: str, text: str, value: Any) -> ModuleType:
    """An issue-16 arm ``PD:<name>=<text>`` overrides the run setting
    ``name`` with ``value`` and passes ``check_arms`` beside plain PD on the
    tiny CPU shape; returns the loaded issue16 module."""
    issue16 = load_bench_script("issue16.py")
    arms = issue16.parse_arms(f"PD,other=PD:{name}={text}")
    assert arms[1].overrides() == {name: value}
    base = {"arch": "tiny", "concurrency": 1, "cache_fraction": 0.2, "device": "cpu"}
    issue16.check_arms(arms, base, ["tiny"])
    return issue16


# Tokens/s of the fake engine, per baseline at concurrency 1 (scaled by
# concurrency): the expected order B0 < B1 < B2 < PD <= B3.
FAKE_TPS = {
    "B0": 10.0,
    "B1": 20.0,
    "B2": 25.0,
    "PD": 38.0,
    "B3": 40.0,
    # PD's ablations (issue 15) and PD+host
    "PD-all-on": 34.0,
    "PD-no-route-ahead": 30.0,
    "PD-one-band": 34.0,
    "PD-token-sched": 37.0,
    "PD-no-stream": 33.0,
    "PD-full-width": 32.0,
    "PD+host": 39.0,
}


def base_row(**overrides: Any) -> dict[str, Any]:
    """A valid PD row; override any field."""
    row: dict[str, Any] = {
        "arch": "tiny",
        "baseline": "PD",
        "weights_source": "synthetic",
        "acceptance_source": "forced",
        "acceptance_params": {"mean_tau": 4.0},
        "routing_source": "model",
        "device": "cpu",
        "link_gbps_measured": 1.0,
        "block_size": 16,
        "concurrency": 4,
        "cache_fraction": 0.2,
        "repeat": 0,
        "seed": 0,
        "output_tokens_per_s": 38.0,
        "acceptance_length_mean": 4.0,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": 0.2,
        "round_latency_p50_s": 0.05,
        "round_latency_p99_s": 0.09,
        "goodput_rps": 1.5,
        "slo_s": 2.0,
        "expert_cache_hit_rate": 0.5,
        "routeahead_coverage": 0.8,
        "routeahead_precision": 0.7,
        "wasted_prefetch_bytes": 1000.0,
        "exposed_fetch_s": 0.01,
        "h2d_bytes": 100000.0,
        "h2d_overlap_fraction": 0.6,
        "expert_occupancy_bytes": 50000.0,
        "kv_occupancy_bytes": 20000.0,
        "scheduler_us_per_step": 12.0,
        "eta": 0.95,
        "compute_busy_s": 1.0,
        "link_busy_s": 0.5,
        "wall_s": 1.05,
        "link_busy_fraction": 0.48,
        "useful_byte_fraction": 0.9,
        "committed_tokens": 100,
        "bytes_per_token": 1000.0,
        "routed_expert_bytes": 200000.0,
        "belady_bytes": 90000.0,
        "belady_bytes_per_token": 900.0,
        "bytes_per_token_vs_belady": 1000.0 / 900.0,
    }
    row.update(overrides)
    return row


@pytest.fixture
def make_row() -> Callable[..., dict[str, Any]]:
    return base_row


def full_matrix(
    concurrency: tuple[int, ...] = (1, 4),
    fractions: tuple[float, ...] = (0.2,),
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """A complete valid result set: every baseline at every point, each
    ``repeats`` times with the same figures (intervals of zero width, so
    the interval verdicts follow the medians)."""
    if repeats > 1:
        one = full_matrix(concurrency, fractions)
        return [dict(r, repeat=rep) for rep in range(repeats) for r in one]
    rows = []
    for cf in fractions:
        for conc in concurrency:
            for b in ("B0", "B1", "B2", "PD"):
                extra: dict[str, Any] = {}
                if b != "PD":
                    extra = {
                        "routeahead_coverage": None,
                        "routeahead_precision": None,
                        "not_measured": {
                            "routeahead_coverage": f"{b} predicts nothing",
                            "routeahead_precision": f"{b} predicts nothing",
                        },
                    }
                rows.append(
                    base_row(
                        baseline=b,
                        concurrency=conc,
                        cache_fraction=cf,
                        output_tokens_per_s=FAKE_TPS[b] * conc,
                        **extra,
                    )
                )
    for conc in concurrency:
        rows.append(
            base_row(
                baseline="B3",
                concurrency=conc,
                cache_fraction=1.0,
                output_tokens_per_s=FAKE_TPS["B3"] * conc,
                routeahead_coverage=None,
                routeahead_precision=None,
                not_measured={
                    "routeahead_coverage": "B3 predicts nothing",
                    "routeahead_precision": "B3 predicts nothing",
                },
            )
        )
    return rows


@pytest.fixture
def matrix_rows() -> Callable[..., list[dict[str, Any]]]:
    return full_matrix


@dataclasses.dataclass
class FakeRunResult:
    row: dict[str, Any]
    routing_trace: list[np.ndarray]
    cache_slots: int
    expert_nbytes: int


class FakeEngine:
    """Deterministic stand-in for run_spec; records the specs it ran."""

    layers, experts, top_k = 2, 8, 2

    def __init__(self, fail_on: str | None = None) -> None:
        self.specs: list[RunSpec] = []
        self.fail_on = fail_on

    def __call__(self, spec: RunSpec, progress: Any = None) -> FakeRunResult:
        self.specs.append(spec)
        if self.fail_on is not None and spec.baseline == self.fail_on:
            raise RuntimeError(f"planted failure for {spec.baseline}")
        rng = np.random.default_rng(spec.seed + spec.repeat)
        rounds = 6
        trace = [
            layer * self.experts + rng.choice(self.experts, size=self.top_k, replace=False)
            for _ in range(rounds)
            for layer in range(self.layers)
        ]
        total = self.layers * self.experts
        slots = (
            total if spec.baseline == "B3" else max(self.top_k, int(spec.cache_fraction * total))
        )
        committed = 24 * spec.concurrency
        # bytes moved: PD 10% above the optimum for its trace, others 60%
        optimum = belady(trace, slots, 4096).bytes_moved
        h2d = 0.0 if spec.baseline == "B3" else optimum * (1.1 if spec.baseline == "PD" else 1.6)
        nothing = not spec.baseline.startswith("PD") or spec.baseline == "PD-no-route-ahead"
        row = base_row(
            arch=spec.arch,
            baseline=spec.baseline,
            block_size=spec.block_size,
            concurrency=spec.concurrency,
            cache_fraction=spec.cache_fraction,
            repeat=spec.repeat,
            seed=spec.seed,
            device="cpu",
            output_tokens_per_s=FAKE_TPS[spec.baseline] * spec.concurrency,
            committed_tokens=committed,
            h2d_bytes=h2d,
            bytes_per_token=h2d / committed,
            goodput_rps=None if spec.slo_s is None else 1.0,
        )
        row["marginal_rule"] = spec.marginal_rule  # as run_spec records the setting
        if spec.arrivals != "burst":
            row["workload"] = {
                "arrivals": spec.arrivals,
                "rate_per_s": spec.rate_per_s,
                "users": spec.users,
                "think_s": spec.think_s,
            }
        for k in (
            "routed_expert_bytes",
            "belady_bytes",
            "belady_bytes_per_token",
            "bytes_per_token_vs_belady",
            "slo_s",
        ):
            row.pop(k)
        reasons: dict[str, str] = {}
        if spec.slo_s is None:
            reasons["goodput_rps"] = "no SLO"
        if nothing:
            row["routeahead_coverage"] = row["routeahead_precision"] = None
            reasons["routeahead_coverage"] = reasons["routeahead_precision"] = "no route-ahead"
        if reasons:
            row["not_measured"] = reasons
        return FakeRunResult(row=row, routing_trace=trace, cache_slots=slots, expert_nbytes=4096)


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[Any, FakeEngine]]:
    """``make(fail_on=None)``: a :class:`FakeEngine`, installed as the bench
    matrix's engine (``matrix.load_engine``) for the test; returns
    ``(RunSpec, engine)``."""

    def make(fail_on: str | None = None) -> tuple[Any, FakeEngine]:
        from pdflash.bench.engine_run import RunSpec
        from pdflash.bench.suites import matrix

        engine = FakeEngine(fail_on)
        monkeypatch.setattr(matrix, "load_engine", lambda: (RunSpec, engine))
        return RunSpec, engine

    return make
