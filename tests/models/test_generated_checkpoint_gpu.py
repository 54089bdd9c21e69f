"""Generated synthetic weights drawn on CUDA (as the bench does on a GPU)
equal the files the writer draws on CUDA, and CUDA bench runs use the shared
warm-up (auto) once per shape, over generated or written weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.models.store import open_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("arch", "fmt"), [("qwen3_moe", None), ("gpt_oss", "mxfp4")])
def test_cuda_generated_weights_equal_cuda_written_ones(
    tmp_path: Path, arch: str, fmt: str | None
) -> None:
    kw = {"seed": 5, "expert_format": fmt, "dtype": torch.bfloat16, "device": "cuda"}
    files = write_synthetic_checkpoint(tmp_path / "f", arch, "tiny", **kw)  # type: ignore[arg-type]
    gen = write_synthetic_checkpoint(tmp_path / "g", arch, "tiny", weights="generated", **kw)  # type: ignore[arg-type]
    written, drawn = open_checkpoint(files), open_checkpoint(gen)
    for key in written.keys():  # noqa: SIM118
        assert torch.equal(drawn.read(key), written.read(key)), key
    a = load_adapter(files, device="cuda")
    b = load_adapter(gen, device="cuda")
    for g in range(a.store.num_ids):
        va, vb = a.store.views(g), b.store.views(g)
        for name in va:
            assert torch.equal(va[name], vb[name]), (g, name)


def test_a_cuda_run_over_generated_weights_with_the_shared_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.bench import engine_run
    from pdflash.bench.engine_run import RunSpec, run_spec

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    engine_run.release_targets()
    kw = {"arch": "tiny", "baseline": "B1", "device": "cuda", "concurrency": 3}
    kw |= {"num_requests": 5, "block_size": 6, "max_new_tokens": 7, "prompt_len": 5}
    first = run_spec(RunSpec(**kw))  # type: ignore[arg-type]
    again = run_spec(RunSpec(**kw, repeat=0))  # type: ignore[arg-type]
    engine_run.release_targets()
    files = run_spec(RunSpec(**kw, synthetic_weights="files"))  # type: ignore[arg-type]
    assert first.row["warmup"]["mode"] == "shared"
    assert first.row["warmup"]["shared"]["ran_now"] is True
    assert again.row["warmup"]["shared"]["ran_now"] is False
    assert files.row["warmup"]["shared"]["ran_now"] is True  # released: warmed again
    # (the weights' bit-identity is the test above; CUDA kernels need not route
    # bit-identically run to run, so only the workload's own counts compare)
    for name in ("committed_tokens", "num_requests", "cache_slots", "expert_nbytes"):
        assert first.row[name] == again.row[name] == files.row[name], name
    assert first.row["synthetic_weights"] == "generated"
    assert files.row["synthetic_weights"] == "files"
