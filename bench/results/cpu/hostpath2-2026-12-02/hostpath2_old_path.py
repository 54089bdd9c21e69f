"""The per-layer host path of the eager offloaded call as it was before the
hostpath2 branch, patched in for before/after runs (CPU and H200):
``install()`` puts back a fresh page-locked tensor per slot-table upload,
the ``[2, experts]`` phase table gathered on the device by the routing
(and the rows' slots gathered per phase), and one new CUDA event per
release / unpin (waited on and dropped by the old ``_evict``): the tests'
copy of that path (``tests/hostpath_reference.py``'s ``OLD_PATH``).
Everything else is the installed package's.

    python -P -c "import sys; sys.path.insert(0, 'DIR'); import hostpath2_old_path as o; o.install(); o.main()" [eager_host args]
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# the old path's code is the differential tests' copy
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
_reference = importlib.import_module("hostpath_reference")


def install() -> None:
    """Patch the old path into the classes (the process's every instance)."""
    for cls, name, fn in _reference.OLD_PATH:
        setattr(cls, name, fn)


def main() -> None:
    from pdflash.bench.eager_host import main as eager_main

    sys.exit(eager_main(sys.argv[1:]))
