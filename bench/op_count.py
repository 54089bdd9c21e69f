"""Count the aten ops of one B3 verify forward on the CPU, per decoder layer.

A CPU stand-in for the GPU's kernel count of the all-resident (B3) verify
step (issue 13): under CUDA graphs every op that computes is still one or a
few kernels of a few microseconds each, so fewer ops per layer is fewer
kernels. This builds a synthetic target with the real expert grid of the
named shape (experts per layer, top-k, decoder layers, heads, so the slab
has the real slot count) but small hidden/intermediate sizes and vocab (op
counts do not depend on them), every expert resident, 16 requests of a
32-token prompt, then counts the ops of one verify forward of 16 tokens
per request (256 rows) under a ``TorchDispatchMode``:

* ``compute`` ops: every aten op except views and metadata (reshape, view,
  transpose, slice, select, expand, detach, empty...), which launch no
  kernel; by region (the runner's ``attention`` / ``router`` / ``experts``
  regions, ``other``: embedding, the final norm, lm_head, the step's
  bookkeeping) and by op name;
* per layer: each region's count over the layers divided by the layer count
  (every layer runs the same ops).

These are op counts on the CPU, not GPU times or GPU kernel counts: a CPU op
may be one CUDA kernel or several (a sort, a top-k) and the reverse.
Usage::

    python -m pdflash.bench.op_count --arch qwen3-30b-a3b --out counts.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that only make views or read metadata (no kernel on a GPU)
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "t",
        "transpose",
        "permute",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "alias",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "lift_fresh",
        "_reshape_alias",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_local_scalar_dense",
        "result_type",
    }
)

#: the command-line shapes: (synthetic preset's arch, preset)
SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", "qwen3-30b-a3b"),
    "gpt-oss-20b": ("gpt_oss", "gpt-oss-20b"),
}

#: small sizes for the counting model (the op sequence does not depend on them)
SMALL = {"hidden_size": 64, "vocab_size": 256, "tie_word_embeddings": False}
SMALL_BY_ARCH: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "head_dim": 16},
    "gpt_oss": {"intermediate_size": 32, "head_dim": 16},
}


class DispatchCounter(TorchDispatchMode):
    """Counts every torch dispatch by op name (views included) in
    :attr:`ops`, and all of them in :attr:`total`: each is host time on a
    GPU host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        self.total += 1
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Counts aten ops by (region, name); :attr:`region` is set by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.region = "other"
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.counts[(self.region, name)] += 1
        return func(*args, **(kwargs or {}))


class _RegionSetter:
    """A :class:`~pdflash.engine.target.RegionTimer` that tells the counter
    which region runs."""

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        outer = self.counter.region
        self.counter.region = name
        try:
            yield
        finally:
            self.counter.region = outer


def count_verify_ops(
    shape: str,
    *,
    layers: int = 8,
    requests: int = 16,
    prompt_len: int = 32,
    block: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """One verify forward's op counts (module docstring)."""
    from pdflash.cache import ExpertCache
    from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    arch, preset = SHAPES[shape]
    overrides = {**SMALL, **SMALL_BY_ARCH[arch]}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic_checkpoint(
            Path(tmp) / "target",
            arch,
            preset,
            num_layers=layers,
            dtype=dtype,
            seed=1,
            config_overrides=overrides,
        )
        issuer = H2DIssuer(backend="host")
        try:
            adapter: Any = load_adapter(path, device="cpu")
            grid = adapter.num_layers * adapter.num_experts
            cache = ExpertCache(
                adapter.store, issuer, device="cpu", num_slots=grid, top_k=adapter.top_k
            )
            adapter.attach_cache(cache)
            cache.wait_ready(cache.prefetch(np.arange(grid)))
            pages = requests * (prompt_len + 2 * block) // 16 + 8
            kv = kv_cache_for(
                adapter, page_size=16, num_pages=pages, dtype=dtype, device="cpu", scratch=True
            )
            runner = TargetRunner(adapter, kv)
            gen = torch.Generator().manual_seed(0)
            vocab = int(adapter.config.vocab_size)
            for i in range(requests):
                kv.add_sequence(i)
                runner.forward(
                    [Chunk(i, torch.randint(0, vocab, (prompt_len,), generator=gen), False)]
                )
            blocks = [torch.randint(0, vocab, (block,), generator=gen) for _ in range(requests)]
            counter = OpCounter()
            runner.region_timer = _RegionSetter(counter)
            with counter:
                runner.forward([Chunk(i, b, True) for i, b in enumerate(blocks)])
            moe_path = adapter.runtime.path
        finally:
            issuer.close()
    by_region: Counter[str] = Counter()
    for (region, _), n in counter.counts.items():
        by_region[region] += n
    layer_regions = ("attention", "router", "experts")
    per_layer = {r: by_region[r] / layers for r in layer_regions}
    return {
        "what": "aten compute ops (views/metadata excluded) of one B3 verify forward on the CPU",
        "counting": "op counts, not GPU times or GPU kernel counts",
        "shape": shape,
        "arch": arch,
        "dtype": str(dtype).removeprefix("torch."),
        "layers": layers,
        "experts_per_layer": int(adapter.num_experts),
        "top_k": int(adapter.top_k),
        "slots": int(grid),
        "requests": requests,
        "verify_rows": requests * block,
        "moe_path": moe_path,
        "total_ops": sum(by_region.values()),
        "ops_by_region": dict(sorted(by_region.items())),
        "ops_per_layer": {**per_layer, "total": sum(per_layer.values())},
        "ops_by_region_and_name": {
            f"{region}/{name}": n for (region, name), n in sorted(counter.counts.items())
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(SHAPES), action="append", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the counts here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [count_verify_ops(shape, layers=args.layers) for shape in args.arch]
    for row in rows:
        print(
            f"{row['shape']}: {row['total_ops']} ops per verify forward; per layer "
            + ", ".join(f"{k} {v:g}" for k, v in row["ops_per_layer"].items())
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
