"""pdflash: serve Mixture-of-Experts models with experts in host memory.

DFlash block-diffusion drafts a block; route-ahead predicts the experts its
verify pass needs and copies them over PCIe early, in priority bands; a 2-D
{tokens, expert-bytes} deficit scheduler batches the verify steps.
"""

from __future__ import annotations

from pdflash._native import NativeExtensionError, load_all

# Fail at import, naming the module, if the build is incomplete: this runs
# before anything below imports a native module on its own.
_NATIVE = load_all()

from pdflash.h2d import H2DIssuer  # noqa: E402
from pdflash.protocols import Band  # noqa: E402
from pdflash.scheduler import SchedulerConfig, StepResult, VerifyScheduler  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Band",
    "H2DIssuer",
    "NativeExtensionError",
    "SchedulerConfig",
    "StepResult",
    "VerifyScheduler",
    "__version__",
]
