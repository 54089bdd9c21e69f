"""``pdflash serve`` / ``generate`` with ``--baseline PD+host`` (the hybrid
miss service) and ``PD-all-on``: built, served, greedy-equal to PD, closed
without leaks; refused where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdflash.cli import build_parser, main
from pdflash.engine import SamplingParams
from pdflash.engine.pd_controller import FixedParts, PDController
from pdflash.serve.build import EngineBundle, ServeModelConfig, build_engine
from pdflash.text import load_tokenizer

pytestmark = pytest.mark.timeout(180)


def _greedy(bundle: EngineBundle, prompt_ids: list[int], n: int) -> list[int]:
    engine = bundle.engine
    rid = engine.add_request(prompt_ids, SamplingParams(), max_new_tokens=n, stop_ids=[])
    engine.run_until_done()
    return list(engine.request(rid).output)


def _config(tiny_model: tuple[Path, Path], baseline: str, **kw: object) -> ServeModelConfig:
    target, draft = tiny_model
    return ServeModelConfig(
        model=str(target),
        draft=str(draft),
        device="cpu",
        block_size=4,
        baseline=baseline,
        **kw,  # type: ignore[arg-type]
    )


def test_pd_host_serves_misses_on_the_host_and_decodes_as_pd(
    tiny_model: tuple[Path, Path],
) -> None:
    tok = load_tokenizer(tiny_model[0])
    prompt = tok("The hybrid miss service")["input_ids"]
    # a slow emulated link (the tiny experts are a few KB): copying a miss
    # costs more than computing it on the host, so the planner hosts some
    slow = {"cache_fraction": 0.5, "emulated_link_gbps": 0.01}
    pd = build_engine(_config(tiny_model, "PD", **slow))
    try:
        assert pd.engine.host_service is None
        want = _greedy(pd, prompt, 16)
    finally:
        pd.close()
    # under the controller (the default) its probes and gate decide whether
    # the host part runs in this short run; "always" runs it in every step
    for control in ("controller", "always"):
        host = build_engine(_config(tiny_model, "PD+host", host_control=control, **slow))
        service = host.engine.host_service
        try:
            assert service is not None and host.engine.config.host_experts == "auto"
            assert host.engine.config.host_control == control
            assert isinstance(host.engine.parts.policy, PDController)  # type: ignore[union-attr]
            got = _greedy(host, prompt, 16)
            if control == "always":
                assert service.books.experts > 0, "no miss was served on the host"
        finally:
            host.close()
        # the same greedy tokens whichever side computed an expert (fp32 CPU)
        assert got == want, control
        # closing the bundle closed the service's host pool
        assert service.executor.closed


def test_pd_host_hosting_queued_copies_decodes_as_pd(
    tiny_model: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--host-queued`` reaches the service, which then hosts experts whose
    copy is still queued (given back): the tokens stay PD's, the cache's
    given-back copies are the service's, and nothing stays pinned."""
    import pdflash.h2d
    from pdflash.h2d import H2DIssuer

    def one_chunk_window(**kw: object) -> H2DIssuer:
        # a slow link that runs one 4 KB chunk at a time: later copies queue
        return H2DIssuer(**{**kw, "chunk_bytes": 4096, "window_bytes": 4096})  # type: ignore[arg-type]

    monkeypatch.setattr(pdflash.h2d, "H2DIssuer", one_chunk_window)  # build_engine's issuer
    tok = load_tokenizer(tiny_model[0])
    prompt = tok("Queued copies given back")["input_ids"]
    slow = {"cache_fraction": 0.5, "emulated_link_gbps": 0.002}
    pd = build_engine(_config(tiny_model, "PD", **slow))
    try:
        want = _greedy(pd, prompt, 16)
    finally:
        pd.close()
    bundle = build_engine(
        _config(tiny_model, "PD+host", host_control="always", host_queued=True, **slow)
    )
    service = bundle.engine.host_service
    try:
        assert service is not None and service.host_queued
        got = _greedy(bundle, prompt, 16)
        assert service.books.experts > 0, "no miss was served on the host"
        assert service.books.queued_hosted > 0, "no queued copy was hosted"
        assert bundle.cache.given_back == service.books.queued_hosted
        assert int(bundle.cache.pins.sum()) == 0
    finally:
        bundle.close()
    assert got == want


def test_pd_host_with_every_expert_resident_builds_no_service(
    tiny_model: tuple[Path, Path],
) -> None:
    bundle = build_engine(_config(tiny_model, "PD+host", cache_fraction=1.0))
    try:
        assert bundle.engine.host_service is None
        assert "host_experts" in bundle.engine.full_cache_state()["switched_off"]
    finally:
        bundle.close()


def test_pd_all_on_runs_every_part_under_fixed_books(tiny_model: tuple[Path, Path]) -> None:
    bundle = build_engine(_config(tiny_model, "PD-all-on", cache_fraction=0.5))
    try:
        assert bundle.engine.config.baseline == "PD-all-on"
        assert bundle.engine.host_service is None
        assert isinstance(bundle.engine.parts.policy, FixedParts)  # type: ignore[union-attr]
        assert len(_greedy(bundle, [1, 2, 3, 4], 6)) == 6
    finally:
        bundle.close()


def test_bad_baselines_are_refused(
    tiny_model: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="baseline must be one of"):
        _config(tiny_model, "PD+cpu").validate()
    with pytest.raises(ValueError, match="needs --baseline PD\\+host"):
        _config(tiny_model, "PD", host_control="always").validate()
    with pytest.raises(ValueError, match="host_control must be one of"):
        _config(tiny_model, "PD+host", host_control="sometimes").validate()
    with pytest.raises(ValueError, match="host_queued needs --baseline PD\\+host"):
        _config(tiny_model, "PD", host_queued=True).validate()
    _config(tiny_model, "PD+host", gpus=2).validate()  # each rank's host its own experts
    target = str(tiny_model[0])
    # speculative without a draft: named before anything loads
    rc = main(["generate", "--model", target, "--prompt", "x", "--baseline", "PD+host"])
    assert rc == 2
    assert "give --draft" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--model", "m", "--baseline", "PD+host"])
    assert args.baseline == "PD+host" and args.host_control == "controller"
    assert not args.host_queued
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--host-queued"])
    assert args.host_queued
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--baseline", "PD+cpu"])


def test_metrics_report_the_host_service(tiny_model: tuple[Path, Path]) -> None:
    import time

    import httpx

    from .conftest import start_server
    from .test_server import client

    target, draft = tiny_model
    srv, loop = start_server(
        target,
        draft,
        block_size=4,
        baseline="PD+host",
        host_control="always",
        cache_fraction=0.5,
        emulated_link_gbps=0.01,
    )
    try:
        client(srv).completions.create(model="target", prompt="host", max_tokens=12, temperature=0)
        time.sleep(0.3)  # the engine thread snapshots its statistics when idle
        text = httpx.get(srv.url + "/metrics").text
        samples = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        experts = samples["pdflash_host_experts_total"]
        assert experts > 0
        nbytes = int(loop.bundle.cache.expert_nbytes)
        assert samples["pdflash_host_link_bytes_saved_total"] == experts * nbytes
        assert samples["pdflash_host_busy_seconds_total"] > 0
        assert samples["pdflash_host_part_on"] == 1
        assert samples["pdflash_host_queued_experts_total"] == 0  # --host-queued is off
    finally:
        srv.stop()
