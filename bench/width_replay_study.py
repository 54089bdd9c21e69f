"""The adaptive verify width's settings on a replayed learned trace: a CPU
model of a one-client closed loop (no model is run; a model, not a
measurement).

Each request of a committed proxy trace replays its verify rounds in order.
A round that the width cuts to ``k`` drafts commits ``min(A, k) + 1`` tokens,
``A`` being the drafts the trace's whole-block round accepted, and routes
what the first ``1 + k`` rows of that round's block routed (the trace's own
per-layer top-k). So both the acceptance and the union a width buys are the
trace's, round by round. Rounds that did not verify a whole block are
skipped. A request ends after ``--tokens`` committed tokens; requests run one
after another (one client), ``--requests`` of them in a seeded order.

A step's time is modeled on the H200's one-client closed loop
(``bench/results/h200/session21-2026-12-04``, PD at ``adaptive``):
``t_fixed + exposed · miss · L · U · bytes / link``. Here ``U`` is the
round's measured per-layer union, ``miss`` the share of routed experts the
cache copied, and ``exposed`` the share of that link time the step waited
for. ``--marginal-exposed`` sets a different share for the link time of the
experts the drafts past the first add (the H200's c=1 loop waited for nearly
all of it, ``bench/results/h200/session22-2026-12-04``), and
``--row-compute-s`` adds compute per verified draft to the step. The policy
(:class:`pdflash.engine.verify_width.AdaptiveWidth`, as
:func:`~pdflash.engine.verify_width.build_policy` builds it) observes
exactly that step and the round's union, as the engine would report them.
Fixed widths run the same loop.

Output (JSON): per setting, the median over seeds of the modeled tokens/s,
mean drafts verified and accepted per round, and the policy's calibration
and union fit at the end.

Usage: python bench/width_replay_study.py TRACE.npz [--seeds 20] [--settings ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import numpy as np

from pdflash.engine.verify_width import (
    AdaptiveWidth,
    WidthOutcome,
    WidthRequest,
    WidthStep,
    build_policy,
)
from pdflash.traces import ProxyTrace, load_trace

DEFAULT_SETTINGS = (
    "fixed:1",
    "fixed:2",
    "fixed:3",
    "full",
    "adaptive",
    "adaptive:cal=1",
    "adaptive:union=hyperbolic",
    "adaptive:cal=1:union=hyperbolic",
)


def request_rounds(trace: ProxyTrace) -> list[list[tuple[int, np.ndarray]]]:
    """Per request, its whole-block rounds in order: ``(A, unions)``, ``A``
    the drafts accepted and ``unions[r - 1]`` the (layer, expert) pairs the
    block's first ``r`` rows routed to, ``r = 1 .. block``."""
    block = int(trace.round_rows.max())
    starts = np.concatenate([[0], np.cumsum(trace.round_rows.astype(np.int64))])
    _, layers, _ = trace.verify_topk.shape
    out: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(trace.num_requests)]
    for i, req in enumerate(trace.round_request.tolist()):
        if int(trace.round_rows[i]) != block:
            continue
        rows = trace.verify_topk[starts[i] : starts[i] + block]
        unions = np.asarray(
            [
                sum(np.unique(rows[:r, layer, :]).size for layer in range(layers))
                for r in range(1, block + 1)
            ]
        )
        # round_accepted counts the committed tokens (the accepted drafts + 1)
        out[req].append((int(trace.round_accepted[i]) - 1, unions))
    return out


def run_loop(
    setting: str,
    rounds: list[list[tuple[int, np.ndarray]]],
    order: list[int],
    *,
    block: int,
    layers: int,
    num_experts: int,
    top_k: int,
    tokens: int,
    t_fixed: float,
    link_s_per_expert: float,
    exposed: float,
    miss: float,
    expert_bytes: int,
    full_accepts: np.ndarray | None = None,
    marginal_exposed: float | None = None,
    row_compute_s: float = 0.0,
) -> dict[str, Any]:
    """One seed's loop under ``setting`` (module docstring). A step waits for
    ``exposed`` of the link time of the union of its first two rows (the
    anchor and the first draft) and ``marginal_exposed`` (None: ``exposed``)
    of what the further drafts add; its compute is ``t_fixed`` plus
    ``row_compute_s`` per verified draft."""
    policy = build_policy(
        setting,
        block_size=block,
        num_layers=layers,
        num_experts=num_experts,
        top_k=top_k,
        expert_bytes=expert_bytes,
    )
    wall = 0.0
    committed = verified = accepted = steps = 0
    for req in order:
        done = 0
        for j, (a, unions) in enumerate(rounds[req]):
            if full_accepts is not None and full_accepts[req, j]:
                a = block - 1
            left = tokens - done
            if left <= 0:
                break
            available = min(block - 1, left - 1)
            if available <= 0:
                k = 0
            elif policy is None:  # full
                k = available
            else:
                k = policy.widths([WidthRequest(req, available)])[0]
            acc = min(a, k)
            union = int(unions[k])  # the first 1 + k rows
            wait = exposed * (link_s_per_expert * union)
            if marginal_exposed is not None:
                base = int(unions[min(k, 1)])  # the anchor and the first draft
                wait = link_s_per_expert * (exposed * base + marginal_exposed * (union - base))
            compute = t_fixed + row_compute_s * k
            step = compute + wait
            if policy is not None and k > 0:
                policy.observe(
                    WidthStep(
                        (WidthOutcome(req, k, acc),),
                        wall_s=step,
                        union_experts=union,
                        copied_bytes=int(miss * union * expert_bytes),
                        link_bytes_per_s=miss * expert_bytes / link_s_per_expert,
                        verify_compute_s=compute,
                        exposed_fetch_s=wait,
                    )
                )
            wall += step
            done += acc + 1
            committed += acc + 1
            verified += k
            accepted += acc
            steps += 1
        if policy is not None:
            policy.forget(req)
    out: dict[str, Any] = {
        "tokens_per_s": committed / wall,
        "steps": steps,
        "verified_per_round": verified / steps,
        "accepted_per_round": accepted / steps,
    }
    if isinstance(policy, AdaptiveWidth):
        est = policy.stats()["estimates"]
        out["acceptance_calibration"] = est["acceptance_calibration"]
        out["union_fit"] = [est["union_novelty"], est["union_saturation"]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="committed tokens per request")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS))
    # the H200's c=1 closed loop (PD adaptive rows): the policy's t_fixed,
    # its modeled link s per routed expert (miss rate x padded MXFP4 bytes /
    # link rate) and its measured exposed share
    parser.add_argument("--t-fixed", type=float, default=0.038)
    parser.add_argument("--link-s-per-expert", type=float, default=1.23e-4)
    parser.add_argument("--exposed", type=float, default=0.58)
    parser.add_argument("--miss", type=float, default=0.53)
    parser.add_argument("--expert-bytes", type=int, default=13_236_736)
    parser.add_argument(
        "--marginal-exposed",
        type=float,
        default=None,
        help="share of the link time of the experts the drafts past the first add that a step "
        "waits for (default: --exposed)",
    )
    parser.add_argument(
        "--row-compute-s", type=float, default=0.0, help="compute per verified draft (s)"
    )
    parser.add_argument(
        "--inject-full",
        type=float,
        default=0.0,
        help="chance that a round starts a run of whole-block accepts (a repetition loop), "
        "drawn per round and seed (a perturbation of the trace: the report says so)",
    )
    parser.add_argument(
        "--loop-stay",
        type=float,
        default=0.0,
        help="chance that the round after a whole-block accept injected by --inject-full "
        "accepts the whole block too (0: independent rounds)",
    )
    args = parser.parse_args()
    trace = load_trace(args.trace)
    _, layers, top_k = trace.verify_topk.shape
    block = int(trace.round_rows.max())
    num_experts = int(trace.provenance["num_experts"])
    rounds = request_rounds(trace)
    usable = [r for r in range(trace.num_requests) if rounds[r]]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    longest = max(len(r) for r in rounds)  # a request's rounds, at most
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        order = [int(x) for x in rng.permutation(usable)[: args.requests]]
        full = None
        if args.inject_full > 0.0:
            draws = rng.random((trace.num_requests, longest))
            stays = rng.random((trace.num_requests, longest))
            full = draws < args.inject_full
            for j in range(1, longest):
                full[:, j] |= full[:, j - 1] & (stays[:, j] < args.loop_stay)
        for s in settings:
            per[s].append(
                run_loop(
                    s,
                    rounds,
                    order,
                    block=block,
                    layers=layers,
                    num_experts=num_experts,
                    top_k=top_k,
                    tokens=args.tokens,
                    t_fixed=args.t_fixed,
                    link_s_per_expert=args.link_s_per_expert,
                    exposed=args.exposed,
                    miss=args.miss,
                    expert_bytes=args.expert_bytes,
                    full_accepts=full,
                    marginal_exposed=args.marginal_exposed,
                    row_compute_s=args.row_compute_s,
                )
            )
    base = per[settings[0]]
    report: dict[str, Any] = {
        "trace": args.trace,
        "kind": "CPU model of a one-client closed loop on a replayed learned trace (not a measurement)"
        + (
            f"; {args.inject_full:g} of rounds injected to accept the whole block"
            if args.inject_full
            else ""
        ),
        "parameters": {k: v for k, v in vars(args).items() if k not in ("trace", "settings")},
        "reference": settings[0],
        "settings": {},
    }
    for s in settings:
        runs = per[s]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base, strict=True)]
        entry: dict[str, Any] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "vs_reference_median": statistics.median(ratios),
            "vs_reference_range": [min(ratios), max(ratios)],
            "verified_per_round": statistics.mean(r["verified_per_round"] for r in runs),
            "accepted_per_round": statistics.mean(r["accepted_per_round"] for r in runs),
        }
        if "acceptance_calibration" in runs[0]:
            entry["acceptance_calibration_median"] = statistics.median(
                r["acceptance_calibration"] for r in runs
            )
        report["settings"][s] = entry
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
