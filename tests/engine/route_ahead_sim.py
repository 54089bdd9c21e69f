"""The simulated steps the PD controller's route-ahead gate tests drive
(``test_pd_controller_route_ahead_gate``, ``test_pd_controller_shadow_check``):
the step's wall depends on whether route-ahead runs (``ra_factor``), with
multiplicative noise, and a step with predictions (route-ahead on, or in
shadow) reports the named/routed counts of a precision, its host seconds
and one expert's copy time."""

from __future__ import annotations

import numpy as np

from pdflash.engine.pd_controller import PartsState, PDController, StepMeasurement

NAMED = 200  # (layer, expert) pairs a step's predictions name


def step(
    parts: PartsState,
    rng: np.random.Generator,
    *,
    precision: float,
    ra_factor: float,
    host_s: float = 0.0,
    copy_s: float | None = None,
    waits_s: float = 0.0,
    noise: float = 0.02,
) -> StepMeasurement:
    """A step: route-ahead's host seconds ``host_s`` (with noise) where it
    runs, one expert's copy time ``copy_s`` (None: not measured), and the
    forwards' waits for copies ``waits_s`` (with noise); the wall's
    log-normal noise ``noise``. A shadow step (route-ahead off, its
    predictions counted) is timed as an off one and reports the
    predictions and the predictor's share of the host time (0.7), as the
    engine does."""
    wall = 0.05 * (ra_factor if parts.route_ahead else 1.0) * float(np.exp(rng.normal(0.0, noise)))
    predicts = parts.route_ahead or parts.route_ahead_shadow
    named = NAMED if predicts else 0
    host = host_s * float(np.exp(rng.normal(0.0, 0.1))) if predicts else 0.0
    stream = 0.3 * host if parts.route_ahead and parts.stream else 0.0
    return StepMeasurement(
        wall_s=wall,
        committed_tokens=4,
        verified_tokens=4,
        route_ahead_predicted=named,
        route_ahead_hits=round(precision * named),
        part_host_s={"route_ahead": 0.7 * host, "stream": stream},
        expert_copy_s=copy_s,
        exposed_fetch_s=waits_s * float(np.exp(rng.normal(0.0, 0.1))),
    )


def simulate(
    ctl: PDController,
    *,
    precision: float,
    ra_factor: float,
    steps: int,
    seed: int = 0,
    host_s: float = 0.0,
    copy_s: float | None = None,
    waits_s: float = 0.0,
    noise: float = 0.02,
) -> list[bool]:
    """Run ``steps`` steps (the wall's noise ``noise``); returns
    route-ahead's state per step."""
    ctl.bind(PartsState())
    rng = np.random.default_rng(seed)
    states = []
    for _ in range(steps):
        parts = ctl.parts
        states.append(parts.route_ahead)
        measured = step(
            parts,
            rng,
            precision=precision,
            ra_factor=ra_factor,
            host_s=host_s,
            copy_s=copy_s,
            waits_s=waits_s,
            noise=noise,
        )
        ctl.observe(measured)
    return states


def ra_decisions(ctl: PDController) -> list[dict[str, object]]:
    return [d for d in ctl.summary()["decisions"] if d["part"] == "route_ahead"]
