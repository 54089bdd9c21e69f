"""Issue 16 on the H200: tokens/s of PD+host (hybrid miss service) vs PD,
and the one runner of every interleaved A/B of run settings (``--arms``).

Runs :func:`pdflash.bench.engine_run.run_spec` in one process for every
(arch, repeat, point, arm): gpt-oss-20b and Qwen3-30B-A3B shapes truncated
to ``--layers`` (8 by default) MoE layers, synthetic bf16 weights
(``--synthetic-format mxfp4``: gpt-oss MXFP4 experts, kept MXFP4 in host
memory and over the link unless ``--expert-dtype dense``), forced
acceptance, block 16; ``--trace FILE`` replays a proxy trace's learned
routing and acceptance instead (the rows say ``trace``), and ``--closed N``
runs a closed loop of N requests per client instead of one burst. The host
computes from the weight format ``--host-format`` (default ``auto``: timed
at start-up; the chosen format and every candidate's time are in each
PD+host row and the summary).

Arms (``--arms``, default :data:`DEFAULT_ARMS`: each label at the best
setting measured for it, below): a comma-separated list of
``NAME=BASELINE[:SETTING=VALUE[:SETTING=VALUE...]]``; a bare ``BASELINE``
is an arm of that name with no overrides. SETTING is a run setting of
:class:`~pdflash.bench.engine_run.RunSpec` (``pdflash.report.schema``'s
RUN_SETTINGS, the settings a row's key records), VALUE as RunSpec takes it
(``true``/``false`` for a flag, ``none`` for an unset optional; a value may
hold ``:`` where what follows is not ``SETTING=``, e.g.
``verify_width=fixed:4``). An override beats the command line's option of
the same setting for that arm only. Example::

    --arms "PD,host=PD+host,stream=PD+host:host_handoff=stream,
            noaffinity=PD+host:host_affinity=off,weighted=PD+host:host_ahead=weighted"

Names, baselines, settings and values are checked (every arm's RunSpec
validated for every arch) before anything runs; two arms of one name, two
that run one configuration (the same engine configuration, from the label's
preset and the overrides, and the same other settings, at some point: e.g.
``PD`` and ``PDadaptive=PD:verify_width=adaptive``, PD's width being
``adaptive``), and
a ``host_*`` setting on an arm that runs no host service, are refused.
Within one repeat of one point every arm runs once, their order rotated by
one each repeat and point, so no arm always runs first or after the same
neighbour; repeats are repeat-major, one arch after
the other (the packed host experts of one arch are reused across its runs).
Every row carries ``arm`` and ``arm_settings``.

``--diag`` first times the host executor against the memory-bound floor and
the bare MLP on the first arch's own experts (``bench/h200/diag_host_experts.py``,
sections ``--diag-sections``, default ``paths``: the executor's paths, cold,
over ``--diag-bytes`` of experts, and on CUDA under a concurrent H2D copy;
its summary is in the summary's ``diag``).

torch's intra-op threads are process-wide: they are set once to
``--host-threads`` before the first run, so every arm runs with the same
setting; the host pool has ``--host-workers`` threads. Both are recorded.

Writes ``OUT/rows.jsonl`` (every row as it finishes) and ``OUT/summary.json``;
the summary is also the last line on stdout and a compact table goes to
stderr. Per point: each arm's tokens/s (median, 95% interval), per-repeat
ratios with their median and a verdict (from the pairs' own interval where
two or more repeats pair, else from the arms' intervals) for every arm vs
the reference arm (``--reference``, default the first PD+host arm) and for
every arm vs the first PD arm (``comparisons``, keyed ``ARM/OTHER``; each
with the pairs' own 95% interval, ``pair_ratio_ci95``), the fastest PD+host
arm against the fastest PD arm (``best_vs_best``: the issue's target reads
each label at its best setting; a PD-all-on or ablation arm is a setting of
PD, and with ``host_experts=auto`` of PD+host: :func:`label_side`), and
per arm the mechanism (``by_arm``: host served and planned-ahead experts,
link bytes per token, busy fractions, the ahead plans' outcome and routed
fraction, the hand-off that ran and why it fell back, the affinity that was
applied, who decided whether the host part ran (``--host-control``) and the
share of the measured steps it ran in, and the share each of PD's other parts
ran in with the controller's switches). The fields ``speedup_median``, ``verdict``, ``bytes_per_token``,
``pd_host`` and ``pd`` read the reference arm as "PD+host" and the PD arm
as "PD" (with the default arms: those presets, warmed past their
controller's first round). ``--budget-s``
stops starting runs; the summary says how many repeats each point got.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdflash.bench.pair_ratios import captures_in_clock, ratio_verdict

from pdflash.report.stats import compare, pair_summary, t_interval


def interval(values: list[float]) -> dict[str, Any]:
    """Median, min/max and (with two or more values) the t-based 95%
    interval of the mean (:func:`pdflash.report.stats.t_interval`)."""
    if not values:
        return {"n": 0}
    out: dict[str, Any] = {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }
    if len(values) >= 2:
        iv = t_interval(values)
        out["mean_ci95"] = [iv.low, iv.high]
    return out


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _median(rows: list[dict[str, Any]], name: str) -> float | None:
    vals = [v for v in (_num(r.get(name)) for r in rows) if v is not None]
    return statistics.median(vals) if vals else None


#: each side at its best measured setting, warmed alike: the presets past
#: their controller's first round, PD's parts all on (without and with the
#: host part) given as many workload bursts, CUDA graph pieces on all
#: (bench/results/h200/session27-2026-12-04/: the settled presets and the
#: all-on arms within noise of each other at c=1, 4 and 16)
DEFAULT_ARMS = (
    "PD=PD:cuda_graphs=piecewise:controller_warmup=first_round,"
    "PD-all-on=PD-all-on:cuda_graphs=piecewise:warm_bursts=3,"
    "PD+host=PD+host:cuda_graphs=piecewise:controller_warmup=first_round,"
    "PD-all-on+host=PD-all-on:host_experts=auto:cuda_graphs=piecewise:warm_bursts=3"
)
#: an arm's name: what rows, ratios (``ARM/OTHER``) and the table show
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
#: splits an arm's overrides: a ``:`` followed by ``SETTING=``
_OVERRIDE_SPLIT = re.compile(r":(?=[a-z_][a-z0-9_]*=)")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm of an A/B: a baseline and the run settings it overrides."""

    name: str
    baseline: str
    settings: tuple[tuple[str, Any], ...] = ()

    def overrides(self) -> dict[str, Any]:
        return dict(self.settings)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "baseline": self.baseline, "settings": self.overrides()}


def settable_settings() -> dict[str, str]:
    """The run settings an arm may override: RunSpec's fields that a row's
    key records (``pdflash.report.schema.RUN_SETTINGS``), with their
    annotations."""
    from pdflash.bench.engine_run import RunSpec

    from pdflash.report.schema import RUN_SETTINGS

    fields = {f.name: str(f.type) for f in dataclasses.fields(RunSpec)}
    return {s.name: fields[s.name] for s in RUN_SETTINGS if s.name in fields}


def _coerce(arm: str, name: str, text: str, annotation: str) -> Any:
    """``text`` as the RunSpec field ``name`` (annotated ``annotation``) takes it."""
    kinds = {k.strip() for k in annotation.split("|")}
    if "None" in kinds and text.lower() == "none":
        return None
    try:
        if "bool" in kinds:
            if text.lower() not in ("true", "false"):
                raise ValueError("a flag is true or false")
            return text.lower() == "true"
        if "int" in kinds:
            return int(text)
        if "float" in kinds:
            return float(text)
    except ValueError as exc:
        raise ValueError(
            f"arm {arm!r}: {name}={text!r} is not of type {annotation} ({exc})"
        ) from None
    return text


#: run settings whose value may hold ``:NAME=`` options of its own
#: (``verify_width=adaptive:beta=one``)
_OPTIONED_SETTINGS = ("verify_width",)


def _width_options_joined(overrides: list[str], settable: dict[str, str]) -> list[str]:
    """``overrides`` with each ``NAME=VALUE`` piece whose NAME is no run
    setting joined back onto a preceding setting that takes options (an
    adaptive width's ``:beta=one``); any other unknown NAME stays its own
    piece, for :func:`parse_arms` to refuse."""
    out: list[str] = []
    for piece in overrides:
        key = piece.partition("=")[0]
        if key not in settable and out and out[-1].partition("=")[0] in _OPTIONED_SETTINGS:
            out[-1] += ":" + piece
        else:
            out.append(piece)
    return out


def parse_arms(text: str, settable: dict[str, str] | None = None) -> list[Arm]:
    """The arms ``text`` names (the module doc's syntax), or ValueError
    saying what is wrong. Checks the syntax, names, baselines and setting
    names and types; :func:`check_arms` then validates each arm's RunSpec."""
    from pdflash.engine.config import BASELINES

    settable = settable_settings() if settable is None else settable
    arms: list[Arm] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, *tail = _OVERRIDE_SPLIT.split(item)
        name, eq, baseline = head.partition("=")
        name, baseline = name.strip(), (baseline.strip() if eq else name.strip())
        if not ARM_NAME.fullmatch(name):
            raise ValueError(
                f"arm name {name!r} (in {item!r}) must be letters, digits, '_', '.', '+' or '-'"
            )
        if baseline not in BASELINES:
            raise ValueError(f"arm {name!r}: baseline must be one of {BASELINES}, got {baseline!r}")
        if any(a.name == name for a in arms):
            raise ValueError(f"two arms are named {name!r}")
        settings: dict[str, Any] = {}
        for override in _width_options_joined(tail, settable):
            key, _, value = override.partition("=")
            if key not in settable:
                raise ValueError(
                    f"arm {name!r}: {key!r} is not a run setting; one of {sorted(settable)}"
                )
            if key in settings:
                raise ValueError(f"arm {name!r} sets {key} twice")
            settings[key] = _coerce(name, key, value, settable[key])
        arms.append(Arm(name, baseline, tuple(settings.items())))
    if not arms:
        raise ValueError(f"no arms in {text!r}")
    return arms


def arm_spec_kwargs(base: dict[str, Any], arm: Arm) -> dict[str, Any]:
    """RunSpec's keywords for ``arm``: ``base`` (the command line's
    settings), its baseline, its overrides."""
    return {**base, "baseline": arm.baseline, **arm.overrides()}


#: RunSpec fields a run reads only through its engine configuration, where
#: :meth:`~pdflash.bench.engine_run.RunSpec.engine_config` resolves them (an
#: ``auto`` width to the label's, PD+host's host mode, the default limits)
_IN_ENGINE_CONFIG = ("verify_width", "host_experts", "max_running", "token_budget")


def resolved_run(spec: Any) -> tuple[Any, ...]:
    """What a run of ``spec`` (a RunSpec) runs: the engine configuration its
    label's preset and settings build, and its other fields, each run setting
    resolved as the report keys rows (``pdflash.report.schema.RUN_SETTINGS``:
    e.g. the marginal rule where it cannot apply, an int or a float share) and
    the eviction policy as the run resolves it (``auto`` is ``layer_cyclic``).
    Two specs with one resolved run run one configuration."""
    from pdflash.report.schema import RUN_SETTINGS

    fields = dataclasses.asdict(spec)
    resolved = {s.name: s.of_spec(fields) for s in RUN_SETTINGS if s.in_spec and s.name in fields}
    resolved["eviction"] = spec.resolved_eviction()
    rest = {k: resolved.get(k, v) for k, v in fields.items() if k not in _IN_ENGINE_CONFIG}
    return (spec.engine_config(), tuple(sorted((k, repr(v)) for k, v in rest.items())))


def _as_written(arm: Arm) -> str:
    settings = ":".join(f"{k}={v}" for k, v in arm.settings)
    return arm.baseline + (f":{settings}" if settings else "")


def check_arms(arms: Sequence[Arm], base: dict[str, Any], archs: Sequence[str]) -> None:
    """Validate every arm's RunSpec for every arch (``base`` holds what the
    arms share, point fields included), before anything runs; ValueError
    names the arm. Refuses a ``host_*`` override on an arm that runs no host
    service, two arms that run one configuration (:func:`resolved_run`:
    e.g. ``PD`` and ``PD:verify_width=adaptive``, PD's width being
    ``adaptive``) and arms that would warm up differently on CUDA
    (:func:`check_warm_ups`)."""
    from pdflash.bench.engine_run import RunSpec

    for arch in archs:
        seen: dict[tuple[Any, ...], Arm] = {}
        specs: list[tuple[Arm, Any]] = []
        for arm in arms:
            try:
                spec = RunSpec(**arm_spec_kwargs({**base, "arch": arch}, arm))
                spec.validate()
            except (TypeError, ValueError) as exc:
                raise ValueError(f"arm {arm.name!r} ({arch}): {exc}") from None
            idle = [
                k
                for k, _ in arm.settings
                if k.startswith("host_") and k != "host_experts" and spec.host_mode == "off"
            ]
            if idle:
                raise ValueError(
                    f"arm {arm.name!r}: {', '.join(idle)} cannot apply to baseline "
                    f"{arm.baseline} (no host service; use PD+host or host_experts=auto)"
                )
            key = resolved_run(spec)
            if key in seen:
                other = seen[key]
                raise ValueError(
                    f"arms {other.name!r} ({_as_written(other)}) and {arm.name!r} "
                    f"({_as_written(arm)}) run one configuration ({arch}, cache "
                    f"{spec.cache_fraction}, c={spec.concurrency}): their overrides resolve to "
                    "the same engine configuration and run settings (an override equal to "
                    "what the label's preset or the command line already sets changes "
                    "nothing); drop one arm or change its settings"
                )
            seen[key] = arm
            specs.append((arm, spec))
        check_warm_ups(specs)


def check_warm_ups(specs: Sequence[tuple[Arm, Any]]) -> None:
    """Refuse arms (with their RunSpecs) whose warm-ups differ on CUDA
    (:func:`pdflash.bench.engine_run.warmup_mode`; ``warmup=auto`` is
    ``workload`` with CUDA graphs on, ``shared`` without). A run warmed on
    its own workload starts from an engine that kept what it learned (the PD
    controller past its warm-up, the width's estimates), a run after the
    shared warm-up from a nearly fresh one, so the comparison would mix the
    warm-up with the setting (in session 22's graph A/B the PD controller's
    parts ran differently in every graph run from the eager ones). Checked
    for CUDA whatever the device, so a CPU rehearsal refuses it too."""
    import torch
    from pdflash.bench.engine_run import warmup_mode

    cuda = torch.device("cuda")
    modes = [(arm, warmup_mode(spec, cuda)) for arm, spec in specs]
    first, first_mode = modes[0]
    for arm, mode in modes[1:]:
        if mode != first_mode:
            raise ValueError(
                f"arms {first.name!r} ({_as_written(first)}) and {arm.name!r} "
                f"({_as_written(arm)}) warm up differently on CUDA ({first_mode} vs {mode}; "
                "warmup=auto is workload with cuda_graphs on, shared with it off): a run warmed "
                "on its own workload keeps what its engine learned, so the comparison would mix "
                "the warm-up with the setting; set one warmup (e.g. warmup=workload) on every arm"
            )


def arm_order(arms: Sequence[Arm], repeat: int, point_index: int) -> list[Arm]:
    """The arms in the order one repeat of one point runs them: rotated by
    one each repeat and each point."""
    shift = (repeat + point_index) % len(arms)
    return [*arms[shift:], *arms[:shift]]


def _arm_of(row: dict[str, Any]) -> str:
    # rows from before --arms: their baseline was their arm
    return str(row.get("arm") or row["baseline"])


def _service(row: dict[str, Any]) -> dict[str, Any]:
    hs = row.get("host_service")
    return hs if isinstance(hs, dict) else {}


def _verdict(a: dict[str, Any], b: dict[str, Any], name_a: str) -> str:
    """``name_a`` faster / slower than the other (two :func:`interval`
    summaries) where their 95% intervals do not overlap
    (:func:`pdflash.report.stats.compare`); a side with one run has no
    interval, so no verdict."""
    if "mean_ci95" not in a or "mean_ci95" not in b:
        return "too few runs"
    called = compare(t_interval(a["values"]), t_interval(b["values"]))
    return {"a": f"{name_a} faster", "b": f"{name_a} slower"}.get(called, "within noise")


def _pairs_verdict(low: float, high: float, name: str) -> str:
    """``name`` faster / slower where the interleaved pairs' ratio interval
    ``[low, high]`` excludes 1 (:func:`pdflash.bench.pair_ratios.ratio_verdict`)."""
    verdict = ratio_verdict(low, high)
    return verdict if verdict == "within noise" else f"{name} {verdict}"


def _median_of(rows: list[dict[str, Any]], read: Callable[[dict[str, Any]], Any]) -> float | None:
    vals = [v for v in (_num(read(r)) for r in rows) if v is not None]
    return statistics.median(vals) if vals else None


def _busy(row: dict[str, Any], key: str) -> float | None:
    busy, wall = _num(row.get(key)), _num(row.get("wall_s"))
    return busy / wall if busy is not None and wall else None


#: PD's parts its controller probes (``pd_parts.on_fraction``'s keys beside
#: the host part, ``host_experts``, reported on its own): those of
#: pdflash.engine.pd_controller.PARTS, in the table's order, kept here so the
#: summary loads without the engine (a test keeps the two equal)
PD_PARTS = ("route_ahead", "stream", "scheduler_2d")


def _controller_warmup(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    warmed = [
        w
        for r in rows
        if isinstance(w := (r.get("warmup") or {}).get("controller"), dict)
        and w.get("first_round_done") is not None
    ]
    if not warmed:
        return None
    return {
        "runs": len(warmed),
        "first_round_done": sum(1 for w in warmed if w["first_round_done"]),
        "bursts_median": statistics.median(w["bursts"] for w in warmed),
        "steps_median": statistics.median(w["steps"] for w in warmed),
    }


def _spread(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Median, min and max (:func:`interval`'s) of the runs' ``key`` (None
    where no run has it)."""
    vals = [v for v in (_num(r.get(key)) for r in rows) if v is not None]
    if not vals:
        return None
    summary = interval(vals)
    return {k: summary[k] for k in ("median", "min", "max")}


def _books_exposed_share(row: dict[str, Any]) -> float | None:
    """The exposed fetch PD's books summed over a run's steps (the per-step
    reads its probes judge by) over the row's own total (read after a device
    synchronize): below 1 where the per-step reads miss waits (None without
    books, or a run that waited for no copy)."""
    sums = (row.get("pd_parts") or {}).get("step_sums") or {}
    books, total = _num(sums.get("exposed_fetch_s")), _num(row.get("exposed_fetch_s"))
    return books / total if books is not None and total else None


def _part_on(row: dict[str, Any], part: str) -> Any:
    """The share of a run's measured steps ``part`` (one of
    :data:`PD_PARTS` or ``host_experts``) ran in (None where the run had no
    PD controller books)."""
    return ((row.get("pd_parts") or {}).get("on_fraction") or {}).get(part)


def _host_ms_per_expert(row: dict[str, Any]) -> float | None:
    """A run's host busy milliseconds per expert the host served (None
    where it served none)."""
    served, busy = _num(row.get("host_served_experts")), _num(row.get("host_busy_s"))
    return 1e3 * busy / served if served and busy is not None else None


def arm_mechanism(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: medians over its runs of what the host service did, and what
    each run recorded it ran (host fields None where no run had a host
    service: not measured, not zero)."""
    hosted = [r for r in rows if _service(r)]
    out: dict[str, Any] = {
        "runs": len(rows),
        "host_service_runs": len(hosted),
        "bytes_per_token": _median_of(rows, lambda r: r.get("bytes_per_token")),
        "h2d_bytes": _median_of(rows, lambda r: r.get("h2d_bytes")),
        "wasted_prefetch_bytes": _median_of(rows, lambda r: r.get("wasted_prefetch_bytes")),
        # each resource's busy seconds over the run's wall, per run, then the median
        "busy_fraction": {
            res: _median_of(rows, functools.partial(_busy, key=key))
            for res, key in (
                ("compute", "compute_busy_s"),
                ("link", "link_busy_s"),
                ("host_cpu", "host_busy_s"),
            )
        },
        "host_served_experts": _median_of(rows, lambda r: r.get("host_served_experts")),
        # experts hosted whose copy was still queued (given back; host_queued)
        "queued_hosted": _median_of(rows, lambda r: _service(r).get("queued_hosted")),
        "host_planned_ahead_experts": _median_of(
            rows, lambda r: r.get("host_planned_ahead_experts")
        ),
        "host_wait_s": _median_of(rows, lambda r: r.get("host_wait_s")),
        # the host CPU's speed as the runs met it: its busy time per expert it
        # served, per run in repeat order (it drifts over a call as the host
        # slows), and the median
        "host_busy_ms_per_expert": _median_of(rows, _host_ms_per_expert),
        # runs whose clock holds CUDA-graph captures (target pieces or whole
        # steps, or the drafter's): a pre-capture that did not cover them
        "runs_with_captures_in_run": sum(1 for r in rows if captures_in_clock(r)),
        "host_busy_ms_per_expert_by_repeat": [
            x
            for r in sorted(rows, key=lambda r: r.get("repeat") or 0)
            if (x := _host_ms_per_expert(r)) is not None
        ],
        # PD's controller probes its parts inside short runs (each probe
        # turns a part off in half its steps): the share of measured steps
        # each ran in, and the switches it made (None without a controller)
        "parts_on_fraction": {
            part: _median_of(rows, functools.partial(_part_on, part=part)) for part in PD_PARTS
        },
        "parts_switches": _median_of(rows, lambda r: (r.get("pd_parts") or {}).get("switches")),
        # the books' per-step exposed fetch over the row's total (median)
        "books_exposed_share": _median_of(rows, _books_exposed_share),
        # the exposed fetch's share of the wall by what the waits waited
        # for (copies issued on demand for misses / prefetches not landed),
        # and the hit rate counting only copies landed before the access
        "exposed_miss_share": _median_of(rows, lambda r: _busy(r, "exposed_fetch_miss_s")),
        "exposed_inflight_share": _median_of(rows, lambda r: _busy(r, "exposed_fetch_inflight_s")),
        "exposed_queued_share": _median_of(rows, lambda r: _busy(r, "exposed_fetch_queued_s")),
        "landed_hit_rate": _median_of(rows, lambda r: r.get("expert_cache_landed_hit_rate")),
        # tokens committed per request round, per run: arms whose draws or
        # widths differ commit differently per step (the tokens/s follow)
        "acceptance_length": _spread(rows, "acceptance_length_mean"),
        # how much each run's clock measured: a run of a few steps (c=1 with
        # few new tokens) gives a noisy rate
        "measured_steps": _spread(rows, "steps"),
        "measured_wall_s": _spread(rows, "wall_s"),
        # controller_warmup="first_round": the warm-up bursts each run ran
        # and how many runs' controllers ended their first round before the
        # clock (None where no run of the arm warmed its controller)
        "controller_warmup": _controller_warmup(rows),
    }
    if not hosted:
        for k in (
            "ahead_outcome",
            "ahead_fraction_end",
            "host_ahead",
            "host_plan",
            "host_ahead_from",
            "ahead_gate",
            "host_control",
            "host_part_on_fraction",
            "lookahead_split",
            "plan_reasons",
            "handoff",
            "affinity",
        ):
            out[k] = None
        return out
    # the ahead plans' HOST experts over the arm's runs: seen by their
    # layers, routed, hosted by the layer's own plan
    out["ahead_outcome"] = {
        k: sum(int((_service(r).get("ahead_outcome") or {}).get(k, 0)) for r in hosted)
        for k in ("seen", "routed", "hosted")
    }
    # the routed fraction each run's planner ended with (weighted's p)
    out["ahead_fraction_end"] = [
        (_service(r).get("ahead_fraction") or {}).get("value") for r in hosted
    ]
    out["host_ahead"] = sorted(
        {str((_service(r).get("planner") or {}).get("ahead")) for r in hosted}
    )
    # the planner's rule (rows recorded before the queue and lag rules were
    # removed carry theirs; every later row ran makespan), which copies its
    # ahead plans split and the lookahead layers it split in the forwards
    # (summed over the arm's runs), and why it chose what it chose: its
    # decisions (layers planned, by reason; pdflash.hybrid.planner.PLAN_REASONS,
    # and ahead_* for the pre-verify plan's layers) summed over the arm's runs
    # (a planner that counts none: absent from the sum, "runs" says how many did)
    out["host_plan"] = sorted(
        {str((_service(r).get("planner") or {}).get("rule", "makespan")) for r in hosted}
    )
    out["host_ahead_from"] = sorted(
        {str(_service(r).get("ahead_from", "predicted")) for r in hosted}
    )
    # the pre-verify plan's gate (--host-ahead-min-exposed): the settings
    # the arm's runs recorded and the verifies it opened / closed, summed
    # (rows older than the gate's record: absent from the sums, "runs" says
    # how many recorded it)
    gates = [g for g in (r.get("host_ahead_gate") for r in hosted) if isinstance(g, dict)]
    out["ahead_gate"] = (
        {
            "runs": len(gates),
            "min_exposed": sorted({float(g["min_exposed"]) for g in gates}),
            **{k: sum(int(g.get(k, 0)) for g in gates) for k in ("open", "closed")},
        }
        if gates
        else None
    )
    # who decided whether the host part ran (--host-control; rows older than
    # the setting: the controller) and the share of the measured steps it
    # ran in (the PD controller's books; None without a controller)
    out["host_control"] = sorted({str(r.get("host_control") or "controller") for r in hosted})
    out["host_part_on_fraction"] = _median_of(
        hosted, functools.partial(_part_on, part="host_experts")
    )
    out["lookahead_split"] = {
        k: sum(int((_service(r).get("lookahead_split") or {}).get(k, 0)) for r in hosted)
        for k in ("layers", "planned")
    }
    # the measured part's decisions (the part host_served_experts counts);
    # rows recorded before they were kept apart: the whole run's
    counted, parts = [], set()
    for r in hosted:
        svc = _service(r)
        measured = svc.get("planner_decisions_measured")
        d = measured if measured is not None else svc.get("planner_decisions")
        if d:
            counted.append(d)
            parts.add("measured" if measured is not None else "whole_run")
    reasons: dict[str, int] = {}
    for d in counted:
        for k, v in d.items():
            reasons[k] = reasons.get(k, 0) + int(v)
    out["plan_reasons"] = (
        {"runs": len(counted), "part": "+".join(sorted(parts)), **reasons} if counted else None
    )
    handoffs = [_service(r).get("host_handoff") or {} for r in hosted]
    ran: dict[str, int] = {}
    for h in handoffs:
        ran[str(h.get("mode"))] = ran.get(str(h.get("mode")), 0) + 1
    out["handoff"] = {
        "requested": sorted({str(h.get("requested")) for h in handoffs}),
        # runs per mode that actually ran, and why a run fell back
        "ran": ran,
        "fallback_reasons": sorted({str(h["reason"]) for h in handoffs if h.get("reason")}),
    }
    placed = [_service(r).get("affinity") or {} for r in hosted]
    out["affinity"] = {
        "mode": sorted({str(a.get("mode")) for a in placed}),
        "applied_runs": sum(1 for a in placed if a.get("applied")),
        "reasons": sorted({str(a["reason"]) for a in placed if a.get("reason")}),
    }
    return out


def comparisons(
    names: Sequence[str], reference: str | None, pd_arm: str | None
) -> list[tuple[str, str]]:
    """The (arm, other) pairs a point is judged on: every arm vs the
    reference arm, then every arm vs the PD arm, each pair once and in one
    direction (the reference vs PD, not PD vs the reference)."""
    pairs: list[tuple[str, str]] = []
    for other in (reference, pd_arm):
        if other is None:
            continue
        pairs += [
            (a, other)
            for a in names
            if a != other and (a, other) not in pairs and not (other == reference and a == pd_arm)
        ]
    return pairs


def _compared(
    tps: dict[str, Any],
    per_rep: dict[tuple[str, Any], float | None],
    num: str,
    den: str,
    subject: str | None = None,
) -> dict[str, Any]:
    """Arm ``num`` against arm ``den`` at one point: the per-repeat ratios
    of the repeats both ran, their median and their own 95% interval, the
    ratio of the medians and the verdict: from the pairs' interval (faster
    or slower where it excludes 1) where two or more repeats pair, else from
    the arms' intervals (``verdict_from`` says which); the verdict names
    ``subject`` (default ``num``)."""
    pairs = pair_summary(
        {rep: v for (arm, rep), v in per_rep.items() if arm == num},
        {rep: v for (arm, rep), v in per_rep.items() if arm == den},
    )
    ratios = pairs["ratios"]
    ta, tb = tps[num], tps[den]
    name = num if subject is None else subject
    if pairs["called"] is None:
        verdict, verdict_from = _verdict(ta, tb, name), "arms"
    else:
        verdict, verdict_from = _pairs_verdict(pairs["low"], pairs["high"], name), "pairs"
    return {
        "pair_ratios": ratios,
        # one pair is its own median
        "pair_ratio_median": statistics.median(ratios) if ratios else None,
        # the interleaved pairs' own interval: tighter than the arms' where
        # the repeats drift together
        "pair_ratio_ci95": None if pairs["called"] is None else [pairs["low"], pairs["high"]],
        "median_ratio": ta["median"] / tb["median"] if ta.get("n") and tb.get("n") else None,
        "verdict": verdict,
        "verdict_from": verdict_from,
    }


def label_side(row: dict[str, Any]) -> str | None:
    """Which side of the issue's comparison a run is on: ``PD+host`` where
    it ran the host service on PD's machinery (the PD+host label, or PD,
    PD-all-on or one of PD's ablations with ``host_experts`` on), ``PD``
    where it ran PD's machinery without it (PD, PD-all-on, an ablation: a
    setting of PD), None for the other baselines."""
    baseline = str(row.get("baseline"))
    hosted = row.get("host_experts") not in (None, "off")
    if baseline == "PD+host" or (baseline.startswith("PD") and hosted):
        return "PD+host"
    if baseline == "PD" or baseline.startswith("PD-"):
        return "PD"
    return None


def best_arms(tps: dict[str, Any], side_of: dict[str, str | None]) -> tuple[str, str] | None:
    """The fastest PD+host arm and the fastest PD arm of a point (by median
    tokens/s; ``side_of``: each arm's :func:`label_side`), or None where
    either side has no arm with runs."""

    def fastest(label: str) -> str | None:
        ran = [a for a, t in tps.items() if side_of.get(a) == label and t.get("n")]
        return max(ran, key=lambda a: tps[a]["median"]) if ran else None

    host, pd = fastest("PD+host"), fastest("PD")
    return None if host is None or pd is None else (host, pd)


def summarise(
    rows: list[dict[str, Any]],
    arms: Sequence[Arm] | None = None,
    reference: str | None = None,
) -> list[dict[str, Any]]:
    """Per (arch, cache fraction, concurrency): see the module doc.
    ``arms``: the run's arms (default: from the rows, in order of first
    appearance); ``reference``: the arm the others are compared with
    (default: the first PD+host arm)."""
    if arms is None:
        found: dict[str, str] = {}
        for r in rows:
            found.setdefault(_arm_of(r), r["baseline"])
        arms = [Arm(n, b) for n, b in found.items()]
    names = [a.name for a in arms]
    pd_arm = next((a.name for a in arms if a.baseline == "PD"), None)
    if reference is None:
        reference = next((a.name for a in arms if a.baseline == "PD+host"), None)
    points: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["arch"], r["cache_fraction"], r["concurrency"])
        points.setdefault(key, {}).setdefault(_arm_of(r), []).append(r)
    out = []
    for (arch, cf, conc), by in sorted(points.items()):
        pd, host = by.get(pd_arm or "", []), by.get(reference or "", [])
        tps = {
            arm: interval(
                [v for v in (_num(r.get("output_tokens_per_s")) for r in by[arm]) if v is not None]
            )
            for arm in [*[n for n in names if n in by], *[n for n in by if n not in names]]
        }
        entry: dict[str, Any] = {
            "arch": arch,
            "cache_fraction": cf,
            "concurrency": conc,
            "tokens_per_s": tps,
            "reference_arm": reference,
            "pd_arm": pd_arm,
        }
        per_rep = {
            (arm, r["repeat"]): _num(r.get("output_tokens_per_s"))
            for arm, rs in by.items()
            for r in rs
            if r.get("repeat") is not None
        }
        a, b = tps.get(pd_arm or "", {}), tps.get(reference or "", {})
        if a.get("n") and b.get("n"):
            assert reference is not None and pd_arm is not None
            entry["speedup_median"] = b["median"] / a["median"]
            # the reference arm read as PD+host (one run on a side: too few runs)
            headline = _compared(tps, per_rep, reference, pd_arm, subject="PD+host")
            entry["verdict"] = headline["verdict"]
        entry["comparisons"] = {
            f"{num}/{den}": _compared(tps, per_rep, num, den)
            for num, den in comparisons(list(tps), reference, pd_arm)
            if num in tps and den in tps
        }
        best = best_arms(tps, {arm: label_side(rs[0]) for arm, rs in by.items()})
        if best is not None:
            # the issue's target reads each label at its best setting
            entry["best_vs_best"] = {"pair": "/".join(best), **_compared(tps, per_rep, *best)}
        entry["by_arm"] = {arm: arm_mechanism(by[arm]) for arm in tps}
        bpt_pd, bpt_host = _median(pd, "bytes_per_token"), _median(host, "bytes_per_token")
        entry["bytes_per_token"] = {"PD": bpt_pd, "PD+host": bpt_host}
        if bpt_pd and bpt_host is not None:
            entry["bytes_per_token_ratio"] = bpt_host / bpt_pd
        if host:
            nbytes = float(host[0]["expert_nbytes"])
            served = _median(host, "host_served_experts") or 0.0
            copied = (_median(host, "h2d_bytes") or 0.0) / nbytes
            busy = {
                "compute": _median(host, "compute_busy_s"),
                "link": _median(host, "link_busy_s"),
                "host_cpu": _median(host, "host_busy_s"),
            }
            wall = _median(host, "wall_s") or float("nan")
            frac = {k: (v / wall if v is not None else None) for k, v in busy.items()}
            known = {k: v for k, v in frac.items() if v is not None}
            entry["pd_host"] = {
                "host_served_experts": served,
                "host_share_of_misses": served / (served + copied) if served + copied else None,
                "link_bytes_saved_per_token": _median(host, "link_bytes_saved_per_token"),
                "host_wait_s": _median(host, "host_wait_s"),
                "busy_fraction": frac,
                "binding_resource": max(known, key=lambda k: known[k]) if known else None,
                "cpu_is_bottleneck": bool(known)
                and max(known, key=lambda k: known[k]) == "host_cpu",
                "eta": _median(host, "eta"),
                "eta_phys": _median(host, "eta_phys"),
            }
        if pd:
            wall = _median(pd, "wall_s") or float("nan")
            entry["pd"] = {
                "busy_fraction": {
                    "compute": (_median(pd, "compute_busy_s") or 0.0) / wall,
                    "link": (_median(pd, "link_busy_s") or 0.0) / wall,
                },
                "eta": _median(pd, "eta"),
                "eta_phys": _median(pd, "eta_phys"),
            }
        out.append(entry)
    return out


def _per_arm_line(
    by_arm: dict[str, Any], heading: str, key: str, show: Callable[[Any], str]
) -> list[str]:
    """One table line, ``heading: arm shown; ...``, over the arms whose
    summary has ``key`` (none where no arm has it)."""
    shown = [f"{arm} {show(m[key])}" for arm, m in by_arm.items() if m.get(key) is not None]
    return [f"  {heading}: " + "; ".join(shown)] if shown else []


def _measured_line(by_arm: dict[str, Any]) -> list[str]:
    """Per arm, the steps and wall seconds a run's clock measured (medians;
    older summaries carry none: no line)."""
    shown = [
        f"{arm} {_fmt(m['measured_steps']['median'], '.0f')} steps "
        f"[{_fmt(m['measured_steps']['min'], '.0f')}-{_fmt(m['measured_steps']['max'], '.0f')}]"
        f" ({_fmt(m['measured_wall_s']['median'])} s)"
        for arm, m in by_arm.items()
        if (m.get("measured_steps") or {}).get("median") is not None
        and (m.get("measured_wall_s") or {}).get("median") is not None
    ]
    return ["  measured a run (median): " + "; ".join(shown)] if shown else []


def _exposed_split_line(by_arm: dict[str, Any]) -> list[str]:
    """The wall's exposed-fetch shares on misses and on prefetches in flight
    (of those, still queued when the forward asked), and the landed-only hit
    rate, per arm (older rows carry none: no line)."""
    if all(m.get("exposed_miss_share") is None for m in by_arm.values()):
        return []
    return [
        "  exposed fetch / wall, on misses + on prefetches in flight [of them queued]"
        " (landed hit rate): "
        + "; ".join(
            f"{arm} {_fmt(m.get('exposed_miss_share'))} + {_fmt(m.get('exposed_inflight_share'))}"
            f" [{_fmt(m.get('exposed_queued_share'))}] ({_fmt(m.get('landed_hit_rate'))})"
            for arm, m in by_arm.items()
        )
    ]


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if _num(x) is None else format(x, spec)


def _reasons(counts: dict[str, Any] | None) -> str:
    """The planner's decisions by reason, compactly: per layer plan and per
    ahead-plan layer, ``reason=count`` (module doc of pdflash.hybrid.planner)."""
    if not counts:
        return "not counted"
    layer = " ".join(
        f"{k}={counts[k]}"
        # copy_hidden: rows of the removed queue rule
        for k in ("split", "copy_hidden", "copy_ineligible", "copy_margin", "probes")
        if k in counts
    )
    ahead = " ".join(
        f"{k.removeprefix('ahead_')}={v}"
        for k, v in counts.items()
        if k.startswith("ahead_") and k != "ahead_layers"
    )
    return (
        f"layers {counts.get('layers')} [{layer}] ahead layers {counts.get('ahead_layers')} "
        f"[{ahead}] ({counts.get('runs')} runs, {counts.get('part', 'whole_run')})"
    )


def table(summary: dict[str, Any]) -> list[str]:
    """The compact table (the log's last lines): per point each arm's median
    tokens/s (runs), every comparison's per-repeat ratio median and verdict,
    and per arm with a host service its mechanism."""
    lines = [
        f"issue16 arms: {summary.get('device')}, runs {summary.get('runs')}, not started "
        f"(budget) {summary.get('runs_not_started_budget')}, errors {len(summary.get('errors', []))}"
    ]
    for p in summary.get("points", []):
        tps = p.get("tokens_per_s", {})
        by_arm = p.get("by_arm") or {}
        head = " | ".join(
            f"{arm} {_fmt(t.get('median'), '.1f')} ({t.get('n', 0)})" for arm, t in tps.items()
        )
        lines.append(f"{p['arch']} cache {p['cache_fraction']} c={p['concurrency']}: {head}")
        for pair, c in (p.get("comparisons") or {}).items():
            lines.append(
                f"  {pair}: median {_fmt(c.get('pair_ratio_median'))} ({c.get('verdict')})"
            )
        best = p.get("best_vs_best")
        if best:
            ci = best.get("pair_ratio_ci95")
            ci_text = "no interval" if ci is None else f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"
            lines.append(
                f"  best PD+host / best PD ({best['pair']}): median "
                f"{_fmt(best.get('pair_ratio_median'))}, pairs' interval {ci_text} "
                f"({best.get('verdict')})"
            )
        captured = {
            arm: (m.get("runs_with_captures_in_run"), m.get("runs"))
            for arm, m in by_arm.items()
            if m.get("runs_with_captures_in_run")
        }
        if captured:
            # those runs' clocks hold graph captures: their comparisons are confounded
            lines.append(
                "  runs with CUDA-graph captures in their clock: "
                + ", ".join(f"{arm} {n}/{runs}" for arm, (n, runs) in captured.items())
            )
        probed = {
            arm: m
            for arm, m in by_arm.items()
            if any(v is not None for v in (m.get("parts_on_fraction") or {}).values())
        }
        if probed:
            # below 1: the controller ran the part in only that share of the steps
            lines.append(
                "  PD's parts on (share of steps; switches): "
                + "; ".join(
                    f"{arm} "
                    + " ".join(
                        f"{part} {_fmt(m['parts_on_fraction'].get(part))}" for part in PD_PARTS
                    )
                    + f" ({_fmt(m.get('parts_switches'), '.0f')})"
                    for arm, m in probed.items()
                )
            )
        lines += _per_arm_line(
            by_arm,
            "committed per request round",
            "acceptance_length",
            lambda a: f"{_fmt(a['median'])} [{_fmt(a['min'])}, {_fmt(a['max'])}]",
        )
        lines += _measured_line(by_arm)
        lines += _per_arm_line(
            by_arm,
            "exposed fetch the books' per-step reads saw / the run's total",
            "books_exposed_share",
            _fmt,
        )
        lines += _exposed_split_line(by_arm)
        # the runs' clocks started past the controller's first round (or the
        # warm-up's step cap came first: fewer ended than runs)
        lines += _per_arm_line(
            by_arm,
            "controller warmed past its first round",
            "controller_warmup",
            lambda w: (
                f"{w['first_round_done']}/{w['runs']} runs, bursts "
                f"{_fmt(w['bursts_median'], '.0f')}, steps {_fmt(w['steps_median'], '.0f')}"
            ),
        )
        for arm, m in by_arm.items():
            if not m.get("host_service_runs"):
                continue
            busy = m.get("busy_fraction") or {}
            bpt = _num(m.get("bytes_per_token"))
            fr = [f for f in m.get("ahead_fraction_end") or [] if _num(f) is not None]
            lines.append(
                f"  {arm}: host {_fmt(m.get('host_served_experts'), '.0f')} "
                f"planned-ahead {_fmt(m.get('host_planned_ahead_experts'), '.0f')} "
                f"MB/tok {_fmt(None if bpt is None else bpt / 1e6, '.1f')} "
                f"link {_fmt(busy.get('link'))} host {_fmt(busy.get('host_cpu'))} "
                f"ahead {m.get('ahead_outcome')} p_end {_fmt(statistics.median(fr) if fr else None)} "
                f"handoff {m.get('handoff', {}).get('ran')} {m.get('handoff', {}).get('fallback_reasons')} "
                f"affinity {m.get('affinity', {}).get('mode')} "
                f"applied {m.get('affinity', {}).get('applied_runs')}/{m.get('host_service_runs')}"
                f" {m.get('affinity', {}).get('reasons') or ''}"
            )
            by_rep = m.get("host_busy_ms_per_expert_by_repeat") or []
            queued = m.get("queued_hosted")
            lines.append(
                f"    host busy ms/expert {_fmt(m.get('host_busy_ms_per_expert'))} by repeat "
                f"[{', '.join(_fmt(x) for x in by_rep)}]"
                + ("" if queued is None else f" queued-hosted {_fmt(queued, '.0f')}")
            )
            lines.append(
                f"    plan {m.get('host_plan')} from {m.get('host_ahead_from')} "
                f"gate {_gate(m.get('ahead_gate'))} "
                f"host-part {m.get('host_control')} on {_fmt(m.get('host_part_on_fraction'))} "
                f"lookahead-split {m.get('lookahead_split')}: {_reasons(m.get('plan_reasons'))}"
            )
    return lines


def _gate(gate: Any) -> str:
    """An arm's pre-verify gate for the table: ``>=SHARE open/closed``."""
    if not isinstance(gate, dict):
        return "-"
    shares = ",".join(f"{v:g}" for v in gate.get("min_exposed", []))
    return f">={shares} {gate.get('open')}/{gate.get('closed')}"


def run_diag(args: argparse.Namespace, arch: str) -> dict[str, Any]:
    """The executor diagnostic on ``arch``'s target, loaded as the runs load
    it (so they reuse it)."""
    from pdflash.bench.engine_run import RunSpec, load_target, synthetic_paths

    from pdflash.serve.build import resolve_device

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from diag_host_experts import diagnose  # type: ignore[import-not-found]

    spec = RunSpec(
        arch=arch,
        baseline="PD",
        layers=args.layers or None,
        synthetic_format=args.synthetic_format,
        expert_dtype=args.expert_dtype,
    )
    device = resolve_device(spec.device)
    t0 = time.perf_counter()
    path, _, dtype = synthetic_paths(spec, device)
    ad = load_target(path, device, dtype, spec.expert_dtype)
    load_s = time.perf_counter() - t0
    # cold: walk more expert bytes than the CPU's last-level cache holds
    experts = args.diag_experts or max(8, math.ceil(args.diag_bytes / ad.store.expert_nbytes))
    out = diagnose(
        ad,
        tokens=[1, 4, 16],
        formats=["packed", "out_in", "onednn", "fp32_out_in"],
        experts=experts,
        repeats=3,
        sections=[s for s in args.diag_sections.split(",") if s],
        link_load=device.type == "cuda",
        head={"arch": arch, "layers": args.layers, "load_s": round(load_s, 1)},
    )
    print(
        f"[issue16] diag done in {time.perf_counter() - t0:.0f}s (load {load_s:.0f}s)",
        file=sys.stderr,
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    from pdflash.bench.suites.engine import add_host_switch_arguments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers (0: the shape's own)")
    ap.add_argument("--cache", default="0.2,0.5")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument(
        "--points",
        default="",
        help="explicit cache:concurrency pairs, e.g. 0.5:1,0.2:4 (instead of --cache x --concurrency)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="replay a proxy trace's learned routing and acceptance (RunSpec routing_source and "
        "acceptance 'trace'; rows say so) instead of synthetic routing and forced acceptance",
    )
    ap.add_argument(
        "--closed",
        type=int,
        default=None,
        metavar="N",
        help="a closed loop of N requests per client (the point's concurrency is the clients) "
        "instead of one burst of as many requests as the concurrency",
    )
    ap.add_argument("--host-threads", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--host-workers", type=int, default=1)
    ap.add_argument("--host-max-ratio", type=float, default=1.5)
    ap.add_argument("--host-max-tokens", type=int, default=16, help="0: no cap")
    ap.add_argument("--host-format", default="auto")
    ap.add_argument(
        "--host-critical-path",
        action="store_true",
        help="the planner judges the forward's critical path (RunSpec.host_critical_path)",
    )
    ap.add_argument(
        "--host-queued",
        action="store_true",
        help="the planner may host experts whose copy is still queued (RunSpec.host_queued)",
    )
    ap.add_argument(
        "--host-job-term",
        action="store_true",
        help="the host calibration's fixed cost per HOST job (RunSpec.host_job_term)",
    )
    add_host_switch_arguments(ap)
    ap.add_argument("--synthetic-format", default=None, choices=(None, "mxfp4"))
    ap.add_argument("--expert-dtype", default=None, choices=(None, "dense"))
    ap.add_argument("--diag", action="store_true", help="time the executor first")
    ap.add_argument("--diag-experts", type=int, default=0, help="0: --diag-bytes' worth")
    ap.add_argument("--diag-bytes", type=float, default=1.6e9, help="expert bytes walked cold")
    ap.add_argument("--diag-sections", default="paths", help="diag_host_experts.py --sections")
    ap.add_argument("--budget-s", type=float, default=250.0)
    ap.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help="NAME=BASELINE[:SETTING=VALUE...],... (module doc); default: the presets and "
        "PD-all-on without and with the host part, each warmed and with CUDA graph pieces",
    )
    ap.add_argument(
        "--reference",
        default=None,
        help="the arm every other arm is compared with (default: the first PD+host arm)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    archs = [a for a in args.archs.split(",") if a]
    caches = [float(c) for c in args.cache.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    points = [(cf, conc) for cf in caches for conc in concs]
    if args.points:
        points = [
            (float(p.split(":")[0]), int(p.split(":")[1])) for p in args.points.split(",") if p
        ]
    if args.closed is not None and args.closed < 1:
        ap.error(f"--closed needs at least one request per client, got {args.closed}")
    # what every arm shares (an arm's overrides beat these)
    base: dict[str, Any] = {
        "block_size": 16,
        "layers": args.layers or None,
        "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len,
        "host_threads": args.host_threads,
        "host_workers": args.host_workers,
        "host_max_ratio": args.host_max_ratio,
        "host_max_tokens": args.host_max_tokens,
        "host_format": args.host_format,
        "host_critical_path": args.host_critical_path,
        "host_queued": args.host_queued,
        "host_job_term": args.host_job_term,
        "host_handoff": args.host_handoff,
        "host_affinity": args.host_affinity,
        "host_ahead": args.host_ahead,
        "host_ahead_from": args.host_ahead_from,
        "host_ahead_min_exposed": args.host_ahead_min_exposed,
        "host_control": args.host_control,
        "synthetic_format": args.synthetic_format,
        "expert_dtype": args.expert_dtype,
    }
    if args.trace is not None:
        base.update(routing_source="trace", acceptance="trace", trace=str(args.trace))

    def at_point(cf: float, conc: int) -> dict[str, Any]:
        """A point's settings: the cache, and the clients (a closed loop's)
        or the burst's requests."""
        out: dict[str, Any] = {"cache_fraction": cf, "concurrency": conc}
        if args.closed is not None:
            out.update(arrivals="closed", users=conc, num_requests=args.closed * conc)
        return out

    # every arm checked before anything runs (or loads)
    try:
        arms = parse_arms(args.arms)
        for cf, conc in points:
            check_arms(arms, {**base, **at_point(cf, conc)}, archs)
        if args.reference is not None and args.reference not in {a.name for a in arms}:
            raise ValueError(
                f"--reference {args.reference!r} is not an arm; one of {[a.name for a in arms]}"
            )
    except ValueError as exc:
        ap.error(str(exc))

    import torch
    from pdflash.bench.engine_run import RunSpec, release_targets, run_spec

    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    torch.set_num_threads(args.host_threads)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    cut = 0
    diag: dict[str, Any] | None = None
    if args.diag and archs:
        try:
            diag = run_diag(args, archs[0])
        except Exception as exc:  # the runs matter more: report and go on
            diag = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[issue16] diag FAILED: {exc}", file=sys.stderr, flush=True)
    for ai, arch in enumerate(archs):
        # each arch may use its share of what is left of the budget
        arch_deadline = started + args.budget_s * (ai + 1) / len(archs)
        for rep in range(args.repeats):
            for pi, (cf, conc) in enumerate(points):
                for arm in arm_order(arms, rep, pi):
                    if time.perf_counter() > arch_deadline:
                        cut += 1
                        continue
                    spec = RunSpec(
                        **arm_spec_kwargs(
                            {**base, "arch": arch, **at_point(cf, conc), "repeat": rep},
                            arm,
                        )
                    )
                    t0 = time.perf_counter()
                    try:
                        row = run_spec(spec).row
                    except Exception as exc:  # one failure must not lose the rest
                        errors.append(
                            {
                                "arm": arm.name,
                                "spec": vars(spec),
                                "error": f"{type(exc).__name__}: {exc}",
                            }
                        )
                        print(
                            f"[issue16] FAILED {arch} {arm.name} cf{cf} c{conc} r{rep}: {exc}",
                            file=sys.stderr,
                            flush=True,
                        )
                        continue
                    row["arm"] = arm.name
                    row["arm_settings"] = arm.overrides()
                    row["run_elapsed_s"] = time.perf_counter() - t0
                    rows.append(row)
                    with rows_path.open("a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
                    print(
                        f"[issue16] {arch} {arm.name} cf{cf} c{conc} r{rep}: "
                        f"tok/s={row['output_tokens_per_s']:.1f} "
                        f"B/tok={row.get('bytes_per_token') or 0:.3g} "
                        f"host={row.get('host_served_experts')} "
                        f"({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - started:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
        release_targets()
    calibrations = {
        r["arch"]: (r.get("host_service") or {}).get("calibration") for r in rows if _service(r)
    }
    host_weights = {
        r["arch"]: (r.get("host_service") or {}).get("host_weights") for r in rows if _service(r)
    }
    # per run with a host service: what the planner started from and ended with
    host_runs = []
    for r in rows:
        hs = r.get("host_service") or {}
        if not hs:
            continue
        cal = hs.get("calibration") or {}
        hw = hs.get("host_weights") or {}
        host_runs.append(
            {
                "arm": _arm_of(r),
                "concurrency": r["concurrency"],
                "cache_fraction": r["cache_fraction"],
                "repeat": r["repeat"],
                "tokens_per_s": r.get("output_tokens_per_s"),
                "host_served_experts": r.get("host_served_experts"),
                "calibration_points": cal.get("points"),
                "calibration_spread": cal.get("spread"),
                "online_cost": hs.get("online_cost"),
                "planner_decisions": hs.get("planner_decisions"),
                "critical_path": hs.get("critical_path"),
                "copy_sampled": hs.get("copy_sampled_layers"),
                # the ahead plans' HOST experts: seen by their layers, routed, hosted
                "ahead_outcome": hs.get("ahead_outcome"),
                # the planner's routed fraction of those over the run
                "ahead_fraction": hs.get("ahead_fraction"),
                "host_part_on_fraction": _part_on(r, "host_experts"),
                "host_weights_reused": hw.get("reused"),
            }
        )
    summary = {
        "suite": "issue16",
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_count": os.cpu_count(),
        "torch_intra_op_threads": torch.get_num_threads(),
        # the settings every arm shares (host_*, synthetic_format, expert_dtype)
        **{
            k: v
            for k, v in base.items()
            if k.startswith("host_") or k.endswith(("_format", "_dtype"))
        },
        "arms": [a.to_json() for a in arms],
        "layers": args.layers,
        "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len,
        # learned routing and acceptance replayed (None: synthetic, forced)
        "trace": None if args.trace is None else str(args.trace),
        "closed_requests_per_client": args.closed,
        "repeats_requested": args.repeats,
        "runs": len(rows),
        "runs_not_started_budget": cut,
        "errors": errors,
        "elapsed_s": time.perf_counter() - started,
        "host_calibration": calibrations,
        "host_weights": host_weights,
        "host_runs": host_runs,
        "diag": diag,
        "points": summarise(rows, arms, args.reference),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for line in table(summary):
        print(line, file=sys.stderr)
    print(json.dumps(summary, default=str))
    return 1 if errors or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
