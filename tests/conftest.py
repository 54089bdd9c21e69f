"""Shared test configuration.

Hypothesis profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, a fixed
example budget) and ``thorough`` (``THOROUGH_FACTOR`` times every test's
budget, on demand): ``HYPOTHESIS_PROFILE=thorough pytest -m property``.
Tests that set their own ``max_examples`` scale it with
``hypothesis_budget.scaled``, so the profile scales them too.

Seeds rotate: every run draws a new seed from the clock and prints it in the
pytest header; replay a failure with ``PDFLASH_HYPOTHESIS_SEED=N pytest ...``.
``PDFLASH_HYPOTHESIS_SEED=derandomize`` gives the fixed, per-test derived
examples instead (reproducible without a seed). ``--hypothesis-seed`` wins
over both.

Kinds of test are markers, not directories (the directories mirror the
package): ``native``, ``gpu``, ``faults`` and ``slow`` are set by the modules
(``pytestmark``) or tests themselves, ``property`` by the hook below on every
hypothesis test. ``gpu`` tests skip cleanly without a CUDA device.

Fixtures shared by several directories live in plugin modules next to this
file (``pytest_plugins``): ``issuer_fixtures`` (tiny checkpoints, the host and
a fake issuer) and ``bench_fixtures`` (valid bench rows and a fake engine).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # hypothesis_budget, for test modules

from hypothesis_budget import CI_EXAMPLES, THOROUGH_FACTOR

pytest_plugins = ("issuer_fixtures", "bench_fixtures")

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


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Kinds are markers: every hypothesis test (``@given``) is ``property``;
    ``gpu`` tests skip cleanly without a CUDA device."""
    from hypothesis import is_hypothesis_test

    for item in items:
        if isinstance(item, pytest.Function) and is_hypothesis_test(item.obj):
            item.add_marker(pytest.mark.property)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="no CUDA device on this machine")
        for item in gpu_items:
            item.add_marker(skip)
