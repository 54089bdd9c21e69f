"""``pdflash-bench proxy train|draft|eval|trace``.

Progress goes to stderr; the command's result (provenance, figures) is the
JSON printed on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HELP = "train a proxy qwen3_moe on local Python sources and its DFlash drafter; eval; export traces"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="proxy_command", metavar="COMMAND", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        # SUPPRESS: do not clobber `pdflash-bench proxy --json ...`
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")

    tr = sub.add_parser("train", help="train the target (writes an HF checkpoint)")
    common(tr)
    tr.add_argument("--preset", default="cpu-tiny", help="cpu-tiny or gpu")
    tr.add_argument("--out", required=True, help="checkpoint directory")
    tr.add_argument("--work", default=None, help="corpus/tokenizer cache (default OUT.work)")
    tr.add_argument(
        "--roots", nargs="*", default=None, help="source roots (default: stdlib + site-packages)"
    )
    tr.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall clock of the training loop (LR schedule and stop); default: the preset's",
    )
    tr.add_argument("--max-steps", type=int, default=None)

    dr = sub.add_parser("draft", help="train the DFlash drafter on the target's continuations")
    common(dr)
    dr.add_argument("--preset", default="cpu-tiny", help="cpu-tiny or gpu")
    dr.add_argument("--target", required=True)
    dr.add_argument("--out", required=True, help="drafter directory (z-lab layout)")
    dr.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall clock of the training loop (after data generation); default: the preset's",
    )
    dr.add_argument("--max-steps", type=int, default=None)

    ev = sub.add_parser("eval", help="tokens per round (anchors, loop; greedy, T=1)")
    common(ev)
    ev.add_argument("--target", required=True)
    ev.add_argument("--drafter", required=True)
    ev.add_argument("--num-prompts", type=int, default=8)
    ev.add_argument("--prompt-len", type=int, default=64)
    ev.add_argument("--max-new-tokens", type=int, default=96)
    ev.add_argument("--out", default=None, help="also write the result JSON here")

    tc = sub.add_parser("trace", help="export routing + acceptance of a decoding run")
    common(tc)
    tc.add_argument("--target", required=True)
    tc.add_argument("--drafter", required=True)
    tc.add_argument("--out", required=True, help="trace file (.npz)")
    tc.add_argument("--num-prompts", type=int, default=8)
    tc.add_argument("--prompt-len", type=int, default=64)
    tc.add_argument("--max-new-tokens", type=int, default=96)
    tc.add_argument("--temperature", type=float, default=0.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cmd = args.proxy_command
    if cmd == "train":
        from pdflash.bench.proxy.presets import target_preset
        from pdflash.bench.proxy.target import train_target

        work = args.work or f"{Path(args.out).resolve()}.work"
        return train_target(
            target_preset(args.preset),
            args.out,
            work,
            roots=args.roots,
            time_budget_s=args.time_budget_s,
            max_steps=args.max_steps,
            seed=args.seed,
            device=args.device,
            log=_log,
        )
    if cmd == "draft":
        from pdflash.bench.proxy.drafter import train_drafter
        from pdflash.bench.proxy.presets import drafter_preset

        return train_drafter(
            args.target,
            args.out,
            drafter_preset(args.preset),
            time_budget_s=args.time_budget_s,
            max_steps=args.max_steps,
            seed=args.seed,
            device=args.device,
            log=_log,
        )
    if cmd == "eval":
        import torch
        from pdflash.bench.proxy.decode import evaluate
        from pdflash.bench.proxy.drafter import load_target
        from pdflash.bench.proxy.target import heldout_prompts

        from pdflash.engine.drafter import load_drafter
        from pdflash.serve.build import resolve_device

        dev = resolve_device(args.device)
        target = load_target(args.target, dev, torch.float32)
        drafter = load_drafter(args.drafter, device=dev, dtype=torch.float32)
        prompts = heldout_prompts(args.target, "eval", args.num_prompts, args.prompt_len, 0)
        if not prompts:
            raise SystemExit(f"{args.target}: no held-out eval prompt of {args.prompt_len} tokens")
        result = evaluate(
            target,
            drafter,
            [p for p, _ in prompts],
            args.max_new_tokens,
            seed=args.seed,
            log=_log,
        )
        result["prompts_source"] = "held-out 'eval' documents (sha256:offset)"
        result["prompt_ids"] = [src for _, src in prompts]
        result["dtype"] = "float32"
        result["device"] = str(dev)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return result
    if cmd == "trace":
        from pdflash.bench.proxy.export import export_trace

        out = export_trace(
            args.target,
            args.drafter,
            args.out,
            num_prompts=args.num_prompts,
            prompt_len=args.prompt_len,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            device=args.device,
            log=_log,
        )
        return out["summary"]
    raise SystemExit(f"unknown proxy command {cmd!r}")
