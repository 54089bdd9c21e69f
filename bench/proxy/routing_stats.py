"""Per-layer routing statistics of a trained MoE, and routing capture.

For top-k expert ids ``[tokens, layers, k]`` of contiguous text, per layer:

* ``load_entropy``: entropy of the expert load distribution (share of the
  routed slots each expert received) divided by ``log(E)``; 1.0 is perfectly
  balanced.
* ``block_union_B``: mean number of distinct experts a block of ``B``
  consecutive tokens routes to, and its ratio to two i.i.d. expectations:
  tokens drawing their k experts uniformly (``E * (1 - (1 - k/E)**B)``) and
  tokens drawing independently with this layer's measured per-expert
  inclusion rate ``pi_e`` (``sum_e 1 - (1 - pi_e)**B``). A ratio below 1 means
  consecutive tokens share experts (what makes a verify block cheap).
* ``repeat_rate``: mean fraction of a token's k experts also chosen by the
  previous token, beside the uniform i.i.d. value ``k / E`` and the
  load-matched one ``sum_e pi_e**2 / k``.

No published figure for these statistics is quoted here: none was available
offline with a source that could be cited; the report leaves that column out
rather than print an unsourced number.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

BLOCK_SIZES = (4, 16)


def layer_stats(
    topk: npt.NDArray[np.integer[Any]], num_experts: int, block_sizes: tuple[int, ...] = BLOCK_SIZES
) -> list[dict[str, float]]:
    """Statistics per layer of ``topk [tokens, layers, k]`` (one contiguous stream)."""
    if topk.ndim != 3:
        raise ValueError(f"topk must be [tokens, layers, k], got shape {topk.shape}")
    n, num_layers, k = topk.shape
    if n < 2:
        raise ValueError("need at least 2 tokens")
    out: list[dict[str, float]] = []
    for layer in range(num_layers):
        ids = topk[:, layer, :].astype(np.int64)
        counts = np.bincount(ids.reshape(-1), minlength=num_experts).astype(np.float64)
        share = counts / counts.sum()
        nz = share[share > 0]
        entropy = float(-(nz * np.log(nz)).sum() / np.log(num_experts))
        pi = counts / n  # inclusion probability per token
        member = np.zeros((n, num_experts), dtype=bool)
        member[np.arange(n)[:, None], ids] = True
        row: dict[str, float] = {
            "layer": float(layer),
            "load_entropy": entropy,
            "max_load_share": float(share.max()),
            "dead_experts": float((counts == 0).sum()),
        }
        for b in block_sizes:
            nb = n // b
            if nb == 0:
                continue
            blocks = member[: nb * b].reshape(nb, b, num_experts).any(axis=1)
            union = float(blocks.sum(axis=1).mean())
            iid_uniform = num_experts * (1.0 - (1.0 - k / num_experts) ** b)
            iid_load = float((1.0 - (1.0 - pi) ** b).sum())
            row[f"block_union_{b}"] = union
            row[f"block_union_{b}_vs_iid_uniform"] = union / iid_uniform
            row[f"block_union_{b}_vs_iid_load"] = union / iid_load
        overlap = (member[1:] & member[:-1]).sum(axis=1) / k
        row["repeat_rate"] = float(overlap.mean())
        row["repeat_rate_iid_uniform"] = k / num_experts
        row["repeat_rate_iid_load"] = float((pi**2).sum() / k)
        out.append(row)
    return out


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of every statistic over layers."""
    keys = [k for k in rows[0] if k != "layer"]
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def format_table(rows: list[dict[str, float]], block: int = 16) -> str:
    head = (
        f"{'layer':>5} {'entropy':>8} {'maxshare':>8} {'dead':>5} "
        f"{'U' + str(block):>7} {'/iidU':>6} {'/iidL':>6} {'repeat':>7} {'iidU':>6} {'iidL':>6}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{int(r['layer']):>5} {r['load_entropy']:>8.3f} {r['max_load_share']:>8.3f} "
            f"{int(r['dead_experts']):>5} {r.get(f'block_union_{block}', float('nan')):>7.2f} "
            f"{r.get(f'block_union_{block}_vs_iid_uniform', float('nan')):>6.3f} "
            f"{r.get(f'block_union_{block}_vs_iid_load', float('nan')):>6.3f} "
            f"{r['repeat_rate']:>7.3f} {r['repeat_rate_iid_uniform']:>6.3f} "
            f"{r['repeat_rate_iid_load']:>6.3f}"
        )
    return "\n".join(lines)


@contextmanager
def capture_routing(model: Any) -> Iterator[list[list[Any]]]:
    """Record every router call of a transformers qwen3_moe model.

    Yields ``calls``: one list per layer of ``[tokens, k]`` int64 CPU tensors,
    appended in forward order (the router's flattened ``batch * seq`` rows).
    """
    layers = model.model.layers
    calls: list[list[Any]] = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):

        def hook(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            calls[i].append(out[2].detach().to("cpu", non_blocking=False).long())

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_lookahead(model: Any) -> Iterator[list[list[tuple[Any, Any]]]]:
    """Record the next-layer gate lookahead of a transformers qwen3_moe model
    (:mod:`pdflash.traces`, ``token_lookahead``): per layer ``l``, layer
    ``l``'s router over its MoE norm of the residual stream entering layer
    ``l`` (attention skipped), as :class:`pdflash.routeahead.NextLayerLookahead`
    computes it in the engine (softmax over every expert, top-k by
    probability).

    Yields ``calls``: one list per layer of ``(ids [tokens, k] int64,
    probs [tokens, k] float32)`` CPU tensor pairs, appended in forward order.
    """
    layers = model.model.layers
    calls: list[list[tuple[Any, Any]]] = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):

        def hook(m: Any, args: Any, kwargs: Any, i: int = i) -> None:
            ids, top = _gate_topk(m, args[0] if args else kwargs["hidden_states"])
            calls[i].append((ids.cpu().long(), top.cpu()))

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def approx_router_topk(
    model: Any, hidden: Any
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Route-ahead's approximate router (:mod:`pdflash.traces`,
    ``token_approx``) over proxy residuals ``hidden [rows, H]`` of a
    transformers qwen3_moe model: per layer, its router over its MoE norm of
    the same ``hidden`` (the proxy feeds every layer alike), softmax over
    every expert, top-k by probability, as
    :class:`pdflash.routeahead.ApproxRouterPredictor` scores it. Returns
    ``([rows, layers, k] ids, [rows, layers, k] probs)``."""
    ids, probs = [], []
    for layer in model.model.layers:
        i, p = _gate_topk(layer, hidden)
        ids.append(i.cpu().long().numpy())
        probs.append(p.cpu().float().numpy())
    return np.stack(ids, axis=1), np.stack(probs, axis=1)


def _gate_topk(layer: Any, hidden: Any) -> tuple[Any, Any]:
    """A qwen3_moe decoder layer's router over its MoE norm of ``hidden``
    (rows flattened), scored as the engine scores its lookahead and
    approximate router: softmax over every expert, top-k by probability.
    Returns ``(ids [rows, k], probs [rows, k])`` on ``hidden``'s device."""
    import torch

    from pdflash.routeahead.predictors import _topk_gate_scores

    with torch.no_grad():
        gate = layer.mlp.gate
        normed = layer.post_attention_layernorm(hidden).reshape(-1, gate.weight.shape[1])
        logits = torch.nn.functional.linear(normed, gate.weight)
        return _topk_gate_scores(logits, int(gate.top_k), gate.weight.shape[0])


def stack_lookahead(
    calls: list[list[tuple[Any, Any]]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """``([rows, layers, k] ids, [rows, layers, k] probs)`` of the last
    forward :func:`capture_lookahead` recorded."""
    ids = np.stack([c[-1][0].numpy() for c in calls], axis=1)
    probs = np.stack([c[-1][1].numpy() for c in calls], axis=1)
    return ids, probs
