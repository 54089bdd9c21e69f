"""bench/h200/issue16.py: its arms (parsing, checks, order), its summary's
intervals, ratios and verdicts (hand-checked), and a run of every arm on the
tiny CPU shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_fixtures import load_bench_script

issue16 = load_bench_script("issue16.py")


def test_interval_hand_checked() -> None:
    out = issue16.interval([1.0, 2.0, 3.0])
    assert (out["n"], out["median"], out["min"], out["max"]) == (3, 2.0, 1.0, 3.0)
    # mean 2, s = 1, t(0.975, 2) = 4.3026527: 2 -/+ 4.3026527 / sqrt(3)
    lo, hi = out["mean_ci95"]
    half = 4.3026527 / 3**0.5
    assert (lo, hi) == pytest.approx((2 - half, 2 + half))
    # ten values (9 degrees of freedom): t(0.975, 9) = 2.2621572, not the normal 1.96
    lo, hi = issue16.interval([float(v) for v in range(10)])["mean_ci95"]
    assert hi - lo == pytest.approx(2 * 2.2621572 * (55 / 6) ** 0.5 / 10**0.5)
    assert "mean_ci95" not in issue16.interval([5.0])
    assert issue16.interval([]) == {"n": 0}


def _row(baseline: str, tps: float, **kw: Any) -> dict[str, Any]:
    row = {
        "arch": "a",
        "cache_fraction": 0.2,
        "concurrency": 1,
        "baseline": baseline,
        "output_tokens_per_s": tps,
        "expert_nbytes": 100,
        "bytes_per_token": 1000.0 if baseline == "PD" else 600.0,
        "wall_s": 10.0,
        "compute_busy_s": 2.0,
        "link_busy_s": 9.0,
    }
    row.update(kw)
    return row


def test_summary_verdicts_and_the_binding_resource() -> None:
    rows = [_row("PD", t) for t in (10.0, 11.0, 12.0)]
    host = dict(host_served_experts=30.0, h2d_bytes=7000.0, host_busy_s=9.5)
    rows += [_row("PD+host", t, **host) for t in (20.0, 21.0, 22.0)]
    (point,) = issue16.summarise(rows)
    assert point["speedup_median"] == pytest.approx(21 / 11)
    assert point["verdict"] == "PD+host faster"
    assert point["bytes_per_token_ratio"] == pytest.approx(0.6)
    ph = point["pd_host"]
    assert ph["host_share_of_misses"] == pytest.approx(30 / (30 + 70))
    assert ph["binding_resource"] == "host_cpu" and ph["cpu_is_bottleneck"]
    # overlapping intervals: within noise
    rows = [_row("PD", t) for t in (10.0, 15.0, 20.0)] + [
        _row("PD+host", t, **host) for t in (12.0, 16.0, 21.0)
    ]
    assert issue16.summarise(rows)[0]["verdict"] == "within noise"


def test_one_run_on_a_side_gives_no_verdict() -> None:
    """A single run has no interval: its ratio is reported, not judged (a
    one-run point once read "PD+host slower" from two bare values)."""
    rows = [_row("PD", 35.0), _row("PD+host", 30.0, host_served_experts=3.0, h2d_bytes=700.0)]
    (point,) = issue16.summarise(rows)
    assert point["speedup_median"] == pytest.approx(30 / 35)
    assert point["verdict"] == "too few runs"
    rows += [_row("PD", 35.2), _row("PD+host", 30.2, host_served_experts=3.0, h2d_bytes=700.0)]
    assert issue16.summarise(rows)[0]["verdict"] == "PD+host slower"


# --- --arms: named arms, each a baseline plus run-setting overrides --------

_FIVE = (
    "PD,host=PD+host,stream=PD+host:host_handoff=stream,"
    "noaffinity=PD+host:host_affinity=off,weighted=PD+host:host_ahead=weighted"
)


def test_parse_arms_names_baselines_and_typed_overrides() -> None:
    arms = issue16.parse_arms(_FIVE)
    assert [(a.name, a.baseline, a.overrides()) for a in arms] == [
        ("PD", "PD", {}),
        ("host", "PD+host", {}),
        ("stream", "PD+host", {"host_handoff": "stream"}),
        ("noaffinity", "PD+host", {"host_affinity": "off"}),
        ("weighted", "PD+host", {"host_ahead": "weighted"}),
    ]
    # the default: both presets warmed past their controller's first round and
    # PD-all-on without and with the host part given bursts, pieces on all
    default = issue16.parse_arms(issue16.DEFAULT_ARMS)
    assert [(a.name, a.baseline) for a in default] == [
        ("PD", "PD"),
        ("PD-all-on", "PD-all-on"),
        ("PD+host", "PD+host"),
        ("PD-all-on+host", "PD-all-on"),
    ]
    assert [a.overrides() for a in default] == [
        {"cuda_graphs": "piecewise", "controller_warmup": "first_round"},
        {"cuda_graphs": "piecewise", "warm_bursts": 3},
        {"cuda_graphs": "piecewise", "controller_warmup": "first_round"},
        {"host_experts": "auto", "cuda_graphs": "piecewise", "warm_bursts": 3},
    ]
    # an adaptive width's own options stay in its value; other unknown names are refused
    (one,) = issue16.parse_arms("one=PD:verify_width=adaptive:beta=one:z=1.5:cuda_graphs=piecewise")
    assert one.overrides() == {
        "verify_width": "adaptive:beta=one:z=1.5",
        "cuda_graphs": "piecewise",
    }
    with pytest.raises(ValueError, match="'beta' is not a run setting"):
        issue16.parse_arms("bad=PD:cuda_graphs=piecewise:beta=one")
    # a value may hold ':' (not followed by SETTING=)
    (arm,) = issue16.parse_arms(
        "w=PD+host:verify_width=fixed:4:host_critical_path=true:host_max_tokens=0"
        ":host_threads=none:host_max_ratio=2"
    )
    assert arm.overrides() == {
        "verify_width": "fixed:4",
        "host_critical_path": True,
        "host_max_tokens": 0,
        "host_threads": None,
        "host_max_ratio": 2.0,
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a b=PD", "arm name 'a b'"),
        ("x/y=PD", "arm name 'x/y'"),
        ("a=PDX", "baseline must be one of"),
        ("a=PD,a=PD+host", "two arms are named 'a'"),
        ("PD,PD", "two arms are named 'PD'"),
        ("a=PD+host:foo=1", "'foo' is not a run setting"),
        # a point field is not an arm's setting
        ("a=PD+host:concurrency=4", "'concurrency' is not a run setting"),
        ("a=PD+host:host_max_tokens=x", "host_max_tokens='x' is not of type int"),
        ("a=PD+host:host_critical_path=yes", "is not of type bool"),
        ("a=PD+host:host_ahead=certain:host_ahead=weighted", "sets host_ahead twice"),
        (" , ", "no arms"),
    ],
)
def test_parse_arms_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        issue16.parse_arms(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # RunSpec's own validation, named by arm and arch
        ("a=PD+host:host_handoff=bogus", r"arm 'a' \(tiny-gpt_oss\): host_handoff must be one of"),
        ("a=PD+host:host_affinity=on", r"arm 'a' \(tiny-gpt_oss\): host_affinity"),
        # a host setting where no host service runs does nothing: refused
        ("x=PD:host_handoff=stream", "host_handoff cannot apply to baseline PD"),
        # two arms running one configuration (the second names the default)
        (
            "a=PD+host,b=PD+host:host_handoff=thread",
            r"arms 'a' \(PD\+host\) and 'b' \(PD\+host:host_handoff=thread\) run one "
            r"configuration \(tiny-gpt_oss, cache 0.2, c=4\)",
        ),
        # PD's width is adaptive: the override resolves to PD's own configuration
        ("PD,PDa=PD:verify_width=adaptive", "arms 'PD' \\(PD\\) and 'PDa'"),
        # the limits RunSpec derives from the point, given as written
        ("PD,m=PD:max_running=4:token_budget=64", "arms 'PD' \\(PD\\) and 'm'"),
        # PD+host always runs the host service
        ("h=PD+host,hx=PD+host:host_experts=auto", "arms 'h' \\(PD\\+host\\) and 'hx'"),
        # a gate of 0 given as an int or a float is one setting
        (
            "o=PD+host:host_ahead_min_exposed=0,o2=PD+host:host_ahead_min_exposed=0.0",
            "arms 'o' .* and 'o2'",
        ),
        # B0 verifies no draft: a width changes nothing
        ("B0,w=B0:verify_width=fixed:4", "arms 'B0' \\(B0\\) and 'w'"),
        # the gate's share is checked before anything loads
        (
            "a=PD+host:host_ahead_min_exposed=1.5",
            r"arm 'a' \(tiny-gpt_oss\): host_ahead_min_exposed must be a share in \[0, 1\]",
        ),
        ("x=PD:host_ahead_min_exposed=0", "host_ahead_min_exposed cannot apply to baseline PD"),
        # graphs on warm up on the run's own workload, off after the shared one
        (
            "PD,PDauto=PD:cuda_graphs=auto",
            r"arms 'PD' \(PD\) and 'PDauto' \(PD:cuda_graphs=auto\) warm up differently on "
            r"CUDA \(shared vs workload",
        ),
        (
            "a=PD:warmup=workload,b=PD:cuda_graphs=piecewise:warmup=shared",
            "warm up differently on CUDA \\(workload vs shared",
        ),
    ],
)
def test_check_arms_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        issue16.check_arms(issue16.parse_arms(text), {"layers": None}, ["tiny-gpt_oss"])


def test_check_arms_accepts_the_five_and_host_settings_with_host_experts() -> None:
    issue16.check_arms(issue16.parse_arms(_FIVE), {"layers": None}, ["tiny-gpt_oss"])
    # the default arms are valid and distinct runs on both archs
    issue16.check_arms(
        issue16.parse_arms(issue16.DEFAULT_ARMS),
        {"layers": None},
        ["tiny-gpt_oss", "tiny-qwen3_moe"],
    )
    # configurations that differ from the label's preset are distinct arms
    distinct = (
        "PD,full=PD:verify_width=full,PD+host,open=PD+host:host_ahead_min_exposed=0,"
        "split=PD+host:host_ahead_from=stream,m=PD:max_running=8"
    )
    issue16.check_arms(issue16.parse_arms(distinct), {"layers": None}, ["tiny-gpt_oss"])
    # the width scripts' default arms (width_ab.sh, widthmodel_ab.sh)
    for text in ("PD,PDfull=PD:verify_width=full,B3", "PDfull=PD:verify_width=full,PD"):
        issue16.check_arms(issue16.parse_arms(text), {"layers": None}, ["tiny-gpt_oss"])
    # graph arms against eager ones with the same warm-up (session 22's confound, removed)
    same = "PDw=PD:warmup=workload,PDauto=PD:cuda_graphs=auto,PDpw=PD:cuda_graphs=piecewise"
    issue16.check_arms(issue16.parse_arms(same), {"layers": None}, ["tiny-gpt_oss"])
    arms = issue16.parse_arms("PD,hx=PD:host_experts=auto:host_handoff=stream")
    issue16.check_arms(arms, {"layers": None}, ["tiny-gpt_oss"])
    # a limit equal to what the point derives is one run at that point only
    limited = issue16.parse_arms("PD,m=PD:max_running=4")
    issue16.check_arms(limited, {"layers": None, "concurrency": 8}, ["tiny-gpt_oss"])
    with pytest.raises(ValueError, match=r"run one configuration \(tiny-gpt_oss, cache 0.5, c=4\)"):
        issue16.check_arms(
            limited, {"layers": None, "concurrency": 4, "cache_fraction": 0.5}, ["tiny-gpt_oss"]
        )
    # eviction=auto is layer_cyclic for every baseline: one run
    cyclic = issue16.parse_arms("PD,cyc=PD:eviction=layer_cyclic")
    with pytest.raises(ValueError, match=r"'PD' \(PD\) and 'cyc' .* run one configuration"):
        issue16.check_arms(cyclic, {"layers": None}, ["tiny-gpt_oss"])
    issue16.check_arms(
        issue16.parse_arms("PD,lru=PD:eviction=lru"), {"layers": None}, ["tiny-gpt_oss"]
    )
    with pytest.raises(ValueError, match="unknown arch"):
        issue16.check_arms(arms, {}, ["no-such-arch"])


def test_main_refuses_bad_arms_before_running(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        issue16.main(
            [
                "--archs",
                "tiny-gpt_oss",
                "--arms",
                "a=PD+host:host_ahead=maybe",
                "--out",
                str(tmp_path),
            ]
        )
    assert exc.value.code == 2
    assert not (tmp_path / "rows.jsonl").exists()
    with pytest.raises(SystemExit):
        issue16.main(["--archs", "tiny-gpt_oss", "--reference", "nope", "--out", str(tmp_path)])


def test_main_refuses_two_arms_of_one_configuration_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PD's width is ``adaptive``: ``PDadaptive`` would run PD's
    configuration again (argparse's error, before torch or a model is
    touched)."""
    argv = ["--archs", "tiny-gpt_oss", "--points", "0.2:1,0.2:4", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        issue16.main([*argv, "--arms", "PD,PDadaptive=PD:verify_width=adaptive"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    want = "arms 'PD' (PD) and 'PDadaptive' (PD:verify_width=adaptive) run one configuration"
    assert want in err
    assert "(tiny-gpt_oss, cache 0.2, c=1)" in err
    assert not (tmp_path / "rows.jsonl").exists()


def test_best_vs_best_counts_pd_settings_on_either_side() -> None:
    """A PD-all-on arm is a setting of PD, and with host_experts on of
    PD+host: the fastest of each side is compared, whatever its label."""
    rows = []
    for rep in range(3):
        rows += [
            _arm_row("PD", rep, 100.0),
            _arm_row("allon", rep, 110.0, baseline="PD-all-on", host_experts="off"),
            _arm_row("host", rep, 140.0),
            _arm_row("hostall", rep, 150.0, baseline="PD-all-on", host_experts="auto"),
            _arm_row("B1", rep, 120.0, baseline="B1", host_experts="off"),
        ]
    arms = issue16.parse_arms(
        "PD,allon=PD-all-on,host=PD+host,hostall=PD-all-on:host_experts=auto,B1=B1"
    )
    (p,) = issue16.summarise(rows, arms)
    best = p["best_vs_best"]
    assert best["pair"] == "hostall/allon"
    assert best["pair_ratio_median"] == pytest.approx(150 / 110)
    assert issue16.label_side({"baseline": "B1"}) is None
    assert issue16.label_side({"baseline": "PD-no-stream", "host_experts": "off"}) == "PD"


def test_each_arm_reports_the_share_of_steps_pd_parts_ran_in() -> None:
    """Medians over an arm's runs of pd_parts.on_fraction per part and of
    its switches; None for an arm whose runs had no controller books."""

    def parts(stream: float, switches: int) -> dict[str, Any]:
        on = {"route_ahead": 1.0, "stream": stream, "scheduler_2d": 0.9}
        return {"on_fraction": on, "switches": switches}

    rows = [
        _arm_row("PD", 0, 90.0, pd_parts=parts(0.55, 0)),
        _arm_row("PD", 1, 91.0, pd_parts=parts(0.61, 0)),
        _arm_row("PD", 2, 92.0, pd_parts=parts(0.45, 1)),
        _arm_row("host", 0, 100.0),
        _arm_row("host", 1, 101.0),
        _arm_row("host", 2, 102.0),
    ]
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    pd, host = p["by_arm"]["PD"], p["by_arm"]["host"]
    assert pd["parts_on_fraction"] == pytest.approx(
        {"route_ahead": 1.0, "stream": 0.55, "scheduler_2d": 0.9}
    )
    assert pd["parts_switches"] == 0
    assert host["parts_on_fraction"] == dict.fromkeys(issue16.PD_PARTS)
    assert host["parts_switches"] is None
    lines = issue16.table({"device": "x", "runs": 6, "runs_not_started_budget": 0, "points": [p]})
    (line,) = [x for x in lines if "PD's parts on" in x]
    assert "PD route_ahead 1.00 stream 0.55 scheduler_2d 0.90 (0)" in line
    assert "host" not in line


def test_the_summarys_parts_are_the_controllers() -> None:
    from pdflash.engine.pd_controller import PARTS

    assert sorted(issue16.PD_PARTS) == sorted(PARTS)


def test_each_arm_reports_its_controller_warmup() -> None:
    """Runs warmed past the controller's first round (controller_warmup
    first_round): per arm, how many runs' rounds ended, and the median
    bursts and steps; None for an arm whose runs did not warm it (absent, or
    a label without the controller, whose record says None)."""

    def warm(done: bool | None, bursts: int, steps: int) -> dict[str, Any]:
        controller = {"bursts": bursts, "steps": steps, "first_round_done": done, "why": None}
        return {"mode": "workload", "controller": controller}

    rows = [
        _arm_row("PD", 0, 90.0, warmup=warm(True, 2, 40)),
        _arm_row("PD", 1, 91.0, warmup=warm(True, 3, 52)),
        _arm_row("PD", 2, 92.0, warmup=warm(False, 20, 401)),
        _arm_row("host", 0, 100.0, warmup=warm(None, 0, 0)),
        _arm_row("host", 1, 101.0),
    ]
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    assert p["by_arm"]["PD"]["controller_warmup"] == {
        "runs": 3,
        "first_round_done": 2,
        "bursts_median": 3,
        "steps_median": 52,
    }
    assert p["by_arm"]["host"]["controller_warmup"] is None
    lines = issue16.table({"device": "x", "runs": 5, "runs_not_started_budget": 0, "points": [p]})
    (line,) = [x for x in lines if "controller warmed" in x]
    assert "PD 2/3 runs, bursts 3, steps 52" in line and "host" not in line


def test_each_arm_reports_what_its_books_per_step_reads_saw() -> None:
    """The exposed fetch PD's books summed over a run's steps over the run's
    own total, per arm (median over runs; None without books or waits)."""

    def books(exposed: float) -> dict[str, Any]:
        return {"step_sums": {"wall_s": 9.0, "exposed_fetch_s": exposed}}

    rows = [
        _arm_row("PD", 0, 90.0, exposed_fetch_s=2.0, pd_parts=books(0.4)),
        _arm_row("PD", 1, 91.0, exposed_fetch_s=2.0, pd_parts=books(0.6)),
        _arm_row("PD", 2, 92.0, exposed_fetch_s=0.0, pd_parts=books(0.0)),
        _arm_row("host", 0, 100.0, exposed_fetch_s=1.0),
        _arm_row("host", 1, 101.0, exposed_fetch_s=1.0),
    ]
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    assert p["by_arm"]["PD"]["books_exposed_share"] == pytest.approx(0.25)
    assert p["by_arm"]["host"]["books_exposed_share"] is None
    lines = issue16.table({"device": "x", "runs": 5, "runs_not_started_budget": 0, "points": [p]})
    (line,) = [x for x in lines if "per-step reads saw" in x]
    assert "PD 0.25" in line and "host" not in line


def test_each_arm_splits_its_exposed_fetch_and_reads_its_landed_hit_rate() -> None:
    split = {"exposed_fetch_miss_s": 3.0, "exposed_fetch_inflight_s": 1.0}
    rows = [
        _arm_row(
            "PD", 0, 90.0, **split, exposed_fetch_queued_s=0.2, expert_cache_landed_hit_rate=0.5
        ),
        _arm_row(
            "PD", 1, 91.0, **split, exposed_fetch_queued_s=0.4, expert_cache_landed_hit_rate=0.7
        ),
        _arm_row("host", 0, 100.0),  # an older row: no split
    ]
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    pd = p["by_arm"]["PD"]
    assert pd["exposed_miss_share"] == pytest.approx(0.3)
    assert pd["exposed_inflight_share"] == pytest.approx(0.1)
    assert pd["exposed_queued_share"] == pytest.approx(0.03)
    assert pd["landed_hit_rate"] == pytest.approx(0.6)
    assert p["by_arm"]["host"]["exposed_miss_share"] is None
    lines = issue16.table({"device": "x", "runs": 3, "runs_not_started_budget": 0, "points": [p]})
    (line,) = [x for x in lines if "on prefetches in flight" in x]
    assert "PD 0.30 + 0.10 [0.03] (0.60)" in line and "host - + - [-] (-)" in line
    (old,) = issue16.summarise(rows[2:], issue16.parse_arms("host=PD+host"))
    old_lines = issue16.table(
        {"device": "x", "runs": 1, "runs_not_started_budget": 0, "points": [old]}
    )
    assert not any("on prefetches in flight" in x for x in old_lines)


def test_each_arm_reports_its_runs_committed_per_round() -> None:
    """The spread of the runs' acceptance length per arm, so arms that drew
    or verified differently show it beside their tokens/s."""
    rows = [
        _arm_row("PD", 0, 90.0, acceptance_length_mean=4.0),
        _arm_row("PD", 1, 91.0, acceptance_length_mean=5.0),
        _arm_row("PD", 2, 92.0, acceptance_length_mean=4.5),
        _arm_row("host", 0, 100.0),
    ]
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    assert p["by_arm"]["PD"]["acceptance_length"] == {"median": 4.5, "min": 4.0, "max": 5.0}
    assert p["by_arm"]["host"]["acceptance_length"] is None
    lines = issue16.table({"device": "x", "runs": 4, "runs_not_started_budget": 0, "points": [p]})
    (line,) = [x for x in lines if "committed per request round" in x]
    assert "PD 4.50 [4.00, 5.00]" in line and "host" not in line


def test_arm_order_rotates_per_repeat_and_point() -> None:
    arms = issue16.parse_arms("a=PD,b=PD+host,c=PD+host:host_ahead=weighted")

    def names(rep: int, point: int) -> str:
        return "".join(a.name for a in issue16.arm_order(arms, rep, point))

    assert [names(r, 0) for r in range(4)] == ["abc", "bca", "cab", "abc"]
    assert [names(0, p) for p in range(3)] == ["abc", "bca", "cab"]
    # over len(arms) repeats each arm runs in each position once
    for point in range(3):
        orders = [names(r, point) for r in range(3)]
        for pos in range(3):
            assert sorted(o[pos] for o in orders) == ["a", "b", "c"]
    # two arms: they alternate which goes first
    two = issue16.parse_arms("PD,PD+host")
    assert [issue16.arm_order(two, r, 0)[0].name for r in range(3)] == ["PD", "PD+host", "PD"]


def _arm_row(arm: str, rep: int, tps: float, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "arch": "a",
        "cache_fraction": 0.2,
        "concurrency": 4,
        "repeat": rep,
        "arm": arm,
        "baseline": "PD" if arm == "PD" else "PD+host",
        "output_tokens_per_s": tps,
        "expert_nbytes": 100,
        "bytes_per_token": 1000.0 if arm == "PD" else 600.0,
        "wall_s": 10.0,
        "compute_busy_s": 2.0,
        "link_busy_s": 7.0,
    }
    if arm != "PD":
        row["host_busy_s"] = 2.0
        row["host_served_experts"] = 30.0
        row["h2d_bytes"] = 7000.0
        row["host_service"] = {
            "planner": {"ahead": "weighted" if arm == "weighted" else "certain"},
            "ahead_outcome": {"seen": 10, "routed": 7, "hosted": 5},
            "ahead_fraction": {"value": 0.75 if arm == "weighted" else 0.7},
            "host_handoff": {"requested": "thread", "mode": "thread", "reason": None},
            "affinity": {"mode": "off", "applied": False, "reason": None},
        }
    row.update(kw)
    return row


def test_arms_summary_ratios_verdicts_and_books() -> None:
    """Three arms, hand-checked: weighted is 1.2x host each repeat, host is
    1.3, 1.32 and 131/101 = 1.297x PD."""
    rows = []
    for rep, (pd, host) in enumerate(((100.0, 130.0), (100.0, 132.0), (101.0, 131.0))):
        rows += [_arm_row("PD", rep, pd), _arm_row("host", rep, host)]
        rows.append(_arm_row("weighted", rep, host * 1.2))
    arms = issue16.parse_arms("PD,host=PD+host,weighted=PD+host:host_ahead=weighted")
    (p,) = issue16.summarise(rows, arms)
    assert (p["reference_arm"], p["pd_arm"]) == ("host", "PD")
    assert list(p["tokens_per_s"]) == ["PD", "host", "weighted"]
    # every arm vs the reference, then vs PD; PD vs the reference is host/PD reversed
    assert list(p["comparisons"]) == ["weighted/host", "host/PD", "weighted/PD"]
    c = p["comparisons"]
    assert c["weighted/host"]["pair_ratios"] == pytest.approx([1.2, 1.2, 1.2])
    assert c["weighted/host"]["verdict"] == "weighted faster"
    assert c["host/PD"]["pair_ratio_median"] == pytest.approx(1.3)
    assert c["host/PD"]["median_ratio"] == pytest.approx(131 / 100)
    assert c["host/PD"]["verdict"] == "host faster"
    assert c["weighted/PD"]["pair_ratios"] == pytest.approx([1.56, 1.584, 157.2 / 101])
    # the pairs' own interval: a constant 1.2 has none wider than itself
    assert c["weighted/host"]["pair_ratio_ci95"] == pytest.approx([1.2, 1.2])
    lo, hi = c["host/PD"]["pair_ratio_ci95"]
    assert lo < 1.297 < 1.3 < 1.32 < hi
    # the fastest arm of each label: weighted (PD+host) over PD, whatever the reference
    best = p["best_vs_best"]
    assert best["pair"] == "weighted/PD"
    assert best["pair_ratios"] == c["weighted/PD"]["pair_ratios"]
    assert "best PD+host / best PD (weighted/PD): median 1.56" in "\n".join(
        issue16.table({"points": [p]})
    )
    # the legacy fields read the reference arm as PD+host
    assert p["speedup_median"] == pytest.approx(131 / 100)
    assert p["verdict"] == "PD+host faster"
    assert p["bytes_per_token_ratio"] == pytest.approx(0.6)
    assert p["pd_host"]["host_share_of_misses"] == pytest.approx(30 / (30 + 70))
    w = p["by_arm"]["weighted"]
    # host busy 2 s over 30 served experts in each run
    assert w["host_busy_ms_per_expert"] == pytest.approx(2000 / 30)
    assert w["host_busy_ms_per_expert_by_repeat"] == pytest.approx([2000 / 30] * 3)
    assert p["by_arm"]["PD"]["host_busy_ms_per_expert"] is None
    # no graphs: no run's clock holds a capture, and the table says nothing of it
    assert w["runs_with_captures_in_run"] == 0
    assert "captures in their clock" not in "\n".join(issue16.table({"points": [p]}))
    # a PD run that recorded pieces (16) and drafter graphs (2) inside its clock
    captured = [dict(r) for r in rows]
    captured[0]["cuda_graphs"] = {"captures_in_run": 16, "draft_captures_in_run": 2}
    (q,) = issue16.summarise(captured, arms)
    assert q["by_arm"]["PD"]["runs_with_captures_in_run"] == 1
    assert "runs with CUDA-graph captures in their clock: PD 1/3" in "\n".join(
        issue16.table({"points": [q]})
    )
    assert "host busy ms/expert 66.67 by repeat [66.67, 66.67, 66.67]" in "\n".join(
        issue16.table({"points": [p]})
    )
    assert w["ahead_outcome"] == {"seen": 30, "routed": 21, "hosted": 15}
    assert w["ahead_fraction_end"] == [0.75, 0.75, 0.75]
    assert w["host_ahead"] == ["weighted"]
    assert w["busy_fraction"]["link"] == pytest.approx(0.7)
    assert w["busy_fraction"]["host_cpu"] == pytest.approx(0.2)
    assert w["handoff"] == {"requested": ["thread"], "ran": {"thread": 3}, "fallback_reasons": []}
    assert w["affinity"] == {"mode": ["off"], "applied_runs": 0, "reasons": []}
    # PD has no host service: its host books are absent, not 0
    pd = p["by_arm"]["PD"]
    assert pd["busy_fraction"]["host_cpu"] is None
    assert pd["host_service_runs"] == 0
    assert pd["ahead_outcome"] is None and pd["handoff"] is None
    lines = issue16.table({"device": "x", "runs": 9, "runs_not_started_budget": 0, "points": [p]})
    assert any("weighted/host: median 1.20 (weighted faster)" in line for line in lines)


def test_arms_summary_reference_handoff_fallback_and_affinity() -> None:
    svc = {
        "host_handoff": {"requested": "stream", "mode": "thread", "reason": "no cuda"},
        "affinity": {"mode": "auto", "applied": True, "reason": None},
    }
    rows = [
        _arm_row("host", 0, 100.0),
        _arm_row("stream", 0, 90.0, host_service=svc),
        _arm_row("host", 1, 100.0),
        _arm_row(
            "stream",
            1,
            99.0,
            host_service={**svc, "host_handoff": {"requested": "stream", "mode": "stream"}},
        ),
    ]
    arms = issue16.parse_arms("host=PD+host,stream=PD+host:host_handoff=stream")
    (p,) = issue16.summarise(rows, arms, reference="stream")
    # no PD arm: only the comparison with the reference, no legacy verdict
    assert list(p["comparisons"]) == ["host/stream"]
    assert p["comparisons"]["host/stream"]["pair_ratios"] == pytest.approx([100 / 90, 100 / 99])
    assert "verdict" not in p and "speedup_median" not in p
    s = p["by_arm"]["stream"]
    assert s["handoff"] == {
        "requested": ["stream"],
        "ran": {"thread": 1, "stream": 1},
        "fallback_reasons": ["no cuda"],
    }
    assert s["affinity"] == {"mode": ["auto"], "applied_runs": 2, "reasons": []}
    # one run per arm: a ratio, no verdict
    (q,) = issue16.summarise(rows[:2], arms)
    assert q["comparisons"]["stream/host"]["verdict"] == "too few runs"
    assert q["comparisons"]["stream/host"]["pair_ratios"] == pytest.approx([0.9])


def test_arms_summary_counts_the_planners_reasons() -> None:
    """Each arm's planner rule, which copies its ahead plans split, the
    lookahead layers split and its decisions by reason, summed over the arm's
    runs; a run whose planner counts none adds nothing (absent, not 0). A row
    recorded under a removed rule (``queue``) still reads as that rule."""
    counts = {"layers": 10, "probes": 1, "split": 4, "copy_hidden": 5, "copy_margin": 1}
    counts |= {"ahead_layers": 8, "ahead_split": 2, "ahead_copy_hidden": 6}
    split = {
        "planner": {"ahead": "certain"},
        "planner_decisions": counts,
        "ahead_from": "stream",
        "lookahead_split": {"layers": 3, "planned": 5},
    }
    old = {"planner": {"ahead": "certain", "rule": "queue"}}
    rows = [
        _arm_row("host", 0, 100.0),  # a planner that records no rule: makespan
        _arm_row("split", 0, 110.0, host_service=split),
        _arm_row("host", 1, 100.0, host_service=old),
        _arm_row("split", 1, 111.0, host_service=split),
    ]
    arms = issue16.parse_arms("host=PD+host,split=PD+host:host_ahead_from=stream")
    (p,) = issue16.summarise(rows, arms)
    q, h = p["by_arm"]["split"], p["by_arm"]["host"]
    assert q["host_plan"] == ["makespan"] and h["host_plan"] == ["makespan", "queue"]
    assert q["host_ahead_from"] == ["stream"] and h["host_ahead_from"] == ["predicted"]
    assert q["lookahead_split"] == {"layers": 6, "planned": 10}
    assert h["lookahead_split"] == {"layers": 0, "planned": 0}
    assert q["plan_reasons"] == {
        "runs": 2,
        "part": "whole_run",
        **{k: 2 * v for k, v in counts.items()},
    }
    assert h["plan_reasons"] is None
    # rows that keep the measured part's decisions are counted by those
    measured = {**split, "planner_decisions_measured": {"layers": 3, "split": 1}}
    rows_m = [_arm_row("split", i, 110.0, host_service=measured) for i in range(2)]
    (pm,) = issue16.summarise(rows_m, arms)
    assert pm["by_arm"]["split"]["plan_reasons"] == {
        "runs": 2,
        "part": "measured",
        "layers": 6,
        "split": 2,
    }
    lines = issue16.table({"device": "x", "runs": 4, "runs_not_started_budget": 0, "points": [p]})
    assert any(
        # rows older than host_control and without the controller's books
        "plan ['makespan'] from ['stream'] gate - host-part ['controller'] on - "
        "lookahead-split {'layers': 6, 'planned': 10}: "
        "layers 20 [split=8 copy_hidden=10 copy_margin=2 probes=2] "
        "ahead layers 16 [split=4 copy_hidden=12] (2 runs, whole_run)" in line
        for line in lines
    )
    assert any("plan ['makespan', 'queue'] from ['predicted']" in line for line in lines)
    assert any("not counted" in line for line in lines)


def test_arms_summary_sums_the_pre_verify_gate() -> None:
    """Each host arm's pre-verify gate: the settings its runs recorded and
    the verifies the gate opened / closed, summed; a row older than the
    record adds nothing (``runs`` counts those that recorded it); an arm
    with no host service has none."""
    rows = [
        _arm_row("PD", 0, 90.0),
        _arm_row("host", 0, 100.0, host_ahead_gate={"min_exposed": 0.2, "open": 2, "closed": 9}),
        _arm_row("host", 1, 100.0),  # recorded before the gate was
        _arm_row("open", 0, 104.0, host_ahead_gate={"min_exposed": 0.0, "open": 11, "closed": 0}),
        _arm_row("open", 1, 105.0, host_ahead_gate={"min_exposed": 0.0, "open": 12, "closed": 0}),
    ]
    arms = issue16.parse_arms("PD,host=PD+host,open=PD+host:host_ahead_min_exposed=0")
    (p,) = issue16.summarise(rows, arms)
    assert p["by_arm"]["PD"]["ahead_gate"] is None
    host, gate_open = p["by_arm"]["host"]["ahead_gate"], p["by_arm"]["open"]["ahead_gate"]
    assert host == {"runs": 1, "min_exposed": [0.2], "open": 2, "closed": 9}
    assert gate_open == {"runs": 2, "min_exposed": [0.0], "open": 23, "closed": 0}
    lines = issue16.table({"device": "x", "runs": 5, "runs_not_started_budget": 0, "points": [p]})
    assert any("from ['predicted'] gate >=0.2 2/9 " in line for line in lines)
    assert any("from ['predicted'] gate >=0 23/0 " in line for line in lines)


def test_the_host_on_arm_is_checked_and_its_host_part_summarised() -> None:
    """The hoston A/B's arms (bench/h200/hoston_ab.sh): accepted, a host
    control on an arm without a host service refused; per host arm the host
    control its runs recorded (rows older than the setting: the controller)
    and the median share of measured steps its host part ran in."""
    text = "PD,host=PD+host,hoston=PD+host:host_control=always"
    arms = issue16.parse_arms(text)
    assert arms[2].overrides() == {"host_control": "always"}
    issue16.check_arms(arms, {"layers": None}, ["tiny-gpt_oss"])
    with pytest.raises(ValueError, match="host_control cannot apply to baseline PD"):
        issue16.check_arms(
            issue16.parse_arms("PD,x=PD:host_control=always"), {"layers": None}, ["tiny-gpt_oss"]
        )

    def parts(on: float) -> dict[str, Any]:
        return {"on_fraction": {"host_experts": on, "stream": 1.0}}

    rows = [
        _arm_row("PD", 0, 90.0),
        _arm_row("host", 0, 100.0, pd_parts=parts(0.4)),  # recorded before the setting
        _arm_row("host", 1, 101.0, pd_parts=parts(0.6), host_control="controller"),
        _arm_row("hoston", 0, 120.0, pd_parts=parts(1.0), host_control="always"),
        _arm_row("hoston", 1, 121.0, pd_parts=parts(1.0), host_control="always"),
    ]
    (p,) = issue16.summarise(rows, arms)
    by = p["by_arm"]
    assert (by["PD"]["host_control"], by["PD"]["host_part_on_fraction"]) == (None, None)
    assert by["host"]["host_control"] == ["controller"]
    assert by["host"]["host_part_on_fraction"] == pytest.approx(0.5)
    assert (by["hoston"]["host_control"], by["hoston"]["host_part_on_fraction"]) == (
        ["always"],
        1.0,
    )
    assert list(p["comparisons"]) == ["hoston/host", "host/PD", "hoston/PD"]
    lines = issue16.table({"device": "x", "runs": 5, "runs_not_started_budget": 0, "points": [p]})
    assert any("host-part ['always'] on 1.00 " in line for line in lines)
    assert any("host-part ['controller'] on 0.50 " in line for line in lines)


def test_rows_without_arm_group_by_baseline() -> None:
    """Rows written before --arms (no ``arm``) are their baseline's arm: the
    default summary is today's."""
    rows = [_row("PD", t, repeat=i) for i, t in enumerate((10.0, 11.0, 12.0))]
    rows += [_row("PD+host", t, repeat=i) for i, t in enumerate((20.0, 21.0, 22.0))]
    (p,) = issue16.summarise(rows)
    assert list(p["tokens_per_s"]) == ["PD", "PD+host"]
    assert list(p["comparisons"]) == ["PD+host/PD"]
    c = p["comparisons"]["PD+host/PD"]
    assert c["pair_ratios"] == pytest.approx([2.0, 21 / 11, 22 / 12])
    assert c["verdict"] == "PD+host faster" == p["verdict"]
    # rows that record no repeat: intervals and verdicts, no pairs
    for r in rows:
        del r["repeat"]
    (q,) = issue16.summarise(rows)
    assert q["comparisons"]["PD+host/PD"]["pair_ratios"] == []
    assert q["comparisons"]["PD+host/PD"]["pair_ratio_median"] is None
    assert q["verdict"] == "PD+host faster"


def test_the_table_counts_the_queued_copies_an_arm_hosted() -> None:
    rows = [_arm_row("PD", 0, 90.0), _arm_row("q", 0, 100.0), _arm_row("q", 1, 101.0)]
    for r, n in zip(rows[1:], (3, 5), strict=True):
        r["host_service"] = {**r["host_service"], "queued_hosted": n}
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,q=PD+host:host_queued=true"))
    assert p["by_arm"]["q"]["queued_hosted"] == 4 and p["by_arm"]["PD"]["queued_hosted"] is None
    lines = issue16.table({"device": "x", "runs": 3, "runs_not_started_budget": 0, "points": [p]})
    assert any("host busy ms/expert" in x and x.endswith("queued-hosted 4") for x in lines)


def test_the_table_says_how_much_each_run_measured() -> None:
    """A run of a few steps gives a noisy rate: the table prints each arm's
    measured steps (median [min-max]) and wall; rows without steps, no line."""
    rows = [
        _arm_row("PD", 0, 90.0, steps=5, wall_s=0.2),
        _arm_row("PD", 1, 91.0, steps=9, wall_s=0.5),
        _arm_row("PD", 2, 92.0, steps=7, wall_s=0.3),
        _arm_row("host", 0, 100.0, steps=7, wall_s=0.3),
    ]
    (p,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    assert p["by_arm"]["PD"]["measured_steps"] == {"median": 7, "min": 5, "max": 9}
    lines = issue16.table({"device": "x", "runs": 4, "runs_not_started_budget": 0, "points": [p]})
    (line,) = [x for x in lines if x.startswith("  measured a run")]
    assert (
        line == "  measured a run (median): PD 7 steps [5-9] (0.30 s); host 7 steps [7-7] (0.30 s)"
    )
    for r in rows:
        del r["steps"]
    (q,) = issue16.summarise(rows, issue16.parse_arms("PD,host=PD+host"))
    lines = issue16.table({"device": "x", "runs": 4, "runs_not_started_budget": 0, "points": [q]})
    assert not any(x.startswith("  measured a run") for x in lines)


def test_verdicts_read_the_pairs_where_repeats_pair() -> None:
    """Interleaved repeats that drift together: the arms' intervals overlap,
    the pairs' ratios do not straddle 1, and the verdict reads the pairs
    (the rule the results READMEs state); without repeats it reads the arms."""
    pd = (10.0, 15.0, 20.0)
    rows = [_row("PD", t, repeat=i) for i, t in enumerate(pd)]
    rows += [
        _row("PD+host", t * r, repeat=i)
        for i, (t, r) in enumerate(zip(pd, (0.8, 0.82, 0.79), strict=True))
    ]
    (p,) = issue16.summarise(rows)
    c = p["comparisons"]["PD+host/PD"]
    assert c["pair_ratio_ci95"][1] < 1 and c["verdict_from"] == "pairs"
    assert c["verdict"] == "PD+host slower" == p["verdict"]
    # the same runs judged by the arms' intervals (no repeats to pair): within noise
    for r in rows:
        del r["repeat"]
    (q,) = issue16.summarise(rows)
    assert q["comparisons"]["PD+host/PD"]["verdict_from"] == "arms"
    assert q["comparisons"]["PD+host/PD"]["verdict"] == "within noise" == q["verdict"]
    # pairs that straddle 1: within noise whatever the medians say
    rows = [_row("PD", t, repeat=i) for i, t in enumerate(pd)]
    rows += [
        _row("PD+host", t * r, repeat=i)
        for i, (t, r) in enumerate(zip(pd, (0.7, 1.2, 0.9), strict=True))
    ]
    (s,) = issue16.summarise(rows)
    assert s["comparisons"]["PD+host/PD"]["verdict"] == "within noise" == s["verdict"]


def test_smoke_five_arms_on_the_tiny_cpu_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One process, every arm interleaved, on the tiny gpt-oss shape (CPU):
    rows carry their arm, the stream arm records its fallback to the
    thread hand-off, the summary judges every arm."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["--archs", "tiny-gpt_oss", "--layers", "0", "--points", "0.5:2", "--repeats", "2"]
    argv += ["--max-new-tokens", "4", "--host-threads", "1", "--budget-s", "300"]
    rc = issue16.main([*argv, "--arms", _FIVE, "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in rows] == [
        "PD", "host", "stream", "noaffinity", "weighted",
        "host", "stream", "noaffinity", "weighted", "PD",
    ]  # fmt: skip
    assert {r["arm"]: r["arm_settings"] for r in rows}["stream"] == {"host_handoff": "stream"}
    summary = json.loads((out / "summary.json").read_text())
    assert [a["name"] for a in summary["arms"]] == [
        "PD",
        "host",
        "stream",
        "noaffinity",
        "weighted",
    ]
    # the settings every arm shares, as the command line gave them
    assert (summary["host_handoff"], summary["host_ahead"], summary["host_threads"]) == (
        "thread",
        "certain",
        1,
    )
    (p,) = summary["points"]
    assert {k: v["n"] for k, v in p["tokens_per_s"].items()} == dict.fromkeys(
        ["PD", "host", "stream", "noaffinity", "weighted"], 2
    )
    assert len(p["comparisons"]) == 7
    stream = p["by_arm"]["stream"]
    # a CPU run cannot wait on the device: it ran the thread hand-off, saying why
    assert stream["handoff"]["requested"] == ["stream"]
    assert stream["handoff"]["ran"] == {"thread": 2}
    assert stream["handoff"]["fallback_reasons"]
    # auto is the default: the reference arm asked for it, the override for off
    assert p["by_arm"]["host"]["affinity"]["mode"] == ["auto"]
    assert p["by_arm"]["noaffinity"]["affinity"]["mode"] == ["off"]
    assert p["by_arm"]["weighted"]["host_ahead"] == ["weighted"]
    assert p["by_arm"]["host"]["host_ahead"] == ["certain"]
    assert "issue16 arms: cpu" in capsys.readouterr().err


def test_arms_replay_a_trace_in_a_closed_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--trace`` replays the committed proxy trace's learned routing and
    acceptance under every arm (so a run setting is A/B'd on learned
    routing, interleaved), and ``--closed N`` runs N requests per client."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path / "cache"))
    trace = (
        Path(__file__).resolve().parents[2]
        / "bench/results/h200/proxy-balanced-2026-12-01/trace_gpu_t1.npz"
    )
    out = tmp_path / "out"
    argv = ["--archs", "tiny-gpt_oss", "--layers", "0", "--points", "0.5:1", "--repeats", "1"]
    argv += ["--max-new-tokens", "4", "--host-threads", "1", "--budget-s", "300"]
    argv += ["--trace", str(trace), "--closed", "2", "--arms", "PD,deep=PD:stream_ahead=8"]
    assert issue16.main([*argv, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in rows) == ["PD", "deep"]
    for row in rows:
        assert (row["routing_source"], row["acceptance_source"]) == ("trace", "trace")
        assert row["num_requests"] == 2 and row["concurrency"] == 1
    assert {r["arm"]: r["stream_ahead"] for r in rows} == {"PD": 2, "deep": 8}
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["trace"], summary["closed_requests_per_client"]) == (str(trace), 2)
    with pytest.raises(SystemExit):
        issue16.main([*argv[:-4], "--closed", "0", "--out", str(out)])
