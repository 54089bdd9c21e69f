"""Gzip the committed raw results under ``bench/results/`` so the tracked tree
stays small (the device tool copies every tracked file, 64 MiB at most).

Every ``.jsonl``, ``.txt``, ``.log`` and ``.csv`` over 32 KiB, and every
``tokenizer.json`` (a trained proxy's, kept as provenance), becomes ``NAME.gz``
(deterministic: no name, mtime 0, like ``gzip -n``); the gzip is read back and
compared byte for byte before the original goes. ``pdflash-bench report`` and
the summaries read ``.jsonl.gz`` as they are (``pdflash.report.writers``).

    python3 bench/compact_results.py [ROOT] [--dry-run]   # ROOT: bench/results
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
from pathlib import Path

SUFFIXES = (".jsonl", ".txt", ".log", ".csv")
#: files gzipped by name whatever their suffix (no code reads the committed ones)
NAMES = ("tokenizer.json",)
MIN_BYTES = 32 * 1024


def candidates(root: Path) -> list[Path]:
    """Files this tool gzips: the suffixes and names above, over ``MIN_BYTES``."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and (p.suffix in SUFFIXES or p.name in NAMES)
        and p.stat().st_size > MIN_BYTES
    )


def gzip_bytes(data: bytes) -> bytes:
    """``data`` gzipped with no file name and mtime 0 (same input, same bytes)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return buf.getvalue()


def compact(path: Path) -> Path:
    """Write ``path.gz``, check it gunzips to ``path``'s bytes, delete ``path``."""
    data = path.read_bytes()
    out = path.with_name(path.name + ".gz")
    if out.exists():
        raise FileExistsError(f"{out} exists; not overwriting")
    out.write_bytes(gzip_bytes(data))
    if gzip.decompress(out.read_bytes()) != data:
        out.unlink()
        raise RuntimeError(f"{out} does not round-trip to {path}; original kept")
    path.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--dry-run", action="store_true", help="only list what would be gzipped")
    args = ap.parse_args(argv)
    before = after = 0
    for path in candidates(args.root):
        size = path.stat().st_size
        before += size
        if args.dry_run:
            print(f"{size:>10}  {path}")
            continue
        out = compact(path)
        after += out.stat().st_size
        print(f"{size:>10} -> {out.stat().st_size:>9}  {out}")
    print(f"total {before} bytes" + ("" if args.dry_run else f" -> {after} bytes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
