"""The adaptive width's ``voi`` rule against every due exploration on the
synthetic width plant of tests/engine/test_verify_width.py (``WidthPlant``:
geometric acceptance, a fixed drafter time, verify compute per row, i.i.d.
routing whose copies' link time is partly exposed). A model, not a
measurement. For each point and concurrency: committed tokens/s over the
last 3/4 of 300 steps, 6 seeds; the median and the least of the per-seed
ratios to ``voi=0``, for the upper bound at ``EXPLORE_Z`` = 2 (the default)
and at 1. Run from the repository root (tests/ importable):

    python3 -P bench/results/cpu/explore-voi-2026-12-05/plant_compare.py
"""

import importlib
import sys
from pathlib import Path

import numpy as np

from pdflash.engine.verify_width import AdaptiveWidth

sys.path.append(str(Path.cwd()))  # after the installed pdflash
# the tests' plant, imported by name (the type checker does not follow it into tests/)
WidthPlant = importlib.import_module("tests.engine.test_verify_width").WidthPlant

POINTS = [  # (acceptance, drafter s, compute s per row, link s per expert, exposed share)
    (0.7, 0.02, 0.0005, 0.00002, 0.0),
    (0.7, 0.02, 0.0005, 0.0001, 0.3),
    (0.7, 0.02, 0.0005, 0.0005, 0.3),
    (0.7, 0.02, 0.0005, 0.002, 1.0),
    (0.3, 0.02, 0.0002, 0.01, 1.0),
    (0.35, 0.02, 0.0002, 0.004, 1.0),
    (0.6, 0.02, 0.0002, 0.003, 1.0),
    (0.8, 0.02, 0.0002, 0.003, 1.0),
]


def rate(point: tuple[float, ...], c: int, seed: int, voi: bool, z: float) -> float:
    accept, t_draft, t_row, link, exposed = point
    AdaptiveWidth.EXPLORE_Z = z
    plant = WidthPlant(
        accept=accept,
        t_draft=t_draft,
        t_row=t_row,
        link_s_per_expert=link,
        exposed=exposed,
        seed=seed,
    )
    return float(plant.rate(plant.policy(explore_voi=voi), steps=300, c=c, skip=75))


print("accept link_s/expert exposed c | voi z=2 / voi=0: median (least) | z=1: median (least)")
for point in POINTS:
    for c in (1, 4):
        cells = []
        for z in (2.0, 1.0):
            r = [rate(point, c, s, True, z) / rate(point, c, s, False, z) for s in range(6)]
            cells.append(f"{np.median(r):.3f} ({min(r):.3f})")
        print(f"{point[0]} {point[3]} {point[4]} c={c} | {cells[0]} | {cells[1]}")
AdaptiveWidth.EXPLORE_Z = 2.0
