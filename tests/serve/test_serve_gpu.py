"""``pdflash serve``'s engine loop and the transformers integration on a CUDA
device (CUDA-backend issuer): greedy outputs equal the references, resources
return to zero. No HTTP client needed (the CPU tests cover the HTTP layer)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from pdflash.engine.sampling import SamplingParams
from pdflash.models import write_synthetic_checkpoint
from pdflash.serve.build import ServeModelConfig, build_engine, write_synthetic_model
from pdflash.serve.loop import EngineLoop, Finish, GenerationRequest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


class _Collect:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: Finish | None = None
        self.done = threading.Event()

    def on_tokens(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def on_finish(self, finish: Finish) -> None:
        self.finish = finish
        self.done.set()


def _run(loop: EngineLoop, prompts: list[list[int]], n: int) -> list[list[int]]:
    sinks = [_Collect() for _ in prompts]
    for p, s in zip(prompts, sinks, strict=True):
        loop.submit(GenerationRequest(p, SamplingParams(), n, (), s))
    for s in sinks:
        assert s.done.wait(120)
        assert s.finish is not None and s.finish.reason == "length"
    return [s.tokens for s in sinks]


def test_engine_loop_on_cuda_pd_and_pd_host_equal_b0(tmp_path: Path) -> None:
    target, draft = write_synthetic_model(tmp_path, "qwen3_moe", "tiny", dtype=torch.float32)
    prompts = [[5, 9, 33, 17], [1, 2, 3], [60, 61, 62, 63, 64]]
    outs = {}
    # PD+host on CUDA: the start-up link probe and the host service's build and
    # close on the CUDA issuer (whether the planner hosts a tiny expert is its
    # cost model's call; the CPU tests force hosting on a slow emulated link)
    for baseline, d in (("B0", None), ("PD", draft), ("PD+host", draft), ("PD-all-on", draft)):
        cfg = ServeModelConfig(
            model=str(target),
            draft=None if d is None else str(d),
            device="cuda",
            baseline=baseline,
            cache_fraction=0.3,
            block_size=4,
        )
        loop = EngineLoop(lambda cfg=cfg: build_engine(cfg))
        loop.start(timeout_s=120)
        try:
            outs[baseline] = _run(loop, prompts, 16)
            counts = loop.call(lambda b: b.resource_counts())
            assert counts["kv_pages"] == counts["expert_pins"] == counts["running"] == 0
            has_service = loop.call(lambda b: b.engine.host_service is not None)
            assert has_service is (baseline == "PD+host")
        finally:
            loop.stop()
    assert outs["PD"] == outs["B0"] == outs["PD+host"] == outs["PD-all-on"]


def test_transformers_offload_on_cuda_equals_resident(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pdflash.integrations.transformers import offload

    path = write_synthetic_checkpoint(tmp_path / "q", "qwen3_moe", "tiny", dtype=torch.float32)
    ids = torch.tensor([[5, 17, 33, 9, 60, 7]], device="cuda")
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    want = plain.generate(ids, max_new_tokens=16, do_sample=False)
    model = offload(path, cache_fraction=0.3, device="cuda", dtype=torch.float32)
    try:
        got = model.generate(ids, max_new_tokens=16, do_sample=False)
        assert model.pdflash.stats()["misses"] > 0
    finally:
        model.pdflash.close()
    assert torch.equal(got, want)
