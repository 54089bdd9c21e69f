"""A byte-level BPE trained on the corpus, with reserved special ids.

Ids 0, 1, 2 are ``<|endoftext|>`` (eos, also written between documents),
``<|pad|>`` and ``<|mask|>`` (the DFlash drafter's mask token). The
tokenizer is saved as ``tokenizer.json`` + ``tokenizer_config.json`` through
transformers' ``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained``
loads it; its identity is the SHA-256 of ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

EOS = "<|endoftext|>"
PAD = "<|pad|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike[str]) -> str:
    """Train, save to ``out_dir`` and return the tokenizer hash."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65535:
        raise ValueError(f"vocab_size must be in ({256 + len(SPECIAL_TOKENS)}, 65535]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, not {i}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, mask_token=MASK
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return tokenizer_hash(out)


def tokenizer_hash(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256((Path(path) / "tokenizer.json").read_bytes()).hexdigest()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The raw ``tokenizers.Tokenizer`` (fast batch encoding)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def encode_documents(
    tok: Any, texts: Sequence[str]
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.int64]]:
    """One uint16 token stream (each document followed by eos) and the start
    offset of every document (``len(texts) + 1`` entries, the last = length)."""
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encs], dtype=np.int64)
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    stream = np.empty(int(offsets[-1]), dtype=np.uint16)
    for e, start in zip(encs, offsets[:-1], strict=True):
        n = len(e.ids)
        stream[start : start + n] = e.ids
        stream[start + n] = EOS_ID
    return stream, offsets
