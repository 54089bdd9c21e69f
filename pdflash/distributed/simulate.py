"""Simulated scaling of a measured single-GPU run to ``N`` expert-parallel
GPUs (issue 18). Every figure this module returns is **simulated** from the
measured row and the stated model below, never measured.

Model (per measured row; times in seconds over the whole run):

* measured on one GPU: wall ``W``, compute ``C`` (compute stream, copy waits
  excluded), exposed fetch ``E`` (the compute stream waiting for copies),
  link busy ``L`` and bytes ``B`` (so the link moved ``r = B / L`` while
  busy); the rest ``O = max(0, W - C - E)`` is host time not hidden;
* N ranks: each rank's link carries its own experts' misses: ``L_N = B_N x
  imbalance / N / r`` (``imbalance`` = the busiest rank's share x N, 1.0 when
  the placement balances the missing bytes; ``B_N`` = ``B`` (``same_bytes``,
  the conservative case: a larger aggregate cache saves nothing), or the
  bytes measured at the aggregate cache fraction ``N x f`` interpolated
  between rows of the same point (``aggregate_cache``));
* exposed fetch: between ``E x L_N / L`` (waits shrink in proportion to the
  link time: the conservative end) and ``max(0, L_N - (L - E))`` (the link
  time hidden on one GPU stays hidden: the optimistic end);
* compute: ``C`` on every rank (attention and dense parts replicated; the
  MoE share that divides by N is not credited unless ``moe_compute_share``);
* exchange per MoE layer and forward of ``t`` tokens (top-k ``k``, hidden
  ``H``, activations ``a`` bytes): 5 collectives (counts, rows, expert ids,
  results, all-gather), each ``latency_s``, and ``(N - 1) / N x (2 t k H a +
  8 t k + t H a)`` bytes per rank at ``peer_gbps``; over PCIe the received
  exchange bytes also take the same x16 link as the expert copies (added to
  ``L_N``); forwards: the row's verify forwards of ``min(token budget,
  concurrency x block)`` tokens plus one prefill of every prompt;
* ``W_N = C x (1 - moe_compute_share x (1 - 1/N)) + O + E_N + A_N``;
  tokens/s = the row's committed tokens / ``W_N``. ``N = 1`` reproduces the
  measured row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: interconnect profiles (stated assumptions, not measurements): peer
#: bandwidth per GPU and direction, and one small collective's latency
INTERCONNECTS: dict[str, dict[str, Any]] = {
    "nvlink": {
        "peer_gbps": 450.0,
        "latency_s": 12e-6,
        "shares_h2d_link": False,
        "source": "H200 NVLink 4: 900 GB/s bidirectional per GPU (vendor figure); "
        "NCCL small-message latency ~10-15 us intra-node (assumed)",
    },
    "pcie": {
        "peer_gbps": 50.0,
        "latency_s": 20e-6,
        "shares_h2d_link": True,
        "source": "PCIe Gen5 x16 peer-to-peer at ~the measured pinned H2D rate (assumed); "
        "exchange bytes share the link with the expert copies",
    },
}

#: hidden sizes of the published shapes (the rows do not carry them)
HIDDEN_SIZE = {"gpt-oss-20b": 2880, "qwen3-30b-a3b": 2048, "mixtral-8x7b": 4096}


@dataclass(frozen=True)
class ScaleParams:
    interconnect: str = "nvlink"
    peer_gbps: float | None = None  # None: the interconnect's
    latency_s: float | None = None
    imbalance: float = 1.0
    moe_compute_share: float = 0.0
    activation_bytes: int = 2  # bf16 activations
    bytes_model: str = "same_bytes"  # or aggregate_cache
    hidden_size: int | None = None  # for rows of shapes HIDDEN_SIZE does not know

    def resolved(self) -> dict[str, Any]:
        if self.interconnect not in INTERCONNECTS:
            raise ValueError(f"interconnect must be one of {sorted(INTERCONNECTS)}")
        if self.bytes_model not in ("same_bytes", "aggregate_cache"):
            raise ValueError("bytes_model must be same_bytes or aggregate_cache")
        if not self.imbalance >= 1.0:
            raise ValueError(f"imbalance must be >= 1 (1 = balanced), got {self.imbalance}")
        if not 0.0 <= self.moe_compute_share <= 1.0:
            raise ValueError("moe_compute_share must be in [0, 1]")
        prof = dict(INTERCONNECTS[self.interconnect])
        if self.peer_gbps is not None:
            prof["peer_gbps"] = self.peer_gbps
        if self.latency_s is not None:
            prof["latency_s"] = self.latency_s
        return {**asdict(self), **prof}


def _num(row: Mapping[str, Any], key: str) -> float:
    value = row.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"row has no measured {key!r} (got {value!r})")
    return float(value)


def point_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        row.get("arch"),
        row.get("baseline"),
        row.get("concurrency"),
        row.get("block_size"),
        row.get("layers"),
    )


def bytes_at_fraction(
    rows: Sequence[Mapping[str, Any]], row: Mapping[str, Any], fraction: float
) -> float | None:
    """``h2d_bytes`` of ``row``'s point at cache ``fraction``, interpolated
    linearly between measured rows of that point (None outside their range;
    repeats averaged)."""
    key = point_key(row)
    by_frac: dict[float, list[float]] = {}
    for r in rows:
        if point_key(r) == key and isinstance(r.get("h2d_bytes"), int | float):
            by_frac.setdefault(float(r["cache_fraction"]), []).append(float(r["h2d_bytes"]))
    pts = sorted((f, sum(v) / len(v)) for f, v in by_frac.items())
    for (f0, b0), (f1, b1) in itertools.pairwise(pts):
        if f0 <= fraction <= f1:
            return b0 + (b1 - b0) * (fraction - f0) / (f1 - f0)
    for f, b in pts:
        if abs(f - fraction) < 1e-9:
            return b
    return None


def simulate_row(
    row: Mapping[str, Any],
    gpus: int,
    params: ScaleParams,
    rows: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The simulated run of ``row`` on ``gpus`` GPUs (module doc)."""
    p = params.resolved()
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    wall, compute = _num(row, "wall_s"), _num(row, "compute_busy_s")
    exposed, link = _num(row, "exposed_fetch_s"), _num(row, "link_busy_s")
    nbytes, tokens = _num(row, "h2d_bytes"), _num(row, "committed_tokens")
    other = max(0.0, wall - compute - exposed)
    rate = nbytes / link if link > 0 else None
    out: dict[str, Any] = {
        "simulated": True,
        "kind": "simulated from a measured single-GPU row (pdflash.distributed.simulate)",
        "gpus": gpus,
        "arch": row.get("arch"),
        "baseline": row.get("baseline"),
        "concurrency": row.get("concurrency"),
        "cache_fraction_per_gpu": row.get("cache_fraction"),
        "measured_tokens_per_s_1gpu": row.get("output_tokens_per_s"),
        "params": p,
    }
    b_n: float | None = nbytes
    if params.bytes_model == "aggregate_cache" and gpus > 1:
        frac = float(row.get("cache_fraction") or 0.0) * gpus
        # at >= 1 every expert fits: no measured row says what the warm-up costs
        b_n = None if frac >= 1.0 else bytes_at_fraction(rows, row, frac)
        out["aggregate_cache_fraction"] = frac
    if b_n is None:
        out["not_simulated"] = "no measured rows bracket the aggregate cache fraction"
        return out
    # the exchange, per MoE layer and forward
    k = int(_num(row, "top_k"))
    layers = int(_num(row, "layers"))
    hidden = row.get("hidden_size") or HIDDEN_SIZE.get(str(row.get("arch"))) or params.hidden_size
    if hidden is None:
        out["not_simulated"] = f"hidden size of {row.get('arch')!r} unknown"
        return out
    t_verify = min(_num(row, "token_budget"), _num(row, "concurrency") * _num(row, "block_size"))
    t_prefill = _num(row, "num_requests") * _num(row, "prompt_len")
    forwards = [(t_verify, _num(row, "verify_forwards")), (t_prefill, 1.0)]
    share = (gpus - 1) / gpus
    a = int(p["activation_bytes"])
    a2a_s = 0.0
    a2a_bytes = 0.0
    for t, count in forwards:
        per_layer = share * (2 * t * k * hidden * a + 8 * t * k + t * hidden * a)
        if gpus > 1:
            a2a_s += count * layers * (5 * p["latency_s"] + per_layer / (p["peer_gbps"] * 1e9))
            a2a_bytes += count * layers * per_layer
    link_n = 0.0 if rate is None else b_n * params.imbalance / gpus / rate
    if p["shares_h2d_link"] and rate is not None:
        link_n += a2a_bytes / rate
    if gpus == 1:
        link_n = link
    exposed_hi = exposed * (link_n / link) if link > 0 else 0.0
    exposed_lo = max(0.0, link_n - (link - exposed))
    compute_n = compute * (1.0 - params.moe_compute_share * (1.0 - 1.0 / gpus))
    wall_hi = compute_n + other + exposed_hi + a2a_s
    wall_lo = compute_n + other + min(exposed_lo, exposed_hi) + a2a_s
    tps = [tokens / wall_hi, tokens / wall_lo]
    measured = row.get("output_tokens_per_s")
    out.update(
        {
            "simulated_tokens_per_s_low": tps[0],
            "simulated_tokens_per_s_high": tps[1],
            "simulated_speedup_low": tps[0] / (tokens / (compute + other + exposed)),
            "simulated_speedup_high": tps[1] / (tokens / (compute + other + exposed)),
            "simulated_link_busy_s_per_rank": link_n,
            "simulated_h2d_bytes_total": b_n,
            "simulated_aggregate_link_gbps": (b_n / wall_hi / 1e9),
            "simulated_all_to_all_s": a2a_s,
            "simulated_all_to_all_share": a2a_s / wall_hi,
            "simulated_exposed_fetch_s_range": [min(exposed_lo, exposed_hi), exposed_hi],
            "measured_wall_s": wall,
            "measured_link_busy_s": link,
            "measured_exposed_fetch_s": exposed,
            "measured_compute_busy_s": compute,
            "exposed_fetch_share_1gpu": exposed / wall if wall > 0 else None,
            "check_1gpu_tokens_per_s": tokens / (compute + other + exposed),
            "measured_output_tokens_per_s": measured,
            "link_gbps_measured_1gpu": None if rate is None else rate / 1e9,
        }
    )
    return out
