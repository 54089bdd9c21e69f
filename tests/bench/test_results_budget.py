"""The device tool copies every tracked file (64 MiB at most), so the
committed results must stay well under that; ``bench/compact_results.py``
gzips raw results, and this test fails before the tree creeps back over.
The budget leaves 15 MiB of the copy for the code (5.4 MiB in the fifty-third
session) and the next results (the proxy traces, already compressed, are most
of what grows: 4.8-7.8 MB each since they record the gate lookahead and
route-ahead's approximate router)."""

from __future__ import annotations

import gzip
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET_BYTES = 49 * 1024 * 1024


def _tracked(under: str) -> list[Path] | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--", under], cwd=ROOT, capture_output=True, check=False
    )
    if proc.returncode != 0:
        return None
    return [ROOT / p for p in proc.stdout.decode().split("\0") if p]


def test_tracked_results_stay_under_budget() -> None:
    files = _tracked("bench/results")
    if files is None:
        pytest.skip("not a git checkout")
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total < BUDGET_BYTES, (
        f"tracked bench/results is {total / 2**20:.1f} MiB (budget "
        f"{BUDGET_BYTES / 2**20:.0f} MiB): run `python3 bench/compact_results.py` "
        "and commit the .gz files"
    )


def test_compact_round_trips_and_is_deterministic(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "compact_results", ROOT / "bench" / "compact_results.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    data = b"".join(b'{"i": %d, "pad": "%s"}\n' % (i, b"x" * 40) for i in range(3000))
    big, small, md = tmp_path / "rows.jsonl", tmp_path / "small.log", tmp_path / "README.md"
    big.write_bytes(data)
    small.write_bytes(b"short\n")
    md.write_bytes(data)
    # a trained tokenizer and a big csv go too; other .json (summaries that
    # scripts read back) stay plain
    tok, csv, summary = tmp_path / "tokenizer.json", tmp_path / "rows.csv", tmp_path / "s.json"
    for p in (tok, csv, summary):
        p.write_bytes(data)
    assert mod.candidates(tmp_path) == sorted([big, tok, csv])
    tok.unlink()
    csv.unlink()
    out = mod.compact(big)
    assert out == tmp_path / "rows.jsonl.gz" and not big.exists()
    assert gzip.decompress(out.read_bytes()) == data
    assert out.read_bytes() == mod.gzip_bytes(data)  # same bytes on every run
    assert small.exists() and md.exists()
