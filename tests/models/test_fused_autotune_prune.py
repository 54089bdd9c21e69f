"""The fused kernel's autotuner tries every candidate on the published
shapes and only :data:`DEFAULT_CONFIG` on small ones (the first-use probe's
case, tiny test models), so those cost one compile and one benchmark instead
of one per candidate. Skips where triton is not installed."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the interpreter runs one config, nothing to prune", allow_module_level=True)

from pdflash.models import fused_moe_triton as kernels  # noqa: E402


def _shapes(configs: list[object]) -> list[tuple[int, int, int, int]]:
    return [kernels._config_shape(c) for c in configs]


@pytest.mark.parametrize(
    ("n", "k"),
    [(2880, 2880), (5760 // 2, 2880), (768, 2048), (2048, 768), (256, 256)],
)
def test_published_and_small_preset_shapes_try_every_candidate(n: int, k: int) -> None:
    configs = kernels._configs()
    assert kernels._prune_configs(configs, {"N": n}, K=k) == configs


@pytest.mark.parametrize(("n", "k"), [(48, 96), (32, 32), (64, 1000)])
def test_small_shapes_run_the_default_config_alone(n: int, k: int) -> None:
    assert n * k < kernels.TUNE_MIN_WEIGHTS
    configs = kernels._configs()
    assert _shapes(kernels._prune_configs(configs, {"N": n}, K=k)) == [kernels.DEFAULT_CONFIG]
    # candidates without the default (a narrowed list): the first one
    others = [c for c in configs if kernels._config_shape(c) != kernels.DEFAULT_CONFIG]
    assert kernels._prune_configs(others, {"N": n}, K=k) == others[:1]


def test_the_kernel_autotunes_through_the_pruning() -> None:
    tuner = kernels._grouped_qgemm_kernel
    assert tuner.early_config_prune is kernels._prune_configs


def test_configs_from_the_environment_are_parsed_or_refused() -> None:
    assert kernels.parse_configs("64:64:8:3,128:64:2:1") == [(64, 64, 8, 3), (128, 64, 2, 1)]
    bad_items = ("64:64:8", "64:64:8:3:1", "64:64:0:3", "a:b:c:d", "64:64:8:3,", "64:64:8:0")
    bad_items += ("48:64:8:3", "64:16:8:3", "8:64:4:3", "64:64:3:3")
    for bad in bad_items:
        with pytest.raises(ValueError, match="PDFLASH_FUSED_CONFIGS"):
            kernels.parse_configs(bad)
