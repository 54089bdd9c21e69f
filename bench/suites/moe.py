"""``pdflash-bench moe``: offloaded vs resident MoE forward on a real HF
architecture (synthetic weights unless ``--weights``).

For each repeat, one sequence of ``--tokens`` seeded random tokens runs
through the HF forward twice: with every layer's experts resident on the
device (the architecture's own transformers MoE block over stacked experts)
and offloaded (experts in pinned host memory, a cache of ``--cache-fraction``
of all experts, misses copied ON_DEMAND through :class:`pdflash.h2d.H2DIssuer`).
Per-layer times come from CUDA events (``perf_counter`` on CPU) around each
decoder layer and each MoE block; medians over ``--repeats`` after one
warm-up repeat. The cache persists across repeats (steady state).

On CUDA, ``link_gbps`` is a 256 MiB pinned->device copy measured in the same
run, for context.

Per layer and per ``--all-hit-tokens`` count, ``all_hit`` compares, on the
same random rows and routing: ``offloaded_all_hit_us`` (the offloaded block's
``forward_routed`` with every expert of the layer resident: the path with no
host sync), ``grouped_mm_active_us`` (the architecture's grouped MLP alone on
the active experts' dense weights stacked in one tensor, rows pre-sorted: no
routing, sort, lookup or scatter) and ``hbm_roofline_us`` (stored bytes of
the active experts / ``hbm_gbps``, a device-to-device copy measured in the
same run, counted as bytes read + written). The targets of issue 13
(``<= 1.25x`` grouped_mm, ``<= 2x`` roofline) are evaluated on each row.
``resident_execution`` says whether the timed block replayed a recording of
the layer's kernels (``graph``, :mod:`pdflash.models.resident_graphs`,
``--resident-graphs on``) or ran eagerly (``eager``, the reason in
``resident_execution_reason``); ``--resident-graphs both`` times the eager
block in the main fields and the recorded one in the same interleaved rounds
(``by_resident_graphs.on``: its µs, host and device µs, ratios, whether its
output equals the eager block's bit for bit).

Both sides are timed the same way (:func:`_timed`; the row's
``all_hit_timing`` says so in words), in ``--all-hit-rounds`` interleaved
rounds (offloaded, plain, offloaded, ...; medians, the rounds kept): ``*_us``
is CUDA events around ``--all-hit-iters`` back-to-back calls (what an eager
caller gets: a side whose host issues its calls slower than the device runs
them is timed at the host's pace), ``*_host_us`` the host's time to issue
one call (``perf_counter`` around the same loop) and ``*_device_us`` the
device's time per call with every call queued behind a spin kernel first
(``torch.cuda._sleep``), so no host time shows; null with the reason where
the host could not queue them all in time (or on CPU). The cache's deferred
accesses are applied before each round (a sync it otherwise makes every ~4M
routed ids), so no timed window holds one. Neither side times
the router (top-k) or the weighted sum's inputs; the offloaded side also
times its cache books, slot lookup, row sort, gathers and un-permute, which
plain grouped_mm leaves out (the target counts them as the block's overhead).

Wall time by phase: ``setup_s`` (``before_run``: the process's start-up,
imports and CLI; ``checkpoint``: the synthetic checkpoint written, reused or
temporary, as ``checkpoint`` says; on CUDA with MXFP4 experts
``mxfp4_kernel_probes``: the Triton kernels' first-use compiles and the
fused GEMM's probe; ``load``, ``resident_blocks``, ``link_probe``,
``hbm_probe``), ``phases_s`` per run (``measure`` with its
``measure_warmup_repeat``, where first-use compiles at ``--tokens`` land;
``all_hit``; ``mxfp4_dequant_speed``), each all-hit point's ``setup_s``
(``first_call``: compiles and autotuning new to that token count; ``point``)
and ``run_s``, ``close_adapter_s``. Each phase also prints a line to stderr
as it starts and ends, so a run cut by a timeout says where it was.

``--synthetic-cache`` (default ``$PDFLASH_CACHE/synthetic-moe`` when
``PDFLASH_CACHE`` is set) keeps the synthetic checkpoint between runs, keyed
by its arguments (:func:`pdflash.models.synthetic.cached_synthetic_checkpoint`);
``--checkpoint-only`` writes (or finds) it and stops, so a timed run after it
does not write one.

Output: one JSON object (see ``run``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HELP = "offloaded vs resident MoE forward per layer: time, hit rate, bytes moved, max_abs_err"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arch",
        default="qwen3_moe",
        help="qwen3_moe | gpt_oss | mixtral | olmoe, or a preset name "
        "(qwen3-30b-a3b, gpt-oss-20b, mixtral-8x7b, olmoe-1b-7b)",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="synthetic preset (default: tiny on CPU, the published shape on CUDA)",
    )
    p.add_argument(
        "--weights", default=None, help="a checkpoint directory instead of synthetic weights"
    )
    p.add_argument(
        "--cache-fraction",
        default="0.5",
        help="fraction of all experts the device cache holds; a comma list "
        "(0.2,0.5) measures each on the same weights and prints {runs: [...]}",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="truncate the synthetic model to N layers (default: 8 for published shapes, all for tiny)",
    )
    p.add_argument("--tokens", type=int, default=16, help="tokens per forward (one sequence)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument(
        "--dtype",
        default=None,
        help="bfloat16 | float16 | float32 (default: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument("--policy", default="lru", help="lru | lfu | route_ahead")
    p.add_argument(
        "--expert-dtype",
        default=None,
        choices=["dense", "fp8"],
        help="how experts are stored: default as the checkpoint stores them (gpt-oss MXFP4 "
        "stays MXFP4); dense = dequantized to the compute dtype at pack time; fp8 = dense "
        "checkpoints' experts as e4m3 with per-output-channel scales (half of bf16; its error "
        "vs the checkpoint's experts is reported in fp8_error)",
    )
    p.add_argument(
        "--all-hit-tokens",
        default="16,64,256",
        help="token counts of the per-layer all-hit comparison (empty: skip it)",
    )
    p.add_argument("--all-hit-iters", type=int, default=20, help="timed calls per all-hit point")
    p.add_argument(
        "--all-hit-rounds",
        type=int,
        default=3,
        help="interleaved timing rounds per all-hit point (offloaded, plain, ...; medians)",
    )
    p.add_argument(
        "--synthetic-format",
        default=None,
        choices=["mxfp4"],
        help="write synthetic gpt-oss experts as MXFP4 blocks/scales (as released checkpoints are)",
    )
    p.add_argument(
        "--mxfp4-dequantizer",
        default=None,
        choices=["auto", "torch", "triton"],
        help="how MXFP4 experts are dequantized on CUDA (default: PDFLASH_MXFP4_DEQUANT, else "
        "auto = the Triton kernel when it runs, torch otherwise; both give the same bits); "
        "triton fails rather than falling back",
    )
    p.add_argument(
        "--compressed-gemm",
        default=None,
        choices=["auto", "dequant", "fused", "both"],
        help="how the grouped path multiplies by compressed (MXFP4/FP8) experts: dequant = "
        "dequantize the used slots then grouped_mm; fused = one Triton dequantize-GEMM "
        "launch per projection over the slab; auto = fused where it runs (CUDA, triton), "
        "else dequant; both = build dequant, and time both on every all-hit point, "
        "interleaved (rows: by_compressed_gemm; MXFP4 rows time the fused kernel as fused "
        "(registers), fused_dot_scaled (tl.dot_scaled) and fused_cuda (the CUDA kernel), or "
        "say why not). Default: PDFLASH_COMPRESSED_GEMM, else auto",
    )
    p.add_argument(
        "--row-sort",
        default=None,
        choices=["plan_atomic", "plan", "counting", "sort", "both", "all"],
        help="how the offloaded block orders its routed rows (pdflash.models.offload."
        "set_row_sort): plan_atomic (default; PDFLASH_ROW_SORT), plan, counting or sort; "
        "both = plan_atomic in the main fields, counting timed in the same all-hit rounds "
        "(rows: by_row_sort); all = both and plan (the stable plan) too",
    )
    p.add_argument(
        "--resident-graphs",
        default=None,
        choices=["off", "on", "both"],
        help="whether the offloaded block replays a recording (CUDA graph) of an all-resident "
        "layer's device work (pdflash.models.resident_graphs.set_resident_graphs): off "
        "(default; PDFLASH_RESIDENT_GRAPHS) or on; both = off (eager) in the main fields, on "
        "timed in the same all-hit rounds (rows: by_resident_graphs)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint-only",
        action="store_true",
        help="write (or find) the synthetic checkpoint in --synthetic-cache and stop: "
        "prints {checkpoint, path, setup_s} (a set-up step before a timed run)",
    )
    p.add_argument(
        "--synthetic-cache",
        default=None,
        help="directory where the synthetic checkpoint is written once and reused while its "
        "arguments (and the writer, torch, transformers) are unchanged; 'off': a temporary "
        "checkpoint per run. Default: $PDFLASH_CACHE/synthetic-moe when PDFLASH_CACHE is set, "
        "else off",
    )
    p.add_argument(
        "--resident-experts",
        default=None,
        help="transformers experts implementation for the resident baseline "
        "(grouped_mm | batched_mm | eager; default: transformers' choice)",
    )


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _process_age_s() -> Any:
    """Seconds since this process started (Linux /proc; NotMeasured elsewhere):
    at :func:`run`'s start, the interpreter's start-up, imports and CLI."""
    from pdflash.metrics import NotMeasured

    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return NotMeasured("no /proc/self/stat: the process's start time is unknown")


class _Phases:
    """Wall seconds of a run's phases (the row's ``setup_s`` and
    ``phases_s``). Each phase prints a line to stderr when it starts and when
    it ends, so a run cut short by a timeout says in its log where it was."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.s: dict[str, float] = {}

    def note(self, text: str) -> None:
        print(f"moe [{time.perf_counter() - self.t0:7.2f} s] {text}", file=sys.stderr, flush=True)

    @contextmanager
    def phase(self, name: str, device: Any = None) -> Iterator[None]:
        """Time the block as ``name`` (added to an earlier one of that name);
        with ``device``: synchronized at both ends (its queued work counts)."""
        self.note(f"{name} ...")
        if device is not None:
            _sync(device)
        t = time.perf_counter()
        yield
        if device is not None:
            _sync(device)
        dt = time.perf_counter() - t
        self.s[name] = self.s.get(name, 0.0) + dt
        self.note(f"{name} done in {dt:.2f} s")


class _Timer:
    """Per-module elapsed times via hooks (CUDA events, or host clocks on CPU)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.marks: dict[str, list[Any]] = {}
        self.handles: list[Any] = []

    def watch(self, name: str, module: Any) -> None:
        import torch

        cuda = self.device.type == "cuda"

        def stamp() -> Any:
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                return ev
            return time.perf_counter()

        def pre(_m: Any, _a: Any) -> None:
            self.marks.setdefault(name, []).append([stamp(), None])

        def post(_m: Any, _a: Any, _o: Any) -> None:
            self.marks[name][-1][1] = stamp()

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def collect_ms(self) -> dict[str, float]:
        _sync(self.device)
        out: dict[str, float] = {}
        for name, pairs in self.marks.items():
            total = 0.0
            for a, b in pairs:
                total += a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3
            out[name] = total
        self.marks = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _jsonable(obj: Any) -> Any:
    """Nested dicts with :class:`NotMeasured` leaves -> JSON: the value becomes
    null and its reason goes to that level's ``"not_measured"``."""
    from pdflash.metrics import NotMeasured

    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        reasons: dict[str, str] = {}
        for k, v in obj.items():
            if isinstance(v, NotMeasured):
                out[k] = None
                reasons[k] = v.reason
            else:
                out[k] = _jsonable(v)
        if reasons:
            out["not_measured"] = {**out.get("not_measured", {}), **reasons}
        return out
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _link_gbps(device: Any) -> Any:
    import torch

    from pdflash.metrics import NotMeasured

    if device.type != "cuda":
        return NotMeasured("no CUDA device: no host-to-device link")
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    _sync(device)
    return 3 * n / (time.perf_counter() - t0) / 1e9


def _hbm_gbps(device: Any) -> Any:
    """Device-to-device copy bandwidth, counted as bytes read + bytes written
    (:func:`pdflash.engine.roofline.measure_hbm_gbps`, the engine rows' probe)."""
    from pdflash.engine.roofline import measure_hbm_gbps
    from pdflash.metrics import NotMeasured

    gbps = measure_hbm_gbps(device)
    return NotMeasured(gbps) if isinstance(gbps, str) else gbps


def _time_us(fn: Any, iters: int, device: Any) -> float:
    import torch

    for _ in range(3):
        fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        _sync(device)
        return float(start.elapsed_time(end)) * 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


#: what each side of an all-hit row times (stated in every run's row)
ALL_HIT_TIMING = {
    "method": "the same for both sides: see *_us, *_host_us, *_device_us",
    "us": "CUDA events around --all-hit-iters back-to-back calls, per call (CPU: perf_counter); "
    "a side whose host issues slower than its device runs is timed at the host's pace",
    "host_us": "perf_counter around the same loop, per call: the host's time to issue one call "
    "(with any wait for a full launch queue)",
    "device_us": "CUDA events around the calls queued behind a torch.cuda._sleep spin (every call "
    "issued before the device reaches the first): the device's time alone, over *_device_iters "
    "calls (fewer than iters where the launch queue would fill)",
    "offloaded_all_hit": "OffloadedMoE.forward_routed(layer, x, ids, weights) with every expert "
    "of the layer resident: cache books (pin, deferred access, unpin), slot lookup, row sort, "
    "x gather, the grouped MLP over the slab, un-permute, weighted k-way sum",
    "grouped_mm_active": "the arch's grouped MLP alone (GroupedExperts.forward) on rows already "
    "sorted by expert and gathered, over the active experts' dense weights stacked contiguously",
    "neither": "router / top-k, the norm, building the inputs",
}


def _dense_stacked(ad: Any, flat_ids: list[int], device: Any) -> dict[str, Any]:
    """The given experts' dense compute weights stacked ``[G, ...]`` on
    ``device``: the stored (packed) bytes are moved and stacked there first
    and dequantized there (an MXFP4 expert dequantized on the host costs
    ~0.1 s of CPU; the dequantizers give the same bits on either device)."""
    import torch

    per = [ad.store.views(g) for g in flat_ids]
    # each expert copied from the (pinned) store and stacked on the device:
    # no host-side stack of the layer's bytes
    packed = {n: torch.stack([w[n].to(device) for w in per]) for n in per[0]}
    return {n: w.contiguous() for n, w in ad.dense_expert_weights(packed).items()}


_CYCLES_PER_US: dict[str, float] = {}


def _spin_cycles_per_us(device: Any) -> float:
    """``torch.cuda._sleep`` cycles per µs on ``device`` (measured once)."""
    import torch

    key = str(device)
    if key not in _CYCLES_PER_US:
        cycles = 20_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        _sync(device)
        _CYCLES_PER_US[key] = cycles / max(start.elapsed_time(end) * 1e3, 1.0)
    return _CYCLES_PER_US[key]


#: launches queued behind the spin at most (CUDA's launch queue holds ~1024;
#: a full queue blocks the host until the device drains it)
MAX_QUEUED_LAUNCHES = 600


def _timed(
    fn: Any, iters: int, device: Any, launches_per_call: int | None = None
) -> dict[str, Any]:
    """One timing of ``fn`` (see :data:`ALL_HIT_TIMING`): ``us`` per call of
    back-to-back calls, ``host_us`` the host's issue time per call in that
    loop, and ``device_us`` per call with every call queued behind a spin
    kernel (NotMeasured where it could not be), over ``device_iters`` calls:
    ``iters``, fewer where ``launches_per_call`` says they would overfill the
    launch queue (:data:`MAX_QUEUED_LAUNCHES`)."""
    import torch

    from pdflash.metrics import NotMeasured

    for _ in range(3):
        fn()
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / iters
        return {"us": us, "host_us": us, "device_us": NotMeasured("CPU: no separate device queue")}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host_us = (time.perf_counter() - t0) * 1e6 / iters
    end.record()
    _sync(device)
    out: dict[str, Any] = {"us": float(start.elapsed_time(end)) * 1e3 / iters, "host_us": host_us}
    if getattr(torch.cuda, "_sleep", None) is None:
        out["device_us"] = NotMeasured("this torch has no torch.cuda._sleep")
        return out
    dev_iters = iters
    if launches_per_call:
        dev_iters = max(1, min(iters, MAX_QUEUED_LAUNCHES // launches_per_call))
    out["device_iters"] = dev_iters
    # the spin lasts twice the host's issue time of those calls (at least 2 ms)
    cycles = int(_spin_cycles_per_us(device) * max(2000.0, 2.0 * host_us * dev_iters))
    torch.cuda._sleep(cycles)
    start.record()
    for _ in range(dev_iters):
        fn()
    end.record()
    queued = not start.query()  # the device is still spinning: every call was queued
    _sync(device)
    out["device_us"] = (
        float(start.elapsed_time(end)) * 1e3 / dev_iters
        if queued
        else NotMeasured("the device reached the calls before the host had issued them all")
    )
    return out


#: torch ops that launch no kernel (views, metadata, allocation, no-op casts)
_NO_KERNEL_OPS = frozenset(
    {
        "alias",
        "as_strided",
        "chunk",
        "detach",
        "empty",
        "empty_like",
        "expand",
        "reshape",
        "select",
        "slice",
        "split",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "_reshape_alias",
        "_unsafe_view",
    }
)


def _dispatches(fn: Any) -> dict[str, Any]:
    """The torch ops one call of ``fn`` dispatches (each is host time on a
    GPU host): all of them, and those that may launch a kernel (not a view,
    an allocation or a metadata op; ``to`` counts though it may be a no-op).
    Triton launches are not torch ops and are not counted."""
    from ..op_count import DispatchCounter

    with DispatchCounter() as c:
        fn()
    return {
        "all": sum(c.ops.values()),
        "kernel_ops": sum(n for op, n in c.ops.items() if op not in _NO_KERNEL_OPS),
        "by_op": dict(sorted(c.ops.items())),
    }


def _syncs(fn: Any, device: Any) -> Any:
    """Host syncs torch sees in one call of ``fn`` (CUDA; NotMeasured on CPU)."""
    from pdflash.metrics import NotMeasured

    if device.type != "cuda":
        return NotMeasured("CPU: no device syncs")
    from pdflash.bench.eager_host import count_syncs

    return count_syncs(fn, device)


@contextmanager
def _resident_graphs(mode: str) -> Iterator[None]:
    """Within: the offloaded block's all-resident calls replay recordings
    (``on``) or run eagerly (``off``)."""
    from pdflash.models.resident_graphs import resident_graphs_mode, set_resident_graphs

    before = resident_graphs_mode()
    set_resident_graphs(mode)
    try:
        yield
    finally:
        set_resident_graphs(before)


@contextmanager
def _row_sort(mode: str) -> Iterator[None]:
    """Within: the offloaded block orders its rows by ``mode``."""
    from pdflash.models.offload import row_sort_mode, set_row_sort

    before = row_sort_mode()
    set_row_sort(mode)
    try:
        yield
    finally:
        set_row_sort(before)


def _ratio_or(a: Any, b: Any) -> Any:
    """``a / b``, or the first NotMeasured of the two."""
    from pdflash.metrics import NotMeasured

    for v in (a, b):
        if isinstance(v, NotMeasured):
            return v
    return a / b


def _host_bound(t: dict[str, Any]) -> Any:
    """Whether a side's host issue time per call exceeds its device time."""
    from pdflash.metrics import NotMeasured

    dev = t["device_us"]
    return dev if isinstance(dev, NotMeasured) else bool(t["host_us"] > dev)


def _timing_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of :func:`_timed` that measured a value
    (NotMeasured, with its reason, when none did) and the rounds'
    back-to-back ``us``."""
    from pdflash.metrics import NotMeasured

    out: dict[str, Any] = {"rounds_us": [r["us"] for r in rounds]}
    out["device_iters"] = rounds[0].get("device_iters")
    for key in ("us", "host_us", "device_us"):
        vals = [r[key] for r in rounds]
        good = [v for v in vals if not isinstance(v, NotMeasured)]
        out[key] = _median(good) if good else vals[0]
    return out


def _all_hit(
    ad: Any, args: argparse.Namespace, device: Any, hbm: Any, phases: _Phases | None = None
) -> list[dict[str, Any]]:
    """Per layer and token count: the offloaded block with every routed expert
    resident vs plain grouped_mm on the same active experts vs the roofline.
    Each row's ``setup_s``: wall seconds of the point's parts (``first_call``:
    the block's first call at this token count, synchronized: on CUDA it
    holds the compiles and autotuning of kernels new to this shape;
    ``dense_stack``: the plain side's weights stacked and dequantized;
    ``point``: the whole point); ``phases`` also notes each point on stderr."""
    import torch

    from pdflash.metrics import NotMeasured, ratio
    from pdflash.protocols import Band

    counts = [int(t) for t in str(args.all_hit_tokens).split(",") if t.strip()]
    runtime, cache = ad.runtime, ad.cache
    if not counts or runtime is None or cache is None:
        return []
    if runtime.grouped is None:
        return [{"not_measured": {"all_hit": f"the offloaded block runs the {runtime.path} path"}}]
    from pdflash.models.layout import mxfp4_dequantizer

    # which dequantizer the compressed block runs (None: the experts are not MXFP4)
    dequantizer = mxfp4_dequantizer(device) if ad.layout.format == "mxfp4" else None
    # --compressed-gemm both: the fused MLP beside the runtime's dequant path
    grouped = runtime.grouped
    modes: dict[str, Any] = {}
    modes_not_measured: dict[str, str] = {}
    if args.compressed_gemm == "both" and runtime.compressed_gemm is not None:
        from pdflash.models.compressed_gemm import FusedGemmUnavailableError, set_compressed_gemm

        set_compressed_gemm("fused")
        try:
            fused = ad.grouped_experts().fused
        except FusedGemmUnavailableError as exc:
            fused, modes_not_measured["fused"] = None, str(exc)
        finally:
            set_compressed_gemm("dequant")
        if fused is None:
            modes_not_measured.setdefault("fused", "no fused MLP for this arch's activation")
        else:
            modes = {"dequant": None, "fused": fused}
        if fused is not None and fused.fmt == "mxfp4":
            # both ways of multiplying MXFP4 tiles: registers (fused) and tl.dot_scaled
            from pdflash.models.compressed_gemm import FusedSlabMLP, fused_gemm_unavailable

            kw = {"out_axis": fused.out_axis, "alpha": fused.alpha, "limit": fused.limit}
            modes["fused"] = FusedSlabMLP("mxfp4", fused.act, mxfp4_dot="registers", **kw)
            reason = fused_gemm_unavailable(device, "scaled")
            if reason is None and ad.dtype == torch.bfloat16:
                modes["fused_dot_scaled"] = FusedSlabMLP(
                    "mxfp4", fused.act, mxfp4_dot="scaled", **kw
                )
            else:
                modes_not_measured["fused_dot_scaled"] = reason or "tl.dot_scaled takes bf16"
            # the hand-written CUDA kernel (pdflash_native._mxfp4gemm)
            reason = fused_gemm_unavailable(device, "cuda")
            if reason is None and ad.dtype == torch.bfloat16:
                modes["fused_cuda"] = FusedSlabMLP("mxfp4", fused.act, mxfp4_dot="cuda", **kw)
            else:
                modes_not_measured["fused_cuda"] = (
                    reason or "the CUDA MXFP4 GEMM takes bf16 activations"
                )
    from pdflash.models.offload import row_sort_mode
    from pdflash.models.resident_graphs import resident_graphs_mode

    # other settings of the block timed in the same rounds as the main one:
    # (field of the row, setting, context that applies it)
    variants: list[tuple[str, str, Any]] = []
    if args.row_sort in ("both", "all"):
        variants.append(("by_row_sort", "counting", _row_sort))
    if args.row_sort == "all":
        variants.append(("by_row_sort", "plan", _row_sort))
    if args.resident_graphs == "both":
        variants.append(("by_resident_graphs", "on", _resident_graphs))
    recorded = runtime.resident_graphs
    # each point times one exact token count: recorded at that count (no
    # padding to a bucket), the eager block's kernels and bits
    recorded.token_buckets = ()
    rows = []
    e = ad.num_experts
    gen = torch.Generator().manual_seed(args.seed + 17)
    for layer in range(ad.num_layers):
        for tokens in counts:
            t_point = time.perf_counter()
            x = (torch.randn(tokens, ad.hidden_size, generator=gen) * 0.5).to(device, ad.dtype)
            with torch.inference_mode():
                ids, weights = ad.route(layer, ad.moe_norm(layer, x))
                active = torch.unique(ids).tolist()
                base = layer * e
                # the routed experts first, then the rest of the layer when it fits
                rest = [g for g in range(e) if g not in set(active)]
                cache.prefetch([base + g for g in active + rest][: cache.num_slots], Band.ON_DEMAND)
                cache.drain_inflight()
                path = "layer_resident" if cache.layer_resident(layer) else "routed_resident"

                def block(
                    x: Any = x, ids: Any = ids, weights: Any = weights, layer: int = layer
                ) -> Any:
                    return runtime.forward_routed(layer, x, ids, weights)

                _sync(device)
                t_first = time.perf_counter()
                got = block()
                _sync(device)
                first_call_s = time.perf_counter() - t_first
                # warm-ups: with recordings on, the key is recorded by now (its
                # capture and check are not in a counted or timed call)
                for _ in range(recorded.min_uses):
                    block()
                execution, execution_reason = recorded.last, recorded.last_reason
                by_mode_us: dict[str, list[float]] = {m: [] for m in modes}
                by_mode_out: dict[str, Any] = {}
                for _round in range(2 if modes else 0):  # interleaved: A B A B
                    for mode, fused in modes.items():
                        grouped.fused = fused
                        by_mode_out[mode] = block()
                        by_mode_us[mode].append(_time_us(block, args.all_hit_iters, device))
                if modes:
                    grouped.fused = None
                # plain grouped GEMMs over the active experts' stacked dense weights
                t_stack = time.perf_counter()
                w = _dense_stacked(ad, [base + g for g in active], device)
                _sync(device)
                dense_stack_s = time.perf_counter() - t_stack
                k = ids.shape[1]
                flat = ids.reshape(-1)
                order = torch.argsort(flat, stable=True)
                lookup = torch.full((e,), -1, dtype=torch.long, device=device)
                lookup[torch.tensor(active, device=device)] = torch.arange(
                    len(active), device=device
                )
                group_of_row = lookup[flat[order]]
                offs = torch.cumsum(torch.bincount(group_of_row, minlength=len(active)), 0).to(
                    torch.int32
                )
                xs = x[order // k].contiguous()
                mlp = ad.grouped_experts()

                def plain(
                    xs: Any = xs,
                    w: Any = w,
                    offs: Any = offs,
                    g: Any = group_of_row,
                    mlp: Any = mlp,
                ) -> Any:
                    return mlp.forward(xs, w, offs, g)

                ref_sorted = plain()
                # one untimed call of each side: its torch dispatches and host syncs
                cache.stats()  # (the deferred accesses applied first: not this call's sync)
                block_ops, plain_ops = _dispatches(block), _dispatches(plain)
                block_syncs, plain_syncs = _syncs(block, device), _syncs(plain, device)
                # --row-sort / --resident-graphs both: the block with the other
                # setting, timed in the same rounds (its output, how it ran, its
                # dispatches and syncs from one call after the warm-ups)
                other: dict[tuple[str, str], dict[str, Any]] = {}
                for field, mode, setting in variants:
                    with setting(mode):
                        for _ in range(1 + recorded.min_uses):
                            block()
                        out_v = block()
                        other[field, mode] = {
                            "setting": setting,
                            "out": out_v,
                            "execution": recorded.last,
                            "execution_reason": recorded.last_reason,
                            "ops": _dispatches(block),
                            "syncs": _syncs(block, device),
                            "rounds": [],
                        }
                # both sides timed the same way, interleaved round by round
                block_rounds, plain_rounds = [], []
                for _round in range(max(1, args.all_hit_rounds)):
                    # the accesses deferred so far applied now, not inside a timed
                    # window (the cache applies them every ~4M routed ids, a sync)
                    cache.stats()
                    block_rounds.append(
                        _timed(block, args.all_hit_iters, device, block_ops["kernel_ops"])
                    )
                    for (_field, mode), o in other.items():
                        cache.stats()
                        with o["setting"](mode):
                            o["rounds"].append(
                                _timed(block, args.all_hit_iters, device, o["ops"]["kernel_ops"])
                            )
                    plain_rounds.append(
                        _timed(plain, args.all_hit_iters, device, plain_ops["kernel_ops"])
                    )
                block_t, plain_t = _timing_summary(block_rounds), _timing_summary(plain_rounds)
                by_variant: dict[str, dict[str, Any]] = {f: {} for f, _, _ in variants}
                for (field, mode), o in other.items():
                    t = _timing_summary(o["rounds"])
                    by_variant[field][mode] = {
                        "offloaded_all_hit_us": t["us"],
                        "offloaded_all_hit_host_us": t["host_us"],
                        "offloaded_all_hit_device_us": t["device_us"],
                        "offloaded_all_hit_rounds_us": t["rounds_us"],
                        "offloaded_over_grouped_mm": t["us"] / plain_t["us"],
                        "offloaded_over_grouped_mm_device": _ratio_or(
                            t["device_us"], plain_t["device_us"]
                        ),
                        "offloaded_all_hit_dispatches": o["ops"],
                        "offloaded_all_hit_syncs": o["syncs"],
                        "max_abs_diff_vs_main": float((o["out"].float() - got.float()).abs().max()),
                        "bit_equal_vs_main": bool(torch.equal(o["out"], got)),
                        "offloaded_over_roofline": t["us"],  # divided by the roofline below
                        "offloaded_over_roofline_device": t["device_us"],
                        "offloaded_host_bound": _host_bound(t),
                        "resident_execution": o["execution"],
                        "resident_execution_reason": o["execution_reason"],
                    }
                block_us, plain_us = block_t["us"], plain_t["us"]
                y = torch.empty_like(ref_sorted)
                y[order] = ref_sorted
                want = (y.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)
                err = float((got.float() - want.float()).abs().max())
                del w
            touched = len(active) * ad.expert_nbytes
            roofline: Any = touched / (hbm * 1e9) * 1e6 if not isinstance(hbm, NotMeasured) else hbm
            for variant in by_variant.values():
                for v in variant.values():
                    for name in ("offloaded_over_roofline", "offloaded_over_roofline_device"):
                        v[name] = _ratio_or(v[name], roofline)
                    over = v["offloaded_over_roofline"]
                    v["meets_1p25x_grouped_mm"] = v["offloaded_over_grouped_mm"] <= 1.25
                    v["meets_2x_roofline"] = over if isinstance(over, NotMeasured) else over <= 2.0
            by_mode: dict[str, Any] = {}
            for mode, times in by_mode_us.items():
                us = _median(times)
                out = by_mode_out[mode]
                over_roof_m: Any = (
                    roofline if isinstance(roofline, NotMeasured) else ratio(us, roofline, "")
                )
                by_mode[mode] = {
                    "offloaded_all_hit_us": us,
                    "rounds_us": times,
                    "offloaded_over_grouped_mm": us / plain_us,
                    "offloaded_over_roofline": over_roof_m,
                    "meets_1p25x_grouped_mm": us / plain_us <= 1.25,
                    "meets_2x_roofline": over_roof_m <= 2.0
                    if not isinstance(over_roof_m, NotMeasured)
                    else over_roof_m,
                    "max_abs_err_vs_grouped_mm": float((out.float() - want.float()).abs().max()),
                    "max_abs_err_vs_dequant": float(
                        (out.float() - by_mode_out["dequant"].float()).abs().max()
                    ),
                }
            over_gmm = block_us / plain_us
            point_s = time.perf_counter() - t_point
            if phases is not None:
                phases.note(
                    f"all_hit layer {layer} tokens {tokens}: {point_s:.2f} s (first call "
                    f"{first_call_s:.2f} s, dense stack {dense_stack_s:.2f} s)"
                )
            over_roof: Any = (
                roofline if isinstance(roofline, NotMeasured) else ratio(block_us, roofline, "")
            )
            rows.append(
                {
                    "layer": layer,
                    "tokens": tokens,
                    "active_experts": len(active),
                    "resident_path": path,
                    "weight_bytes_touched": touched,
                    "offloaded_all_hit_us": block_us,
                    "grouped_mm_active_us": plain_us,
                    "hbm_roofline_us": roofline,
                    "offloaded_all_hit_host_us": block_t["host_us"],
                    "grouped_mm_active_host_us": plain_t["host_us"],
                    "offloaded_all_hit_device_us": block_t["device_us"],
                    "grouped_mm_active_device_us": plain_t["device_us"],
                    # calls per device-only timing (fewer than --all-hit-iters where
                    # they would overfill the launch queue; None on CPU)
                    "offloaded_all_hit_device_iters": block_t["device_iters"],
                    "grouped_mm_active_device_iters": plain_t["device_iters"],
                    "offloaded_all_hit_rounds_us": block_t["rounds_us"],
                    "grouped_mm_active_rounds_us": plain_t["rounds_us"],
                    "offloaded_over_grouped_mm_device": _ratio_or(
                        block_t["device_us"], plain_t["device_us"]
                    ),
                    # torch ops per call (kernel_ops: those that may launch one)
                    "offloaded_all_hit_dispatches": block_ops,
                    "grouped_mm_active_dispatches": plain_ops,
                    "offloaded_all_hit_syncs": block_syncs,
                    "grouped_mm_active_syncs": plain_syncs,
                    # the host issues a call slower than its device runs it
                    "offloaded_host_bound": _host_bound(block_t),
                    "grouped_mm_host_bound": _host_bound(plain_t),
                    "offloaded_over_grouped_mm": over_gmm,
                    "offloaded_over_roofline": over_roof,
                    "offloaded_over_roofline_device": _ratio_or(block_t["device_us"], roofline),
                    "meets_1p25x_grouped_mm": over_gmm <= 1.25,
                    "meets_2x_roofline": over_roof <= 2.0
                    if not isinstance(over_roof, NotMeasured)
                    else over_roof,
                    "max_abs_err_vs_grouped_mm": err,
                    "mxfp4_dequantizer": dequantizer,
                    # which compressed GEMM the timed block ran (None: dense experts)
                    "compressed_gemm": runtime.compressed_gemm,
                    # --compressed-gemm both: each mode, timed interleaved on this point
                    "by_compressed_gemm": by_mode or None,
                    "by_compressed_gemm_not_measured": modes_not_measured or None,
                    # which row sort the main fields' block ran; --row-sort both / all:
                    # the others, timed in the same rounds
                    "row_sort": row_sort_mode(),
                    "by_row_sort": by_variant.get("by_row_sort") or None,
                    # whether the main fields' block replayed a recording of the
                    # layer's kernels (graph) or ran eagerly (why: the reason);
                    # --resident-graphs both: the recorded block in the same rounds
                    "resident_graphs": resident_graphs_mode(),
                    "resident_execution": execution,
                    "resident_execution_reason": execution_reason,
                    "by_resident_graphs": by_variant.get("by_resident_graphs") or None,
                    # wall seconds of this point's parts (see the docstring)
                    "setup_s": {
                        "first_call": first_call_s,
                        "dense_stack": dense_stack_s,
                        "point": point_s,
                    },
                }
            )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _mxfp4_dequant_speed(ad: Any, args: argparse.Namespace, device: Any, hbm: Any) -> Any:
    """The MXFP4 dequantizer alone on one layer's worth of experts (every
    expert's gate_up and down blocks/scales, random bytes in the stored
    shapes): time per call and bytes moved per second (blocks + scales read,
    output written) for the torch path and the Triton kernel, against
    ``hbm_gbps`` (counted the same way)."""
    import torch

    from pdflash.metrics import NotMeasured, ratio
    from pdflash.models.layout import dequantize_mxfp4_torch, mxfp4_triton_unavailable

    if ad.layout.format != "mxfp4":
        return NotMeasured(f"experts are stored {ad.layout.format}, not MXFP4")
    shapes = {c.name: c.shape for c in ad.layout.components}
    gen = torch.Generator().manual_seed(args.seed + 29)
    parts = []
    for name in ("gate_up", "down"):
        lead = (ad.num_experts, *shapes[f"{name}_scales"])
        blocks = torch.randint(0, 256, (*lead, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(110, 140, lead, generator=gen, dtype=torch.uint8)
        parts.append((blocks.to(device), scales.to(device)))
    out_bytes = (
        sum(s.numel() * 32 for _, s in parts) * torch.empty((), dtype=ad.dtype).element_size()
    )
    moved = sum(b.numel() + s.numel() for b, s in parts) + out_bytes
    kernels: dict[str, Any] = {"torch": dequantize_mxfp4_torch}
    reason = mxfp4_triton_unavailable(device)
    if reason is None:
        from pdflash.models.mxfp4_triton import dequantize_mxfp4_triton

        kernels["triton"] = dequantize_mxfp4_triton
    result: dict[str, Any] = {
        "experts": ad.num_experts,
        "bytes_moved_per_call": moved,
        "output_bytes": out_bytes,
    }
    want = None
    for name, fn in kernels.items():

        def call(fn: Any = fn) -> Any:
            return [fn(b, s, ad.dtype) for b, s in parts]

        got = call()
        if want is None:
            want = got
        elif not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
            raise RuntimeError(f"the {name} MXFP4 dequantizer disagrees with the torch path")
        del got
        us = _time_us(call, args.all_hit_iters, device)
        gbps = moved / (us * 1e-6) / 1e9
        result[f"{name}_us"] = us
        result[f"{name}_gbps"] = gbps
        result[f"{name}_over_hbm"] = (
            hbm if isinstance(hbm, NotMeasured) else ratio(gbps, hbm, "hbm_gbps is 0")
        )
    if reason is not None:
        for key in ("us", "gbps", "over_hbm"):
            result[f"triton_{key}"] = NotMeasured(reason)
        result["triton_speedup"] = NotMeasured(reason)
    else:
        result["triton_speedup"] = result["torch_us"] / result["triton_us"]
    return result


def _fp8_error(ad: Any, path: Path, issuer: Any, args: argparse.Namespace, device: Any) -> Any:
    """FP8-stored experts vs the checkpoint's own experts on one sequence of
    256 seeded tokens: logit error, and how often the greedy (argmax) next
    token agrees at each of the 256 positions (same prefix for both: the
    teacher-forced greedy agreement)."""
    import torch

    from pdflash.models import load_adapter

    ref = load_adapter(path, device=device, dtype=ad.dtype, issuer=issuer, cache_fraction=1.0)
    try:
        gen = torch.Generator().manual_seed(args.seed + 256)
        ids = torch.randint(0, ad.vocab_size, (256,), generator=gen)
        with torch.inference_mode():
            want = ref.forward_logits(ids).float()
            got = ad.forward_logits(ids).float()
        err = float((got - want).abs().max())
        scale = float(want.abs().max())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        return {
            "tokens": 256,
            "logit_max_abs_err": err,
            "logit_rel_err": err / scale if scale > 0 else None,
            "logit_mean_abs_err": float((got - want).abs().mean()),
            "greedy_agreement_teacher_forced": agree,
            "reference_expert_nbytes": ref.expert_nbytes,
            "fp8_expert_nbytes": ad.expert_nbytes,
        }
    finally:
        ref.close()


def _measure(
    ad: Any, issuer: Any, resident: list[Any], args: argparse.Namespace, device: Any
) -> dict[str, Any]:
    import torch

    from pdflash.metrics import ratio

    assert ad.cache is not None
    timer = _Timer(device)
    for i, layer in enumerate(ad._layers):
        timer.watch(f"layer{i}", layer)
        timer.watch(f"moe{i}", ad.blocks[i])
        timer.watch(f"moe{i}", resident[i])
    captured: list[tuple[int, Any, Any]] = []

    def capture(layer: int) -> Any:
        def hook(_m: Any, a: Any, out: Any) -> None:
            captured.append(
                (layer, a[0].detach(), (out[0] if isinstance(out, tuple) else out).detach())
            )

        return hook

    cap_handles = [blk.register_forward_hook(capture(i)) for i, blk in enumerate(ad.blocks)]
    gen = torch.Generator().manual_seed(args.seed)
    per: dict[str, dict[str, list[float]]] = {"resident": {}, "offloaded": {}}
    fwd: dict[str, list[float]] = {"resident": [], "offloaded": []}
    max_err = 0.0
    max_ref = 0.0
    moe_err = 0.0
    moe_ref = 0.0
    busy0 = 0.0
    warmup_s = 0.0
    for rep in range(args.repeats + 1):
        t_rep = time.perf_counter()
        ids = torch.randint(0, ad.vocab_size, (args.tokens,), generator=gen)
        if rep == 1:
            ad.cache.reset_stats()  # the warm-up repeat is not counted
            busy0 = float(issuer.stats()["link_busy_s"])
        outs = {}
        for mode in ("resident", "offloaded"):
            _sync(device)
            t = time.perf_counter()
            with torch.inference_mode():
                if mode == "resident":
                    with ad.swapped_blocks(resident):
                        logits = ad.forward_logits(ids)
                else:
                    logits = ad.forward_logits(ids)
            _sync(device)
            elapsed = (time.perf_counter() - t) * 1e3
            ms = timer.collect_ms()
            outs[mode] = logits.float()
            if rep == 0:
                warmup_s = time.perf_counter() - t_rep
                continue
            fwd[mode].append(elapsed)
            for k, v in ms.items():
                per[mode].setdefault(k, []).append(v)
        if rep > 0:
            max_err = max(max_err, float((outs["offloaded"] - outs["resident"]).abs().max()))
            max_ref = max(max_ref, float(outs["resident"].abs().max()))
            # each offloaded MoE block vs the resident block on the same input
            with torch.inference_mode():
                for layer, x, y in captured:
                    want = resident[layer](x)
                    want = (want[0] if isinstance(want, tuple) else want).float()
                    moe_err = max(moe_err, float((y.float() - want).abs().max()))
                    moe_ref = max(moe_ref, float(want.abs().max()))
            _sync(device)
            timer.collect_ms()  # drop the resident calls above from the timings
        captured.clear()
    for h in cap_handles:
        h.remove()
    timer.remove()
    issuer_stats = issuer.stats()
    link_busy_s = float(issuer_stats["link_busy_s"]) - busy0
    st = ad.cache.stats()
    offloaded_s = sum(fwd["offloaded"]) / 1e3
    per_layer = []
    for i in range(ad.num_layers):
        r_l, o_l = _median(per["resident"][f"layer{i}"]), _median(per["offloaded"][f"layer{i}"])
        per_layer.append(
            {
                "layer": i,
                "resident_ms": r_l,
                "offloaded_ms": o_l,
                "resident_moe_ms": _median(per["resident"][f"moe{i}"]),
                "offloaded_moe_ms": _median(per["offloaded"][f"moe{i}"]),
                "offloaded_over_resident": o_l / r_l if r_l > 0 else None,
            }
        )
    cfg = ad.config
    return {
        "expert_format": ad.layout.format,
        "moe_path": ad.runtime.path,
        "layers": ad.num_layers,
        "num_experts": ad.num_experts,
        "top_k": ad.top_k,
        "hidden_size": ad.hidden_size,
        "expert_nbytes": ad.expert_nbytes,
        "total_expert_bytes": ad.store.total_nbytes,
        "cache_slots": ad.cache.num_slots,
        "cache_bytes": ad.cache.num_slots * ad.expert_nbytes,
        "policy": args.policy,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "experts_implementation_resident": getattr(cfg, "_experts_implementation", None),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "forward_ms": {m: _median(v) for m, v in fwd.items()},
        # wall seconds of the uncounted warm-up repeat (both forwards): on CUDA
        # it holds the first-use compiles and autotuning at --tokens
        "warmup_repeat_s": warmup_s,
        "per_layer": per_layer,
        "hits": st["hits"],
        "misses": st["misses"],
        "evictions": st["evictions"],
        "bytes_moved": st["bytes_in"],
        "bytes_moved_per_forward": st["bytes_in"] / args.repeats,
        "copies": st["copies"],
        "issuer_backend": issuer.backend,
        "issuer": issuer_stats,  # cumulative over the whole run (all fractions, warm-up)
        "_metrics": {
            "hit_rate": st["hit_rate"],
            "useful_byte_fraction": st["useful_byte_fraction"],
            # bytes copied / wall time of the offloaded forwards (not link-busy time)
            "h2d_gbps_over_forward": ratio(
                st["bytes_in"] / 1e9, offloaded_s, "no offloaded forward timed"
            ),
            # issuer copy-stream busy time during the measured offloaded forwards
            "link_busy_s": link_busy_s,
            "link_busy_fraction": ratio(link_busy_s, offloaded_s, "no offloaded forward timed"),
            "h2d_gbps_while_busy": ratio(
                st["bytes_in"] / 1e9, link_busy_s, "the link was never busy"
            ),
            "max_abs_err": max_err,
            "max_abs_logit_resident": max_ref,
            "rel_err": ratio(max_err, max_ref, "resident logits are all zero"),
            # NOTE: in bf16 the logits can differ beyond rounding when a 1-ulp
            # change flips a near-tie in top-k; the per-block error isolates
            # the offloaded computation (same input to both blocks).
            "moe_max_abs_err": moe_err,
            "moe_rel_err": ratio(moe_err, moe_ref, "resident MoE outputs are all zero"),
        },
    }


def _end_settings(args: argparse.Namespace) -> None:
    """This run's --row-sort / --resident-graphs settings end with it."""
    if args.row_sort is not None:
        from pdflash.models.offload import set_row_sort

        set_row_sort(None)
    if args.resident_graphs is not None:
        from pdflash.models.resident_graphs import set_resident_graphs

        set_resident_graphs(None)


def _synthetic_cache_dir(args: argparse.Namespace) -> Path | None:
    """Where the synthetic checkpoint is cached (None: a temporary one)."""
    if args.synthetic_cache is not None:
        return None if args.synthetic_cache == "off" else Path(args.synthetic_cache)
    root = os.environ.get("PDFLASH_CACHE")
    return Path(root) / "synthetic-moe" if root else None


def _stores_mxfp4(path: Path, args: argparse.Namespace) -> bool:
    """Whether the checkpoint's experts stay MXFP4 in the store (so the
    adapter probes the MXFP4 kernels when it is built)."""
    import json

    if args.expert_dtype is not None:
        return False
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def run(args: argparse.Namespace) -> dict[str, Any]:
    before_run = _process_age_s()
    phases = _Phases()
    import torch

    from pdflash.h2d import H2DIssuer
    from pdflash.metrics import metrics_to_json
    from pdflash.models import PRESET_ARCH, load_adapter, write_synthetic_checkpoint
    from pdflash.models.layout import (
        mxfp4_dequant_calls,
        mxfp4_dequantizer,
        mxfp4_triton_unavailable,
        set_mxfp4_dequantizer,
    )
    from pdflash.models.synthetic import cached_synthetic_checkpoint

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.compressed_gemm is not None:
        from pdflash.models.compressed_gemm import (
            fused_gemm_unavailable,
            fused_mxfp4_dot,
            set_compressed_gemm,
        )

        if args.compressed_gemm == "fused":
            reason = fused_gemm_unavailable(device, fused_mxfp4_dot(device))
            if reason is not None:
                raise SystemExit(f"--compressed-gemm fused: {reason}")
        set_compressed_gemm("dequant" if args.compressed_gemm == "both" else args.compressed_gemm)
    if args.row_sort is not None:
        from pdflash.models.offload import DEFAULT_ROW_SORT, set_row_sort

        set_row_sort(DEFAULT_ROW_SORT if args.row_sort in ("both", "all") else args.row_sort)
    if args.resident_graphs is not None:
        from pdflash.models.resident_graphs import set_resident_graphs

        set_resident_graphs("off" if args.resident_graphs == "both" else args.resident_graphs)
    if args.mxfp4_dequantizer is not None:
        try:
            set_mxfp4_dequantizer(args.mxfp4_dequantizer)
        except RuntimeError as exc:
            raise SystemExit(f"--mxfp4-dequantizer {args.mxfp4_dequantizer}: {exc}") from exc
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    arch, preset = args.arch, args.preset
    if arch in PRESET_ARCH:
        arch, preset = PRESET_ARCH[arch], preset or arch
    if preset is None:
        default_full = {
            "qwen3_moe": "qwen3-30b-a3b",
            "gpt_oss": "gpt-oss-20b",
            "mixtral": "mixtral-8x7b",
            "olmoe": "olmoe-1b-7b",
        }
        preset = default_full[arch] if device.type == "cuda" else "tiny"
    if args.repeats < 1 or args.tokens < 1:
        raise SystemExit("--repeats and --tokens must be >= 1")

    tmp: tempfile.TemporaryDirectory[str] | None = None
    cache_dir = _synthetic_cache_dir(args)
    if args.checkpoint_only and not args.weights and cache_dir is None:
        raise SystemExit("--checkpoint-only needs a cache: --synthetic-cache DIR or PDFLASH_CACHE")
    with phases.phase("checkpoint"):
        if args.weights:
            path = Path(args.weights)
            weights, checkpoint = "checkpoint", "given"
        else:
            synth: dict[str, Any] = dict(
                # NOTE: published shapes default to 8 layers (a full qwen3-30b-a3b is ~58 GB
                # of experts); 8 keeps a 0.2 cache >= one layer's routed experts for 16 tokens
                num_layers=args.layers if args.layers is not None or preset == "tiny" else 8,
                dtype=dtype,
                seed=args.seed,
                device=device.type,
                shard_bytes=4 << 30,
                expert_format=args.synthetic_format,
            )
            if cache_dir is not None:
                path, reused = cached_synthetic_checkpoint(cache_dir, arch, preset, **synth)
                checkpoint = "reused" if reused else "written"
            else:
                tmp = tempfile.TemporaryDirectory(prefix="pdflash-moe-")
                path = write_synthetic_checkpoint(Path(tmp.name) / arch, arch, preset, **synth)
                checkpoint = "temporary"
            weights = "synthetic"
    write_s = phases.s["checkpoint"]
    if args.checkpoint_only:
        _end_settings(args)
        return dict(
            _jsonable(
                {
                    "suite": "moe",
                    "checkpoint": checkpoint,
                    "path": str(path),
                    "setup_s": {"before_run": before_run, **phases.s},
                }
            )
        )

    fractions = [float(f) for f in str(args.cache_fraction).split(",") if f.strip()]
    if not fractions:
        raise SystemExit("--cache-fraction needs at least one value")
    with phases.phase("issuer"):
        issuer = H2DIssuer(
            backend="cuda" if device.type == "cuda" else "host",
            device=(device.index or 0) if device.type == "cuda" else 0,
        )
    try:
        if device.type == "cuda" and _stores_mxfp4(path, args):
            # the MXFP4 kernels' first-use probes (Triton compiles and, for the
            # fused GEMM, autotuning on a small case): cached per device, so
            # building the adapter below reuses them
            from pdflash.models.compressed_gemm import choose_compressed_gemm

            with phases.phase("mxfp4_kernel_probes", device):
                mxfp4_dequantizer(device)
                choose_compressed_gemm(device, "mxfp4")
        with phases.phase("load", device):
            ad = load_adapter(
                path,
                device=device,
                dtype=dtype,
                issuer=issuer,
                cache_fraction=fractions[0],
                max_batch_tokens=min(args.tokens, 16),
                policy=args.policy,
                expert_dtype=args.expert_dtype,
            )
        load_s = phases.s["load"]
        if args.resident_experts:
            ad.hf_model.config._experts_implementation = args.resident_experts
        with phases.phase("resident_blocks", device):
            resident = [ad.resident_block(i) for i in range(ad.num_layers)]
        fp8_error = None
        if args.expert_dtype == "fp8":
            with phases.phase("fp8_error", device):
                fp8_error = _fp8_error(ad, path, issuer, args, device)
        with phases.phase("link_probe"):
            link = _link_gbps(device)
        with phases.phase("hbm_probe"):
            hbm = _hbm_gbps(device)
        # the setup's phases (the runs' own are in each row's phases_s)
        setup_s: dict[str, Any] = {"before_run": before_run, **phases.s}
        runs = []
        for k, fraction in enumerate(fractions):
            if k > 0:  # same weights and store, a fresh cache of another size
                ad.detach_cache()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                ad.attach_new_cache(
                    issuer,
                    fraction=fraction,
                    max_batch_tokens=min(args.tokens, 16),
                    policy=args.policy,
                )
            calls_before = mxfp4_dequant_calls()
            phases.s = {}
            with phases.phase(f"measure (cache {fraction})"):
                row = _measure(ad, issuer, resident, args, device)
            measure_s = phases.s.pop(f"measure (cache {fraction})")
            with phases.phase(f"all_hit (cache {fraction})"):
                all_hit = _all_hit(ad, args, device, hbm, phases)
            all_hit_s = phases.s.pop(f"all_hit (cache {fraction})")
            run_phases: dict[str, Any] = {
                "measure": measure_s,
                "measure_warmup_repeat": row["warmup_repeat_s"],
                "all_hit": all_hit_s,
            }
            calls = mxfp4_dequant_calls()
            if ad.layout.format == "mxfp4":
                # which dequantizer the dispatcher picks here, and which ran (calls in this run)
                row["mxfp4_dequantizer"] = mxfp4_dequantizer(device)
                row["mxfp4_triton_unavailable"] = mxfp4_triton_unavailable(device)
                row["mxfp4_dequant_calls"] = {n: calls[n] - calls_before[n] for n in calls}
                row["mxfp4_dequant_speed"] = None
                if k == 0:
                    with phases.phase("mxfp4_dequant_speed"):
                        row["mxfp4_dequant_speed"] = _mxfp4_dequant_speed(ad, args, device, hbm)
                    run_phases["mxfp4_dequant_speed"] = phases.s.pop("mxfp4_dequant_speed")
            else:
                row["mxfp4_dequantizer"] = None  # experts are not MXFP4: nothing to dequantize
            checked = [r for r in all_hit if "meets_1p25x_grouped_mm" in r]
            row["all_hit"] = all_hit
            # wall seconds of this run's parts (write_s, load_s: the setup)
            row["measure_s"], row["all_hit_s"] = measure_s, all_hit_s
            # wall seconds by phase: the setup's (before_run: the process's start-up,
            # imports and CLI before the suite ran; checkpoint: written, reused or
            # temporary, see "checkpoint") and this run's; run_s: from the suite's
            # start to this row
            row["setup_s"], row["phases_s"] = setup_s, run_phases
            row["run_s"] = time.perf_counter() - phases.t0
            row["checkpoint"] = checkpoint
            row["checkpoint_cache_dir"] = str(cache_dir) if cache_dir is not None else None
            row["all_hit_timing"] = {
                **ALL_HIT_TIMING,
                "iters": args.all_hit_iters,
                "rounds": max(1, args.all_hit_rounds),
            }
            row["compressed_gemm"] = ad.runtime.compressed_gemm if ad.runtime else None
            row["compressed_gemm_reason"] = (
                ad.runtime.compressed_gemm_reason if ad.runtime else None
            )
            row["fp8_error"] = fp8_error  # None unless --expert-dtype fp8
            # recorded all-resident calls over the whole run (replays, captures,
            # eager calls by reason; see pdflash.models.resident_graphs)
            row["resident_graph_stats"] = (
                ad.runtime.resident_graphs.stats.as_dict() if ad.runtime else None
            )
            row["all_hit_targets"] = {
                "rows": len(checked),
                "meets_1p25x_grouped_mm": sum(bool(r["meets_1p25x_grouped_mm"]) for r in checked),
                "meets_2x_roofline": sum(r["meets_2x_roofline"] is True for r in checked),
            }
            row.update(
                {
                    "suite": "moe",
                    "arch": arch,
                    "preset": preset if weights == "synthetic" else None,
                    "weights": weights,
                    "weights_path": str(path) if weights == "checkpoint" else None,
                    "device": str(device),
                    "device_name": torch.cuda.get_device_name(device)
                    if device.type == "cuda"
                    else "cpu",
                    "dtype": str(dtype).removeprefix("torch."),
                    "cache_fraction": fraction,
                    "write_s": write_s,
                    "load_s": load_s,
                }
            )
            row.update(metrics_to_json({**row.pop("_metrics"), "link_gbps": link, "hbm_gbps": hbm}))
            runs.append(row)
        with phases.phase("close_adapter"):
            ad.close()
        for row in runs:
            # after run_s: the adapter's close (its store, slab and pinned memory)
            row["close_adapter_s"] = phases.s["close_adapter"]
        if len(runs) == 1:
            return dict(_jsonable(runs[0]))
        return {"suite": "moe", "runs": _jsonable(runs)}
    finally:
        with phases.phase("close_issuer"):
            issuer.close()
        if tmp is not None:
            with phases.phase("remove_temporary_checkpoint"):
                tmp.cleanup()
        _end_settings(args)
