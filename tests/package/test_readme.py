"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples() -> None:
    assert _python_blocks(), "the README lost its embedding example"


def test_readme_scheduler_example_runs_and_schedules() -> None:
    block = next(b for b in _python_blocks() if "VerifyScheduler" in b)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(block, str(README), "exec"), namespace)
    batch = namespace["batch"]
    sched = namespace["sched"]
    # the example's byte budget admits some but not all of its 8 requests
    assert 1 <= len(batch) < 8  # type: ignore[arg-type]
    assert batch.missing_bytes <= 2 << 30  # type: ignore[attr-defined]
    assert 3 not in sched  # type: ignore[operator]


def test_readme_issuer_example_copies_every_expert() -> None:
    block = next(b for b in _python_blocks() if "H2DIssuer" in b)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(block, str(README), "exec"), namespace)  # asserts the copied bytes itself
    slots = namespace["slots"]
    assert int(slots.sum()) == sum(range(4)) * (1 << 20)  # type: ignore[attr-defined]
