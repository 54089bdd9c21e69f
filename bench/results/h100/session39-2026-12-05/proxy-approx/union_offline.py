"""Offline: how precise route-ahead's union could be before a verify on the
trained proxy's trace, in the trace's own expert space (128 experts top-8,
not the 32 the gpt-oss replay maps them onto): per round (after a request's
first) and layer, the experts the round's first H rows routed against the
approximate router's top-8 over the same rows as decoded (``approx``), the
previous round's first H rows' routed experts (``prev``), their union (PD's
``union`` source), their intersection (``both``), and the approximate
router's experts whose summed probability exceeds 0.3; coverage = routed
experts predicted / routed, precision = predicted experts routed (sums over
rounds and layers).

    python3 bench/results/h100/session39-2026-12-05/proxy-approx/union_offline.py TRACE H
"""

import sys

import numpy as np

from pdflash import traces as tf

trace = tf.load_trace(sys.argv[1])
horizon = int(sys.argv[2])
assert trace.verify_approx is not None and trace.verify_approx_probs is not None
layers = int(trace.provenance["num_layers"])
rows = trace.round_rows.astype(np.int64)
starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
totals = {k: [0, 0, 0] for k in ("approx", "prev", "union", "both", "approx p > 0.3")}
prev: list[set[int]] | None = None
prev_request = -1
for i, (s, n) in enumerate(zip(starts.tolist(), rows.tolist(), strict=True)):
    h = min(horizon, n)
    routed = [set(trace.verify_topk[s : s + h, layer].ravel().tolist()) for layer in range(layers)]
    request = int(trace.round_request[i])
    if prev is not None and request == prev_request:
        for layer in range(layers):
            approx = set(trace.verify_approx[s : s + h, layer].ravel().tolist())
            mass: dict[int, float] = {}
            for r in range(s, s + h):
                ids = trace.verify_approx[r, layer].tolist()
                ps = trace.verify_approx_probs[r, layer].tolist()
                for e, p in zip(ids, ps, strict=True):
                    mass[e] = mass.get(e, 0.0) + float(p)
            sets = {
                "approx": approx,
                "prev": prev[layer],
                "union": approx | prev[layer],
                "both": approx & prev[layer],
                "approx p > 0.3": {e for e, p in mass.items() if p > 0.3},
            }
            for name, predicted in sets.items():
                t = totals[name]
                t[0] += len(predicted & routed[layer])
                t[1] += len(predicted)
                t[2] += len(routed[layer])
    prev, prev_request = routed, request
print(f"rows <= {horizon}:")
for name, (hit, named, want) in totals.items():
    print(
        f"  {name:>15}: coverage {hit / want:.3f} precision "
        f"{hit / named if named else float('nan'):.3f} (predicted / routed {named / want:.2f})"
    )
