"""The bare ``pdflash-bench`` default's own runs, interleaved A/B: the
default suite's specs (tiny synthetic model, forced acceptance, cache 0.25,
``2c`` live requests for a ``c``-block step; on the GPU the real link, on
the CPU the emulated one unless ``--emulated-link-gbps`` says otherwise)
for B1, B2 and PD, plus PD's ablations, every arm once per repeat in an
order rotated each repeat, until ``--repeats`` or ``--budget-s``; before
the repeats every arm runs once unrecorded (``--warm-runs 0``: not).

Arms (``--arms``, comma-separated names):
  B1, B2, PD          the default suite's specs as they are
  PDprec              PD with ``route_ahead_gate=precision`` (the gate
                      without its cost bound: the default before it)
  PDnora              PD-no-route-ahead (route-ahead and the stream off)
  PDwcost0            PD with ``verify_width=adaptive:cost=0`` (the width
                      that never stands down for its own host time: the
                      default before it)
  PDfull              PD with ``verify_width=full`` (every draft verified,
                      B1's width; the rest of PD as it is)
  PDsettled, B1warm   PD with ``controller_warmup=first_round`` (workload
                      bursts outside the clock until its controller ended
                      its first round: one burst here) and B1 with one such
                      burst (``warm_bursts=1``): the two in steady state
  PDsetFull           PDsettled with every draft verified (B1's width)
  PDnoclear           PD whose controller never reads the route-ahead cost
                      bound clear (``ROUTE_AHEAD_COST_CLEAR`` set to inf): the
                      default before it
  PDnowaits           PD whose controller never skips a probe of route-ahead
                      by the waits bound (``ROUTE_AHEAD_WAITS_MIN_STEPS``
                      set past any window): the default before it
  PDpartbooks         PD whose books charge each prefetching part only its
                      own stages (``pd_controller._books_host`` replaced by
                      ``_host``): the books before session 44
  PDme                PD whose controller probes route-ahead first and
                      judges it must-earn (``PARTS``, ``ALL_PARTS``,
                      ``DEFAULT_STANCES``): a design candidate
  PDprobe16           PD whose stood-down verify width probes every 16
                      steps, never fewer (``AdaptiveWidth.COST_PROBE_MAX_EVERY``
                      = ``COST_PROBE_EVERY``): the probes before session 45
  PDnorest            PD whose controller never rests (``PDController.resting``
                      False: every step measured, the shadow scheduler and
                      F's refit run): the controller before session 46
  PDnoraFcfs          PDnora with first-come batching (B1's) instead of
                      the 2-D scheduler
  PDnoraNobg          PDnora without background prefetch
  PDnoraFull          PDnora with every draft verified (B1's width)
  PDnoraB1            PDnora with all three: B1's configuration reached from
                      PD's side (these four change the engine configuration
                      the spec builds)
  PDsetFcfs           PDsettled with first-come batching (B1's)
  PDsetB1cfg          PDsettled with first-come batching, no background
                      prefetch and every draft verified: B1's configuration
                      under PD's settled controller
  PDbusyrest          PD whose rest keeps PD's own batching and width
                      (``rest_batching`` ``scheduler``,
                      ``WidthHook.QUIET_AT_REST`` False): the rest before
                      session 51
  PDsetBusy           PDsettled with the same
  (PDnoclear, PDnowaits, PDpartbooks, PDme, PDprobe16, PDnorest, the PDnora* four,
  PDsetFcfs, PDsetB1cfg, PDbusyrest and PDsetBusy change this process for their runs
  only; their rows say how in ``arm_patch``)

Writes ``OUT/rows.jsonl`` (each row with its ``arm`` and ``repeat``; read by
``bench/pair_ratios.py OUT/rows.jsonl PD/B1 ...``) and prints the pairs.
``--profile`` instead runs each arm once warm and once with its engine stages
timed (``bench/h200/default_profile.py``: host ms per engine step on the
run's clock by stage, and on CUDA the synchronizing calls each stage
makes), prints them and writes ``OUT/profile.json`` (keyed by concurrency,
then arm); ``--profile-repeats N``
profiles every arm ``N`` times, interleaved, and prints and writes the
medians (with every run under ``runs``): one run does not rank arms on a
host whose speed drifts between runs. ``--cuda-api`` (CUDA only) instead
runs each arm under torch's profiler (CUPTI, no operator tracing;
``--profile-repeats`` times, interleaved) over its measured steps after the
first, and writes ``OUT/cuda_api.json``: per step the CUDA runtime calls of
the Python thread and of the native threads (count, mean duration), the
device's kernel and copy time and its most frequent kernels, and the
threads' CPU time.

    python3 bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --out OUT
    python3 bench/h200/default_ab.py --concurrency 4 --arms B1,B2,PD --profile --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.pair_ratios import pair_ratios
from pdflash.bench.suites import default
from pdflash.bench.suites.matrix import rotated

from pdflash.engine import pd_controller
from pdflash.engine.config import EngineConfig
from pdflash.engine.verify_width import AdaptiveWidth, WidthHook

# default_profile.py sits next to this script; `python -P` leaves this folder off sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import default_profile  # type: ignore[import-not-found]

#: name: (the default spec it changes, the changes)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "PDprec": ("PD", {"route_ahead_gate": "precision"}),
    "PDnora": ("PD", {"baseline": "PD-no-route-ahead"}),
    "PDwcost0": ("PD", {"verify_width": "adaptive:cost=0"}),
    "PDfull": ("PD", {"verify_width": "full"}),
    # the steady state a server's engine reaches: PD after its controller's
    # first round outside the clock, B1 after as many workload bursts (one
    # burst settles the default's controller; each row's ``warmup`` says)
    "PDsettled": ("PD", {"controller_warmup": "first_round"}),
    "B1warm": ("B1", {"warm_bursts": 1}),
    "PDsetFull": ("PD", {"controller_warmup": "first_round", "verify_width": "full"}),
}


@contextmanager
def _attributes(
    owner: object, label: str, values: dict[str, Any], text: str | None = None
) -> Iterator[str]:
    """``owner``'s attributes (a module's or a class's, named ``label`` in
    the text) set to ``values`` while the run runs (restored after it, on
    failure too); yields what changed."""
    saved = {attr: getattr(owner, attr) for attr in values}
    for attr, value in values.items():
        setattr(owner, attr, value)
    try:
        yield text or "; ".join(f"{label}.{k}={v}" for k, v in values.items())
    finally:
        for attr, value in saved.items():
            setattr(owner, attr, value)


def _controller(values: dict[str, Any], text: str | None = None) -> AbstractContextManager[str]:
    """``pd_controller``'s module attributes set to ``values`` for the run."""
    return _attributes(pd_controller, "pd_controller", values, text)


@contextmanager
def _configured(changes: dict[str, Any]) -> Iterator[str]:
    """Every engine configuration a run spec builds changed by ``changes``
    while the run runs; yields what changed."""
    built = RunSpec.engine_config

    def changed(spec: RunSpec) -> EngineConfig:
        return built(spec).replace(**changes)

    setattr(RunSpec, "engine_config", changed)  # noqa: B010 (a method replaced for a run)
    try:
        yield "EngineConfig " + ",".join(f"{k}={v}" for k, v in changes.items())
    finally:
        setattr(RunSpec, "engine_config", built)  # noqa: B010


@contextmanager
def _busy_rest() -> Iterator[str]:
    """PD's rest with its own batching and its width consulted."""
    with (
        _configured({"rest_batching": "scheduler"}) as configured,
        _attributes(WidthHook, "WidthHook", {"QUIET_AT_REST": False}) as width,
    ):
        yield f"{configured}; {width}"


def _route_ahead_first_must_earn() -> AbstractContextManager[str]:
    parts = ("route_ahead", "scheduler_2d", "stream")
    return _controller(
        {
            "PARTS": parts,
            "ALL_PARTS": (pd_controller.HOST_PART, *parts),
            "DEFAULT_STANCES": MappingProxyType(
                {**pd_controller.DEFAULT_STANCES, "route_ahead": "must_earn"}
            ),
        },
        "pd_controller.PARTS route_ahead first; DEFAULT_STANCES route_ahead=must_earn",
    )


#: name: (the arm whose spec it runs, what its runs run under: a context
#: manager, entered per run, that yields what it changed for the rows'
#: ``arm_patch``; no configuration names these changes)
PATCHED: dict[str, tuple[str, Callable[[], AbstractContextManager[str]]]] = {
    "PDnoclear": ("PD", lambda: _controller({"ROUTE_AHEAD_COST_CLEAR": math.inf})),
    "PDnowaits": (
        "PD",
        lambda: _controller(
            {"ROUTE_AHEAD_WAITS_MIN_STEPS": sys.maxsize},
            "pd_controller.ROUTE_AHEAD_WAITS_MIN_STEPS=maxsize (the waits bound never reads)",
        ),
    ),
    "PDpartbooks": (
        "PD",
        lambda: _controller(
            {"_books_host": pd_controller._host}, "pd_controller._books_host=_host"
        ),
    ),
    "PDme": ("PD", _route_ahead_first_must_earn),
    "PDprobe16": (
        "PD",
        lambda: _attributes(
            AdaptiveWidth, "AdaptiveWidth", {"COST_PROBE_MAX_EVERY": AdaptiveWidth.COST_PROBE_EVERY}
        ),
    ),
    "PDnorest": (
        "PD",
        lambda: _attributes(
            pd_controller.PDController,
            "PDController",
            {"resting": False},
            "PDController.resting=False (every step measured)",
        ),
    ),
    # which of PD-no-route-ahead's remaining differences from B1 costs what
    "PDnoraFcfs": ("PDnora", lambda: _configured({"batching": "fcfs"})),
    "PDnoraNobg": ("PDnora", lambda: _configured({"background_prefetch": False})),
    "PDnoraFull": ("PDnora", lambda: _configured({"verify_width": "full"})),
    "PDnoraB1": (
        "PDnora",
        lambda: _configured(
            {"batching": "fcfs", "background_prefetch": False, "verify_width": "full"}
        ),
    ),
    # the rest before session 51: PD's own batching and width at rest
    "PDbusyrest": ("PD", lambda: _busy_rest()),
    "PDsetBusy": ("PDsettled", lambda: _busy_rest()),
    # which of settled PD's differences from B1 costs what in steady state
    "PDsetFcfs": ("PDsettled", lambda: _configured({"batching": "fcfs"})),
    "PDsetB1cfg": (
        "PDsettled",
        lambda: _configured(
            {"batching": "fcfs", "background_prefetch": False, "verify_width": "full"}
        ),
    ),
}


@contextmanager
def _patched(name: str) -> Iterator[str | None]:
    """What arm ``name``'s runs run under (:data:`PATCHED`); yields what
    changed (None: nothing)."""
    if name not in PATCHED:
        yield None
        return
    with PATCHED[name][1]() as what:
        yield what


def run_arm(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One run of arm ``name``: its row, with ``arm`` (and ``arm_patch``)."""
    with _patched(name) as patch:
        row = run_spec(RunSpec(**spec)).row
    row["arm"] = name
    if patch is not None:
        row["arm_patch"] = patch
    return row


def _arm_specs(names: list[str], base: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for name in names:
        if name in base:
            specs[name] = base[name]
        elif name in VARIANTS:
            of, changes = VARIANTS[name]
            specs[name] = {**base[of], **changes}
        elif name in PATCHED:
            of = PATCHED[name][0]
            specs[name] = _arm_specs([of], base)[of]
        else:
            raise SystemExit(f"unknown arm {name!r}; choose from {[*base, *VARIANTS, *PATCHED]}")
    return specs


def _default_specs(args: argparse.Namespace, conc: int, on_gpu: bool) -> dict[str, dict[str, Any]]:
    ns = argparse.Namespace(
        quick=False,
        concurrency=[conc],
        cache_fraction=[0.25],
        device=args.device,
        emulated_link_gbps=args.emulated_link_gbps,
        marginal_rule="verify",
    )
    return {s["baseline"]: s for s in default.default_specs(ns, on_gpu=on_gpu)}


def _interleaved_profiles(
    args: argparse.Namespace,
    names: list[str],
    conc: int,
    on_gpu: bool,
    profile_one: Callable[[dict[str, Any], bool], dict[str, Any]],
    show: Callable[[str, int, dict[str, Any]], None],
) -> dict[str, list[dict[str, Any]]]:
    """Every arm's ``--profile-repeats`` runs at ``conc`` by ``profile_one(spec,
    warm)``, interleaved (order rotated each repeat; the first repeat warms
    each arm first); ``show(arm, repeat, result)`` sees each as it ends."""
    specs = _arm_specs(names, _default_specs(args, conc, on_gpu))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(args.profile_repeats):
        for name in rotated(names, rep):
            with _patched(name):
                prof = profile_one(specs[name], rep == 0)
            runs[name].append(prof)
            show(name, rep, prof)
    return runs


def _profile(args: argparse.Namespace, names: list[str], on_gpu: bool) -> None:
    """Every arm profiled ``--profile-repeats`` times, interleaved; writes
    every run and, with several, the arms' medians."""
    out: dict[str, dict[str, Any]] = {}
    for conc in args.concurrency:

        def show(name: str, rep: int, prof: dict[str, Any], conc: int = conc) -> None:
            if args.profile_repeats == 1:
                default_profile.print_profile(f"c={conc} {name}", prof)

        runs = _interleaved_profiles(
            args,
            names,
            conc,
            on_gpu,
            lambda spec, warm: default_profile.profile_arm(spec, on_gpu, warm=warm),
            show,
        )
        if args.profile_repeats == 1:
            out[str(conc)] = {name: r[0] for name, r in runs.items()}
            continue
        out[str(conc)] = {}
        for name in names:
            med = default_profile.median_profile(runs[name])
            out[str(conc)][name] = {**med, "runs": runs[name]}
            default_profile.print_profile(f"c={conc} {name}", med)
    (args.out / "profile.json").write_text(json.dumps(out, indent=1))


def _cuda_api(args: argparse.Namespace, names: list[str], on_gpu: bool) -> None:
    """Every arm under the CUDA profiler ``--profile-repeats`` times,
    interleaved; writes every run to ``OUT/cuda_api.json``."""
    if not on_gpu:
        raise SystemExit("--cuda-api needs a CUDA device")
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for conc in args.concurrency:

        def show(name: str, rep: int, prof: dict[str, Any], conc: int = conc) -> None:
            default_profile.print_cuda_api(f"c={conc} {name} run {rep}", prof)

        out[str(conc)] = _interleaved_profiles(
            args,
            names,
            conc,
            on_gpu,
            lambda spec, warm: default_profile.cuda_api_profile_arm(spec, warm=warm),
            show,
        )
    (args.out / "cuda_api.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--arms", default="B1,B2,PD,PDprec,PDnora")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--emulated-link-gbps", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", action="store_true", help="time each arm's engine stages")
    parser.add_argument(
        "--cuda-api",
        action="store_true",
        help="CUDA: each arm's runtime calls by thread and its device time (torch's profiler)",
    )
    parser.add_argument(
        "--profile-repeats",
        type=int,
        default=1,
        help="with --profile: profiled runs an arm, interleaved; > 1 prints their medians",
    )
    parser.add_argument(
        "--warm-runs",
        type=int,
        choices=[0, 1],
        default=1,
        help="run every arm once, unrecorded, before the repeats (1, the default)",
    )
    args = parser.parse_args()
    if args.profile_repeats < 1:
        parser.error(f"--profile-repeats must be >= 1, got {args.profile_repeats}")
    on_gpu = default._cuda_present(args.device)
    names = args.arms.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        _profile(args, names, on_gpu)
        return
    if args.cuda_api:
        _cuda_api(args, names, on_gpu)
        return
    rows_path = args.out / "rows.jsonl"
    start = time.monotonic()
    # the process's first runs pay one-time costs (allocator, kernels, caches):
    # every arm once, unrecorded, so the first repeat's pairs do not carry them
    for conc in args.concurrency if args.warm_runs else ():
        for name, spec in _arm_specs(names, _default_specs(args, conc, on_gpu)).items():
            run_arm(name, {**spec, "repeat": args.repeats})  # a seed no repeat uses
    with rows_path.open("a") as f:
        for rep in range(args.repeats):
            for conc in args.concurrency:
                specs = _arm_specs(names, _default_specs(args, conc, on_gpu))
                for name in rotated(names, rep):
                    row = run_arm(name, {**specs[name], "repeat": rep})
                    f.write(json.dumps(row, default=str) + "\n")
                    f.flush()
                    print(
                        f"rep {rep} c={conc} {name}: {row['output_tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
            if time.monotonic() - start > args.budget_s:
                break
    rows = [json.loads(line) for line in rows_path.open()]
    for num in names[1:]:
        for den in names[:1] + (["B2"] if "B2" in names and num != "B2" else []):
            for point in pair_ratios(rows, num, den):
                print(json.dumps({"pair": f"{num}/{den}", **point}, default=str))


if __name__ == "__main__":
    main()
