"""The fault-injection suite: bad inputs, corrupt checkpoints and injected
faults in every engine stage, each recorded with how it ended.

Outcomes (:class:`Ledger`): ``clear_error`` (refused with a typed error that
names the problem, state unchanged), ``recovered`` (the engine went on as
documented: the faulty request finished with ``finish_reason="error"``, every
other request's output equals plain greedy decoding, nothing leaked), and the
failures ``accepted_silently``, ``wrong_output``, ``hung``, ``crashed``
(an untyped error, e.g. an ``AttributeError`` from deep inside) and
``leaked``. The session prints a summary table; every case asserts it ended
in an acceptable outcome.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

GOOD = ("clear_error", "recovered")
OUTCOMES = (*GOOD, "accepted_silently", "wrong_output", "hung", "crashed", "leaked")


class Ledger:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []  # (kind, case, outcome, detail)

    def record(self, kind: str, case: str, outcome: str, detail: str = "") -> str:
        assert outcome in OUTCOMES, outcome
        self.rows.append((kind, case, outcome, detail))
        return outcome


LEDGER = Ledger()


@pytest.fixture
def ledger() -> Ledger:
    return LEDGER


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not LEDGER.rows:
        return
    tr = terminalreporter
    tr.section("fault-injection summary")
    by_kind: dict[str, Counter[str]] = {}
    for kind, _, outcome, _ in LEDGER.rows:
        by_kind.setdefault(kind, Counter())[outcome] += 1
    total: Counter[str] = Counter(o for _, _, o, _ in LEDGER.rows)
    tr.write_line(
        f"{len(LEDGER.rows)} cases tried: " + ", ".join(f"{o}={total[o]}" for o in OUTCOMES)
    )
    for kind in sorted(by_kind):
        c = by_kind[kind]
        tr.write_line(
            f"  {kind:<18} {sum(c.values()):>4}  "
            + ", ".join(f"{o}={c[o]}" for o in OUTCOMES if c[o])
        )
    for kind, case, outcome, detail in LEDGER.rows:
        if outcome not in GOOD:
            tr.write_line(f"  NOT OK {kind}/{case}: {outcome} {detail}")


def run_with_timeout(fn: Callable[[], Any], timeout_s: float = 20.0) -> tuple[str, Any]:
    """Run ``fn`` in a thread: ("ok", value), ("raised", exception) or ("hung", None)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return "hung", None
    if "exc" in box:
        return "raised", box["exc"]
    return "ok", box.get("value")


@dataclass
class TwoSteppers:
    """How two threads in one engine's ``step()`` ended (:func:`step_from_two_threads`)."""

    #: what was raised while the first thread was held inside its step, i.e. the second's error
    refused: list[BaseException]
    #: every error either thread raised, once both ended
    errors: list[BaseException]
    #: both threads ended within the time allowed
    finished: bool


def step_from_two_threads(
    engine: Any, hold_at_layer: int | None = None, timeout_s: float = 20.0
) -> TwoSteppers:
    """Call ``engine.step()`` from a first thread and hold it inside its
    forward (a before-MoE hook at ``hold_at_layer``, or the first layer it
    meets), call ``step()`` from a second thread meanwhile, then let the
    first go on. The hook is removed again before this returns."""
    inside, release = threading.Event(), threading.Event()
    first: list[int] = []

    def hold(layer: int) -> None:
        if not first:
            first.append(threading.get_ident())
        held_here = hold_at_layer is None or layer == hold_at_layer
        if threading.get_ident() == first[0] and not release.is_set() and held_here:
            inside.set()
            release.wait(timeout_s)

    errors: list[BaseException] = []

    def stepper() -> None:
        try:
            engine.step()
        except BaseException as exc:
            errors.append(exc)

    engine.runner.before_moe_hooks.append(hold)
    try:
        t1 = threading.Thread(target=stepper, daemon=True)
        t1.start()
        assert inside.wait(timeout_s), "the first step never reached the held layer"
        t2 = threading.Thread(target=stepper, daemon=True)
        t2.start()
        t2.join(timeout_s)
        refused = list(errors)
    finally:
        release.set()
    t1.join(timeout_s)
    engine.runner.before_moe_hooks.remove(hold)
    return TwoSteppers(refused, errors, not t1.is_alive() and not t2.is_alive())


def classify_refusal(
    fn: Callable[[], Any], errors: tuple[type[BaseException], ...], must_mention: str = ""
) -> tuple[str, str]:
    """How a call that must be refused ended: ``clear_error`` when it raised one
    of ``errors`` whose text contains ``must_mention``."""
    kind, value = run_with_timeout(fn)
    if kind == "hung":
        return "hung", ""
    if kind == "ok":
        return "accepted_silently", repr(value)[:80]
    text = f"{type(value).__name__}: {value}"
    if isinstance(value, errors) and must_mention.lower() in str(value).lower():
        return "clear_error", text[:160]
    return "crashed", text[:160]


def _engine_conftest() -> Any:
    path = Path(__file__).resolve().parent.parent / "conftest.py"  # tests/engine
    spec = importlib.util.spec_from_file_location("_pdflash_engine_test_helpers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HELPERS = _engine_conftest()


# NOTE: tests/engine/conftest.py's autouse _one_torch_thread applies here
# too; its session target, adapter and drafter are made again instead (the
# fault injections patch the drafter they run with)
@pytest.fixture(scope="session")
def hf_target() -> Any:
    return HELPERS.make_hf_target()


@pytest.fixture(scope="session")
def adapter(hf_target: Any) -> Any:
    return HELPERS.HFQwen3MoeAdapter(hf_target)


@pytest.fixture(scope="session")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from pdflash.engine.drafter import load_drafter, write_synthetic_drafter

    path: Path = tmp_path_factory.mktemp("drafter")
    write_synthetic_drafter(path, HELPERS.TINY, "tiny", seed=1, dtype=torch.float32)
    return load_drafter(path, dtype=torch.float32)


MAX_NEW = 10


@pytest.fixture(scope="session")
def cases(hf_target: Any) -> list[tuple[list[int], list[int]]]:
    """Four prompts and their plain greedy continuations."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    out = []
    for n in (4, 7, 5, 9):
        p = torch.randint(0, hf_target.config.vocab_size, (n,), generator=g).tolist()
        out.append((p, HELPERS.greedy_reference(hf_target, p, MAX_NEW)))
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Belt and braces: every case asserts its own outcome; a recorded bad
    outcome fails the session even if a case forgot to."""
    if any(outcome not in GOOD for _, _, outcome, _ in LEDGER.rows) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
