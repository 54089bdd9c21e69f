"""The PD controller's host gate (``host_gate``): a host part that runs
where the forwards barely wait for expert copies (a compute-bound step) is
switched off by its probe's first pair, and later rounds keep it off with no
probe; where they wait (the link binds) its must-earn probes judge it as
without the gate, and a part off is switched back on once the link binds
(simulated steps). The gated part's start (off, the gate's first decision)
is tested in ``test_pd_controller_host_start.py``; here the part starts on
where a test says so (``initial=WITH_HOST``)."""

from __future__ import annotations

import pytest

from pdflash.engine.pd_controller import (
    HOST_GATE_EXPOSED,
    HOST_PART,
    PDController,
)

from .test_pd_controller_host_start import simulate
from .test_pd_controller_stances import WITH_HOST


def _run(
    ctl: PDController, *, exposed: float, host_factor: float, steps: int, seed: int = 0
) -> list[bool]:
    """Steps of 50 ms (x ``host_factor`` with the host on) whose forwards
    waited ``exposed`` of the wall for copies with the host off (none with
    it on); 5% noise on the wall. Returns the host part's state per step."""
    return simulate(
        ctl, exposed=exposed, host_factor=host_factor, steps=steps, seed=seed, share_noise=0.0
    )


def _host_decisions(ctl: PDController) -> list[dict[str, object]]:
    return [d for d in ctl.summary()["decisions"] if d["part"] == HOST_PART]


@pytest.mark.parametrize("seed", range(3))
def test_a_compute_bound_run_switches_a_running_host_off_after_one_pair(seed: int) -> None:
    """Started on, where the forwards wait 5% of the step for copies: the
    host part's probe ends after its first pair (off), and every later round
    keeps it off with no probe: on only in the warm-up and that pair's on
    step."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, initial=WITH_HOST)
    on = _run(ctl, exposed=0.05, host_factor=1.15, steps=120, seed=seed)
    # the warm-up (2), the settle step, the pair's on step
    assert sum(on) <= ctl.warmup + ctl.settle + 1 and not any(on[8:])
    first, *later = _host_decisions(ctl)
    assert first["switched"] and first["on"] is False
    assert "gated" in str(first["why"]) and "0.05" in str(first["why"])
    assert later and all(not d["switched"] and d["on"] is False for d in later)
    assert all("gated" in str(d["why"]) for d in later)
    s = ctl.summary()
    assert s["on_fraction"][HOST_PART] < 0.05 and s["settings"]["host_gate"] == HOST_GATE_EXPOSED
    # PD's own parts are still probed
    assert any(d["part"] != HOST_PART for d in s["decisions"])


def test_without_the_gate_the_same_run_probes_the_host() -> None:
    """The same compute-bound steps, no gate: the probe's host-on steps run
    on (what the gate's probe saves in a short run, the host started on)."""
    gated = _run(
        PDController(host_gate=HOST_GATE_EXPOSED, initial=WITH_HOST),
        exposed=0.05,
        host_factor=1.15,
        steps=20,
    )
    plain = _run(PDController(), exposed=0.05, host_factor=1.15, steps=20)
    assert sum(gated) <= 4 and sum(plain) >= 2 * sum(gated)


@pytest.mark.parametrize("seed", range(3))
def test_a_link_bound_run_switches_the_host_on_and_keeps_it_where_it_pays(seed: int) -> None:
    """The forwards wait 40% of the step for copies with the host off and
    the host makes the step 25% shorter: the gate switches it on after two
    measured steps, lets its probes run, and they keep it."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED)
    on = _run(ctl, exposed=0.4, host_factor=0.75, steps=150, seed=seed)
    first, *later = _host_decisions(ctl)
    assert first["switched"] and first["on"] is True and "the link binds" in str(first["why"])
    # on from the third step (a probe's host-off steps aside), never switched off
    assert later and all("must earn" in str(d["why"]) for d in later)
    assert not any(d["switched"] and d["on"] is False for d in _host_decisions(ctl))
    assert sum(on) > 0.75 * len(on)


def test_a_link_bound_host_that_costs_is_still_switched_off_by_its_probe() -> None:
    """The link binds but the host makes the step 40% longer: the gate
    switches it on, its first must-earn probe switches it off, and the next
    round's gate switches it back on (the link binds) for the probe after to
    judge again."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, hold=4, max_hold=8)
    _run(ctl, exposed=0.4, host_factor=1.4, steps=120)
    decisions = [d for d in _host_decisions(ctl) if d["switched"]]
    assert [d["on"] for d in decisions[:3]] == [True, False, True]
    assert "must-earn" in str(decisions[1]["why"])
    assert all("the link binds" in str(d["why"]) for d in (decisions[0], decisions[2]))


def test_a_host_part_started_off_is_gated_without_a_probe() -> None:
    """Started off (``initial`` with the host off, as the gate's default):
    compute-bound, it never runs; link-bound, the gate switches it on right
    after the warm-up."""
    from pdflash.engine.pd_controller import ALL_ON

    ctl = PDController(host_gate=HOST_GATE_EXPOSED, initial=ALL_ON)
    assert not any(_run(ctl, exposed=0.05, host_factor=1.15, steps=60))
    assert all(not d["switched"] for d in _host_decisions(ctl))
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, initial=ALL_ON)
    on = _run(ctl, exposed=0.4, host_factor=0.75, steps=60)
    first = _host_decisions(ctl)[0]
    assert first["switched"] and first["on"] is True and "the link binds" in str(first["why"])
    assert on.index(True) <= ctl.warmup + ctl.settle


def test_the_gate_checks_its_value() -> None:
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="host_gate"):
            PDController(host_gate=bad)
