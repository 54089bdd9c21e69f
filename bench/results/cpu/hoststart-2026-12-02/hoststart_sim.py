"""Host-on steps of the gated PD controller in simulated bench-length runs,
the old start (``old``: host part on) against the new one (``new``: off
until the gate's first decision, from ``HOST_GATE_FIRST_STEPS`` = 2
measured steps; ``new-1``: the same from one step).

Each run mimics one ``bench/h200/issue16.py`` run: one prefill step
(admitted, not measured), then ``decode`` measured steps (the per-run
warm-up leaves the controller no measured step: on the H200 rows of the old
start its first decision fell on step 6 of 6-step runs, the prefill, two
warm-up steps and its probe pair with a settle step). A step's waiting share (the
forwards' wait for copies over its wall, host part off) is drawn per step:

* ``compute``: from the single host-off steps the H200 rows recorded at
  cache 0.5 (session 13, calls 2 and 4: the gate's ``why``);
* ``link``: uniform over 0.29-0.48 (PD's exposed-fetch share at cache 0.2
  in past sessions);
* ``borderline``: uniform over 0.1-0.3 (the median at the gate: how often
  each start runs the host where the gate cannot tell).

Host-on steps wait for nothing (the host serves the misses); their wall is
``HOST_FACTOR`` x the host-off wall (only a must-earn probe reads it).
Prints, per scenario and start, the runs' mean host-on steps, the share of
runs with any, and the mean first host-on step (None: never on).

    python -P bench/results/cpu/hoststart-2026-12-02/hoststart_sim.py
"""

from __future__ import annotations

import json

import numpy as np

from pdflash.engine.pd_controller import (
    ALL_ON,
    HOST_GATE_EXPOSED,
    HOST_GATE_FIRST_STEPS,
    HOST_PART,
    PARTS,
    PDController,
    StepMeasurement,
)

WITH_HOST = ALL_ON.with_part(HOST_PART, True)

#: single host-off steps' waiting shares at cache 0.5 (c=1 and c=4), H200
COMPUTE_SHARES = (0.0477, 0.108, 0.136, 0.0373, 0.168, 0.0831, 0.181, 0.124)
LINK_RANGE = (0.29, 0.48)
BORDERLINE_RANGE = (0.1, 0.3)
HOST_FACTOR = {"compute": 1.15, "link": 0.75, "borderline": 1.0}
DECODE_STEPS = (4, 6, 8, 12)
RUNS = 400


def _share(rng: np.random.Generator, scenario: str) -> float:
    if scenario == "compute":
        return float(rng.choice(COMPUTE_SHARES))
    if scenario == "borderline":
        return float(rng.uniform(*BORDERLINE_RANGE))
    return float(rng.uniform(*LINK_RANGE))


def _step(rng: np.random.Generator, scenario: str, on: bool, admitted: int = 0) -> StepMeasurement:
    wall = 0.05 * (HOST_FACTOR[scenario] if on else 1.0) * float(rng.uniform(0.95, 1.05))
    return StepMeasurement(
        wall_s=wall,
        committed_tokens=8,
        verified_tokens=16,
        admitted=admitted,
        part_host_s=dict.fromkeys(PARTS, 0.0),
        exposed_fetch_s=0.0 if on else _share(rng, scenario) * wall,
    )


def run(scenario: str, start: str, decode: int, seed: int) -> list[bool]:
    """The host part's state in each measured-run step (prefill first)."""
    rng = np.random.default_rng(seed)
    initial = WITH_HOST if start == "old" else None
    steps = 1 if start == "new-1" else HOST_GATE_FIRST_STEPS
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, initial=initial, host_gate_steps=steps)
    ctl.bind(WITH_HOST)
    states = []
    for i in range(1 + decode):
        on = ctl.parts.host_experts
        states.append(on)
        ctl.observe(_step(rng, scenario, on, admitted=1 if i == 0 else 0))
    return states


def main() -> None:
    out = []
    for scenario in ("compute", "link", "borderline"):
        for decode in DECODE_STEPS:
            for start in ("old", "new", "new-1"):
                runs = [run(scenario, start, decode, seed) for seed in range(RUNS)]
                on = [sum(s) for s in runs]
                firsts = [s.index(True) for s in runs if any(s)]
                out.append(
                    {
                        "scenario": scenario,
                        "steps": 1 + decode,
                        "start": start,
                        "host_on_steps_mean": round(float(np.mean(on)), 3),
                        "on_fraction_mean": round(float(np.mean(on)) / (1 + decode), 3),
                        "runs_with_host_on": round(float(np.mean([n > 0 for n in on])), 3),
                        "first_on_step_mean": (
                            round(float(np.mean(firsts)), 3) if firsts else None
                        ),
                    }
                )
    for row in out:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
