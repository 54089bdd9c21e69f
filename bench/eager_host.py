"""The host's time per EAGER offloaded verify step, part by part (the small-
batch verify whose experts are partly outside the cache: no CUDA graph).

A synthetic target (``--arch``, ``--layers``; experts and top-k at the
published ratio by default) runs from an expert cache of ``--cache-fraction``
of its experts (the layer-cyclic eviction policy and its ``before_layer``
hook, as every bench baseline) through a
:class:`~pdflash.engine.target.TargetRunner`, optionally with B2's gate
lookahead (:class:`~pdflash.engine.prefetch.GateLookahead`) as a layer
observer and the routing replayed from a proxy trace
(:class:`~pdflash.engine.replay.TraceRouting`). Each step verifies
``--tokens`` fresh random tokens for each of ``--requests`` requests (16: a
block; 2: a verify width of 1), then the KV is rolled back, so every step
has the same shape and keeps missing experts.

Every part is timed with ``time.perf_counter`` around the methods that do
it, **exclusive** of the other timed parts it calls (a call stack), so the
parts and ``glue`` add up to the forward:

- ``attention``: each layer's norm, q/k/v, KV write, paged attention,
  output projection (:meth:`TargetRunner.attention_block`);
- ``router``: the MoE norm, the router's top-k and the routed-grid marks
  (:meth:`TargetRunner.route_block`); with a trace, ``trace_route`` (the
  replayed ids and weights per layer) and ``trace_begin`` (per forward);
- ``policy_hook``: the eviction policy's ``before_layer``;
- ``readback``: the routed counts' device-to-host read of a layer with
  misses (:meth:`OffloadedMoE._routing_on_host`; the one sync it keeps);
- ``books``: the expert cache's host books (``acquire``, ``release``,
  ``pin_layer``, ``unpin_layer``, ``defer_access``, ``free_capacity``,
  ``device_slot_table``) and the row selection of a partial group
  (:meth:`OffloadedMoE._phase_rows`);
- ``waits``: :meth:`ExpertCache.wait_ready` (CPU: the host backend's copy
  itself, on its thread; CUDA: a stream wait, no host block);
- ``gemm``: the grouped GEMM dispatch (sort by slot, offsets, the grouped
  calls, the scatter; the loop path's per-expert calls);
- ``moe_rest``: the rest of the MoE call (the weighted k-way sum, buffers);
- ``stream_routed`` (``--stream``: PD's
  :class:`~pdflash.engine.prefetch.StreamingPrefetcher` instead of the gate
  lookahead): its routed hook (``on_routed``: the layer's exact plan, the
  ``ahead`` copies of the next layers; books and submissions inclusive);
- ``lookahead_router``: the gate lookahead's next-layer router pass and its
  read-back (:meth:`~pdflash.routeahead.NextLayerLookahead.predict_next`);
- ``lookahead``: the rest of the gate lookahead observer (its prefetch
  books and copy submissions, inclusive; with ``stream`` the stream's
  layer-release hook and its pump);
- ``finish``: the logits' split and the routed union;
- ``glue``: the forward outside those (index tensors, embedding, the
  loop over layers, ``lm_head``, the routing grid's read-back).

On CUDA one more (untimed) step runs under torch's sync debug mode:
``syncs.torch_syncs_per_step`` counts the host syncs torch sees in it.

On a CPU every tensor op is its compute (no launch, no sync): the numbers
say which host parts cost most relative to each other. On CUDA the same
timers see launches and syncs: a sync's time includes the device work
queued before it.

    python -P -m pdflash.bench.eager_host --arch gpt_oss --layers 8 --requests 1 --tokens 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdflash.hybrid.affinity import DEFAULT_HOST_AFFINITY

from .op_count import DispatchCounter
from .suites.engine import add_host_switch_arguments

#: the timed parts, in the order a layer meets them
PARTS = (
    "attention",
    "router",
    "trace_begin",
    "trace_route",
    "policy_hook",
    "readback",
    "books",
    "waits",
    "gemm",
    "moe_rest",
    "stream_routed",
    "lookahead_router",
    "lookahead",
    "finish",
)

#: the HOST part's pieces on the forward thread (with ``host_every``):
#: ``host_split`` the service's split (planner, books); ``host_rows`` the
#: HOST rows' selection and gather (:func:`pdflash.hybrid.block.host_rows`);
#: ``host_d2h`` the rows' copy to the host and its event
#: (:meth:`HostExpertExecutor.to_host`); ``host_launch`` the pool submits
#: (``_launch``); ``host_submit`` the rest of ``submit`` (the output buffer);
#: ``host_start`` the rest of the service's ``start`` (books);
#: ``host_part`` the rest of ``start_host_part``; ``host_result``
#: :meth:`HostJob.result` (the wait for the workers, then the result's
#: copy to the device); ``host_finish`` the rest of the service's
#: ``finish`` (books, the planner's observation, the clock);
#: ``host_write`` the rows' write into the block's output
HOST_PARTS = (
    "host_split",
    "host_rows",
    "host_d2h",
    "host_launch",
    "host_submit",
    "host_start",
    "host_part",
    "host_result",
    "host_finish",
    "host_write",
)

#: the host service's planners ``--host-planner`` picks (:func:`measure`)
HOST_PLANNERS = ("forced", "makespan")

#: the published experts / top-k ratio each arch's synthetic target gets by
#: default (gpt-oss-20b: 32 experts top-4; Qwen3-30B-A3B: 128 top-8)
DEFAULT_EXPERTS = {"gpt_oss": (32, 4), "qwen3_moe": (128, 8)}
_EXPERT_KEYS = {"gpt_oss": "num_local_experts", "qwen3_moe": "num_experts"}

#: parts whose callees are not split out (their time is theirs, inclusive),
#: except the parts named here
_INCLUSIVE: dict[str, frozenset[str]] = {
    "lookahead": frozenset({"lookahead_router"}),
    "stream_routed": frozenset({"lookahead_router"}),
}


class _Frame:
    """A timed call in progress: its part, start and its timed callees' seconds."""

    __slots__ = ("callee_ops", "callees", "ops", "part", "start")

    def __init__(self, part: str, start: float, ops: int) -> None:
        self.part, self.start, self.callees = part, start, 0.0
        self.ops, self.callee_ops = ops, 0


class ExclusiveTimer:
    """Per-part exclusive host seconds of nested timed calls; while
    :attr:`counter` is set, also each part's exclusive torch calls
    (:attr:`torch_calls`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.torch_calls: dict[str, int] = defaultdict(int)
        self.counter: DispatchCounter | None = None
        self._stack: list[_Frame] = []

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.torch_calls.clear()

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            stack = self._stack
            if stack:
                split = _INCLUSIVE.get(stack[-1].part)
                if split is not None and part not in split:
                    return fn(*args, **kw)
            counter = self.counter
            frame = _Frame(part, time.perf_counter(), 0 if counter is None else counter.total)
            stack.append(frame)
            try:
                return fn(*args, **kw)
            finally:
                stack.pop()
                spent = time.perf_counter() - frame.start
                self.seconds[part] += spent - frame.callees
                self.calls[part] += 1
                ops = 0 if counter is None else counter.total - frame.ops
                self.torch_calls[part] += ops - frame.callee_ops
                if stack:
                    stack[-1].callees += spent
                    stack[-1].callee_ops += ops

        return timed

    def patch(self, obj: Any, name: str, part: str) -> None:
        """Time every call of ``obj.name`` (an instance attribute over the method)."""
        setattr(obj, name, self.wrap(part, getattr(obj, name)))


def count_syncs(fn: Callable[[], Any], device: torch.device | None = None) -> int:
    """How many host syncs torch sees in ``fn`` (its sync debug mode's
    warnings: device-to-host reads, ``nonzero``, ``item``...; not the native
    issuer's own waits nor CUDA event waits). Only the per-operation
    warnings count: the one-time notice that the debug mode is a prototype
    (its first use in a process) also mentions synchronization."""
    import warnings

    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("called a synchronizing" in str(w.message) for w in seen)


def _checkpoint(
    root: Path,
    arch: str,
    layers: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    preset: str = "tiny",
) -> Path:
    """The synthetic target; a preset other than ``tiny`` (a published
    shape) writes its config only (weights generated when loaded)."""
    from pdflash.models import write_synthetic_checkpoint

    name = f"{arch}-{preset}-{layers}-e{experts}-k{top_k}-{str(dtype).split('.')[-1]}"
    ckpt = root / name
    if not (ckpt / "config.json").is_file():
        overrides = {_EXPERT_KEYS[arch]: experts, "num_experts_per_tok": top_k}
        write_synthetic_checkpoint(
            ckpt,
            arch,
            preset,
            num_layers=layers,
            dtype=dtype,
            seed=3,
            config_overrides=overrides,
            weights="files" if preset == "tiny" else "generated",
        )
    return ckpt


def measure(
    *,
    arch: str = "gpt_oss",
    layers: int = 8,
    requests: int = 1,
    tokens: int = 2,
    prompt_len: int = 32,
    steps: int = 50,
    warm_steps: int = 5,
    cache_fraction: float = 0.2,
    lookahead: bool = True,
    stream: bool = False,
    trace: str | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    device: str = "cpu",
    workdir: Path | None = None,
    seed: int = 0,
    detail: bool = False,
    expert_bytes_as: str | None = None,
    host_every: int | None = None,
    host_threads: int | None = None,
    host_format: str = "packed",
    host_affinity: str = DEFAULT_HOST_AFFINITY,
    preset: str = "tiny",
    host_handoff: str = "thread",
    count_steps: int = 3,
    host_planner: str = "forced",
    host_expert_s: float = 1e-3,
) -> dict[str, Any]:
    """Median host µs per eager verify step of each part (:data:`PARTS`,
    ``glue`` and ``forward``), over ``steps`` steps after ``warm_steps``
    untimed ones. See the module docstring. ``detail``: ``books``, ``gemm``
    and the other method-timed parts are also split per method
    (``detail_us``: ``part.method``). ``expert_bytes_as``: pad every stored
    expert to a published expert's size or a byte count
    (:func:`pdflash.bench.realtext.published_expert_nbytes`): copies, slots
    and waits move that many bytes while the compute stays the tiny
    model's (rows say ``expert_bytes_source: padded``).

    ``host_planner`` (:data:`HOST_PLANNERS`): ``forced`` (the default, with
    ``host_every``) or the cost-model planner (``makespan``) with a
    configured host cost of ``host_expert_s`` per
    expert (``host_every`` then only attaches the service: give 0): a
    costly host makes every plan COPY, the service present but hosting
    nothing, as at a compute-bound point (rows say ``planner`` and
    ``host_cost_source: configured``). ``host.per_step_us`` gives each of
    :data:`HOST_PARTS` per step whether or not a layer hosted (the cost of
    the service's presence).

    ``host_every``: attach a hybrid host service with a forced planner
    (:class:`~pdflash.hybrid.ForcedHostPlanner`): every ``host_every``-th
    missed expert of a layer is HOST; 0 runs the same hook with nothing
    HOST (every miss copied: the baseline). The ``host`` entry then gives
    each of :data:`HOST_PARTS` per hosting layer (the median over steps of
    a step's seconds over its hosting layers), the forward thread's block
    for the workers (``wait``) and the forward less that block.
    ``host_threads``: the service's intra-op threads (default: torch's on
    a CPU, all cores but two on CUDA); ``host_format``: how the host holds
    its experts (:data:`pdflash.hybrid.HOST_FORMAT_CHOICES`; ``auto`` is
    ``packed`` here: nothing is calibrated); ``host_affinity``: where the
    service's threads run (:mod:`pdflash.hybrid.affinity`; the host entry
    records the placement). ``preset``: the synthetic
    shape (``tiny``, or a published one such as ``gpt-oss-20b``, truncated
    to ``layers``; its weights are generated at load). ``host_handoff``:
    the service's hand-off (:mod:`pdflash.hybrid.handoff`); on CUDA
    ``forward_synced_us`` times each step to the device's end (then the
    service's :meth:`~pdflash.hybrid.service.HostExpertService.settle`),
    which compares the hand-offs: with ``stream`` the forward's thread
    returns before the device is done."""
    from pdflash.engine.prefetch import GateLookahead
    from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for
    from pdflash.h2d import H2DIssuer
    from pdflash.hybrid import block as host_block
    from pdflash.hybrid.executor import HostJob
    from pdflash.models import load_adapter

    if arch not in DEFAULT_EXPERTS:
        raise ValueError(f"arch must be one of {sorted(DEFAULT_EXPERTS)}, got {arch!r}")
    if requests < 1 or tokens < 1 or steps < 1 or layers < 1:
        raise ValueError("requests, tokens, steps and layers must be >= 1")
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e_default, k_default = DEFAULT_EXPERTS[arch]
    num_experts = e_default if experts is None else experts
    k = k_default if top_k is None else top_k
    tmp = tempfile.TemporaryDirectory() if workdir is None else None
    root = Path(tmp.name) if tmp is not None else Path(workdir)  # type: ignore[arg-type]
    ckpt = _checkpoint(root, arch, layers, num_experts, k, dtype, preset)
    issuer = H2DIssuer(backend="cuda" if dev.type == "cuda" else "host")
    timer = ExclusiveTimer()
    service: Any = None
    class_patches: list[tuple[Any, str, Any]] = []
    step_s: list[float] = []
    calls_per_step: dict[str, list[int]] = defaultdict(list)
    plan_s: list[float] = []  # the stream's books between forwards (``stream``)
    synced_s: list[float] = []  # each step to the device's end (CUDA)
    handoff: dict[str, Any] | None = None
    wait_s: list[float] = []
    hosting: list[int] = []
    per_step: dict[str, list[float]] = defaultdict(list)
    try:
        pad: dict[str, Any] = {}
        pad_source = None
        if expert_bytes_as is not None:
            from .realtext import published_expert_nbytes

            pad["expert_nbytes"], pad_source = published_expert_nbytes(expert_bytes_as)
        adapter: Any = load_adapter(ckpt, device=dev, **pad)
        cache = adapter.attach_new_cache(
            issuer,
            fraction=cache_fraction,
            policy="layer_cyclic",
            max_batch_tokens=requests * tokens,
        )
        pages = requests * (-(-(prompt_len + 2 * tokens) // 16))
        kv = kv_cache_for(
            adapter, page_size=16, num_pages=pages, dtype=dtype, device=dev, scratch=False
        )
        if host_every is not None:
            from pdflash.hybrid import ForcedHostPlanner, build_host_service

            if host_every < 0:
                raise ValueError(f"host_every must be >= 0, got {host_every}")
            if host_planner not in HOST_PLANNERS:
                raise ValueError(
                    f"host_planner must be one of {HOST_PLANNERS}, got {host_planner!r}"
                )
            planner: Any = (
                ForcedHostPlanner(every=host_every)
                if host_every > 0
                else ForcedHostPlanner(every=None, ids=())
            )
            if host_planner != "forced":
                from pdflash.hybrid import CostModelPlanner, HostCostModel

                planner = CostModelPlanner(
                    HostCostModel(float(host_expert_s), 0.0),
                    int(cache.expert_nbytes),
                )
            service = build_host_service(
                adapter,
                link_bytes_per_s=50e9,
                planner=planner,
                calibrate=False,
                workers=1,
                intra_op_threads=host_threads,
                host_format=host_format,
                handoff=host_handoff,
                host_affinity=host_affinity,
            )
        runner = TargetRunner(adapter, kv, capture_layers=(0, layers // 2, layers - 1), device=dev)
        runner.before_moe_hooks.append(cache.policy.before_layer)
        streamer: Any = None
        if stream:
            from pdflash.engine.prefetch import StreamingPrefetcher

            # PD's prefetch in a forward (it replaces the gate lookahead)
            streamer = StreamingPrefetcher(adapter, cache)
            runner.routed_hooks.append(streamer.on_routed)
            runner.observers.append(streamer)
        elif lookahead:
            runner.observers.append(GateLookahead(adapter, cache))
        routing = None
        if trace is not None:
            from pdflash.engine.replay import TraceRouting, load_replay_trace

            routing = TraceRouting(load_replay_trace(trace), adapter, trace)
            if routing.num_trace_requests < 1:
                raise ValueError(f"{trace}: no trace requests")
            runner.routing = routing
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for i in range(requests):
                kv.add_sequence(i)
                if routing is not None:
                    routing.assign(i, i % routing.num_trace_requests)
                prompt = torch.randint(0, adapter.vocab_size, (prompt_len,), generator=gen)
                runner.forward([Chunk(i, prompt.to(dev), False)])
        runtime = adapter.runtime
        # the parts, patched on the instances (the runner calls them through self)
        for obj, names, part in (
            (runner, ("attention_block",), "attention"),
            (runner, ("route_block",), "router"),
            (runner, ("finish",), "finish"),
            (runtime, ("_routing_on_host",), "readback"),
            (runtime, ("_grouped_rows", "_compute_on_device"), "gemm"),
            (runtime, ("_phase_rows",), "books"),
            (adapter, ("moe_routed",), "moe_rest"),
            (
                cache,
                (
                    "acquire",
                    "release",
                    "pin_layer",
                    "unpin_layer",
                    "defer_access",
                    "free_capacity",
                    "device_slot_table",
                ),
                "books",
            ),
            (cache, ("wait_ready",), "waits"),
        ):
            for name in names:
                timer.patch(obj, name, f"{part}.{name}" if detail else part)
        if service is not None:
            ex = service.executor
            for obj, names, part in (
                (service, ("split",), "host_split"),
                (service, ("start",), "host_start"),
                (service, ("finish",), "host_finish"),
                (ex, ("to_host",), "host_d2h"),
                (ex, ("_launch",), "host_launch"),
                (ex, ("submit",), "host_submit"),
            ):
                for name in names:
                    timer.patch(obj, name, part)
            # module functions and per-call objects: patched on the class/module
            from pdflash.hybrid.block import HostPart

            for owner, name, part in (
                (host_block, "host_rows", "host_rows"),
                (host_block, "start_host_part", "host_part"),
                (HostJob, "result", "host_result"),
                (HostPart, "write_into", "host_write"),
            ):
                real = getattr(owner, name, None)
                if real is None:  # an older block without this piece: timed in its caller
                    continue
                class_patches.append((owner, name, real))
                setattr(owner, name, timer.wrap(part, real))
        runner.before_moe_hooks = [timer.wrap("policy_hook", h) for h in runner.before_moe_hooks]
        runner.routed_hooks = [timer.wrap("stream_routed", h) for h in runner.routed_hooks]
        for obs in runner.observers:
            timer.patch(obs, "after_layer", "lookahead")
            predictor = getattr(obs, "predictor", None) or getattr(obs, "_lookahead", None)
            if predictor is not None:
                timer.patch(predictor, "predict_next", "lookahead_router")
        if routing is not None:
            timer.patch(routing, "route", "trace_route")
            timer.patch(routing, "begin_forward", "trace_begin")

        def step(runner: Any) -> None:
            """One untimed verify step (then the KV rolled back)."""
            chunks = [
                Chunk(
                    i, torch.randint(0, adapter.vocab_size, (tokens,), generator=gen).to(dev), True
                )
                for i in range(requests)
            ]
            with torch.no_grad():
                if streamer is not None:
                    streamer.begin_forward()
                out = runner.forward(chunks)
                between_forwards(out)
            for i in range(requests):
                kv.truncate(i, kv.length(i) - tokens)

        def between_forwards(out: Any) -> None:
            """The stream's books after a verify, as the engine keeps them:
            the routed union scores the plan and is the next forward's
            ``prev_round`` plan (its first layers' copies start now)."""
            if streamer is not None:
                routed = np.asarray(out.routed).any(axis=0)
                streamer.end_forward(routed=routed, next_plan=routed)

        counts0 = (cache.misses, cache.copies)
        with torch.no_grad():
            for n in range(warm_steps + steps):
                if n == warm_steps:
                    step_s.clear()
                    synced_s.clear()
                    per_step.clear()
                    wait_s.clear()
                    hosting.clear()
                    plan_s.clear()
                    counts0 = (cache.misses, cache.copies)
                timer.reset()
                chunks = [
                    Chunk(
                        i,
                        torch.randint(0, adapter.vocab_size, (tokens,), generator=gen).to(dev),
                        True,
                    )
                    for i in range(requests)
                ]
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if service is not None:
                    service.books.reset()
                if streamer is not None:
                    streamer.begin_forward()
                t0 = time.perf_counter()
                out = runner.forward(chunks)
                step_s.append(time.perf_counter() - t0)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                    if service is not None:
                        service.settle()
                    synced_s.append(time.perf_counter() - t0)
                if service is not None:
                    wait_s.append(service.books.wait_s)
                    hosting.append(service.books.layers)
                by_part: dict[str, float] = defaultdict(float)
                for name, sec in timer.seconds.items():
                    by_part[name.split(".")[0]] += sec
                    if detail and "." in name:
                        per_step[name].append(sec)
                for part in PARTS + HOST_PARTS:
                    per_step[part].append(by_part.get(part, 0.0))
                t1 = time.perf_counter()
                between_forwards(out)
                plan_s.append(time.perf_counter() - t1)
                for i in range(requests):
                    kv.truncate(i, kv.length(i) - tokens)
        misses = cache.misses - counts0[0]
        copies = cache.copies - counts0[1]
        expert_nbytes = int(cache.expert_nbytes)
        syncs: dict[str, Any] = {"torch_syncs_per_step": None, "why": "cpu: no device syncs"}
        if dev.type == "cuda":
            syncs = {"torch_syncs_per_step": count_syncs(lambda: step(runner), dev)}
        # torch calls per part: untimed steps under a dispatch counter (its
        # own host cost would skew the timed ones)
        for _ in range(count_steps):
            timer.reset()
            timer.counter = DispatchCounter()
            try:
                with timer.counter:
                    step(runner)
            finally:
                total = timer.counter.total
                timer.counter = None
            by_part_calls: dict[str, int] = defaultdict(int)
            for name, n in timer.torch_calls.items():
                by_part_calls[name.split(".")[0]] += n
            for part in PARTS + HOST_PARTS:
                calls_per_step[part].append(by_part_calls.get(part, 0))
            calls_per_step["total"].append(total)
    finally:
        for owner, name, real in class_patches:
            setattr(owner, name, real)
        if service is not None:
            handoff = service.describe()["host_handoff"]
            service.close()
        issuer.close()
        if tmp is not None:
            tmp.cleanup()
    us = {p: 1e6 * statistics.median(per_step[p]) for p in PARTS}
    forward = 1e6 * statistics.median(step_s)
    glue = [f - sum(per_step[p][i] for p in PARTS + HOST_PARTS) for i, f in enumerate(step_s)]
    host: dict[str, Any] | None = None
    if service is not None:
        host = _host_summary(
            per_step, step_s, wait_s, hosting, host_every, host_threads, host_format
        )
        host["planner"] = host_planner
        host["forced"] = host_planner == "forced"
        if host_planner != "forced":
            host["host_cost_source"] = "configured"
            host["host_expert_s"] = host_expert_s
        host["handoff"] = handoff
        host["affinity"] = service.describe()["affinity"]
    detail_us = {
        name: 1e6 * sum(v) / len(step_s) for name, v in sorted(per_step.items()) if "." in name
    }
    return {
        "what": "median host us per eager offloaded verify step, per part (exclusive)",
        "timing_method": "host_perf_counter",
        "device": dev.type,
        "dtype": str(dtype).split(".")[-1],
        "arch": arch,
        "preset": preset,
        "weights": "synthetic",
        "experts": num_experts,
        "expert_nbytes": expert_nbytes,
        "expert_bytes_source": "padded" if expert_bytes_as is not None else "model",
        "expert_bytes_as": pad_source,
        "top_k": k,
        "layers": layers,
        "requests": requests,
        "tokens_per_request": tokens,
        "prompt_len": prompt_len,
        "cache_fraction": cache_fraction,
        "eviction": "layer_cyclic",
        "lookahead": lookahead and not stream,
        "prefetch": "stream" if stream else "gate_lookahead" if lookahead else "none",
        # PD's stream between forwards (scoring, the next plan, its first
        # copies): outside the forward, as in the engine; None without it
        "stream_plan_us": 1e6 * statistics.median(plan_s) if stream else None,
        "routing_source": "trace" if trace is not None else "router",
        "trace": None if trace is None else Path(trace).name,
        "moe_path": runtime.path,
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "misses_per_step": misses / steps,
        "syncs": syncs,
        "copies_per_step": copies / steps,
        "parts_us": us,
        "torch_calls_per_step": {
            p: statistics.median(v) for p, v in sorted(calls_per_step.items())
        },
        "glue_us": 1e6 * statistics.median(glue),
        "forward_us": forward,
        # to the device's end (CUDA only: on the CPU the forward is synchronous)
        "forward_synced_us": 1e6 * statistics.median(synced_s) if synced_s else None,
        "forward_us_per_layer": forward / layers,
        **({"host": host} if host is not None else {}),
        **({"detail_us_mean": detail_us} if detail else {}),
    }


def _host_summary(
    per_step: dict[str, list[float]],
    step_s: list[float],
    wait_s: list[float],
    hosting: list[int],
    host_every: int | None,
    host_threads: int | None,
    host_format: str,
) -> dict[str, Any]:
    """The HOST pieces per hosting layer (see :func:`measure`)."""
    n = len(step_s)
    with_host = [i for i in range(n) if hosting[i] > 0]

    def per_layer(values: Sequence[float]) -> float | None:
        if not with_host:
            return None
        return 1e6 * statistics.median(values[i] / hosting[i] for i in with_host)

    pieces = {p: per_layer(per_step[p]) for p in HOST_PARTS}
    own = [sum(per_step[p][i] for p in HOST_PARTS) - wait_s[i] for i in range(n)]
    collect = [per_step["host_result"][i] - wait_s[i] for i in range(n)]
    return {
        "forced": True,
        "planner": "forced",
        "host_every": host_every,
        "host_threads": host_threads,
        "host_format": host_format,
        "hosting_layers_per_step": statistics.median(hosting),
        "steps_with_host": len(with_host),
        # None: no step hosted a layer (nothing measured)
        "pieces_us_per_hosting_layer": pieces,
        "wait_us_per_hosting_layer": per_layer(wait_s),
        "collect_us_per_hosting_layer": per_layer(collect),
        "own_us_per_hosting_layer": per_layer(own),
        # every HOST piece per step, hosting or not (the service's presence)
        "per_step_us": {p: 1e6 * statistics.median(per_step[p]) for p in HOST_PARTS},
        "forward_less_wait_us": 1e6
        * statistics.median(f - w for f, w in zip(step_s, wait_s, strict=True)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--arch", default="gpt_oss", choices=sorted(DEFAULT_EXPERTS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2, help="verify tokens per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cache-fraction", type=float, default=0.2)
    ap.add_argument("--no-lookahead", action="store_true", help="without B2's gate lookahead")
    ap.add_argument(
        "--stream",
        action="store_true",
        help="PD's streaming prefetcher (its gate lookahead inside) instead of B2's gate lookahead",
    )
    ap.add_argument("--trace", default=None, help="replay the routing of this proxy trace")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--detail", action="store_true", help="also split parts per method")
    ap.add_argument(
        "--count-steps", type=int, default=3, help="untimed steps counting torch calls per part"
    )
    ap.add_argument(
        "--expert-bytes-as",
        default=None,
        help="pad each stored expert to this published arch's expert size or byte count",
    )
    ap.add_argument(
        "--host-every",
        type=int,
        default=None,
        help="forced HOST split: every N-th missed expert of a layer on the host (0: none)",
    )
    ap.add_argument(
        "--host-planner",
        choices=HOST_PLANNERS,
        default="forced",
        help="forced (with --host-every) or the cost-model planner (makespan) with "
        "a configured host cost (--host-expert-s; with --host-every 0)",
    )
    ap.add_argument(
        "--host-expert-s",
        type=float,
        default=1e-3,
        help="the cost-model planner's configured host seconds per expert",
    )
    ap.add_argument("--host-threads", type=int, default=None, help="the host service's threads")
    ap.add_argument("--host-format", default="packed", help="the host's expert format")
    # no pre-verify plan here, and the planner is forced
    add_host_switch_arguments(ap, ahead=False)
    ap.add_argument(
        "--preset", default="tiny", help="synthetic shape: tiny or a published one (gpt-oss-20b)"
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = measure(
        arch=a.arch,
        layers=a.layers,
        requests=a.requests,
        tokens=a.tokens,
        prompt_len=a.prompt_len,
        steps=a.steps,
        cache_fraction=a.cache_fraction,
        lookahead=not a.no_lookahead,
        stream=a.stream,
        trace=a.trace,
        experts=a.experts,
        top_k=a.top_k,
        device=a.device,
        detail=a.detail,
        expert_bytes_as=a.expert_bytes_as,
        host_every=a.host_every,
        host_threads=a.host_threads,
        host_format=a.host_format,
        host_affinity=a.host_affinity,
        preset=a.preset,
        host_handoff=a.host_handoff,
        count_steps=a.count_steps,
        host_planner=a.host_planner,
        host_expert_s=a.host_expert_s,
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
