"""``pdflash synthetic`` and ``pdflash generate`` (in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdflash.cli import main
from pdflash.engine import Engine, EngineConfig, SamplingParams
from pdflash.models import load_adapter
from pdflash.text import load_tokenizer

pytestmark = pytest.mark.timeout(120)


def test_generate_streams_the_greedy_output(
    tiny_model: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = tiny_model
    rc = main(
        [
            "generate",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--prompt",
            "Hello",
            "--max-tokens",
            "12",
            "--block-size",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    out, err = capsys.readouterr()
    assert "finish_reason=" in err
    # the same greedy continuation from a plain autoregressive engine
    tok = load_tokenizer(target)
    adapter = load_adapter(target, device="cpu")
    from pdflash.h2d import H2DIssuer

    with H2DIssuer(backend="host") as issuer:
        from pdflash.cache import ExpertCache

        cache = ExpertCache(adapter.store, issuer, fraction=1.0, top_k=adapter.top_k)
        adapter.attach_cache(cache)
        engine = Engine(adapter, EngineConfig.preset("B0"), expert_cache=cache, max_seq_len=64)
        stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        rid = engine.add_request(
            tok("Hello")["input_ids"], SamplingParams(), max_new_tokens=12, stop_ids=stops
        )
        engine.run_until_done()
        want = tok.decode(engine.request(rid).output, skip_special_tokens=True)
        issuer.cancel(None)
    adapter.close()
    assert out == want + "\n"


def test_generate_reports_bad_input(
    tiny_model: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert rc == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_synthetic_writes_a_servable_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["synthetic", "--out", str(tmp_path), "--no-draft"]) == 0
    assert (tmp_path / "target" / "tokenizer.json").is_file()
    assert not (tmp_path / "draft").exists()
    ids = load_tokenizer(tmp_path / "target")("ab")["input_ids"]
    assert ids and all(0 <= i < 128 for i in ids)  # the tiny preset's vocabulary


def test_serve_command_end_to_end(tiny_model: tuple[Path, Path]) -> None:
    """`pdflash serve` as a user runs it: a subprocess on a free loopback
    port, answering /health and a completion, stopped with SIGINT."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    target, draft = tiny_model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "pdflash.cli",
            "serve",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--block-size",
            "4",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "target", "prompt": "Hello", "max_tokens": 5, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert "serving 'target'" in out


def test_verify_width_reaches_the_engine_and_bad_values_are_refused(
    tiny_model: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflash.serve.build import ServeModelConfig, build_engine

    target, draft = tiny_model
    base = {"model": str(target), "draft": str(draft), "device": "cpu", "block_size": 4}
    bundle = build_engine(ServeModelConfig(**base, verify_width="fixed:2"))  # type: ignore[arg-type]
    try:
        assert bundle.engine.config.verify_width == "fixed:2"
    finally:
        bundle.close()
    # PD's preset: adaptive where a copy can be saved; on the CPU the cache
    # holds every expert by default, and there every draft is verified
    preset = build_engine(ServeModelConfig(**base, cache_fraction=0.5))  # type: ignore[arg-type]
    try:
        assert preset.engine.config.verify_width == "adaptive"
        assert preset.engine.width is not None
    finally:
        preset.close()
    full = build_engine(ServeModelConfig(**base))  # type: ignore[arg-type]
    try:
        assert full.engine.config.verify_width == "full" and full.engine.width is None
        assert "verify_width" in full.engine.full_cache_state()["switched_off"]
    finally:
        full.close()
    with pytest.raises(ValueError, match="exceeds the 3 drafts"):
        ServeModelConfig(**base, verify_width="fixed:5").validate()  # type: ignore[arg-type]
    rc = main(["generate", "--model", str(target), "--prompt", "x", "--verify-width", "wide"])
    assert rc == 2
    assert "verify_width must be one of" in capsys.readouterr().err


def test_prepare_graphs_reaches_the_engine_at_start_up(tiny_model: tuple[Path, Path]) -> None:
    from pdflash.cli import build_parser
    from pdflash.serve.build import ServeModelConfig, build_engine

    target, draft = tiny_model
    base = {"model": str(target), "draft": str(draft), "device": "cpu", "block_size": 4}
    bundle = build_engine(ServeModelConfig(**base, prepare_graphs=8))  # type: ignore[arg-type]
    try:
        # no CUDA here: the engine has no graph runner, and says why
        assert bundle.graphs_prepared == {"state": "off", "why": "not a CUDA device"}
    finally:
        bundle.close()
    with pytest.raises(ValueError, match="prepare_graphs"):
        ServeModelConfig(**base, prepare_graphs=-1).validate()  # type: ignore[arg-type]
    args = build_parser().parse_args(["serve", "--model", "m", "--prepare-graphs", "16"])
    assert args.prepare_graphs == 16
