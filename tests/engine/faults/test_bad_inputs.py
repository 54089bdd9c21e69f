"""Bad client input (issue 12, item 2): every case must be refused with a
typed error naming the argument, leave the engine exactly as it was, and
never disturb the requests around it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine
from pdflash.engine.sampling import SamplingParams

from .conftest import HELPERS, Ledger, classify_refusal

pytestmark = pytest.mark.faults

V = HELPERS.TINY["vocab_size"]
MAX_POS = HELPERS.TINY["max_position_embeddings"]
OK_PROMPT = [3, 1, 4, 1, 5]
NAN = float("nan")
INF = float("inf")

# (case id, add_request kwargs, text the error must contain)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("prompt_bool_list", {"prompt_ids": [True, False, True]}, "prompt_ids"),
    ("prompt_bool_mixed", {"prompt_ids": [1, True]}, "prompt_ids"),
    ("prompt_float_list", {"prompt_ids": [1.0, 2.0]}, "prompt_ids"),
    ("prompt_float_mixed", {"prompt_ids": [1, 2.5]}, "prompt_ids"),
    ("prompt_float_nan", {"prompt_ids": [NAN]}, "prompt_ids"),
    ("prompt_str_list", {"prompt_ids": ["1", "2"]}, "prompt_ids"),
    ("prompt_str", {"prompt_ids": "hello"}, "prompt_ids"),
    ("prompt_bytes", {"prompt_ids": b"ab"}, "prompt_ids"),
    ("prompt_nested", {"prompt_ids": [[1, 2], [3]]}, "prompt_ids"),
    ("prompt_none", {"prompt_ids": None}, "prompt_ids"),
    ("prompt_int_scalar", {"prompt_ids": 5}, "prompt_ids"),
    ("prompt_none_in_list", {"prompt_ids": [1, None]}, "prompt_ids"),
    ("prompt_complex", {"prompt_ids": [1 + 2j]}, "prompt_ids"),
    ("prompt_dict", {"prompt_ids": {1: 2}}, "prompt_ids"),
    ("prompt_set", {"prompt_ids": {1, 2}}, "prompt_ids"),
    ("prompt_np_float_array", {"prompt_ids": np.array([1.0, 2.0])}, "prompt_ids"),
    ("prompt_np_bool_array", {"prompt_ids": np.array([True, False])}, "prompt_ids"),
    ("prompt_np_float_scalars", {"prompt_ids": [np.float32(1), np.float64(2)]}, "prompt_ids"),
    ("prompt_np_bool_scalar", {"prompt_ids": [np.bool_(True)]}, "prompt_ids"),
    ("prompt_np_2d", {"prompt_ids": np.array([[1, 2]])}, "prompt_ids"),
    ("prompt_np_str_array", {"prompt_ids": np.array(["1"])}, "prompt_ids"),
    ("prompt_torch_float", {"prompt_ids": torch.tensor([1.0, 2.0])}, "prompt_ids"),
    ("prompt_torch_bool", {"prompt_ids": torch.tensor([True])}, "prompt_ids"),
    ("prompt_torch_2d", {"prompt_ids": torch.tensor([[1, 2]])}, "prompt_ids"),
    ("prompt_negative", {"prompt_ids": [1, -1]}, "vocabulary"),
    ("prompt_vocab_edge", {"prompt_ids": [V]}, "vocabulary"),
    ("prompt_huge", {"prompt_ids": [2**70]}, "vocabulary"),
    ("prompt_np_uint_huge", {"prompt_ids": np.array([2**63], dtype=np.uint64)}, "vocabulary"),
    ("prompt_empty", {"prompt_ids": []}, "empty"),
    ("prompt_empty_np", {"prompt_ids": np.zeros(0, dtype=np.int64)}, "empty"),
    ("max_new_zero", {"max_new_tokens": 0}, "max_new_tokens"),
    ("max_new_negative", {"max_new_tokens": -1}, "max_new_tokens"),
    ("max_new_true", {"max_new_tokens": True}, "max_new_tokens"),
    ("max_new_false", {"max_new_tokens": False}, "max_new_tokens"),
    ("max_new_float_int", {"max_new_tokens": 4.0}, "max_new_tokens"),
    ("max_new_float", {"max_new_tokens": 2.5}, "max_new_tokens"),
    ("max_new_str", {"max_new_tokens": "8"}, "max_new_tokens"),
    ("max_new_none", {"max_new_tokens": None}, "max_new_tokens"),
    ("max_new_nan", {"max_new_tokens": NAN}, "max_new_tokens"),
    ("max_new_inf", {"max_new_tokens": INF}, "max_new_tokens"),
    ("max_new_np_float", {"max_new_tokens": np.float64(3)}, "max_new_tokens"),
    ("max_new_list", {"max_new_tokens": [3]}, "max_new_tokens"),
    ("max_new_beyond_max_seq_len", {"max_new_tokens": 10**9}, "max_seq_len"),
    ("seed_negative", {"seed": -1}, "seed"),
    ("seed_too_big", {"seed": 2**64}, "seed"),
    ("seed_float", {"seed": 1.5}, "seed"),
    ("seed_float_int", {"seed": 1.0}, "seed"),
    ("seed_bool", {"seed": True}, "seed"),
    ("seed_str", {"seed": "1"}, "seed"),
    ("seed_np_float", {"seed": np.float32(1)}, "seed"),
    ("seed_nan", {"seed": NAN}, "seed"),
    ("seed_list", {"seed": [1]}, "seed"),
    ("slo_zero", {"slo_s": 0}, "slo_s"),
    ("slo_negative", {"slo_s": -1.0}, "slo_s"),
    ("slo_nan", {"slo_s": NAN}, "slo_s"),
    ("slo_inf", {"slo_s": INF}, "slo_s"),
    ("slo_minus_inf", {"slo_s": -INF}, "slo_s"),
    ("slo_str", {"slo_s": "1"}, "slo_s"),
    ("slo_bool", {"slo_s": True}, "slo_s"),
    ("stop_float", {"stop_ids": [1.5]}, "stop_ids"),
    ("stop_str_list", {"stop_ids": ["a"]}, "stop_ids"),
    ("stop_str", {"stop_ids": "ab"}, "stop_ids"),
    ("stop_bool", {"stop_ids": [True]}, "stop_ids"),
    ("stop_negative", {"stop_ids": [-1]}, "stop_ids"),
    ("stop_vocab_edge", {"stop_ids": [V]}, "stop_ids"),
    ("stop_none", {"stop_ids": None}, "stop_ids"),
    ("stop_nested", {"stop_ids": [[1]]}, "stop_ids"),
    ("params_dict", {"params": {"temperature": 0.0}}, "params"),
    ("params_float", {"params": 0.5}, "params"),
    ("params_str", {"params": "greedy"}, "params"),
    ("on_token_int", {"on_token": 5}, "on_token"),
    ("on_token_str", {"on_token": "print"}, "on_token"),
    ("prompt_beyond_max_seq_len", {"prompt_ids": [1] * (MAX_POS + 100)}, "max_seq_len"),
    ("prompt_beyond_max_positions", {"prompt_ids": [1] * (MAX_POS + 1)}, "max_position"),
    (
        "prompt_plus_new_beyond_max_positions",
        {"prompt_ids": [1] * (MAX_POS - 4), "max_new_tokens": 8},
        "max_position",
    ),
]

# (case id, SamplingParams kwargs, text the error must contain)
BAD_PARAMS: list[tuple[str, dict[str, Any], str]] = [
    ("temperature_negative", {"temperature": -1.0}, "temperature"),
    ("temperature_nan", {"temperature": NAN}, "temperature"),
    ("temperature_inf", {"temperature": INF}, "temperature"),
    ("temperature_str", {"temperature": "0.5"}, "temperature"),
    ("temperature_none", {"temperature": None}, "temperature"),
    ("temperature_bool", {"temperature": True}, "temperature"),
    ("temperature_complex", {"temperature": 1j}, "temperature"),
    ("top_p_zero", {"temperature": 1.0, "top_p": 0.0}, "top_p"),
    ("top_p_above_one", {"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ("top_p_nan", {"temperature": 1.0, "top_p": NAN}, "top_p"),
    ("top_p_negative", {"temperature": 1.0, "top_p": -0.1}, "top_p"),
    ("top_p_str", {"temperature": 1.0, "top_p": "1"}, "top_p"),
    ("top_k_negative", {"temperature": 1.0, "top_k": -1}, "top_k"),
    ("top_k_float", {"temperature": 1.0, "top_k": 1.5}, "top_k"),
    ("top_k_bool", {"temperature": 1.0, "top_k": True}, "top_k"),
    ("top_k_str", {"temperature": 1.0, "top_k": "5"}, "top_k"),
    ("top_k_none", {"temperature": 1.0, "top_k": None}, "top_k"),
]


def _engine(adapter: Any, drafter: Any) -> Engine:
    # max_seq_len beyond the model's max_position_embeddings, so that limit is reachable
    cfg = EngineConfig.preset("B1", block_size=4, max_running=2)
    return Engine(adapter, cfg, drafter=drafter, max_seq_len=MAX_POS + 64)


def _state(eng: Engine) -> tuple[Any, ...]:
    return (
        dict(eng._requests),
        list(eng._waiting),
        list(eng._running),
        eng._committed_pages,
        eng.kv.used_pages,
    )


@pytest.mark.parametrize(
    ("case", "kwargs", "mention"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_is_refused_without_state_change(
    case: str, kwargs: dict[str, Any], mention: str, adapter: Any, drafter: Any, ledger: Ledger
) -> None:
    eng = _engine(adapter, drafter)
    first = eng.add_request(OK_PROMPT, max_new_tokens=4)
    before = _state(eng)
    call = {"prompt_ids": OK_PROMPT, "max_new_tokens": 4, **kwargs}
    prompt = call.pop("prompt_ids")
    outcome, detail = classify_refusal(
        lambda: eng.add_request(prompt, **call), (TypeError, ValueError), mention
    )
    if outcome == "clear_error" and _state(eng) != before:
        outcome, detail = "leaked", "state changed by a refused request"
    if outcome == "clear_error":
        second = eng.add_request(OK_PROMPT, max_new_tokens=4)
        if second != first + 1:
            outcome, detail = "leaked", f"the refused request used up id {first + 1}"
    ledger.record("bad_input", case, outcome, detail)
    assert outcome == "clear_error", detail


@pytest.mark.parametrize(("case", "kwargs", "mention"), BAD_PARAMS, ids=[c[0] for c in BAD_PARAMS])
def test_bad_sampling_params_are_refused(
    case: str, kwargs: dict[str, Any], mention: str, ledger: Ledger
) -> None:
    outcome, detail = classify_refusal(
        lambda: SamplingParams(**kwargs), (TypeError, ValueError), mention
    )
    ledger.record("bad_sampling", case, outcome, detail)
    assert outcome == "clear_error", detail


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([3, 1, 4, 1, 5], dtype=np.int32),
        np.array([3, 1, 4, 1, 5], dtype=np.uint8),
        torch.tensor([3, 1, 4, 1, 5]),
        [np.int64(3), np.int16(1), 4, 1, 5],
        (3, 1, 4, 1, 5),
    ],
    ids=["np_int32", "np_uint8", "torch_int64", "np_scalars", "tuple"],
)
def test_integer_arrays_are_accepted(prompt: Any, adapter: Any, drafter: Any) -> None:
    eng = _engine(adapter, drafter)
    rid = eng.add_request(
        prompt, max_new_tokens=np.int64(2), seed=np.uint64(2**64 - 1), stop_ids={7, 9}
    )
    req = eng.request(rid)
    assert req.prompt == OK_PROMPT and all(type(t) is int for t in req.prompt)
    assert req.max_new_tokens == 2 and req.stop_ids == frozenset({7, 9})


@pytest.mark.timeout(120)
def test_bad_requests_never_poison_the_others(
    adapter: Any, drafter: Any, cases: list[Any], ledger: Ledger
) -> None:
    """Every bad request of the table, interleaved with good ones on one
    engine: the good ones decode exactly as plain greedy."""
    cfg = EngineConfig.preset("B1", block_size=4, max_running=3)
    eng = Engine(adapter, cfg, drafter=drafter, max_seq_len=MAX_POS + 64)
    good: dict[int, list[int]] = {}
    for i, (_, kwargs, _) in enumerate(BAD_REQUESTS):
        if i % 20 == 0:
            p, ref = cases[(i // 20) % len(cases)]
            good[eng.add_request(p, max_new_tokens=len(ref))] = ref
        call = {"prompt_ids": OK_PROMPT, "max_new_tokens": 4, **kwargs}
        prompt = call.pop("prompt_ids")
        with pytest.raises((TypeError, ValueError)):
            eng.add_request(prompt, **call)
        if i % 7 == 0 and eng.has_work:
            eng.step()
    eng.run_until_done(max_steps=200)
    ok = all(eng.request(rid).output == ref for rid, ref in good.items())
    ledger.record("bad_input", "interleaved_with_good", "recovered" if ok else "wrong_output")
    assert ok
