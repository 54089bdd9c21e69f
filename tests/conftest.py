"""Shared test configuration.

Hypothesis profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, a fixed
example budget) and ``thorough`` (``THOROUGH_FACTOR`` times every test's
budget, on demand): ``HYPOTHESIS_PROFILE=thorough pytest tests/property``.
Tests that set their own ``max_examples`` scale it with
``hypothesis_budget.scaled``, so the profile scales them too.

Seeds rotate: every run draws a new seed from the clock and prints it in the
pytest header; replay a failure with ``PDFLASH_HYPOTHESIS_SEED=N pytest ...``.
``PDFLASH_HYPOTHESIS_SEED=derandomize`` gives the fixed, per-test derived
examples instead (reproducible without a seed). ``--hypothesis-seed`` wins
over both.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # hypothesis_budget, for test modules

from hypothesis_budget import CI_EXAMPLES, THOROUGH_FACTOR

SEED_ENV = "PDFLASH_HYPOTHESIS_SEED"
_SEED_SETTING = os.environ.get(SEED_ENV, "").strip()
DERANDOMIZE = _SEED_SETTING.lower() == "derandomize"

_common: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
    "derandomize": DERANDOMIZE,
}
settings.register_profile("ci", max_examples=CI_EXAMPLES, **_common)
settings.register_profile("thorough", max_examples=CI_EXAMPLES * THOROUGH_FACTOR, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _choose_seed() -> int | None:
    if DERANDOMIZE:
        return None
    if _SEED_SETTING:
        try:
            return int(_SEED_SETTING)
        except ValueError:
            raise ValueError(
                f"{SEED_ENV} must be an integer or 'derandomize', got {_SEED_SETTING!r}"
            ) from None
    return int(time.time()) % 2**32  # a new seed every run, printed in the header


HYPOTHESIS_SEED: int | None = None


def pytest_configure(config: Any) -> None:
    global HYPOTHESIS_SEED
    from hypothesis import core

    if config.getoption("hypothesis_seed", None) is not None:
        return  # --hypothesis-seed given: the hypothesis plugin sets it
    HYPOTHESIS_SEED = _choose_seed()
    if HYPOTHESIS_SEED is not None:
        core.global_force_seed = HYPOTHESIS_SEED


def pytest_report_header(config: Any) -> str:
    profile = settings.get_current_profile_name()
    given = config.getoption("hypothesis_seed", None)
    if given is not None:
        return f"hypothesis: profile {profile}, seed {given} (--hypothesis-seed)"
    if HYPOTHESIS_SEED is None:
        return f"hypothesis: profile {profile}, derandomized ({SEED_ENV}=derandomize)"
    return (
        f"hypothesis: profile {profile}, seed {HYPOTHESIS_SEED} "
        f"(replay: {SEED_ENV}={HYPOTHESIS_SEED} pytest ...)"
    )
