"""Host thread placement (pdflash.hybrid.affinity, ``--host-affinity``): the
plan, the pins read back from the kernel (os.sched_getaffinity of each
thread id), ``off`` making no affinity call, and every mask given back and
every thread joined on close."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.hybrid import (
    ForcedHostPlanner,
    HostExpertExecutor,
    HostPlacement,
    build_host_service,
    default_host_threads,
    plan_host_threads,
    plan_placement,
    rank_cpus,
    rank_host_share,
)
from pdflash.hybrid.affinity import ThreadPinner, _parse_cpu_list, affinity_supported
from pdflash.hybrid.native import NativeHostKernel, native_unavailable_reason
from pdflash.models import load_adapter

linux = pytest.mark.skipif(not affinity_supported(), reason="no sched_setaffinity here")
ALLOWED = sorted(os.sched_getaffinity(0)) if affinity_supported() else []
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs to place threads apart")


def _alive(tid: int, timeout_s: float = 3.0) -> bool:
    """Whether thread ``tid`` is still in this process (a joined thread may
    take a moment to leave /proc)."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/self/task/{tid}"):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.01)
    return False


def _mask(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


# -- the plan -------------------------------------------------------------------


def test_plan_keeps_two_cores_for_the_engine_and_the_rest_for_the_host() -> None:
    p = plan_placement("auto", allowed=range(16), siblings=lambda c: frozenset({c}))
    assert p.applied and p.reason is None
    assert p.engine_cpus == (0, 1) and p.host_cpus == tuple(range(2, 16))
    assert p.describe() == {
        "mode": "auto",
        "applied": True,
        "engine_cpus": [0, 1],
        "host_cpus": list(range(2, 16)),
        "reason": None,
    }


def test_plan_keeps_smt_siblings_on_one_side() -> None:
    # cpus 0-7, core i's siblings are i and i + 4
    p = plan_placement("auto", allowed=range(8), siblings=lambda c: frozenset({c % 4, c % 4 + 4}))
    assert p.engine_cpus == (0, 1, 4, 5) and p.host_cpus == (2, 3, 6, 7)
    # a sibling outside the allowed set is not used
    q = plan_placement(
        "auto", allowed=[0, 1, 2, 4], siblings=lambda c: frozenset({c % 4, c % 4 + 4})
    )
    assert q.engine_cpus == (0, 1, 4) and q.host_cpus == (2,)


def test_plan_refuses_to_place_where_it_cannot_keep_both_sides() -> None:
    p = plan_placement("auto", allowed=[0, 1], siblings=lambda c: frozenset({c}))
    assert not p.applied and p.engine_cpus == () and p.host_cpus == ()
    assert p.reason is not None and "2 cores" in p.reason
    assert plan_placement("auto", allowed=[3, 5], engine_cores=1).host_cpus == (5,)
    off = plan_placement("off", allowed=range(16))
    assert not off.applied and off.reason is None and off.mode == "off"


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="host_affinity must be one of"):
        plan_placement("on")
    with pytest.raises(ValueError, match="engine_cores"):
        plan_placement("auto", allowed=range(4), engine_cores=0)
    with pytest.raises(ValueError, match=">= 0"):
        plan_placement("auto", allowed=[-1, 0, 1, 2])


def _one(cpu: int) -> frozenset[int]:
    return frozenset({cpu})


def test_ranks_on_one_host_split_its_cores_into_contiguous_shares() -> None:
    shares = [rank_cpus(r, 3, allowed=range(16), siblings=_one) for r in range(3)]
    assert shares == [tuple(range(0, 6)), tuple(range(6, 11)), tuple(range(11, 16))]
    # SMT siblings stay in one share (core i is cpus i and i + 8)
    smt = lambda c: frozenset({c % 8, c % 8 + 8})  # noqa: E731
    low, high = (rank_cpus(r, 2, allowed=range(16), siblings=smt) for r in range(2))
    assert low == (0, 1, 2, 3, 8, 9, 10, 11) and high == (4, 5, 6, 7, 12, 13, 14, 15)
    # fewer cores than ranks: the ranks take the cores in turn and share them
    assert [rank_cpus(r, 3, allowed=[4, 5], siblings=_one) for r in range(3)] == [(4,), (5,), (4,)]
    assert rank_cpus(0, 1, allowed=[7, 2], siblings=_one) == (2, 7)
    mine = rank_cpus(0, 1)  # this process's own CPUs, all of them for one rank
    assert mine and (not affinity_supported() or set(mine) == set(ALLOWED))


def test_rank_shares_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="world must be >= 1"):
        rank_cpus(0, 0, allowed=range(4))
    with pytest.raises(ValueError, match="rank must be in"):
        rank_cpus(2, 2, allowed=range(4))
    with pytest.raises(ValueError, match="no CPUs"):
        rank_cpus(0, 1, allowed=[])
    with pytest.raises(ValueError, match=">= 0"):
        rank_cpus(0, 1, allowed=[-1, 3])


@linux
def test_a_rank_plans_its_host_threads_inside_its_share() -> None:
    share = rank_cpus(1, 2, allowed=range(16), siblings=_one)
    assert share == tuple(range(8, 16))
    placement, threads = plan_host_threads("auto", torch.device("cuda"), share)
    # the engine's two cores and the host pool's, all inside the share
    assert placement == plan_placement("auto", allowed=share) and placement.applied
    assert set(placement.engine_cpus) | set(placement.host_cpus) == set(share)
    assert threads == len(share) - 2
    # without a share: the machine's default; on a CPU model nothing is placed
    assert plan_host_threads("auto", torch.device("cuda"))[1] == default_host_threads()[1]
    on_cpu, _ = plan_host_threads("auto", torch.device("cpu"), share)
    assert not on_cpu.applied and on_cpu.reason is not None and "device" in on_cpu.reason
    assert plan_host_threads("off", torch.device("cuda"), [3])[1] == 1
    with pytest.raises(ValueError, match="cpus is empty"):
        plan_host_threads("auto", torch.device("cuda"), [])


def test_a_rank_gets_its_share_of_the_cores_and_the_weight_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pdflash.hybrid as hybrid

    monkeypatch.setattr(hybrid, "default_weight_budget", lambda: 1000)
    share = rank_host_share(1, 3)
    assert share == {"cpus": rank_cpus(1, 3), "weight_budget_bytes": 333}
    assert rank_host_share(0, 1)["weight_budget_bytes"] == 1000


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert _parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert _parse_cpu_list("5") == [5]


# -- pinning threads ---------------------------------------------------------------


@linux
@two_cpus
def test_pinner_pins_a_thread_and_gives_its_mask_back() -> None:
    go, ready = threading.Event(), threading.Event()
    tids: list[int] = []

    def body() -> None:
        tids.append(threading.get_native_id())
        ready.set()
        go.wait(10)

    t = threading.Thread(target=body)
    t.start()
    try:
        ready.wait(10)
        (tid,) = tids
        before = _mask(tid)
        pinner = ThreadPinner()
        assert pinner.pin(tid, [ALLOWED[-1]])
        assert _mask(tid) == {ALLOWED[-1]} and pinner.pinned == [tid]
        assert pinner.pin(tid, [ALLOWED[0]])  # a second pin keeps the first "before"
        pinner.restore()
        assert _mask(tid) == before and pinner.pinned == []
        pinner.restore()  # idempotent
        with pytest.raises(ValueError, match="thread id"):
            pinner.pin(0, [ALLOWED[0]])
        with pytest.raises(ValueError, match="no CPUs"):
            pinner.pin(tid, [])
        assert _mask(tid) == before  # refused: unchanged
    finally:
        go.set()
        t.join()
    assert not _alive(tid)
    assert not ThreadPinner().pin(tid, [ALLOWED[0]])  # exited: nothing pinned


@linux
def test_native_team_reports_its_worker_threads_and_joins_them() -> None:
    kernel = NativeHostKernel("swiglu_silu", lambda _v: (), hidden=8, inter=8, threads=3)
    tids = kernel.thread_ids()
    assert len(tids) == 2 and len(set(tids)) == 2
    assert all(os.path.exists(f"/proc/self/task/{t}") for t in tids)
    assert threading.get_native_id() not in tids  # the caller is the team's third member
    kernel.close()
    assert not any(_alive(t) for t in tids)


@linux
def test_the_issuer_reports_its_worker_thread(host_issuer: Any) -> None:
    deadline = time.monotonic() + 3.0
    while host_issuer.worker_tid == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # it is set by the thread itself once it starts
    tid = host_issuer.worker_tid
    assert tid > 0 and tid != threading.get_native_id()
    assert os.path.exists(f"/proc/self/task/{tid}")


@linux
@two_cpus
def test_executor_workers_place_themselves_on_the_host_cpus() -> None:
    cpu = ALLOWED[-1]
    ex = HostExpertExecutor(
        lambda g: {"w": torch.tensor(float(g + 1))},
        lambda x, w: x * w["w"],
        dtype=torch.float32,
        workers=2,
        host_cpus=[cpu],
    )
    try:
        out = ex.compute(np.array([0, 1]), torch.ones(3, 2), [2, 1])
        assert torch.equal(out, torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]))
        assert ex.thread_ids and all(_mask(t) == {cpu} for t in ex.thread_ids)
        assert _mask(threading.get_native_id()) == set(ALLOWED)  # the caller untouched
    finally:
        ex.close()
    assert not any(_alive(t) for t in ex.thread_ids)


def test_executor_rejects_bad_cpus() -> None:
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="host_cpus"):
            HostExpertExecutor(lambda g: {}, lambda x, w: x, dtype=torch.float32, host_cpus=bad)


# -- the service -------------------------------------------------------------------


def _bf16_adapter(tiny_checkpoints: dict[str, Path], issuer: Any) -> Any:
    return load_adapter(
        tiny_checkpoints["qwen3_moe"], issuer=issuer, cache_slots=8, dtype=torch.bfloat16
    )


def _serve_once(svc: Any, ad: Any) -> None:
    ids = np.array([0, 1])
    x = torch.randn(3, int(ad.hidden_size)).to(torch.bfloat16)
    svc.executor.compute(ids, x, [2, 1])


@linux
@two_cpus
def test_service_places_host_and_engine_threads_and_gives_them_back(
    tiny_checkpoints: dict[str, Path], host_issuer: Any
) -> None:
    native = native_unavailable_reason(torch.bfloat16) is None
    ad = _bf16_adapter(tiny_checkpoints, host_issuer)
    engine_cpu, host_cpu = ALLOWED[0], ALLOWED[-1]
    me = threading.get_native_id()
    issuer_tid = host_issuer.worker_tid
    assert issuer_tid > 0
    before = {me: _mask(me), issuer_tid: _mask(issuer_tid)}
    placement = HostPlacement("auto", engine_cpus=(engine_cpu,), host_cpus=(host_cpu,))
    svc = build_host_service(
        ad,
        link_bytes_per_s=1e9,
        planner=ForcedHostPlanner(every=1),
        calibrate=False,
        host_format="native" if native else "packed",
        intra_op_threads=2,
        host_affinity=placement,
    )
    team: list[int] = []
    try:
        # the engine: this (forward) thread and the issuer's
        assert _mask(me) == {engine_cpu} and _mask(issuer_tid) == {engine_cpu}
        if native:
            kernel = getattr(svc.executor.batch_fn, "__self__", None)  # the kernel's forward_many
            assert isinstance(kernel, NativeHostKernel)
            team = kernel.thread_ids()
            assert len(team) == 1 and _mask(team[0]) == {host_cpu}
            before[team[0]] = set(ALLOWED)
        _serve_once(svc, ad)
        assert svc.executor.thread_ids
        assert all(_mask(t) == {host_cpu} for t in svc.executor.thread_ids)
        got = svc.describe()["affinity"]
        assert got["mode"] == "auto" and got["applied"] is True
        assert got["engine_cpus"] == [engine_cpu] and got["host_cpus"] == [host_cpu]
        assert got["engine_threads_pinned"] == 2
        assert got["host_threads_pinned"] == len(team) + len(svc.executor.thread_ids)
    finally:
        svc.close()
        ad.runtime.host_service = None
    for tid, mask in before.items():
        assert _mask(tid) == mask, tid
    assert not any(_alive(t) for t in svc.executor.thread_ids)
    svc.close()  # idempotent
    assert _mask(me) == before[me]


def test_off_makes_no_affinity_call(
    tiny_checkpoints: dict[str, Path], host_issuer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []

    def spy(*args: Any) -> None:
        calls.append(args)
        raise AssertionError("sched_setaffinity called with host_affinity off")

    monkeypatch.setattr(os, "sched_setaffinity", spy, raising=False)
    ad = _bf16_adapter(tiny_checkpoints, host_issuer)
    for mode in ("off", "auto"):  # auto on a CPU model: the host is the device, nothing placed
        svc = build_host_service(
            ad,
            link_bytes_per_s=1e9,
            planner=ForcedHostPlanner(every=1),
            calibrate=False,
            host_format="packed",
            host_affinity=mode,
        )
        try:
            _serve_once(svc, ad)
            got = svc.describe()["affinity"]
        finally:
            svc.close()
            ad.runtime.host_service = None
        assert got["mode"] == mode and got["applied"] is False
        assert got["engine_threads_pinned"] == got["host_threads_pinned"] == 0
        assert (got["reason"] is None) == (mode == "off")
    assert calls == []


def test_a_bad_mode_is_refused_before_anything_changes(
    tiny_checkpoints: dict[str, Path], host_issuer: Any
) -> None:
    ad = _bf16_adapter(tiny_checkpoints, host_issuer)
    threads = torch.get_num_threads()
    mask = _mask(0) if affinity_supported() else None
    with pytest.raises(ValueError, match="host_affinity must be one of"):
        build_host_service(
            ad,
            link_bytes_per_s=1e9,
            planner=ForcedHostPlanner(every=1),
            calibrate=False,
            intra_op_threads=threads + 1,
            host_affinity="pinned",
        )
    assert torch.get_num_threads() == threads
    assert ad.runtime.host_service is None
    if mask is not None:
        assert _mask(0) == mask


# -- the run setting -----------------------------------------------------------------


def test_the_run_setting_is_validated_keyed_and_spelled_by_the_clis() -> None:
    import argparse

    from pdflash.bench.engine_run import RunSpec, run_spec
    from pdflash.bench.suites import engine, matrix

    from pdflash.hybrid import DEFAULT_HOST_AFFINITY
    from pdflash.report.schema import RUN_SETTINGS

    # auto is the default everywhere a host service is built
    assert DEFAULT_HOST_AFFINITY == "auto"
    assert RunSpec(arch="tiny-qwen3_moe", baseline="PD+host").host_affinity == "auto"
    with pytest.raises(ValueError, match="host_affinity"):
        run_spec(RunSpec(arch="tiny-gpt_oss", baseline="PD+host", host_affinity="on"))
    ap = argparse.ArgumentParser()
    engine.add_arguments(ap)
    assert ap.parse_args([]).host_affinity == "auto"
    assert ap.parse_args(["--host-affinity", "off"]).host_affinity == "off"
    with pytest.raises(SystemExit):
        ap.parse_args(["--host-affinity", "on"])
    assert matrix.HOST_DEFAULTS["host_affinity"] == "auto"
    (setting,) = [s for s in RUN_SETTINGS if s.name == "host_affinity"]
    assert setting.default == DEFAULT_HOST_AFFINITY
    assert setting.recorded is not None
    # a row records the mode its service ran with; an older service placed
    # nothing (off); a row without a service keys like a default run
    assert setting.recorded({"host_service": {"affinity": {"mode": "off"}}}) == "off"
    assert setting.recorded({"host_service": {"affinity": {"mode": "auto"}}}) == "auto"
    assert setting.recorded({"host_service": {"planner": {}}}) == "off"
    assert setting.recorded({}) == "auto"
