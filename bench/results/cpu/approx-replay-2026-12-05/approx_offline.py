"""Offline: how well a trace's recorded approximate router (drafter proxy,
as decoded and teacher-forced; embedding proxy) and the previous round
predict a round's routed experts, per layer, over the round's first rows
(coverage = routed experts predicted / routed; precision = predicted
experts that were routed; means over rounds and layers).

    python3 bench/results/cpu/approx-replay-2026-12-05/approx_offline.py TRACE
"""

import sys
from typing import Any

import numpy as np

from pdflash import traces as tf

trace = tf.load_trace(sys.argv[1])
assert trace.verify_approx is not None and trace.token_approx is not None
assert trace.token_approx_embed is not None
layers = int(trace.provenance["num_layers"])
rows = trace.round_rows.astype(np.int64)
starts = np.concatenate([[0], np.cumsum(rows)[:-1]])


def score(predicted: list[Any], routed: list[Any]) -> tuple[float, float]:
    cov = prec = 0.0
    n = 0
    for p, r in zip(predicted, routed, strict=True):
        for layer in range(layers):
            want = set(r[:, layer].ravel().tolist())
            got = set(p[:, layer].ravel().tolist())
            cov += len(got & want) / len(want)
            prec += len(got & want) / len(got)
            n += 1
    return cov / n, prec / n


# each round's first position in its request's token rows (rounds start after
# the prompt and advance by their commits)
first_row = np.zeros(rows.size, dtype=np.int64)
pos = {r: int(trace.prompt_len[r]) for r in range(trace.num_requests)}
for i, (req, acc) in enumerate(
    zip(trace.round_request.tolist(), trace.round_accepted.tolist(), strict=True)
):
    first_row[i] = int(trace.token_request[req]) + pos[req]
    pos[req] += acc

for horizon in (1, 2, 4, 16):
    approx, routed, prev, prev_routed = [], [], [], []
    embed, taught, embed_routed = [], [], []
    last: dict[int, Any] = {}
    for i, (s, n) in enumerate(zip(starts.tolist(), rows.tolist(), strict=True)):
        m = min(horizon, n)
        approx.append(trace.verify_approx[s : s + m])
        routed.append(trace.verify_topk[s : s + m])
        # the token rows' proxies on the same rows (the token rows at those
        # positions), where the verified token is the committed one
        t0 = int(first_row[i])
        t1 = min(t0 + m, int(trace.token_request[int(trace.round_request[i]) + 1]))
        same = trace.tokens[t0:t1] == trace.verify_tokens[s : s + (t1 - t0)]
        k = int(np.argmin(same)) if not same.all() else t1 - t0
        if k:
            embed.append(trace.token_approx_embed[t0 : t0 + k])
            taught.append(trace.token_approx[t0 : t0 + k])
            embed_routed.append(trace.verify_topk[s : s + k])
        req = int(trace.round_request[i])
        if req in last:
            prev.append(last[req])
            prev_routed.append(trace.verify_topk[s : s + m])
        last[req] = trace.verify_topk[s : s + n]
    c, p = score(approx, routed)
    c2, p2 = score(prev, prev_routed)
    c4, p4 = score(embed, embed_routed)
    c5, p5 = score(taught, embed_routed)
    print(
        f"rows <= {horizon}: drafter proxy as decoded {c:.3f} / {p:.3f}; committed rows only: "
        f"drafter proxy teacher-forced {c5:.3f} / {p5:.3f}, embedding proxy {c4:.3f} / {p4:.3f}; "
        f"previous round {c2:.3f} / {p2:.3f} (coverage / precision)"
    )
