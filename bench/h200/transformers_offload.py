"""pdflash's transformers integration vs accelerate's CPU offload (issue 17).

For each architecture: a synthetic checkpoint of the published shape,
truncated to a few layers (random weights: every row is labelled
``synthetic``), and the same greedy prompts through

* ``resident``: plain transformers, every weight on the GPU (the reference
  output and the speed ceiling);
* ``pdflash``: :func:`pdflash.integrations.transformers.offload` with an
  expert cache of ``--cache-fraction`` of the experts;
* ``accelerate``: ``from_pretrained(device_map=...)`` with the map from
  ``accelerate.infer_auto_device_map`` under ``max_memory`` = the GPU bytes
  pdflash uses for weights (non-expert weights + its expert cache); modules
  mapped to ``cpu`` are offloaded (moved to the GPU for each forward).

Per row: tokens/s of ``model.generate`` (batch 1, one prompt after another,
after a warm-up), peak GPU memory while loading and while generating, and
whether the greedy tokens equal the resident run's (with the length of the
common prefix). Prints one JSON object (the last line) and writes it to
``$OUT/issue17_offload.json``.

    python3 bench/h200/transformers_offload.py --archs qwen3_moe,gpt_oss --layers 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

PRESET = {"qwen3_moe": "qwen3-30b-a3b", "gpt_oss": "gpt-oss-20b"}


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def _reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int | None:
    """Peak GPU bytes since the last reset (None on the CPU dry run: not measured)."""
    return int(torch.cuda.max_memory_allocated()) if CUDA else None


def _bytes_by_kind(model: Any) -> dict[str, int]:
    out = {"expert": 0, "non_expert": 0}
    for name, p in model.named_parameters():
        kind = "expert" if ".mlp.experts." in name else "non_expert"
        out[kind] += p.numel() * p.element_size()
    return out


def _generate(model: Any, prompts: list[torch.Tensor], new_tokens: int) -> dict[str, Any]:
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    model.generate(prompts[0], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    _sync()
    _reset_peak()
    outputs = []
    t0 = time.perf_counter()
    for p in prompts:
        out = model.generate(p, **kw)
        outputs.append(out[0, p.shape[1] :].tolist())
    _sync()
    elapsed = time.perf_counter() - t0
    return {
        "tokens": outputs,
        "generated_tokens": sum(len(o) for o in outputs),
        "generate_s": elapsed,
        "tokens_per_s": sum(len(o) for o in outputs) / elapsed,
        "peak_gpu_bytes_generate": _peak(),
    }


def _compare(row: dict[str, Any], ref: list[list[int]] | None) -> None:
    if ref is None:
        row["greedy_equal"] = None
        return
    row["greedy_equal"] = row["tokens"] == ref
    row["common_prefix"] = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(row["tokens"], ref, strict=True)
    ]


def run_arch(arch: str, args: argparse.Namespace, root: Path, rows: list[dict[str, Any]]) -> None:
    """Append the arch's rows to ``rows`` as each method finishes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdflash.integrations.transformers import offload
    from pdflash.models import write_synthetic_checkpoint

    dtype = getattr(torch, args.dtype)
    preset = args.preset or PRESET[arch]
    path = root / f"{arch}-{preset}-L{args.layers}-{args.dtype}"
    t0 = time.perf_counter()
    if not (path / "COMPLETE").is_file():
        write_synthetic_checkpoint(
            path, arch, preset, num_layers=args.layers, dtype=dtype, device=DEVICE
        )
        (path / "COMPLETE").write_text("ok\n")
    write_s = time.perf_counter() - t0
    config = AutoConfig.from_pretrained(path)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(4, config.vocab_size, (1, args.prompt_len), generator=gen).to(DEVICE)
        for _ in range(args.prompts)
    ]
    common = {
        "arch": arch,
        "shape": preset,
        "layers": args.layers,
        "dtype": args.dtype,
        "synthetic": True,
        "weights": "synthetic random (pdflash.models.write_synthetic_checkpoint)",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch": 1,
        "checkpoint_write_s": write_s,
    }
    ref: list[list[int]] | None = None

    if not args.skip_resident:
        _free()
        _reset_peak()
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=DEVICE).eval()
        _sync()
        load = {"load_s": time.perf_counter() - t0, "peak_gpu_bytes_load": _peak()}
        sizes = _bytes_by_kind(model)
        row = {**common, "method": "resident", **load, **_generate(model, prompts, args.new_tokens)}
        row["weight_bytes"] = sizes
        ref = row["tokens"]
        _compare(row, ref)
        rows.append(row)
        del model
    _free()

    # pdflash
    _reset_peak()
    t0 = time.perf_counter()
    model = offload(path, cache_fraction=args.cache_fraction, device=DEVICE, dtype=dtype)
    _sync()
    load = {"load_s": time.perf_counter() - t0, "peak_gpu_bytes_load": _peak()}
    handle = model.pdflash
    cache_bytes = int(handle.cache.num_slots) * int(handle.cache.expert_nbytes)
    non_expert = _bytes_by_kind(model)["non_expert"]
    row = {**common, "method": "pdflash", "cache_fraction": args.cache_fraction, **load}
    row["eviction_policy"] = handle.cache.policy.name
    try:
        row.update(_generate(model, prompts, args.new_tokens))
        st = handle.stats()
    finally:
        handle.close()  # frees the pinned host experts even when generate fails
    row["gpu_weight_bytes"] = {"non_expert": non_expert, "expert_cache": cache_bytes}
    row["expert_cache"] = {
        k: (float(v) if isinstance(v, (int, float)) else str(v))
        for k, v in st.items()
        if k in ("hits", "misses", "bytes_in", "hit_rate", "route_ahead_bytes", "num_slots")
    }
    _compare(row, ref)
    rows.append(row)
    del model, handle
    _free()

    # accelerate
    from accelerate import infer_auto_device_map, init_empty_weights

    budget = non_expert + cache_bytes
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts_cls = type(empty.model.layers[0].mlp.experts).__name__
    device_map = infer_auto_device_map(
        empty,
        max_memory={0: budget, "cpu": 512 << 30},
        no_split_module_classes=[experts_cls],
        dtype=dtype,
    )
    on_gpu = {"expert": 0, "non_expert": 0}
    on_cpu = {"expert": 0, "non_expert": 0}
    for name, p in empty.named_parameters():
        owner = max(
            (m for m in device_map if m == "" or name == m or name.startswith(m + ".")),
            key=len,
            default=None,
        )
        dev = None if owner is None else device_map[owner]
        kind = "expert" if ".mlp.experts." in name else "non_expert"
        (on_cpu if dev == "cpu" else on_gpu)[kind] += p.numel() * p.element_size()
    del empty
    _free()
    _reset_peak()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map).eval()
    _sync()
    load = {"load_s": time.perf_counter() - t0, "peak_gpu_bytes_load": _peak()}
    row = {**common, "method": "accelerate", "max_memory_gpu_bytes": budget, **load}
    row.update(_generate(model, prompts, args.new_tokens))
    row["gpu_weight_bytes"] = on_gpu
    row["cpu_offloaded_bytes"] = on_cpu
    row["device_map_cpu_modules"] = sum(1 for d in device_map.values() if d == "cpu")
    _compare(row, ref)
    rows.append(row)
    del model
    _free()


def main() -> None:
    import accelerate
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="qwen3_moe,gpt_oss")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cache-fraction", type=float, default=0.2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--preset", default=None, help="synthetic preset (default: the published shape)"
    )
    ap.add_argument("--skip-resident", action="store_true")
    ap.add_argument("--root", default=os.environ.get("PDFLASH_CACHE", "/tmp/pdflash-cache"))
    args = ap.parse_args()
    root = Path(args.root) / "issue17"
    rows: list[dict[str, Any]] = []
    for arch in args.archs.split(","):
        try:
            run_arch(arch, args, root, rows)
        except Exception as e:  # one method failing must not lose the other rows
            done = [r["method"] for r in rows if r.get("arch") == arch]
            rows.append(
                {
                    "arch": arch,
                    "synthetic": True,
                    "after": done,
                    "error": f"{type(e).__name__}: {e}",
                }
            )
        _free()
    result = {
        "bench": "issue17_transformers_offload",
        "device": torch.cuda.get_device_name(0) if CUDA else "cpu (dry run: no GPU memory figures)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "rows": rows,
    }
    out = Path(os.environ.get("OUT", ".")) / "issue17_offload.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for r in rows:
        if "error" in r:
            print(f"{r['arch']:10s} ERROR {r['error']}", flush=True)
        else:
            peak = r["peak_gpu_bytes_generate"]
            peak_s = "n/a (no GPU)" if peak is None else f"{peak / 1e9:6.2f} GB"
            print(
                f"{r['arch']:10s} {r['method']:10s} {r['tokens_per_s']:8.2f} tok/s  "
                f"peak gen {peak_s}  load {r['load_s']:6.1f} s  "
                f"greedy_equal={r.get('greedy_equal')}",
                flush=True,
            )
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "rows"}
            | {"rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
        )
    )


if __name__ == "__main__":
    main()
