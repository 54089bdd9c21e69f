"""Before/after eager_host runs on the CPU, alternated (this box is shared:
medians of several runs, relative only). ``BEFORE`` is a site directory
holding main's pdflash (with this branch's bench/eager_host.py, so both
sides count torch calls); the installed package is the branch.

    python3 lookahead_measure.py BEFORE_SITE OUT.jsonl REPS -- eager_host args...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

before, out, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
args = sys.argv[sys.argv.index("--") + 1 :]
cmd = [sys.executable, "-P", "-m", "pdflash.bench.eager_host", *args]
with open(out, "a") as f:
    for rep in range(reps):
        for side in ("before", "after"):
            env = dict(os.environ)
            if side == "before":
                env["PYTHONPATH"] = before
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            f.write(json.dumps({"side": side, "rep": rep, "args": args, "result": row}) + "\n")
            f.flush()
            print(side, rep, round(row["forward_us"]), flush=True)
