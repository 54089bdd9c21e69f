"""The host cost's robustness: the start-up calibration (warmed per point,
median of repeats, spread recorded), the planner's online correction from
the run's own HOST jobs (a too-pessimistic calibration converges to serving
host work, a too-optimistic one backs off), the prepared host weights kept
with the store (reused only for the same settings, released explicitly),
and no host threads outliving what owns them."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pdflash.hybrid import (
    CostModelPlanner,
    HostCostModel,
    HostExpertExecutor,
    HostExpertService,
    LinkState,
    OnlineHostCost,
    build_host_service,
    calibrate_host,
    fit_affine,
    fit_robust,
    host_weights_for,
    release_host_weights,
)
from pdflash.hybrid.native import cpu_has_avx512_bf16
from pdflash.models import load_adapter

MS = 1e-3


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_threads(at_most: int, timeout_s: float = 3.0) -> int:
    """The OS thread count once it is ``at_most`` (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    n = _threads()
    while n > at_most and time.monotonic() < deadline:
        time.sleep(0.02)
        n = _threads()
    return n


# -- calibration ------------------------------------------------------------------


class _SpinUp:
    """An expert function that costs ``steady_s`` per call, plus ``penalty_s``
    on the first ``slow_calls`` calls with each row count (a thread team's
    spin-up, a code path's first use)."""

    def __init__(self, steady_s: float, penalty_s: float, slow_calls: int) -> None:
        self.steady_s, self.penalty_s, self.slow_calls = steady_s, penalty_s, slow_calls
        self.seen: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = int(x.shape[0])
        with self.lock:
            k = self.seen[rows] = self.seen.get(rows, 0) + 1
        time.sleep(self.steady_s + (self.penalty_s if k <= self.slow_calls else 0.0))
        return x.clone()


def test_calibration_warms_every_point_and_records_the_spread() -> None:
    """Each row count's first two calls are 25x slower: warmed per point
    and the median of five, no point sees them (one warm-up before the
    first point and the median of three would have two slow batches of
    three at every later point)."""
    fn = _SpinUp(steady_s=2 * MS, penalty_s=50 * MS, slow_calls=2)
    weights = {"w": torch.zeros(1)}
    with HostExpertExecutor(lambda g: weights, fn, dtype=torch.float32, workers=1) as ex:
        cost = calibrate_host(
            ex, num_ids=4, hidden_size=4, token_points=(1, 4, 16), experts_per_batch=1
        )
    assert cost.repeats == 5
    for n, s in cost.points:
        assert s < 20 * MS, f"point {n}: {s * 1e3:.1f} ms carries the spin-up"
    spread = {n: (lo, hi) for n, lo, hi in cost.spread}
    assert sorted(spread) == [1, 4, 16]
    for n, s in cost.points:
        lo, hi = spread[n]
        assert lo <= s <= hi
    # the second slow call of each row count is among the timed ones
    assert any(hi > 40 * MS for lo, hi in spread.values())
    row = cost.to_json()
    assert row["spread"] and row["repeats"] == 5


class _JobCost:
    """A ``batch_fn`` whose call (one job's experts on a worker) costs
    ``job_s`` plus ``expert_s`` per expert."""

    def __init__(self, job_s: float, expert_s: float) -> None:
        self.job_s, self.expert_s = job_s, expert_s

    def __call__(
        self,
        x: torch.Tensor,
        weights: list[dict[str, torch.Tensor]],
        bounds: list[int],
        out: torch.Tensor,
    ) -> None:
        time.sleep(self.job_s + self.expert_s * len(weights))
        out.copy_(x)


def test_calibration_separates_a_fixed_cost_per_job() -> None:
    """A host whose job costs 6 ms plus 2 ms an expert: the job term reads
    the slope between one expert and four as seconds per expert and the
    rest as ``job_s``; without it the two-expert batch's mean (5 ms) is
    charged every expert: a lone expert's 8 ms priced at 5, four experts'
    14 ms at 20."""
    weights = {"w": torch.zeros(1)}
    fn = _JobCost(job_s=6 * MS, expert_s=2 * MS)
    with HostExpertExecutor(
        lambda g: weights, lambda x, w: x.clone(), dtype=torch.float32, workers=1, batch_fn=fn
    ) as ex:
        cost = calibrate_host(
            ex, num_ids=8, hidden_size=4, token_points=(1, 4), repeats=3, job_term=True
        )
        flat = calibrate_host(ex, num_ids=8, hidden_size=4, token_points=(1, 4), repeats=3)
        single = calibrate_host(
            ex,
            num_ids=8,
            hidden_size=4,
            token_points=(1,),
            repeats=1,
            experts_per_batch=1,
            job_term=True,
        )
    assert cost.job_s == pytest.approx(6 * MS, abs=1.5 * MS)
    assert float(cost.expert_s(1)) == pytest.approx(2 * MS, abs=0.7 * MS)
    assert [n for n, _ in cost.job_points] == [1, 4]
    assert cost.job_cost([1]) == pytest.approx(8 * MS, abs=1.5 * MS)
    assert cost.job_cost([1, 1, 1, 1]) == pytest.approx(14 * MS, abs=2.5 * MS)
    assert cost.job_cost([]) == 0.0
    assert cost.to_json()["job_points"] == [list(p) for p in cost.job_points]
    assert cost.to_json()["job_s"] == cost.job_s and "job_s_absent" not in cost.to_json()
    assert flat.job_s == 0.0 and flat.job_points == ()
    assert "job_s" not in flat.to_json() and flat.to_json()["job_s_absent"]
    # without the term (the default), two-expert batches (two per worker): (6 + 4) / 2
    assert float(flat.expert_s(1)) == pytest.approx(5 * MS, abs=1.0 * MS)
    # batches of one expert cannot tell the job from the expert
    assert single.job_s == 0.0
    with pytest.raises(ValueError, match="job_s"):
        HostCostModel(1 * MS, 0.0, job_s=-1.0)


def test_a_job_term_keeps_probes_from_locking_the_host_out() -> None:
    """The H100 machine's host (thirty-fourth session) in miniature: a job
    costs 4 ms plus 0.3 ms an expert, a copy 1 ms. Priced per expert from
    two-expert batches (2.3 ms, over the 1.5x cap) the planner copies
    everything, and its one-expert probes (4.3 ms) confirm it: the host
    stays locked out although hosting two of six misses cuts the layer from
    6 to 4.6 ms. With the job term the calibration prices it right, every
    layer is split, and the jobs it then observes leave the correction at 1."""
    rng = np.random.default_rng(0)

    def drive(planner: CostModelPlanner, steps: int) -> list[int]:
        hosted = []
        for _ in range(steps):
            tokens = rng.integers(1, 3, size=6)
            plan = planner.plan(0, np.arange(6, dtype=np.int64), tokens, LinkState(1e9))
            if plan.host.size:
                planner.observe([1] * int(plan.host.size), 4 * MS + 0.3 * MS * plan.host.size)
            hosted.append(int(plan.host.size))
        return hosted

    per_expert = CostModelPlanner(HostCostModel(2.3 * MS, 0.0), 1_000_000, probe_every=2)
    hosted = drive(per_expert, 24)
    assert per_expert.decisions["split"] == 0
    assert max(hosted) == 1 and per_expert.decisions["probes"] == sum(hosted) > 0
    assert per_expert.online_cost()["buckets"]["1-1"]["correction"] > 1.5
    with_job = CostModelPlanner(HostCostModel(0.3 * MS, 0.0, job_s=4 * MS), 1_000_000)
    hosted = drive(with_job, 24)
    assert with_job.decisions["split"] == 24 and min(hosted) >= 2
    assert with_job.online_cost()["buckets"]["1-1"]["correction"] == pytest.approx(1.0)
    assert with_job.model.job_s == pytest.approx(4 * MS)


def test_robust_fit_ignores_one_bad_point() -> None:
    """A calibration the H200 recorded (ms per expert at 1/4/16/64 tokens):
    the 16-token point is 5x its neighbours' trend. Least squares charges
    every expert 1.76 ms; the medians keep the 1-token cost at its
    measured ~0.8 ms."""
    pts = [(1, 0.80), (4, 0.93), (16, 5.10), (64, 4.16)]
    a_ls, _ = fit_affine(pts)
    assert a_ls > 1.7
    a, b = fit_robust(pts)
    # b: median of the 6 pairwise slopes, (0.0533 + 0.0538) / 2
    assert b == pytest.approx((3.36 / 63 + 3.23 / 60) / 2, rel=1e-9)
    # a: median of y - b x, the middle two of (0.746, 0.716, 4.243, 0.731)
    assert a == pytest.approx((0.80 - b + 4.16 - 64 * b) / 2, rel=1e-9)
    assert 0.73 < a < 0.75
    # a clean line is its own fit; one x: the median, flat
    assert fit_robust([(1, 1.0), (3, 2.0), (5, 3.0)]) == pytest.approx((0.5, 0.5))
    assert fit_robust([(4, 1.0), (4, 3.0), (4, 10.0)]) == pytest.approx((3.0, 0.0))
    # falling times: flat at the median; a negative intercept: through the origin
    assert fit_robust([(1, 3.0), (2, 1.0)]) == pytest.approx((2.0, 0.0))
    assert fit_robust([(1, 0.5), (2, 2.0), (3, 3.5)]) == pytest.approx((0.0, 1.0))
    with pytest.raises(ValueError, match="no calibration points"):
        fit_robust([])


# -- online correction ------------------------------------------------------------


def test_online_cost_is_a_bounded_median() -> None:
    base = HostCostModel(1 * MS, 0.0)
    online = OnlineHostCost(base, window=8, prior=2, max_ratio=8.0)
    assert online.expert_s(4) == pytest.approx(1 * MS)  # no measurement: the calibration
    online.observe([4], 100 * MS)  # one outlier (100x)
    assert online.correction(4) == pytest.approx(1.0)  # median of {1, 1, 8}
    for _ in range(4):
        online.observe([4], 0.5 * MS)
    # {1, 1, 8, .5, .5, .5, .5}: the median moved down, the outlier did not hold it up
    assert online.correction(4) == pytest.approx(0.5)
    assert online.expert_s(3) == pytest.approx(0.5 * MS)
    # another bucket with no job of its own uses all buckets' ratios
    assert online.correction(64) == pytest.approx(0.5)
    online.observe([64], 4 * MS)
    assert online.correction(64) == pytest.approx(1.0)  # {1, 1, 4}
    assert online.correction(2) == pytest.approx(0.5)  # its own bucket kept
    # nonsense measurements are ignored
    online.observe([], 1.0)
    online.observe([4], float("nan"))
    online.observe([4], 0.0)
    row = online.to_json()
    assert row["observations"] == 6
    assert row["buckets"]["2-4"]["runs"] == 5 and row["buckets"][">16"]["runs"] == 1
    assert row["buckets"]["1-1"]["correction"] is None
    fit = row["measured_fit"]
    assert fit["runs"] == 6 and fit["intercept_s"] >= 0 and fit["per_token_s"] >= 0
    with pytest.raises(ValueError, match="max_ratio"):
        OnlineHostCost(base, max_ratio=1.0)


def _drive(
    planner: CostModelPlanner, true_s: float, steps: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    """Plan ``steps`` layers of 6 misses (2-4 tokens each) on a 1 GB/s link
    (1 ms a copy); every HOST job takes ``true_s`` per expert. Returns per
    step (HOST experts, whether the plan was a split rather than a probe)."""
    out = []
    for _ in range(steps):
        tokens = rng.integers(2, 5, size=6)
        ids = np.arange(6, dtype=np.int64)
        splits = planner.decisions["split"]
        plan = planner.plan(0, ids, tokens, LinkState(1e9))
        if plan.host.size:
            planner.observe([int(tokens[i]) for i in plan.host], true_s * plan.host.size)
        out.append((int(plan.host.size), int(planner.decisions["split"] > splits)))
    return out


def test_pessimistic_calibration_converges_to_serving_host_work() -> None:
    """The host takes 0.8 ms an expert, a copy 1 ms: hosting pays. A
    calibration 3x too slow (2.4 ms, over the 1.5x cap) plans all-COPY; the
    probes measure the host and the planner splits within a few layers."""
    rng = np.random.default_rng(0)
    slow = CostModelPlanner(HostCostModel(2.4 * MS, 0.0), 1_000_000, probe_every=2)
    steps = _drive(slow, 0.8 * MS, 12, rng)
    assert steps[0] == (0, 0)  # the calibration alone: copy everything
    first_split = next(i for i, (_, split) in enumerate(steps) if split)
    assert first_split <= 8, steps
    assert all(split for _, split in steps[first_split:]), steps
    assert slow.decisions["probes"] >= 1
    assert slow.online_cost()["buckets"]["2-4"]["correction"] == pytest.approx(1 / 3)
    # without the online model it never learns
    fixed = CostModelPlanner(HostCostModel(2.4 * MS, 0.0), 1_000_000, online=False)
    assert all(h == 0 for h, _ in _drive(fixed, 0.8 * MS, 12, rng))
    assert fixed.online_cost() is None


def test_optimistic_calibration_backs_off() -> None:
    """The host takes 2.4 ms an expert (over the cap of 1.5 copies); a
    calibration 3x too fast (0.8 ms) splits at first, then stops."""
    rng = np.random.default_rng(1)
    fast = CostModelPlanner(HostCostModel(0.8 * MS, 0.0), 1_000_000, probe_every=4)
    steps = _drive(fast, 2.4 * MS, 16, rng)
    assert steps[0][1] == 1  # the calibration alone: split
    last_split = max(i for i, (_, split) in enumerate(steps) if split)
    assert last_split <= 3, steps
    # afterwards only the occasional probe, one expert at a time
    assert all(h <= 1 for h, _ in steps[last_split + 1 :])
    assert sum(h for h, _ in steps[last_split + 1 :]) <= 4


def test_probe_only_where_the_link_has_other_work() -> None:
    p = CostModelPlanner(HostCostModel(5 * MS, 0.0), 1_000_000, probe_every=1)
    # one miss: nothing to overlap a probe with
    plan = p.plan(0, np.array([3]), np.array([1]), LinkState(1e9))
    assert plan.host.size == 0
    # two misses, but the host's 5 ms is over 4x the other copy's 1 ms
    plan = p.plan(0, np.array([3, 4]), np.array([1, 2]), LinkState(1e9))
    assert plan.host.size == 0
    # three misses, the fewest tokens: probed
    plan = p.plan(0, np.array([3, 4, 5]), np.array([2, 1, 2]), LinkState(1e9))
    assert plan.host.tolist() == [4] and p.decisions["probes"] == 1
    # beyond the token cap: never
    p = CostModelPlanner(HostCostModel(5 * MS, 0.0), 1_000_000, probe_every=1)
    plan = p.plan(0, np.array([3, 4, 5]), np.array([20, 30, 40]), LinkState(1e9))
    assert plan.host.size == 0
    # no HOST expert allowed per layer: no probe either
    p = CostModelPlanner(HostCostModel(5 * MS, 0.0), 1_000_000, probe_every=1, max_host_per_layer=0)
    plan = p.plan(0, np.array([3, 4, 5]), np.array([2, 1, 2]), LinkState(1e9))
    assert plan.host.size == 0
    with pytest.raises(ValueError, match="probe_every"):
        CostModelPlanner(HostCostModel(0.0, 0.0), 1, probe_every=0)


def _forwards(ad: object, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 128, (6,), generator=g)
        ad.forward_logits(ids)  # type: ignore[attr-defined]


@pytest.mark.parametrize("wrong", ["pessimistic", "optimistic"])
def test_tiny_model_planner_corrects_an_injected_calibration(
    wrong: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """On a tiny model whose host expert takes a known 2 ms (the adapter's
    expert function plus a sleep: a tiny expert's own time is all per-job
    overhead and noise), a copy 4 ms: an injected calibration 3x too slow
    (6 ms, over the 1x cap) starts all-COPY and ends splitting; one 3x too
    fast (0.67 ms, under a 0.3x cap) starts splitting and stops."""
    ad = load_adapter(
        tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_slots=4, max_batch_tokens=2
    )
    assert ad.runtime is not None
    true_s = 2 * MS

    def slow_expert(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(true_s)
        out: torch.Tensor = ad.expert_forward(x, w)
        return out

    scale, cap = (3.0, 1.0) if wrong == "pessimistic" else (1 / 3, 0.3)
    injected = HostCostModel(true_s * scale, 0.0)
    planner = CostModelPlanner(
        injected,
        ad.expert_nbytes,
        margin=0.0,
        max_host_ratio=cap,
        max_host_tokens=None,
        probe_every=2,
    )
    executor = HostExpertExecutor(
        ad.store.views,
        slow_expert,
        dtype=ad.store.layout.dtype,
        expert_nbytes=ad.expert_nbytes,
        workers=1,
    )
    svc = HostExpertService(
        executor,
        planner,
        num_experts=ad.num_experts,
        expert_nbytes=ad.expert_nbytes,
        link_bytes_per_s=ad.expert_nbytes / (2 * true_s),
        cost=injected,
    )
    ad.runtime.host_service = svc
    try:
        _forwards(ad, 3, 0)
        early = planner.decisions["split"]
        _forwards(ad, 12, 1)
        mid = planner.decisions["split"]
        _forwards(ad, 6, 2)
        late = planner.decisions["split"] - mid
        assert svc.books.experts > 0
        online = svc.describe()["online_cost"]
        assert online is not None and online["observations"] > 0
        if wrong == "pessimistic":
            assert early == 0
            assert late > 0, online
        else:
            assert early > 0
            assert late == 0, online
    finally:
        svc.close()
        ad.runtime.host_service = None


# -- prepared weights kept with the store; threads ------------------------------------


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the native kernel needs AVX-512 BF16")
def test_kept_native_weights_follow_the_thread_count_and_release_their_team(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """A native kernel's team is sized by torch's thread count when it is
    made: weights kept for one count are not reused for another (they
    would run a team of the old size), and release joins the team."""
    ad = load_adapter(
        tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8, dtype=torch.bfloat16
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = host_weights_for(ad, "native", budget_bytes=1 << 34)
        assert two.kernel.threads == 2  # type: ignore[attr-defined]
        assert host_weights_for(ad, "native", budget_bytes=1 << 34) is two
        assert two.uses == 2 and two.describe()["reused"] is True
        torch.set_num_threads(1)
        one = host_weights_for(ad, "native", budget_bytes=1 << 34)
        assert one is not two and one.kernel.threads == 1  # type: ignore[attr-defined]
        assert one.describe()["reused"] is False
    finally:
        torch.set_num_threads(before)
    assert release_host_weights(ad.store) is True
    assert release_host_weights(ad.store) is False  # nothing kept any more


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the native kernel needs AVX-512 BF16")
@pytest.mark.parametrize("fmt", ["native", "auto"])
def test_services_with_host_experts_leave_no_threads_behind(
    fmt: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """Build, use and close several services (native teams, pools, the
    format selection's timed kernels): the OS thread count does not grow,
    the kept weights are reused, and releasing them gives the threads back."""
    ad = load_adapter(
        tiny_checkpoints["gpt_oss"],
        issuer=host_issuer,
        cache_slots=4,
        dtype=torch.bfloat16,
        max_batch_tokens=2,
    )
    assert ad.runtime is not None

    def one_service() -> dict[str, object]:
        svc = build_host_service(
            ad, link_bytes_per_s=1e6, host_format=fmt, intra_op_threads=2, probe_every=1
        )
        try:
            _forwards(ad, 2, 0)
            return svc.describe()
        finally:
            svc.close()
            ad.runtime.host_service = None  # type: ignore[union-attr]

    release_host_weights(ad.store)
    baseline = _threads()
    first = one_service()
    kept = _settled_threads(baseline + 8)  # the kept kernel's team, torch's pool
    rows = []
    for _ in range(3):
        rows.append(one_service())
        # a joined thread may take a moment to leave /proc
        assert _settled_threads(kept) <= kept
    hw0 = first["host_weights"]
    assert isinstance(hw0, dict) and hw0["reused"] is False
    for row in rows:
        hw = row["host_weights"]
        assert isinstance(hw, dict) and hw["reused"] is True
    assert release_host_weights(ad.store)
    # auto may have chosen a torch format, which has no team of its own
    team_workers = 1 if hw0["host_format"] == "native" else 0
    assert _settled_threads(kept - team_workers) <= kept - team_workers  # the team joined


def test_a_probe_records_its_modeled_host_seconds() -> None:
    """A probed expert's plan carries the pool seconds the probe was judged
    by (round trip and the expert at its token count), and no split costs."""
    p = CostModelPlanner(HostCostModel(5 * MS, 0.1 * MS), 1_000_000, probe_every=1)
    plan = p.plan(0, np.array([3, 4, 5]), np.array([2, 1, 2]), LinkState(1e9))
    assert plan.host.tolist() == [4] and p.decisions["probes"] == 1
    expected = p.model.roundtrip_s + float(p.model.expert_s(1))
    assert plan.modeled_host_s == expected
    assert expected == pytest.approx(p.model.roundtrip_s + 5.1 * MS)
    # the copies it replaces: 3 MB at 1 GB/s ahead of nothing, all exposed
    assert plan.modeled_copy_only_s == plan.modeled_s == pytest.approx(3 * MS)
