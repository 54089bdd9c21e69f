"""The result-row schema of docs/design.md §6 and its validation.

A *row* is one engine run: one (arch, baseline, block size, concurrency,
cache fraction, repeat, workload) and one value of each of
:data:`RUN_SETTINGS`: see :func:`row_key`; rows recorded before rows named
their workload count as bursts. It is a flat JSON object: identity fields say what
was run and where its inputs came from; metric fields are either a finite
non-negative number or ``null`` with the reason under
``row["not_measured"][name]`` (the convention of :mod:`pdflash.metrics`).

:func:`validate_row` checks one row, :func:`validate_rows` a whole result set
(adds duplicate keys and missing baselines). Both return a list of problems
(human-readable, each naming the row and field); an empty list means valid.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# the labels a run may record (BASELINES) and PD's ablations among them
# (labels of their own, so their rows never count as PD's)
from pdflash.labels import ABLATIONS as ABLATIONS
from pdflash.labels import BASELINES as BASELINES

SCHEMA_VERSION = 1

#: Labels no run records any more whose rows a result set may still hold:
#: ``PD-adaptive-width`` is PD at the adaptive verify width, recorded while
#: PD's preset verified every draft (PD's configuration of today). Rows of
#: them validate and are reported under their own label.
RETIRED_LABELS: tuple[str, ...] = ("PD-adaptive-width",)

#: Every label a row may carry: :data:`BASELINES`, then :data:`RETIRED_LABELS`.
ROW_LABELS: tuple[str, ...] = (*BASELINES, *RETIRED_LABELS)

#: Labels that predict nothing (route-ahead coverage from them is vacuous).
NO_ROUTE_AHEAD: frozenset[str] = frozenset({"B0", "B1", "B2", "B3", "PD-no-route-ahead"})

#: The baselines a result set must cover unless told otherwise (``PD+host``
#: is optional: rows of it are validated when present).
REQUIRED_BASELINES: tuple[str, ...] = ("B0", "B1", "B2", "B3", "PD")

#: Identity fields every row carries, with the Python types allowed.
IDENTITY_FIELDS: dict[str, tuple[type, ...]] = {
    "arch": (str,),
    "baseline": (str,),
    "weights_source": (str,),
    "acceptance_source": (str,),
    "acceptance_params": (dict,),
    "routing_source": (str,),
    "device": (str,),
    "link_gbps_measured": (int, float, type(None)),
    "block_size": (int,),
    "concurrency": (int,),
    "cache_fraction": (int, float),
    "repeat": (int,),
    "seed": (int,),
}

#: Metrics every row carries (a number, or null with a reason).
METRIC_FIELDS: tuple[str, ...] = (
    "output_tokens_per_s",
    "acceptance_length_mean",
    "ttft_p50_s",
    "ttft_p99_s",
    "round_latency_p50_s",
    "round_latency_p99_s",
    "goodput_rps",
    "expert_cache_hit_rate",
    "routeahead_coverage",
    "routeahead_precision",
    "wasted_prefetch_bytes",
    "exposed_fetch_s",
    "h2d_bytes",
    "h2d_overlap_fraction",
    "expert_occupancy_bytes",
    "kv_occupancy_bytes",
    "scheduler_us_per_step",
    "eta",
    "compute_busy_s",
    "link_busy_s",
    "wall_s",
    "link_busy_fraction",
    "useful_byte_fraction",
    "committed_tokens",
    "bytes_per_token",
    # NOTE: required (the engine's row builder always adds it): the vacuous
    # coverage / hit-rate checks and the hide inequality depend on it
    "routed_expert_bytes",
)

#: The hybrid miss service's books (pdflash.hybrid), in every engine row.
HOST_METRIC_FIELDS: tuple[str, ...] = (
    "host_served_experts",
    "host_tokens",
    "host_compute_s",
    "host_busy_s",
    "host_wait_s",
    "host_busy_fraction",
    "link_bytes_saved",
    "link_bytes_saved_per_token",
    "host_planned_ahead_experts",
)

#: Optional numeric fields: validated when present (the Belady and
#: routing-trace figures; an engine may add the hide-window terms).
OPTIONAL_METRIC_FIELDS: tuple[str, ...] = (
    "trace_forward_layers",
    "initial_resident_experts",
    "cache_slots",
    "expert_nbytes",
    "belady_bytes",
    "belady_bytes_per_token",
    "belady_free_start_bytes",
    "bytes_per_token_vs_belady",
    "draft_busy_s",
    "router_busy_s",
    "verify_overlap_window_s",
    "slo_s",
    # serving workloads: per-request latency beyond TTFT, and how the 2-D
    # scheduler's batches differed from the token-only scheduler's
    "tpot_p50_s",
    "tpot_p99_s",
    "queue_delay_p50_s",
    "queue_delay_p99_s",
    "token_only_differing_step_fraction",
    "batch_missing_bytes_2d",
    "batch_missing_bytes_token_only",
    # the scheduled steps a deficit batcher granted whole without its scheduler
    "uncontended_step_fraction",
    "byte_budget_verify_compute_s",
    "fixed_step_bytes",
    "fixed_step_compute_s",
    "fixed_step_bytes_final",
    # the hybrid miss service's books (null with a reason when it is off)
    *HOST_METRIC_FIELDS,
    "eta_phys",
    "miss_floor_s",
    # the part of expert_cache_hit_rate whose copy had landed before the
    # forward asked (a hit on a copy still in flight waits for it)
    "expert_cache_landed_hit_rate",
    "expert_cache_inflight_hits",
    # exposed_fetch_s split: the waits for prefetches not landed yet, then
    # the extra waits for copies issued on demand for misses
    "exposed_fetch_miss_s",
    "exposed_fetch_inflight_s",
    # the part of exposed_fetch_inflight_s on prefetches still queued (no
    # chunk started) when the forward asked
    "exposed_fetch_queued_s",
)

#: Metrics that are fractions and must lie in [0, 1].
FRACTION_FIELDS: frozenset[str] = frozenset(
    {
        "expert_cache_hit_rate",
        "expert_cache_landed_hit_rate",
        "routeahead_coverage",
        "routeahead_precision",
        "h2d_overlap_fraction",
        "eta",
        "link_busy_fraction",
        "useful_byte_fraction",
        "token_only_differing_step_fraction",
        "uncontended_step_fraction",
        "host_busy_fraction",
    }
)

#: Numbers that are counts and must be whole.
INTEGER_FIELDS: frozenset[str] = frozenset(
    {
        "committed_tokens",
        "cache_slots",
        "expert_nbytes",
        "trace_forward_layers",
        "initial_resident_experts",
        "host_served_experts",
        "host_tokens",
        "host_planned_ahead_experts",
        "expert_cache_inflight_hits",
    }
)

# A ratio measured from busy times may round a hair over 1.
_FRACTION_SLACK = 1e-6


def workload_label(row: Mapping[str, Any]) -> str:
    """The arrival process a row ran, as a short label: ``burst`` (every
    request at t = 0: the fixed-concurrency runs, and every row recorded
    before rows carried a ``workload``), ``poisson 2/s`` or ``closed 8u
    think 0.5s``. Rows of one point but different labels (a rate sweep) are
    different points, never duplicates."""
    w = row.get("workload")
    if not isinstance(w, Mapping):
        return "burst"
    arrivals = w.get("arrivals", "burst")
    if arrivals == "poisson":
        rate = w.get("rate_per_s")
        return f"poisson {rate:g}/s" if isinstance(rate, (int, float)) else "poisson"
    if arrivals == "closed":
        think = w.get("think_s") or 0.0
        return f"closed {w.get('users')}u think {think:g}s"
    return str(arrivals)


def arch_label(row: Mapping[str, Any]) -> Any:
    """The architecture a row ran, with its depth where the row records it
    (``gpt-oss-20b L24``): a truncation is a different model, so its rows
    never merge with the full depth's (rows without ``layers`` keep the bare
    arch name). An expert-parallel row adds its GPU count (``gpt-oss-20b L8
    x2 GPUs``): N links are a different machine, never merged with one GPU's."""
    arch = row.get("arch")
    layers = row.get("layers")
    label = arch
    if isinstance(layers, int) and not isinstance(layers, bool):
        label = f"{arch} L{layers}"
    gpus = row.get("gpus")
    if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 1:
        label = f"{label} x{gpus} GPUs"
    return label


def _recorded(field: str, key: str | None = None) -> Callable[[Mapping[str, Any]], Any]:
    """A reader of what an engine row records a setting ran as: the row's
    ``field`` (or its ``field[key]`` where the row records a dict)."""

    def read(row: Mapping[str, Any]) -> Any:
        value = row.get(field)
        if key is not None:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    return read


#: Labels whose ``auto`` verify width is ``adaptive``: PD, PD+host and PD's
#: ablations but ``PD-full-width``, and the retired ``PD-adaptive-width``
#: (mirrors :meth:`pdflash.engine.config.EngineConfig.preset`, checked by a
#: test, without importing the engine); every other label verifies every
#: draft. Rows of PD recorded while its preset was ``full`` name the width
#: in their spec or record it (``verify_width.setting``), so they are read
#: as ``full`` still (:data:`RUN_SETTINGS`).
ADAPTIVE_WIDTH_LABELS: frozenset[str] = frozenset(
    b for b in ROW_LABELS if b.startswith("PD") and b != "PD-full-width"
)


#: Labels whose preset runs PD's route-ahead stream (mirrors
#: :meth:`pdflash.engine.config.EngineConfig.preset`'s ``streaming_prefetch``,
#: checked by a test, without importing the engine): only their runs read
#: the ``stream_ahead`` setting.
STREAM_LABELS: frozenset[str] = frozenset(
    {"PD", "PD+host", "PD-all-on", "PD-one-band", "PD-token-sched", "PD-full-width"}
)


#: Labels whose preset predicts a verify's experts (mirrors
#: :meth:`pdflash.engine.config.EngineConfig.preset`'s ``route_ahead``,
#: checked by a test): only their runs read the ``route_ahead_horizon`` setting.
ROUTE_AHEAD_LABELS: frozenset[str] = STREAM_LABELS | {"PD-no-stream"}


#: Labels whose preset runs PD's parts under the PD controller (mirrors
#: :meth:`pdflash.engine.config.EngineConfig.preset`'s ``parts_controller``,
#: checked by a test): only their runs read the ``controller_warmup`` setting.
CONTROLLER_LABELS: frozenset[str] = frozenset({"PD", "PD+host", "PD-full-width"})

#: ``controller_warmup`` values: ``off`` (the warm-up as the ``warmup``
#: setting runs it) or ``first_round`` (after it, more workload bursts
#: outside the clock until the PD controller has ended its first round of
#: probes, as a server's engine has after its first steps).
CONTROLLER_WARMUPS: tuple[str, ...] = ("off", "first_round")

#: ``warm_bursts`` at most (workload bursts after the warm-up, any label; a
#: burst is one warm-up's workload)
MAX_WARM_BURSTS = 32


def resolved_width(width: str, baseline: str) -> str:
    """The verify width a label runs at for a requested ``width``: ``auto``
    is the label's preset (``adaptive`` for :data:`ADAPTIVE_WIDTH_LABELS`,
    PD's included, ``full`` for the rest); B0 drafts nothing, so it is
    always ``full``; any other width is itself."""
    if baseline == "B0":
        return "full"
    if width != "auto":
        return width
    return "adaptive" if baseline in ADAPTIVE_WIDTH_LABELS else "full"


@dataclass(frozen=True)
class RunSetting:
    """One setting beyond the point and the repeat that defines a run.

    ``name`` is the :class:`pdflash.bench.engine_run.RunSpec` field (a spec
    that omits it runs with ``default``); ``in_spec`` is False for a
    process-wide mode no spec carries (the row alone records it).
    ``recorded`` reads what a row says the setting ran as, for rows without
    a spec. ``resolve`` maps a spec's value to the value the run runs at
    where a spec may name it indirectly (``auto``), so two specs that run
    alike are one run and two that do not are two. ``omitted`` reads what a
    recorded row ran with where its spec does not say (no spec, or one
    recorded before specs named the setting, whose run did not necessarily
    use today's default); None: ``recorded``, else the default. ``refine``
    maps the value :meth:`of_row` read to the value the run ran at where the
    row says more than its setting (a default that has since changed).
    ``read_where`` says whether a spec's run reads the setting at all; one
    that does not (the part that reads it does not run) runs as the default,
    whatever the spec names.
    """

    name: str
    default: Any
    recorded: Callable[[Mapping[str, Any]], Any] | None = None
    in_spec: bool = True
    resolve: Callable[[Any, Mapping[str, Any]], Any] | None = None
    omitted: Callable[[Mapping[str, Any]], Any] | None = None
    refine: Callable[[Any, Mapping[str, Any]], Any] | None = None
    read_where: Callable[[Mapping[str, Any]], bool] | None = None

    def of_spec(self, spec: Mapping[str, Any]) -> Any:
        """The setting of a run by its spec (the matrix's resume key)."""
        value = spec.get(self.name, self.default)
        if self.read_where is not None and not self.read_where(spec):
            value = self.default
        if self.resolve is not None:
            value = self.resolve(value, spec)
        # a number given as an int or a float is one setting
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and isinstance(self.default, float)
        ):
            return float(value)
        return value

    def of_row(self, row: Mapping[str, Any]) -> Any:
        """The setting of a recorded run: its spec's where the row carries the
        spec (the matrix's rows: the very value its resume key keyed, in the
        same terms whichever code version recorded the row), except that a
        setting with ``omitted`` the spec does not name reads ``omitted``;
        else what the row records it ran as, else the default; then
        ``refine``."""
        value = self._row_value(row)
        return value if self.refine is None else self.refine(value, row)

    def _row_value(self, row: Mapping[str, Any]) -> Any:
        spec = row.get("spec")
        if (
            self.in_spec
            and isinstance(spec, Mapping)
            and (self.omitted is None or self.name in spec)
        ):
            return self.of_spec(spec)
        if self.omitted is not None:
            return self.omitted(row)
        if self.recorded is not None:
            value = self.recorded(row)
            if value is not None:
                return value
        return self.default


def _spec_width(width: Any, spec: Mapping[str, Any]) -> Any:
    """A spec's verify width as the width its run runs at."""
    if not isinstance(width, str):
        return width
    return resolved_width(width, str(spec.get("baseline")))


#: how an ``adaptive`` width without ``beta=`` charges a further modeled link
#: second (mirrors :attr:`pdflash.engine.verify_width.AdaptiveWidth.BETA_MODE`,
#: checked by a test, without importing the engine)
ADAPTIVE_BETA_DEFAULT = "hinge"
#: whether an ``adaptive`` width without ``voi=`` skips the due explorations
#: that could not pay (mirrors :attr:`pdflash.engine.verify_width.AdaptiveWidth.EXPLORE_VOI`,
#: checked by a test)
ADAPTIVE_VOI_DEFAULT = True
#: whether an ``adaptive`` width without ``cost=`` stands down where its own
#: host time exceeds what it saves (mirrors
#: :attr:`pdflash.engine.verify_width.AdaptiveWidth.COST_GATE`, checked by a test)
ADAPTIVE_COST_DEFAULT = True
#: the ``adaptive:`` options in the order the width's parser writes them
#: (mirrors :data:`pdflash.engine.verify_width.ADAPTIVE_OPTION_KEYS`, checked
#: by a test)
_OPTION_ORDER = ("shrink", "z", "cal", "union", "beta", "row", "explore", "reach", "voi", "cost")


def _unnamed_option(
    width: Any, row: Mapping[str, Any], key: str
) -> tuple[list[str], Mapping[str, Any]] | None:
    """``(the width's parts, the row's recorded estimates)`` where ``width``
    is an ``adaptive`` width naming no ``key=`` and the row's policy recorded
    its estimates; None otherwise (nothing to name: another width, the
    option named, or no policy ran, e.g. switched to full)."""
    if not isinstance(width, str):
        return None
    parts = width.split(":")
    if parts[0] != "adaptive" or any(p.startswith(f"{key}=") for p in parts[1:]):
        return None
    recorded = row.get("verify_width")
    estimates = recorded.get("estimates") if isinstance(recorded, Mapping) else None
    return (parts, estimates) if isinstance(estimates, Mapping) else None


def _with_option(parts: list[str], key: str, value: str) -> str:
    """The ``adaptive`` width of ``parts`` with ``key=value`` written where
    the width's parser writes it (before the first named option it writes
    later)."""
    later = _OPTION_ORDER[_OPTION_ORDER.index(key) + 1 :]
    at = next((i for i, p in enumerate(parts) if i and p.split("=")[0] in later), len(parts))
    return ":".join([*parts[:at], f"{key}={value}", *parts[at:]])


def _width_charge(width: Any, row: Mapping[str, Any]) -> Any:
    """An ``adaptive`` width that names no ``beta=``, of a row whose policy
    charged a further link second otherwise than today's default (rows
    recorded before ``hinge`` became it: ``estimates.beta_mode``, absent
    where only ``average`` existed), as the width that charge is named by
    today, e.g. ``adaptive:beta=average``: so such a run is not one with
    today's ``adaptive``. Any other width is itself."""
    found = _unnamed_option(width, row, "beta")
    if found is None:
        return width
    parts, estimates = found
    mode = estimates.get("beta_mode") or "average"
    if mode == ADAPTIVE_BETA_DEFAULT:
        return width
    return _with_option(parts, "beta", mode)


def _width_voi(width: Any, row: Mapping[str, Any]) -> Any:
    """An ``adaptive`` width that names no ``voi=``, of a row whose policy
    ran its explorations otherwise than today's default (rows recorded
    before ``voi`` became it: ``estimates.explore_voi`` absent or false), as
    ``...:voi=0`` (where the width's parser writes it): such a run is not
    one with today's ``adaptive``. A width that never
    explores (``explore=0``: the rule has nothing to judge) and any other
    width are themselves."""
    found = _unnamed_option(width, row, "voi")
    if found is None or "explore=0" in found[0][1:]:
        return width
    parts, estimates = found
    ran = bool(estimates.get("explore_voi"))
    if ran is ADAPTIVE_VOI_DEFAULT:
        return width
    return _with_option(parts, "voi", str(int(ran)))


def _width_cost(width: Any, row: Mapping[str, Any]) -> Any:
    """An ``adaptive`` width that names no ``cost=``, of a row whose policy
    never stood down for its own host time (rows recorded before the cost
    gate became the default: ``estimates.cost_gate`` absent or false), as
    ``...:cost=0`` (where the width's parser writes it):
    such a run is not one with today's ``adaptive``. Any other width is
    itself."""
    found = _unnamed_option(width, row, "cost")
    if found is None:
        return width
    parts, estimates = found
    ran = bool(estimates.get("cost_gate"))
    return width if ran is ADAPTIVE_COST_DEFAULT else _with_option(parts, "cost", str(int(ran)))


def _width_refined(width: Any, row: Mapping[str, Any]) -> Any:
    """A row's ``adaptive`` width with the defaults it ran under named where
    they differ from today's (:func:`_width_charge`, :func:`_width_voi`,
    :func:`_width_cost`)."""
    return _width_cost(_width_voi(_width_charge(width, row), row), row)


def _omitted_width(row: Mapping[str, Any]) -> Any:
    """The width of a row whose spec names none (no spec, or recorded before
    the matrix named every width): what the row records it ran at, else
    ``full`` (rows recorded before verify widths existed verified every
    draft)."""
    value = _recorded("verify_width", "setting")(row)
    return "full" if value is None else value


def _omitted_full_cache(row: Mapping[str, Any]) -> Any:
    """The full-cache setting of a row whose spec names none: what the row
    records, else (rows recorded before the setting) ``off`` where the
    cache could hold every expert (an offloaded label at cache fraction 1.0:
    it filled on demand, its prefetch parts on) and ``auto`` elsewhere (the
    setting changes nothing there)."""
    value = _recorded("full_cache", "setting")(row)
    if value is not None:
        return value
    full = row.get("cache_fraction") == 1.0 and row.get("baseline") != "B3"
    return "off" if full else "auto"


def _marginal_applies(settings: Mapping[str, Any]) -> bool:
    """Whether a run can apply PD's marginal rule: a label that runs the 2-D
    scheduler (not B0-B3, not PD-token-sched) with M calibrated or given (the
    engine calibrates ``F`` only then; at the floor sizing M never binds)."""
    baseline = str(settings.get("baseline", ""))
    if baseline.startswith("B") or baseline == "PD-token-sched":
        return False
    return settings.get("byte_budget_from") == "verify" or settings.get("byte_budget") is not None


def _spec_marginal(value: Any, spec: Mapping[str, Any]) -> Any:
    """A spec's marginal rule as the run runs it: ``off`` and ``verify`` are
    one run where the rule cannot apply."""
    if value == "off" and not _marginal_applies(spec):
        return "verify"
    return value


def _omitted_marginal(row: Mapping[str, Any]) -> Any:
    """The marginal rule of a row whose spec names none: what the row records,
    else ``off`` where the rule could apply (recorded before it existed: M
    hard), resolved as a spec's would be."""
    spec = row.get("spec")
    settings: Mapping[str, Any] = (
        spec
        if isinstance(spec, Mapping)
        else {"baseline": row.get("baseline"), "byte_budget_from": row.get("byte_budget_from")}
    )
    value = row.get("marginal_rule") or "off"
    return _spec_marginal(value, settings)


def _omitted_gemm(row: Mapping[str, Any]) -> Any:
    """The compressed-GEMM mode of a row whose spec names none (no spec, or
    recorded before the matrix named the mode): the mode the row records its
    compressed experts ran in, else ``dequant`` (the only default there was;
    a row of dense experts records none)."""
    value = row.get("compressed_gemm")
    return "dequant" if value is None else value


def _recorded_critical_path(row: Mapping[str, Any]) -> Any:
    """Whether a row's host planner was given the forward's critical-path
    terms: as its host service records, else True for a service that
    measured them before the switch existed (they were always planned
    with), else the default (no host service, or one older than the terms)."""
    service = row.get("host_service")
    if not isinstance(service, Mapping):
        return False
    if "critical_path_planned" in service:
        return bool(service["critical_path_planned"])
    return "critical_path" in service


def _recorded_handoff(row: Mapping[str, Any]) -> Any:
    """The HOST hand-off a row's run asked for: as its host service records,
    else ``thread`` (no host service, or one from before the switch, which
    always ran the thread hand-off)."""
    service = row.get("host_service")
    if not isinstance(service, Mapping):
        return "thread"
    handoff = service.get("host_handoff")
    if isinstance(handoff, Mapping) and handoff.get("requested") is not None:
        return handoff["requested"]
    return "thread"


def _recorded_affinity(row: Mapping[str, Any]) -> Any:
    """Where a row's host threads were placed (``--host-affinity``): as its
    host service records; a host service older than the setting placed
    nothing (``off``); a row without one has no host threads, so it keeps
    the default (its key equals a default run's)."""
    service = row.get("host_service")
    if not isinstance(service, Mapping):
        return "auto"
    placed = service.get("affinity")
    return placed.get("mode", "off") if isinstance(placed, Mapping) else "off"


def _planner_records(row: Mapping[str, Any], key: str, default: Any) -> Any:
    """What a row's host planner records under ``key`` (its host service's
    ``planner``), else ``default`` (no host service, no planner, or none
    recorded)."""
    service = row.get("host_service")
    planner = service.get("planner") if isinstance(service, Mapping) else None
    value = planner.get(key) if isinstance(planner, Mapping) else None
    return default if value is None else value


def _recorded_ahead(row: Mapping[str, Any]) -> Any:
    """How a row's pre-verify host plan treated a predicted expert
    (``--host-ahead``): as its planner records, else ``certain`` (no host
    service, a planner that records none, or one older than the setting:
    the ahead plan was ``certain``)."""
    return _planner_records(row, "ahead", "certain")


def _recorded_plan(row: Mapping[str, Any]) -> Any:
    """How a row's host planner judged a split (the retired ``--host-plan``:
    ``queue`` and ``lag`` rows were recorded before the rules were removed):
    as its planner records, else ``makespan`` (no host service, a planner
    that records none, one older than the setting, or one newer: the only
    rule there is)."""
    return _planner_records(row, "rule", "makespan")


def _recorded_ahead_from(row: Mapping[str, Any]) -> Any:
    """Which copies a row's host pre-verify plan split (``--host-ahead-from``):
    as its host service records, else ``predicted`` (no host service, or one
    older than the setting: the only choice there was)."""
    service = row.get("host_service")
    value = service.get("ahead_from") if isinstance(service, Mapping) else None
    return "predicted" if value is None else value


def _recorded_gate(row: Mapping[str, Any]) -> Any:
    """The exposed-miss share a row's pre-verify host plan needed
    (``--host-ahead-min-exposed``): as the row's gate records, else the
    default (no host service, or a row older than the setting: the engine's
    constant was the default)."""
    gate = row.get("host_ahead_gate")
    value = gate.get("min_exposed") if isinstance(gate, Mapping) else None
    return 0.2 if value is None else value


def _spec_fills_full_cache(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run starts with every expert resident and runs none
    of PD's parts that serve a miss (``full_cache`` ``auto`` at cache 1;
    :func:`pdflash.engine.engine.fills_full_cache` for a built config)."""
    return bool(spec.get("cache_fraction", 0.0) >= 1.0) and spec.get("full_cache", "auto") == "auto"


def _spec_runs_stream(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run streams route-ahead copies: a label with the
    stream (:data:`STREAM_LABELS`) and not a full cache, which runs none of
    the parts that serve a miss. Only such runs read the stream's settings
    (``stream_ahead``, ``lookahead_score``, ``lookahead_tail``)."""
    return spec.get("baseline") in STREAM_LABELS and not _spec_fills_full_cache(spec)


def _spec_runs_route_ahead(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run predicts a verify's experts: a label with
    route-ahead (:data:`ROUTE_AHEAD_LABELS`) and not a full cache."""
    return spec.get("baseline") in ROUTE_AHEAD_LABELS and not _spec_fills_full_cache(spec)


def _spec_runs_router_pass(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run has the route-ahead union's approximate router
    (route-ahead from the ``union`` source): only it reads ``route_ahead_proxy``."""
    return _spec_runs_route_ahead(spec) and spec.get("route_ahead_source", "union") == "union"


def _spec_hosted(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run has a hybrid miss service: PD+host, or another
    label but B3 (every expert resident) with ``host_experts`` on."""
    baseline = spec.get("baseline")
    return baseline == "PD+host" or (baseline != "B3" and spec.get("host_experts", "off") != "off")


def _spec_runs_controller(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run has PD's controller over its parts: a label
    with the controller (:data:`CONTROLLER_LABELS`), not a full cache (which
    runs none of the switchable parts), on one GPU (expert-parallel ranks
    run PD's parts fixed)."""
    return (
        spec.get("baseline") in CONTROLLER_LABELS
        and not _spec_fills_full_cache(spec)
        and (spec.get("gpus") or 1) <= 1
    )


def _spec_gates_route_ahead(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run has PD's route-ahead gate acting, which alone
    reads ``route_ahead_gate``: a label with the controller and route-ahead,
    not a full cache, on one GPU (expert-parallel ranks run PD's parts
    fixed), without a hybrid miss service (whose planner reads the
    predictions too: the gate does not act there)."""
    return _spec_runs_controller(spec) and _spec_runs_route_ahead(spec) and not _spec_hosted(spec)


def _spec_of_row(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """A row's spec, or for a row without one the settings it records that
    say which of PD's parts its run had (label, cache, GPUs, host service)."""
    spec = row.get("spec")
    if isinstance(spec, Mapping):
        return spec
    return {
        "baseline": row.get("baseline"),
        "cache_fraction": row.get("cache_fraction") or 0.0,
        "full_cache": _recorded("full_cache", "setting")(row) or "auto",
        "gpus": row.get("gpus"),
        "host_experts": row.get("host_experts") or "off",
    }


def _refine_route_ahead_gate(value: Any, row: Mapping[str, Any]) -> Any:
    """A row's route-ahead gate as its controller ran it, where the gate
    would act and the row's PD controller recorded its settings: ``off``
    without a gate (recorded before the gate existed, or run with it off),
    ``precision`` with a gate but no cost bound (recorded before the bound
    existed, or run with ``precision``)."""
    if not _spec_gates_route_ahead(_spec_of_row(row)):
        return value
    parts = row.get("pd_parts")
    settings = parts.get("settings") if isinstance(parts, Mapping) else None
    if not isinstance(settings, Mapping):
        return value
    if settings.get("route_ahead_gate") is None:
        return "off"
    if not settings.get("route_ahead_cost_gate", False):
        return "precision"
    return value


def _spec_shadow_checks_route_ahead(spec: Mapping[str, Any]) -> bool:
    """Whether a spec's run has PD's route-ahead gate acting with a gate
    (not ``off``), which alone reads ``route_ahead_shadow_check``."""
    return _spec_gates_route_ahead(spec) and spec.get("route_ahead_gate") != "off"


def _refine_route_ahead_shadow_check(value: Any, row: Mapping[str, Any]) -> Any:
    """A row's shadow check as its controller ran it: a row whose controller
    recorded a route-ahead gate but no ``route_ahead_shadow_check`` setting
    is older than the check (its gated route-ahead was probed at once:
    False)."""
    if not _spec_gates_route_ahead(_spec_of_row(row)):
        return value
    parts = row.get("pd_parts")
    settings = parts.get("settings") if isinstance(parts, Mapping) else None
    if not isinstance(settings, Mapping) or settings.get("route_ahead_gate") is None:
        return value
    return settings.get("route_ahead_shadow_check", False)


def _refine_rest_batching(value: Any, row: Mapping[str, Any]) -> Any:
    """A row's rest batching as its run ran it: a row of a resting
    controller that records none is older than the setting. Those recorded
    since at-rest first-come batching (their ``verify_width`` counts the
    controller's rest steps) ran ``first_come``; older ones batched every
    step with the configured batcher, ``scheduler``."""
    if row.get("rest_batching") is not None:
        return value
    parts = row.get("pd_parts")
    if not (isinstance(parts, Mapping) and parts.get("rest_steps") is not None):
        return value  # no resting controller recorded: the spec's or the default
    width = row.get("verify_width")
    if isinstance(width, Mapping) and "controller_rest_steps" in width:
        return value
    return "scheduler"


def _spec_controller_warmup(value: Any, spec: Mapping[str, Any]) -> Any:
    """A spec's controller warm-up as its run runs it: a label without the
    controller (:data:`CONTROLLER_LABELS`), a full cache that runs none of
    PD's switchable parts, or expert-parallel ranks (their engines run PD's
    parts fixed: ``pdflash.distributed.lockstep.replicated_config``) have no
    probes to settle, so they run ``off``."""
    return value if _spec_runs_controller(spec) else "off"


def _spec_sdpa_backends(value: Any, spec: Mapping[str, Any]) -> Any:
    """A spec's SDPA backends in one spelling (``+`` or ``,``, any case), as
    :func:`pdflash.engine.attention.canonical_sdpa_backends` spells a valid
    one (a test keeps them equal) without importing the engine."""
    if not isinstance(value, str):
        return value
    names = [n.strip() for n in value.lower().replace("+", ",").split(",") if n.strip()]
    return ",".join(names) or "auto"


def _recorded_breakdown(row: Mapping[str, Any]) -> bool:
    """Whether a row's run timed its verify's regions (``--breakdown``):
    its ``verify_breakdown_ms`` is an object exactly then."""
    return isinstance(row.get("verify_breakdown_ms"), Mapping)


def _spec_host_control(value: Any, spec: Mapping[str, Any]) -> Any:
    """A spec's host control as its run runs it: a run without a host
    service (B3, or a label other than PD+host with ``host_experts`` off)
    has no host part, so ``always`` runs as ``controller`` there
    (``RunSpec.engine_config``)."""
    return "controller" if value == "always" and not _spec_hosted(spec) else value


#: Every setting that, beside the point (arch with its depth and GPUs,
#: baseline, block, concurrency, cache fraction, workload) and the repeat,
#: defines a run: the matrix's resume key (:func:`spec_settings`) and the
#: report's row key (:func:`row_key`) both read this one list, so two
#: settings of one label are never one run to either.
RUN_SETTINGS: tuple[RunSetting, ...] = (
    RunSetting("host_experts", "off", _recorded("host_experts")),
    RunSetting("host_format", "auto"),
    RunSetting("host_workers", None),
    RunSetting("host_threads", None),
    RunSetting("host_max_ratio", 1.5),  # pdflash.hybrid.planner.DEFAULT_MAX_HOST_RATIO
    RunSetting("host_max_tokens", 16),  # pdflash.hybrid.planner.DEFAULT_MAX_HOST_TOKENS
    RunSetting("host_critical_path", False, _recorded_critical_path),
    # rows older than the setting never hosted a queued copy
    RunSetting("host_queued", False, _recorded("host_service", "host_queued")),
    # rows older than the setting calibrated without the job term
    RunSetting("host_job_term", False, _recorded("host_service", "host_job_term")),
    RunSetting("host_handoff", "thread", _recorded_handoff),
    RunSetting("host_affinity", "auto", _recorded_affinity),  # pdflash.hybrid.DEFAULT_HOST_AFFINITY
    RunSetting("host_ahead", "certain", _recorded_ahead),
    # retired: no spec carries it any more, old rows still tell their rule
    RunSetting("host_plan", "makespan", _recorded_plan, in_spec=False),
    RunSetting("host_ahead_from", "predicted", _recorded_ahead_from),
    # pdflash.engine.config.DEFAULT_HOST_AHEAD_MIN_EXPOSED
    RunSetting("host_ahead_min_exposed", 0.2, _recorded_gate),
    # pdflash.engine.config.EngineConfig.host_control; rows older than the
    # setting record none: the controller decided
    RunSetting("host_control", "controller", _recorded("host_control"), resolve=_spec_host_control),
    RunSetting("expert_bytes_as", None),
    RunSetting("expert_dtype", None, _recorded("expert_format")),
    RunSetting("synthetic_format", None),
    # the process-wide mode the matrix planned the run under (every spec
    # names it; RunSpec refuses to run in another); rows whose spec does not
    # name it: the mode their compressed experts ran in, else dequant
    RunSetting("compressed_gemm", None, _recorded("compressed_gemm"), omitted=_omitted_gemm),
    RunSetting("routing_source", "model", _recorded("routing_source")),
    RunSetting("route_ahead_source", "union", _recorded("route_ahead_source")),
    # pdflash.engine.predict.ROUTE_AHEAD_PROXIES (a test keeps the default);
    # only the union's approximate router reads it
    RunSetting(
        "route_ahead_proxy",
        "auto",
        _recorded("route_ahead_proxy"),
        read_where=_spec_runs_router_pass,
    ),
    RunSetting("acceptance", "auto"),
    RunSetting("mean_tau", None),
    RunSetting("eviction", "auto", _recorded("eviction_policy")),
    RunSetting("byte_budget_from", "floor"),
    # the marginal rule: one setting where the run cannot apply it; rows
    # recorded before it existed ran with M hard
    RunSetting(
        "marginal_rule",
        "verify",
        _recorded("marginal_rule"),
        resolve=_spec_marginal,
        omitted=_omitted_marginal,
    ),
    RunSetting("max_running", None),
    RunSetting("token_budget", None),
    RunSetting("prompt_len_max", None),
    RunSetting("max_new_tokens_max", None),
    RunSetting("placement", "round_robin"),
    RunSetting("warmup", "auto", _recorded("warmup", "requested")),
    RunSetting("cuda_graphs", "off", _recorded("cuda_graphs", "setting")),
    # recorded all-resident layer calls; rows from before the setting ran
    # with the switch off (its default; no engine run set it)
    RunSetting("resident_graphs", "off", _recorded("resident_graphs", "setting")),
    # the verify's timed regions (CUDA events on the compute stream); rows
    # carry verify_breakdown_ms exactly when their run timed them
    RunSetting("breakdown", False, _recorded_breakdown),
    # pdflash.engine.config.EngineConfig.stream_ahead (a test keeps the
    # defaults equal); a row without the stream, or older than the setting,
    # records none and reads as the default
    RunSetting("stream_ahead", 2, _recorded("stream_ahead"), read_where=_spec_runs_stream),
    # pdflash.engine.config.EngineConfig.lookahead_score (a test keeps the
    # defaults equal); read as stream_ahead is: only a stream's runs use it
    RunSetting(
        "lookahead_score", "prob", _recorded("lookahead_score"), read_where=_spec_runs_stream
    ),
    # pdflash.engine.config.EngineConfig.lookahead_tail (a test keeps the
    # defaults equal); read as lookahead_score is
    RunSetting("lookahead_tail", "skip", _recorded("lookahead_tail"), read_where=_spec_runs_stream),
    # pdflash.engine.config.EngineConfig.route_ahead_horizon (a test keeps
    # the defaults equal); a row without route-ahead, or older than the
    # setting, records none and reads as the default
    RunSetting(
        "route_ahead_horizon",
        "acceptance",
        _recorded("route_ahead_horizon"),
        read_where=_spec_runs_route_ahead,
    ),
    # pdflash.engine.config.EngineConfig.route_ahead_gate (a test keeps the
    # defaults equal); rows whose controller ran without it read "off", and
    # those whose gate had no cost bound "precision"
    RunSetting(
        "route_ahead_gate",
        "precision_cost",
        _recorded("route_ahead_gate"),
        refine=_refine_route_ahead_gate,
        read_where=_spec_gates_route_ahead,
    ),
    # pdflash.engine.config.EngineConfig.route_ahead_shadow_check (a test
    # keeps the defaults equal); read where the gate acts; rows whose gate
    # recorded no shadow check (older than it) read False
    RunSetting(
        "route_ahead_shadow_check",
        False,
        _recorded("route_ahead_shadow_check"),
        refine=_refine_route_ahead_shadow_check,
        read_where=_spec_shadow_checks_route_ahead,
    ),
    # the SDPA backends a run's attention may use (None: the process's
    # PDFLASH_SDPA_BACKENDS, as before the setting); one spelling per set
    RunSetting("sdpa_backends", None, resolve=_spec_sdpa_backends),
    # warm-up bursts until the PD controller ended its first probe round
    # (rows older than the setting record none: their warm-up left the
    # controller where it was, "off")
    RunSetting(
        "controller_warmup",
        "off",
        _recorded("controller_warmup"),
        resolve=_spec_controller_warmup,
    ),
    # pdflash.engine.config.EngineConfig.rest_batching (a test keeps the
    # defaults equal); rows of a resting controller older than at-rest
    # first-come batching read "scheduler"
    RunSetting(
        "rest_batching",
        "first_come",
        _recorded("rest_batching"),
        refine=_refine_rest_batching,
        read_where=_spec_runs_controller,
    ),
    # workload bursts after the warm-up, outside the clock (rows older than
    # the setting ran none)
    RunSetting("warm_bursts", 0, _recorded("warm_bursts")),
    # a cache with a slot for every expert filled before the clock, the
    # prefetch parts off (pdflash.engine.config.EngineConfig.full_cache)
    RunSetting(
        "full_cache",
        "auto",
        _recorded("full_cache", "setting"),
        omitted=_omitted_full_cache,
    ),
    # the width the run verifies at: a spec's ``auto`` (RunSpec's default)
    # resolved for its label, as RunSpec resolves it; rows whose spec names
    # no width: what they recorded running at, else full; an adaptive row's
    # charge and exploration rule named where they differ from today's defaults
    RunSetting(
        "verify_width",
        "auto",
        _recorded("verify_width", "setting"),
        resolve=_spec_width,
        omitted=_omitted_width,
        refine=_width_refined,
    ),
)

#: The settings' values in a spec that omits them.
SETTING_DEFAULTS: dict[str, Any] = {s.name: s.default for s in RUN_SETTINGS}


def spec_settings(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    """A spec's :data:`RUN_SETTINGS` that specs carry (its part of the matrix's
    resume key)."""
    return tuple(s.of_spec(spec) for s in RUN_SETTINGS if s.in_spec)


def recorded_spec_settings(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A recorded row's part of the matrix's resume key: :func:`spec_settings`
    of its spec, each as :meth:`RunSetting.of_row` reads it (so a row whose
    spec omits a setting it ran at a value other than today's default is
    keyed by what it ran at, not as a run of today's default)."""
    return tuple(s.of_row(row) for s in RUN_SETTINGS if s.in_spec)


def row_settings(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A recorded row's :data:`RUN_SETTINGS`, in their order."""
    return tuple(s.of_row(row) for s in RUN_SETTINGS)


def settings_label(row: Mapping[str, Any], names: Iterable[str]) -> str:
    """``name=value`` of the named :data:`RUN_SETTINGS` of a row, in their
    order, comma-separated."""
    wanted = set(names)
    return ", ".join(
        f"{setting.name}={value}"
        for setting, value in zip(RUN_SETTINGS, row_settings(row), strict=True)
        if setting.name in wanted
    )


def series_labels(rows: Iterable[Mapping[str, Any]]) -> dict[int, str]:
    """Per row (by ``id``): its baseline, with the settings that tell its
    rows apart where the set holds more than one setting of that baseline at
    one point, e.g. ``PD [verify_width=adaptive]`` beside ``PD
    [verify_width=full]``; a baseline of one setting per point keeps its bare
    label (a setting that follows the point, e.g. ``max_running`` set from
    the concurrency, pools nothing)."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    by_baseline: dict[str, list[tuple[Mapping[str, Any], tuple[Any, ...]]]] = defaultdict(list)
    for row in rows:
        by_baseline[str(row.get("baseline"))].append((row, row_settings(row)))
    labels: dict[int, str] = {}
    for baseline, members in by_baseline.items():
        at_point: dict[tuple[Any, ...], set[tuple[Any, ...]]] = defaultdict(set)
        for row, values in members:
            at_point[group_key(row)].add(values)
        varying = [
            setting.name
            for i, setting in enumerate(RUN_SETTINGS)
            if any(len({values[i] for values in point}) > 1 for point in at_point.values())
        ]
        for row, _ in members:
            labels[id(row)] = (
                f"{baseline} [{settings_label(row, varying)}]" if varying else baseline
            )
    return labels


def inputs_label(row: Mapping[str, Any]) -> str:
    """Where a row's inputs came from, for its face in every table and plot:
    weights (synthetic | checkpoint), acceptance (model, or forced with its
    mean τ, or replayed), routing, and padded expert bytes where a row says
    so, e.g. ``synthetic weights; acceptance forced τ=4; routing model``."""
    parts = [f"{row.get('weights_source', '?')} weights"]
    acc = str(row.get("acceptance_source", "?"))
    params = row.get("acceptance_params")
    tau = params.get("mean_tau") if isinstance(params, Mapping) else None
    if acc == "forced" and isinstance(tau, (int, float)):
        acc = f"forced τ={tau:.3g}"
    if row.get("draft_source") == "none":
        parts.append("no drafter (autoregressive)")
    else:
        parts.append(f"acceptance {acc}")
    parts.append(f"routing {row.get('routing_source', '?')}")
    padded = row.get("expert_bytes_source")
    if padded not in (None, "", "model", "checkpoint", "stored"):
        parts.append(f"expert bytes {padded}")
    return "; ".join(parts)


def row_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """The identity a row is unique by: (arch with its depth, baseline,
    block, concurrency, cache fraction, repeat, workload label, then every
    :data:`RUN_SETTINGS` value): two settings of one label are two runs."""
    return (
        arch_label(row),
        row.get("baseline"),
        row.get("block_size"),
        row.get("concurrency"),
        row.get("cache_fraction"),
        row.get("repeat"),
        workload_label(row),
        *row_settings(row),
    )


def row_label(row: Mapping[str, Any]) -> str:
    """A short human label, e.g. ``tiny/PD/blk16/c4/cf0.2/r0`` (with
    ``/poisson 2/s`` appended for a workload other than a burst)."""
    arch, baseline, block, conc, cf, rep, load = row_key(row)[:7]
    tail = "" if load == "burst" else f"/{load}"
    return f"{arch}/{baseline}/blk{block}/c{conc}/cf{cf}/r{rep}{tail}"


def point_label(point: tuple[Any, ...]) -> str:
    """A comparison point as text: ``arch/blkB/cC/cfF`` (plus the workload
    when it is not a burst)."""
    arch, block, conc, cf, load = point
    tail = "" if load == "burst" else f"/{load}"
    return f"{arch}/blk{block}/c{conc}/cf{cf}{tail}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: object, problems: list[str], label: str) -> bool:
    """Append a problem unless ``value`` is a finite, non-negative number."""
    if not _is_number(value):
        problems.append(f"{label}: {name} is {value!r}, not a number")
        return False
    assert isinstance(value, (int, float))
    if not math.isfinite(value):
        problems.append(f"{label}: {name} is non-finite ({value!r})")
        return False
    if value < 0:
        problems.append(f"{label}: {name} is negative ({value!r})")
        return False
    if name in FRACTION_FIELDS and value > 1 + _FRACTION_SLACK:
        problems.append(f"{label}: {name} = {value!r} is a fraction above 1")
        return False
    if name in INTEGER_FIELDS and float(value) != math.floor(value):
        problems.append(f"{label}: {name} = {value!r} is not a whole count")
        return False
    return True


def validate_row(row: Mapping[str, Any]) -> list[str]:
    """Problems with one row (empty if valid).

    Checks: identity fields present and typed; the baseline is known; every
    metric present as a finite non-negative number or null with a reason
    (and no reason for a metric that has a value); fractions within [0, 1];
    and vacuous metrics, i.e. a figure reported where nothing it is computed
    from was observed (acceptance with no committed tokens, route-ahead
    coverage or precision from a baseline without route-ahead or a run with
    no routed experts, goodput without an SLO).
    """
    if not isinstance(row, Mapping):
        return [f"row is {type(row).__name__}, not a JSON object"]
    label = row_label(row)
    problems: list[str] = []

    for name, types in IDENTITY_FIELDS.items():
        if name not in row:
            problems.append(f"{label}: missing identity field {name!r}")
            continue
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, types):
            problems.append(f"{label}: identity field {name} = {value!r} has the wrong type")
            continue
        if isinstance(value, str) and not value:
            problems.append(f"{label}: identity field {name} is empty")
    baseline = row.get("baseline")
    if isinstance(baseline, str) and baseline not in ROW_LABELS:
        problems.append(f"{label}: unknown baseline {baseline!r} (expected one of {ROW_LABELS})")
    for name in ("block_size", "concurrency"):
        value = row.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            problems.append(f"{label}: {name} = {value} must be >= 1")
    cf = row.get("cache_fraction")
    if _is_number(cf) and not (0 < cf <= 1):  # type: ignore[operator]
        problems.append(f"{label}: cache_fraction = {cf!r} must be in (0, 1]")
    for name in ("repeat", "seed"):
        value = row.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            problems.append(f"{label}: {name} = {value} must be >= 0")

    reasons = row.get("not_measured", {})
    if not isinstance(reasons, Mapping):
        problems.append(f"{label}: not_measured is {type(reasons).__name__}, not an object")
        reasons = {}

    # link bandwidth is identity but may be unmeasured (e.g. B3 moves nothing)
    link = row.get("link_gbps_measured")
    if "link_gbps_measured" in row:
        if link is None:
            if not reasons.get("link_gbps_measured"):
                problems.append(f"{label}: link_gbps_measured is null without a reason")
        else:
            _check_number("link_gbps_measured", link, problems, label)

    measured: dict[str, float] = {}
    for name in (*METRIC_FIELDS, *OPTIONAL_METRIC_FIELDS):
        if name not in row:
            if name in METRIC_FIELDS:
                problems.append(
                    f"{label}: missing metric {name!r} (null with a reason if unmeasured)"
                )
            continue
        value = row[name]
        if value is None:
            reason = reasons.get(name)
            if not isinstance(reason, str) or not reason.strip():
                problems.append(f"{label}: {name} is null without a reason in not_measured")
            continue
        if name in reasons:
            problems.append(f"{label}: {name} has a value and a not_measured reason")
        if _check_number(name, value, problems, label):
            measured[name] = float(value)
    for name in reasons:
        if name not in row:
            problems.append(f"{label}: not_measured names {name!r}, which the row lacks")

    problems.extend(_vacuous_metrics(row, measured, label))
    return problems


def _vacuous_metrics(
    row: Mapping[str, Any], measured: Mapping[str, float], label: str
) -> list[str]:
    problems: list[str] = []
    committed = measured.get("committed_tokens")
    if "acceptance_length_mean" in measured:
        if committed == 0:
            problems.append(
                f"{label}: acceptance_length_mean reported with no committed tokens (vacuous)"
            )
        elif measured["acceptance_length_mean"] < 1:
            problems.append(
                f"{label}: acceptance_length_mean = {measured['acceptance_length_mean']} < 1 "
                "(a round commits at least one token)"
            )
        block = row.get("block_size")
        # τ counts accepted drafts plus the bonus token, so at most B.
        if isinstance(block, int) and measured["acceptance_length_mean"] > block + _FRACTION_SLACK:
            problems.append(
                f"{label}: acceptance_length_mean = {measured['acceptance_length_mean']} "
                f"exceeds the block size {block}"
            )
    if "output_tokens_per_s" in measured and committed == 0 and measured["output_tokens_per_s"] > 0:
        problems.append(f"{label}: output_tokens_per_s > 0 with no committed tokens")
    for name in ("routeahead_coverage", "routeahead_precision"):
        if name not in measured:
            continue
        if row.get("baseline") in NO_ROUTE_AHEAD:
            problems.append(
                f"{label}: {name} reported for baseline {row.get('baseline')}, "
                "which predicts nothing (vacuous)"
            )
        if measured.get("routed_expert_bytes") == 0:
            problems.append(f"{label}: {name} reported with no routed experts observed (vacuous)")
    if "goodput_rps" in measured and "slo_s" in row and row["slo_s"] is None:
        problems.append(f"{label}: goodput_rps reported without an SLO (vacuous)")
    blocked = row.get("issuer_blocked_wait_s")
    if (
        row.get("issuer_backend") == "host"
        and "exposed_fetch_s" in measured
        and isinstance(blocked, (int, float))
        and not isinstance(blocked, bool)
        and measured["exposed_fetch_s"] < 0.5 * blocked - 1e-3
    ):
        # On the host backend the forward itself blocks in the issuer's wait,
        # so its measured stall cannot be far below the issuer's blocked time.
        problems.append(
            f"{label}: exposed_fetch_s = {measured['exposed_fetch_s']:.4g} s but callers blocked "
            f"{blocked:.4g} s in the issuer's wait: the stall timer missed waits"
        )
    if "expert_cache_hit_rate" in measured and measured.get("routed_expert_bytes") == 0:
        problems.append(f"{label}: expert_cache_hit_rate reported with no routed experts (vacuous)")
    return problems


def group_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """(arch, block, concurrency, cache fraction, workload label): where
    baselines are compared."""
    return (
        arch_label(row),
        row.get("block_size"),
        row.get("concurrency"),
        row.get("cache_fraction"),
        workload_label(row),
    )


def serves(row: Mapping[str, Any], point: tuple[Any, ...]) -> bool:
    """Whether ``row`` is its baseline's entry at comparison ``point``
    (arch, block, concurrency, cache fraction, workload label).

    Two baselines do not depend on every coordinate, so one run serves
    several points: B3 keeps every expert resident (any cache fraction), and
    B0 decodes autoregressively (any block size; the engine may record its
    block as 1). The workload must match always.
    """
    arch, block, conc, cf, load = point
    if arch_label(row) != arch or row.get("concurrency") != conc:
        return False
    if workload_label(row) != load:
        return False
    if row.get("baseline") == "B3":
        return bool(row.get("block_size") == block)
    if row.get("baseline") == "B0":
        return bool(row.get("cache_fraction") == cf)
    return bool(row.get("block_size") == block and row.get("cache_fraction") == cf)


def comparison_points(rows: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """The (arch, block, concurrency, cache fraction, workload) points a
    result set covers: those of its B1, B2, PD and PD-variant rows (or, if
    it has none, of every row)."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    specific = {
        group_key(r)
        for r in rows
        if r.get("baseline") in ("B1", "B2", "PD", "PD+host", *ABLATIONS, *RETIRED_LABELS)
    }
    points = specific or {group_key(r) for r in rows}
    return sorted(points, key=lambda p: tuple(str(x) for x in p))


def validate_rows(
    rows: Sequence[Mapping[str, Any]],
    required_baselines: Iterable[str] = REQUIRED_BASELINES,
) -> list[str]:
    """Problems with a result set: each row's, duplicates, missing baselines.

    Every required baseline must have a row serving each comparison point
    (see :func:`serves`: one B3 row serves every cache fraction, one B0 row
    every block size).
    """
    problems: list[str] = []
    required = tuple(required_baselines)
    unknown = [b for b in required if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown required baseline(s) {unknown}; known: {BASELINES}")
    if not rows:
        return ["no rows"]
    seen: dict[tuple[Any, ...], int] = {}
    for index, row in enumerate(rows):
        problems.extend(f"row {index}: {p}" for p in validate_row(row))
        if isinstance(row, Mapping):
            key = row_key(row)
            if key in seen:
                problems.append(f"row {index}: duplicate of row {seen[key]} ({row_label(row)})")
            else:
                seen[key] = index

    by_baseline: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        if isinstance(row, Mapping):
            by_baseline[str(row.get("baseline"))].append(row)
    for point in comparison_points(rows):
        missing = [b for b in required if not any(serves(r, point) for r in by_baseline.get(b, []))]
        if missing:
            problems.append(f"missing baseline(s) {', '.join(missing)} at {point_label(point)}")
    return problems
