"""The ``pdflash`` command: ``serve``, ``generate`` and ``synthetic``.

pdflash synthetic --out /tmp/tiny                  # a tiny random model + draft + tokenizer
pdflash generate --model /tmp/tiny/target --prompt "Hello" --max-tokens 32
pdflash serve --model /tmp/tiny/target --draft /tmp/tiny/draft --port 8000
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pdflash.engine.config import HOST_CONTROLS
from pdflash.engine.verify_width import WIDTH_KINDS
from pdflash.serve.build import SERVE_BASELINES, ServeModelConfig


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint directory (HF format)")
    p.add_argument("--draft", default=None, help="DFlash draft checkpoint directory (optional)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--cache-fraction",
        type=float,
        default=None,
        help="expert cache size as a fraction of all experts (default 0.2 on GPU, 1.0 on CPU)",
    )
    g.add_argument("--cache-gb", type=float, default=None, help="expert cache size in GB")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: checkpoint's",
    )
    p.add_argument(
        "--baseline",
        default=None,
        choices=list(SERVE_BASELINES),
        help="engine configuration (default: PD with --draft, B0 without; PD+host adds the "
        "hybrid miss service: the host CPU computes some missed experts while the link copies "
        "others; PD-all-on runs PD's parts without its controller)",
    )
    p.add_argument("--block-size", type=int, default=8, help="DFlash block size")
    p.add_argument("--max-running", type=int, default=8, help="requests decoding at once")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: min(max_position_embeddings, 4096))",
    )
    p.add_argument(
        "--verify-width",
        default=None,
        help=f"drafts each verify checks: {' or '.join(WIDTH_KINDS)} "
        "(default: the baseline's preset: adaptive for PD, PD+host and PD-all-on, full for "
        "B0-B3; with every expert resident adaptive verifies every draft)",
    )
    p.add_argument(
        "--prepare-graphs",
        type=int,
        default=0,
        help="record up to N CUDA graphs of the verify forward and N of the drafter's at "
        "start-up (the likeliest shape buckets first) instead of at each bucket's first "
        "step; 0: none",
    )
    p.add_argument(
        "--host-control",
        default="controller",
        choices=list(HOST_CONTROLS),
        help="with --baseline PD+host: who decides whether the host computes missed experts "
        "(controller: PD's controller probes it and its gate switches it on where the step "
        "waits on the link; always: every step)",
    )
    p.add_argument(
        "--host-queued",
        action="store_true",
        help="with --baseline PD+host: the host may also compute routed experts whose copy "
        "has not started, cancelling the copy (off by default; not yet measured to pay on a "
        "GPU)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the engine's seed (unseeded requests' sampling); generate also gives it to its "
        "request, so a sampled generate repeats (it then verifies every draft under the "
        "adaptive width)",
    )


def _model_config(a: argparse.Namespace) -> ServeModelConfig:
    return ServeModelConfig(
        model=a.model,
        draft=a.draft,
        cache_fraction=a.cache_fraction,
        cache_gb=a.cache_gb,
        device=a.device,
        dtype=a.dtype,
        baseline=a.baseline,
        block_size=a.block_size,
        max_running=a.max_running,
        max_model_len=a.max_model_len,
        seed=a.seed,
        verify_width=a.verify_width,
        prepare_graphs=a.prepare_graphs,
        host_control=a.host_control,
        host_queued=a.host_queued,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdflash", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queue", type=int, default=256, help="live requests before answering 429")
    s.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="partition the experts over N GPUs (expert parallelism): this process serves as "
        "rank 0 and starts ranks 1..N-1 (rank r on cuda:r, NCCL; gloo with --device cpu)",
    )

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    _model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    y = sub.add_parser("synthetic", help="write a synthetic (random-weight) model to serve")
    y.add_argument("--out", required=True, help="directory; writes OUT/target and OUT/draft")
    y.add_argument(
        "--arch",
        default="qwen3_moe",
        choices=["qwen3_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "glm4_moe"],
    )
    y.add_argument("--preset", default="tiny")
    y.add_argument("--layers", type=int, default=None, help="truncate to this many layers")
    y.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    y.add_argument("--no-draft", action="store_true", help="no DFlash drafter")
    return parser


def _serve(a: argparse.Namespace) -> int:
    from aiohttp import web

    from pdflash.distributed.serving import build_rank0, join_followers, start_followers
    from pdflash.serve.app import make_app, make_state
    from pdflash.serve.build import build_engine
    from pdflash.serve.loop import EngineLoop

    cfg = dataclasses.replace(_model_config(a), gpus=a.gpus)
    cfg.validate()
    # --gpus N: this process is rank 0, ranks 1..N-1 follow it
    followers = start_followers(cfg) if cfg.gpus > 1 else []
    loop = EngineLoop(
        (lambda: build_rank0(cfg)) if followers else (lambda: build_engine(cfg)),
        max_queue=a.max_queue,
    )
    try:
        loop.start()
    except BaseException:
        join_followers(followers, timeout_s=0.0)
        raise
    try:
        state = make_state(loop, cfg.model)
        app = make_app(state)
        print(
            f"pdflash: serving {state.model_name!r} (max context {state.max_model_len}) "
            f"on http://{a.host}:{a.port}/v1",
            file=sys.stderr,
            flush=True,
        )
        web.run_app(app, host=a.host, port=a.port, handler_cancellation=True, print=None)
    finally:
        loop.stop()
        join_followers(followers)
    return 0


def _generate(a: argparse.Namespace) -> int:
    from pdflash.engine.engine import RequestState
    from pdflash.engine.sampling import SamplingParams
    from pdflash.serve.build import build_engine
    from pdflash.text import (
        IncrementalDetokenizer,
        StopStringMatcher,
        load_tokenizer,
        stop_token_ids,
    )

    cfg = _model_config(a)
    cfg.validate()
    tok = load_tokenizer(cfg.model)
    if a.chat:
        text = tok.apply_chat_template(
            [{"role": "user", "content": a.prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tok(a.prompt)["input_ids"])
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    bundle = build_engine(cfg)
    try:
        engine = bundle.engine
        detok = IncrementalDetokenizer(tok)
        matcher = StopStringMatcher(a.stop)
        out = sys.stdout

        def on_token(rid: int, token: int) -> None:
            text, stopped = matcher.feed(detok.add([token]))
            out.write(text)
            out.flush()
            if stopped:
                engine.abort(rid)

        rid = engine.add_request(
            ids,
            params,
            max_new_tokens=a.max_tokens,
            stop_ids=stop_token_ids(tok, cfg.model),
            on_token=on_token,
            seed=a.seed,
        )
        engine.run_until_done()
        req = engine.request(rid)
        if req.state != RequestState.ABORTED:
            text, stopped = matcher.feed(detok.flush())
            out.write(text if stopped else text + matcher.flush())
        out.write("\n")
        out.flush()
        m = req.metrics
        reason = "stop" if matcher.stopped else m.finish_reason
        print(
            f"[{len(req.output)} tokens, finish_reason={reason}, "
            f"ttft={m.ttft_s or 0.0:.3f}s, total={m.latency_s or 0.0:.3f}s]",
            file=sys.stderr,
        )
    finally:
        bundle.close()
    return 0


def _synthetic(a: argparse.Namespace) -> int:
    import torch

    from pdflash.serve.build import write_synthetic_model

    target, draft = write_synthetic_model(
        a.out,
        a.arch,
        a.preset,
        num_layers=a.layers,
        dtype=getattr(torch, a.dtype),
        draft=not a.no_draft,
    )
    print(f"target: {target}")
    if draft is not None:
        print(f"draft:  {draft}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    commands: dict[str, Any] = {"serve": _serve, "generate": _generate, "synthetic": _synthetic}
    try:
        rc: int = commands[a.command](a)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdflash {a.command}: error: {e}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
