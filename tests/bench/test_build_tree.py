"""bench/h200/build_tree.sh: SKIP_BUILD=1 skips the install only where this
machine last built this very tree; a fresh machine, a changed source or a
failed install builds (or stays unmarked)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "h200" / "build_tree.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("sha256sum") is None,
    reason="needs bash and sha256sum",
)


def _setup(tmp_path: Path, install_rc: int) -> tuple[Path, Path, Path, dict[str, str]]:
    repo = tmp_path / "repo"
    (repo / "pdflash").mkdir(parents=True)
    (repo / "pdflash" / "a.py").write_text("x = 1\n")
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "installs.txt"
    fake = bin_dir / "python3"
    # stands in for `python3 -m pip install ...`: records the call, exits as told
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> "{calls}"\nexit {install_rc}\n')
    fake.chmod(0o755)
    mark = tmp_path / "mark"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PDFLASH_BUILT_MARK": str(mark),
    }
    return repo, calls, mark, env


def _run(repo: Path, env: dict[str, str], skip: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), str(repo)],
        env={**env, "SKIP_BUILD": "1" if skip else "0"},
        capture_output=True,
        text=True,
        check=False,
    )


def _installs(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_skip_only_where_this_tree_was_built(tmp_path: Path) -> None:
    repo, calls, mark, env = _setup(tmp_path, install_rc=0)
    first = _run(repo, env, skip=True)  # a fresh machine: no marker yet
    assert first.returncode == 0
    assert "has not built this tree" in first.stdout
    assert _installs(calls) == 1 and mark.exists()
    assert "install" in calls.read_text() and str(repo) in calls.read_text()

    again = _run(repo, env, skip=True)
    assert again.returncode == 0 and "build skipped" in again.stdout
    assert _installs(calls) == 1

    # recorded results are not sources: they leave the marker valid
    (repo / "bench" / "results" / "new.json").write_text("{}")
    assert "build skipped" in _run(repo, env, skip=True).stdout

    (repo / "pdflash" / "a.py").write_text("x = 2\n")  # the tree changed
    changed = _run(repo, env, skip=True)
    assert "has not built this tree" in changed.stdout
    assert _installs(calls) == 2

    forced = _run(repo, env, skip=False)  # without SKIP_BUILD it always builds
    assert "build rc=0" in forced.stdout and _installs(calls) == 3


def test_failed_install_leaves_no_marker(tmp_path: Path) -> None:
    repo, calls, mark, env = _setup(tmp_path, install_rc=3)
    failed = _run(repo, env, skip=True)
    assert failed.returncode == 3 and "build rc=3" in failed.stdout
    assert not mark.exists()
    _run(repo, env, skip=True)  # so the next call tries again
    assert _installs(calls) == 2
