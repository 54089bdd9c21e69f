"""The README's "Serve" and "Use inside transformers" Python examples run as
written (against a loopback test server / in a temporary directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdflash.serve.app import BackgroundServer
from pdflash.serve.loop import EngineLoop

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.timeout(120)


def _block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def test_readme_openai_client_example(
    server: tuple[BackgroundServer, EngineLoop], capsys: pytest.CaptureFixture[str]
) -> None:
    srv, _ = server
    code = _block("from openai import OpenAI")
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", srv.url + "/v1")
    ns: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), ns)
    reply = ns["reply"]
    assert reply.choices[0].finish_reason == "length"  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens == 16  # type: ignore[attr-defined]
    assert "CompletionUsage" in capsys.readouterr().out


def test_readme_transformers_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _block("pdflash.integrations.transformers")
    assert '"/tmp/pdflash-tiny-qwen"' in code
    code = code.replace('"/tmp/pdflash-tiny-qwen"', repr(str(tmp_path / "tiny")))
    ns: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), ns)
    out = ns["out"]
    assert isinstance(out, torch.Tensor) and out.shape == (1, 4 + 16)
    assert ns["model"].pdflash.closed  # type: ignore[attr-defined]
    assert capsys.readouterr().out.strip()
