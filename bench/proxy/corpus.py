"""The training corpus: this machine's own Python sources.

Files are collected from the standard library and site-packages (or given
roots), read as UTF-8, deduplicated by the SHA-256 of their bytes and split
into train / held-out by that hash (``int(sha[:8], 16) % 1000 <
heldout_permille``), so the split does not depend on paths, walk order or
which machine collected them. The held-out split is halved the same way
(``int(sha[8:16], 16) % 2``) into ``draft`` documents (prompts for the
drafter's training data) and ``eval`` documents (prompts for evaluation and
traces).

The manifest records every kept file's hash, size and split, the counts and
sizes, and ``manifest_sha256``: the hash of the sorted ``(sha256, bytes,
split)`` lines, which identifies the corpus independently of where the
files lived.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import site
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_VERSION = 1
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class SourceFile:
    sha256: str
    nbytes: int
    path: str  # the first path seen with this content
    split: str  # "train" or "heldout"

    @property
    def heldout_role(self) -> str | None:
        """``"draft"`` or ``"eval"`` for held-out files, None for train."""
        if self.split != "heldout":
            return None
        return "draft" if int(self.sha256[8:16], 16) % 2 == 0 else "eval"


@dataclass
class Corpus:
    """Deduplicated source files (sorted by hash) and their texts."""

    files: list[SourceFile]
    texts: dict[str, str] = field(repr=False)
    roots: list[str]
    heldout_permille: int
    skipped: dict[str, int]

    def split(self, name: str, role: str | None = None) -> list[SourceFile]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of {SPLITS}")
        out = [f for f in self.files if f.split == name]
        if role is not None:
            out = [f for f in out if f.heldout_role == role]
        return out

    def manifest(self) -> dict[str, Any]:
        lines = [f"{f.sha256} {f.nbytes} {f.split}" for f in self.files]
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        counts = {s: sum(1 for f in self.files if f.split == s) for s in SPLITS}
        sizes = {s: sum(f.nbytes for f in self.files if f.split == s) for s in SPLITS}
        roles = {r: sum(1 for f in self.files if f.heldout_role == r) for r in ("draft", "eval")}
        return {
            "version": MANIFEST_VERSION,
            "manifest_sha256": digest,
            "roots": self.roots,
            "heldout_rule": f"int(sha256[:8], 16) % 1000 < {self.heldout_permille}",
            "heldout_role_rule": "int(sha256[8:16], 16) % 2 == 0 -> draft, else eval",
            "counts": counts,
            "bytes": sizes,
            "heldout_roles": roles,
            "skipped": dict(self.skipped),
            "files": [
                {"sha256": f.sha256, "bytes": f.nbytes, "split": f.split, "path": f.path}
                for f in self.files
            ],
        }


def default_roots() -> list[Path]:
    """The standard library and every site-packages directory, existing ones only."""
    cands: list[str] = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    with contextlib.suppress(AttributeError):  # virtualenv's old site.py lacks it
        cands += site.getsitepackages()
    cands.append(site.getusersitepackages())
    out: list[Path] = []
    for c in cands:
        p = Path(c).resolve()
        if p.is_dir() and p not in out:
            out.append(p)
    return out


def _walk_py(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def collect(
    roots: Sequence[str | os.PathLike[str]] | None = None,
    *,
    heldout_permille: int = 20,
    max_file_bytes: int = 1 << 20,
    max_total_bytes: int | None = None,
) -> Corpus:
    """Collect, deduplicate and split the ``.py`` files under ``roots``.

    Files over ``max_file_bytes`` (generated tables), not UTF-8, or empty are
    skipped and counted. ``max_total_bytes`` keeps the files with the
    smallest hashes whose sizes fit (a deterministic subset, the same on any
    machine holding the same files).
    """
    if not 0 < heldout_permille < 1000:
        raise ValueError(f"heldout_permille must be in (0, 1000), got {heldout_permille}")
    root_paths = [Path(r).resolve() for r in roots] if roots is not None else default_roots()
    missing = [str(r) for r in root_paths if not r.is_dir()]
    if missing:
        raise FileNotFoundError(f"corpus root(s) not found: {missing}")
    texts: dict[str, str] = {}
    first_path: dict[str, str] = {}
    skipped = {"too_large": 0, "not_utf8": 0, "empty": 0, "duplicate": 0, "unreadable": 0}
    for root in root_paths:
        for p in _walk_py(root):
            try:
                if p.stat().st_size > max_file_bytes:
                    skipped["too_large"] += 1
                    continue
                data = p.read_bytes()
            except OSError:
                skipped["unreadable"] += 1
                continue
            if not data.strip():
                skipped["empty"] += 1
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest in texts:
                skipped["duplicate"] += 1
                continue
            try:
                texts[digest] = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not_utf8"] += 1
                continue
            first_path[digest] = str(p)
    files: list[SourceFile] = []
    total = 0
    for digest in sorted(texts):
        nbytes = len(texts[digest].encode("utf-8"))
        if max_total_bytes is not None and total + nbytes > max_total_bytes:
            del texts[digest]
            skipped.setdefault("over_budget", 0)
            skipped["over_budget"] += 1
            continue
        total += nbytes
        split = "heldout" if int(digest[:8], 16) % 1000 < heldout_permille else "train"
        files.append(SourceFile(digest, nbytes, first_path[digest], split))
    if not any(f.split == "train" for f in files) or not any(f.split == "heldout" for f in files):
        raise ValueError(
            f"corpus under {[str(r) for r in root_paths]} has {len(files)} files: too few for "
            "both a train and a held-out split (add roots or raise heldout_permille)"
        )
    return Corpus(files, texts, [str(r) for r in root_paths], heldout_permille, skipped)


def write_manifest(corpus: Corpus, path: str | os.PathLike[str]) -> dict[str, Any]:
    man = corpus.manifest()
    Path(path).write_text(json.dumps(man, indent=1, sort_keys=True))
    return man
