"""``pdflash-bench matrix``: the baseline matrix of docs/design.md §6.

One engine run per (arch, baseline, block size, concurrency, cache fraction,
repeat), each appended as one JSON line to ``OUT/rows.jsonl``, which is never
rewritten: a rerun into the same folder skips the runs already recorded
(so a matrix cut short by ``--budget-s`` or a crash resumes where it
stopped). B3 keeps every expert resident, so it runs once per (arch, block,
concurrency, repeat) and is recorded at cache fraction 1.0; B0 decodes
autoregressively, so it runs once per (arch, concurrency, cache fraction,
repeat), at the first block size.

Each row is the engine's row plus what this suite measures from the run's
recorded routing trace: the bytes every forward layer routed to, and the
bytes Belady's offline-optimal replacement would have moved for the same
trace and cache size (``belady_bytes``, ``belady_bytes_per_token``,
``bytes_per_token_vs_belady``; with the run's cache size, starting from the
cache contents the engine had when its clock started, so the optimum and the
baseline start alike; ``belady_initial_state`` says ``engine``, or ``empty``
for an engine that does not report its starting contents;
``belady_free_start_bytes`` is the lower bound with a free choice of starting
contents). The real engine's rows carry these figures already (its row
builder computes them); the matrix computes them only for rows that lack
them. At the end the report of ``pdflash-bench report`` is written into the
same folder.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pdflash.engine.config import DEFAULT_ROUTE_AHEAD_GATE
from pdflash.report.schema import (
    CONTROLLER_WARMUPS,
    SETTING_DEFAULTS,
    recorded_spec_settings,
    spec_settings,
)

from ..workload import WARMUP_CHOICES
from . import _common as common

HELP = "run the baseline matrix (B0 B1 B2 B3 PD) and write rows + report"

ROWS_FILE = "rows.jsonl"
ERRORS_FILE = "errors.jsonl"
B3_CACHE_FRACTION = 1.0
#: Default repeats: enough for a 95% interval on the GPU; one on the CPU so
#: the bare ``pdflash-bench`` stays about a minute on two cores.
GPU_REPEATS = 3
CPU_REPEATS = 1

#: The serving-workload options of :class:`pdflash.bench.engine_run.RunSpec`
#: and their defaults: a spec carries one only where it differs (so specs and
#: resume keys of plain burst runs stay as they were).
SERVING_DEFAULTS: dict[str, Any] = {
    "arrivals": "burst",
    "users": None,
    "think_s": 0.0,
    "prompt_len_max": None,
    "max_new_tokens_max": None,
    "max_running": None,
    "token_budget": None,
    "byte_budget_from": "floor",
    "marginal_rule": "verify",
}

# The engine: RunSpec class and run_spec function (pdflash.bench.engine_run).
# A function (not a module-level import) so tests can substitute a fake engine
# and the CLI starts without importing torch.
Engine = tuple[Callable[..., Any], Callable[..., Any]]


#: the hybrid miss service's settings a plan passes only where they differ
#: from the engine's defaults (so specs and resume keys of plain runs are
#: unchanged); host_max_ratio is pdflash.hybrid.planner.DEFAULT_MAX_HOST_RATIO
#: (not imported: it pulls in torch; a test keeps them equal)
HOST_DEFAULTS: dict[str, Any] = {
    name: SETTING_DEFAULTS[name]
    for name in (
        "host_experts",
        "host_format",
        "host_workers",
        "host_threads",
        "host_max_ratio",
        "host_max_tokens",
        "host_critical_path",
        "host_queued",
        "host_job_term",
        "host_handoff",
        "host_affinity",
        "host_ahead",
        "host_ahead_from",
        "host_ahead_min_exposed",
        "host_control",
    )
}


def load_engine() -> Engine:
    """The engine's ``(RunSpec, run_spec)``."""
    from ..engine_run import RunSpec, run_spec

    return RunSpec, run_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    g = parser.add_argument_group("matrix")
    add_point_arguments(g, concurrency=[1, 4], cache_fraction=[0.2, 0.5, 0.8])
    g.add_argument("--baselines", type=common.baselines, default=["B0", "B1", "B2", "B3", "PD"])
    g.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"repeats per point, baselines interleaved round-robin (default {GPU_REPEATS} on a "
        f"GPU, {CPU_REPEATS} on the CPU)",
    )
    add_output_arguments(g, "matrix", no_report="only write rows.jsonl")


def add_point_arguments(
    g: argparse._ActionsContainer, *, concurrency: list[int], cache_fraction: list[float]
) -> None:
    """The points a suite on the matrix's runner runs (arch x block size x
    concurrency x cache fraction), with the suite's defaults."""
    g.add_argument(
        "--arch",
        type=common.archs,
        default=["tiny"],
        help="comma list of " + ", ".join(common.ARCHS),
    )
    g.add_argument("--block-sizes", type=common.positive_ints("--block-sizes"), default=[16])
    g.add_argument("--concurrency", type=common.positive_ints("--concurrency"), default=concurrency)
    g.add_argument("--cache-fraction", type=common.fractions, default=cache_fraction)


def add_output_arguments(g: argparse._ActionsContainer, suite: str, *, no_report: str) -> None:
    """Where a suite on the matrix's runner writes, its time budget and the
    dry run (``no_report``: what ``--no-report`` still writes)."""
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results folder (default bench-results/{suite}-<UTC>)",
    )
    g.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new run after this many seconds; rerun the same command to resume",
    )
    g.add_argument("--no-report", action="store_true", help=no_report)
    g.add_argument("--dry-run", action="store_true", help="list the planned runs; run nothing")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options passed to every engine run (shared with the default suite)."""
    g = parser.add_argument_group("each run")
    g.add_argument(
        "--weights",
        type=common.source_arg,
        default="synthetic",
        help="'synthetic' or a checkpoint path",
    )
    g.add_argument(
        "--draft",
        type=common.source_arg,
        default="synthetic",
        help="'synthetic' or a drafter checkpoint path",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--slo", type=float, default=None, help="per-request SLO in seconds (for goodput)"
    )
    g.add_argument(
        "--layers", type=int, default=None, help="truncate full-size synthetic shapes to N layers"
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per run (engine default: scaled to concurrency)",
    )
    g.add_argument("--prompt-len", type=int, default=32)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument(
        "--emulated-link-gbps",
        type=float,
        default=None,
        help="throttle the host copy backend to this many GB/s (CPU runs)",
    )
    g.add_argument(
        "--acceptance", default="auto", help="acceptance model: auto, model, forced or trace"
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch intra-op threads for CPU runs (default 1; 0 leaves torch's default)",
    )
    g.add_argument("--mean-tau", type=float, default=None, help="mean accepted length when forced")
    from .engine import (
        add_expert_storage_arguments,
        add_gpu_arguments,
        add_host_arguments,
        add_realtext_arguments,
        add_workload_arguments,
    )

    add_host_arguments(g)
    add_gpu_arguments(g)
    add_realtext_arguments(g)
    g.add_argument(
        "--eviction",
        default="auto",
        choices=["auto", "lru", "lfu", "route_ahead", "layer_cyclic"],
        help="expert-cache eviction for every run (auto: layer_cyclic for every offloaded baseline)",
    )
    g.add_argument(
        "--warmup",
        default="auto",
        choices=WARMUP_CHOICES,
        help="before each run's clock: short (one 2-token request), workload (the run's own "
        "shape once, every run), shared (that workload warm-up once per process for the runs "
        "that differ only in repeat and rate, then a short one per run on its own fresh cache), "
        "auto (default: shared on CUDA, short on CPU)",
    )
    g.add_argument(
        "--controller-warmup",
        default="off",
        choices=list(CONTROLLER_WARMUPS),
        help="first_round: after each run's warm-up, workload bursts outside the clock until "
        "PD's controller has ended its first round of probes (the state of a server's engine "
        "after its first steps; labels without the controller ignore it); off (default)",
    )
    g.add_argument(
        "--warm-bursts",
        type=common.warm_bursts_arg,
        default=0,
        help="workload bursts after each run's warm-up, outside the clock, for every label "
        "(before --controller-warmup's): give labels without the controller the warm-up a "
        "settled controller got; default 0",
    )
    g.add_argument(
        "--cuda-graphs",
        default="off",
        choices=list(common.CUDA_GRAPHS),
        help="CUDA graphs per shape bucket for every run on CUDA (auto; see `engine "
        "--cuda-graphs`); off (default) runs everything eagerly; part of each run's resume key",
    )
    g.add_argument(
        "--breakdown",
        action="store_true",
        help="time each verify's attention / router / experts (the rest: other and host gaps) "
        "in every run (row field verify_breakdown_ms, as `engine --breakdown`); the timed "
        "regions are part of each run's resume key",
    )
    g.add_argument(
        "--resident-graphs",
        default="off",
        choices=("off", "on"),
        help="recorded all-resident layer calls for every run (see `engine "
        "--resident-graphs`); off (default) runs them eagerly; part of each run's resume key",
    )
    g.add_argument(
        "--verify-width",
        type=common.verify_widths,
        default=["auto"],
        help=f"drafts each verify checks (pdflash.engine.verify_width), for every label: "
        f"{common.WIDTH_FORMS}; auto (default) is the label's preset: adaptive for PD, "
        "PD+host and PD's ablations but PD-full-width, full for the rest; or a comma list of "
        "them: every label runs at each (a width that resolves to one already listed is "
        "dropped), interleaved with the labels within every repeat, so each baseline can be "
        "compared at its best width in one "
        "process. Each spec names the width its run verifies at (auto resolved), which the row "
        "records and the resume key keys. The report shows a label run at several widths as "
        "one series per width",
    )
    add_expert_storage_arguments(g)
    add_workload_arguments(parser)


def default_repeats(device: str) -> int:
    """:data:`GPU_REPEATS` where the runs go to a GPU, else :data:`CPU_REPEATS`."""
    if device == "cpu":
        return CPU_REPEATS
    if device.startswith("cuda"):
        return GPU_REPEATS
    import torch

    return GPU_REPEATS if torch.cuda.is_available() else CPU_REPEATS


def resolved_repeats(args: argparse.Namespace) -> int:
    repeats = getattr(args, "repeats", None)
    if repeats is None:
        repeats = default_repeats(str(getattr(args, "device", "auto")))
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    return int(repeats)


def serving_kw(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The serving options that differ from RunSpec's defaults, one dict per
    request rate of a sweep (one empty dict for a plain burst)."""
    kw: dict[str, Any] = {}
    for name, default in SERVING_DEFAULTS.items():
        value = getattr(args, name, default)
        if value != default:
            kw[name] = value
    arrivals = kw.get("arrivals", "burst")
    rates = getattr(args, "rate", None)
    if arrivals == "poisson":
        if not rates:
            raise SystemExit("--arrivals poisson needs --rate")
        return [{**kw, "rate_per_s": float(r)} for r in rates]
    if rates:
        raise SystemExit("--rate applies to --arrivals poisson only")
    if arrivals == "closed" and not kw.get("users"):
        raise SystemExit("--arrivals closed needs --users")
    return [kw]


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """RunSpec keyword arguments for every run, in run order: per arch, per
    request rate, per cache fraction, per concurrency, then per repeat every
    baseline (interleaved round-robin: no baseline's repeats run back to
    back, and each repeat starts with the next baseline), so complete
    comparison groups finish first (a budget-cut matrix is still usable).
    B3 is repeated like the rest."""
    repeats = resolved_repeats(args)
    common_kw = {
        "weights": args.weights,
        "draft": args.draft,
        "seed": args.seed,
        "slo_s": args.slo,
        "layers": args.layers,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "device": args.device,
        "emulated_link_gbps": args.emulated_link_gbps,
        "acceptance": args.acceptance,
        "mean_tau": args.mean_tau,
        "eviction": args.eviction,
    }
    # only when given, so plans (and their rows' specs and keys) stay as before
    if getattr(args, "warmup", "auto") != "auto":
        common_kw["warmup"] = args.warmup
    if getattr(args, "controller_warmup", "off") != "off":
        common_kw["controller_warmup"] = args.controller_warmup
    if getattr(args, "warm_bursts", 0):
        common_kw["warm_bursts"] = args.warm_bursts
    if getattr(args, "cuda_graphs", "off") != "off":
        common_kw["cuda_graphs"] = args.cuda_graphs
    if getattr(args, "resident_graphs", "off") != "off":
        common_kw["resident_graphs"] = args.resident_graphs
    # runs that time their verify's regions (CUDA events in every layer) are rows of their own
    if getattr(args, "breakdown", False):
        common_kw["breakdown"] = True
    # expert-parallel ranks, only when asked for (plain specs unchanged)
    if getattr(args, "gpus", 1) != 1:
        common_kw["gpus"] = args.gpus
    if getattr(args, "placement", "round_robin") != "round_robin":
        common_kw["placement"] = args.placement
    for name, default in HOST_DEFAULTS.items():
        value = getattr(args, name, default)
        if value != default:
            common_kw[name] = value
    # only when given, so plans (and their rows' specs) without them are unchanged
    for name in ("synthetic_format", "expert_dtype"):
        if getattr(args, name, None) is not None:
            common_kw[name] = getattr(args, name)
    if getattr(args, "synthetic_weights", "generated") != "generated":
        common_kw["synthetic_weights"] = args.synthetic_weights
    from .engine import realtext_kwargs

    common_kw.update(realtext_kwargs(args))
    # the process-wide compressed-GEMM mode the runs will use: in every spec
    # (RunSpec refuses to run it in another), so a resume in another mode
    # cannot count this mode's runs as done
    common_kw["compressed_gemm"] = process_compressed_gemm()
    specs: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    loads = serving_kw(args)
    widths = _width_list(getattr(args, "verify_width", ["auto"]))
    for arch, load, cf, block, conc in itertools.product(
        args.arch, loads, args.cache_fraction, args.block_sizes, args.concurrency
    ):
        # each label at each width it resolves to, once
        runs = list(
            dict.fromkeys((b, common.resolved_width(w, b)) for b in args.baselines for w in widths)
        )
        for repeat in range(repeats):
            for baseline, width in rotated(runs, repeat):
                if baseline == "B3" and common_kw.get("gpus", 1) != 1:
                    continue  # every expert resident on one GPU: not expert-parallel
                frac = B3_CACHE_FRACTION if baseline == "B3" else cf
                # B0 decodes one token at a time: one run serves every block size
                blk = args.block_sizes[0] if baseline == "B0" else block
                spec = {
                    "arch": arch,
                    "baseline": baseline,
                    "block_size": blk,
                    "concurrency": conc,
                    "cache_fraction": frac,
                    "repeat": repeat,
                    **common_kw,
                    **load,
                }
                # every spec names the width its label runs at (auto resolved),
                # so RunSpec runs, the row records and the key keys that width
                spec["verify_width"] = width
                key = spec_key(spec)
                if key in seen:
                    continue
                seen.add(key)
                specs.append(spec)
    return specs


T = TypeVar("T")


def process_compressed_gemm() -> str:
    """The compressed-GEMM mode this process runs compressed experts in
    (:func:`pdflash.models.compressed_gemm.compressed_gemm_mode`:
    ``PDFLASH_COMPRESSED_GEMM`` or the library's default)."""
    from pdflash.models.compressed_gemm import compressed_gemm_mode

    return compressed_gemm_mode()


def _width_list(value: str | Sequence[str]) -> list[str]:
    """``--verify-width`` as a list (a plain string: one width, as callers
    that build the namespace themselves pass it)."""
    return [value] if isinstance(value, str) else list(value)


def rotated(labels: Sequence[T], repeat: int) -> list[T]:
    """``labels`` starting at the ``repeat``-th (round-robin interleaving:
    which baseline runs first changes from one repeat to the next, so slow
    drift of the machine is not charged to one baseline)."""
    k = repeat % len(labels) if labels else 0
    return [*labels[k:], *labels[:k]]


def spec_key(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a run is unique by (a rerun skips recorded keys): the point (with
    the depth and the GPU count), the repeat, the workload (specs without
    serving options are bursts, as every spec recorded before they existed)
    and every setting of :data:`pdflash.report.schema.RUN_SETTINGS` (the
    list the report's row key reads too)."""
    return (*_point_key(spec), *spec_settings(spec))


def row_spec_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """:func:`spec_key` of a recorded row (by the spec that produced it),
    its settings as the row ran them where its spec omits one
    (:func:`pdflash.report.schema.recorded_spec_settings`)."""
    return (*_point_key(row["spec"]), *recorded_spec_settings(row))


def _point_key(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        spec["arch"],
        spec.get("layers"),
        spec["baseline"],
        spec["block_size"],
        spec["concurrency"],
        float(spec["cache_fraction"]),
        spec["repeat"],
        spec.get("arrivals", "burst"),
        spec.get("rate_per_s"),
        spec.get("users"),
        spec.get("think_s", 0.0),
        spec.get("gpus", 1),
    )


def spec_label(spec: Mapping[str, Any], with_repeat: bool = False) -> str:
    """A spec as ``arch/baseline/blkB/cC/cfF`` (``/rR`` with its repeat, then
    ``/Xrps`` at a request rate)."""
    label = "{arch}/{baseline}/blk{block_size}/c{concurrency}/cf{cache_fraction}".format(**spec)
    if with_repeat:
        label += f"/r{spec['repeat']}"
    if spec.get("rate_per_s") is not None:
        label += f"/{spec['rate_per_s']:g}rps"
    return label


#: a first repeat whose verify step is this much slower than the median of
#: the later repeats of its point is flagged by :func:`first_use_check`
FIRST_USE_RATIO = 1.25


def verify_ms_per_forward(row: Mapping[str, Any]) -> float | None:
    """Mean verify step time of a row in ms (None without verify forwards)."""
    forwards = row.get("verify_forwards")
    verify_s = row.get("verify_s")
    if not isinstance(forwards, (int, float)) or not isinstance(verify_s, (int, float)):
        return None
    if forwards <= 0:
        return None
    return 1e3 * float(verify_s) / float(forwards)


def first_use_check(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Does a point's first repeat pay first-use costs its later repeats do
    not? Per point (every spec field but the repeat), the first repeat's mean
    verify step time over the median of the later repeats'; points above
    :data:`FIRST_USE_RATIO` are listed under ``slow_first``. A warm-up that
    sets up every shape the runs meet keeps every ratio near 1."""
    import statistics

    groups: dict[tuple[Any, ...], dict[int, float]] = {}
    labels: dict[tuple[Any, ...], str] = {}
    for row in rows:
        spec = row.get("spec")
        ms = verify_ms_per_forward(row)
        if not isinstance(spec, Mapping) or ms is None:
            continue
        key = row_spec_key({**row, "spec": {**spec, "repeat": -1}})
        groups.setdefault(key, {})[int(spec.get("repeat", 0))] = ms
        labels.setdefault(key, spec_label(spec))
    ratios: list[dict[str, Any]] = []
    for key, by_repeat in groups.items():
        if len(by_repeat) < 2:
            continue
        first = min(by_repeat)
        later = [v for r, v in by_repeat.items() if r != first]
        ratio = by_repeat[first] / statistics.median(later)
        label = labels[key]
        ratios.append({"point": label, "first_repeat": first, "ratio": ratio})
    if not ratios:
        return {"points": 0, "why": "no point with two or more repeats of a verify step"}
    values = [r["ratio"] for r in ratios]
    return {
        "points": len(ratios),
        "metric": "first repeat's verify ms per forward / median of the later repeats'",
        "median_ratio": statistics.median(values),
        "max_ratio": max(values),
        "threshold": FIRST_USE_RATIO,
        "slow_first": [r for r in ratios if r["ratio"] > FIRST_USE_RATIO],
    }


def recorded_keys(rows_path: Path) -> set[tuple[Any, ...]]:
    """Keys of the runs already in a rows file (by the spec that produced them)."""
    keys: set[tuple[Any, ...]] = set()
    if not rows_path.exists():
        return keys
    for line in rows_path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            keys.add(row_spec_key(row))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # not ours to judge here; the report validates it
    return keys


def unrecorded(specs: Iterable[Mapping[str, Any]], rows_path: Path) -> list[Any]:
    """The ``specs`` whose runs ``rows_path`` does not hold yet (what a rerun
    runs), in order."""
    done = recorded_keys(rows_path)
    return [s for s in specs if spec_key(s) not in done]


def read_rows(rows_path: Path) -> list[dict[str, Any]]:
    """The parseable rows of a rows file (none when it does not exist)."""
    rows: list[dict[str, Any]] = []
    if not rows_path.exists():
        return rows
    for line in rows_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def trace_fields(
    routing_trace: Sequence[Any],
    cache_slots: int,
    expert_nbytes: int,
    committed_tokens: Any,
    initial_resident: Any = None,
) -> dict[str, Any]:
    """Routing-trace figures for a row: routed bytes and the Belady replay
    (:func:`pdflash.report.belady.trace_metrics`, the same function the
    engine's own row builder uses)."""
    from pdflash.report.belady import trace_metrics

    return trace_metrics(
        routing_trace, cache_slots, expert_nbytes, committed_tokens, initial_resident
    )


def augment_row(row: Mapping[str, Any], result: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine row plus trace figures, the spec and provenance.

    An engine row that already carries its trace figures (the real engine's
    rows do, replayed from its starting cache contents) keeps them; for an
    engine that does not, they are computed here from ``result``.
    """
    from pdflash.report.belady import bytes_per_token_vs_belady

    out = dict(row)
    reasons = dict(out.get("not_measured") or {})
    if "routed_expert_bytes" not in row or "belady_initial_state" not in row:
        extra = trace_fields(
            result.routing_trace,
            result.cache_slots,
            result.expert_nbytes,
            row.get("committed_tokens"),
            getattr(result, "initial_resident", None),
        )
        extra_reasons = extra.pop("not_measured", {})
        assert isinstance(extra_reasons, dict)
        reasons.update(extra_reasons)
        out.update(extra)
    if "bytes_per_token_vs_belady" not in row:
        value, why = bytes_per_token_vs_belady(
            row.get("bytes_per_token"), out.get("belady_bytes_per_token")
        )
        out["bytes_per_token_vs_belady"] = value
        if why is not None:
            reasons["bytes_per_token_vs_belady"] = why
    if "slo_s" not in out:
        out["slo_s"] = spec.get("slo_s")
        if out["slo_s"] is None:
            reasons["slo_s"] = "no SLO given (--slo)"
    if reasons:
        out["not_measured"] = reasons
    out["spec"] = dict(spec)
    return out


def _identity_mismatch(row: Mapping[str, Any], spec: Mapping[str, Any]) -> list[str]:
    bad = []
    names = ["baseline", "concurrency", "repeat", "seed"]
    if spec.get("baseline") != "B0":  # B0 may record its decode block (1)
        names.append("block_size")
    for name in names:
        if name in row and name in spec and row[name] != spec[name]:
            bad.append(f"{name}: spec {spec[name]!r}, row {row[name]!r}")
    return bad


def set_cpu_threads(specs: Sequence[Mapping[str, Any]], threads: int) -> int | None:
    """Pin torch's intra-op threads for CPU runs; returns the count set.

    NOTE: the tiny model's ops are far too small to gain from intra-op
    parallelism, while OpenMP workers that spin-wait on a loaded machine
    (and against the host copy backend's thread) made identical CPU runs
    vary 100x on the 2-core CI box; one thread made them repeatable.
    """
    if threads <= 0:
        return None
    cpu = any(str(s.get("device", "auto")) == "cpu" for s in specs)
    if not cpu and any(str(s.get("device", "auto")) == "auto" for s in specs):
        import torch

        cpu = not torch.cuda.is_available()
    if not cpu:
        return None
    import torch

    torch.set_num_threads(threads)
    return threads


class _TokenBar:
    """A second bar, tokens of the current run, fed by the engine's
    ``progress(done, total)`` callback."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc="  tokens",
                unit="tok",
                leave=False,
                position=1,
                dynamic_ncols=True,
            )
        self.bar.n = min(done, total)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def check_resumable(out_dir: Path) -> None:
    """Raise ``ValueError`` where ``out_dir`` holds gzipped rows only: committed
    results are gzipped (``bench/compact_results.py``), and a plain
    ``rows.jsonl`` appended beside them would rerun every recorded spec while
    readers take the plain file over the ``.gz``."""
    rows_path = out_dir / ROWS_FILE
    gzipped = rows_path.with_name(ROWS_FILE + ".gz")
    if gzipped.exists() and not rows_path.exists():
        raise ValueError(
            f"{out_dir} holds gzipped rows ({gzipped.name}); run `gunzip -k {gzipped}` "
            "to resume into it, or pass another --out"
        )


def run_matrix(
    specs: Iterable[Mapping[str, Any]],
    out_dir: Path,
    *,
    engine: Engine | None = None,
    budget_s: float | None = None,
    show_progress: bool = True,
    cpu_threads: int = 1,
) -> dict[str, Any]:
    """Run every spec not already recorded in ``out_dir/rows.jsonl``; append
    rows (and failures to ``errors.jsonl``). Returns a summary."""
    from pdflash.report.writers import append_row

    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / ROWS_FILE
    check_resumable(out_dir)
    all_specs = [dict(s) for s in specs]
    todo = unrecorded(all_specs, rows_path)
    skipped = len(all_specs) - len(todo)
    spec_cls, run_fn = engine if engine is not None else load_engine()
    threads = set_cpu_threads(todo, cpu_threads)
    bar = common.progress_bar(len(todo), "matrix", disable=not show_progress)
    start = time.perf_counter()
    ran = failed = 0
    not_started = 0
    for i, spec in enumerate(todo):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            not_started = len(todo) - i
            bar.write(
                f"budget of {budget_s:.0f}s spent: {not_started} runs not started (rerun to resume)"
            )
            break
        label = spec_label(spec, with_repeat=True)
        bar.set_postfix_str(label)
        t0 = time.perf_counter()
        try:
            tokens = _TokenBar() if show_progress else None
            try:
                result = run_fn(spec_cls(**spec), progress=tokens)
            finally:
                if tokens is not None:
                    tokens.close()
            row = augment_row(result.row, result, spec)
            mismatch = _identity_mismatch(result.row, spec)
            if mismatch:
                raise RuntimeError("engine row does not match its spec: " + "; ".join(mismatch))
        except Exception as exc:  # NOTE: one failed run must not lose the others
            failed += 1
            append_row(
                out_dir / ERRORS_FILE,
                {
                    "spec": spec,
                    "error": f"{type(exc).__name__}: {exc}",
                    "elapsed_s": time.perf_counter() - t0,
                },
            )
            bar.write(f"FAILED {label}: {type(exc).__name__}: {exc}")
        else:
            row["run_elapsed_s"] = time.perf_counter() - t0
            if threads is not None:
                row["cpu_threads"] = threads
            row["recorded_utc"] = common.utc_stamp()
            append_row(rows_path, row)
            ran += 1
        bar.update(1)
    bar.close()
    return {
        "out": str(out_dir),
        "rows_file": str(rows_path),
        "ran": ran,
        "failed": failed,
        "skipped_already_recorded": skipped,
        "not_started_budget": not_started,
        "elapsed_s": time.perf_counter() - start,
    }


def matrix_command(args: argparse.Namespace, out: Path) -> str:
    """The full command that reproduces this matrix (every option spelled out)."""

    def csv(values: Sequence[Any]) -> str:
        return ",".join(str(v) for v in values)

    def host_changed(name: str) -> Any:
        """The host setting ``name`` where it differs from HOST_DEFAULTS, else None."""
        value = getattr(args, name, HOST_DEFAULTS[name])
        return None if value == HOST_DEFAULTS[name] else value

    parts = [
        "pdflash-bench matrix",
        f"--arch {csv(args.arch)}",
        f"--weights {shlex.quote(args.weights)}",
        f"--draft {shlex.quote(args.draft)}",
        f"--block-sizes {csv(args.block_sizes)}",
        f"--concurrency {csv(args.concurrency)}",
        f"--cache-fraction {csv(args.cache_fraction)}",
        f"--baselines {csv(args.baselines)}",
        f"--repeats {resolved_repeats(args)}",
        f"--seed {args.seed}",
        f"--prompt-len {args.prompt_len}",
        f"--max-new-tokens {args.max_new_tokens}",
        f"--device {args.device}",
        f"--acceptance {args.acceptance}",
        f"--cpu-threads {args.cpu_threads}",
    ]
    for flag, value in (
        ("--slo", args.slo),
        ("--layers", args.layers),
        ("--num-requests", args.num_requests),
        ("--emulated-link-gbps", args.emulated_link_gbps),
        ("--mean-tau", args.mean_tau),
        ("--budget-s", args.budget_s),
        ("--host-workers", host_changed("host_workers")),
        ("--host-threads", host_changed("host_threads")),
        ("--synthetic-format", getattr(args, "synthetic_format", None)),
        (
            "--synthetic-weights",
            None
            if getattr(args, "synthetic_weights", "generated") == "generated"
            else args.synthetic_weights,
        ),
        ("--expert-dtype", getattr(args, "expert_dtype", None)),
        ("--prompts", getattr(args, "prompts", None)),
        ("--expert-bytes-as", getattr(args, "expert_bytes_as", None)),
        ("--trace", getattr(args, "trace", None)),
        ("--warmup", None if getattr(args, "warmup", "auto") == "auto" else args.warmup),
        (
            "--controller-warmup",
            None if getattr(args, "controller_warmup", "off") == "off" else args.controller_warmup,
        ),
        ("--warm-bursts", str(args.warm_bursts) if getattr(args, "warm_bursts", 0) else None),
        (
            "--cuda-graphs",
            None if getattr(args, "cuda_graphs", "off") == "off" else args.cuda_graphs,
        ),
        (
            "--resident-graphs",
            None if getattr(args, "resident_graphs", "off") == "off" else args.resident_graphs,
        ),
        (
            "--verify-width",
            None
            if _width_list(getattr(args, "verify_width", ["auto"])) == ["auto"]
            else ",".join(_width_list(args.verify_width)),
        ),
    ):
        if value is not None:
            parts.append(f"{flag} {value}")
    if (experts := host_changed("host_experts")) is not None:
        parts.append(f"--host-experts {experts}")
    if getattr(args, "temperature", 0.0):
        parts.append(f"--temperature {args.temperature}")
    if getattr(args, "routing_source", "model") != "model":
        parts.append(f"--routing-source {args.routing_source}")
    if getattr(args, "route_ahead_source", "union") != "union":
        parts.append(f"--route-ahead-source {args.route_ahead_source}")
    if getattr(args, "route_ahead_proxy", "auto") != "auto":
        parts.append(f"--route-ahead-proxy {args.route_ahead_proxy}")
    if getattr(args, "route_ahead_gate", DEFAULT_ROUTE_AHEAD_GATE) != DEFAULT_ROUTE_AHEAD_GATE:
        parts.append(f"--route-ahead-gate {args.route_ahead_gate}")
    if getattr(args, "rest_batching", "first_come") != "first_come":
        parts.append(f"--rest-batching {args.rest_batching}")
    for name, default in SERVING_DEFAULTS.items():
        value = getattr(args, name, default)
        if value != default:
            parts.append(f"--{name.replace('_', '-')} {value}")
    if getattr(args, "rate", None):
        parts.append(f"--rate {csv(args.rate)}")
    if getattr(args, "breakdown", False):
        parts.append("--breakdown")
    # the other host settings, in HOST_DEFAULTS' order (a switch is spelled bare)
    spelled_above = ("host_experts", "host_workers", "host_threads")
    for name in HOST_DEFAULTS:
        value = host_changed(name)
        if name in spelled_above or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    parts.append(f"--out {shlex.quote(str(out))}")
    # the process-wide compressed-GEMM mode is part of every run's key
    mode = os.environ.get("PDFLASH_COMPRESSED_GEMM")
    if mode:
        parts.insert(0, f"PDFLASH_COMPRESSED_GEMM={shlex.quote(mode)}")
    return " ".join(parts)


def run_planned(
    specs: Sequence[Mapping[str, Any]], out: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """:func:`run_matrix` over a suite's plan with its options (budget,
    progress bars, CPU threads); the summary adds how many runs were planned
    and the first-use check over every row in ``out``."""
    summary = run_matrix(
        specs,
        out,
        budget_s=args.budget_s,
        show_progress=not args.no_progress,
        cpu_threads=args.cpu_threads,
    )
    summary["planned"] = len(specs)
    summary["first_use"] = first_use_check(read_rows(out / ROWS_FILE))
    return summary


def log_command(out: Path, command: str) -> None:
    """Append ``command`` to ``out/commands.txt``, stamped (every invocation
    of a results folder, resumes included)."""
    with open(out / "commands.txt", "a", encoding="utf-8") as fh:
        fh.write(f"{common.utc_stamp()} {command}\n")


def load_result_rows(out: Path) -> list[dict[str, Any]]:
    """The report's rows of ``out/rows.jsonl`` (none where it is absent)."""
    from pdflash.report import load_rows

    return load_rows(out / ROWS_FILE) if (out / ROWS_FILE).exists() else []


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or Path("bench-results") / f"matrix-{common.utc_stamp()}")
    try:
        check_resumable(out)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    specs = plan(args)
    if args.dry_run:
        todo = unrecorded(specs, out / ROWS_FILE)
        counts: dict[str, int] = {}
        for s in todo:
            counts[s["baseline"]] = counts.get(s["baseline"], 0) + 1
        return {
            "planned": len(specs),
            "already_recorded": len(specs) - len(todo),
            "to_run": len(todo),
            "to_run_per_baseline": counts,
            "command": matrix_command(args, out),
        }
    summary = run_planned(specs, out, args)
    cmd = matrix_command(args, out)
    log_command(out, cmd)
    if not args.no_report:
        from pdflash.report import write_report

        rows = load_result_rows(out)
        evaluation = write_report(rows, out, required_baselines=args.baselines, command=cmd)
        summary["verdict"] = evaluation["verdict"]["label"]
        summary["valid"] = evaluation["valid"]
        summary["problems"] = len(evaluation["problems"])
        summary["report"] = evaluation["files"].get("markdown")
    summary["exit_code"] = 1 if summary["failed"] else 0
    return summary
