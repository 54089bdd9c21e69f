"""Injected faults in every stage of an engine step (issue 12, item 1) and
concurrent use (item 4).

Each case builds an engine over the tiny resident target, injects one fault
(a raising drafter, predictor, batcher, target forward, acceptance rule or
stream callback), runs to completion and checks the documented semantics:
the affected requests finish with ``finish_reason="error"`` and the error
text, every other request's output equals plain greedy decoding, and no KV
page, promised page or request entry is left behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdflash.engine import verify as verify_mod
from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine, RequestState

from .conftest import HELPERS, MAX_NEW, Ledger, run_with_timeout, step_from_two_threads

pytestmark = pytest.mark.faults


class Injected(RuntimeError):
    """The fault the tests inject."""


def make_engine(adapter: Any, drafter: Any, baseline: str = "PD", **kw: Any) -> Engine:
    cfg = EngineConfig.preset(baseline, block_size=4, max_running=4, token_budget=16)
    batcher, predictor = HELPERS.make_batcher_and_predictor(cfg, adapter)
    return Engine(
        adapter, cfg, drafter=drafter, batcher=batcher, predictor=predictor, max_seq_len=48, **kw
    )


def leaks(eng: Engine) -> list[str]:
    out = []
    if eng.kv.used_pages:
        out.append(f"{eng.kv.used_pages} target KV pages")
    if eng.draft_kv is not None and eng.draft_kv.used_pages:
        out.append(f"{eng.draft_kv.used_pages} draft KV pages")
    if eng._committed_pages:
        out.append(f"{eng._committed_pages} promised pages")
    if eng._running or eng._waiting or eng._requests:
        out.append(f"live requests {list(eng._requests)}")
    return out


def once(fn: Callable[..., Any], when: Callable[..., bool], msg: str) -> Callable[..., Any]:
    """``fn`` that raises :class:`Injected` the first time ``when(*args)`` holds."""
    fired = [False]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not fired[0] and when(*args, **kwargs):
            fired[0] = True
            raise Injected(msg)
        return fn(*args, **kwargs)

    return wrapped


def _is_prefill(chunks: Any) -> bool:
    return any(not c.all_logits for c in chunks)


def _is_verify(chunks: Any) -> bool:
    return any(c.all_logits for c in chunks)


# each injector: (engine, request ids) -> the set of requests the fault may end
def inject_prefill_transient(eng: Engine, ids: list[int]) -> set[int]:
    eng.runner.forward = once(eng.runner.forward, _is_prefill, "prefill boom")  # type: ignore[method-assign]
    return set()  # retried once: nobody fails


def inject_prefill_poison(eng: Engine, ids: list[int]) -> set[int]:
    bad = ids[1]
    base = eng.runner.forward

    def forward(chunks: Any) -> Any:
        if _is_prefill(chunks) and any(c.seq_id == bad for c in chunks):
            raise Injected("poison prompt")
        return base(chunks)

    eng.runner.forward = forward  # type: ignore[method-assign]
    return {bad}


def inject_draft(eng: Engine, ids: list[int]) -> set[int]:
    assert eng.drafter is not None
    calls = [0]
    base = eng.drafter.forward_blocks

    def forward_blocks(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise Injected("drafter boom")
        return base(*a, **k)

    eng.drafter.forward_blocks = forward_blocks  # type: ignore[method-assign]
    return set(ids)


def inject_predict(eng: Engine, ids: list[int]) -> set[int]:
    assert eng.predictor is not None
    p = eng.predictor
    name = "predict_batch" if hasattr(p, "predict_batch") else "predict"
    setattr(p, name, once(getattr(p, name), lambda *a, **k: True, "predictor boom"))
    return set(ids)


def inject_schedule(eng: Engine, ids: list[int]) -> set[int]:
    eng.batcher.select = once(eng.batcher.select, lambda *a: True, "batcher boom")  # type: ignore[method-assign]
    return set(ids)


def inject_verify_forward(eng: Engine, ids: list[int]) -> set[int]:
    calls = [0]

    def when(chunks: Any) -> bool:
        if _is_verify(chunks):
            calls[0] += 1
        return calls[0] == 2

    eng.runner.forward = once(eng.runner.forward, when, "verify forward boom")  # type: ignore[method-assign]
    return set(ids)


def inject_accept(eng: Engine, ids: list[int], monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The acceptance rule raises for one request, in the middle of a batch."""
    bad = ids[1]
    base = verify_mod.greedy_accept
    seen = [0]
    current: list[int] = []
    orig_accepts = eng.acceptance.forced_accepts

    def forced(rid: int, n: int) -> Any:
        current[:] = [rid]
        return orig_accepts(rid, n)

    def accept(drafts: Any, argmax: Any) -> Any:
        if current and current[0] == bad:
            seen[0] += 1
            if seen[0] == 2:
                raise Injected("acceptance boom")
        return base(drafts, argmax)

    eng.acceptance.forced_accepts = forced  # type: ignore[method-assign]
    monkeypatch.setattr(verify_mod, "greedy_accept", accept)
    return {bad}


INJECTORS: dict[str, Callable[..., set[int]]] = {
    "prefill_transient": inject_prefill_transient,
    "prefill_poison": inject_prefill_poison,
    "draft": inject_draft,
    "predict": inject_predict,
    "schedule": inject_schedule,
    "verify_forward": inject_verify_forward,
    "accept": inject_accept,
}

MESSAGES = {
    "prefill_poison": "poison prompt",
    "draft": "drafter boom",
    "predict": "predictor boom",
    "schedule": "batcher boom",
    "verify_forward": "verify forward boom",
    "accept": "acceptance boom",
}


def check_run(
    eng: Engine,
    ids: list[int],
    refs: dict[int, list[int]],
    may_fail: set[int],
    message: str,
) -> tuple[str, str]:
    """Run to completion; classify how it ended."""
    kind, value = run_with_timeout(lambda: eng.run_until_done(max_steps=300))
    if kind == "hung":
        return "hung", ""
    if kind == "raised":
        return "crashed", f"{type(value).__name__}: {value}"
    errored = set()
    for rid in ids:
        req = eng.request(rid)
        if req.metrics.finish_reason == "error":
            errored.add(rid)
            if rid not in may_fail:
                return "wrong_output", f"request {rid} errored but was not affected: {req.error}"
            if message not in (req.error or ""):
                return "crashed", f"request {rid} error text {req.error!r} lacks {message!r}"
            if req.output != refs[rid][: len(req.output)]:
                return "wrong_output", f"errored request {rid} committed a wrong token"
        elif req.output != refs[rid]:
            return "wrong_output", f"request {rid}: {req.output} != greedy {refs[rid]}"
    if may_fail and not errored:
        return "accepted_silently", "the fault was injected but no request saw it"
    lk = leaks(eng)
    if lk:
        return "leaked", "; ".join(lk)
    return "recovered", f"{len(errored)} errored, {len(ids) - len(errored)} == greedy"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", sorted(INJECTORS))
def test_stage_fault_errors_only_affected_requests(
    stage: str,
    adapter: Any,
    drafter: Any,
    cases: list[Any],
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng = make_engine(adapter, drafter)
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases[:3]]
    refs = {rid: ref for rid, (_, ref) in zip(ids, cases, strict=False)}
    inj = INJECTORS[stage]
    may_fail = inj(eng, ids, monkeypatch) if stage == "accept" else inj(eng, ids)
    outcome, detail = check_run(eng, ids, refs, may_fail, MESSAGES.get(stage, ""))
    ledger.record("engine_stage", stage, outcome, detail)
    assert outcome == "recovered", detail
    # the engine stays usable: a request added after the fault is served losslessly
    prompt, ref = cases[3]
    rid = eng.add_request(prompt, max_new_tokens=MAX_NEW)
    eng.run_until_done(max_steps=100)
    assert eng.request(rid).output == ref
    assert not leaks(eng)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at_token", [1, 3])
def test_raising_callback_affects_only_its_request(
    at_token: int, adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    seen: dict[int, list[int]] = {}

    def on_token(rid: int, tok: int) -> None:
        seen.setdefault(rid, []).append(tok)
        if rid == ids[1] and len(seen[rid]) == at_token:
            raise Injected("client went away")

    ids = [eng.add_request(p, max_new_tokens=MAX_NEW, on_token=on_token) for p, _ in cases[:3]]
    refs = {rid: ref for rid, (_, ref) in zip(ids, cases, strict=False)}
    outcome, detail = check_run(eng, ids, refs, {ids[1]}, "client went away")
    ledger.record("callback", f"raise_at_token_{at_token}", outcome, detail)
    assert outcome == "recovered", detail
    bad = eng.request(ids[1])
    assert bad.metrics.finish_reason == "error" and "on_token" in (bad.error or "")
    for rid in (ids[0], ids[2]):
        assert seen[rid] == refs[rid]  # every other stream got every token, in order


@pytest.mark.timeout(120)
def test_callback_aborting_others_and_itself(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    ids: list[int] = []

    def on_token(rid: int, tok: int) -> None:
        if rid == ids[0] and len(eng.request(rid).output) == 3:
            assert eng.abort(ids[2])  # another request, maybe later in the same batch
            assert not eng.abort(ids[2])  # double abort: False, nothing happens
            assert not eng.abort(10_000)  # unknown id
            eng.abort(rid)  # itself

    ids += [eng.add_request(p, max_new_tokens=MAX_NEW, on_token=on_token) for p, _ in cases[:3]]
    refs = {rid: ref for rid, (_, ref) in zip(ids, cases, strict=False)}
    kind, value = run_with_timeout(lambda: eng.run_until_done(max_steps=300))
    ok = kind == "ok"
    ok = ok and eng.request(ids[0]).state == RequestState.ABORTED
    ok = ok and eng.request(ids[2]).state == RequestState.ABORTED
    ok = ok and eng.request(ids[1]).output == refs[ids[1]]
    outcome = "recovered" if ok and not leaks(eng) else ("hung" if kind == "hung" else "crashed")
    ledger.record("abort", "from_callback_mid_step", outcome, str(value)[:100])
    assert outcome == "recovered"


@pytest.mark.timeout(60)
def test_run_until_done_never_loops_without_progress(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    """A stage that silently does nothing (a bug) must end in a clear error,
    not an endless loop."""
    eng = make_engine(adapter, drafter)
    eng.add_request(cases[0][0], max_new_tokens=MAX_NEW)
    eng._draft = lambda reqs: None  # type: ignore[method-assign,assignment]
    kind, value = run_with_timeout(lambda: eng.run_until_done(), timeout_s=20)
    if kind == "hung":
        outcome = "hung"
    elif kind == "raised" and isinstance(value, RuntimeError) and "progress" in str(value):
        outcome = "clear_error"
    else:
        outcome = "crashed" if kind == "raised" else "accepted_silently"
    ledger.record("engine_stage", "no_progress_bound", outcome, str(value)[:100])
    assert outcome == "clear_error"


@pytest.mark.timeout(60)
def test_prefill_failing_twice_errors_and_releases(
    adapter: Any, drafter: Any, cases: list[Any]
) -> None:
    eng = make_engine(adapter, drafter)
    base = eng.runner.forward

    def forward(chunks: Any) -> Any:
        if _is_prefill(chunks):
            raise Injected("prefill always fails")
        return base(chunks)

    eng.runner.forward = forward  # type: ignore[method-assign]
    rid = eng.add_request(cases[0][0], max_new_tokens=MAX_NEW)
    eng.step()
    assert eng.request(rid).state == RequestState.WAITING  # released and queued for one retry
    assert eng.kv.used_pages == 0 and eng._committed_pages == 0
    eng.run_until_done(max_steps=10)
    req = eng.request(rid)
    assert req.metrics.finish_reason == "error" and "prefill always fails" in (req.error or "")
    assert not leaks(eng)


# ---------------------------------------------------------------- threads


@pytest.mark.timeout(60)
def test_two_threads_stepping_one_gets_a_clear_error(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases[:2]]
    refs = {rid: ref for rid, (_, ref) in zip(ids, cases, strict=False)}
    two = step_from_two_threads(eng)
    second_errors, errors = two.refused, two.errors
    assert two.finished
    ok = len(second_errors) == 1 and isinstance(second_errors[0], RuntimeError)
    ok = ok and "single-threaded" in str(second_errors[0]) and len(errors) == 1
    kind, _ = run_with_timeout(lambda: eng.run_until_done(max_steps=200))
    ok = ok and kind == "ok" and all(eng.request(r).output == refs[r] for r in ids)
    outcome = "clear_error" if ok and not leaks(eng) else ("hung" if kind == "hung" else "crashed")
    ledger.record("threads", "two_threads_step", outcome, str(second_errors)[:120])
    assert outcome == "clear_error", (second_errors, errors)


@pytest.mark.timeout(30)
def test_step_from_a_callback_is_refused(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    got: list[BaseException] = []

    def on_token(rid: int, tok: int) -> None:
        if not got:
            try:
                eng.step()
            except RuntimeError as exc:
                got.append(exc)
                raise

    rid = eng.add_request(cases[0][0], max_new_tokens=MAX_NEW, on_token=on_token)
    other = eng.add_request(cases[1][0], max_new_tokens=MAX_NEW)
    kind, _ = run_with_timeout(lambda: eng.run_until_done(max_steps=100))
    ok = kind == "ok" and len(got) == 1 and "re-entrant" in str(got[0])
    ok = ok and eng.request(rid).metrics.finish_reason == "error"
    ok = ok and eng.request(other).output == cases[1][1]
    ledger.record(
        "threads", "step_from_callback", "clear_error" if ok else "crashed", str(got)[:120]
    )
    assert ok


# ---------------------------------------------------------- retention


def test_finished_requests_are_released_on_demand(
    adapter: Any, drafter: Any, cases: list[Any]
) -> None:
    eng = make_engine(adapter, drafter, max_finished=2)
    ids = [eng.add_request(p, max_new_tokens=3) for p, _ in cases]
    eng.run_until_done(max_steps=100)
    kept = list(eng.finished)
    assert len(kept) == 2  # the two that finished last; the others were dropped
    for rid in set(ids) - set(kept):
        with pytest.raises(KeyError):
            eng.request(rid)
    popped = eng.pop_finished()
    assert list(popped) == kept and not eng.finished
    assert eng.routing_trace and eng.scheduler_us
    eng.reset_stats()
    assert not eng.routing_trace and not eng.trace_kinds and not eng.scheduler_us
    assert eng.verify_forwards == 0


def test_error_field_and_slo(adapter: Any, drafter: Any, cases: list[Any]) -> None:
    eng = make_engine(adapter, drafter)

    def on_token(rid: int, tok: int) -> None:
        raise Injected("x")

    rid = eng.add_request(cases[0][0], max_new_tokens=4, on_token=on_token, slo_s=100.0)
    eng.run_until_done(max_steps=20)
    req = eng.request(rid)
    assert req.state == RequestState.FINISHED
    assert req.metrics.finish_reason == "error"
    assert req.error is not None and "Injected: x" in req.error
    assert req.metrics.met_slo is None  # an error is not a met (or missed) SLO
    assert req.output == cases[0][1][:1]  # the token the callback refused is the last one
    torch.testing.assert_close(torch.tensor(eng.kv.used_pages), torch.tensor(0))


# --------------------------------------------------- interrupts (BaseException)


class Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception, so it propagates out of step()."""


@pytest.mark.timeout(120)
def test_interrupt_mid_commit_rolls_back_uncommitted_requests(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt while committing request i of a batch: requests i.. keep
    their KV as at the step's start and are verified again later, so every
    output still equals greedy."""
    eng = make_engine(adapter, drafter)
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases[:3]]
    refs = {rid: ref for rid, (_, ref) in zip(ids, cases, strict=False)}
    base = verify_mod.greedy_accept
    calls = [0]

    def accept(drafts: Any, argmax: Any) -> Any:
        calls[0] += 1
        if calls[0] == 5:  # the second request of the second verify batch
            raise Interrupt()
        return base(drafts, argmax)

    monkeypatch.setattr(verify_mod, "greedy_accept", accept)
    interrupted = False
    for _ in range(300):
        if not eng.has_work:
            break
        try:
            eng.step()
        except Interrupt:
            interrupted = True
    ok = interrupted and all(eng.request(r).output == refs[r] for r in ids)
    ok = ok and all(eng.request(r).metrics.finish_reason == "length" for r in ids)
    outcome = "recovered" if ok and not leaks(eng) else "wrong_output"
    ledger.record("engine_stage", "interrupt_mid_commit", outcome)
    assert outcome == "recovered", [eng.request(r).output for r in ids]


@pytest.mark.timeout(60)
def test_interrupt_in_prefill_requeues(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    rid = eng.add_request(cases[0][0], max_new_tokens=MAX_NEW)
    base = eng.runner.forward
    fired = [False]

    def forward(chunks: Any) -> Any:
        if not fired[0]:
            fired[0] = True
            raise Interrupt()
        return base(chunks)

    eng.runner.forward = forward  # type: ignore[method-assign]
    with pytest.raises(Interrupt):
        eng.step()
    ok = eng.request(rid).state == RequestState.WAITING and eng.kv.used_pages == 0
    kind, _ = run_with_timeout(lambda: eng.run_until_done(max_steps=50))
    ok = ok and kind == "ok" and eng.request(rid).output == cases[0][1] and not leaks(eng)
    ledger.record("engine_stage", "interrupt_in_prefill", "recovered" if ok else "hung")
    assert ok


# ------------------------------------------------------------ abort table

ABORT_CASES: list[tuple[str, Any]] = [
    ("unknown_id", 10_000),
    ("negative_id", -1),
    ("str_id", "0"),
    ("float_id", 0.0),
    ("none_id", None),
    ("bool_id", True),
    ("list_id", [0]),
]


@pytest.mark.parametrize(("case", "bad_id"), ABORT_CASES, ids=[c[0] for c in ABORT_CASES])
def test_abort_of_an_unknown_or_bad_id_is_harmless(
    case: str, bad_id: Any, adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    rid = eng.add_request(cases[0][0], max_new_tokens=3)
    kind, value = run_with_timeout(lambda: eng.abort(bad_id))
    ok = kind == "ok" and value is False and eng.request(rid).state == RequestState.WAITING
    eng.run_until_done(max_steps=50)
    ok = ok and eng.request(rid).output == cases[0][1][:3]
    ledger.record("abort", case, "clear_error" if ok else "crashed", f"{kind} {value!r}")
    assert ok, (kind, value)


@pytest.mark.parametrize("when", ["waiting", "running", "finished", "twice"])
def test_abort_lifecycle(
    when: str, adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    rid = eng.add_request(cases[0][0], max_new_tokens=MAX_NEW)
    other = eng.add_request(cases[1][0], max_new_tokens=MAX_NEW)
    if when in ("running", "twice"):
        eng.step()
        eng.step()
    if when == "finished":
        eng.run_until_done(max_steps=50)
    first = eng.abort(rid)
    second = eng.abort(rid) if when == "twice" else None
    eng.run_until_done(max_steps=100)
    ok = first is (when != "finished") and second in (None, False)
    ok = ok and eng.request(other).output == cases[1][1] and not leaks(eng)
    want = RequestState.FINISHED if when == "finished" else RequestState.ABORTED
    ok = ok and eng.request(rid).state == want
    ledger.record("abort", f"abort_{when}", "recovered" if ok else "leaked")
    assert ok


@pytest.mark.timeout(60)
def test_add_request_from_another_thread_during_a_step_is_refused(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    eng = make_engine(adapter, drafter)
    eng.add_request(cases[0][0], max_new_tokens=MAX_NEW)
    inside, release = threading.Event(), threading.Event()
    stepper: list[int] = []

    def hold(layer: int) -> None:
        if threading.get_ident() == stepper[0] and not release.is_set():
            inside.set()
            release.wait(20)

    eng.runner.before_moe_hooks.append(hold)

    def run() -> None:
        stepper.append(threading.get_ident())
        eng.step()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert inside.wait(20)
    outcomes = []
    for call in (
        lambda: eng.add_request(cases[1][0], max_new_tokens=2),
        lambda: eng.abort(0),
        lambda: eng.pop_finished(),
    ):
        _, value = run_with_timeout(call, timeout_s=5)
        outcomes.append(isinstance(value, RuntimeError) and "single-threaded" in str(value))
    release.set()
    t.join(20)
    eng.runner.before_moe_hooks.remove(hold)
    eng.run_until_done(max_steps=100)
    ok = all(outcomes) and len(eng.finished) == 1 and not leaks(eng)
    ledger.record("threads", "add_abort_from_other_thread", "clear_error" if ok else "crashed")
    assert ok, outcomes


@pytest.mark.timeout(120)
def test_sampled_requests_are_isolated_from_a_failing_neighbour(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    """Sampling (lossless rejection): with per-request seeds, the requests
    next to one whose callback raises sample exactly what they sample in a
    run without the fault."""
    from pdflash.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=20)

    def run(fail: bool) -> dict[int, list[int]]:
        from pdflash.engine.verify_width import FixedWidth

        # every draft verified: an adaptive width decides from measured step
        # times, so a sampled request's draws (a lossless sample either way)
        # repeat per seed only at a width that does not depend on timing
        eng = make_engine(adapter, drafter, width=FixedWidth(None, 4))

        def on_token(rid: int, tok: int) -> None:
            if fail and rid == 1 and len(eng.request(rid).output) == 2:
                raise Injected("sampled client went away")

        ids = [
            eng.add_request(p, params, max_new_tokens=MAX_NEW, seed=100 + i, on_token=on_token)
            for i, (p, _) in enumerate(cases[:3])
        ]
        eng.run_until_done(max_steps=200)
        assert not leaks(eng)
        if fail:
            assert eng.request(1).metrics.finish_reason == "error"
        return {rid: eng.request(rid).output for rid in ids}

    clean, faulty = run(False), run(True)
    ok = faulty[0] == clean[0] and faulty[2] == clean[2] and faulty[1] == clean[1][:2]
    ledger.record("callback", "sampled_neighbour_isolated", "recovered" if ok else "wrong_output")
    assert ok, (clean, faulty)
