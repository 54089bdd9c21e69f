"""Stop strings held back until they cannot match, incremental
detokenization, and the synthetic tokenizer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash.text import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TokenizerError,
    load_tokenizer,
    stop_token_ids,
    write_synthetic_tokenizer,
)


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out, stopped = "", False
    for p in pieces:
        text, stopped = m.feed(p)
        out += text
        if stopped:
            return out, True
    return out + m.flush(), False


def test_stop_string_split_across_pieces() -> None:
    assert _run(["END"], ["abc E", "N", "D tail"]) == ("abc ", True)
    # a partial match that fails is released, not lost
    assert _run(["END"], ["abc E", "N", "x"]) == ("abc ENx", False)
    m = StopStringMatcher(["END"])
    assert m.feed("abc EN") == ("abc ", False)  # "EN" held back
    assert m.pending == "EN"


def test_earliest_stop_wins_and_empty_stop_refused() -> None:
    assert _run(["cd", "b"], ["abcd"]) == ("a", True)
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@given(
    st.text(alphabet="abEND", max_size=30),
    st.lists(st.integers(0, 30), max_size=6),
    st.lists(st.sampled_from(["END", "ab", "NDa", "E"]), min_size=1, max_size=3),
)
def test_stop_matcher_equals_whole_text_search(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[: min(hits)], True) if hits else (text, False)
    assert _run(stops, pieces) == expected


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> object:
    path: Path = write_synthetic_tokenizer(tmp_path_factory.mktemp("tok"), 128)
    return load_tokenizer(path)


def test_synthetic_tokenizer_fits_vocab_and_has_chat_template(tok: object, tmp_path: Path) -> None:
    t: object = tok
    assert len(t) <= 128  # type: ignore[arg-type]
    ids = t("Hello, world!")["input_ids"]  # type: ignore[operator]
    assert all(0 <= i < 128 for i in ids)
    assert t.decode(ids) == "Hello, world!"  # type: ignore[attr-defined]
    prompt = t.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="too small"):
        write_synthetic_tokenizer(tmp_path / "small", 50)


def test_incremental_detokenizer_concatenates_to_decode(tok: object) -> None:
    t: object = tok
    ids = t("The quick brown fox, 1234!\nok")["input_ids"] + [2, 0]  # type: ignore[operator]
    d = IncrementalDetokenizer(t)
    text = "".join(d.add([i]) for i in ids) + d.flush()
    assert text == t.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert text == "The quick brown fox, 1234!\nok"


def test_stop_token_ids_and_missing_tokenizer(tok: object, tmp_path: Path) -> None:
    path = write_synthetic_tokenizer(tmp_path / "t", 128)
    t = load_tokenizer(path)
    ids = stop_token_ids(t, path)
    assert t.convert_ids_to_tokens(ids) == ["<|endoftext|>", "<|im_end|>"]
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def byte_tok() -> object:
    """A byte-level BPE tokenizer (as GPT-2 / Qwen use) with few merges, so
    multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(["hello wörld, naïve café 🙂 — ok"] * 8, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@given(st.text(alphabet="ab é🙂ñ—\n", max_size=40), st.integers(1, 4))
def test_incremental_detokenizer_byte_level(byte_tok: object, text: str, group: int) -> None:
    t: object = byte_tok
    ids = t(text)["input_ids"]  # type: ignore[operator]
    d = IncrementalDetokenizer(t)
    pieces = [d.add(ids[i : i + group]) for i in range(0, len(ids), group)]
    assert not any("\ufffd" in p for p in pieces)  # never a half character
    assert "".join(pieces) + d.flush() == text
