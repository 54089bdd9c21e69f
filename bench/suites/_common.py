"""Helpers shared by the matrix, default and report suites."""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ARCHS = ("tiny", "gpt-oss-20b", "qwen3-30b-a3b", "mixtral-8x7b", "olmoe")
#: also accepted: the engine's tiny variants of each architecture
#: ("proxy" labels a trained proxy checkpoint given with --weights)
EXTRA_ARCHS = (
    "tiny-qwen3_moe",
    "tiny-gpt_oss",
    "tiny-mixtral",
    "tiny-olmoe",
    "olmoe-1b-7b",
    "proxy",
)


def utc_stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def parse_list(text: str, convert: Callable[[str], T], what: str) -> list[T]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; a clear error naming the bad item."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{what}: empty list {text!r}")
    out = []
    for item in items:
        try:
            out.append(convert(item))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{what}: bad item {item!r} in {text!r}") from exc
    return out


def positive_ints(what: str) -> Callable[[str], list[int]]:
    def convert(text: str) -> list[int]:
        values = parse_list(text, int, what)
        bad = [v for v in values if v < 1]
        if bad:
            raise argparse.ArgumentTypeError(f"{what}: {bad[0]} is not a positive integer")
        return values

    return convert


def rates(text: str) -> list[float]:
    """``--rate``: positive request rates (requests/s), a comma list."""
    values = parse_list(text, float, "--rate")
    bad = [v for v in values if not v > 0]
    if bad:
        raise argparse.ArgumentTypeError(f"--rate: {bad[0]} is not a positive rate")
    return values


def fractions(text: str) -> list[float]:
    values = parse_list(text, float, "--cache-fraction")
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"--cache-fraction: {bad[0]} is not in (0, 1]")
    return values


def baselines(text: str) -> list[str]:
    from pdflash.report.schema import BASELINES

    known = {b.upper(): b for b in BASELINES}
    values = [known.get(v.upper(), v) for v in parse_list(text, str, "--baselines")]
    bad = [v for v in values if v not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"--baselines: unknown {bad[0]!r}; known: {BASELINES}")
    return values


WIDTH_FORMS = (
    "auto, full, fixed:K (K >= 0 drafts) or "
    "adaptive[:shrink=W][:z=Z][:cal=0|1][:union=FORM][:beta=MODE][:row=MODE]"
    "[:explore=N][:reach=R][:voi=0|1][:cost=0|1]"
)
#: adaptive with its estimator options (their ranges are checked when each
#: run is built, by pdflash.engine.verify_width.parse_width)
ADAPTIVE_OPTIONS = re.compile(
    r"adaptive(:(shrink|z|cal|union|beta|row|explore|reach|voi|cost)=[0-9A-Za-z.+-]+)+"
)

#: ``--cuda-graphs`` values: pdflash.engine.config.CUDA_GRAPHS (importing the
#: engine here would load torch for every CLI call; a test keeps them equal)
CUDA_GRAPHS = ("off", "auto", "piecewise")

#: ``--host-format`` values besides ``auto``: pdflash.hybrid.kernels.HOST_FORMATS
#: (kept free of torch like CUDA_GRAPHS; a test keeps them equal)
HOST_FORMATS = (
    "packed",
    "out_in",
    "in_out",
    "fp32_out_in",
    "fp32_in_out",
    "onednn",
    "native",
    "native_mxfp4",
    "native_fp8",
)


def verify_width(text: str) -> str:
    """``--verify-width``: ``auto``, ``full``, ``fixed:K`` or
    ``adaptive[:shrink=W][:z=Z][:cal=0|1][:union=FORM][:beta=MODE][:row=MODE]
    [:explore=N][:reach=R][:voi=0|1][:cost=0|1]`` (the form checked here without importing the
    engine; K against the block size and the options' values when each run
    is built)."""
    s = text.strip()
    if s in ("auto", "full", "adaptive"):
        return s
    if ADAPTIVE_OPTIONS.fullmatch(s):
        return s
    if s.startswith("fixed:") and s[len("fixed:") :].isdigit():
        return f"fixed:{int(s[len('fixed:') :])}"
    raise argparse.ArgumentTypeError(f"--verify-width: use {WIDTH_FORMS}, got {text!r}")


def verify_widths(text: str) -> list[str]:
    """A comma list of :func:`verify_width` values."""
    values = [verify_width(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"--verify-width: use {WIDTH_FORMS}, got {text!r}")
    return values


def resolved_width(width: str, baseline: str) -> str:
    """The width a label runs at (:func:`pdflash.report.schema.resolved_width`:
    ``auto`` is the label's preset, B0 always ``full``)."""
    from pdflash.report.schema import resolved_width as resolve

    return resolve(width, baseline)


def archs(text: str) -> list[str]:
    values = [v.lower() for v in parse_list(text, str, "--arch")]
    bad = [v for v in values if v not in ARCHS + EXTRA_ARCHS]
    if bad:
        raise argparse.ArgumentTypeError(f"--arch: unknown {bad[0]!r}; known: {ARCHS}")
    return values


def warm_bursts_arg(text: str) -> int:
    """``--warm-bursts``: an int in [0, MAX_WARM_BURSTS]."""
    from pdflash.report.schema import MAX_WARM_BURSTS

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warm-bursts takes an int, got {text!r}") from None
    if not 0 <= n <= MAX_WARM_BURSTS:
        raise argparse.ArgumentTypeError(
            f"--warm-bursts must be in [0, {MAX_WARM_BURSTS}], got {n}"
        )
    return n


def source_arg(text: str) -> str:
    """``synthetic`` or an existing checkpoint path."""
    if text == "synthetic":
        return text
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'synthetic' nor an existing path")
    return str(Path(text).resolve())


def progress_bar(total: int, desc: str, disable: bool = False) -> Any:
    """A tqdm bar on stderr (or a no-op when tqdm is missing or disabled)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        disable = True
    if disable:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, leave=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str) -> None:
        print(s, file=sys.stderr)

    def close(self) -> None:
        pass
