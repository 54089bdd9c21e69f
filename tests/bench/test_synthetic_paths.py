"""The engine harness's synthetic target and drafter (:func:`synthetic_paths`)
come from one keyed, atomic cache directory
(:func:`pdflash.models.synthetic.cached_directory`): reused for the same
spec, written anew when the generating device, a writer's source, a library
version or a spec field changes, and never reused after an interrupted
write. A synthetic drafter for a real target (:func:`synthetic_drafter_for`)
is keyed the same way. CPU only (a CUDA spec's writes are redirected to CPU
generation, recording the device asked for)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pdflash.bench import engine_run
from pdflash.bench.engine_run import RunSpec, synthetic_drafter_for, synthetic_paths

import pdflash.models
from pdflash.engine.drafter import load_drafter
from pdflash.models.synthetic import CACHE_MARKER

CPU = torch.device("cpu")
SPEC = RunSpec(arch="tiny", baseline="B1", layers=2, seed=3, synthetic_weights="files")


class Writes:
    """Counts the target and drafter writes (and the devices asked for);
    a CUDA write is done on CPU here, which lacks CUDA."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.targets: list[str] = []
        self.drafters = 0
        real_target = pdflash.models.write_synthetic_checkpoint
        real_drafter = engine_run.write_synthetic_drafter

        def target(*args: Any, **kwargs: Any) -> Path:
            self.targets.append(kwargs.get("device", "cpu"))
            return real_target(*args, **{**kwargs, "device": "cpu"})

        def drafter(*args: Any, **kwargs: Any) -> Path:
            self.drafters += 1
            return real_drafter(*args, **kwargs)

        monkeypatch.setattr(pdflash.models, "write_synthetic_checkpoint", target)
        monkeypatch.setattr(engine_run, "write_synthetic_drafter", drafter)

    @property
    def count(self) -> tuple[int, int]:
        return len(self.targets), self.drafters


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    return tmp_path / "synthetic"


def _digest(file: Path) -> str:
    """A file's content digest; a safetensors file's by its tensors and
    metadata (its header's metadata order varies between writes)."""
    if file.suffix != ".safetensors":
        return hashlib.sha256(file.read_bytes()).hexdigest()
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(file), "pt") as f:
        h.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for name in sorted(f.keys()):
            h.update(name.encode())
            h.update(f.get_tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _digests(path: Path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): _digest(f)
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != CACHE_MARKER
    }


def test_the_same_spec_reuses_the_target_and_drafter(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = Writes(monkeypatch)
    target, drafter, dtype = synthetic_paths(SPEC, CPU)
    assert writes.count == (1, 1) and dtype == torch.float32
    assert target.parent == drafter.parent and target.parent.parent == cache
    assert (target.parent / CACHE_MARKER).is_file()
    assert (target / "model.safetensors").is_file()
    # the drafter is derived from this target's config
    cfg = json.loads((target / "config.json").read_text())
    assert load_drafter(drafter).cfg.num_target_layers == cfg["num_hidden_layers"] == 2
    before = _digests(target.parent)

    again = synthetic_paths(SPEC, CPU)
    assert again == (target, drafter, dtype) and writes.count == (1, 1)
    assert _digests(target.parent) == before
    # an equal spec (another object) names the same directory too
    assert synthetic_paths(dataclasses.replace(SPEC), CPU)[0] == target
    assert [p.name for p in cache.iterdir()] == [target.parent.name]


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 4},
        {"layers": 1},
        {"dtype": "bfloat16"},
        {"synthetic_weights": "generated"},
        {"arch": "tiny-olmoe"},
        {"synthetic_format": "mxfp4"},
    ],
)
def test_a_changed_spec_field_writes_another_directory(
    cache: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any]
) -> None:
    # MXFP4 experts are gpt-oss's: that change is made on a gpt-oss spec
    base = dataclasses.replace(SPEC, arch="tiny-gpt_oss") if "synthetic_format" in change else SPEC
    first = synthetic_paths(base, CPU)[0]
    writes = Writes(monkeypatch)
    other = synthetic_paths(dataclasses.replace(base, **change), CPU)[0]
    assert writes.count == (1, 1) and other.parent != first.parent
    assert (first.parent / CACHE_MARKER).is_file() and (other.parent / CACHE_MARKER).is_file()
    meta = json.loads((other / "config.json").read_text())["pdflash_synthetic"]
    assert meta["seed"] == change.get("seed", SPEC.seed)
    assert meta["weights"] == change.get("synthetic_weights", "files")


@pytest.mark.parametrize("weights", ["files", "generated"])
def test_the_generating_device_is_part_of_the_key(
    cache: Path, monkeypatch: pytest.MonkeyPatch, weights: str
) -> None:
    spec = dataclasses.replace(SPEC, dtype="float32", synthetic_weights=weights)
    writes = Writes(monkeypatch)
    on_cpu = synthetic_paths(spec, CPU)[0]
    on_cuda = synthetic_paths(spec, torch.device("cuda"))[0]
    assert writes.targets == ["cpu", "cuda"] and on_cuda.parent != on_cpu.parent
    assert "-cuda" in on_cuda.parent.name and "-cpu" in on_cpu.parent.name
    # each device's directory is reused by that device only
    assert synthetic_paths(spec, torch.device("cuda:0"))[0] == on_cuda
    assert synthetic_paths(spec, CPU)[0] == on_cpu
    assert writes.count == (2, 2)


@pytest.mark.parametrize(
    "module", ["pdflash.models.synthetic", "pdflash.engine.drafter"], ids=["target", "drafter"]
)
def test_a_changed_writer_source_writes_anew(
    cache: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    first = synthetic_paths(SPEC, CPU)[0]
    writes = Writes(monkeypatch)
    real = inspect.getsource

    def edited(obj: Any) -> str:
        text = real(obj)
        return text + "\n# edited\n" if getattr(obj, "__name__", "") == module else text

    monkeypatch.setattr(inspect, "getsource", edited)
    other = synthetic_paths(SPEC, CPU)[0]
    assert writes.count == (1, 1) and other.parent != first.parent


@pytest.mark.parametrize("library", ["torch", "transformers"])
def test_a_changed_library_version_writes_anew(
    cache: Path, monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    import transformers

    first = synthetic_paths(SPEC, CPU)[0]
    writes = Writes(monkeypatch)
    module = {"torch": torch, "transformers": transformers}[library]
    monkeypatch.setattr(module, "__version__", "0.0.0-other")
    other = synthetic_paths(SPEC, CPU)[0]
    assert writes.count == (1, 1) and other.parent != first.parent


def test_a_failed_or_interrupted_write_is_never_reused(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_drafter = engine_run.write_synthetic_drafter

    def interrupted(path: Path, *args: Any, **kwargs: Any) -> Path:
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    # the drafter's write fails after the target's: nothing is left behind
    monkeypatch.setattr(engine_run, "write_synthetic_drafter", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synthetic_paths(SPEC, CPU)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(engine_run, "write_synthetic_drafter", real_drafter)

    writes = Writes(monkeypatch)
    target, drafter, _ = synthetic_paths(SPEC, CPU)
    assert writes.count == (1, 1)
    want = _digests(target.parent)
    # a process killed mid-write (no clean-up ran) leaves its temporary
    # sibling; a directory left by an in-place writer has no marker (or the
    # old layout's COMPLETE file): neither is reused
    (cache / f".{target.parent.name}.killed").mkdir()
    (target.parent / CACHE_MARKER).unlink()
    (target.parent / "COMPLETE").write_text("ok\n")
    (target / "model.safetensors").write_bytes(b"truncated")
    again = synthetic_paths(SPEC, CPU)
    assert again[0] == target and writes.count == (2, 2)
    assert _digests(target.parent) == want  # the stale copy replaced whole
    assert load_drafter(drafter).cfg.num_target_layers == 2
    # a marker whose key differs (written by another version): rewritten too
    (target.parent / CACHE_MARKER).write_text("{}")
    synthetic_paths(SPEC, CPU)
    assert writes.count == (3, 3)


def test_a_synthetic_drafter_for_a_real_target_is_keyed(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = synthetic_paths(SPEC, CPU)[0]
    writes = Writes(monkeypatch)
    first = synthetic_drafter_for(target, 4, torch.float32)
    assert writes.drafters == 1 and (first / CACHE_MARKER).is_file()
    assert load_drafter(first).cfg.num_target_layers == 2
    assert synthetic_drafter_for(target, 4, torch.float32) == first and writes.drafters == 1
    # another dtype, seed or target config: another drafter
    assert synthetic_drafter_for(target, 4, torch.bfloat16) != first
    assert synthetic_drafter_for(target, 5, torch.float32) != first
    other = synthetic_paths(dataclasses.replace(SPEC, layers=1), CPU)[0]
    assert writes.drafters == 4
    mirror = cache.parent / "real" / target.name
    mirror.mkdir(parents=True)
    (mirror / "config.json").write_text((other / "config.json").read_text())
    assert load_drafter(synthetic_drafter_for(mirror, 4, torch.float32)).cfg.num_target_layers == 1
    assert writes.drafters == 5
