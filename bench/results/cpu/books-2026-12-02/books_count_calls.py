"""Function calls per MoE layer made by the expert cache's books, on the
eager_host verify step (``python -P count_calls.py [eager_host options]``).

The books are the methods eager_host times as ``books`` (ExpertCache's
acquire, release, pin_layer, unpin_layer, defer_access, free_capacity,
device_slot_table, layer_resident and OffloadedMoE._phase_rows), everything
they call included (the eviction policy, the issuer's submit). A profile
hook counts each call made from pdflash code inside them, by the callee's
home: ``numpy`` (numpy functions and ndarray methods), ``torch``, ``native``
(pdflash_native, e.g. the issuer's submit, the books' core) and
``python`` (pdflash's own functions). NOTE: numpy operators and indexing
(``a[i]``, ``a >= 0``, ``a & b``) are not function calls and are NOT
counted; they cost a numpy call each too. Layers are counted from the
first verify step (the prompt's prefill forward is not counted)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from pdflash.bench.eager_count import HARNESS_FILE, EagerCount

from pdflash.cache.expert_cache import ExpertCache
from pdflash.models.offload import OffloadedMoE

BOOKS = (
    (ExpertCache, "acquire"),
    (ExpertCache, "release"),
    (ExpertCache, "pin_layer"),
    (ExpertCache, "unpin_layer"),
    (ExpertCache, "defer_access"),
    (ExpertCache, "free_capacity"),
    (ExpertCache, "device_slot_table"),
    (ExpertCache, "layer_resident"),
    (OffloadedMoE, "_phase_rows"),
)

count = EagerCount()
calls: Counter[str] = Counter()


def _home(event: str, arg: Any, frame: Any) -> str | None:
    if event == "c_call":
        owner = getattr(arg, "__self__", None)
        mod = getattr(arg, "__module__", None) or type(owner).__module__ or ""
    else:  # a Python function: where its code lives
        mod = frame.f_code.co_filename
        if mod == HARNESS_FILE:  # the harness's wrappers: not pdflash's code
            return "other"
    if "numpy" in mod:
        return "numpy"
    if "torch" in mod:
        return "torch"
    if "pdflash_native" in mod:
        return "native"
    if "pdflash" in mod:
        return "python"
    return "builtins" if "builtins" in mod else "other"


def _profile(frame: Any, event: str, arg: Any) -> None:
    if not count.on or not count.stack or event not in ("call", "c_call"):
        return
    caller = frame if event == "c_call" else frame.f_back
    if caller is None or "pdflash" not in caller.f_code.co_filename:
        return
    if caller.f_code.co_filename == HARNESS_FILE:
        return
    if "numpy" in caller.f_code.co_filename or "/torch/" in caller.f_code.co_filename:
        return
    home = _home(event, arg, frame)
    if home is not None:
        calls[home] += 1


def main() -> int:
    for cls, name in BOOKS:
        count.wrap(cls, name)
    sys.setprofile(_profile)
    try:
        count.run(sys.argv[1:])
    finally:
        sys.setprofile(None)
    print(
        json.dumps(
            {
                "what": "function calls per MoE layer inside the books (operators/indexing not counted)",
                "moe_layers": count.layers,
                "per_layer": {k: round(v / count.moe_layers, 2) for k, v in sorted(calls.items())},
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
