"""Benchmark inputs from real text and published expert sizes.

* :func:`load_prompts`: the prompts of a run from held-out text instead of
  random ids. Sources (``RunSpec.prompts``):

  - ``heldout`` / ``heldout:ROLE``: held-out documents of a proxy checkpoint's
    corpus split (``ROLE`` ``eval`` by default, or ``draft``), see
    :func:`pdflash.bench.proxy.target.heldout_prompts`;
  - ``PATH.npz``: a proxy trace (:mod:`pdflash.traces`):
    request ``i`` gets the first ``n`` tokens of trace request ``i mod R``'s
    sequence (its prompt, then its output), so engine positions line up
    with the trace's for routing replay;
  - any other ``PATH``: a UTF-8 text file tokenized with the checkpoint's
    ``tokenizer.json``; requests take consecutive windows of the token
    stream (wrapping around).

  Each prompt has the length the workload draws for it.
* :func:`published_expert_nbytes`: the bytes of one expert of a published
  architecture as the synthetic presets define it (bf16, dense; or, with a
  ``-FORMAT`` suffix, in a compressed format pdflash stores it in, e.g.
  ``gpt-oss-20b-mxfp4``, the checkpoint's own format), or a byte count, for
  ``RunSpec.expert_bytes_as`` (experts padded to that size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

#: ``expert_bytes_as`` names -> (model_type, synthetic preset)
PUBLISHED_SHAPES: dict[str, tuple[str, str]] = {
    "gpt-oss-20b": ("gpt_oss", "gpt-oss-20b"),
    "qwen3-30b-a3b": ("qwen3_moe", "qwen3-30b-a3b"),
    "mixtral-8x7b": ("mixtral", "mixtral-8x7b"),
    "olmoe-1b-7b": ("olmoe", "olmoe-1b-7b"),
}

#: ``expert_bytes_as`` names of a published expert in a stored compressed
#: format -> (``PUBLISHED_SHAPES`` name, expert format): the bytes pdflash
#: moves for that checkpoint by default (gpt-oss ships MXFP4 experts)
STORED_FORMAT_SHAPES: dict[str, tuple[str, str]] = {
    "gpt-oss-20b-mxfp4": ("gpt-oss-20b", "mxfp4"),
}


def published_expert_nbytes(spec: str) -> tuple[int, str]:
    """``(bytes, source)`` for an ``expert_bytes_as`` value: a published
    architecture name (its synthetic preset's bf16 dense expert layout), one
    of :data:`STORED_FORMAT_SHAPES` (the preset's experts as stored in that
    format: packed blocks, scales and bf16 biases) or a positive byte count.
    Raises ``ValueError`` on anything else."""
    import torch

    from pdflash.models import synthetic_config
    from pdflash.models.adapters import get_adapter_class

    text = spec.strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"expert_bytes_as must be a positive byte count, got {spec!r}")
        return n, f"{n} bytes (configured)"
    if text in STORED_FORMAT_SHAPES:
        name, fmt_name = STORED_FORMAT_SHAPES[text]
        arch, preset = PUBLISHED_SHAPES[name]
        config = synthetic_config(arch, preset)
        adapter = get_adapter_class(arch)
        (fmt,) = [f for f in adapter.expert_formats(config) if f.name == fmt_name]
        layout, _ = adapter.stored_layout(config, torch.bfloat16, fmt, None)
        return int(layout.nbytes), (
            f"{text} (synthetic preset {preset!r}, {fmt_name} stored expert layout)"
        )
    if text not in PUBLISHED_SHAPES:
        names = sorted([*PUBLISHED_SHAPES, *STORED_FORMAT_SHAPES])
        raise ValueError(f"expert_bytes_as must be a byte count or one of {names}, got {spec!r}")
    arch, preset = PUBLISHED_SHAPES[text]
    config = synthetic_config(arch, preset)
    nbytes = int(get_adapter_class(arch).expert_layout(config, torch.bfloat16).nbytes)
    return nbytes, f"{text} (synthetic preset {preset!r}, bfloat16 dense expert layout)"


@dataclass
class Prompts:
    """The prompts of one run and where they came from."""

    prompts: list[list[int]]
    source: str
    #: per prompt, the trace request it was taken from (trace prompts only)
    trace_requests: list[int] | None = None
    details: dict[str, Any] = field(default_factory=dict)


def load_prompts(source: str, lengths: list[int], vocab_size: int, weights: str | None) -> Prompts:
    """Prompts of ``lengths`` tokens from ``source`` (see the module doc).

    Raises ``ValueError`` when the source is missing, has too little text,
    or holds an id outside the model's vocabulary."""
    if not lengths:
        return Prompts([], source)
    if source == "heldout" or source.startswith("heldout:"):
        out = _heldout(source, lengths, weights)
    elif source.endswith(".npz"):
        out = _from_trace(source, lengths)
    else:
        out = _from_text(source, lengths, weights)
    bad = [t for p in out.prompts for t in p if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompts from {source!r} hold token id {bad[0]} outside the model's vocabulary "
            f"({vocab_size}); use the checkpoint the text or trace was tokenized for"
        )
    return out


def _heldout(source: str, lengths: list[int], weights: str | None) -> Prompts:
    from .proxy.target import heldout_prompts

    role = source.partition(":")[2] or "eval"
    if weights is None or not (Path(weights) / "heldout_tokens.npy").is_file():
        raise ValueError(
            f"prompts {source!r} need a proxy checkpoint with a held-out split (weights="
            f"{weights!r} has no heldout_tokens.npy)"
        )
    got = heldout_prompts(weights, role, len(lengths), max(lengths), 0)
    if not got:
        raise ValueError(f"{weights}: no held-out {role!r} document of {max(lengths)} tokens")
    prompts = [list(got[i % len(got)][0][:n]) for i, n in enumerate(lengths)]
    return Prompts(
        prompts,
        f"held-out {role!r} documents of the checkpoint's corpus",
        details={"windows": [got[i % len(got)][1] for i in range(len(lengths))]},
    )


def _from_trace(source: str, lengths: list[int]) -> Prompts:
    from pdflash.traces import load_trace

    trace = load_trace(source)
    prompts: list[list[int]] = []
    reqs: list[int] = []
    for i, n in enumerate(lengths):
        r = i % trace.num_requests
        seq = trace.request_tokens(r)
        # at least one token of the sequence stays ahead of the prompt
        prompts.append([int(t) for t in seq[: max(1, min(n, seq.size - 1))]])
        reqs.append(r)
    prov = trace.provenance
    return Prompts(
        prompts,
        f"trace {Path(source).name}: {prov.get('prompts_source')}",
        trace_requests=reqs,
        details={"trace_prompts_sha256": prov.get("prompts_sha256")},
    )


@functools.lru_cache(maxsize=4)
def _text_tokens(
    path: str, tok_file: str, mtime_ns: int, size: int
) -> tuple[str, npt.NDArray[np.int64]]:
    """The file's sha256 and its token ids (read-only), once per file
    version: a run and its warm-up take their prompts from the same file."""
    import hashlib

    from tokenizers import Tokenizer

    data = Path(path).read_bytes()
    text = data.decode("utf-8", errors="replace")
    ids = Tokenizer.from_file(tok_file).encode(text, add_special_tokens=False).ids
    stream = np.asarray(ids, dtype=np.int64)
    stream.flags.writeable = False
    return hashlib.sha256(data).hexdigest(), stream


def _from_text(source: str, lengths: list[int], weights: str | None) -> Prompts:
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompts file {source!r} does not exist")
    tok_file = Path(weights or "") / "tokenizer.json"
    if weights is None or not tok_file.is_file():
        raise ValueError(
            f"prompts from a text file need the checkpoint's tokenizer ({tok_file} is missing)"
        )
    stat = path.stat()
    digest, stream = _text_tokens(
        str(path.resolve()), str(tok_file), stat.st_mtime_ns, stat.st_size
    )
    if stream.size < max(lengths):
        raise ValueError(
            f"{source}: {stream.size} tokens, fewer than the longest prompt ({max(lengths)})"
        )
    prompts: list[list[int]] = []
    pos = 0
    for n in lengths:
        if pos + n > stream.size:
            pos = 0
        prompts.append(stream[pos : pos + n].tolist())
        pos += n
    return Prompts(
        prompts,
        f"text file {path.name} (sha256 {digest[:16]}), consecutive windows",
        details={"tokens_in_file": int(stream.size)},
    )
