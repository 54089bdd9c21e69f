"""Corpus dedup / split determinism / manifest, and the tokenizer's reserved ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from pdflash.bench.proxy import corpus
from pdflash.bench.proxy import tokenizer as tk


def _write_tree(root: Path, n: int) -> None:
    (root / "pkg").mkdir(parents=True)
    for i in range(n):
        (root / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 3))
    (root / "copy.py").write_text((root / "pkg" / "m3.py").read_text())  # duplicate content
    (root / "empty.py").write_text("  \n")
    (root / "latin.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8
    (root / "notes.txt").write_text("not python")


def test_collect_dedups_splits_by_hash_and_counts(tmp_path: Path) -> None:
    _write_tree(tmp_path / "a", 60)
    c = corpus.collect([tmp_path / "a"], heldout_permille=300)
    assert len(c.files) == 60  # the copy, the empty and the non-UTF-8 file are out
    assert c.skipped["duplicate"] == 1 and c.skipped["empty"] == 1 and c.skipped["not_utf8"] == 1
    assert [f.sha256 for f in c.files] == sorted(f.sha256 for f in c.files)
    for f in c.files:
        assert (f.split == "heldout") == (int(f.sha256[:8], 16) % 1000 < 300)
        assert (f.heldout_role is None) == (f.split == "train")
    man = c.manifest()
    assert man["counts"]["train"] + man["counts"]["heldout"] == 60
    assert man["bytes"]["train"] + man["bytes"]["heldout"] == sum(f.nbytes for f in c.files)
    assert man["heldout_roles"]["draft"] + man["heldout_roles"]["eval"] == man["counts"]["heldout"]
    assert {e["sha256"] for e in man["files"]} == set(c.texts)


def test_split_and_manifest_hash_do_not_depend_on_paths(tmp_path: Path) -> None:
    _write_tree(tmp_path / "a", 40)
    shutil.copytree(tmp_path / "a" / "pkg", tmp_path / "b" / "elsewhere" / "renamed")
    one = corpus.collect([tmp_path / "a" / "pkg"], heldout_permille=250).manifest()
    two = corpus.collect([tmp_path / "b"], heldout_permille=250).manifest()
    assert one["manifest_sha256"] == two["manifest_sha256"]
    assert [(f["sha256"], f["split"]) for f in one["files"]] == [
        (f["sha256"], f["split"]) for f in two["files"]
    ]
    other = corpus.collect([tmp_path / "a" / "pkg"], heldout_permille=500).manifest()
    assert other["manifest_sha256"] != one["manifest_sha256"]
    path = tmp_path / "m.json"
    corpus.write_manifest(corpus.collect([tmp_path / "a" / "pkg"], heldout_permille=250), path)
    assert json.loads(path.read_text())["manifest_sha256"] == one["manifest_sha256"]


def test_collect_errors_and_byte_budget(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        corpus.collect([tmp_path / "missing"])
    _write_tree(tmp_path / "a", 4)
    with pytest.raises(ValueError, match="too few"):
        corpus.collect([tmp_path / "a"], heldout_permille=1)
    _write_tree(tmp_path / "big", 80)
    full = corpus.collect([tmp_path / "big"], heldout_permille=300)
    cap = sum(f.nbytes for f in full.files) // 2
    part = corpus.collect([tmp_path / "big"], heldout_permille=300, max_total_bytes=cap)
    assert sum(f.nbytes for f in part.files) <= cap
    assert {f.sha256 for f in part.files} < {f.sha256 for f in full.files}


def test_default_roots_hold_the_standard_library() -> None:
    import sysconfig

    roots = corpus.default_roots()
    assert Path(sysconfig.get_paths()["stdlib"]).resolve() in roots


def test_tokenizer_reserved_ids_and_transformers_loading(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
    digest = tk.train_tokenizer(texts, 300, tmp_path / "tok")
    assert digest == tk.tokenizer_hash(tmp_path / "tok") and len(digest) == 64
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (
        tk.EOS_ID,
        tk.PAD_ID,
        tk.MASK_ID,
    )
    assert hf.convert_ids_to_tokens([0, 1, 2]) == list(tk.SPECIAL_TOKENS)
    ids = hf("def f7(x):\n    return x + 7\n").input_ids
    assert hf.decode(ids) == "def f7(x):\n    return x + 7\n"
    assert min(ids) > 2  # text never encodes to a reserved id
    raw = tk.load_tokenizer(tmp_path / "tok")
    stream, offsets = tk.encode_documents(raw, ["a = 1\n", "b = 2\n"])
    assert stream.dtype == np.uint16 and offsets.tolist()[0] == 0 and offsets[-1] == stream.size
    assert stream[offsets[1] - 1] == tk.EOS_ID and stream[-1] == tk.EOS_ID
    # a second training on the same texts gives the same tokenizer
    assert tk.train_tokenizer(texts, 300, tmp_path / "tok2") == digest
    with pytest.raises(ValueError):
        tk.train_tokenizer(texts, 100, tmp_path / "bad")
