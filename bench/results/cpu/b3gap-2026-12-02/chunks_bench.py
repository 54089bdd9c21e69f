"""The verifier's chunk building at 16 requests x (anchor + 15 drafts) on
the CPU: one ``torch.cat`` per request (before) vs one ``torch.cat`` of
every request's parts and a split (after). Median of 7 runs of 2000 builds
each, µs per build.

    python bench/results/cpu/b3gap-2026-12-02/chunks_bench.py
"""

import statistics
import timeit

import torch

torch.set_num_threads(1)
anchors = torch.arange(16)
drafts = [torch.randint(0, 1000, (15,)) for _ in range(16)]


def before() -> list[torch.Tensor]:
    return [torch.cat([anchors[i : i + 1], d]) for i, d in enumerate(drafts)]


def after() -> tuple[torch.Tensor, ...]:
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    for i, d in enumerate(drafts):
        parts += [anchors[i : i + 1], d]
        sizes.append(1 + int(d.shape[0]))
    return torch.split(torch.cat(parts), sizes)


assert all(torch.equal(a, b) for a, b in zip(before(), after(), strict=True))
for f in (before, after):
    t = [1e6 * x / 2000 for x in timeit.repeat(f, number=2000, repeat=7)]
    print(f.__name__, round(statistics.median(t), 1), [round(x, 1) for x in t])
