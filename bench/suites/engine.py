"""``pdflash-bench engine``: every baseline of the engine at several concurrencies.

Each (baseline, concurrency) point is one :func:`pdflash.bench.engine_run.run_spec`
call; the JSON has one row per point with the docs/design.md §6 fields, and a short
per-run summary (tokens/s, acceptance, TTFT p50/p99, hit rate, coverage,
exposed fetch seconds) is printed to stderr as the runs finish. Every row
carries the routing-trace figures (``routed_expert_bytes``, the Belady replay
from the run's starting cache) like a matrix row; with ``--out DIR`` the rows
are also appended to ``DIR/rows.jsonl``, which ``pdflash-bench report DIR``
validates and evaluates like the matrix's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdflash.engine.config import (
    DEFAULT_HOST_AHEAD_MIN_EXPOSED,
    DEFAULT_ROUTE_AHEAD_GATE,
    FULL_CACHE,
    HOST_CONTROLS,
    REST_BATCHINGS,
    ROUTE_AHEAD_GATES,
)
from pdflash.hybrid.affinity import DEFAULT_HOST_AFFINITY, HOST_AFFINITY_CHOICES
from pdflash.hybrid.planner import HOST_AHEAD_FROM_CHOICES
from pdflash.report.schema import CONTROLLER_WARMUPS

from ..workload import WARMUP_CHOICES
from . import _common as common

HELP = (
    "engine baselines B0/B1/B2/B3/PD: tokens/s, acceptance, TTFT, hit rate, coverage, exposed fetch"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch", default="tiny", help="tiny, gpt-oss-20b, qwen3-30b-a3b, ... (default tiny)"
    )
    parser.add_argument(
        "--concurrency",
        type=common.positive_ints("--concurrency"),
        default=[1, 4, 16],
        help="e.g. 1,4,16",
    )
    parser.add_argument("--baselines", default="B0,B1,B2,B3,PD", help="comma-separated subset")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-fraction", type=float, default=0.2)
    parser.add_argument("--weights", default="synthetic", help="'synthetic' or a checkpoint path")
    parser.add_argument("--draft", default="synthetic", help="'synthetic' or a DFlash draft path")
    parser.add_argument(
        "--layers", type=int, default=None, help="truncate full-size synthetic shapes"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=None, help="default: = concurrency")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    parser.add_argument("--emulated-link-gbps", type=float, default=None, help="host backend only")
    parser.add_argument(
        "--acceptance", default="auto", choices=["auto", "model", "forced", "trace"]
    )
    parser.add_argument("--mean-tau", type=float, default=None)
    parser.add_argument("--slo-s", type=float, default=None)
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="synthetic weights (default: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument(
        "--eviction",
        default="auto",
        choices=["auto", "lru", "lfu", "route_ahead", "layer_cyclic"],
        help="expert-cache eviction (auto: layer_cyclic for every offloaded baseline)",
    )
    add_workload_arguments(parser)
    add_host_arguments(parser)
    parser.add_argument(
        "--warmup",
        default="auto",
        choices=WARMUP_CHOICES,
        help="before the clock: short (one 2-token request), workload (the run's own "
        "shape once: every batch size and key length it meets), shared (that workload "
        "warm-up once per process for the runs that differ only in repeat and rate, then a "
        "short one per run), auto (default: shared on CUDA, short on CPU)",
    )
    parser.add_argument(
        "--controller-warmup",
        default="off",
        choices=list(CONTROLLER_WARMUPS),
        help="first_round: after the warm-up, workload bursts outside the clock until PD's "
        "controller has ended its first round of probes (a server's engine after its first "
        "steps; labels without the controller ignore it); off (default)",
    )
    parser.add_argument(
        "--warm-bursts",
        type=common.warm_bursts_arg,
        default=0,
        help="workload bursts after the warm-up, outside the clock, for every label (before "
        "--controller-warmup's): give labels without the controller the warm-up a settled "
        "controller got; default 0",
    )
    add_gpu_arguments(parser)
    add_realtext_arguments(parser)
    add_expert_storage_arguments(parser)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time each verify's attention / router / experts (row field verify_breakdown_ms)",
    )
    parser.add_argument(
        "--cuda-graphs",
        type=_graph_settings,
        default=["off"],
        help="CUDA graphs per shape bucket on CUDA: auto, B3's verify forward and the "
        "drafter's forward as one graph each; piecewise, also the offloaded baselines' "
        "verifies as pieces (attention and router replayed, experts eager); off (default "
        "here, the library's default is auto) runs everything eagerly; a comma list "
        "(off,auto) runs each setting in turn within every repeat (interleaved); rows "
        "record cuda_graphs (captures, replays, piecewise steps, eager fallbacks); "
        "--breakdown then times the replayed parts as one region, graphed_ms",
    )
    parser.add_argument(
        "--resident-graphs",
        default="off",
        choices=("off", "on"),
        help="recorded all-resident layer calls (pdflash.models.resident_graphs) for the "
        "runs: on replays a CUDA-graph recording of an all-resident offloaded layer's device "
        "work where it can, off (default) runs it eagerly; set for each run and put back "
        "after; rows record resident_graphs (captures, capture_s, replays, eager calls by "
        "reason, mismatches)",
    )
    parser.add_argument(
        "--full-cache",
        default="auto",
        choices=FULL_CACHE,
        help="where the expert cache has a slot for every expert (cache fraction 1.0): auto "
        "(default) fills it before the clock, as B3's, and runs none of the parts that only "
        "serve a miss (route-ahead, the stream, lookahead, background prefetch, the PD "
        "controller); off runs each label as configured, the cache filling on demand; rows "
        "record full_cache (state, what was switched off and why)",
    )
    parser.add_argument(
        "--verify-width",
        type=common.verify_widths,
        default=["auto"],
        help=f"drafts each verify checks (pdflash.engine.verify_width), for every label: "
        f"{common.WIDTH_FORMS}; auto (default) is the label's preset: adaptive for PD, "
        "PD+host and PD's ablations but PD-full-width, full for the rest; a comma list runs "
        "each in turn within every repeat (interleaved); rows record verify_width (setting, "
        "mean width, expected vs realized accepted drafts)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also append the rows to OUT/rows.jsonl (for `pdflash-bench report OUT`)",
    )


def _graph_settings(text: str) -> list[str]:
    """``--cuda-graphs``: ``off``, ``auto``, ``piecewise`` or a comma list of them."""
    settings = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in settings if t not in common.CUDA_GRAPHS]
    if bad or not settings:
        raise argparse.ArgumentTypeError(
            f"use {', '.join(common.CUDA_GRAPHS)} or a comma list of them, got {text!r}"
        )
    return settings


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving workload's options, as a group: arrivals, length ranges,
    engine limits and PD's M (shared with the matrix)."""
    g = parser.add_argument_group(
        "serving workload",
        "open-loop (poisson) or closed-loop arrivals, length ranges and engine limits; "
        "--max-running above --token-budget / block size makes the scheduler choose",
    )
    g.add_argument("--arrivals", default="burst", choices=["burst", "poisson", "closed"])
    g.add_argument(
        "--rate",
        type=common.rates,
        default=None,
        help="poisson requests/s; a comma list sweeps rates (each rate its own point)",
    )
    g.add_argument("--users", type=int, default=None, help="closed-loop clients")
    g.add_argument("--think-s", type=float, default=0.0, help="closed-loop mean think time")
    g.add_argument("--prompt-len-max", type=int, default=None, help="prompts uniform in [len, max]")
    g.add_argument(
        "--max-new-tokens-max", type=int, default=None, help="outputs uniform in [len, max]"
    )
    g.add_argument("--max-running", type=int, default=None, help="default: = concurrency")
    g.add_argument(
        "--token-budget", type=int, default=None, help="default: concurrency x block size"
    )
    g.add_argument(
        "--byte-budget-from",
        default="floor",
        choices=["floor", "verify"],
        help="PD's M: floor (every expert's bytes or more) or verify (link x verify time)",
    )
    g.add_argument(
        "--marginal-rule",
        default="verify",
        choices=["off", "verify"],
        help="PD's marginal rule (M soft against shared experts, F = link x verify time) "
        "where M is calibrated or given; off: M hard",
    )


def add_expert_storage_arguments(parser: argparse._ActionsContainer) -> None:
    """How synthetic weights are written and how the experts are held
    (shared with the matrix)."""
    parser.add_argument(
        "--synthetic-format",
        default=None,
        choices=["mxfp4"],
        help="write synthetic gpt-oss experts as MXFP4 blocks/scales (as released checkpoints are)",
    )
    parser.add_argument(
        "--synthetic-weights",
        default="generated",
        choices=["generated", "files"],
        help="synthetic weights: generated (default: config only, the loader draws the seeded "
        "tensors straight into the host store) or files (written as safetensors and read "
        "back through the checkpoint reader; the same values, slower)",
    )
    parser.add_argument(
        "--expert-dtype",
        default=None,
        choices=["dense", "fp8"],
        help="experts in host memory, over the link and in the slab: default as the checkpoint "
        "stores them (MXFP4 stays MXFP4); dense = dequantized to the compute dtype at pack time; "
        "fp8 = e4m3 with per-output-channel scales (dense checkpoints; lossy, never the default)",
    )


def add_gpu_arguments(parser: argparse._ActionsContainer) -> None:
    """Expert-parallel ranks (issue 18; shared with the matrix)."""
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="experts partitioned over N GPUs: N local processes (one rank each, NCCL; gloo "
        "on CPU), each caching and copying only its experts over its own link; burst "
        "arrivals only (default 1)",
    )
    parser.add_argument(
        "--placement",
        default="round_robin",
        choices=["round_robin", "frequency"],
        help="which rank owns each expert with --gpus > 1: round robin, or balanced by the "
        "routing frequency of --trace",
    )


def add_host_arguments(parser: argparse._ActionsContainer) -> None:
    """The hybrid miss service's switches (shared with the matrix)."""
    parser.add_argument(
        "--host-experts",
        default="off",
        choices=["off", "auto"],
        help="hybrid miss service for every offloaded baseline: 'auto' lets the host CPU "
        "compute the misses its cost model gives it (default off until measured on the GPU; "
        "the PD+host baseline is always auto)",
    )
    parser.add_argument(
        "--host-workers",
        type=int,
        default=None,
        help="host expert pool threads (default 1); they share torch's process-wide intra-op "
        "threads, so with N workers give --host-threads about cores / N",
    )
    parser.add_argument(
        "--host-threads",
        type=int,
        default=None,
        help="torch intra-op threads for the host pool, process-wide (default: all cores but "
        "two on CUDA, torch's setting on CPU)",
    )
    parser.add_argument(
        "--host-max-ratio",
        type=float,
        # NOTE: pdflash.hybrid.planner.DEFAULT_MAX_HOST_RATIO (not imported:
        # it pulls in torch; a test keeps them equal)
        default=1.5,
        help="HOST only experts the CPU computes at most this times slower than the link "
        "copies them (default 1.5: see pdflash.hybrid.planner)",
    )
    parser.add_argument(
        "--host-max-tokens",
        type=int,
        # NOTE: pdflash.hybrid.planner.DEFAULT_MAX_HOST_TOKENS (a test keeps them equal)
        default=16,
        help="HOST only experts routed at most this many tokens (default 16, one verify "
        "block; 0: no cap; see pdflash.hybrid.planner)",
    )
    parser.add_argument(
        "--host-format",
        default="auto",
        choices=("auto", *common.HOST_FORMATS),
        help="how the host holds the experts it computes (pdflash.hybrid.kernels); auto "
        "(default) times the formats at start-up and keeps the fastest that fits in memory",
    )
    parser.add_argument(
        "--host-critical-path",
        action="store_true",
        help="the host planner judges the forward's critical path (copies hidden behind the "
        "launching thread cost nothing, a HOST part's dispatch is charged) instead of the "
        "link's makespan (default; see HostExpertService.critical_path)",
    )
    parser.add_argument(
        "--host-queued",
        action="store_true",
        help="the host planner may also host routed experts whose copy is still queued (not "
        "started), cancelling the copy (HostExpertService.host_queued; off by default)",
    )
    parser.add_argument(
        "--host-job-term",
        action="store_true",
        help="the host calibration also measures a fixed cost per HOST job, beside the seconds "
        "per expert (RunSpec.host_job_term; off by default: not yet measured on a GPU)",
    )
    add_host_switch_arguments(parser)


def add_host_switch_arguments(parser: argparse._ActionsContainer, *, ahead: bool = True) -> None:
    """The PD+host switches each measured against its default (shared with
    the matrix, ``eager_host`` and ``bench/h200/issue16.py``); ``ahead``:
    also ``--host-ahead``, ``--host-ahead-from``, ``--host-ahead-min-exposed``
    and ``--host-control`` (a runner that makes no pre-verify plan and runs
    no PD controller leaves them out)."""
    parser.add_argument(
        "--host-handoff",
        default="thread",
        choices=("thread", "stream"),
        help="how HOST outputs reach the device stream (pdflash.hybrid.handoff): thread "
        "(default: the forward's thread waits for the host) or stream (a device-side wait "
        "on a host-set flag; the thread goes on; falls back to thread, reason recorded, "
        "where it cannot run)",
    )
    parser.add_argument(
        "--host-affinity",
        choices=HOST_AFFINITY_CHOICES,
        default=DEFAULT_HOST_AFFINITY,
        help="where the host pool's threads run (pdflash.hybrid.affinity): auto (default) "
        "keeps the engine's forward and issuer threads on two cores the host's compute "
        "threads never use (CUDA, Linux; elsewhere it records why it placed nothing); off "
        "makes no affinity call",
    )
    if ahead:
        parser.add_argument(
            "--host-ahead",
            choices=("certain", "weighted"),
            default="certain",
            help="how the host planner's pre-verify plan treats a route-ahead predicted expert "
            "(pdflash.hybrid.planner, 'The ahead plan'): certain (default) as routed; weighted "
            "routed with the run's measured probability (its host time weighted by it)",
        )
        parser.add_argument(
            "--host-ahead-from",
            choices=HOST_AHEAD_FROM_CHOICES,
            default="predicted",
            help="which copies the host's pre-verify plan splits (pdflash.hybrid.service, "
            "'Splitting the stream's copies'): predicted (default) the route-ahead prediction "
            "only; stream also the streaming prefetcher's own copies (its fetch set before "
            "the verify, its gate lookahead's next layer in the forward), so the stream "
            "copies only what the plan leaves COPY",
        )
        parser.add_argument(
            "--host-ahead-min-exposed",
            type=float,
            default=DEFAULT_HOST_AHEAD_MIN_EXPOSED,
            help="the pre-verify host plan (and with it --host-ahead-from stream's split) runs "
            "only where forwards waited for expert copies or host results at least this share "
            f"of the time since the previous plan (default {DEFAULT_HOST_AHEAD_MIN_EXPOSED}; "
            "0: before every verify; EngineConfig.host_ahead_min_exposed)",
        )
        parser.add_argument(
            "--host-control",
            choices=HOST_CONTROLS,
            default="controller",
            help="who decides whether PD+host's host part runs in a step "
            "(EngineConfig.host_control): controller (default: PD's controller, its host gate "
            "and must-earn probes) or always (on in every step from the first, never probed "
            "nor gated; PD's other parts are probed as usual); no effect on a run without a "
            "host service",
        )


def add_realtext_arguments(parser: argparse._ActionsContainer) -> None:
    """Real text, padded experts and trace replay (issue 14; shared with the matrix)."""
    parser.add_argument(
        "--prompts",
        default=None,
        help="prompts instead of random ids: 'heldout[:eval|draft]' (a proxy checkpoint's "
        "held-out split), a trace .npz (its sequences), or a text file (tokenized with the "
        "checkpoint's tokenizer.json); lengths as --prompt-len says",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)"
    )
    parser.add_argument(
        "--expert-bytes-as",
        default=None,
        help="pad every stored expert to a published size (gpt-oss-20b, qwen3-30b-a3b, "
        "mixtral-8x7b, olmoe-1b-7b: their bf16 dense expert bytes; gpt-oss-20b-mxfp4: its "
        "MXFP4 stored bytes) or a byte count; copies, "
        "slots and Belady move the padded size, routing and tau stay the model's",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="a proxy trace .npz to replay (--routing-source trace, --acceptance trace; "
        "--acceptance auto with a synthetic drafter uses it)",
    )
    parser.add_argument(
        "--routing-source",
        default="model",
        choices=["model", "trace"],
        help="each layer's experts from the router (model) or replayed from --trace",
    )
    from pdflash.engine.predict import ROUTE_AHEAD_SOURCES

    parser.add_argument(
        "--route-ahead-source",
        default="union",
        choices=list(ROUTE_AHEAD_SOURCES),
        help="what PD predicts before a verify: union (approximate router + previous round), "
        "token_prior (token id -> experts learned online, calibrated to a precision floor) "
        "or previous_round (the experts the request's last verify routed to)",
    )
    from pdflash.engine.predict import ROUTE_AHEAD_PROXIES

    parser.add_argument(
        "--route-ahead-proxy",
        default="auto",
        choices=list(ROUTE_AHEAD_PROXIES),
        help="what the union's approximate router reads: auto (the drafter's hidden states "
        "where the drafter exposes them, else the embeddings), drafter or embed",
    )
    parser.add_argument(
        "--route-ahead-gate",
        default=DEFAULT_ROUTE_AHEAD_GATE,
        choices=list(ROUTE_AHEAD_GATES),
        help="PD's controller over route-ahead: precision_cost (default: route-ahead runs by "
        "default only while at least half the experts it predicts are routed and its host "
        "time is below what those routed predictions could save, one expert's copy each; "
        "otherwise it must earn its place by its probes), precision (the first rule alone) "
        "or off (judged as PD's other parts)",
    )
    parser.add_argument(
        "--rest-batching",
        default="first_come",
        choices=list(REST_BATCHINGS),
        help="how a step is batched while PD's controller rests (route-ahead off): "
        "first_come (default: B1's rule, the waiting requests in arrival order; the lower "
        "host cost, but a request that waits for the token budget waits for those ahead of "
        "it) or scheduler (the configured batcher every step: requests take turns)",
    )


def realtext_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RunSpec keywords of :func:`add_realtext_arguments`, only those given
    (so specs and resume keys of plain runs are unchanged)."""
    defaults = {
        "prompts": None,
        "temperature": 0.0,
        "expert_bytes_as": None,
        "trace": None,
        "routing_source": "model",
        "route_ahead_source": "union",
        "route_ahead_proxy": "auto",
        "route_ahead_gate": DEFAULT_ROUTE_AHEAD_GATE,
        "rest_batching": "first_come",
    }
    return {
        name: getattr(args, name)
        for name, default in defaults.items()
        if getattr(args, name, default) != default
    }


def _fmt(x: Any, nd: int = 3) -> str:
    return "null" if x is None else (f"{x:.{nd}g}" if isinstance(x, float) else str(x))


def label_runs(
    baselines: Sequence[str], graphs: Sequence[str], widths: Sequence[str]
) -> list[tuple[str, str, str]]:
    """``(label, cuda graphs, width)`` of each run in a repeat: every label at
    each graphs setting and each width it resolves to, once (PD's ``auto`` is
    ``adaptive``, so ``auto,adaptive`` is one run, as in the matrix), the
    width as asked where first listed (its row records it as requested)."""
    unique: dict[tuple[str, str, str], tuple[str, str, str]] = {}
    for b, g, w in itertools.product(baselines, graphs, widths):
        unique.setdefault((b, g, common.resolved_width(w, b)), (b, g, w))
    return list(unique.values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdflash.report.writers import ROWS_FILE, append_row

    from ..engine_run import RunSpec, run_spec

    rows_path = None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rows_path = args.out / ROWS_FILE
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    if args.arrivals == "poisson" and not args.rate:
        raise SystemExit("--arrivals poisson needs --rate")
    rates: list[float | None] = list(args.rate) if args.arrivals == "poisson" else [None]
    runs = label_runs(baselines, args.cuda_graphs, args.verify_width)
    for conc, rate in itertools.product(args.concurrency, rates):
        for repeat in range(args.repeats):
            for baseline, graphs, width in runs:
                spec = RunSpec(
                    arch=args.arch,
                    baseline=baseline,
                    block_size=args.block_size,
                    concurrency=conc,
                    cache_fraction=args.cache_fraction,
                    repeat=repeat,
                    seed=args.seed,
                    weights=args.weights,
                    draft=args.draft,
                    device=args.device,
                    num_requests=args.num_requests,
                    prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens,
                    slo_s=args.slo_s,
                    emulated_link_gbps=args.emulated_link_gbps,
                    layers=args.layers,
                    acceptance=args.acceptance,
                    mean_tau=args.mean_tau,
                    dtype=args.dtype,
                    eviction=args.eviction,
                    arrivals=args.arrivals,
                    rate_per_s=rate,
                    users=args.users,
                    think_s=args.think_s,
                    prompt_len_max=args.prompt_len_max,
                    max_new_tokens_max=args.max_new_tokens_max,
                    max_running=args.max_running,
                    token_budget=args.token_budget,
                    byte_budget_from=args.byte_budget_from,
                    marginal_rule=args.marginal_rule,
                    host_experts=args.host_experts,
                    host_workers=args.host_workers,
                    host_threads=args.host_threads,
                    host_max_ratio=args.host_max_ratio,
                    host_max_tokens=args.host_max_tokens,
                    host_format=args.host_format,
                    host_critical_path=getattr(args, "host_critical_path", False),
                    host_queued=getattr(args, "host_queued", False),
                    host_job_term=getattr(args, "host_job_term", False),
                    host_handoff=getattr(args, "host_handoff", "thread"),
                    host_affinity=getattr(args, "host_affinity", DEFAULT_HOST_AFFINITY),
                    host_ahead=getattr(args, "host_ahead", "certain"),
                    host_ahead_from=getattr(args, "host_ahead_from", "predicted"),
                    host_ahead_min_exposed=getattr(
                        args, "host_ahead_min_exposed", DEFAULT_HOST_AHEAD_MIN_EXPOSED
                    ),
                    host_control=getattr(args, "host_control", "controller"),
                    warmup=args.warmup,
                    controller_warmup=getattr(args, "controller_warmup", "off"),
                    warm_bursts=getattr(args, "warm_bursts", 0),
                    synthetic_format=args.synthetic_format,
                    synthetic_weights=args.synthetic_weights,
                    expert_dtype=args.expert_dtype,
                    breakdown=args.breakdown,
                    cuda_graphs=graphs,
                    resident_graphs=getattr(args, "resident_graphs", "off"),
                    full_cache=getattr(args, "full_cache", "auto"),
                    verify_width=width,
                    gpus=args.gpus,
                    placement=args.placement,
                    **realtext_kwargs(args),
                )
                result = run_spec(spec)
                row = result.row
                rows.append(row)
                if rows_path is not None:
                    append_row(rows_path, row)
                gpus_txt = (
                    f"gpus={row['gpus']} a2a={_fmt(row['all_to_all_share'])} "
                    if "gpus" in row
                    else ""
                )
                print(
                    f"[engine] {args.arch} {baseline} width={row['verify_width']['setting']} "
                    f"c={conc} "
                    f"{'' if rate is None else f'rate={rate}/s '}r={repeat}: "
                    f"tok/s={_fmt(row['output_tokens_per_s'])} "
                    f"tau={_fmt(row['acceptance_length_mean'])} ({row['acceptance_source']}) "
                    f"ttft p50/p99={_fmt(row['ttft_p50_s'])}/{_fmt(row['ttft_p99_s'])}s "
                    f"hit={_fmt(row['expert_cache_hit_rate'])} "
                    f"(landed {_fmt(row.get('expert_cache_landed_hit_rate'))}) "
                    f"cov={_fmt(row['routeahead_coverage'])} "
                    f"tpot p50/p99={_fmt(row.get('tpot_p50_s'))}/{_fmt(row.get('tpot_p99_s'))}s "
                    f"queue p99={_fmt(row.get('queue_delay_p99_s'))}s "
                    f"exposed={_fmt(row['exposed_fetch_s'])}s eta={_fmt(row['eta'])} "
                    f"host={_fmt(row.get('host_served_experts'))} "
                    f"graphs={row['cuda_graphs']['state']} "
                    f"resident_graphs={row['resident_graphs']['state']} "
                    f"{gpus_txt}"
                    f"wall={_fmt(row['wall_s'])}s",
                    file=sys.stderr,
                    flush=True,
                )
    return {
        "suite": "engine",
        "command": "pdflash-bench " + " ".join(sys.argv[1:]),
        "arch": args.arch,
        "device": "cuda" if (args.device != "cpu" and torch.cuda.is_available()) else "cpu",
        "concurrency": args.concurrency,
        "baselines": baselines,
        "elapsed_s": time.perf_counter() - started,
        "runs": rows,
        **({"rows_file": str(rows_path)} if rows_path is not None else {}),
    }
