"""Switching PD's machinery off where it does not pay (issue 14's rule).

PD's parts — route-ahead prediction, the 2-D verify scheduler and the
streaming prefetcher — cost host time and can move bytes that go unused; on
some workloads they cost more than the copies they hide. A
:class:`PartsPolicy` is fed one :class:`StepMeasurement` per engine step and
answers which parts run in the next step (:class:`PartsState`).

:class:`PDController` decides by paired-step probes and a sequential test,
so that the first part's decision fits in about 20 steps of a short run
(the warm-up and at most ``max_pairs`` pairs with their settle steps; about
40 where an extension runs; the other parts follow, one probe each). After a warm-up
it probes one part at a time: its measured steps alternate between the
configuration (arm A) and the configuration with that part flipped (arm B),
in pairs ordered AB, BA, AB, ... (a trend over the probe, such as requests
finishing, cancels), with ``settle`` unmeasured steps after every change.
After ``min_pairs`` pairs and after each further one, up to ``max_pairs``
(then every ``min_pairs`` pairs of an extension, below), it tests
per-pair statistics, one-sided, by Student's t, by the part's **stance**
(below: PD's own parts are ``default_on``, the host service
``must_earn``). A default-on part is judged by two:

* the **rate**: ``log(rate_B / rate_A)``, the tokens per second of the
  flipped step over the configured one: by default the tokens the step is
  expected to commit (``rate_of``, below); it votes to flip when the mean
  exceeds ``margin`` and is above 0 at the look's level;
* for the prefetching parts (route-ahead, the stream), the **books**: the
  host seconds of the prefetch machinery with the part, less those without
  it (:attr:`StepMeasurement.books_host_s`: every prefetch stage the part
  changes, the forward hooks of whichever prefetcher runs included), plus
  the exposed fetch seconds with it, less those without it, over the
  pair's mean step wall (its net cost as a share of the step; the host
  seconds are measured, not modeled, so this is far less noisy than the
  wall); it votes to switch the part off
  when that share exceeds ``margin`` (on, when it falls below ``-margin``)
  at the look's level, unless the rate points the other way (its mean
  below ``-margin``: the books are a proxy, and a wait the device's events
  do not see, such as the forward's thread blocked on a copy, is no exposed
  fetch in them; on the H200, in a benchmark warm-up whose settled cache
  waited for copies on the host, they voted the stream off in probes whose
  rate read it 26-31% faster); and the rate does not flip a prefetching part
  whose books point the other way (their mean below ``-margin``).

For a default-on part a vote flips the part at once. The levels are Bonferroni shares of
``alpha`` over the looks and the rules, so a part that changes nothing is
switched by a probe with probability at most ``alpha`` (0.05 by default,
for Gaussian per-step noise; the tests measure it under the heavy-tailed
noise of a loaded CPU). A probe ends early, without a switch, once every
rule's one-sided upper confidence bound is below ``margin`` (nothing worth
a switch to find), and without a switch at ``max_pairs`` — unless a
statistic points to a flip there (mean above ``margin``, unadjusted p below
``alpha``): then it runs ``extend_pairs`` more pairs, pooled with the first
(the extension's looks are counted in the Bonferroni shares whether or not
a probe is extended). After every part
was probed the configuration holds for ``hold`` measured steps and the
parts are probed again (the hold doubles after each round that switched
nothing, up to ``max_hold``: a steady workload pays for fewer probes and
false switches), so a part switched off is switched back on when the
workload shifts; switching a part back needs another significant probe
the other way. Steps that prefilled new requests and the ``settle`` steps
after each change are not measured (their wall time is not the parts').
Every decision carries its numbers (``why``).

**The probe budget.** A probe's flipped arm loses time where the part
pays, and that loss is the controller's own cost. After a round that
switched nothing (after a switch the normal hold re-checks soon, so a
false switch does not last) the hold is at least long enough, ``max_hold``
notwithstanding, that the round's estimated loss is at most
``probe_budget`` (0.05) of the round's steps and the hold's. A probe's
loss is its steps in its flipped arm (settle steps too) times the extra
time a flipped step took for its tokens,
``rate configured / rate flipped - 1``, at one standard error above its
pairs' mean gain (noise alone charges little), 0 where the flip did not
lose. A part that clearly pays is thus re-probed rarely (a round whose
probes lost 10 steps' worth waits about 200 steps); parts that change
nothing charge little and keep the doubling hold. The summary's
``probe_loss_steps`` adds the charges up. The budget bounds the probes'
cost in long runs only: a fresh controller's first round runs in full
whatever it costs.

**Stances.** The rule above puts the burden of proof on switching a part
off: a ``default_on`` part stays as it is unless a probe shows the flip
better, so a part that changes nothing keeps its state (switched with
probability at most ``alpha`` a probe). That suits PD's own parts, which
are the design and cost little where they do not pay. A costly optional
part is ``must_earn`` (:data:`DEFAULT_STANCES`: the host service): the
burden of proof is on the part, which runs only while its probes show it
better. Its statistic is the rate's, as the part's gain ``g = log(rate
with it / rate without it)`` per pair (the same pairs, AB/BA, settle steps
and hold; no books rule, no extension), tested after ``min_pairs`` ..
``max_pairs`` pairs (:func:`must_earn_verdict`):

* before the last look the probe ends once either direction is shown at a
  Bonferroni share of ``alpha`` over those looks (a clear gain: on; a clear
  loss: off; no margin);
* at the last look (``max_pairs``) the part is **on only if its gain is
  shown at** ``earn_level`` (0.2 by default: the one-sided t test's p below
  0.2, i.e. the mean gain above about 0.92 standard errors at 6 pairs);
  otherwise off, whatever its state before.

The verdict is the same whether the probe started with the part on or off
(a switch either way needs only that probe). Its error rates, for Gaussian
per-pair noise: a must-earn part that changes nothing, or costs, is left
(or switched) on by a probe with probability at most ``earn_level +
alpha`` (0.25 by default: the last look's test at ``earn_level`` plus the
early looks' shares of ``alpha``) and is switched off otherwise — a part
that changes nothing is switched off with probability at least ``1 -
earn_level - alpha``, **the intended bias**: costly machinery that shows no
gain does not run. A must-earn part that pays is switched off early (a
loss shown) with probability at most ``alpha``; at the last look it stays
on with the test's power, which needs its gain to stand out of the
per-pair noise (about 0.92 standard errors at 6 pairs); a gain that does
not is left off until a later probe shows it (the part then runs only in
the re-probes' steps that carry it).

The rate is the user-visible one, committed tokens per second, but
without the acceptance draw's noise: a step's **expected committed tokens**
are ``Σ_i (1 + Σ_{j<=k_i} S_i(j))`` over the requests it verified, ``k_i``
the drafts verified and ``S_i(j)`` the request's estimated probability that
its first ``j`` drafts are accepted (a
:class:`~pdflash.engine.verify_width.SurvivalEstimator` of the engine side,
updated after each step from the verify's outcomes, so a step is valued by
the estimate from before its own draw). No part changes what a draft would
be accepted at, only which drafts are verified in which step, so this is
the realized committed tokens' expectation given the step's batch: a part
that verifies fewer drafts is charged exactly the drafts' expected
acceptance, not their count. Verified tokens (``rate_of="verified"``)
overstate the cost of a scheduler that trims grants (the trimmed drafts are
the least likely to be accepted); realized committed tokens
(``rate_of="committed"``) are unbiased but carry the acceptance draw, which
at one request a step is about as large as the effects the probe looks
for. A measurement without the expectation (``None``) counts its realized
committed tokens.

The controller does not judge the verify width: its rates compare steps
whose widths the width policy chose alike, and the width policy
(:mod:`pdflash.engine.verify_width`) maximizes committed tokens per second
by itself.

Switching a part changes only timing and copies, never tokens: route-ahead
and streaming only prefetch, and the token-only and 2-D schedulers both
grant whole blocks under the same token budget, whose greedy outputs are
the target's greedy tokens whatever the batch (checked by
``tests/engine/test_pd_controller.py``).

The policy is deterministic given its measurements (no clock of its own):
the engine measures (:func:`measure_step`), the policy decides.

Engine side (:func:`attach`, :func:`before_step`, :func:`after_step`): a part
can be switched only if the engine was built with it (a predictor, a
streaming prefetcher, a :class:`~pdflash.engine.batching.ShadowComparison`
batcher whose shadow is the token-only scheduler, a hybrid miss service);
parts it lacks stay off and are never probed.

The hybrid miss service (``PD+host``, :mod:`pdflash.hybrid`) is a part too,
``host_experts`` (:data:`HOST_PART`): probed before PD's own parts, must
earn its place (its stance, above) and is judged by the rate alone (where
hosting costs, it costs the forward thread's time, which no part's books
separate); switched off, every miss is copied and nothing is planned for
the host (``HostExpertService.enabled``). Its planner already copies where
the copies hide behind the forward; the part is the net for what the
planner's model does not see. ``summary()["settings"]`` lists each part's
stance and ``earn_level``, so every row says which rule judged it.

**The host gate** (``host_gate``; the engine's controller sets
:data:`HOST_GATE_EXPOSED`): the host can only save what the forwards wait
for expert copies. The controller keeps the share of each measured step's
wall that the forwards waited for copies (``exposed_fetch_s / wall_s``)
over the steps that ran with the host part off.

With a gate, the host part **starts off** (unless ``initial`` or
``host_control``, below, says otherwise) and only the gate's rule switches it on: once
``host_gate_steps`` measured steps ran with it off
(:data:`HOST_GATE_FIRST_STEPS`, 2, by default), the median share over them
decides, at or above the gate switched on (the link binds: the host may
pay), below it kept off. No host-on step runs before that decision, so a
compute-bound run never runs the host, not even for a probe, and a
link-bound one runs it from its third measured step (the settle step after
the switch runs it too). Steps that are not measured (those that prefilled
new requests, settle steps) run with the part as it stands and add no
sample; a run with fewer measured steps than ``host_gate_steps`` never runs
the host. The first round of probes waits for this decision (a warm-up
shorter than ``host_gate_steps`` delays PD's first probes that much), skips
the host part (decided) and probes PD's parts as usual.

From the next round on the host part is judged as follows. While it runs,
by its must-earn probe, which ends after its first pair, the part switched
off, where the median share over the probe's host-off steps is below the
gate (a compute-bound step: the copies hide behind the forward; a
must-earn probe would need 3-6 pairs, more steps than a short run has, and
half of them with the host on). While it is off, at its turn, by the gate's
rule over the latest :data:`HOST_GATE_WINDOW` host-off steps: below the
gate kept off with no probe; at or above, switched on and probed from the
next round. Without a gate the host part starts on (where the engine has
it) and its must-earn probes judge it from the first round.

**The gate's watch.** A share read early can mislead: the first steps can
be unlike the run's later ones (on the H200 at c=4, 0.05-0.08 of the step
in a benchmark warm-up whose settled cache hid the waits, against 0.2-0.8
in the measured runs; a prefill that just copied the requests' experts in
may also leave the next steps little to wait for). So while the host part is off by the
gate's reading (its first decision, its turn or its probe's, not a
must-earn verdict), the gate re-reads the latest ``host_gate_steps``
host-off steps, as its first decision does, outside probes (between two
probes, and at every measured step of a hold) and switches the part on
where their median is at or above the gate; a must-earn probe's verdict
ends the watch (the part is then judged by its probes, as above).

**The route-ahead gate** (``route_ahead_gate``; the engine's controller
sets :data:`ROUTE_AHEAD_GATE_PRECISION` unless
:attr:`~pdflash.engine.config.EngineConfig.route_ahead_gate` is ``off``):
route-ahead pays only where its copies are mostly right. A predicted copy
the verify routes saves at most one copy's wait; one it does not route
costs one copy's link time and the slot it takes. Each step reports the
(layer, expert) pairs its batch's predictions named (the union over its
requests) and how many of them the verify routed
(``route_ahead_predicted``, ``route_ahead_hits``); the controller keeps the
latest :data:`ROUTE_AHEAD_GATE_WINDOW` steps that had predictions, and their
**batch precision** is hits over named. Its probes cannot see route-ahead's
cost where one request runs (per-pair noise several times the effect),
which the precision shows from the first steps. Where the engine has a
hybrid miss service (the host part) the gate does not act: the host
planner plans the host's experts from route-ahead's predictions too, so
their worth is not only their copies'.

Once ``route_ahead_gate_steps`` steps with predictions ran (or, with none,
twice that many measured steps), the gate's **first decision**: precision
below the gate switches route-ahead off (and the stream with it), and the
first round skips its probe; at or above, it stays on. The first round of
probes waits for this decision. From then on, route-ahead **must earn** its
place (the host part's rule, above; while it is off, its turn starts with
the opt-in shadow check, below) while it is off by the gate or by a
must-earn verdict, and while the window's precision is below the gate;
otherwise it is judged as a default-on part. A must-earn probe's on-arm
steps refill the window. While route-ahead runs on the first decision's
reading (no probe of route-ahead has switched it since), the gate **keeps
watching**: outside probes (between two, and at every measured step of a
hold) a full window whose precision fell below the gate switches it off,
as the first decision would have (a workload whose predictions start
precise and then stop being so; a probe cannot see the cost at c=1). Once
a probe of route-ahead has switched it, its probes judge it. ``summary()``
gives the window's precision (``route_ahead_precision``) and ``settings``
the gate.

**The gate's cost bound** (``route_ahead_cost_gate``; the engine's
controller sets it where
:attr:`~pdflash.engine.config.EngineConfig.route_ahead_gate` is
``precision_cost``, the default): precision alone says nothing of what a
right copy is worth. A predicted expert the verify routes saves at most one
copy's link time (its copy, or its miss avoided by protecting it), so over
the window route-ahead saves at most its hits times one expert's copy time
(the expert's bytes at the issuer's measured link rate), whatever its
copies' timing. Route-ahead's own host time (the predictor and its copy
issue, with the stream's planning, which runs only with it) is measured.
Where that host time exceeds the bound over the window the part cannot pay
(small experts on a fast link: the copies it hides take microseconds, its
predictor fractions of a millisecond), and the gate switches it off as it
does an imprecise one: at its first decision, and by its watch. The bound is
loose (the wrong copies' cost and the copies' timeliness are left out, both
against route-ahead), so it switches route-ahead off only where no timing
could make it pay. While the bound holds, route-ahead must earn its place,
and a must-earn probe's verdict to switch it on is overruled (the window
then holds the probe's on-arm steps: a gain the bound says cannot be is
noise). Steps whose measurement lacks a copy time (no link rate measured
yet) are not counted by it.

A **clear** reading decides sooner: where route-ahead's host time is at
least :data:`ROUTE_AHEAD_COST_CLEAR` times the bound over at least
:data:`ROUTE_AHEAD_COST_CLEAR_STEPS` steps, the first decision switches it
off without waiting for ``route_ahead_gate_steps``, in any step with
predictions (the reading needs no measured wall, so a step that admits
requests counts); and a must-earn probe of route-ahead ends, route-ahead
off, once its own on-arm steps read so (only them, not the window's older
steps): the bound would overrule its verdict to switch route-ahead on at
its end anyway. A run's first steps, whose cold cache misses more, favour
route-ahead, so a clear reading there is not the warm-up's chance.

An **imprecise probe ends early.** A must-earn probe of route-ahead
whose own on-arm steps still read a batch precision below the gate ends
after :data:`ROUTE_AHEAD_IMPRECISE_PAIRS` pairs, route-ahead off, unless
those pairs already show its gain at the last look's level (mean gain
above 0 at p < ``earn_level``: the must-earn verdict's own test, as a
screen). Where one request runs, the rate's per-pair noise is several
times route-ahead's effect, so the last look's verdict is mostly noise
(each probe switches a route-ahead that changes nothing on with
probability up to ``earn_level + alpha``, and it then runs to the next
probe) while every on-arm step pays for the wrong copies; a gain that could earn route-ahead's way back
below the gate mostly passes the screen where a few requests run. (With the
shadow check, below, a must-earn probe of a gated route-ahead runs only
where its shadow steps read at or above the gate; the early end then
catches on-arm steps that read below it.)

The **waits bound** spares a probe of route-ahead whose verdict is known
before it runs. A prefetch saves at most the time the forwards wait for
copies without it, so while route-ahead is off by its gate (with the cost
bound), a probe of it is skipped (logged as a decision that keeps it off)
where its host time a step over the cost bound's window is at least
:data:`ROUTE_AHEAD_COST_CLEAR` times the mean wait for copies of the latest
:data:`ROUTE_AHEAD_WAITS_WINDOW` counted steps with route-ahead and the host
part off (rest steps included; at least :data:`ROUTE_AHEAD_WAITS_MIN_STEPS`
of them). Where the waits grow (a workload whose misses rise) the bound
lets the next probe run. Not where the engine has a host part (its planner
reads the predictions: they may pay there by what they plan, not by waits
they hide).

**The shadow check** (``route_ahead_shadow_check``; the engine's controller
takes :attr:`~pdflash.engine.config.EngineConfig.route_ahead_shadow_check`,
off by default: opt-in until a GPU A/B shows it pays; on the CPU replay of
that trace at c=1, where a route-ahead step costs little, PD with it read
0.996x [0.989, 0.999] PD without it, 8 pairs,
``bench/results/cpu/shadow-check-2026-12-07/``). What a must-earn probe of an imprecise route-ahead costs is
its on-arm steps' copies, not its predictions: the wrong copies take the
link and cache slots and the stream's narrower lookahead misses (on the H100
at c=1, precision about 0.4: each on-arm step about 12% slower, median log
rate on over off -0.122 over 42 probe decisions, against the predictor's
2-3 ms of a 65 ms step; ``bench/results/h100/session56-2026-12-07/``). So at
route-ahead's turn while it must earn its way back (off, by the gate or a
must-earn verdict; after the waits bound, which may skip the turn first),
the controller first runs it in **shadow**
(:attr:`PartsState.route_ahead_shadow`): off in everything (no copy, stream
plan, protection from eviction, host plan, or byte dimension for the
scheduler), but the predictor still predicts and the engine counts its
predictions against the verify's routing as it counts route-ahead's own
(``route_ahead_predicted``, ``route_ahead_hits``). Once
``route_ahead_gate_steps`` shadow steps had predictions (any step: the
precision needs no measured wall; with fewer, once twice that many steps
ran), a batch precision below the gate keeps route-ahead off with no paired
probe (a decision that says so) and the round moves on; at or above it, or
with nothing read, its must-earn probe runs as before (from its arm A, after
a settle step). No shadow step enters a probe's pairs or the probe budget's
loss. Below the gate route-ahead thus no longer earns its way back by a
probe's gain: only once its predictions read at or above the gate. Shadow
steps enter the gate's window like any step with predictions; their host
time is the predictor's alone (no copy issue, no stream plan), less than
route-ahead's own, so the cost bound and the waits bound, which read the
window, read them in route-ahead's favour. ``summary()`` counts the shadow
steps (``route_ahead_shadow_steps``) and ``settings`` the setting; without it
(the default) the probe runs at once, as before the check.

**Host control** (``host_control``, :data:`HOST_CONTROLS`; the engine's
controller takes :attr:`~pdflash.engine.config.EngineConfig.host_control`):
``controller`` (default) judges the host part as above; ``always`` runs it
in every step where the engine has it, from the first: it is never probed
nor gated (no host-off step for a probe or the gate to measure), and the
controller probes PD's other parts as usual. ``summary()["settings"]``
records which (the A/B arm of what the gate and the must-earn probes cost
where the host pays).

**Rest.** Where nothing of PD's prefetching runs (route-ahead off, so the
stream too, and no host part on) and the controller is in a hold outside
every gate's first decision and watch, it reads of a step nothing but
that it ran: the hold counts steps. The controller then **rests**
(:attr:`PDController.resting`, a :class:`RestingPolicy`): the engine side
skips the step's measurement (its counters, its expected committed tokens,
which also leave the acceptance estimate unchanged) and hands the policy a
:class:`RestStep` (the step's wall and waits, for the books' step sums, and
whether the hold counts it). The hold's last :meth:`PDController.rest_tail`
steps are measured in full (the host gate's window where the engine has a
host part, whose turn reads the latest host-off steps; else the step that
starts the round). Given the same measurements a resting controller
decides exactly as one that reads every step: at rest it would have read
only the count. At rest the engine batches each step first-come
(``rest_batching``, default ``first_come``: B1's rule over the waiting
requests in arrival order; the configured batcher is paused and misses
those steps), and a verify width standing down between its probes is not
consulted (:class:`~pdflash.engine.verify_width.WidthHook`: every draft
verified, its probes wait for the controller's next round): at rest PD runs
B1's step, with the controller's count on top. One thing differs after a rest: the acceptance estimate
behind the expected committed tokens has not learned the rest steps'
outcomes (both arms of a later probe are valued by it alike; a finished
or aborted request's estimate is dropped at rest all the same). With
route-ahead switched off the 2-D scheduler and the stream are not probed
either: no demand names a predicted expert, so the 2-D choice has no byte
dimension, and the stream runs only with route-ahead.

A step's waits are the stall timer's reading at its end less its start
mark; the start mark is the previous step's end reading while no wait was
recorded since (:func:`_stall_mark`): one read of the timer a step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np

# who decides whether the host part runs (PDController's host_control):
# ``controller`` (its gate and must-earn probes) or ``always``
from pdflash.engine.config import HOST_CONTROLS as HOST_CONTROLS
from pdflash.engine.config import check_host_control
from pdflash.engine.verify_width import SurvivalEstimator, link_rate_of

if TYPE_CHECKING:
    from pdflash.engine.engine import Engine, StepReport

#: parts judged also by cost/benefit (their host time vs the exposed fetch
#: time they remove); the scheduler's cost is in its batches, not host time
COST_BENEFIT_PARTS = frozenset({"stream", "route_ahead"})

#: what a step's tokens per second counts (see :class:`PDController`)
RATES = ("expected_committed", "committed", "verified")

#: the switchable parts, in the order they are probed: the scheduler first,
#: because with route-ahead off it has no predicted bytes to act on (a
#: route-ahead probe would also measure the scheduler's batches); the stream
#: before route-ahead, because switching route-ahead off stops the stream
#: too (a stream that costs must go off alone, not take route-ahead with it)
PARTS: tuple[str, ...] = ("scheduler_2d", "stream", "route_ahead")

#: the hybrid miss service (``PD+host``'s part, :mod:`pdflash.hybrid`):
#: switchable where the engine has one, must earn its place
#: (:data:`DEFAULT_STANCES`), judged by the rate alone (its cost is the
#: forward thread's time, which no part's books separate), and probed
#: first: where the host does not pay it costs the most
HOST_PART = "host_experts"

#: the host gate the engine's PD controller uses (:class:`PDController`'s
#: ``host_gate``, module docstring): the least median share of a step's wall
#: the forwards waited for expert copies (host part off) for the host part
#: to run. (On the H200, PD's exposed-fetch share was 0.29-0.48 at the
#: link-bound points and at most 0.17 at the compute-bound ones.)
HOST_GATE_EXPOSED = 0.2

#: steps with the host part off whose waiting share the gate keeps (the latest)
HOST_GATE_WINDOW = 8

#: measured host-off steps the gate's first decision needs (:class:`PDController`'s
#: ``host_gate_steps``): a median of two, so one step's noise does not
#: switch the host on, while a link-bound run still gets it from its third
#: measured step
HOST_GATE_FIRST_STEPS = 2

#: the route-ahead gate the engine's PD controller uses (:class:`PDController`'s
#: ``route_ahead_gate``, module docstring): the least batch precision of
#: route-ahead's predictions (the share of the experts they named that the
#: verify routed) for route-ahead to run by default; below it, it must earn
#: its place. A right copy saves at most one copy's wait and a wrong one
#: costs one copy's link time and a slot, so below one half the copies cost
#: more than they save (bench/results/h100/session39-2026-12-05/).
ROUTE_AHEAD_GATE_PRECISION = 0.5

#: steps with route-ahead's predictions the gate's first decision needs
ROUTE_AHEAD_GATE_STEPS = 4

#: the latest steps with predictions whose batch precision the gate reads
ROUTE_AHEAD_GATE_WINDOW = 8

#: a **clear** reading of the cost bound (module docstring): route-ahead's
#: host time at least this many times the most its routed predictions could
#: save, over at least :data:`ROUTE_AHEAD_COST_CLEAR_STEPS` steps. It decides
#: before the window fills: the first decision, and a must-earn probe of
#: route-ahead, which then ends instead of running route-ahead's steps for
#: a verdict the bound would overrule
ROUTE_AHEAD_COST_CLEAR = 2.0

#: steps with predictions a clear reading needs
ROUTE_AHEAD_COST_CLEAR_STEPS = 2

#: pairs after which a must-earn probe of route-ahead whose on-arm steps
#: read a precision below the gate ends, route-ahead off, unless they show
#: its gain at ``earn_level`` (module docstring: an imprecise probe ends early)
ROUTE_AHEAD_IMPRECISE_PAIRS = 2

#: the **waits bound** (module docstring): the latest counted steps with
#: route-ahead and the host part off whose waits for copies it reads, and
#: how many it needs before it skips a probe
ROUTE_AHEAD_WAITS_WINDOW = 16
ROUTE_AHEAD_WAITS_MIN_STEPS = 8

#: every switchable part, in probe order
ALL_PARTS: tuple[str, ...] = (HOST_PART, *PARTS)

#: a part's stance, how its probes judge it (module docstring):
#: ``default_on``, it runs unless a probe shows it worse (the burden of proof
#: on switching it off); ``must_earn``, it runs only while its probes show it
#: better (the burden of proof on the part)
STANCES = ("default_on", "must_earn")

#: the stance of each part unless :class:`PDController` is told otherwise:
#: PD's parts are its design and run by default; the host service is a
#: costly option (the forward thread's time) that must earn its place
DEFAULT_STANCES: Mapping[str, str] = MappingProxyType(
    {**dict.fromkeys(PARTS, "default_on"), HOST_PART: "must_earn"}
)


@dataclass(frozen=True)
class PartsState:
    """Which of PD's parts run. ``stream`` needs ``route_ahead`` (the stream
    copies the predictor's plan): with route-ahead off it does not run.
    ``host_experts``: the hybrid miss service runs (off by default: only an
    engine built with one has it; a policy left without an explicit
    ``initial`` state starts with every part the engine has on, except a
    :class:`PDController` with a host gate, whose host part starts off
    unless its ``host_control`` is ``always``).
    ``route_ahead_shadow``: with route-ahead off, the predictor still
    predicts and the engine counts its predictions against the verify's
    routing, and nothing else reads them (no copy, stream plan, protection
    from eviction, host plan or byte dimension of the scheduler: module
    docstring, "The shadow check"); moot with route-ahead on. Not a part
    (:data:`ALL_PARTS`): a way of running route-ahead off, never probed."""

    route_ahead: bool = True
    scheduler_2d: bool = True
    stream: bool = True
    host_experts: bool = False
    route_ahead_shadow: bool = False

    def on(self, part: str) -> bool:
        if part not in ALL_PARTS:
            raise ValueError(f"unknown part {part!r}; choose one of {ALL_PARTS}")
        value: bool = getattr(self, part)
        return value

    def with_part(self, part: str, on: bool) -> PartsState:
        if part not in ALL_PARTS:
            raise ValueError(f"unknown part {part!r}; choose one of {ALL_PARTS}")
        return dataclasses.replace(self, **{part: bool(on)})

    def runs(self, part: str) -> bool:
        """Does ``part`` actually run (``stream`` only with route-ahead)?"""
        if part == "stream":
            return self.stream and self.route_ahead
        return self.on(part)

    @property
    def shadows_route_ahead(self) -> bool:
        """Route-ahead runs in shadow: off, its predictions only counted."""
        return self.route_ahead_shadow and not self.route_ahead

    def masked(self, available: PartsState) -> PartsState:
        """This state with the parts ``available`` lacks switched off (the
        shadow too, without route-ahead's predictor)."""
        return PartsState(
            **{p: self.on(p) and available.on(p) for p in ALL_PARTS},
            route_ahead_shadow=self.route_ahead_shadow and available.route_ahead,
        )


#: PD's parts on (and no host service: see :class:`PartsState`)
ALL_ON = PartsState()


def route_ahead_gate_applies(available: PartsState) -> bool:
    """Whether the route-ahead gate can act on an engine with ``available``
    parts (module docstring): it has route-ahead, and no host part, whose
    planner reads route-ahead's predictions too."""
    return available.route_ahead and not available.host_experts


@dataclass(frozen=True)
class StepMeasurement:
    """What one engine step cost and produced.

    Attributes:
        wall_s: the step's wall time.
        committed_tokens: tokens committed by its verify.
        verified_tokens: tokens its verify forward took (anchors + drafts).
        expected_committed_tokens: the tokens its verify was expected to
            commit given the drafts it verified (module docstring); None:
            not estimated (the realized ``committed_tokens`` stand in).
        verified: the step ran a verify forward.
        admitted: requests admitted (and prefilled) in the step.
        part_host_s: host seconds spent in each part's own work this step
            (route-ahead: prediction, as its span on the compute stream, and
            its copy issue; scheduler_2d: the
            verify scheduler; stream: the streaming prefetcher's stages
            outside the forward). Work inside the forward's hooks is not
            separated from the forward.
        books_host_s: the host seconds a prefetching part's books charge
            it (:data:`COST_BENEFIT_PARTS`; a part not named here: its
            ``part_host_s``): every prefetch stage the part changes, timed
            whichever prefetcher runs, so that a probe pair's difference is
            the part's whole host cost (the forward hooks of the stream or,
            with it off, of the gate lookahead; the stream's plans; the
            copies issued before the verify; route-ahead's also its
            predictor's span).
        exposed_fetch_s: time the compute waited on expert copies.
        bytes_in: expert bytes copied in (None: the cache does not count).
        prefetch_bytes_in: of which prefetched (None: not counted).
        prefetch_wasted_bytes: prefetched bytes evicted unused (None: not counted).
        route_ahead_predicted: (layer, expert) pairs the verify batch's
            route-ahead predictions named, union over its requests (0: no
            prediction this step).
        route_ahead_hits: of those, the pairs the verify routed.
        expert_copy_s: the link seconds one expert's copy takes (its bytes
            at the issuer's measured rate; None: not measured), for the
            route-ahead gate's cost bound.
    """

    wall_s: float
    committed_tokens: int
    verified_tokens: int = 0
    expected_committed_tokens: float | None = None
    verified: bool = True
    admitted: int = 0
    part_host_s: Mapping[str, float] = field(default_factory=dict)
    books_host_s: Mapping[str, float] = field(default_factory=dict)
    exposed_fetch_s: float = 0.0
    bytes_in: int | None = None
    prefetch_bytes_in: int | None = None
    prefetch_wasted_bytes: int | None = None
    route_ahead_predicted: int = 0
    route_ahead_hits: int = 0
    expert_copy_s: float | None = None

    def __post_init__(self) -> None:
        if not self.wall_s >= 0.0:
            raise ValueError(f"wall_s must be >= 0, got {self.wall_s}")
        for name in (
            "committed_tokens",
            "verified_tokens",
            "route_ahead_predicted",
            "route_ahead_hits",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.admitted < 0:
            raise ValueError(f"admitted must be >= 0, got {self.admitted}")
        if self.route_ahead_hits > self.route_ahead_predicted:
            raise ValueError(
                f"route_ahead_hits ({self.route_ahead_hits}) must be <= "
                f"route_ahead_predicted ({self.route_ahead_predicted})"
            )
        e = self.expected_committed_tokens
        if e is not None and not (math.isfinite(e) and e >= 0.0):
            raise ValueError(f"expected_committed_tokens must be finite and >= 0, got {e}")
        c = self.expert_copy_s
        if c is not None and not (math.isfinite(c) and c >= 0.0):
            raise ValueError(f"expert_copy_s must be finite and >= 0, got {c}")


@runtime_checkable
class PartsPolicy(Protocol):
    """Decides each step which of PD's parts run."""

    @property
    def parts(self) -> PartsState:
        """The parts for the coming step."""
        ...

    def bind(self, available: PartsState) -> None:
        """The parts the engine can switch (the others stay off)."""
        ...

    def observe(self, m: StepMeasurement) -> PartsState:
        """Record one step's measurement; returns the parts for the next step."""
        ...

    def summary(self) -> dict[str, Any]:
        """Decisions so far: fraction of steps each part was on, switches, why."""
        ...

    def reset_stats(self) -> None:
        """Start the books (steps, fractions, switches, decisions) over;
        the decisions' state (which parts run, the probe under way) stays."""
        ...


@dataclass(frozen=True)
class RestStep:
    """What a policy at rest reads of a step (module docstring, "Rest").

    Attributes:
        wall_s: the step's wall time (for the books' step sums).
        exposed_fetch_s: the time its forwards waited for copies (the same).
        counted: the step would have been measured (it verified and
            admitted no request): a hold counts it.
    """

    wall_s: float
    exposed_fetch_s: float
    counted: bool


@runtime_checkable
class RestingPolicy(PartsPolicy, Protocol):
    """A :class:`PartsPolicy` that can rest: on the steps where it reads
    nothing but their count the engine skips the step's measurement."""

    @property
    def resting(self) -> bool:
        """Whether the coming step is read for nothing but its count (the
        engine then calls :meth:`rest_step` instead of ``observe``)."""
        ...

    def rest_step(self, step: RestStep) -> PartsState:
        """Count one step at rest; returns the parts for the next step."""
        ...


@dataclass(frozen=True)
class Decision:
    """A probe's outcome. ``switched``: the part was flipped to ``on``."""

    step: int
    part: str
    on: bool
    switched: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Books:
    """Per-step accounting shared by the policies (fractions on, switches)."""

    def __init__(self) -> None:
        self.available = ALL_ON
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.on_steps = dict.fromkeys(ALL_PARTS, 0)
        self._counted_parts: PartsState | None = None
        self._running: tuple[str, ...] = ()
        self.switches = 0
        self.decisions: list[Decision] = []
        # every step's measured wall and exposed fetch, summed (all steps,
        # prefill and settle steps too): set beside the row's own totals,
        # they show whether the per-step reads lose waits
        self.wall_s = 0.0
        self.exposed_fetch_s = 0.0
        #: steps the policy read at rest (their count, wall and waits only)
        self.rest_steps = 0
        #: steps route-ahead ran in shadow (off, its predictions only counted)
        self.shadow_steps = 0

    def add_times(self, m: StepMeasurement | RestStep) -> None:
        self.wall_s += m.wall_s
        self.exposed_fetch_s += m.exposed_fetch_s

    def count(self, parts: PartsState) -> None:
        self.steps += 1
        if parts is not self._counted_parts:  # the same state step after step, mostly
            self._counted_parts = parts
            self._running = tuple(p for p in ALL_PARTS if parts.runs(p))
        on_steps = self.on_steps
        for p in self._running:
            on_steps[p] += 1
        self.shadow_steps += parts.shadows_route_ahead

    def listed(self) -> tuple[str, ...]:
        """The parts a summary lists: PD's, and the host service where the
        engine has one."""
        return PARTS if not self.available.host_experts else ALL_PARTS

    def summary(self, name: str, parts: PartsState, keep: int) -> dict[str, Any]:
        listed = self.listed()
        frac: dict[str, float | None] = {
            p: (self.on_steps[p] / self.steps if self.steps else None) for p in listed
        }
        return {
            "policy": name,
            "steps": self.steps,
            "available": {p: self.available.on(p) for p in listed},
            "on_fraction": frac,
            "switches": self.switches,
            "at_end": {p: parts.runs(p) for p in listed},
            "probes": len(self.decisions),
            "step_sums": {"wall_s": self.wall_s, "exposed_fetch_s": self.exposed_fetch_s},
            "rest_steps": self.rest_steps,
            "route_ahead_shadow_steps": self.shadow_steps,
            # every switch (up to MAX_SWITCHES_KEPT), and the first and last
            # of the other probes' outcomes
            "decisions": [d.as_dict() for d in _kept(self.decisions, keep)],
        }


#: switch decisions a summary lists at most (the first ones)
MAX_SWITCHES_KEPT = 64


def _kept(items: list[Decision], keep: int) -> list[Decision]:
    switches = [d for d in items if d.switched][:MAX_SWITCHES_KEPT]
    others = [d for d in items if not d.switched]
    if len(others) > keep:
        half = keep // 2
        others = others[:half] + others[len(others) - (keep - half) :]
    return sorted(switches + others, key=lambda d: d.step)


class FixedParts:
    """A policy that never switches (``PD-all-on`` and the fixed ablations):
    it only keeps the books, so every PD row records its parts the same way."""

    name = "fixed"

    def __init__(self, parts: PartsState | None = None) -> None:
        # None: every part the engine has
        self._want = parts
        self._parts = parts if parts is not None else ALL_ON
        self._books = _Books()

    @property
    def parts(self) -> PartsState:
        return self._parts

    def bind(self, available: PartsState) -> None:
        self._books.available = available
        self._parts = available if self._want is None else self._want.masked(available)

    def observe(self, m: StepMeasurement) -> PartsState:
        self._books.count(self._parts)
        self._books.add_times(m)
        return self._parts

    def reset_stats(self) -> None:
        self._books.reset()

    def summary(self) -> dict[str, Any]:
        return self._books.summary(self.name, self._parts, keep=0)


def t_sf(t: float, df: int) -> float:
    """``P(T >= t)`` for Student's t with ``df`` (an integer >= 1) degrees of
    freedom, exact (the finite series of integer ``df``)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    s = math.sin(theta)
    if df % 2 == 1:
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2.0 / math.pi * (theta + s * math.cos(theta) * total)
    else:
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    # inside = P(|T| < |t|)
    tail = max(0.0, 0.5 * (1.0 - inside))
    return tail if t >= 0 else 1.0 - tail


@functools.lru_cache(maxsize=256)
def t_isf(p: float, df: int) -> float:
    """The ``t`` with ``P(T >= t) = p`` (``0 < p < 1``), by bisection on
    :func:`t_sf` (~90 evaluations; remembered, since the controller asks
    for few ``(alpha, df)`` pairs over and over)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p > 0.5:
        return -t_isf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > p:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if t_sf(mid, df) > p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Test:
    """A one-sided paired test of ``mean > 0`` and its numbers."""

    n: int
    mean: float
    se: float
    p: float

    def upper(self, alpha: float) -> float:
        """The one-sided ``1 - alpha`` upper confidence bound of the mean."""
        if self.n < 2:
            return float("inf")
        return self.mean + t_isf(alpha, self.n - 1) * self.se

    def text(self) -> str:
        return f"mean {self.mean:+.3g} (se {self.se:.3g}, n {self.n}, p {self.p:.3g})"

    @classmethod
    def of(cls, n: int, mean: float, se: float) -> Test:
        """The test from its summary statistics (``n`` >= 2 values, their
        ``mean`` and its standard error ``se``; ``se`` 0: p 0 or 1 by the
        mean's sign, 0 counting as no gain)."""
        if n < 2:
            raise ValueError(f"a paired test needs 2 or more pairs, got {n}")
        if se < 0.0:
            raise ValueError(f"se must be >= 0, got {se}")
        if se <= 1e-15 * max(1.0, abs(mean)):
            return cls(n, mean, 0.0, 0.0 if mean > 0 else 1.0)
        return cls(n, mean, se, t_sf(mean / se, n - 1))

    def negated(self) -> Test:
        """The one-sided test of ``mean < 0`` on the same values."""
        return Test.of(self.n, -self.mean, self.se)


def paired_test(values: Sequence[float]) -> Test:
    """One-sided t test of ``mean(values) > 0`` (needs 2 or more values;
    values that are all equal give p 0 or 1 by their sign)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a paired test needs 2 or more pairs, got {n}")
    mean = float(np.mean(values))
    sd = float(np.std(values, ddof=1))
    return Test.of(n, mean, sd / math.sqrt(n))


def must_earn_verdict(
    gain: Test | None, *, last: bool, early_level: float, earn_level: float
) -> bool | None:
    """A must-earn part's state after a look of its probe: True (on), False
    (off), or None (look again).

    ``gain`` is the paired test of ``log(rate with the part / rate
    without)`` (None: fewer than 2 pairs to compare). Before the last look
    the probe ends once either direction is shown at ``early_level`` (a
    Bonferroni share of alpha over the looks): on for a gain, off for a loss.
    At the last look the part is on only if its gain is shown at
    ``earn_level`` (one-sided t test, no margin): anything short of that,
    a part that changes nothing included, leaves it off.
    """
    if gain is None:
        return None if not last else False
    if gain.mean > 0 and gain.p < early_level:
        return True
    if gain.mean < 0 and gain.negated().p < early_level:
        return False
    if not last:
        return None
    return gain.mean > 0 and gain.p < earn_level


@dataclass(frozen=True)
class _RouteAheadStep:
    """What the route-ahead gate keeps of a step with predictions."""

    named: int
    hits: int
    #: route-ahead's own host seconds (its part's, with the stream's, which
    #: runs only with it)
    host_s: float
    #: the most its routed predictions could save: one expert's copy each
    #: (None: no copy time measured)
    saving_bound_s: float | None

    @classmethod
    def of(cls, m: StepMeasurement) -> _RouteAheadStep:
        copy_s = m.expert_copy_s
        return cls(
            named=m.route_ahead_predicted,
            hits=m.route_ahead_hits,
            host_s=_host(m, "route_ahead") + _host(m, "stream"),
            saving_bound_s=None if copy_s is None else m.route_ahead_hits * copy_s,
        )


@dataclass(frozen=True)
class _Pair:
    """One probe pair: the measurement as configured (A) and flipped (B)."""

    a: StepMeasurement
    b: StepMeasurement


class PDController:
    """PD's parts switched by paired-step probes and a sequential test
    (module docstring).

    Args:
        margin: the least effect worth a switch, as a share of the step
            (rate gain, or the part's net cost per step over the step's wall).
        alpha: the false-switch rate of a probe of a part that changes
            nothing (shared by the looks and the rules, Bonferroni).
        min_pairs: pairs before the first look.
        max_pairs: pairs per probe (one look after each from ``min_pairs``
            on).
        extend_pairs: pairs added to a probe that reaches ``max_pairs``
            with a statistic that points to a flip (mean above ``margin``,
            unadjusted p below ``alpha``), pooled with its pairs, with a
            look every ``min_pairs`` pairs and at the end; 0: never.
        warmup: measured steps before the first probe.
        hold: measured steps between probe rounds (re-probing); doubled
            after every round that switched nothing, up to ``max_hold``, and
            back to ``hold`` after a switch.
        max_hold: the longest hold.
        settle: steps not measured after every change of the parts.
        probe_budget: the share of the run's steps the probes may lose:
            after a round, the hold is lengthened so that the round's
            estimated loss (each probe's steps in its flipped arm times the
            extra time a flipped step took) is at most this share of the
            round and its hold (module docstring); 1: no lengthening.
        initial: the parts at the start (masked by what the engine has);
            None: every part the engine has.
        keep_decisions: probe outcomes other than switches kept in
            :meth:`summary` (the first and the last ones; switches are all kept).
        rate_of: the tokens a step's rate counts: ``expected_committed``
            (default: the committed tokens expected given the drafts the
            step verified, the module docstring), ``committed`` (realized:
            unbiased, with the acceptance draw's noise) or ``verified``
            (tokens the verify forward took: biased against a part that
            trims grants, whose dropped drafts are the least likely to be
            accepted).
        stances: each part's stance (``default_on`` or ``must_earn``, module
            docstring), over :data:`DEFAULT_STANCES` (the host service must
            earn its place, PD's parts run by default). A must-earn part is
            judged by the rate alone (a prefetcher given it loses its books'
            rule) and its probes are not extended.
        earn_level: the one-sided level at which a must-earn part's gain
            must be shown at its probe's last look to keep (or turn) it on;
            at most 0.5 (at 0.5 the mean gain need only be > 0).
        host_gate: the host gate (module docstring): the least median
            share of a step's wall the forwards waited for expert copies,
            with the host part off, for the host part to run or be probed.
            With a gate the host part starts off (``initial`` None) and is
            switched on only by the gate. None (default): no gate.
        host_gate_steps: measured host-off steps the gate's first decision
            needs (module docstring); at most :data:`HOST_GATE_WINDOW`.
        host_control: ``controller`` (default: the gate and the must-earn
            probes judge the host part) or ``always`` (the host part runs in
            every step where the engine has it, whatever ``initial`` and
            ``host_gate`` say, and is never probed; module docstring).
        route_ahead_gate: the route-ahead gate (module docstring): the
            least batch precision of route-ahead's predictions for it to run
            by default; below it route-ahead must earn its place. None
            (default): no gate. It does not act where the engine has a host
            part.
        route_ahead_gate_steps: steps with predictions the gate's first
            decision needs; at most :data:`ROUTE_AHEAD_GATE_WINDOW`.
        route_ahead_cost_gate: the gate also switches route-ahead off where
            its host time exceeds what its routed predictions could save at
            one expert's copy each (module docstring, "The gate's cost
            bound"); needs ``route_ahead_gate``.
        route_ahead_shadow_check: at route-ahead's turn while it must earn
            its way back (off, under the gate), its predictions are read in
            shadow first, with no copy made, and a precision below the gate
            keeps it off with no paired probe (module docstring, "The shadow
            check"). False (the default): the paired probe runs at once. It
            acts only with a ``route_ahead_gate``.
    """

    name = "paired-steps"

    def __init__(
        self,
        *,
        margin: float = 0.05,
        alpha: float = 0.05,
        min_pairs: int = 3,
        max_pairs: int = 6,
        extend_pairs: int = 6,
        warmup: int = 2,
        hold: int = 24,
        max_hold: int = 96,
        settle: int = 1,
        probe_budget: float = 0.05,
        initial: PartsState | None = None,
        keep_decisions: int = 16,
        rate_of: str = "expected_committed",
        stances: Mapping[str, str] | None = None,
        earn_level: float = 0.2,
        host_gate: float | None = None,
        host_gate_steps: int = HOST_GATE_FIRST_STEPS,
        host_control: str = "controller",
        route_ahead_gate: float | None = None,
        route_ahead_gate_steps: int = ROUTE_AHEAD_GATE_STEPS,
        route_ahead_cost_gate: bool = False,
        route_ahead_shadow_check: bool = False,
    ) -> None:
        for name, value, low in (
            ("min_pairs", min_pairs, 2),
            ("max_pairs", max_pairs, 2),
            ("extend_pairs", extend_pairs, 0),
            ("warmup", warmup, 0),
            ("hold", hold, 0),
            ("max_hold", max_hold, 0),
            ("settle", settle, 0),
            ("keep_decisions", keep_decisions, 0),
            ("host_gate_steps", host_gate_steps, 1),
            ("route_ahead_gate_steps", route_ahead_gate_steps, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if max_pairs < min_pairs:
            raise ValueError(f"max_pairs ({max_pairs}) must be >= min_pairs ({min_pairs})")
        if max_hold < hold:
            raise ValueError(f"max_hold ({max_hold}) must be >= hold ({hold})")
        if rate_of not in RATES:
            raise ValueError(f"rate_of must be one of {RATES}, got {rate_of!r}")
        if not margin >= 0.0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not 0.0 < probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in (0, 1], got {probe_budget}")
        if not 0.0 < earn_level <= 0.5:
            raise ValueError(f"earn_level must be in (0, 0.5], got {earn_level}")
        if host_gate is not None and not 0.0 <= host_gate < 1.0:
            raise ValueError(f"host_gate must be in [0, 1) or None, got {host_gate}")
        if host_gate_steps > HOST_GATE_WINDOW:
            raise ValueError(
                f"host_gate_steps must be <= {HOST_GATE_WINDOW} (the window), got {host_gate_steps}"
            )
        if route_ahead_gate is not None and not 0.0 < route_ahead_gate <= 1.0:
            raise ValueError(f"route_ahead_gate must be in (0, 1] or None, got {route_ahead_gate}")
        if route_ahead_gate_steps > ROUTE_AHEAD_GATE_WINDOW:
            raise ValueError(
                f"route_ahead_gate_steps must be <= {ROUTE_AHEAD_GATE_WINDOW} (the window), "
                f"got {route_ahead_gate_steps}"
            )
        if route_ahead_cost_gate and route_ahead_gate is None:
            raise ValueError(
                "route_ahead_cost_gate needs a route_ahead_gate (the bound is its rule)"
            )
        check_host_control(host_control)
        self.host_control = host_control
        given = dict(stances or {})
        for part, stance in given.items():
            if part not in ALL_PARTS:
                raise ValueError(f"unknown part {part!r} in stances; choose from {ALL_PARTS}")
            if stance not in STANCES:
                raise ValueError(f"unknown stance {stance!r} for {part!r}; choose one of {STANCES}")
        self.stances: Mapping[str, str] = MappingProxyType({**DEFAULT_STANCES, **given})
        self.earn_level = float(earn_level)
        self.margin = float(margin)
        self.alpha = float(alpha)
        self.min_pairs = min_pairs
        self.max_pairs = max_pairs
        self.extend_pairs = extend_pairs
        self.looks = _looks(min_pairs, max_pairs, extend_pairs)
        #: a must-earn part's looks: no extension (its last look decides)
        self.earn_looks = tuple(range(min_pairs, max_pairs + 1))
        self.warmup = warmup
        self.hold = hold
        self.max_hold = max_hold
        self.settle = settle
        self.probe_budget = float(probe_budget)
        self.keep_decisions = keep_decisions
        self.rate_of = rate_of
        self.host_gate = None if host_gate is None else float(host_gate)
        self.host_gate_steps = host_gate_steps
        self.route_ahead_gate = None if route_ahead_gate is None else float(route_ahead_gate)
        self.route_ahead_gate_steps = route_ahead_gate_steps
        self.route_ahead_cost_gate = bool(route_ahead_cost_gate)
        self.route_ahead_shadow_check = bool(route_ahead_shadow_check)
        self._initial = initial
        self._available = ALL_ON
        self._fresh_state()

    def _fresh_state(self) -> None:
        """Every decision's and measurement's state as a new controller has
        it (the settings stay)."""
        #: the waiting shares of the latest measured steps with the host part off
        self._exposed_off: deque[float] = deque(maxlen=HOST_GATE_WINDOW)
        #: the gate's first decision is still to be made (set by bind: a
        #: gate, an engine with the host part and the part starting off)
        self._gate_first = False
        #: the first round skips the host part (its first decision was made)
        self._skip_host_turn = False
        #: the host part is off by the gate's reading (not by a must-earn
        #: probe): the gate re-reads its window outside probes
        self._gate_watch = False
        #: the latest steps with route-ahead's predictions
        self._ra_window: deque[_RouteAheadStep] = deque(maxlen=ROUTE_AHEAD_GATE_WINDOW)
        #: the route-ahead gate's first decision is still to be made (bind)
        self._ra_gate_first = False
        #: measured steps the first decision has waited
        self._ra_waited = 0
        #: route-ahead is off by the gate or a must-earn verdict: it must earn
        #: its way back on
        self._ra_gated = False
        #: the first round skips route-ahead (the gate's first decision judged it)
        self._skip_ra_turn = False
        #: the waits for copies of the latest counted steps with route-ahead
        #: and the host part off (the waits bound's window; rest steps too)
        self._waits_off: deque[float] = deque(maxlen=ROUTE_AHEAD_WAITS_WINDOW)
        #: route-ahead runs on the gate's reading (its first decision kept it
        #: on and no probe of route-ahead has switched it since): outside
        #: probes the gate re-reads its full window
        self._ra_watch = False
        #: the stance the probe under way judges its part by
        self._probe_stance = "default_on"
        self._parts = self._initial if self._initial is not None else ALL_ON
        self._books = _Books()
        self._probing = False
        self._countdown = self.warmup
        self._hold_now = self.hold  # the hold after this round
        self._round_switched = False
        self._settling = 0
        self._queue: list[str] = []
        self._part: str | None = None
        self._base = self._parts  # the configuration at the probe's start (arm A)
        self._pairs: list[_Pair] = []
        self._half: StepMeasurement | None = None  # the pair's first step
        self._extended = False  # the probe runs on past max_pairs
        self._probe_b_steps = 0  # steps of this probe in its flipped arm (settles too)
        #: a probe of route-ahead: its steps with predictions (the on arm's)
        self._probe_ra_steps: list[_RouteAheadStep] = []
        #: the shadow check of route-ahead is under way (module docstring,
        #: "The shadow check"): its turn's steps run it in shadow, no pairs
        self._shadow_checking = False
        #: the shadow check's steps with predictions, and all its steps
        self._shadow_ra_steps: list[_RouteAheadStep] = []
        self._shadow_waited = 0
        self._round_steps = 0  # steps since this round's first probe began
        self._round_loss = 0.0  # step-equivalents this round's probes lost
        self._probe_loss = 0.0  # the same since reset_stats (the summary's)
        self._rounds_done = 0

    def restart(self) -> None:
        """Forget every decision and measurement: the controller as just
        built and bound to the same engine (its settings kept). For steps
        that ran where no later step will, such as a benchmark warm-up's
        settled cache, whose copies are waited for on the host."""
        self._fresh_state()
        self.bind(self._available)

    # ------------------------------------------------------------ protocol
    @property
    def parts(self) -> PartsState:
        return self._parts

    @property
    def rounds_done(self) -> int:
        """Rounds of probes ended so far (kept by :meth:`reset_stats`): from
        1 on, every part the controller may switch has had its first probe
        (or its gate's decision) and the configuration is in its hold."""
        return self._rounds_done

    @property
    def configured(self) -> PartsState:
        """The configuration the controller's decisions hold: :attr:`parts`
        outside a probe; during one, the configuration it started from (its
        arm A; :attr:`parts` may be the flipped arm B, which no decision
        chose)."""
        return self._base if self._probing else self._parts

    def bind(self, available: PartsState) -> None:
        self._available = available
        self._books.available = available
        if self._initial is not None:
            self._parts = self._initial.masked(available)
        elif self.host_gate is not None:
            # the gate switches the host part on once host-off steps show
            # the forwards waiting for copies (module docstring)
            self._parts = available.with_part(HOST_PART, False)
        else:
            self._parts = available
        if self.host_control == "always":
            # on from the first step wherever the engine has it; never
            # probed (_probeable) nor gated (no gate decision pending)
            self._parts = self._parts.with_part(HOST_PART, available.host_experts)
        self._gate_first = (
            self.host_gate is not None and available.host_experts and not self._parts.host_experts
        )
        self._skip_host_turn = False
        self._gate_watch = False
        self._ra_gate_first = self._ra_gate_acts() and self._parts.route_ahead
        self._ra_waited = 0
        self._ra_gated = False
        self._skip_ra_turn = False
        self._ra_watch = False

    def reset_stats(self) -> None:
        self._books.reset()
        self._probe_loss = 0.0

    def summary(self) -> dict[str, Any]:
        out = self._books.summary(self.name, self._parts, keep=self.keep_decisions)
        # estimated: each ended probe's flipped-arm steps times its rate loss
        out["probe_loss_steps"] = self._probe_loss
        # the waiting shares the gate reads (the latest host-off steps, oldest
        # first): what its next re-read or turn would see
        out["gate_window"] = (
            [round(x, 4) for x in self._exposed_off] if self.host_gate is not None else None
        )
        ra = self._ra_precision()
        out["route_ahead_precision"] = None if ra is None else round(ra, 4)
        out["settings"] = {
            "margin": self.margin,
            "alpha": self.alpha,
            "min_pairs": self.min_pairs,
            "max_pairs": self.max_pairs,
            "extend_pairs": self.extend_pairs,
            "warmup": self.warmup,
            "hold": self.hold,
            "max_hold": self.max_hold,
            "settle": self.settle,
            "probe_budget": self.probe_budget,
            "rate_of": self.rate_of,
            # which rule judged each part the row lists
            "stances": {p: self.stances[p] for p in self._books.listed()},
            "earn_level": self.earn_level,
            "host_gate": self.host_gate,
            "host_gate_steps": self.host_gate_steps,
            "host_control": self.host_control,
            "route_ahead_gate": self.route_ahead_gate,
            "route_ahead_gate_steps": self.route_ahead_gate_steps,
            "route_ahead_cost_gate": self.route_ahead_cost_gate,
            "route_ahead_shadow_check": self.route_ahead_shadow_check,
            # the clear reading's ratio (module docstring); None: no clear
            # reading (a run that set it to inf), or no cost bound
            "route_ahead_cost_clear": (
                ROUTE_AHEAD_COST_CLEAR
                if self.route_ahead_cost_gate and math.isfinite(ROUTE_AHEAD_COST_CLEAR)
                else None
            ),
        }
        return out

    @property
    def resting(self) -> bool:
        """Whether the coming step is read for nothing but its count (module
        docstring, "Rest"): a hold, outside every gate's first decision and
        watch, with route-ahead and the host part off, before the hold's
        last :meth:`rest_tail` steps."""
        return (
            not self._probing
            and self._settling == 0
            and not self._parts.route_ahead
            and not self._parts.route_ahead_shadow
            and not self._parts.host_experts
            and not (self._gate_first or self._ra_gate_first)
            and not (self._gate_watch or self._ra_watch)
            and self._countdown > self.rest_tail()
        )

    def rest_tail(self) -> int:
        """The measured steps that end a hold (module docstring, "Rest"):
        the host gate's window where the engine has a host part (its turn
        reads the latest host-off steps), else the one step whose
        measurement starts the round."""
        return HOST_GATE_WINDOW if self._available.host_experts else 1

    def rest_step(self, step: RestStep) -> PartsState:
        if not self.resting:
            raise RuntimeError("rest_step while the controller is not at rest: observe the step")
        self._books.count(self._parts)
        self._books.add_times(step)
        self._books.rest_steps += 1
        if step.counted:
            self._countdown -= 1
            self._waits_off.append(step.exposed_fetch_s)  # at rest both parts are off
        return self._parts

    def alpha_per_look(self, part: str, stance: str | None = None) -> float:
        """The level of each (look, rule) test of a probe of ``part`` judged
        by ``stance`` (None: its configured stance; a must-earn part: of
        each early look's test, either direction)."""
        if (stance or self.stances[part]) == "must_earn":
            return self.alpha / len(self.earn_looks)
        rules = 2 if part in COST_BENEFIT_PARTS else 1
        return self.alpha / (rules * len(self.looks))

    def observe(self, m: StepMeasurement) -> PartsState:
        self._books.count(self._parts)
        self._books.add_times(m)
        if m.route_ahead_predicted > 0:
            # precision is the predictions' and the routing's, not the
            # step's timing: every step with predictions reads it (a shadow
            # step's too: the same predictor, the same routing)
            self._ra_window.append(_RouteAheadStep.of(m))
            if self._shadow_checking:
                self._shadow_ra_steps.append(self._ra_window[-1])
            elif self._probing and self._part == "route_ahead":
                self._probe_ra_steps.append(self._ra_window[-1])
            elif self._ra_gate_first and self._ra_clearly_cannot_pay(self._ra_window):
                # a clear reading needs no measured wall: admitting and
                # settling steps decide too
                self._ra_gate_first_decision()
        if self._probing:
            self._round_steps += 1
            if self._shadow_checking:
                # its reading needs no measured wall either
                if self._shadow_check_ends():
                    return self._parts
            else:
                self._probe_b_steps += int(self._parts != self._base)
                if self._ra_probe_reads_clear():
                    return self._parts
        if self._settling > 0:
            self._settling -= 1
            return self._parts
        if not m.verified or m.admitted > 0 or m.wall_s <= 0.0:
            return self._parts  # not the parts' time: not measured
        if not self._parts.host_experts:
            self._exposed_off.append(m.exposed_fetch_s / m.wall_s)
            if not self._parts.route_ahead:
                self._waits_off.append(m.exposed_fetch_s)
        if not self._probing:
            if self._gate_first:
                self._gate_first_decision()
            else:
                self._gate_reread()
            if self._ra_gate_first:
                self._ra_gate_first_decision()
            else:
                self._ra_gate_reread()
            self._countdown -= 1
            # the first round waits for the gates' first decisions
            if self._countdown <= 0 and not self._gate_first and not self._ra_gate_first:
                self._start_round()
            return self._parts
        if self._shadow_checking:
            return self._parts  # a shadow step enters no pair
        if self._half is None:
            self._half = m
        else:
            first, second = self._half, m
            self._half = None
            # pairs alternate AB, BA, AB, ...: a trend over the probe cancels
            a_first = len(self._pairs) % 2 == 0
            self._pairs.append(_Pair(first, second) if a_first else _Pair(second, first))
            if (
                self._gate_probe()
                or self._ra_probe_reads_imprecise()
                or (self._look_now() and self._judge())
            ):
                return self._parts
        self._set(self._arm_parts(self._next_arm()))
        return self._parts

    # ------------------------------------------------------------ internals
    def _next_arm(self) -> str:
        i = len(self._pairs)
        first = "A" if i % 2 == 0 else "B"
        if self._half is None:
            return first
        return "B" if first == "A" else "A"

    def _arm_parts(self, arm: str) -> PartsState:
        part = self._part
        assert part is not None
        if arm == "A":
            return self._base
        return self._base.with_part(part, not self._base.on(part))

    def _set(self, parts: PartsState) -> None:
        if parts != self._parts:
            self._parts = parts
            self._settling = self.settle

    def _probeable(self) -> list[str]:
        # the stream runs only with route-ahead, and with route-ahead switched
        # off no demand names a predicted expert, so the 2-D choice has no
        # byte dimension: probing either is moot (an engine without
        # route-ahead has no switchable 2-D scheduler: EngineParts); a host
        # part under host_control "always" is not the controller's
        ra_off = not self._parts.route_ahead
        return [
            p
            for p in ALL_PARTS
            if self._available.on(p)
            and not (p == "stream" and ra_off)
            and not (p == "scheduler_2d" and ra_off and self._available.route_ahead)
            and (p != HOST_PART or self.host_control == "controller")
        ]

    def _start_round(self) -> None:
        self._queue = self._probeable()
        self._round_switched = False
        self._round_steps = 0
        self._round_loss = 0.0
        self._next_probe()

    def _charge_probe(self) -> None:
        """Add the probe that just ended to the round's loss: its steps in
        the flipped arm times the extra time a flipped step took for its
        tokens, ``rate configured / rate flipped - 1`` at one standard error
        above its pairs' mean gain (so noise alone charges little; 0 where
        the flip did not lose, or with fewer than 2 pairs)."""
        gains = self._flip_gains()
        if len(gains) >= 2 and self._probe_b_steps:
            test = paired_test(gains)
            loss = max(0.0, math.exp(-(test.mean + test.se)) - 1.0) * self._probe_b_steps
            self._round_loss += loss
            self._probe_loss += loss
        self._probe_b_steps = 0

    def _next_probe(self) -> None:
        if self._part is not None:
            self._charge_probe()
        # between probes: the part's arms are not under way
        self._gate_reread()
        self._ra_gate_reread()
        while self._queue:
            part = self._queue.pop(0)
            if part == HOST_PART and (self._host_turn_skipped() or self._gated()):
                continue
            if part == "route_ahead" and self._skip_ra_turn:
                self._skip_ra_turn = False
                continue
            if part == "route_ahead" and (why := self._ra_waits_bound_text()) is not None:
                self._log(Decision(self._books.steps, "route_ahead", False, False, why))
                continue
            if part in self._probeable():
                self._part = part
                self._probing = True
                self._base = self._parts
                if part == "route_ahead" and self._shadow_check_due():
                    self._begin_shadow_check()
                else:
                    self._begin_probe()
                return
        self._part = None
        self._probing = False
        self._rounds_done += 1
        # a round that found nothing to switch: probe less often (fewer
        # probes' costs and false switches on a steady workload)
        if self._round_switched:
            self._hold_now = self.hold
        # the probe budget: probes that lost much (parts that pay) wait
        # longer, so the round's loss stays within budget of round and hold;
        # not after a switch (its configuration is re-checked soon: a false
        # switch does not last a long hold)
        budget_hold = 0
        if not self._round_switched:
            budget_hold = math.ceil(self._round_loss / self.probe_budget) - self._round_steps
        self._countdown = max(1, self._hold_now, budget_hold)
        if not self._round_switched:
            self._hold_now = min(self.max_hold, 2 * self._hold_now)

    def _begin_probe(self) -> None:
        """Start the paired probe of ``self._part`` from the configuration
        ``self._base`` (its arm A)."""
        part = self._part
        assert part is not None
        self._probe_stance = self._stance_of(part)
        self._pairs = []
        self._half = None
        self._extended = False
        self._probe_ra_steps = []
        self._probe_b_steps = 0
        self._set(self._arm_parts("A"))

    def _shadow_check_due(self) -> bool:
        """Route-ahead's turn starts with a shadow check (module docstring,
        "The shadow check"): the check is on, the gate acts, and route-ahead
        is off and must earn its way back."""
        return (
            self.route_ahead_shadow_check
            and self._ra_gate_acts()
            and not self._base.route_ahead
            and self._stance_of("route_ahead") == "must_earn"
        )

    def _begin_shadow_check(self) -> None:
        """Run route-ahead in shadow from the next step: off as configured
        (``self._base``), its predictions only counted."""
        self._shadow_checking = True
        self._shadow_ra_steps = []
        self._shadow_waited = 0
        self._probe_stance = "must_earn"
        # no pair, so nothing for the probe's loss to charge (_charge_probe)
        self._pairs = []
        self._half = None
        self._probe_b_steps = 0
        self._set(dataclasses.replace(self._base, route_ahead_shadow=True))

    def _shadow_check_ends(self) -> bool:
        """The shadow check after one more of its steps (module docstring,
        "The shadow check"): once ``route_ahead_gate_steps`` steps had
        predictions (or, with fewer, twice that many steps ran), a batch
        precision below the gate keeps route-ahead off and the round moves
        on; at or above it (or nothing read) its paired must-earn probe
        starts. True when the check ended."""
        self._shadow_waited += 1
        need = self.route_ahead_gate_steps
        steps = self._shadow_ra_steps
        if len(steps) < need and self._shadow_waited < 2 * need:
            return False
        self._shadow_checking = False
        gate = self.route_ahead_gate
        assert gate is not None
        precision = self._ra_precision(steps)
        if precision is not None and precision < gate:
            self._ra_gated = True
            self._ra_watch = False
            return self._probe_keeps(
                "route_ahead",
                False,
                f"kept off (imprecise in a shadow check, no copies made; it must earn its way "
                f"back): batch precision of its predictions {precision:.3g} over "
                f"{len(steps)} steps with predictions in shadow, gate {gate:.3g}; no paired probe",
            )
        self._begin_probe()
        return True

    def _gate_first_decision(self) -> None:
        """The gate's first decision (module docstring), once
        ``host_gate_steps`` measured steps ran with the host part off: the
        part switched on where their median waiting share is at or above
        the gate, else kept off; either way the first round skips it."""
        n = len(self._exposed_off)
        if n < self.host_gate_steps:
            return
        gate = self.host_gate
        assert gate is not None
        self._gate_first = False
        self._skip_host_turn = True  # the first round's turn: decided here
        shares = list(self._exposed_off)
        share = float(np.median(shares))
        nums = (
            f"median share of the step the forwards waited for copies, host part off: "
            f"{share:.3g} over the first {n} measured steps "
            f"({', '.join(f'{x:.3g}' for x in shares)}); gate {gate:.3g}"
        )
        self._gate_decides(share >= gate, nums)

    def _gate_reread(self) -> None:
        """The gate's watch (module docstring): while the host part is off by
        the gate's reading, outside a probe, the latest ``host_gate_steps``
        host-off steps' median waiting share at or above the gate switches
        it on."""
        gate = self.host_gate
        n = self.host_gate_steps
        if not self._gate_watch or gate is None or len(self._exposed_off) < n:
            return
        latest = list(self._exposed_off)[-n:]
        share = float(np.median(latest))
        if share < gate:
            return
        self._round_switched = True
        self._gate_decides(
            True,
            f"re-read: median share of the step the forwards waited for copies, host part "
            f"off: {share:.3g} over the latest {n} measured steps "
            f"({', '.join(f'{x:.3g}' for x in latest)}); gate {gate:.3g}",
        )

    def _gate_decides(self, switch_on: bool, nums: str) -> None:
        """Log the gate's decision for the host part while it is off (``nums``:
        the shares it read) and switch the part on where ``switch_on``."""
        step = self._books.steps
        self._gate_watch = not switch_on
        if not switch_on:
            self._log(
                Decision(
                    step, HOST_PART, False, False, f"kept off (gated: nothing to save): {nums}"
                )
            )
            return
        self._books.switches += 1
        self._set(self._parts.with_part(HOST_PART, True))
        self._log(
            Decision(
                step,
                HOST_PART,
                True,
                True,
                f"switched on (gate: the link binds; probed from the next round): {nums}",
            )
        )

    def _ra_gate_acts(self) -> bool:
        """A gate is set and can act on the engine's parts."""
        return self.route_ahead_gate is not None and route_ahead_gate_applies(self._available)

    def _ra_precision(self, of: Sequence[_RouteAheadStep] | None = None) -> float | None:
        """The batch precision of the steps of ``of`` (None: the route-ahead
        gate's window); None: no step with predictions."""
        steps = self._ra_window if of is None else of
        named = sum(x.named for x in steps)
        return sum(x.hits for x in steps) / named if named else None

    def _ra_cost_bound(
        self, of: Sequence[_RouteAheadStep] | None = None
    ) -> tuple[float, float, int, int] | None:
        """The cost bound's reading over the steps of ``of`` (None: the
        window) that measured a copy time: (route-ahead's host seconds, the
        most its routed predictions could save, their count, steps); None:
        no such step."""
        steps = [x for x in (self._ra_window if of is None else of) if x.saving_bound_s is not None]
        if not steps:
            return None
        return (
            sum(x.host_s for x in steps),
            sum(x.saving_bound_s or 0.0 for x in steps),
            sum(x.hits for x in steps),
            len(steps),
        )

    def _ra_clearly_cannot_pay(self, steps: Sequence[_RouteAheadStep]) -> bool:
        """A clear reading of the cost bound over ``steps`` (module
        docstring): enough of them with a measured copy time, and their
        host time at least ``ROUTE_AHEAD_COST_CLEAR`` times the bound."""
        if not self.route_ahead_cost_gate:
            return False
        reading = self._ra_cost_bound(steps)
        if reading is None or reading[3] < ROUTE_AHEAD_COST_CLEAR_STEPS:
            return False
        host, bound = reading[0], reading[1]
        return host >= ROUTE_AHEAD_COST_CLEAR * bound and host > 0.0

    def _ra_cannot_pay(self) -> bool:
        """The cost bound (module docstring): route-ahead's host time over
        the window exceeds what its routed predictions could save."""
        if not self.route_ahead_cost_gate:
            return False
        reading = self._ra_cost_bound()
        return reading is not None and reading[0] > reading[1]

    def _ra_waits_bound_text(self) -> str | None:
        """The waits bound (module docstring) on a probe of route-ahead about
        to start: where route-ahead is off by its gate and its host time a
        step (the cost bound's window) is at least
        :data:`ROUTE_AHEAD_COST_CLEAR` times the mean wait for copies of the
        latest steps without it, why the probe is skipped; else None."""
        if (
            not self.route_ahead_cost_gate
            or not self._ra_gated
            or self._parts.route_ahead
            or not self._ra_gate_acts()
            or len(self._waits_off) < ROUTE_AHEAD_WAITS_MIN_STEPS
        ):
            return None
        reading = self._ra_cost_bound()
        if reading is None:
            return None
        host_per_step = reading[0] / reading[3]
        waits_per_step = sum(self._waits_off) / len(self._waits_off)
        if host_per_step <= 0.0 or host_per_step < ROUTE_AHEAD_COST_CLEAR * waits_per_step:
            return None
        return (
            f"kept off, its probe skipped (the waits bound: hiding every wait could not "
            f"pay for it): route-ahead's host time {host_per_step * 1e3:.3g} ms a step over "
            f"the latest {reading[3]} steps with predictions, at least "
            f"{ROUTE_AHEAD_COST_CLEAR:g}x the {waits_per_step * 1e3:.3g} ms a step the "
            f"latest {len(self._waits_off)} steps without it waited for copies"
        )

    def _ra_cost_text(self) -> str:
        reading = self._ra_cost_bound()
        if reading is None:
            return "no step with a measured copy time"
        host, bound, hits, steps = reading
        return (
            f"route-ahead's host time {host * 1e3:.3g} ms over the latest {steps} steps with "
            f"predictions, their {hits} routed predictions at most {bound * 1e3:.3g} ms of "
            f"copies saved"
        )

    def _ra_window_text(self) -> str:
        precision = self._ra_precision()
        gate = self.route_ahead_gate
        if precision is None:
            return f"no step with route-ahead's predictions; gate {gate}"
        return (
            f"batch precision of route-ahead's predictions {precision:.3g} over the latest "
            f"{len(self._ra_window)} steps with predictions; gate {gate}"
        )

    def _stance_of(self, part: str) -> str:
        """The stance a probe of ``part`` starting now judges it by: its
        configured one, except route-ahead under the gate (module
        docstring), which must earn its place while it is off by the gate
        or a must-earn verdict, or while its window's precision is below
        the gate."""
        gate = self.route_ahead_gate
        if part == "route_ahead" and gate is not None and self._ra_gate_acts():
            precision = self._ra_precision()
            if self._ra_gated or (precision is not None and precision < gate):
                return "must_earn"
            if self._ra_cannot_pay():
                return "must_earn"
        return self.stances[part]

    def _ra_gate_first_decision(self) -> None:
        """The route-ahead gate's first decision (module docstring)."""
        self._ra_waited += 1
        need = self.route_ahead_gate_steps
        clear = self._ra_clearly_cannot_pay(self._ra_window)
        if len(self._ra_window) < need and self._ra_waited < 2 * need and not clear:
            return
        self._ra_gate_first = False
        gate = self.route_ahead_gate
        assert gate is not None
        precision = self._ra_precision()
        step = self._books.steps
        nums = self._ra_window_text()
        if clear or ((precision is None or precision >= gate) and self._ra_cannot_pay()):
            self._skip_ra_turn = True
            self._ra_gate_off(
                f"switched off (gated: it cannot save its own host time; it must earn its "
                f"way back from the next round): {self._ra_cost_text()}; {nums}"
            )
            return
        if precision is None or precision >= gate:
            kept = f"kept on (gate): {nums}"
            if self.route_ahead_cost_gate:
                kept += f"; {self._ra_cost_text()}"
            self._log(Decision(step, "route_ahead", True, False, kept))
            self._ra_watch = True
            return
        self._skip_ra_turn = True
        self._ra_gate_off(
            f"switched off (gated: its copies mostly unrouted; it must earn its way "
            f"back from the next round): {nums}"
        )

    def _ra_gate_reread(self) -> None:
        """The route-ahead gate's watch (module docstring): outside probes,
        while route-ahead runs on the gate's first reading, a full window
        whose precision fell below the gate switches it off."""
        gate = self.route_ahead_gate
        if not self._ra_watch or gate is None or not self._parts.route_ahead:
            return
        precision = self._ra_precision()
        if len(self._ra_window) < ROUTE_AHEAD_GATE_WINDOW or precision is None:
            return
        if precision < gate:
            self._ra_gate_off(
                f"switched off (gated on re-reading: its copies now mostly unrouted; it "
                f"must earn its way back): {self._ra_window_text()}"
            )
        elif self._ra_cannot_pay():
            self._ra_gate_off(
                f"switched off (gated on re-reading: it cannot save its own host time; it "
                f"must earn its way back): {self._ra_cost_text()}; {self._ra_window_text()}"
            )

    def _ra_gate_off(self, why: str) -> None:
        """The gate switches route-ahead off; it must earn its way back."""
        self._ra_gated = True
        self._ra_watch = False
        self._books.switches += 1
        self._set(self._parts.with_part("route_ahead", False))
        self._log(Decision(self._books.steps, "route_ahead", False, True, why))

    def _ra_probe_reads_clear(self) -> bool:
        """A must-earn probe of route-ahead whose own on-arm steps read the
        cost bound clear (module docstring) ends, route-ahead off. True
        when it did."""
        if self._part != "route_ahead" or self._probe_stance != "must_earn":
            return False
        steps = self._probe_ra_steps
        if not self._ra_clearly_cannot_pay(steps):
            return False
        reading = self._ra_cost_bound(steps)
        assert reading is not None  # a clear reading has measured steps
        host, bound = reading[0], reading[1]
        nums = (
            f"route-ahead's host time {host * 1e3:.3g} ms over this probe's {len(steps)} steps "
            f"with predictions, at most {bound * 1e3:.3g} ms of copies saved (a clear reading: "
            f"at least {ROUTE_AHEAD_COST_CLEAR:g}x)"
        )
        self._ra_gated = True
        self._ra_watch = False
        if not self._base.route_ahead:
            return self._probe_keeps(
                "route_ahead",
                False,
                f"kept off (cannot save its own host time) by its probe's cost bound: {nums}",
            )
        return self._probe_switches(
            "route_ahead",
            False,
            f"switched off (cannot save its own host time) by its probe's cost bound: {nums}",
        )

    def _ra_probe_reads_imprecise(self) -> bool:
        """A must-earn probe of route-ahead whose own on-arm steps read a
        precision below the gate, at :data:`ROUTE_AHEAD_IMPRECISE_PAIRS`
        pairs that do not show its gain at ``earn_level``, ends, route-ahead
        off (module docstring). True when it did."""
        gate = self.route_ahead_gate
        if (
            gate is None
            or self._part != "route_ahead"
            or self._probe_stance != "must_earn"
            or len(self._pairs) != ROUTE_AHEAD_IMPRECISE_PAIRS
        ):
            return False
        steps = self._probe_ra_steps
        precision = self._ra_precision(steps)
        if precision is None or precision >= gate:
            return False
        now = self._base.route_ahead
        flip = self._flip_gains()
        gains = flip if not now else [-g for g in flip]
        if len(gains) < 2:
            return False
        gain = paired_test(gains)
        if gain.mean > 0 and gain.p < self.earn_level:
            return False  # its gain shows already: the probe's looks judge it
        nums = (
            f"batch precision of its predictions {precision:.3g} over this probe's "
            f"{len(steps)} steps with predictions, gate {gate:.3g}; log "
            f"{self.rate_of.replace('_', ' ')} tokens/s on over off: {gain.text()}, its gain "
            f"not shown at p < {self.earn_level:.3g} after {len(self._pairs)} pairs"
        )
        self._ra_gated = True
        self._ra_watch = False
        if not now:
            return self._probe_keeps(
                "route_ahead",
                False,
                f"kept off (imprecise, ended early; it must earn its way back): {nums}",
            )
        return self._probe_switches(
            "route_ahead",
            False,
            f"switched off (imprecise, ended early; it must earn its way back): {nums}",
        )

    def _host_turn_skipped(self) -> bool:
        """True where the host part's turn in this round is skipped (the
        first round, after the gate's first decision)."""
        if self._skip_host_turn:
            self._skip_host_turn = False
            return True
        return False

    def _gate_probe(self) -> bool:
        """The host gate during a probe of the host part while it runs
        (module docstring): once its off arm has a step, a median waiting
        share below the gate ends the probe with the part switched off.
        True when it did."""
        gate = self.host_gate
        if gate is None or self._part != HOST_PART or not self._base.host_experts:
            return False
        off = [p.b for p in self._pairs]  # arm B: the part flipped off
        share = float(np.median([m.exposed_fetch_s / m.wall_s for m in off]))
        if share >= gate:
            return False
        self._gate_watch = True
        return self._probe_switches(
            HOST_PART,
            False,
            "switched off (gated: nothing to save): median share of the step the forwards "
            f"waited for copies, host part off: {share:.3g} over {len(off)} steps of its "
            f"probe; gate {gate:.3g}",
        )

    def _gated(self) -> bool:
        """The host gate at the host part's turn (module docstring): True
        when it decided (the part kept off, or switched on, without a
        probe); False: probe as usual (no gate, the part on, or no step
        measured with it off)."""
        gate = self.host_gate
        if gate is None or self._parts.host_experts or not self._exposed_off:
            return False
        share = float(np.median(self._exposed_off))
        nums = (
            f"median share of the step the forwards waited for copies, host part off: "
            f"{share:.3g} over {len(self._exposed_off)} steps; gate {gate:.3g}"
        )
        self._gate_decides(share >= gate, nums)
        self._round_switched = self._round_switched or share >= gate
        return True

    def _rate(self, m: StepMeasurement) -> float:
        tokens: float
        if self.rate_of == "verified":
            tokens = m.verified_tokens
        elif self.rate_of == "expected_committed" and m.expected_committed_tokens is not None:
            tokens = m.expected_committed_tokens
        else:
            tokens = m.committed_tokens
        return tokens / m.wall_s if m.wall_s > 0 else 0.0

    def _look_now(self) -> bool:
        assert self._part is not None
        looks = self.earn_looks if self._probe_stance == "must_earn" else self.looks
        return len(self._pairs) in looks

    def _flip_gains(self) -> list[float]:
        """Per pair, ``log(rate flipped / rate configured)``; pairs without
        tokens on either side are left out. A difference of logs: the ratio
        of two extreme rates can underflow to 0 (or overflow) where each
        rate's log is finite."""
        return [
            math.log(rb) - math.log(ra)
            for ra, rb in ((self._rate(p.a), self._rate(p.b)) for p in self._pairs)
            if 0 < ra < math.inf and 0 < rb < math.inf
        ]

    def _judge_must_earn(self, part: str, now: bool) -> bool:
        """A must-earn part's look (:func:`must_earn_verdict`); True when
        the probe ended."""
        flip = self._flip_gains()
        # the part's gain: with it over without it, whichever arm it is
        gains = flip if not now else [-g for g in flip]
        gain = paired_test(gains) if len(gains) >= 2 else None
        early = self.alpha_per_look(part, "must_earn")
        last = len(self._pairs) >= self.max_pairs
        verdict = must_earn_verdict(gain, last=last, early_level=early, earn_level=self.earn_level)
        if verdict is None:
            return False
        nums = (
            f"log {self.rate_of.replace('_', ' ')} tokens/s on over off: "
            + (gain.text() if gain is not None else "too few pairs with tokens to compare")
            + f"; must earn: on only if its gain is shown at p < {self.earn_level:.3g} "
            f"by the last look (n {self.max_pairs}), or either way at p < {early:.3g} "
            f"before (alpha {self.alpha:.3g} over {len(self.earn_looks)} looks)"
        )
        if self._probe_stance != self.stances[part]:
            nums += f"; must earn by the route-ahead gate: {self._ra_window_text()}"
        # a gain shown where the gate's cost bound (over the window, which
        # holds the probe's on-arm steps) says none can be is noise
        overruled = part == "route_ahead" and verdict and self._ra_cannot_pay()
        if overruled:
            verdict = False
            nums += f"; overruled by the gate's cost bound: {self._ra_cost_text()}"
        if part == HOST_PART:
            self._gate_watch = False  # the part's own probe judged it
        elif part == "route_ahead":
            self._ra_gated = not verdict  # off: it must earn its way back
            self._ra_watch = False  # its own probe judged it
        if verdict == now:
            if now:
                kept = "kept on (pays)"
            elif overruled:
                kept = "kept off (cannot save its own host time)"
            else:
                kept = "kept off (not shown to pay)"
            return self._probe_keeps(part, now, f"{kept}: {nums}")
        if verdict:
            why = "pays again"
        elif overruled:
            why = "cannot save its own host time"
        elif gain is not None and gain.mean < 0:
            why = "costs more than it saves"
        else:
            why = "not shown to pay"
        return self._probe_switches(
            part, verdict, f"switched {_word(verdict)} ({why}) by must-earn: {nums}"
        )

    def _judge(self) -> bool:
        """Test the probe's pairs; True when the probe ended (decided)."""
        part = self._part
        assert part is not None
        now = self._base.on(part)
        if self._probe_stance == "must_earn":
            return self._judge_must_earn(part, now)
        a_level = self.alpha_per_look(part, self._probe_stance)
        gains = self._flip_gains()
        if len(gains) < 2:
            return self._end_if_last(part, now, "too few pairs with tokens to compare", False)
        rate = paired_test(gains)
        rate_vote = rate.mean > self.margin and rate.p < a_level
        rate_futile = rate.upper(a_level) < self.margin
        rate_hint = rate.mean > self.margin and rate.p < self.alpha
        nums = (
            f"log {self.rate_of.replace('_', ' ')} tokens/s {_word(not now)} over "
            f"{_word(now)}: {rate.text()}"
        )
        cb_vote, cb_futile, cb_hint = False, True, False
        if part in COST_BENEFIT_PARTS:
            # the machinery's host seconds and exposed fetch with the part,
            # less those without it, per step's wall: > 0 costs more
            # than it saves; where it runs now, a switch off needs > margin,
            # where it is off, a switch on needs < -margin
            sign = 1.0 if now else -1.0
            nets, host_on, exp_on, exp_off = [], [], [], []
            for p in self._pairs:
                on_m, off_m = (p.a, p.b) if now else (p.b, p.a)
                host = _books_host(on_m, part) - _books_host(off_m, part)
                net = host + on_m.exposed_fetch_s - off_m.exposed_fetch_s
                nets.append(sign * net / (0.5 * (on_m.wall_s + off_m.wall_s)))
                host_on.append(host)
                exp_on.append(on_m.exposed_fetch_s)
                exp_off.append(off_m.exposed_fetch_s)
            books = paired_test(nets)
            # the books are far less noisy than the rate, but a proxy (a
            # wait the device's events do not see is no exposed fetch): each
            # flips the part only where the other does not point the other
            # way (its mean below -margin)
            rate_against = rate.mean < -self.margin
            cb_vote = books.mean > self.margin and books.p < a_level and not rate_against
            cb_futile = books.upper(a_level) < self.margin
            cb_hint = books.mean > self.margin and books.p < self.alpha and not rate_against
            rate_vote = rate_vote and books.mean >= -self.margin
            rate_hint = rate_hint and books.mean >= -self.margin
            nums += (
                f"; (cost - saving)/step wall, {'on' if now else 'off'} sign: {books.text()}; "
                f"host s/step in part {np.mean(host_on):.3g} on over off, exposed fetch s/step "
                f"{np.mean(exp_on):.3g} on, {np.mean(exp_off):.3g} off"
            )
        nums += (
            f"; need mean > margin {self.margin:.3g} at p < {a_level:.3g} "
            f"(alpha {self.alpha:.3g} over {len(self.looks)} looks"
            f"{' and 2 rules' if part in COST_BENEFIT_PARTS else ''})"
        )
        if rate_vote or cb_vote:
            if part == "route_ahead":
                self._ra_watch = False  # its own probe judged it
            why = "costs more than it saves" if now else "pays again"
            return self._probe_switches(
                part,
                not now,
                f"switched {_word(not now)} ({why}) by {_rules(rate_vote, cb_vote)}: {nums}",
            )
        if rate_futile and cb_futile:
            return self._probe_keeps(part, now, f"kept {_word(now)} (no gain): {nums}")
        return self._end_if_last(part, now, nums, rate_hint or cb_hint)

    def _end_if_last(self, part: str, now: bool, nums: str, hint: bool) -> bool:
        n = len(self._pairs)
        if n < self.max_pairs or (self._extended and n < self.max_pairs + self.extend_pairs):
            return False
        if not self._extended and hint and self.extend_pairs > 0:
            self._extended = True  # points to a flip: more pairs, pooled
            return False
        return self._probe_keeps(part, now, f"kept {_word(now)} (not shown): {nums}")

    def _end_probe(self) -> None:
        self._set(self._base)
        self._next_probe()

    def _probe_switches(self, part: str, on: bool, why: str) -> bool:
        """The probe's verdict switches ``part`` to ``on`` in the
        configuration it holds from now on; the next probe starts. True (the
        probe ended)."""
        self._books.switches += 1
        self._round_switched = True
        self._base = self._base.with_part(part, on)
        self._set(self._base)
        self._log(Decision(self._books.steps, part, on, True, why))
        self._next_probe()
        return True

    def _probe_keeps(self, part: str, on: bool, why: str) -> bool:
        """The probe's verdict keeps ``part`` as it was (``on``); the next
        probe starts. True (the probe ended)."""
        self._log(Decision(self._books.steps, part, on, False, why))
        self._end_probe()
        return True

    def _log(self, d: Decision) -> None:
        self._books.decisions.append(d)


def _looks(min_pairs: int, max_pairs: int, extend_pairs: int) -> tuple[int, ...]:
    """The pair counts a probe is tested at: each from ``min_pairs`` to
    ``max_pairs``, then every ``min_pairs`` pairs of an extension and its end."""
    out = list(range(min_pairs, max_pairs + 1))
    end = max_pairs + extend_pairs
    out += [n for n in range(max_pairs + min_pairs, end + 1, min_pairs)]
    if out[-1] != end:
        out.append(end)
    return tuple(out)


def _host(m: StepMeasurement, part: str) -> float:
    return float(m.part_host_s.get(part, 0.0))


def _books_host(m: StepMeasurement, part: str) -> float:
    """The host seconds ``part``'s books charge it in step ``m``."""
    if part in m.books_host_s:
        return float(m.books_host_s[part])
    return _host(m, part)


def _rules(rate_vote: bool, cb_vote: bool) -> str:
    if rate_vote and cb_vote:
        return "rate and cost/benefit"
    return "rate" if rate_vote else "cost/benefit" if cb_vote else "neither"


def _word(on: bool) -> str:
    return "on" if on else "off"


# ---------------------------------------------------------------- engine side
@dataclass
class _Marks:
    """Counter values at a step's start (for the step's deltas)."""

    t0: float = 0.0
    predict_span_s: float = 0.0
    route_ahead_predicted: int = 0
    route_ahead_hits: int = 0
    stage_s: dict[str, float] = field(default_factory=dict)
    stall_s: float = 0.0
    sched_n: int = 0
    bytes_in: int | None = None
    prefetch_in: int | None = None
    prefetch_wasted: int | None = None


class EngineParts:
    """The engine's switchable parts: what it was built with, and how a
    :class:`PartsState` is applied to it."""

    def __init__(self, engine: Engine, policy: PartsPolicy) -> None:
        from pdflash.engine.batching import DelegatingBatcher, PausableBatcher, ShadowComparison

        self.engine = engine
        self.policy = policy
        self.full_config = engine.config
        self.stream = engine.prefetch.built_stream
        batcher = engine.batcher
        self.switchable_batcher = (
            batcher
            if isinstance(batcher, ShadowComparison)
            and getattr(batcher.shadow, "name", None) == "deficit_tokens"
            else None
        )
        cfg = engine.config
        #: the hybrid miss service, switched through its ``enabled`` flag
        self.host_service = engine.host_service
        route_ahead = bool(cfg.route_ahead and engine.predictor is not None)
        self.available = PartsState(
            route_ahead=route_ahead,
            # without route-ahead no demand names a predicted expert: the
            # 2-D choice has no byte dimension to switch
            scheduler_2d=bool(
                route_ahead and cfg.batching == "deficit_2d" and self.switchable_batcher is not None
            ),
            stream=self.stream is not None,
            host_experts=self.host_service is not None,
        )
        self.applied: PartsState | None = None
        self.marks = _Marks()
        #: the stall timer's version and reading at the last step's end:
        #: the next step's start mark (:func:`_stall_mark`)
        self.stall_reading: tuple[int, float] | None = None
        #: the policy can rest (module docstring, "Rest"), and the step under
        #: way runs at rest: its measurement is skipped
        self.rests = isinstance(policy, RestingPolicy)
        self.resting = False
        #: the batcher paused at rest, its steps batched first-come by the
        #: engine (``rest_batching``; module docstring, "Rest"); None: the
        #: batcher runs at rest too
        self.rest_batcher: PausableBatcher | None = (
            batcher
            if cfg.rest_batching == "first_come"
            and isinstance(batcher, PausableBatcher)
            and not isinstance(batcher, DelegatingBatcher)
            else None
        )
        #: the step under way is batched first-come (at rest, with a
        #: :attr:`rest_batcher`)
        self.first_come = False
        #: the requests' acceptance, for each step's expected committed tokens
        self.survival = SurvivalEstimator(max(0, int(cfg.block_size) - 1))
        self._ended: list[int] = []
        policy.bind(self.available)
        self.apply(policy.parts)

    def forget(self, request_id: int) -> None:
        """The engine ended a request: its acceptance estimate is dropped at
        the end of the step (:meth:`forget_ended`; a step that measures
        still values and learns the request's last outcome by it)."""
        self._ended.append(request_id)

    def forget_ended(self) -> None:
        for rid in self._ended:
            self.survival.forget(rid)
        self._ended.clear()

    def apply(self, parts: PartsState) -> None:
        if parts == self.applied:
            return
        eng, cfg = self.engine, self.full_config
        route = parts.route_ahead and self.available.route_ahead
        # route-ahead off, its predictor still run and counted (no copy)
        eng.route_ahead_shadow = parts.shadows_route_ahead and self.available.route_ahead
        stream = route and parts.stream and self.stream is not None
        two_d = parts.scheduler_2d and self.available.scheduler_2d
        eng.config = cfg.replace(
            route_ahead=route,
            streaming_prefetch=stream,
            batching=cfg.batching
            if (two_d or not self.available.scheduler_2d)
            else "deficit_tokens",
        )
        # the planner pauses the stream (its plain gate lookahead runs instead)
        eng.prefetch.set_parts(route_ahead=route, stream=stream)
        if not route:
            # nothing predicted any more: no expert stays protected for it,
            # and no expert stays planned for the host from an old prediction
            setter = getattr(getattr(eng.expert_cache, "policy", None), "set_predicted", None)
            if setter is not None:
                setter(np.zeros(0, dtype=np.int64))
            eng.host_ahead = None
            if self.stream is not None:
                self.stream.skip[:] = False
        if self.switchable_batcher is not None and self.available.scheduler_2d:
            self.switchable_batcher.execute_shadow = not two_d
        if self.host_service is not None:
            host = parts.host_experts
            self.host_service.enabled = host
            if not host:
                # every miss is copied: nothing stays planned for the host
                eng.host_ahead = None
                eng.prefetch.set_host_planned(None)
        self.applied = parts


def attach(engine: Engine, policy: PartsPolicy) -> EngineParts:
    """Give ``engine`` a policy over its parts (called by the engine)."""
    return EngineParts(engine, policy)


def _cache_counter(cache: object, name: str) -> int | None:
    value = getattr(cache, name, None)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def _stall_mark(parts: EngineParts) -> float:
    """The stall timer at a step's start: the previous step's end reading
    where no wait was recorded and the timer was not reset since (its
    version unchanged), else a fresh reading. Exact or better: a wait
    recorded before that reading but completed on the device after it
    counts in this step instead of in neither."""
    timer = parts.engine.timer
    kept, parts.stall_reading = parts.stall_reading, None
    if kept is not None and kept[0] == timer.stall_version:
        return kept[1]
    return timer.stall_s_ready()


def _stall_end(parts: EngineParts) -> float:
    """The stall timer at a step's end, kept as the next step's start mark."""
    timer = parts.engine.timer
    now = timer.stall_s_ready()
    parts.stall_reading = (timer.stall_version, now)
    return now


def before_step(parts: EngineParts) -> None:
    """Apply the policy's parts and mark the counters (start of a step):
    at rest only the clock and the waits (module docstring, "Rest"), and the
    token-only shadow scheduler is not run (no demand names a predicted
    expert: there is no byte dimension to compare)."""
    eng = parts.engine
    parts.apply(parts.policy.parts)
    resting = parts.rests and cast(RestingPolicy, parts.policy).resting
    if resting != parts.resting:
        if parts.switchable_batcher is not None:
            parts.switchable_batcher.compare = not resting
        if resting and parts.rest_batcher is not None:
            parts.rest_batcher.pause()
    parts.resting = resting
    parts.first_come = resting and parts.rest_batcher is not None
    if resting:
        parts.marks = _Marks(t0=eng.clock(), stall_s=_stall_mark(parts))
        return
    cache = eng.expert_cache
    parts.marks = _Marks(
        t0=eng.clock(),
        predict_span_s=eng.timer.kind_s_ready("predict"),
        route_ahead_predicted=eng.route_ahead_predicted_n,
        route_ahead_hits=eng.route_ahead_hit_n,
        stage_s=dict(eng.prefetch.stage_s),
        stall_s=_stall_mark(parts),
        sched_n=len(eng.scheduler_us),
        bytes_in=_cache_counter(cache, "bytes_in"),
        prefetch_in=_cache_counter(cache, "prefetch_bytes_in"),
        prefetch_wasted=_cache_counter(cache, "prefetch_bytes_evicted_unused"),
    )


def _delta(now: int | None, then: int | None) -> int | None:
    return None if now is None or then is None else now - then


def expected_committed(
    survival: SurvivalEstimator, outcomes: Sequence[tuple[int, int, int]]
) -> float:
    """``Σ_i (1 + Σ_{j<=k_i} S_i(j))`` over ``(request id, drafts verified
    k_i, accepted)`` outcomes, with the estimator's survival as it stands
    (the outcomes' own draws not yet observed)."""
    total = 0.0
    for rid, verified, _ in outcomes:
        k = min(int(verified), survival.max_drafts)
        total += 1.0 + (float(survival.survival(rid)[:k].sum()) if k > 0 else 0.0)
    return total


def _learn_acceptance(parts: EngineParts, report: StepReport) -> float | None:
    """The step's expected committed tokens, then its outcomes learned (and
    the requests that ended since the last step forgotten)."""
    survival = parts.survival
    outcomes = report.verify_outcomes
    expected = expected_committed(survival, outcomes) if outcomes else None
    for rid, verified, accepted in outcomes:
        survival.observe(rid, verified, accepted)
    parts.forget_ended()
    return expected


def measure_step(parts: EngineParts, report: StepReport) -> StepMeasurement:
    """The step's measurement from the engine's counters (deltas since
    :func:`before_step`); learns the step's acceptance outcomes."""
    eng, mk = parts.engine, parts.marks
    stage = {k: v - mk.stage_s.get(k, 0.0) for k, v in eng.prefetch.stage_s.items()}
    sched_s = sum(eng.scheduler_us[mk.sched_n :]) * 1e-6
    # the predictor's span on the compute stream, not the host's wall around
    # it: on CUDA its first read of the device waits for the draft queued
    # before it, which is the draft's time, not its own
    predict_s = eng.timer.kind_s_ready("predict") - mk.predict_span_s
    prefetch_s = sum(stage.get(k, 0.0) for k in ("route_ahead", "stream_plan", "forward_hooks"))
    cache = eng.expert_cache
    return StepMeasurement(
        wall_s=max(0.0, eng.clock() - mk.t0),
        committed_tokens=int(report.committed_tokens),
        verified_tokens=int(report.verified_tokens),
        expected_committed_tokens=_learn_acceptance(parts, report),
        verified=report.verified > 0,
        admitted=int(report.admitted),
        part_host_s={
            "route_ahead": predict_s + stage.get("route_ahead", 0.0),
            "scheduler_2d": sched_s,
            "stream": stage.get("stream_plan", 0.0),
        },
        books_host_s={"route_ahead": predict_s + prefetch_s, "stream": prefetch_s},
        # NOTE: never a device synchronize per step: it would wait for the
        # prefetch copies issued to overlap the next draft
        exposed_fetch_s=max(0.0, _stall_end(parts) - mk.stall_s),
        bytes_in=_delta(_cache_counter(cache, "bytes_in"), mk.bytes_in),
        prefetch_bytes_in=_delta(_cache_counter(cache, "prefetch_bytes_in"), mk.prefetch_in),
        prefetch_wasted_bytes=_delta(
            _cache_counter(cache, "prefetch_bytes_evicted_unused"), mk.prefetch_wasted
        ),
        route_ahead_predicted=eng.route_ahead_predicted_n - mk.route_ahead_predicted,
        route_ahead_hits=eng.route_ahead_hit_n - mk.route_ahead_hits,
        expert_copy_s=_expert_copy_s(cache),
    )


def _expert_copy_s(cache: object) -> float | None:
    """One expert's copy time at the issuer's measured link rate (None:
    no rate measured, or no cache)."""
    nbytes = getattr(cache, "expert_nbytes", None)
    rate = link_rate_of(cache)
    if rate is None or not isinstance(nbytes, int) or nbytes <= 0:
        return None
    return nbytes / rate


def after_step(parts: EngineParts, report: StepReport) -> None:
    """Feed the step's measurement to the policy (end of a step); at rest
    only its wall, its waits and whether a hold counts it."""
    if parts.resting:
        eng, mk = parts.engine, parts.marks
        wall = max(0.0, eng.clock() - mk.t0)
        # nothing learned at rest, but nothing kept of a request that ended
        parts.forget_ended()
        cast(RestingPolicy, parts.policy).rest_step(
            RestStep(
                wall_s=wall,
                exposed_fetch_s=max(0.0, _stall_end(parts) - mk.stall_s),
                counted=report.verified > 0 and report.admitted == 0 and wall > 0.0,
            )
        )
        return
    parts.policy.observe(measure_step(parts, report))
