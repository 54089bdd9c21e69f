"""The host's time per replayed verify step, part by part (issue 13: the
time a graphed step spends outside its replay).

A B3 target (every expert resident) on a synthetic checkpoint runs verify
steps of ``requests`` x ``block`` tokens through a
:class:`~pdflash.engine.graphs.GraphRunner`, each part of
:meth:`~pdflash.engine.graphs.GraphRunner.forward` timed with
``time.perf_counter`` around it: the KV growth (``plan``), the graph
checks (``blocker``, ``bucket``), the static-buffer fill and its copy
(``fill``), the expert cache's books (``pin``, ``book``), the replay
itself, the split of the logits and the routed union's flat ids
(``finish``); ``rest`` is the forward's time outside those (the gathers of
the real rows, the final norm and ``lm_head``, the routing grid's
read-back, the token copy). The
replay backend is the eager stand-in's (``eager``: the replay reruns the
step) or ``noop`` (the replay does nothing: its outputs stay those of the
capture, so only the host's parts are timed). On a CPU every tensor op is
its compute, not a launch: the Python parts (plan, checks, fill, books,
finish) are what these numbers are for.

    python -m pdflash.bench.graph_host --arch gpt_oss --layers 8 --requests 16 --block 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdflash.engine.graphs import EagerBackend, GraphRunner, Outputs, Replayable

#: the timed parts, in step order
PARTS = ("plan", "blocker", "bucket", "fill", "pin", "replay", "book", "finish")


class _NoopReplay:
    def replay(self) -> None:
        return None


class NoopBackend:
    """Captures by running the step once; replays nothing (host time only)."""

    name = "noop"

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        return _NoopReplay(), fn()


class _TimedReplay:
    def __init__(self, inner: Replayable, record: Callable[[float], None]) -> None:
        self.inner, self.record = inner, record

    def replay(self) -> None:
        t0 = time.perf_counter()
        self.inner.replay()
        self.record(time.perf_counter() - t0)


class _TimedBackend:
    def __init__(self, inner: Any, record: Callable[[float], None]) -> None:
        self.inner, self.record, self.name = inner, record, inner.name

    def capture(self, fn: Callable[[], Outputs]) -> tuple[Replayable, Outputs]:
        graph, out = self.inner.capture(fn)
        return _TimedReplay(graph, self.record), out


def _timed(obj: Any, name: str, record: Callable[[float], None]) -> None:
    """Time every call of ``obj.name`` (an instance attribute over the method)."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            record(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def measure(
    *,
    arch: str = "gpt_oss",
    preset: str = "tiny",
    layers: int = 8,
    requests: int = 16,
    block: int = 16,
    prompt_len: int = 32,
    steps: int = 200,
    backend: str = "noop",
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Median µs per replayed step of each part (:data:`PARTS`, ``rest``
    and ``forward``: the whole :meth:`TargetRunner.forward`), over ``steps``
    verify steps of the same bucket (the KV rolled back after each, so the
    shape stays), after 5 untimed ones (the capture among them)."""
    from pdflash.cache import ExpertCache
    from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    if backend not in ("noop", "eager"):
        raise ValueError(f"backend must be noop or eager, got {backend!r}")
    tmp = tempfile.TemporaryDirectory() if workdir is None else None
    root = Path(tmp.name) if tmp is not None else Path(workdir)  # type: ignore[arg-type]
    ckpt = root / f"{arch}-{preset}-{layers}"
    if not (ckpt / "config.json").is_file():
        write_synthetic_checkpoint(
            ckpt, arch, preset, num_layers=layers, dtype=torch.float32, seed=3
        )
    issuer = H2DIssuer(backend="host")
    times: dict[str, list[float]] = defaultdict(list)
    try:
        adapter: Any = load_adapter(ckpt, device="cpu")
        cache = ExpertCache(
            adapter.store, issuer, device="cpu", num_slots=1 << 30, top_k=adapter.top_k
        )
        adapter.attach_cache(cache)
        cache.wait_ready(cache.prefetch(np.arange(adapter.num_layers * adapter.num_experts)))
        pages = requests * (-(-(prompt_len + 2 * block) // 16))
        kv = kv_cache_for(
            adapter, page_size=16, num_pages=pages, dtype=torch.float32, device="cpu", scratch=True
        )
        runner = TargetRunner(adapter, kv, capture_layers=(0, layers // 2, layers - 1))
        step_s: list[float] = []
        inner = NoopBackend() if backend == "noop" else EagerBackend()
        graphs = GraphRunner(
            _TimedBackend(inner, lambda s: times["replay"].append(s)), validate=False
        )
        runner.graphs = graphs
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i in range(requests):
                kv.add_sequence(i)
                prompt = torch.randint(0, adapter.vocab_size, (prompt_len,), generator=gen)
                runner.forward([Chunk(i, prompt, False)])
        moe = runner.offloaded_runtime
        assert moe is not None
        for name, obj, attr in (
            ("plan", runner, "plan"),
            ("blocker", graphs, "blocker"),
            ("bucket", graphs, "bucket"),
            ("fill", graphs, "_fill"),
            ("pin", moe, "pin_resident"),
            ("book", moe, "book_resident"),
            ("finish", runner, "finish"),
        ):
            _timed(obj, attr, times[name].append)
        blocks = [
            torch.randint(0, adapter.vocab_size, (block,), generator=gen) for _ in range(requests)
        ]
        for n in range(5 + steps):
            if n == 5:  # the timers hold these lists: empty them in place
                for kept in times.values():
                    kept.clear()
                step_s.clear()
            chunks = [Chunk(i, blocks[i], True) for i in range(requests)]
            t0 = time.perf_counter()
            runner.forward(chunks)
            step_s.append(time.perf_counter() - t0)
            for i in range(requests):
                kv.truncate(i, kv.length(i) - block)
        if graphs.stats.replays < steps:
            raise RuntimeError(f"only {graphs.stats.replays} of {steps} steps replayed")
    finally:
        issuer.close()
        if tmp is not None:
            tmp.cleanup()
    us = {p: 1e6 * statistics.median(times[p]) for p in PARTS}
    forward = 1e6 * statistics.median(step_s)
    parts_sum = sum(us.values())
    return {
        "what": "median host us per replayed verify step, per part of GraphRunner.forward",
        "timing_method": "host_perf_counter",
        "device": "cpu",
        "backend": backend,
        "arch": arch,
        "preset": preset,
        "layers": layers,
        "requests": requests,
        "block": block,
        "prompt_len": prompt_len,
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "parts_us": us,
        "rest_us": forward - parts_sum,
        "forward_us": forward,
        "outside_replay_us": forward - us["replay"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="gpt_oss")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backend", default="noop", choices=["noop", "eager"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = measure(
        arch=a.arch,
        preset=a.preset,
        layers=a.layers,
        requests=a.requests,
        block=a.block,
        prompt_len=a.prompt_len,
        steps=a.steps,
        backend=a.backend,
    )
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
