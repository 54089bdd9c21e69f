"""Torch calls, page-locked allocations and CUDA events per MoE layer in the
parts of the eager offloaded call that hostpath2 changed, on eager_host's
verify step (``python -P hostpath2_count.py [--old] [eager_host options]``;
``--old``: the path before the branch, :mod:`hostpath2_old_path`).

Each counted method (below) runs under a ``TorchDispatchMode`` that counts
every torch dispatch (views included) made while it is the innermost
counted method: ``dispatches``; the dispatches asking for page-locked
memory (a ``pin_memory=True`` factory, ``pin_memory``/``_pin_memory``):
``pinned_allocs``. ``torch.cuda.Event`` is replaced by a subclass counting
``events_created``, ``event_records``, ``event_queries`` and ``event_syncs`` (CUDA only; a CPU
run makes none). Counted from the first timed step on (warm-up and timed
verify steps, not the prompt's prefill); per layer = total / MoE layer
calls."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = (
    ("OffloadedMoE", "_grouped_misses_on_device"),
    ("OffloadedMoE", "_phase_rows"),
    ("OffloadedMoE", "_grouped_rows"),
    ("ExpertCache", "device_slot_table"),
    ("ExpertCache", "acquire"),
    ("ExpertCache", "release"),
    ("ExpertCache", "pin_layer"),
    ("ExpertCache", "unpin_layer"),
    ("ExpertCache", "_evict"),
)

counts: dict[str, Counter[str]] = defaultdict(Counter)


class _Dispatches(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, count: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        where = self.count.inside
        if where is not None:
            counts[where]["dispatches"] += 1
            name = func.overloadpacket.__name__
            if kwargs.get("pin_memory") or name in ("pin_memory", "_pin_memory"):
                counts[where]["pinned_allocs"] += 1
        return func(*args, **kwargs)


def _count_events(count: Any) -> None:
    base = torch.cuda.Event

    class CountingEvent(base):  # type: ignore[misc,valid-type]
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            where = count.inside
            if where is not None:
                counts[where]["events_created"] += 1
            return super().__new__(cls, *args, **kwargs)

        def record(self, stream: Any = None) -> None:
            where = count.inside
            if where is not None:
                counts[where]["event_records"] += 1
            super().record(stream)

        def synchronize(self) -> None:
            where = count.inside
            if where is not None:
                counts[where]["event_syncs"] += 1
            super().synchronize()

        def query(self) -> bool:
            where = count.inside
            if where is not None:
                counts[where]["event_queries"] += 1
            return bool(super().query())

    torch.cuda.Event = CountingEvent  # type: ignore[misc]


def main() -> int:
    argv = sys.argv[1:]
    old = "--old" in argv
    argv = [a for a in argv if a != "--old"]
    if old:
        import hostpath2_old_path

        hostpath2_old_path.install()
    from pdflash.bench.eager_count import EagerCount

    from pdflash.cache.expert_cache import ExpertCache
    from pdflash.models.offload import OffloadedMoE

    count = EagerCount()
    classes = {"OffloadedMoE": OffloadedMoE, "ExpertCache": ExpertCache}
    for cls_name, name in METHODS:
        count.wrap(classes[cls_name], name, outermost=lambda: _Dispatches(count))
    _count_events(count)
    with contextlib.redirect_stdout(io.StringIO()):
        count.run(argv)
    n = count.moe_layers
    print(
        json.dumps(
            {
                "what": "torch dispatches / pinned allocations / CUDA events per MoE layer, per method (innermost counted)",
                "side": "before" if old else "after",
                "args": argv,
                "moe_layers": count.layers,
                "per_layer": {
                    where: {k: round(v / n, 3) for k, v in sorted(c.items())}
                    for where, c in sorted(counts.items())
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
