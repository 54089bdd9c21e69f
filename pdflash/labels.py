"""The labels a benchmark run records: the baselines of docs/design.md §6 and
PD's ablations.

What each label runs is :meth:`pdflash.engine.config.EngineConfig.preset`
(its module doc has the table); which labels a result row may carry is
:mod:`pdflash.report.schema`. Both read the labels from here; this module
imports nothing, so the report has them without importing the engine.
"""

from __future__ import annotations

#: PD with every part forced on (no controller) and PD with one part switched
#: off (issue 15's ablation; ``PD-full-width``: every draft verified instead
#: of the adaptive verify width): labels of their own, so their rows never
#: count as PD's; in the order the ablation suite runs them within a repeat
#: (after PD).
ABLATIONS: tuple[str, ...] = (
    "PD-all-on",
    "PD-no-route-ahead",
    "PD-one-band",
    "PD-token-sched",
    "PD-no-stream",
    "PD-full-width",
)

#: Every label a run may record, in the order the report lists them;
#: ``PD+host`` is PD with the hybrid miss service (issue 16), then PD's
#: ablations.
BASELINES: tuple[str, ...] = ("B0", "B1", "B2", "B3", "PD", "PD+host", *ABLATIONS)
