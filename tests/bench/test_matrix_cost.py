"""What makes the GPU matrix cheaper per run, checked on the CPU at tiny
shapes: the shared warm-up (once per process and shape, runs start from the
same fresh state), the reused drafter, and the first-use check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pdflash.bench import engine_run
from pdflash.bench.engine_run import RunSpec, run_spec, shared_warmup_key
from pdflash.bench.suites.matrix import FIRST_USE_RATIO, first_use_check

from pdflash.report.schema import validate_row

#: row fields that do not depend on timing for a tiny CPU run without
#: prefetching (B1: copies only on demand)
STABLE = (
    "committed_tokens",
    "steps",
    "verify_forwards",
    "num_requests",
    "belady_bytes",
    "routed_expert_bytes",
    "initial_resident_experts",
    "acceptance_length_mean",
    "cache_slots",
    "expert_nbytes",
    "workload",
)


@pytest.fixture()
def fresh_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synthetic cache of its own and no shared warm-up from earlier tests."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    engine_run.release_targets()


def _spec(**kw: Any) -> RunSpec:
    base: dict[str, Any] = {"arch": "tiny", "baseline": "B1", "device": "cpu"}
    base |= {"concurrency": 3, "num_requests": 5, "block_size": 6}
    base |= {"max_new_tokens": 7, "prompt_len": 5}
    return RunSpec(**(base | kw))


@pytest.mark.usefixtures("fresh_process")
def test_the_shared_warm_up_runs_once_per_key_and_leaves_each_run_as_a_short_one() -> None:
    short = [run_spec(_spec(warmup="short", repeat=r)) for r in (0, 1)]
    shared = [run_spec(_spec(warmup="shared", repeat=r)) for r in (0, 1)]
    first, second = (r.row["warmup"] for r in shared)
    # the first run of the key pays the workload warm-up (3 running requests x 7 tokens)
    assert first["mode"] == "shared" and first["requests"] == 1 and first["new_tokens"] == 2
    assert first["shared"]["ran_now"] is True and first["shared"]["key_runs_before"] == 0
    assert first["shared"]["requests"] == 3 and first["shared"]["new_tokens"] == 21
    assert first["shared"]["s"] > 0
    # the next repeat reuses it
    assert second["shared"]["ran_now"] is False and second["shared"]["key_runs_before"] == 1
    assert second["shared"]["warmed_by_repeat"] == 0 and "s" not in second["shared"]
    # the measured run starts from the state a short warm-up leaves: the
    # shared pass ran on its own cache and issuer and left nothing behind
    for a, b in zip(short, shared, strict=True):
        for name in STABLE:
            assert a.row[name] == b.row[name], name
        assert a.initial_resident is not None and b.initial_resident is not None
        assert np.array_equal(a.initial_resident, b.initial_resident)
        assert len(a.routing_trace) == len(b.routing_trace)
        for x, y in zip(a.routing_trace, b.routing_trace, strict=True):
            assert np.array_equal(x, y)
        assert validate_row(b.row) == []
    # rows count the process's measured runs before them
    counts = [r.row["process_runs_before"] for r in short + shared]
    assert counts == list(range(counts[0], counts[0] + 4))


@pytest.mark.usefixtures("fresh_process")
def test_a_new_shape_gets_its_own_shared_warm_up() -> None:
    a = run_spec(_spec(warmup="shared", baseline="PD"))
    b = run_spec(_spec(warmup="shared", baseline="PD", cache_fraction=0.5))
    c = run_spec(_spec(warmup="shared", baseline="PD", cache_fraction=0.5, repeat=2))
    assert a.row["warmup"]["shared"]["ran_now"] is True
    assert b.row["warmup"]["shared"]["ran_now"] is True
    assert c.row["warmup"]["shared"]["ran_now"] is False
    # a new target forgets what was warmed with the old one
    engine_run.release_targets()
    d = run_spec(_spec(warmup="shared", baseline="PD", cache_fraction=0.5, repeat=1))
    assert d.row["warmup"]["shared"]["ran_now"] is True


def test_the_shared_warm_up_key_ignores_only_repeat_and_rate() -> None:
    base = _spec(arrivals="poisson", rate_per_s=2.0)
    assert shared_warmup_key(base) == shared_warmup_key(_spec(arrivals="poisson", repeat=3))
    assert shared_warmup_key(base) != shared_warmup_key(_spec(arrivals="burst"))
    for change in (
        {"baseline": "PD"},
        {"cache_fraction": 0.5},
        {"concurrency": 4},
        {"max_new_tokens": 8},
        {"seed": 1},
        {"layers": 1},
    ):
        other = _spec(arrivals="poisson", rate_per_s=2.0, **change)
        assert shared_warmup_key(base) != shared_warmup_key(other), change


def test_auto_warm_up_is_shared_on_cuda_and_short_on_cpu() -> None:
    import torch

    assert engine_run.warmup_mode(_spec(), torch.device("cpu")) == "short"
    assert engine_run.warmup_mode(_spec(), torch.device("cuda")) == "shared"
    assert engine_run.warmup_mode(_spec(warmup="workload"), torch.device("cuda")) == "workload"
    # CUDA graphs are recorded per engine: a shared pass would not record the run's
    graphed = _spec()
    object.__setattr__(graphed, "cuda_graphs", "auto")
    assert engine_run.warmup_mode(graphed, torch.device("cuda")) == "workload"
    object.__setattr__(graphed, "cuda_graphs", "off")
    assert engine_run.warmup_mode(graphed, torch.device("cuda")) == "shared"


@pytest.mark.usefixtures("fresh_process")
def test_consecutive_runs_reuse_the_loaded_drafter_and_release_drops_it() -> None:
    run_spec(_spec(baseline="B1"))
    (first,) = engine_run._DRAFTERS.values()
    run_spec(_spec(baseline="PD", repeat=1))
    (second,) = engine_run._DRAFTERS.values()
    assert second is first
    engine_run.release_targets()
    assert not engine_run._DRAFTERS


def _row(baseline: str, repeat: int, verify_s: float, forwards: int = 10) -> dict[str, Any]:
    spec = {"arch": "tiny", "baseline": baseline, "block_size": 16, "concurrency": 4}
    spec |= {"cache_fraction": 0.2, "repeat": repeat}
    return {"spec": spec, "verify_s": verify_s, "verify_forwards": forwards}


def test_first_use_check_compares_the_first_repeat_with_the_later_ones() -> None:
    rows = [
        # B1: first repeat 30 ms per verify, later 20 and 24 (median 22): 1.364
        _row("B1", 0, 0.30),
        _row("B1", 1, 0.20),
        _row("B1", 2, 0.24),
        # PD: 21 ms against a median of 21 (20 and 22): 1.0
        _row("PD", 0, 0.21),
        _row("PD", 1, 0.20),
        _row("PD", 2, 0.22),
        # one repeat only: no comparison
        _row("B2", 0, 0.5),
        # no verify forward (B0-like): skipped
        _row("B3", 0, 0.0, forwards=0),
        _row("B3", 1, 0.0, forwards=0),
    ]
    check = first_use_check(rows)
    assert check["points"] == 2
    assert check["max_ratio"] == pytest.approx(30 / 22)
    assert check["median_ratio"] == pytest.approx((30 / 22 + 1.0) / 2)
    assert check["threshold"] == FIRST_USE_RATIO
    (slow,) = check["slow_first"]
    assert slow["point"].startswith("tiny/B1/") and slow["ratio"] == pytest.approx(30 / 22)
    assert first_use_check([_row("B1", 0, 0.3)])["points"] == 0


@pytest.mark.usefixtures("fresh_process")
@pytest.mark.parametrize("arch", ["tiny", "tiny-gpt_oss"])
def test_generated_synthetic_weights_give_the_rows_written_files_give(arch: str) -> None:
    gen = run_spec(_spec(arch=arch))
    engine_run.release_targets()
    files = run_spec(_spec(arch=arch, synthetic_weights="files"))
    assert gen.row["weights_source"] == files.row["weights_source"] == "synthetic"
    assert gen.row["synthetic_weights"] == "generated"
    assert files.row["synthetic_weights"] == "files"
    for name in STABLE:
        assert gen.row[name] == files.row[name], name
    for x, y in zip(gen.routing_trace, files.routing_trace, strict=True):
        assert np.array_equal(x, y)
    assert [r["output_tokens"] for r in gen.requests] == [
        r["output_tokens"] for r in files.requests
    ]
    root = Path(engine_run.cache_root()) / "synthetic"
    # the cached directory's name: <arch...>-<device>-generated-<key digest>
    (gen_dir,) = [p for p in root.iterdir() if "-generated-" in p.name]
    assert not list((gen_dir / "target").glob("*.safetensors"))
    with pytest.raises(ValueError, match="synthetic_weights must be"):
        run_spec(_spec(synthetic_weights="disk"))


@pytest.mark.usefixtures("fresh_process")
def test_the_shared_pass_calibrates_m_with_one_verify_batch_and_the_run_with_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = engine_run._calibrate

    def recording(spec: RunSpec, requests: int, engine: Any, vocab: int) -> tuple[float, float]:
        calls.append(requests)
        return real(spec, requests, engine, vocab)

    monkeypatch.setattr(engine_run, "_calibrate", recording)
    kw = {"baseline": "PD", "byte_budget_from": "verify", "max_running": 4, "token_budget": 12}
    first = run_spec(_spec(warmup="shared", **kw)).row
    second = run_spec(_spec(warmup="shared", repeat=1, **kw)).row
    # warm pass: token_budget / block = 2 requests; each measured run: max_running = 4
    assert calls == [2, 4, 4]
    for row in (first, second):
        assert row["byte_budget_from"] == "verify" and row["byte_budget_verify_compute_s"] > 0
        assert row["token_budget"] == 12 and row["max_running"] == 4
        assert validate_row(row) == []


def test_one_serving_matrix_over_every_label_holds_the_ablations_runs() -> None:
    """issue15.sh's serve step runs the baselines and the ablation labels in
    one matrix: the ablation over the same options then finds every one of
    its runs recorded (PD runs once for both tables)."""
    import argparse

    from pdflash.bench.suites import ablation, matrix

    serve = "--arch gpt-oss-20b --synthetic-format mxfp4 --arrivals poisson --rate 0.5,2"
    serve += " --num-requests 24 --prompt-len 64 --prompt-len-max 256 --max-new-tokens 128"
    serve += " --max-new-tokens-max 192 --max-running 16 --token-budget 64"
    serve += " --byte-budget-from verify --concurrency 16 --cache-fraction 0.2 --slo 30"
    host = " --host-threads 14 --host-workers 1"
    labels = (
        "B1,B2,B3,PD,PD-all-on,PD-no-route-ahead,PD-one-band,PD-token-sched,PD-no-stream,"
        "PD-full-width,PD+host"
    )
    mp = argparse.ArgumentParser()
    matrix.add_arguments(mp)
    merged = matrix.plan(
        mp.parse_args((serve + host + f" --baselines {labels} --repeats 3").split())
    )
    ap = argparse.ArgumentParser()
    ablation.add_arguments(ap)
    abl = ablation.plan(
        ap.parse_args(("--with-host" + host + " " + serve + " --repeats 3").split())
    )
    assert len(merged) == 11 * 2 * 3 and len(abl) == 8 * 2 * 3
    assert {matrix.spec_key(s) for s in abl} <= {matrix.spec_key(s) for s in merged}


@pytest.mark.usefixtures("fresh_process")
def test_the_shared_warm_ups_phases_split_its_host_weights_setup() -> None:
    row = run_spec(_spec(warmup="shared", baseline="PD+host", host_format="auto")).row
    setup = row["setup_s"]
    assert row["warmup"]["shared"]["ran_now"] is True
    assert "setup_s" not in row["warmup"]["shared"]  # moved into the row's setup_s
    # the pass prepared the host weights (format selection, then preparation) ...
    select = setup["shared_warmup.host_service.host_weights.format_select"]
    prepare = setup["shared_warmup.host_service.host_weights.prepare"]
    assert select > 0 and prepare >= 0
    assert select + prepare <= setup["shared_warmup.host_service"] <= setup["shared_warmup"]
    assert setup["shared_warmup.link_probe"] >= 0
    # ... and the measured run reused them
    assert row["host_service"]["host_weights"]["reused"]
    assert "host_service.host_weights.prepare" not in setup
    top = sum(v for k, v in setup.items() if "." not in k and k not in ("before_clock", "other"))
    assert setup["before_clock"] == pytest.approx(top + setup["other"])
    assert validate_row(row) == []
