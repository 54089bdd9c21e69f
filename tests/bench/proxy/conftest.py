"""Fixtures for the proxy trainer tests: a cpu-tiny target trained for a few
steps on a slice of this machine's standard library, and a drafter trained
for a few steps on its continuations (session-scoped: trained once)."""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
from pdflash.bench.proxy.presets import drafter_preset, target_preset

STDLIB = Path(sysconfig.get_paths()["stdlib"])
#: stdlib packages present on every CPython >= 3.10
ROOT_NAMES = ("email", "json", "http", "urllib", "xml", "logging", "asyncio", "concurrent")

TARGET_STEPS = 40
DRAFT_STEPS = 30


def stdlib_roots() -> list[str]:
    return [str(STDLIB / n) for n in ROOT_NAMES if (STDLIB / n).is_dir()]


def tiny_target_preset() -> Any:
    # NOTE: a higher held-out share than the preset's so a ~200-file corpus
    # still has held-out documents of both roles (draft / eval).
    return dataclasses.replace(
        target_preset("cpu-tiny"),
        heldout_permille=250,
        max_corpus_bytes=2 << 20,
        tokenizer_train_bytes=512 << 10,
        eval_windows=8,
        eval_every_s=1e9,
    )


def tiny_drafter_preset() -> Any:
    return dataclasses.replace(
        drafter_preset("cpu-tiny"),
        data_prompts=16,
        continuation_len=40,
        eval_prompts=2,
        eval_new_tokens=24,
    )


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    # tiny ops on a shared 2-core machine are far faster on one thread
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def trained_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from pdflash.bench.proxy.target import train_target

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("proxy")
    prov = train_target(
        tiny_target_preset(),
        root / "target",
        root / "work",
        roots=stdlib_roots(),
        time_budget_s=60.0,
        max_steps=TARGET_STEPS,
        log=lambda _m: None,
    )
    return root / "target", prov


@pytest.fixture(scope="session")
def trained_drafter(
    trained_target: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    from pdflash.bench.proxy.drafter import train_drafter

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    prov = train_drafter(
        trained_target[0],
        out,
        tiny_drafter_preset(),
        time_budget_s=60.0,
        max_steps=DRAFT_STEPS,
        log=lambda _m: None,
    )
    return out, prov


@pytest.fixture(scope="session")
def models(
    trained_target: tuple[Path, dict[str, Any]], trained_drafter: tuple[Path, dict[str, Any]]
) -> tuple[Any, Any]:
    """(HF target, pdflash drafter), fp32 on the CPU."""
    from pdflash.bench.proxy.drafter import load_target

    from pdflash.engine.drafter import load_drafter

    target = load_target(trained_target[0], torch.device("cpu"), torch.float32)
    drafter = load_drafter(trained_drafter[0], dtype=torch.float32)
    return target, drafter
