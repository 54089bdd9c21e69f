"""bench/h200/trace_args.sh: the trace replay's matrix arguments (the one
owner trace_baselines.sh and width.sh build their commands from) are
arguments `pdflash-bench matrix` takes, naming the committed trace."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_replay_arguments_parse_as_a_matrix_on_the_committed_trace() -> None:
    from pdflash.bench.cli import build_parser

    trace, replay = subprocess.run(
        [
            "bash",
            "-c",
            '. bench/h200/trace_args.sh && echo "$TRACE" && '
            "trace_matrix_args gpt-oss-20b 1,4,16 0.2 32 3 480",
        ],
        cwd=_REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert (_REPO / trace).is_file()
    args = build_parser().parse_args(["matrix", *replay.split(), "--baselines", "PD"])
    assert (args.routing_source, args.acceptance, args.trace) == ("trace", "trace", trace)
    assert (args.arch, args.layers, args.weights, args.draft) == (
        ["gpt-oss-20b"],
        8,
        "synthetic",
        "synthetic",
    )
    assert (args.concurrency, args.cache_fraction, args.block_sizes) == ([1, 4, 16], [0.2], [16])
    assert (args.max_new_tokens, args.repeats, args.budget_s) == (32, 3, 480.0)
    assert (args.prompt_len, args.device, args.json, args.no_progress) == (64, "cuda", True, True)
    # the EXTRA options trace_baselines.sh's header suggests are matrix options
    extra = ["--cuda-graphs", "piecewise", "--controller-warmup", "first_round"]
    args = build_parser().parse_args(["matrix", *replay.split(), "--baselines", "PD", *extra])
    assert (args.cuda_graphs, args.controller_warmup) == ("piecewise", "first_round")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_closed_loop_needs_one_concurrency(tmp_path: Path) -> None:
    """CLOSED=N with a list of concurrencies is refused before anything runs
    (the closed loop's clients are one number)."""
    out = subprocess.run(
        ["bash", "bench/h200/trace_baselines.sh"],
        cwd=_REPO,
        env={"PATH": "/usr/bin:/bin", "CLOSED": "4", "CONC": "1,4", "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "CLOSED needs one CONC value" in out.stderr
