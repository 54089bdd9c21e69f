"""Which eviction policy comes closest to Belady on learned routing?

**A CPU model on a replayed trace, not a measurement.** The proxy's committed
trace (``pdflash.traces``: every verified row's top-k experts, per layer, with
each round's accepted tokens) is replayed in a closed loop of ``--clients``
requests. A step takes each running request's next recorded round, and a
request ends when its rounds run out. A step then visits the MoE layers in
order; each layer accesses the union of the experts its rows route to. The
rows are the anchor and the first ``width`` drafts of the recorded round. The
loop does not model a narrower verify's effect on acceptance, and every policy
sees the same access sequence. Each policy replays that sequence in a cache
of ``fraction x layers x experts`` slots, starting empty. It loads what is
missing, evicting the policy's victims among the experts the current layer
does not use. The table gives loads per Belady's (``pdflash.report.belady``)
on the same sequence.

Policies: ``lru`` and ``lfu`` (``pdflash.cache.eviction``), and
``layer_cyclic`` over each of them as its base (the engine's policy, whose
base is LRU). The engine also protects route-ahead predictions, and this
model leaves that out. ``frequency_oracle`` is not an online policy: it
evicts the largest expected distance to the next use, ``layer distance +
L (1 - p) / p``, where ``p`` is each expert's true share of the steps that
use it, taken from the whole sequence. It bounds what a frequency estimate
added to the layer distance could buy.

    python -P bench/eviction_replay_study.py TRACE.npz [--clients 4] [--fractions 0.2,0.5]
        [--widths 1,15] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pdflash.cache.eviction import EvictionPolicy, LayerCyclicPolicy, LFUPolicy, LRUPolicy
from pdflash.report.belady import belady
from pdflash.traces import ProxyTrace, load_trace

IdArray = npt.NDArray[np.int64]


def closed_loop_steps(trace: ProxyTrace, clients: int, width: int) -> list[list[IdArray]]:
    """Per step, per layer: the flat expert ids (``layer * E + expert``,
    sorted, unique) its rows route to (module docstring)."""
    prov = trace.provenance
    num_layers, num_experts = int(prov["num_layers"]), int(prov["num_experts"])
    starts = np.concatenate([[0], np.cumsum(trace.round_rows.astype(np.int64))])
    rounds: dict[int, list[int]] = {}
    for i, r in enumerate(trace.round_request.tolist()):
        rounds.setdefault(int(r), []).append(i)
    queue = sorted(rounds)
    running: dict[int, int] = {}  # request -> index of its next round
    steps: list[list[IdArray]] = []
    while queue or running:
        while queue and len(running) < clients:
            running[queue.pop(0)] = 0
        rows = []
        for req in list(running):
            i = rounds[req][running[req]]
            n = min(int(trace.round_rows[i]), 1 + width)
            rows.append(trace.verify_topk[starts[i] : starts[i] + n])
            running[req] += 1
            if running[req] == len(rounds[req]):
                del running[req]
        block = np.concatenate(rows).astype(np.int64)  # [rows, L, k]
        steps.append(
            [np.unique(block[:, layer, :]) + layer * num_experts for layer in range(num_layers)]
        )
    return steps


def replay(
    accesses: Sequence[tuple[int, IdArray]], slots: int, num_ids: int, policy: EvictionPolicy
) -> int:
    """Loads of ``accesses`` (``(layer, flat ids)`` in order) under ``policy``."""
    policy.reset(num_ids)
    resident = np.zeros(num_ids, dtype=np.bool_)
    loads = 0
    for clock, (layer, ids) in enumerate(accesses):
        if isinstance(policy, LayerCyclicPolicy):
            policy.before_layer(layer)
        missing = ids[~resident[ids]]
        hit = ids[resident[ids]]
        if hit.size:
            policy.on_access(hit, clock)
        excess = int(resident.sum()) + missing.size - slots
        if excess > 0:
            used = np.zeros(num_ids, dtype=np.bool_)
            used[ids] = True
            cands = np.flatnonzero(resident & ~used).astype(np.int64)
            victims = policy.victims(cands, min(excess, cands.size))
            resident[victims] = False
            policy.on_evict(victims)
        loads += missing.size
        resident[missing] = True
        policy.on_insert(missing, clock)
    return loads


class FrequencyOracle(LayerCyclicPolicy):
    """Evicts the largest ``layer distance + L (1 - p) / p``, ``p`` each
    expert's true step frequency (module docstring: an oracle, a bound)."""

    name = "frequency_oracle"

    def __init__(self, num_layers: int, num_experts: int, frequency: npt.NDArray[np.float64]):
        super().__init__(num_layers, num_experts)
        self.frequency = np.clip(frequency, 1e-6, 1.0)

    def victims(self, candidates: IdArray, n: int) -> IdArray:
        cand = np.asarray(candidates, dtype=np.int64)
        p = self.frequency[cand]
        score = self.next_use_distance(cand) + self.num_layers * (1.0 - p) / p
        return cand[np.lexsort((cand, -score))[:n]]


def step_frequency(steps: Sequence[Sequence[IdArray]], num_ids: int) -> npt.NDArray[np.float64]:
    """Each expert's share of the steps whose accesses include it."""
    count = np.zeros(num_ids, dtype=np.float64)
    for step in steps:
        for ids in step:
            count[ids] += 1.0
    return count / max(1, len(steps))


def policies(
    num_layers: int, num_experts: int, frequency: npt.NDArray[np.float64]
) -> Iterator[tuple[str, EvictionPolicy]]:
    yield "lru", LRUPolicy()
    yield "lfu", LFUPolicy()
    yield "layer_cyclic(lru)", LayerCyclicPolicy(num_layers, num_experts, LRUPolicy())
    yield "layer_cyclic(lfu)", LayerCyclicPolicy(num_layers, num_experts, LFUPolicy())
    yield "frequency_oracle", FrequencyOracle(num_layers, num_experts, frequency)


POLICY_NAMES = ("lru", "lfu", "layer_cyclic(lru)", "layer_cyclic(lfu)", "frequency_oracle")


def study(
    trace: ProxyTrace, clients: int, fractions: Sequence[float], widths: Sequence[int]
) -> list[dict[str, object]]:
    prov = trace.provenance
    num_layers, num_experts = int(prov["num_layers"]), int(prov["num_experts"])
    num_ids = num_layers * num_experts
    out: list[dict[str, object]] = []
    for width in widths:
        steps = closed_loop_steps(trace, clients, width)
        accesses = [(layer, ids) for step in steps for layer, ids in enumerate(step)]
        for fraction in fractions:
            slots = int(fraction * num_ids)
            # a layer's accesses must fit (the engine streams a layer that does not)
            if max(ids.size for _, ids in accesses) > slots:
                continue
            best = belady([ids for _, ids in accesses], slots, 1).loads
            row: dict[str, object] = {
                "label": "CPU model, replayed trace",
                "clients": clients,
                "width": width,
                "cache_fraction": fraction,
                "slots": slots,
                "steps": len(steps),
                "accesses": int(sum(ids.size for _, ids in accesses)),
                "belady_loads": best,
            }
            freq = step_frequency(steps, num_ids)
            for name, policy in policies(num_layers, num_experts, freq):
                loads = replay(accesses, slots, num_ids, policy)
                row[f"{name}_loads"] = loads
                row[f"{name}_vs_belady"] = round(loads / best, 4) if best else None
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fractions", default="0.2,0.5")
    ap.add_argument("--widths", default="1,15", help="drafts verified per round")
    ap.add_argument("--out", type=Path, default=None, help="append the rows as JSON lines")
    args = ap.parse_args(argv)
    if args.clients < 1:
        ap.error("--clients must be >= 1")
    trace = load_trace(args.trace)
    rows = study(
        trace,
        args.clients,
        [float(f) for f in args.fractions.split(",")],
        [int(w) for w in args.widths.split(",")],
    )
    names = POLICY_NAMES
    print(f"{args.trace} (CPU model, replayed trace), {args.clients} clients")
    print("width cache steps belady " + " ".join(f"{n}/belady" for n in names))
    for r in rows:
        ratios = " ".join(f"{r[f'{n}_vs_belady']:.3f}" for n in names)
        print(
            f"{r['width']:5} {r['cache_fraction']:5} {r['steps']:5} {r['belady_loads']:6} {ratios}"
        )
    if args.out is not None:
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps({"trace": str(args.trace), **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
