"""The test tree mirrors the package (issue 11, item 6): every test module
sits in a directory named for the package or bench module it tests, the old
directories named for a kind of test are gone, and the kinds are markers
(``native``, ``property``, ``gpu``, ``faults``, ``slow``) that select tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

#: test directory -> the module it mirrors
DOMAINS = {
    "bench": "pdflash.bench",
    "cache": "pdflash.cache",
    "distributed": "pdflash.distributed",
    "engine": "pdflash.engine",
    "h2d": "pdflash.h2d",
    "hybrid": "pdflash.hybrid",
    "integrations": "pdflash.integrations",
    "models": "pdflash.models",
    "package": "pdflash",
    "report": "pdflash.report",
    "routeahead": "pdflash.routeahead",
    "scheduler": "pdflash.scheduler",
    "serve": "pdflash.serve",
}
#: the directories that named a kind of test (or a suite) instead of a module
OLD_DIRS = ("unit", "native", "property", "gpu", "benchsuite", "proxy", "faults")
#: kinds that must each select tests (``slow`` is a choice, not a guarantee)
KINDS = ("native", "property", "gpu", "faults")

CENSUS_PLUGIN = """
import json, os

def pytest_collection_finish(session):
    counts = {}
    for item in session.items:
        for name in {m.name for m in item.iter_markers()}:
            counts[name] = counts.get(name, 0) + 1
    with open(os.environ["PDFLASH_MARKER_CENSUS"], "w") as f:
        json.dump({"selected": len(session.items), "by_marker": counts}, f)
"""


def test_every_test_module_sits_in_a_domain_directory() -> None:
    modules = [p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")]
    assert modules
    misplaced = sorted(str(p) for p in modules if p.parts[0] not in DOMAINS)
    assert not misplaced, f"test modules outside {sorted(DOMAINS)}: {misplaced}"


@pytest.mark.parametrize(("directory", "module"), sorted(DOMAINS.items()))
def test_each_domain_directory_mirrors_a_module(directory: str, module: str) -> None:
    assert importlib.util.find_spec(module) is not None, module
    assert any((TESTS / directory).rglob("test_*.py")), f"tests/{directory} holds no tests"


def test_the_old_kind_directories_are_gone() -> None:
    left = sorted(str(p.relative_to(TESTS)) for d in OLD_DIRS for p in (TESTS / d).rglob("*"))
    assert not left, left
    assert not [d for d in OLD_DIRS if (TESTS / d).exists()]


def test_each_kind_marker_selects_tests(tmp_path: Path) -> None:
    """``pytest -m native`` (and ``property``, ``gpu``, ``faults``) selects
    tests: one collect-only run of ``-m "native or property or ..."``, its
    selection counted per marker."""
    (tmp_path / "marker_census.py").write_text(CENSUS_PLUGIN)
    out = tmp_path / "census.json"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    args = ["--co", "-q", "-p", "no:cacheprovider", "-p", "marker_census"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-m", " or ".join(KINDS), str(TESTS)],
        cwd=tmp_path,  # never import the source tree instead of the install
        env={**os.environ, "PYTHONPATH": path, "PDFLASH_MARKER_CENSUS": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    census = json.loads(out.read_text())
    counts = {kind: census["by_marker"].get(kind, 0) for kind in KINDS}
    assert all(n > 0 for n in counts.values()), counts
    assert census["selected"] >= max(counts.values())
