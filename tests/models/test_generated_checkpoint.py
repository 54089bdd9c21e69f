"""Synthetic checkpoints with generated weights: no tensor files, the same
tensors as the written checkpoint, loaded through the same adapter code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.models.store import CheckpointError, SafetensorsCheckpoint, open_checkpoint
from pdflash.models.synthetic import GeneratedCheckpoint, is_generated

CASES = [
    ("qwen3_moe", None),
    ("gpt_oss", None),
    ("gpt_oss", "mxfp4"),
    ("mixtral", None),
    ("olmoe", None),
]


def _pair(tmp_path: Path, arch: str, fmt: str | None) -> tuple[Path, Path]:
    kw = {"seed": 3, "expert_format": fmt, "dtype": torch.float32}
    files = write_synthetic_checkpoint(tmp_path / "files", arch, "tiny", **kw)  # type: ignore[arg-type]
    gen = write_synthetic_checkpoint(
        tmp_path / "gen",
        arch,
        "tiny",
        weights="generated",
        **kw,  # type: ignore[arg-type]
    )
    return files, gen


@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_generated_tensors_equal_the_written_ones(
    tmp_path: Path, arch: str, fmt: str | None
) -> None:
    files, gen = _pair(tmp_path, arch, fmt)
    assert not list(gen.glob("*.safetensors")) and is_generated(gen) and not is_generated(files)
    written = open_checkpoint(files)
    drawn = open_checkpoint(gen)
    assert type(written) is SafetensorsCheckpoint and isinstance(drawn, GeneratedCheckpoint)
    assert sorted(written.keys()) == sorted(drawn.keys())
    for key in written.keys():  # noqa: SIM118
        assert drawn.shape(key) == written.shape(key), key
        assert drawn.dtype(key) == written.dtype(key), key
        whole = written.read(key)
        assert torch.equal(drawn.read(key), whole), key
        if whole.dim() >= 2 and whole.shape[0] > 1:  # a fused [E, ...] tensor's slice
            with drawn._open(key) as handle:
                assert torch.equal(drawn.read(key, 1, handle=handle), whole[1]), key
                assert torch.equal(drawn.read(key, 0, handle=handle), whole[0]), key


@pytest.mark.parametrize(("arch", "fmt"), [("qwen3_moe", None), ("gpt_oss", "mxfp4")])
def test_an_adapter_over_generated_weights_equals_one_over_files(
    tmp_path: Path, arch: str, fmt: str | None
) -> None:
    files, gen = _pair(tmp_path, arch, fmt)
    a = load_adapter(files, dtype=torch.float32)
    b = load_adapter(gen, dtype=torch.float32)
    # every expert's tensors (the packed layout's padding bytes are never read)
    for g in range(a.store.num_ids):
        va, vb = a.store.views(g), b.store.views(g)
        assert va.keys() == vb.keys()
        for name in va:
            assert torch.equal(va[name], vb[name]), (g, name)
    sa, sb = a.hf_model.state_dict(), b.hf_model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if sa[key].is_meta:
            continue
        assert torch.equal(sa[key], sb[key]), key


def test_generated_checkpoint_errors(tmp_path: Path) -> None:
    files, gen = _pair(tmp_path, "qwen3_moe", None)
    with pytest.raises(CheckpointError, match="not a synthetic checkpoint with generated"):
        GeneratedCheckpoint(files)
    drawn = open_checkpoint(gen)
    with pytest.raises(CheckpointError, match="not found"):
        drawn.read("model.layers.9.nope")
    with pytest.raises(ValueError, match="weights must be one of"):
        write_synthetic_checkpoint(tmp_path / "x", "qwen3_moe", "tiny", weights="disk")
    assert not (tmp_path / "x").exists()
    assert not is_generated(tmp_path / "missing")
