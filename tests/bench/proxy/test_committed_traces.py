"""The GPU proxies' committed traces (bench/results/h200/proxy-2026-12-01, whose
router collapsed, and proxy-balanced-2026-12-01, retrained with a per-layer
balance loss) are valid, belong to their committed target and drafter, say what
their results README says, and replay on CPU without the weights (learned
routing and acceptance in CI)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from pdflash import traces as tf

H200_RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results" / "h200"
#: the balanced proxy, whose routing CI replays
RESULTS = H200_RESULTS / "proxy-balanced-2026-12-01"
#: loop tau per (results folder, trace) as that folder's README states it
README_TAU = {
    ("proxy-2026-12-01", "trace_gpu_greedy.npz"): 1.53,
    ("proxy-2026-12-01", "trace_gpu_t1.npz"): 1.50,
    ("proxy-balanced-2026-12-01", "trace_gpu_greedy.npz"): 1.75,
    ("proxy-balanced-2026-12-01", "trace_gpu_t1.npz"): 1.50,
}

pytestmark = pytest.mark.skipif(not RESULTS.is_dir(), reason="run from a repository checkout")


@pytest.mark.parametrize(("folder", "name"), sorted(README_TAU))
def test_committed_trace_is_valid_and_matches_its_provenance(folder: str, name: str) -> None:
    results = H200_RESULTS / folder
    trace = tf.load_trace(results / name)
    trace.validate()
    prov = trace.provenance
    target = json.loads((results / "provenance.json").read_text())
    drafter = json.loads((results / "drafter_provenance.json").read_text())
    config = json.loads((results / "config.json").read_text())
    assert prov["target_weights_sha256"] == target["weights_sha256"]
    assert prov["target_preset"] == target["preset"] == drafter["target_preset"]
    assert drafter["target_weights_sha256"] == target["weights_sha256"]
    assert (prov["num_layers"], prov["num_experts"], prov["top_k"]) == (
        config["num_hidden_layers"],
        config["num_local_experts"],
        config["num_experts_per_tok"],
    )
    outputs = np.diff(trace.token_request) - trace.prompt_len
    tau_loop = (
        float((outputs - 1).sum()) / trace.round_request.size
    )  # prefill's token is no round's
    assert tau_loop == pytest.approx(float(trace.round_accepted.mean()))
    assert tau_loop == pytest.approx(README_TAU[folder, name], abs=0.005)
    assert f"{README_TAU[folder, name]:.2f}" in (results / "README.md").read_text()


def test_committed_trace_replays_on_a_cpu_shape() -> None:
    from pdflash.bench.engine_run import RunSpec, run_spec

    path = RESULTS / "trace_gpu_t1.npz"
    trace = tf.load_trace(path)
    spec = RunSpec(
        arch="tiny",
        baseline="B2",
        device="cpu",
        concurrency=2,
        prompt_len=8,
        max_new_tokens=16,
        block_size=int(trace.provenance["block_size"]),
        routing_source="trace",
        acceptance="auto",
        trace=str(path),
    )
    res = run_spec(spec)
    row = res.row
    assert (row["routing_source"], row["acceptance_source"]) == ("trace", "trace")
    assert row["routing_params"]["trace_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    for r, req in enumerate(res.requests):
        rounds = trace.acceptance(r % trace.num_requests).tolist()
        got = req["acceptance_lengths"]
        assert got and got[:-1] == rounds[: len(got) - 1]
