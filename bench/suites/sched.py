"""``pdflash-bench sched``: cost of one verify-scheduler step, native vs reference.

Workload (SYNTHETIC, generated here from a seed; no model involved):

* ``--requests`` live requests (default 256) on a ``--layers`` x ``--experts``
  grid (default 48 x 128, the Qwen3-30B-A3B shape).
* Every demand is a ``--block``-token verify block (default 16: 1 anchor +
  15 drafts). Its predicted set is the union over the block's tokens of a
  top-``--top-k`` (default 8) routing per layer, drawn from a Zipf-like
  per-layer popularity (``p(rank r) ~ r^-s``, ``--zipf`` s = 1.0, over a
  random per-layer expert order), so requests share hot experts the way real
  routing does. A block then predicts ~58 of 128 experts per layer.
* Resident set: each layer's top ``--resident-fraction`` (default 20%) most
  popular experts, i.e. a perfect frequency cache.
* Byte budget ``M`` = ``--step-ms`` x ``--link-gbps`` (default 10 ms x 55
  GB/s = 550 MB, one step of measured PCIe Gen5 H2D time, docs/design.md §3).
* Expert size ``--expert-bytes`` (default 128 KiB, uniform). NOTE: this is
  deliberately small. At a real Qwen3-30B-A3B bf16 expert (9 MiB) a 16-token
  block misses ~1700 experts (~16 GB), so *every* block is an oversize item
  at a 10 ms budget, each step runs one block alone and the scheduler's work
  is trivial. 128 KiB makes the byte budget bind at a few dozen blocks per
  step, the regime where the union/marginal accounting does real work.
* Token budget ``--token-budget`` (default 1024 = 64 blocks).
* ``--sizes per-layer|per-expert`` draws sizes in ``expert_bytes * [0.5,
  1.5]`` per layer (weighted-popcount kernel) or per expert (per-bit kernel,
  the slow general case) instead of one size for all.

Each step, the requests served by the previous step draft a new block (drawn
from a pre-generated pool; untimed), then ``step()`` is timed. The native
scheduler (public ``VerifyScheduler.step()``, wrapper included), the bare
native core, and the pure-Python reference run side by side on the same
events in one process; their results are compared step by step.
``native_us_per_step`` is the public ``step()`` with its default per-step
assertions; ``native_core_us_per_step`` is the Cython scan alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import numpy.typing as npt

HELP = "verify-scheduler step cost: native (Cython) vs pure-Python reference (synthetic workload)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests",
        default="256",
        help="live requests; a comma list (e.g. 16,64,256,1024) runs a sweep",
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--block", type=int, default=16, help="tokens per verify block")
    parser.add_argument("--zipf", type=float, default=1.0, help="per-layer popularity exponent")
    parser.add_argument("--resident-fraction", type=float, default=0.2)
    parser.add_argument("--expert-bytes", type=int, default=128 * 1024)
    parser.add_argument(
        "--sizes",
        choices=["uniform", "per-layer", "per-expert"],
        default="uniform",
        help="expert sizes: all equal (popcount kernel); one size per layer, drawn in "
        "expert_bytes * [0.5, 1.5] (weighted popcount); or one per expert (per-bit kernel)",
    )
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--link-gbps", type=float, default=55.0)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400, help="timed native steps")
    parser.add_argument("--ref-steps", type=int, default=12, help="timed reference steps")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)


def _popularity(rng: np.random.Generator, layers: int, experts: int, s: float) -> Any:
    weights = np.arange(1, experts + 1, dtype=np.float64) ** -s
    weights /= weights.sum()
    order = np.stack([rng.permutation(experts) for _ in range(layers)])  # rank -> expert
    pop = np.empty((layers, experts))
    np.put_along_axis(pop, order, weights[None, :], axis=1)
    return pop, order


def _block_pool(
    rng: np.random.Generator, pop: Any, size: int, block: int, top_k: int
) -> npt.NDArray[np.bool_]:
    layers, experts = pop.shape
    logp = np.log(pop)
    pool = np.zeros((size, layers, experts), dtype=np.bool_)
    for b in range(size):
        # Gumbel top-k: top_k distinct experts per (token, layer) ~ popularity
        g = rng.gumbel(size=(block, layers, experts)) + logp
        top = np.argpartition(-g, top_k - 1, axis=-1)[..., :top_k]
        routed = np.zeros((block, layers, experts), dtype=np.bool_)
        np.put_along_axis(routed, top, True, axis=-1)
        pool[b] = routed.any(axis=0)
    return pool


def _run_one(args: argparse.Namespace, n_requests: int) -> dict[str, Any]:
    from pdflash import SchedulerConfig, VerifyScheduler
    from pdflash._reference.scheduler import ReferenceScheduler

    rng = np.random.default_rng(args.seed)
    L, E = args.layers, args.experts
    pop, order = _popularity(rng, L, E, args.zipf)
    pool_size = min(max(2 * n_requests, 256), 2048)
    pool = _block_pool(rng, pop, pool_size, args.block, args.top_k)
    pool_ids = [np.flatnonzero(m.reshape(-1)) for m in pool]
    pool_sets = [frozenset(ids.tolist()) for ids in pool_ids]
    n_res = round(args.resident_fraction * E)
    resident = np.zeros((L, E), dtype=np.bool_)
    np.put_along_axis(resident, order[:, :n_res], True, axis=1)
    byte_budget = round(args.step_ms * 1e-3 * args.link_gbps * 1e9)
    cfg = SchedulerConfig(
        token_budget=args.token_budget,
        missing_byte_budget=byte_budget,
        num_layers=L,
        num_experts=E,
    )
    if args.sizes == "per-layer":
        per_layer = rng.uniform(0.5, 1.5, size=(L, 1)) * args.expert_bytes
        sizes = np.repeat(np.round(per_layer).astype(np.int64), E, axis=1)
    elif args.sizes == "per-expert":
        sizes = np.round(rng.uniform(0.5, 1.5, size=(L, E)) * args.expert_bytes).astype(np.int64)
    else:
        sizes = np.full((L, E), args.expert_bytes, dtype=np.int64)

    # NOTE: timed as users get it by default, per-step assertions included
    native = VerifyScheduler(cfg)
    bare = VerifyScheduler(cfg, check_invariants=False)  # timed through its core only
    ref = ReferenceScheduler(cfg.token_budget, byte_budget, cfg.quantum, None, cfg.num_flat)
    for s in (native, bare):
        s.set_expert_bytes(sizes)
        s.set_resident(resident)
    ref.set_expert_bytes(sizes.reshape(-1).tolist())
    ref.set_resident(np.flatnonzero(resident.reshape(-1)).tolist())
    for rid in range(n_requests):
        for s in (native, bare):
            s.add_request(rid)
        ref.add_request(rid)

    drafted = args.block - 1
    next_block = 0
    served_last: list[int] = list(range(n_requests))
    native_ns: list[int] = []
    core_ns: list[int] = []
    ref_ns: list[int] = []
    batch_sizes: list[int] = []
    missing: list[int] = []
    tokens: list[int] = []
    oversize = 0
    mismatches = 0
    total = args.warmup + args.steps
    ref_from = args.warmup
    for step in range(total):
        run_ref = ref_from <= step < ref_from + args.ref_steps
        for rid in served_last:
            k = next_block % pool_size
            next_block += 1
            native.update_demand(rid, drafted, pool[k])
            bare.update_demand(rid, drafted, pool[k])
            # NOTE: the reference tracks every event; it is timed only on
            # run_ref steps (it is ~100x slower).
            ref.update_demand(rid, drafted, pool_sets[k])
        t0 = time.perf_counter_ns()
        result = native.step()
        t1 = time.perf_counter_ns()
        bare._core.step()
        t2 = time.perf_counter_ns()
        if step >= args.warmup:
            native_ns.append(t1 - t0)
            core_ns.append(t2 - t1)
            batch_sizes.append(len(result))
            missing.append(result.missing_bytes)
            tokens.append(result.tokens)
            oversize += int(result.oversize)
        if step < ref_from + args.ref_steps:
            t3 = time.perf_counter_ns()
            expected = ref.step()
            t4 = time.perf_counter_ns()
            if run_ref:
                ref_ns.append(t4 - t3)
            same = (
                result.request_ids.tolist() == expected.request_ids
                and result.deficits.tolist() == expected.deficits
                and result.union_ids.tolist() == expected.union_ids
            )
            mismatches += int(not same)
        bare_ids = bare._core.result_index().tolist()
        assert bare_ids == native._core.result_index().tolist(), "bare core diverged"
        served_last = result.request_ids.tolist()

    native_us = statistics.median(native_ns) / 1e3
    ref_us = statistics.median(ref_ns) / 1e3
    return {
        "requests": n_requests,
        "layers": L,
        "experts": E,
        "native_us_per_step": round(native_us, 2),
        "native_core_us_per_step": round(statistics.median(core_ns) / 1e3, 2),
        "native_us_p90": round(float(np.percentile(native_ns, 90)) / 1e3, 2),
        "reference_us_per_step": round(ref_us, 1),
        "speedup": round(ref_us / native_us, 2),
        "native_steps_timed": len(native_ns),
        "reference_steps_timed": len(ref_ns),
        "native_equals_reference": mismatches == 0,
        "mean_batch_requests": round(float(np.mean(batch_sizes)), 2),
        "mean_batch_tokens": round(float(np.mean(tokens)), 1),
        "mean_missing_bytes": round(float(np.mean(missing))),
        "oversize_steps": oversize,
        "size_kernel": native._core.size_path(),
        "token_budget": cfg.token_budget,
        "missing_byte_budget": byte_budget,
        "mean_predicted_experts_per_block": round(float(pool.sum(axis=(1, 2)).mean()), 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdflash._native import load_native

    counts = [int(x) for x in str(args.requests).split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--requests must be positive ints, got {args.requests!r}")
    rows = [_run_one(args, n) for n in counts]
    out: dict[str, Any] = dict(rows[0])
    if len(rows) > 1:
        out["sweep"] = rows
    out.update(
        {
            "suite": "sched",
            "workload": "synthetic",
            "workload_params": {
                "block_tokens": args.block,
                "top_k": args.top_k,
                "zipf_s": args.zipf,
                "resident_fraction": args.resident_fraction,
                "expert_bytes": args.expert_bytes,
                "sizes": args.sizes,
                "step_ms": args.step_ms,
                "link_gbps": args.link_gbps,
                "seed": args.seed,
            },
            "device": "cpu",  # the scheduler runs on the host CPU, GPU or not
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "build": load_native("_build_info").summary(),
        }
    )
    return out
