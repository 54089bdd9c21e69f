"""A cached synthetic checkpoint (:func:`cached_synthetic_checkpoint`) holds
the bytes a fresh write of the same arguments holds, is reused while its key
is unchanged, and is written anew when an argument, the writer or a library
version changes, or when an earlier write did not complete."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pdflash.models import synthetic
from pdflash.models.synthetic import (
    CACHE_MARKER,
    cached_synthetic_checkpoint,
    synthetic_cache_key,
    write_synthetic_checkpoint,
)

ARGS = dict(num_layers=1, dtype=torch.float32, seed=3, expert_format="mxfp4")


def _digests(path: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.suffix == ".safetensors"
    }


def test_a_cached_checkpoint_has_the_bytes_of_a_fresh_write(tmp_path: Path) -> None:
    cached, reused = cached_synthetic_checkpoint(tmp_path / "cache", "gpt_oss", "tiny", **ARGS)
    fresh = write_synthetic_checkpoint(tmp_path / "fresh", "gpt_oss", "tiny", **ARGS)  # type: ignore[arg-type]
    assert not reused and (cached / CACHE_MARKER).is_file()
    assert _digests(cached) and _digests(cached) == _digests(fresh)
    # the MXFP4 experts are there as blocks and scales
    from safetensors import safe_open

    with safe_open(str(cached / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert any(k.endswith("gate_up_proj_blocks") for k in keys)
    assert any(k.endswith("down_proj_scales") for k in keys)


def test_a_cached_checkpoint_is_reused_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, reused = cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    assert not reused
    before = _digests(first)

    def no_write(*_a: object, **_k: object) -> None:
        raise AssertionError("a reused checkpoint must not be written again")

    monkeypatch.setattr(synthetic, "write_synthetic_checkpoint", no_write)
    again, reused = cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    assert reused and again == first and _digests(again) == before
    # nothing but the one checkpoint is left under the cache
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 4},
        {"num_layers": 2},
        {"dtype": torch.bfloat16},
        {"expert_format": None},
        {"shard_bytes": 1 << 20},
    ],
)
def test_a_changed_argument_writes_another_checkpoint(
    tmp_path: Path, change: dict[str, object]
) -> None:
    first, _ = cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    other, reused = cached_synthetic_checkpoint(
        tmp_path,
        "gpt_oss",
        "tiny",
        **{**ARGS, **change},  # type: ignore[arg-type]
    )
    assert not reused and other != first
    assert (first / CACHE_MARKER).is_file() and (other / CACHE_MARKER).is_file()


def test_a_changed_library_version_or_writer_changes_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = synthetic_cache_key("gpt_oss", "tiny", **ARGS)  # type: ignore[arg-type]
    assert key["writer"] and key["torch"] == torch.__version__
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert synthetic_cache_key("gpt_oss", "tiny", **ARGS) != key  # type: ignore[arg-type]
    monkeypatch.undo()

    import inspect

    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + "\n# edited\n")
    assert synthetic_cache_key("gpt_oss", "tiny", **ARGS)["writer"] != key["writer"]  # type: ignore[arg-type]


def test_an_incomplete_or_stale_checkpoint_is_written_again(tmp_path: Path) -> None:
    first, _ = cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    want = _digests(first)
    # an interrupted write: the marker is missing, a shard is damaged
    (first / CACHE_MARKER).unlink()
    (first / "model.safetensors").write_bytes(b"truncated")
    again, reused = cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    assert not reused and again == first and _digests(again) == want
    # a marker whose key differs (written by another version): not reused either
    (first / CACHE_MARKER).write_text("{}")
    _, reused = cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    assert not reused
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(path: Path, *_a: object, **_k: object) -> None:
        (Path(path) / "partial.safetensors").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(synthetic, "write_synthetic_checkpoint", failing)
    with pytest.raises(OSError, match="disk full"):
        cached_synthetic_checkpoint(tmp_path, "gpt_oss", "tiny", **ARGS)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_writers_temporary_directory_is_removed_by_the_next_write(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    key = {"what": "a directory"}
    final, reused = synthetic.cached_directory(tmp_path, "d", key, lambda p: None)
    assert not reused and final.name.startswith("d-")
    # what a killed writer leaves: its temporary sibling, named by host and pid
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = synthetic._host_tag()
    dead = tmp_path / f".{final.name}.{host}.{gone.pid}.abc"
    alive = tmp_path / f".{final.name}.{host}.{os.getpid()}.abc"
    other_host = (
        tmp_path / f".{final.name}.{'0' * 8 if host != '0' * 8 else '1' * 8}.{gone.pid}.abc"
    )
    for d in (dead, alive, other_host):
        (d / "part").mkdir(parents=True)
    # a reuse touches nothing; the next write removes only the dead writer's
    assert synthetic.cached_directory(tmp_path, "d", key, lambda p: None) == (final, True)
    assert dead.exists()
    (final / CACHE_MARKER).unlink()
    written: list[Path] = []
    again, reused = synthetic.cached_directory(tmp_path, "d", key, written.append)
    assert not reused and again == final and (final / CACHE_MARKER).is_file()
    assert written and written[0].parent == tmp_path and not written[0].exists()
    assert not dead.exists() and alive.exists() and other_host.exists()


def test_source_digest_without_the_source_digests_the_module_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module installed without its .py (inspect finds no source) is
    keyed by its compiled file's bytes instead of failing the cache."""
    import inspect
    from pathlib import Path

    import pdflash.models.synthetic as synthetic

    with_source = synthetic.source_digest("pdflash.models.synthetic")

    def no_source(obj: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    got = synthetic.source_digest("pdflash.models.synthetic")
    want = hashlib.sha256(Path(str(synthetic.__file__)).read_bytes()).hexdigest()[:16]
    assert got == want and len(got) == 16
    # the file here is the .py itself: the same bytes as its source
    assert got == with_source
