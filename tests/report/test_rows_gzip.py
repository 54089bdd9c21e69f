"""Committed results are gzipped (bench/compact_results.py): the row readers
must read ``.jsonl.gz`` exactly as the plain file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pdflash.report.writers import RowFileError, load_rows, read_jsonl, results_path

ROWS = [
    {"arch": "tiny", "baseline": "PD", "concurrency": 1, "output_tokens_per_s": 12.5},
    {"arch": "tiny", "baseline": "AR", "concurrency": 4, "output_tokens_per_s": float("nan")},
]


def _text(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows) + "\n"


def _same(a: list[dict[str, object]], b: list[dict[str, object]]) -> bool:
    # NaN != NaN, so compare the JSON text
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_gzipped_file_and_folder_read_as_the_plain_ones(tmp_path: Path) -> None:
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    (plain / "rows-a.jsonl").write_text(_text(ROWS[:1]))
    (plain / "rows-b.jsonl").write_text(_text(ROWS[1:]))
    (packed / "rows-a.jsonl.gz").write_bytes(gzip.compress(_text(ROWS[:1]).encode()))
    (packed / "rows-b.jsonl").write_text(_text(ROWS[1:]))  # a mixed folder

    assert _same(load_rows(plain), ROWS)
    assert _same(load_rows(packed), load_rows(plain))
    assert _same(load_rows(packed / "rows-a.jsonl.gz"), load_rows(plain / "rows-a.jsonl"))
    # the plain name falls back to the committed .gz
    assert results_path(packed / "rows-a.jsonl") == packed / "rows-a.jsonl.gz"
    assert _same(read_jsonl(packed / "rows-a.jsonl"), ROWS[:1])


def test_a_gz_beside_its_plain_file_is_not_read_twice(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text(_text(ROWS))
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(_text(ROWS).encode()))
    assert len(load_rows(tmp_path)) == len(ROWS)


def test_bad_line_in_a_gz_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "rows.jsonl.gz"
    f.write_bytes(gzip.compress(b'{"arch": "tiny"}\nnot json\n'))
    with pytest.raises(RowFileError, match=r"rows\.jsonl\.gz:2: not JSON"):
        load_rows(tmp_path)
