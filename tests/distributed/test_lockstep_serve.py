"""``pdflash serve --gpus 2`` on CPU: rank 0's serving loop drives a
LockstepEngine, rank 1 follows; the streamed tokens equal the single-process
server's, and stopping the server ends the follower."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pdflash.distributed import RankGroup, distributed_available, launch

pytestmark = [
    pytest.mark.skipif(not distributed_available(), reason="torch.distributed with gloo needed"),
    pytest.mark.timeout(300),
]

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8], [3]]


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: Any = None
        self.done = threading.Event()

    def on_tokens(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def on_finish(self, finish: Any) -> None:
        self.finish = finish
        self.done.set()


def _serve(cfg: Any, probe: Any = None) -> Any:
    """Rank 0 (or a single process): the real serving loop over the engine;
    with ``probe``, also what ``probe(bundle)`` reads after the requests."""
    from pdflash.engine.sampling import SamplingParams
    from pdflash.serve.build import build_engine
    from pdflash.serve.loop import EngineLoop, GenerationRequest

    torch.set_num_threads(1)
    loop = EngineLoop(lambda: build_engine(cfg))
    loop.start(timeout_s=120)
    try:
        sinks = [_Sink() for _ in PROMPTS]
        for prompt, sink in zip(PROMPTS, sinks, strict=True):
            loop.submit(GenerationRequest(prompt, SamplingParams(), 8, (), sink))
        for sink in sinks:
            assert sink.done.wait(120)
        out = [(s.tokens, s.finish.reason) for s in sinks]
        return out if probe is None else (out, loop.call(probe))
    finally:
        loop.stop()


def _rank(group: RankGroup, cfg: Any) -> Any:
    if group.is_main:
        return _serve(cfg)
    from pdflash.distributed.lockstep import follow
    from pdflash.serve.build import build_engine

    torch.set_num_threads(1)
    bundle = build_engine(cfg)
    try:
        return follow(bundle.engine, group)
    finally:
        bundle.close()


def _host_books(bundle: Any) -> dict[str, Any]:
    service = bundle.engine.host_service
    return {"experts": service.books.experts, "owned": int(bundle.cache.owned.sum())}


def _host_rank(group: RankGroup, cfg: Any) -> Any:
    """:func:`_rank` for PD+host: each rank also reports its host's books."""
    if group.is_main:
        return _serve(cfg, probe=_host_books)
    from pdflash.distributed.lockstep import follow
    from pdflash.serve.build import build_engine

    torch.set_num_threads(1)
    bundle = build_engine(cfg)
    try:
        steps = follow(bundle.engine, group)
        return steps, _host_books(bundle)
    finally:
        bundle.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from pdflash.serve.build import write_synthetic_model

    target, draft = write_synthetic_model(
        tmp_path_factory.mktemp("ep-serve"), "qwen3_moe", num_layers=3, seed=1
    )
    assert draft is not None
    return target, draft


def test_serve_two_ranks_streams_the_single_process_tokens(model: tuple[Path, Path]) -> None:
    from pdflash.serve.build import ServeModelConfig

    target, draft = model
    base = dict(model=str(target), draft=str(draft), device="cpu", cache_fraction=0.3)
    # ranks verify every draft (an adaptive width decides from each rank's own
    # timings); the single process does too, so both run the same batch shapes
    single = _serve(ServeModelConfig(**base, verify_width="full"))  # type: ignore[arg-type]
    results = launch(_rank, 2, ServeModelConfig(**base, gpus=2), device="cpu")  # type: ignore[arg-type]
    assert [reason for _, reason in single] == ["length"] * len(PROMPTS)
    assert results[0] == single
    assert results[1] > 0  # the follower stepped with rank 0 and was stopped by it


def test_serve_two_ranks_with_the_host_service_streams_pd_tokens(model: tuple[Path, Path]) -> None:
    """``--baseline PD+host --gpus 2``: each rank's host computes misses of
    its own experts (a slow emulated link makes hosting pay); the streamed
    tokens equal a single process's PD, whichever side computed an expert."""
    from pdflash.serve.build import ServeModelConfig

    target, draft = model
    slow = {"cache_fraction": 0.3, "emulated_link_gbps": 0.01}
    base = dict(model=str(target), draft=str(draft), device="cpu", **slow)
    single = _serve(ServeModelConfig(**base, baseline="PD", verify_width="full"))  # type: ignore[arg-type]
    cfg = ServeModelConfig(**base, baseline="PD+host", gpus=2)  # type: ignore[arg-type]
    (tokens, main_books), (steps, follower_books) = launch(_host_rank, 2, cfg, device="cpu")
    assert tokens == single
    assert steps > 0
    for books in (main_books, follower_books):
        assert books["experts"] > 0, "a rank's host served no miss"
    # the ranks' stores hold disjoint halves of the experts
    assert main_books["owned"] + follower_books["owned"] == _expert_count(target)


def _expert_count(target: Path) -> int:
    """Layers x experts of the checkpoint (every layer of it is MoE)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(target)
    return int(c.num_hidden_layers) * int(c.num_experts)


def test_pd_host_on_more_ranks_than_the_experts_spread_over_is_refused(
    model: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round robin leaves ranks past layers + experts - 1 without an expert;
    with PD+host each rank's host computes its own experts, so the build
    refuses (before any collective) and closes what it opened."""
    import pdflash.distributed as distributed
    from pdflash.h2d import H2DIssuer
    from pdflash.serve.build import ServeModelConfig, build_engine

    target, draft = model
    ranks = _grid_span(target) + 1
    group = RankGroup(
        rank=0, world_size=ranks, local_rank=0, device=torch.device("cpu"), backend="gloo"
    )
    monkeypatch.setattr(distributed, "current_group", lambda: group)
    closed: list[H2DIssuer] = []
    close = H2DIssuer.close

    def spy(issuer: H2DIssuer) -> None:
        closed.append(issuer)
        close(issuer)

    monkeypatch.setattr(H2DIssuer, "close", spy)
    cfg = ServeModelConfig(
        model=str(target), draft=str(draft), device="cpu", baseline="PD+host", gpus=ranks
    )
    with pytest.raises(ValueError, match=r"PD\+host on \d+ ranks: rank \d+ of \d+ owns none"):
        build_engine(cfg)
    assert closed, "the issuer the failed build opened was not closed"


def _grid_span(target: Path) -> int:
    """layers + experts - 1: the most ranks round robin gives an expert each."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(target)
    return int(c.num_hidden_layers) + int(c.num_experts) - 1


def test_gpus_config_is_checked() -> None:
    from pdflash.serve.build import ServeModelConfig

    with pytest.raises(ValueError, match="gpus must be >= 1"):
        ServeModelConfig(model="x", gpus=0).validate()
    with pytest.raises(ValueError, match="B3"):
        ServeModelConfig(model="x", gpus=2, baseline="B3").validate()


def test_build_engine_refuses_gpus_without_a_group(model: tuple[Path, Path]) -> None:
    from pdflash.serve.build import ServeModelConfig, build_engine

    target, _ = model
    with pytest.raises(RuntimeError, match="join a 2-rank group"):
        build_engine(ServeModelConfig(model=str(target), device="cpu", gpus=2))
