"""The serving workload generator: arrivals, length draws, seeds."""

from __future__ import annotations

import numpy as np
import pytest
from pdflash.bench.workload import ClosedLoop, LengthDist, Workload, open_loop


def test_poisson_arrivals_are_reproducible_and_have_the_stated_rate() -> None:
    w = Workload("poisson", num_requests=4000, rate_per_s=8.0, seed=11)
    a = open_loop(w)
    b = open_loop(w)
    assert a == b
    times = np.array([r.arrival_s for r in a])
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    # exponential gaps: mean 1/rate = 0.125 s, coefficient of variation 1;
    # 4000 draws put the sample mean within ~1.6% (1 sigma) of the truth
    assert gaps.mean() == pytest.approx(0.125, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)
    other = open_loop(Workload("poisson", num_requests=4000, rate_per_s=8.0, seed=12))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in a]


def test_lengths_within_bounds_and_default_outputs_are_long() -> None:
    w = Workload("burst", num_requests=500, seed=3)
    reqs = open_loop(w)
    assert all(r.arrival_s == 0.0 for r in reqs)
    outs = np.array([r.max_new_tokens for r in reqs])
    prompts = np.array([r.prompt_len for r in reqs])
    assert outs.min() >= 128 and outs.max() <= 512
    assert prompts.min() >= 32 and prompts.max() <= 128
    # uniform over [128, 512]: both halves are drawn
    assert (outs < 320).any() and (outs > 320).any()


def test_lognormal_lengths_median_and_clip() -> None:
    d = LengthDist("lognormal", low=16, high=4096, median=200.0, sigma=0.8)
    x = d.draw(np.random.default_rng(0), 20000)
    assert x.min() >= 16 and x.max() <= 4096
    assert float(np.median(x)) == pytest.approx(200.0, rel=0.05)
    assert LengthDist("fixed", 7, 7).draw(np.random.default_rng(0), 3).tolist() == [7, 7, 7]


def test_length_draws_do_not_depend_on_the_arrival_process() -> None:
    # same seed: the same request lengths whether the loop is open or closed
    open_w = Workload("poisson", num_requests=10, rate_per_s=1.0, seed=5)
    closed_w = Workload("closed", num_requests=10, users=2, think_s=0.5, seed=5)
    assert [r.prompt_len for r in open_loop(open_w)] == closed_w.lengths()[0].tolist()


def test_closed_loop_waits_for_completions_and_stops_at_num_requests() -> None:
    w = Workload("closed", num_requests=5, users=2, think_s=0.0, seed=1)
    loop = ClosedLoop(w)
    first = loop.start()
    assert [(r.index, r.user, r.arrival_s) for r in first] == [(0, 0, 0.0), (1, 1, 0.0)]
    nxt = loop.finished(1, 2.5)
    assert nxt is not None and (nxt.index, nxt.user, nxt.arrival_s) == (2, 1, 2.5)
    assert loop.finished(0, 3.0) is not None
    assert loop.finished(0, 4.0) is not None
    assert loop.sent == 5
    assert loop.finished(1, 5.0) is None
    with pytest.raises(RuntimeError, match="already"):
        loop.start()
    with pytest.raises(ValueError, match="user must be"):
        loop.finished(2, 0.0)


def test_closed_loop_think_time_is_seeded() -> None:
    w = Workload("closed", num_requests=50, users=1, think_s=2.0, seed=9)

    def run() -> list[float]:
        loop = ClosedLoop(w)
        loop.start()
        out = []
        t = 0.0
        while (r := loop.finished(0, t)) is not None:
            assert r.arrival_s is not None and r.arrival_s >= t
            out.append(r.arrival_s - t)
            t = r.arrival_s + 1.0
        return out

    gaps = run()
    assert gaps == run()
    assert len(gaps) == 49 and any(g > 0 for g in gaps)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arrivals": "poisson", "rate_per_s": None}, "rate_per_s"),
        ({"arrivals": "poisson", "rate_per_s": 0.0}, "rate_per_s"),
        ({"arrivals": "poisson", "rate_per_s": float("inf")}, "rate_per_s"),
        ({"arrivals": "closed", "users": 0}, "users"),
        ({"arrivals": "closed", "users": None}, "users"),
        ({"arrivals": "burst", "num_requests": 0}, "num_requests"),
        ({"arrivals": "burst", "num_requests": True}, "num_requests"),
        ({"arrivals": "burst", "think_s": -1.0}, "think_s"),
        ({"arrivals": "uniform"}, "arrivals"),
    ],
)
def test_bad_workloads_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Workload(**kwargs)  # type: ignore[arg-type]


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        LengthDist("uniform", 10, 5)
    with pytest.raises(ValueError, match="median"):
        LengthDist("lognormal", 1, 10, median=None, sigma=1.0)
    with pytest.raises(ValueError, match="kind"):
        LengthDist("normal", 1, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool"):
        LengthDist("fixed", True, 2)
    with pytest.raises(ValueError, match="ClosedLoop"):
        open_loop(Workload("closed", users=2))
    with pytest.raises(ValueError, match="closed workload"):
        ClosedLoop(Workload("burst"))


def test_describe_is_json_able() -> None:
    import json

    d = Workload("poisson", rate_per_s=2.0).describe()
    assert json.loads(json.dumps(d))["output_len"] == "uniform [128, 512]"
