"""Switching PD's machinery off where it does not pay (issue 14's rule).

PD's parts — route-ahead prediction, the 2-D verify scheduler and the
streaming prefetcher — cost host time and can move bytes that go unused; on
some workloads they cost more than the copies they hide. A
:class:`PartsPolicy` is fed one :class:`StepMeasurement` per engine step and
answers which parts run in the next step (:class:`PartsState`).

:class:`PDController` decides by short interleaved A/B windows on tokens
per second (the verify's tokens by default, see ``rate_of``): after a
warm-up it probes one part at a time — ``window`` measured steps as configured (A), ``window`` steps with that part flipped
(B), ``window`` steps back as configured (A') — and votes to flip the part
when B beat both A windows and their mean by more than ``margin`` plus the
two A windows' own disagreement (a per-probe noise estimate), or — for the
prefetching parts (route-ahead, stream) — when the part's own host seconds
per step exceed the exposed fetch seconds per step it removes by more than
``margin`` of a step (or, switched off, fall short of them by as much) and
the rate does not say the opposite beyond ``margin``. A flip needs
``confirm`` consecutive votes for the same part (the part is re-probed at
once), or one probe in which both rules vote; anything else keeps the
configuration. After every part was probed it
holds for ``hold`` steps and probes again, so a part switched off is switched
back on when the workload shifts. Steps that prefilled new requests and the
``settle`` steps after each change are not measured (their wall time is not
the parts'). Every decision carries its numbers (``why``).

Switching a part changes only timing and copies, never tokens: route-ahead
and streaming only prefetch, and the token-only and 2-D schedulers both
grant whole blocks under the same token budget, whose greedy outputs are
the target's greedy tokens whatever the batch (checked by
``tests/engine/test_pd_controller.py``).

The policy is deterministic given its measurements (no clock of its own):
the engine measures (:func:`measure_step`), the policy decides.

Engine side (:func:`attach`, :func:`before_step`, :func:`after_step`): a part
can be switched only if the engine was built with it (a predictor, a
streaming prefetcher, a :class:`~pdflash.engine.batching.ShadowComparison`
batcher whose shadow is the token-only scheduler); parts it lacks stay off
and are never probed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from pdflash.engine.engine import Engine, StepReport

#: parts judged also by cost/benefit (their host time vs the exposed fetch
#: time they remove); the scheduler's cost is in its batches, not host time
COST_BENEFIT_PARTS = frozenset({"stream", "route_ahead"})

#: what a window's tokens per second counts (see :class:`PDController`)
RATES = ("verified", "committed")

#: the switchable parts, in the order they are probed: the stream before
#: route-ahead, because switching route-ahead off stops the stream too (a
#: stream that costs must go off alone, not take route-ahead with it)
PARTS: tuple[str, ...] = ("stream", "route_ahead", "scheduler_2d")


@dataclass(frozen=True)
class PartsState:
    """Which of PD's parts run. ``stream`` needs ``route_ahead`` (the stream
    copies the predictor's plan): with route-ahead off it does not run."""

    route_ahead: bool = True
    scheduler_2d: bool = True
    stream: bool = True

    def on(self, part: str) -> bool:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}; choose one of {PARTS}")
        value: bool = getattr(self, part)
        return value

    def with_part(self, part: str, on: bool) -> PartsState:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}; choose one of {PARTS}")
        return dataclasses.replace(self, **{part: bool(on)})

    def runs(self, part: str) -> bool:
        """Does ``part`` actually run (``stream`` only with route-ahead)?"""
        if part == "stream":
            return self.stream and self.route_ahead
        return self.on(part)

    def masked(self, available: PartsState) -> PartsState:
        """This state with the parts ``available`` lacks switched off."""
        return PartsState(**{p: self.on(p) and available.on(p) for p in PARTS})


ALL_ON = PartsState()


@dataclass(frozen=True)
class StepMeasurement:
    """What one engine step cost and produced.

    Attributes:
        wall_s: the step's wall time.
        committed_tokens: tokens committed by its verify.
        verified_tokens: tokens its verify forward took (anchors + drafts).
        verified: the step ran a verify forward.
        admitted: requests admitted (and prefilled) in the step.
        part_host_s: host seconds spent in each part's own work this step
            (route-ahead: prediction and its copy issue; scheduler_2d: the
            verify scheduler; stream: the streaming prefetcher's stages
            outside the forward). Work inside the forward's hooks is not
            separated from the forward.
        exposed_fetch_s: time the compute waited on expert copies.
        bytes_in: expert bytes copied in (None: the cache does not count).
        prefetch_bytes_in: of which prefetched (None: not counted).
        prefetch_wasted_bytes: prefetched bytes evicted unused (None: not counted).
    """

    wall_s: float
    committed_tokens: int
    verified_tokens: int = 0
    verified: bool = True
    admitted: int = 0
    part_host_s: Mapping[str, float] = field(default_factory=dict)
    exposed_fetch_s: float = 0.0
    bytes_in: int | None = None
    prefetch_bytes_in: int | None = None
    prefetch_wasted_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.wall_s >= 0.0:
            raise ValueError(f"wall_s must be >= 0, got {self.wall_s}")
        for name in ("committed_tokens", "verified_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.admitted < 0:
            raise ValueError(f"admitted must be >= 0, got {self.admitted}")


@runtime_checkable
class PartsPolicy(Protocol):
    """Decides each step which of PD's parts run."""

    @property
    def parts(self) -> PartsState:
        """The parts for the coming step."""
        ...

    def bind(self, available: PartsState) -> None:
        """The parts the engine can switch (the others stay off)."""
        ...

    def observe(self, m: StepMeasurement) -> PartsState:
        """Record one step's measurement; returns the parts for the next step."""
        ...

    def summary(self) -> dict[str, Any]:
        """Decisions so far: fraction of steps each part was on, switches, why."""
        ...

    def reset_stats(self) -> None:
        """Start the books (steps, fractions, switches, decisions) over;
        the decisions' state (which parts run, the probe under way) stays."""
        ...


@dataclass(frozen=True)
class Decision:
    """A probe's outcome. ``switched``: the part was flipped to ``on``."""

    step: int
    part: str
    on: bool
    switched: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Books:
    """Per-step accounting shared by the policies (fractions on, switches)."""

    def __init__(self) -> None:
        self.available = ALL_ON
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.on_steps = dict.fromkeys(PARTS, 0)
        self.switches = 0
        self.decisions: list[Decision] = []

    def count(self, parts: PartsState) -> None:
        self.steps += 1
        for p in PARTS:
            self.on_steps[p] += int(parts.runs(p))

    def summary(self, name: str, parts: PartsState, keep: int) -> dict[str, Any]:
        frac: dict[str, float | None] = {
            p: (self.on_steps[p] / self.steps if self.steps else None) for p in PARTS
        }
        return {
            "policy": name,
            "steps": self.steps,
            "available": {p: self.available.on(p) for p in PARTS},
            "on_fraction": frac,
            "switches": self.switches,
            "at_end": {p: parts.runs(p) for p in PARTS},
            "probes": len(self.decisions),
            # every switch (up to MAX_SWITCHES_KEPT), and the first and last
            # of the other probes' outcomes
            "decisions": [d.as_dict() for d in _kept(self.decisions, keep)],
        }


#: switch decisions a summary lists at most (the first ones)
MAX_SWITCHES_KEPT = 64


def _kept(items: list[Decision], keep: int) -> list[Decision]:
    switches = [d for d in items if d.switched][:MAX_SWITCHES_KEPT]
    others = [d for d in items if not d.switched]
    if len(others) > keep:
        half = keep // 2
        others = others[:half] + others[len(others) - (keep - half) :]
    return sorted(switches + others, key=lambda d: d.step)


class FixedParts:
    """A policy that never switches (``PD-all-on`` and the fixed ablations):
    it only keeps the books, so every PD row records its parts the same way."""

    name = "fixed"

    def __init__(self, parts: PartsState = ALL_ON) -> None:
        self._want = parts
        self._parts = parts
        self._books = _Books()

    @property
    def parts(self) -> PartsState:
        return self._parts

    def bind(self, available: PartsState) -> None:
        self._books.available = available
        self._parts = self._want.masked(available)

    def observe(self, m: StepMeasurement) -> PartsState:
        self._books.count(self._parts)
        return self._parts

    def reset_stats(self) -> None:
        self._books.reset()

    def summary(self) -> dict[str, Any]:
        return self._books.summary(self.name, self._parts, keep=0)


@dataclass
class _Window:
    rate_of: str = "verified"
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    host_s: float = 0.0
    exposed_s: float = 0.0

    def add(self, m: StepMeasurement, part: str) -> None:
        self.steps += 1
        self.tokens += m.verified_tokens if self.rate_of == "verified" else m.committed_tokens
        self.wall_s += m.wall_s
        self.host_s += float(m.part_host_s.get(part, 0.0))
        self.exposed_s += m.exposed_fetch_s

    @staticmethod
    def merged(x: _Window, y: _Window) -> _Window:
        return _Window(
            x.rate_of,
            x.steps + y.steps,
            x.tokens + y.tokens,
            x.wall_s + y.wall_s,
            x.host_s + y.host_s,
            x.exposed_s + y.exposed_s,
        )

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class PDController:
    """PD's parts switched by interleaved A/B windows (module docstring).

    Args:
        window: measured steps per A/B window.
        margin: B must beat the A windows' mean tokens/s by this fraction
            plus their relative disagreement.
        confirm: consecutive votes needed to flip a part.
        warmup: measured steps before the first probe.
        hold: measured steps between probe rounds (re-probing).
        settle: steps not measured after every change of the parts.
        initial: the parts at the start (masked by what the engine has).
        keep_decisions: probe outcomes other than switches kept in
            :meth:`summary` (the first and the last ones; switches are all kept).
        rate_of: the tokens a window's rate counts: ``verified`` (tokens the
            verify forwards took; default) or ``committed``. Committed tokens
            also carry the acceptance draw, which no part changes (route-ahead
            and streaming change no batch; both schedulers fill the same
            token budget) and which, over windows of a few steps, is most of
            the noise; verified tokens per second still shows a scheduler that
            splits batches (more forwards for the same tokens).
    """

    name = "ab-windows"

    def __init__(
        self,
        *,
        window: int = 3,
        margin: float = 0.05,
        confirm: int = 2,
        warmup: int = 2,
        hold: int = 24,
        settle: int = 1,
        initial: PartsState = ALL_ON,
        keep_decisions: int = 16,
        rate_of: str = "verified",
    ) -> None:
        for name, value, low in (
            ("window", window, 1),
            ("confirm", confirm, 1),
            ("warmup", warmup, 0),
            ("hold", hold, 0),
            ("settle", settle, 0),
            ("keep_decisions", keep_decisions, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if rate_of not in RATES:
            raise ValueError(f"rate_of must be one of {RATES}, got {rate_of!r}")
        if not margin >= 0.0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.window = window
        self.margin = float(margin)
        self.confirm = confirm
        self.warmup = warmup
        self.hold = hold
        self.settle = settle
        self.keep_decisions = keep_decisions
        self.rate_of = rate_of
        self._initial = initial
        self._parts = initial
        self._books = _Books()
        self._available = ALL_ON
        # state machine: "hold" (counting down), then per probe "A", "B", "A2"
        self._phase = "hold"
        self._countdown = warmup
        self._settling = 0
        self._queue: list[str] = []
        self._part: str | None = None
        self._votes = 0
        self._win: dict[str, _Window] = {}

    # ------------------------------------------------------------ protocol
    @property
    def parts(self) -> PartsState:
        return self._parts

    def bind(self, available: PartsState) -> None:
        self._available = available
        self._books.available = available
        self._parts = self._initial.masked(available)

    def reset_stats(self) -> None:
        self._books.reset()

    def summary(self) -> dict[str, Any]:
        out = self._books.summary(self.name, self._parts, keep=self.keep_decisions)
        out["settings"] = {
            "window": self.window,
            "margin": self.margin,
            "confirm": self.confirm,
            "warmup": self.warmup,
            "hold": self.hold,
            "settle": self.settle,
            "rate_of": self.rate_of,
        }
        return out

    def observe(self, m: StepMeasurement) -> PartsState:
        self._books.count(self._parts)
        if self._settling > 0:
            self._settling -= 1
            return self._parts
        if not m.verified or m.admitted > 0 or m.wall_s <= 0.0:
            return self._parts  # not the parts' time: not measured
        if self._phase == "hold":
            self._countdown -= 1
            if self._countdown <= 0:
                self._start_round()
            return self._parts
        assert self._part is not None
        self._win[self._phase].add(m, self._part)
        if self._win[self._phase].steps < self.window:
            return self._parts
        if self._phase == "A":
            self._phase = "B"
            self._set(self._parts.with_part(self._part, not self._parts.on(self._part)))
        elif self._phase == "B":
            self._phase = "A2"
            self._set(self._parts.with_part(self._part, not self._parts.on(self._part)))
        else:
            self._judge()
        return self._parts

    # ------------------------------------------------------------ internals
    def _set(self, parts: PartsState) -> None:
        if parts != self._parts:
            self._parts = parts
            self._settling = self.settle

    def _probeable(self) -> list[str]:
        # the stream runs only with route-ahead: probing it without is moot
        return [
            p for p in PARTS if self._available.on(p) and (p != "stream" or self._parts.route_ahead)
        ]

    def _start_round(self) -> None:
        self._queue = self._probeable()
        self._next_probe()

    def _next_probe(self) -> None:
        while self._queue:
            part = self._queue.pop(0)
            if part in self._probeable():
                self._begin(part)
                return
        self._part = None
        self._votes = 0
        self._phase = "hold"
        self._countdown = max(1, self.hold)

    def _begin(self, part: str) -> None:
        self._part = part
        self._phase = "A"
        self._win = {k: _Window(self.rate_of) for k in ("A", "B", "A2")}

    def _judge(self) -> None:
        part = self._part
        assert part is not None
        a, b, a2 = self._win["A"], self._win["B"], self._win["A2"]
        base = 0.5 * (a.rate + a2.rate)
        spread = abs(a.rate - a2.rate) / base if base > 0 else float("inf")
        gain = b.rate / base - 1.0 if base > 0 else 0.0
        now = self._parts.on(part)
        rate_vote = gain > self.margin + spread and b.rate > max(a.rate, a2.rate)
        # cost/benefit (prefetching parts only): the part's own host seconds
        # per step against the exposed fetch seconds it removes; called only
        # where the rate does not say the opposite beyond the margin
        both_a = _Window.merged(a, a2)
        on_w, off_w = (both_a, b) if now else (b, both_a)
        saves = max(0.0, _exposed(off_w) - _exposed(on_w))
        net = _per_step(on_w) - saves  # > 0: costs more than it saves
        wall = on_w.wall_s / on_w.steps if on_w.steps else 0.0
        cb_vote = (
            part in COST_BENEFIT_PARTS
            and wall > 0.0
            and (net > self.margin * wall if now else -net > self.margin * wall)
            and gain >= -self.margin
        )
        vote = rate_vote or cb_vote
        nums = (
            f"{self.rate_of} tokens/s {'on' if now else 'off'} {a.rate:.4g}/{a2.rate:.4g}, "
            f"{'off' if now else 'on'} {b.rate:.4g} (gain {gain:+.3f}, need > "
            f"{self.margin:.3f} + spread {spread:.3f}); host s/step in part "
            f"on {_per_step(on_w):.3g} off {_per_step(off_w):.3g}; "
            f"exposed fetch s/step on {_exposed(on_w):.3g} off {_exposed(off_w):.3g} "
            f"(cost - saving {net:+.3g} s/step, need {'>' if now else '<'} "
            f"{'' if now else '-'}{self.margin * wall:.3g}); "
            f"by {_rules(rate_vote, cb_vote)}"
        )
        step = self._books.steps
        if not vote:
            self._votes = 0
            self._log(Decision(step, part, now, False, f"kept {_word(now)}: {nums}"))
            self._next_probe()
            return
        # both rules agreeing is as strong as `confirm` probes of one
        self._votes = self.confirm if (rate_vote and cb_vote) else self._votes + 1
        if self._votes < self.confirm:
            self._log(
                Decision(
                    step,
                    part,
                    now,
                    False,
                    f"vote {self._votes}/{self.confirm} to switch {_word(not now)}: {nums}",
                )
            )
            self._begin(part)  # re-probe the same part at once
            return
        self._votes = 0
        self._books.switches += 1
        self._set(self._parts.with_part(part, not now))
        why = "costs more than it saves" if now else "pays again"
        self._log(Decision(step, part, not now, True, f"switched {_word(not now)} ({why}): {nums}"))
        self._next_probe()

    def _log(self, d: Decision) -> None:
        self._books.decisions.append(d)


def _rules(rate_vote: bool, cb_vote: bool) -> str:
    if rate_vote and cb_vote:
        return "rate and cost/benefit"
    return "rate" if rate_vote else "cost/benefit" if cb_vote else "neither"


def _word(on: bool) -> str:
    return "on" if on else "off"


def _per_step(w: _Window) -> float:
    return w.host_s / w.steps if w.steps else 0.0


def _exposed(w: _Window) -> float:
    return w.exposed_s / w.steps if w.steps else 0.0


# ---------------------------------------------------------------- engine side
@dataclass
class _Marks:
    """Counter values at a step's start (for the step's deltas)."""

    t0: float = 0.0
    predict_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=dict)
    stall_s: float = 0.0
    sched_n: int = 0
    bytes_in: int | None = None
    prefetch_in: int | None = None
    prefetch_wasted: int | None = None


class EngineParts:
    """The engine's switchable parts: what it was built with, and how a
    :class:`PartsState` is applied to it."""

    def __init__(self, engine: Engine, policy: PartsPolicy) -> None:
        from pdflash.engine.batching import ShadowComparison

        self.engine = engine
        self.policy = policy
        self.full_config = engine.config
        self.stream = engine.prefetch.built_stream
        batcher = engine.batcher
        self.switchable_batcher = (
            batcher
            if isinstance(batcher, ShadowComparison)
            and getattr(batcher.shadow, "name", None) == "deficit_tokens"
            else None
        )
        cfg = engine.config
        self.available = PartsState(
            route_ahead=bool(cfg.route_ahead and engine.predictor is not None),
            scheduler_2d=bool(cfg.batching == "deficit_2d" and self.switchable_batcher is not None),
            stream=self.stream is not None,
        )
        self.applied: PartsState | None = None
        self.marks = _Marks()
        policy.bind(self.available)
        self.apply(policy.parts)

    def apply(self, parts: PartsState) -> None:
        if parts == self.applied:
            return
        eng, cfg = self.engine, self.full_config
        route = parts.route_ahead and self.available.route_ahead
        stream = route and parts.stream and self.stream is not None
        two_d = parts.scheduler_2d and self.available.scheduler_2d
        eng.config = cfg.replace(
            route_ahead=route,
            streaming_prefetch=stream,
            batching=cfg.batching
            if (two_d or not self.available.scheduler_2d)
            else "deficit_tokens",
        )
        # the planner pauses the stream (its plain gate lookahead runs instead)
        eng.prefetch.set_parts(route_ahead=route, stream=stream)
        if not route:
            # nothing predicted any more: no expert stays protected for it,
            # and no expert stays planned for the host from an old prediction
            setter = getattr(getattr(eng.expert_cache, "policy", None), "set_predicted", None)
            if setter is not None:
                setter(np.zeros(0, dtype=np.int64))
            eng.host_ahead = None
            if self.stream is not None:
                self.stream.skip[:] = False
        if self.switchable_batcher is not None:
            self.switchable_batcher.execute_shadow = not two_d
        self.applied = parts


def attach(engine: Engine, policy: PartsPolicy) -> EngineParts:
    """Give ``engine`` a policy over its parts (called by the engine)."""
    return EngineParts(engine, policy)


def _cache_counter(cache: object, name: str) -> int | None:
    value = getattr(cache, name, None)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def before_step(parts: EngineParts) -> None:
    """Apply the policy's parts and mark the counters (start of a step)."""
    eng = parts.engine
    parts.apply(parts.policy.parts)
    cache = eng.expert_cache
    parts.marks = _Marks(
        t0=eng.clock(),
        predict_s=eng.predict_s,
        stage_s=dict(eng.prefetch.stage_s),
        stall_s=eng.timer.stall_s_ready(),
        sched_n=len(eng.scheduler_us),
        bytes_in=_cache_counter(cache, "bytes_in"),
        prefetch_in=_cache_counter(cache, "prefetch_bytes_in"),
        prefetch_wasted=_cache_counter(cache, "prefetch_bytes_evicted_unused"),
    )


def _delta(now: int | None, then: int | None) -> int | None:
    return None if now is None or then is None else now - then


def measure_step(parts: EngineParts, report: StepReport) -> StepMeasurement:
    """The step's measurement from the engine's counters (deltas since
    :func:`before_step`)."""
    eng, mk = parts.engine, parts.marks
    stage = {k: v - mk.stage_s.get(k, 0.0) for k, v in eng.prefetch.stage_s.items()}
    sched_s = sum(eng.scheduler_us[mk.sched_n :]) * 1e-6
    cache = eng.expert_cache
    return StepMeasurement(
        wall_s=max(0.0, eng.clock() - mk.t0),
        committed_tokens=int(report.committed_tokens),
        verified_tokens=int(report.verified_tokens),
        verified=report.verified > 0,
        admitted=int(report.admitted),
        part_host_s={
            "route_ahead": (eng.predict_s - mk.predict_s) + stage.get("route_ahead", 0.0),
            "scheduler_2d": sched_s,
            "stream": stage.get("stream_plan", 0.0),
        },
        # NOTE: never a device synchronize per step: it would wait for the
        # prefetch copies issued to overlap the next draft
        exposed_fetch_s=max(0.0, eng.timer.stall_s_ready() - mk.stall_s),
        bytes_in=_delta(_cache_counter(cache, "bytes_in"), mk.bytes_in),
        prefetch_bytes_in=_delta(_cache_counter(cache, "prefetch_bytes_in"), mk.prefetch_in),
        prefetch_wasted_bytes=_delta(
            _cache_counter(cache, "prefetch_bytes_evicted_unused"), mk.prefetch_wasted
        ),
    )


def after_step(parts: EngineParts, report: StepReport) -> None:
    """Feed the step's measurement to the policy (end of a step)."""
    parts.policy.observe(measure_step(parts, report))
