"""The SASS of the CUDA MXFP4 GEMM kernels whose mangled names contain
``--match`` (cuobjdump over the built ``pdflash_native._mxfp4gemm``), written
to ``--out``; prints each matched function's instruction count and its
wgmma count. Off the machine, the dump is read for the main loop's
instruction mix (what the kernel issues per 128-k chunk)::

    python3 -P bench/h200/mxfp4_cuda/sass_dump.py --match ILi8ELi1ELi8ELi4 --out sass.txt
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", required=True, help="a substring of the mangled kernel names")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    import pdflash_native._mxfp4gemm as mod

    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    dump = subprocess.run(
        [tool, "-sass", str(mod.__file__)], capture_output=True, text=True, check=True
    ).stdout
    # functions start at "Function : <name>" lines
    parts = re.split(r"(?m)^\s*Function : ", dump)
    kept = [p for p in parts[1:] if args.match in p.split("\n", 1)[0]]
    if not kept:
        print(f"no function matches {args.match!r}", file=sys.stderr)
        return 1
    args.out.write_text("".join("Function : " + p for p in kept))
    for p in kept:
        body = p.split("\n")
        insns = [line for line in body if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
        wgmma = sum("HGMMA" in line for line in insns)
        print(f"{body[0].strip()[:120]}: {len(insns)} instructions, {wgmma} HGMMA")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
