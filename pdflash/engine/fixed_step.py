"""``F`` of the scheduler's marginal rule from the engine's online step-time fit.

The marginal rule (docs/scheduler.md rule 4.4) needs ``F = t_fixed · link``:
the bytes the link moves during a step's *fixed* time. A run starts from a
calibrated ``F`` (bench/engine_run.py: link x the calibration's compute per
step, which also holds that batch's per-token compute, so it errs high).
Where the engine fits its step time online, ``step = t_fixed + t_row · rows
(+ exposed link time)`` (:meth:`pdflash.engine.verify_width.AdaptiveWidth.step_time_fit`),
:class:`FixedStepFeed` replaces ``F`` after each step with ``t_fixed`` of that
fit times the link rate, once the fit is identified:

* at least ``min_steps`` measured steps, and their row counts differ (with
  one row count the intercept is the whole mean step, per-row time included,
  which is no better than the calibration);
* its intercept ``t_fixed`` is finite and > 0 (an intercept at or below 0 is
  an extrapolation artefact, not a fixed time);
* ``F`` is bounded above by the bytes the link moves in the fit's mean step
  (the fixed time is part of the step), and by the int64 range the
  scheduler validates (an ``F`` it refuses is not applied).

Otherwise the ``F`` in force (the calibration's, or the last accepted fit's)
stays. The scheduler takes a new ``F`` between steps with no credit or ring
change, so following the fit does not disturb fairness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pdflash.engine.engine import Engine

FIXED_STEP_SOURCES = ("calibration", "online_fit")


@dataclass(frozen=True)
class StepTimeFit:
    """An online least-squares fit of the engine's step time on its rows.

    Attributes:
        t_fixed_s: the intercept (the step's fixed time), not floored: it
            may be <= 0 where the fit extrapolates badly.
        t_row_s: the slope (compute per verified row).
        steps: the measured steps the fit is made of.
        rows_vary: whether those steps' row counts differ (else the slope
            is not identified and the intercept is the mean step).
        mean_step_s: the mean measured step (wall) of those steps.
    """

    t_fixed_s: float
    t_row_s: float
    steps: int
    rows_vary: bool
    mean_step_s: float


@runtime_checkable
class StepTimeFitSource(Protocol):
    """What keeps an online step-time fit (the adaptive verify width)."""

    def step_time_fit(self) -> StepTimeFit | None: ...


class FixedStepTarget(Protocol):
    """What takes ``F`` (:class:`pdflash.engine.batching.DeficitBatcher`)."""

    @property
    def fixed_step_bytes(self) -> int | None: ...

    def set_fixed_step_bytes(self, fixed_step_bytes: int) -> None: ...


class FixedStepFeed:
    """Feeds ``F = t_fixed · link`` from ``source``'s fit to ``target``.

    Args:
        source: the online step-time fit.
        target: the batcher whose marginal rule is on (``F`` already set,
            from a calibration: the value kept until the fit is usable).
        link_bytes_per_s: the link rate ``F`` is measured in (the same the
            calibration used, so the two are comparable).
        min_steps: measured steps the fit needs before it is used.
    """

    def __init__(
        self,
        source: StepTimeFitSource,
        target: FixedStepTarget,
        link_bytes_per_s: float,
        *,
        min_steps: int = 8,
    ) -> None:
        if not (math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0):
            raise ValueError(f"link_bytes_per_s must be finite and > 0, got {link_bytes_per_s}")
        if min_steps < 2:
            raise ValueError(f"min_steps must be >= 2 (a line needs two points), got {min_steps}")
        if target.fixed_step_bytes is None:
            raise ValueError("the target's marginal rule is off (no F to refine)")
        self.source = source
        self.target = target
        self.link_bytes_per_s = float(link_bytes_per_s)
        self.min_steps = min_steps
        self.calibration_bytes: int = target.fixed_step_bytes
        self.source_name = "calibration"
        self.fitted_steps = 0  # steps whose fit was usable (F set from it)
        self.updates = 0  # of those, steps that changed F
        self.last_t_fixed_s: float | None = None
        self.kept: dict[str, int] = {}  # why a step kept the F in force, by reason

    #: why :meth:`skip` keeps ``F`` (the reason :attr:`kept` counts)
    NO_PREDICTED_BYTES = "route-ahead off: no demand names a predicted byte"

    def skip(self) -> None:
        """A step after which ``F`` is not refitted: route-ahead is off, so
        no demand names a predicted byte and ``F`` changes no choice (the
        fit is read again once route-ahead runs)."""
        why = self.NO_PREDICTED_BYTES
        self.kept[why] = self.kept.get(why, 0) + 1

    def after_step(self) -> int | None:
        """Apply the fit's ``F`` if it is usable; returns the ``F`` applied
        (None: the ``F`` in force stays, the reason counted in :attr:`kept`)."""
        fit = self.source.step_time_fit()
        why = self._unusable(fit)
        if why is None:
            assert fit is not None
            bound = self.link_bytes_per_s * fit.mean_step_s
            value = int(min(fit.t_fixed_s * self.link_bytes_per_s, bound))
            try:
                if value != self.target.fixed_step_bytes:
                    self.target.set_fixed_step_bytes(value)
                    self.updates += 1
            except ValueError:
                why = "out of the scheduler's int64 range"
            else:
                self.fitted_steps += 1
                self.source_name = "online_fit"
                self.last_t_fixed_s = fit.t_fixed_s
                return value
        self.kept[why] = self.kept.get(why, 0) + 1
        return None

    def _unusable(self, fit: StepTimeFit | None) -> str | None:
        if fit is None or fit.steps < self.min_steps:
            return "too few measured steps"
        if not fit.rows_vary:
            return "one row count (intercept not identified)"
        if not math.isfinite(fit.t_fixed_s) or fit.t_fixed_s <= 0.0:
            return "intercept <= 0 or not finite"
        if not math.isfinite(fit.mean_step_s) or fit.mean_step_s <= 0.0:
            return "no positive mean step"
        return None

    def fields(self) -> dict[str, Any]:
        """A run row's books: the ``F`` in force now and where it came from."""
        return {
            "fixed_step_bytes_source": self.source_name,
            "fixed_step_bytes_final": self.target.fixed_step_bytes,
            "fixed_step_fit": {
                "followed": True,
                "calibration_bytes": self.calibration_bytes,
                "fitted_steps": self.fitted_steps,
                "updates": self.updates,
                "t_fixed_s": self.last_t_fixed_s,
                "min_steps": self.min_steps,
                "kept": dict(self.kept),
            },
        }


def follow_step_time_fit(
    engine: Engine, target: FixedStepTarget, link_bytes_per_s: float, *, min_steps: int = 8
) -> FixedStepFeed | None:
    """Attach a :class:`FixedStepFeed` to ``engine`` (run after each step)
    where its verify-width policy keeps a step-time fit; None where it keeps
    none (``full``/``fixed:K`` widths): ``F`` then stays as set."""
    policy = None if engine.width is None else engine.width.policy
    if not isinstance(policy, StepTimeFitSource):
        return None
    feed = FixedStepFeed(policy, target, link_bytes_per_s, min_steps=min_steps)
    engine.fixed_step = feed
    return feed
