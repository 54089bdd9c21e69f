"""Text in and out of the engine: the checkpoint's tokenizer and chat
template, incremental detokenization and server-side stop strings.

:func:`load_tokenizer` reads a checkpoint's tokenizer with transformers'
``AutoTokenizer`` (offline: local files only). :func:`write_synthetic_tokenizer`
writes a small character-level BPE tokenizer (trained with the ``tokenizers``
library on fixed text, no download) with a ChatML chat template, so a
synthetic checkpoint can be served like a real one. Its vocabulary is at
most the model's ``vocab_size``; ids past the tokenizer's vocabulary (the
large presets' padding) decode to no text, as padded ids do in real models.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: Special tokens of the synthetic tokenizer (ChatML, as Qwen uses).
SYNTHETIC_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Fixed training text for the synthetic tokenizer's merges (deterministic).
_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "Mixture-of-experts models route every token to a few experts; the experts live in "
    "host memory and are copied to the GPU when a token needs them. "
    "Speculative decoding drafts a block of tokens and verifies it in one forward pass. "
    "Hello, world! How are you today? I am fine, thank you. "
    "def main():\n    print('hello world')\n    return 0\n"
    "user: What is the capital of France?\nassistant: The capital of France is Paris.\n"
)


class TokenizerError(ValueError):
    """The checkpoint has no usable tokenizer."""


def write_synthetic_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (ChatML template,
    eos ``<|im_end|>``) for a model of ``vocab_size`` ids into ``path``.

    Character-level BPE over printable ASCII and newline (other characters
    map to ``<|unk|>``), merges trained on a fixed text up to ``vocab_size``
    entries when the text has that many, special tokens first (ids 0-3).
    """
    from tokenizers import Tokenizer, decoders, models, trainers

    specials = [*SYNTHETIC_SPECIALS, "<|unk|>"]
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(
            f"vocab_size {vocab_size} is too small for the synthetic tokenizer "
            f"(needs >= {len(specials) + len(alphabet)})"
        )
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|unk|>",
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "pdflash_synthetic": "character-level BPE on fixed text, not a trained tokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # generation defaults as a real checkpoint ships them (both end tokens stop)
    ids = [tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen["eos_token_id"] = ids
    gen_path.write_text(json.dumps(gen, indent=2))
    return out


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tokenizer (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        hint = ""
        cfg = p / "config.json"
        if cfg.is_file() and "pdflash_synthetic" in json.loads(cfg.read_text()):
            hint = (
                " (a synthetic checkpoint written before tokenizers were added: "
                "rewrite it, or call pdflash.text.write_synthetic_tokenizer on it)"
            )
        raise TokenizerError(f"{p}: no tokenizer.json or tokenizer_config.json{hint}")
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


def stop_token_ids(tokenizer: Any, path: str | os.PathLike[str] | None = None) -> list[int]:
    """Token ids that end a generation: the tokenizer's eos plus
    ``generation_config.json``'s ``eos_token_id`` (int or list)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if path is not None:
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    return sorted(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (the tokens since the last emitted text plus the
    ones before them, which some decoders need for spacing) instead of the
    whole output each time, as vLLM and TGI do; text ending in U+FFFD (an
    incomplete multi-byte character) is held back until a later token
    completes it. The concatenated deltas plus :meth:`flush` equal
    ``decode(ids)`` for byte-level and character-level tokenizers.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the decoder
        self.read_offset = 0  # tokens before this were emitted as text

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def _step(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        now = self._decode(self.ids[self.prefix_offset :])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return now[len(before) :]

    def add(self, tokens: Iterable[int]) -> str:
        self.ids.extend(int(t) for t in tokens)
        return self._step(final=False)

    def flush(self) -> str:
        """What is still held back (an incomplete character stays as U+FFFD)."""
        return self._step(final=True)


class StopStringMatcher:
    """Server-side stop strings over a text stream.

    :meth:`feed` returns the text that can be shown now and whether a stop
    string was seen; text that could still be the start of a stop string is
    held back, and the stop string itself (and anything after it) is never
    shown, as in OpenAI's API.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.pending = ""
        self.stopped = False

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self.pending + delta
        if not self.stops:
            return text, False
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.pending = ""
            return text[:cut], True
        keep = self._held(text)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text at the end of the stream (no stop followed)."""
        text, self.pending = ("" if self.stopped else self.pending), ""
        return text
