"""The proxy trace: learned routing and acceptance, without the weights.

One ``.npz`` file (``numpy.savez_compressed``) with these arrays (``R`` =
requests, ``L`` = MoE layers, ``k`` = experts per token, ids stored as
``uint8`` when the model has <= 256 experts, else ``int16``):

``tokens``            ``[T]`` uint16/int32: every request's prompt then its
                      generated tokens, requests concatenated.
``token_request``     ``[R + 1]`` int64: offsets of each request in ``tokens``.
``prompt_len``        ``[R]`` int32.
``token_topk``        ``[T, L, k]``: top-k experts of every token, from one
                      teacher-forced target forward over prompt + output (what
                      a verify routes for committed positions).
``round_request``     ``[N]`` int32: the request of each verify round, in order.
``round_accepted``    ``[N]`` int16: tokens committed by the round (accepted
                      drafts + 1).
``round_rows``        ``[N]`` int16: rows the round verified (anchor + drafts).
``verify_topk``       ``[sum round_rows, L, k]``: routing of every verified
                      row, rejected drafts included, rounds concatenated.
``verify_tokens``     ``[sum round_rows]``: the verified block's tokens.
``provenance``        0-d unicode: JSON with at least ``format``,
                      ``version``, ``num_experts``, ``top_k``, ``num_layers``,
                      ``block_size``, ``temperature``, ``target_weights_sha256``,
                      ``drafter_weights_sha256``, ``target_preset``,
                      ``prompts_source`` and ``model_hash`` fields.

Optional, all four or none (:data:`LOOKAHEAD_ARRAYS`): the next-layer gate
lookahead the engine runs inside a verify (:class:`pdflash.routeahead.NextLayerLookahead`),
as the trained model computes it, so a replay on synthetic weights can
predict the replayed routing as the live model would instead of running the
synthetic router:

``token_lookahead``         ``[T, L, k]``: per token and layer ``l``, the
                            top-k of layer ``l``'s router over layer ``l``'s
                            MoE norm of the residual stream *entering* layer
                            ``l`` (layer ``l - 1``'s output; the embeddings for
                            layer 0), layer ``l``'s attention skipped; ranked
                            by gate probability (softmax over all experts).
``token_lookahead_probs``   ``[T, L, k]`` float16: those gate probabilities.
``verify_lookahead``        ``[sum round_rows, L, k]`` and
``verify_lookahead_probs``  the same for every verified row.

Optional, all four or none (:data:`APPROX_ARRAYS`): what route-ahead's
approximate router (:class:`pdflash.routeahead.ApproxRouterPredictor`, the
router pass of PD's ``union`` source) predicts on the trained model, so a
replay need not run the synthetic router before a verify:

``token_approx``            ``[T, L, k]``: per token and layer, the top-k of
                            that layer's router over its MoE norm of the
                            drafter's hidden state for the token's position
                            (the ``drafter`` proxy, which ``auto`` picks where
                            the drafter exposes one), teacher-forced: the
                            first draft row of the block anchored one
                            position before (position 0: its own anchor
                            row); ranked by gate probability (softmax over
                            all experts).
``token_approx_probs``      ``[T, L, k]`` float16: those gate probabilities.
``verify_approx``           ``[sum round_rows, L, k]`` and
``verify_approx_probs``     per verified row, the same over the drafter's
                            hidden state for that row as decoding drafted it.

Optional, both or none (:data:`APPROX_EMBED_ARRAYS`), for offline reads of
the other proxy: ``token_approx_embed`` / ``token_approx_embed_probs``
``[T, L, k]``, the same router over the token's embedding (the ``embed``
proxy). Replays do not read them.

:func:`save_trace` validates before writing; :func:`load_trace` validates
after reading, so a reader never sees an inconsistent trace.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

FORMAT = "pdflash-proxy-trace"
VERSION = 1
REQUIRED_PROVENANCE = (
    "format",
    "version",
    "num_experts",
    "top_k",
    "num_layers",
    "block_size",
    "temperature",
    "target_weights_sha256",
    "drafter_weights_sha256",
    "target_preset",
    "prompts_source",
)
ARRAYS = (
    "tokens",
    "token_request",
    "prompt_len",
    "token_topk",
    "round_request",
    "round_accepted",
    "round_rows",
    "verify_topk",
    "verify_tokens",
)
#: the optional next-layer lookahead arrays (module doc): all or none
LOOKAHEAD_ARRAYS = (
    "token_lookahead",
    "token_lookahead_probs",
    "verify_lookahead",
    "verify_lookahead_probs",
)

#: the optional approximate-router arrays (module doc): all or none
APPROX_ARRAYS = (
    "token_approx",
    "token_approx_probs",
    "verify_approx",
    "verify_approx_probs",
)
#: the optional embedding-proxy arrays of token rows (module doc): both or none
APPROX_EMBED_ARRAYS = ("token_approx_embed", "token_approx_embed_probs")
#: the optional arrays, by group
OPTIONAL_ARRAYS = (LOOKAHEAD_ARRAYS, APPROX_ARRAYS, APPROX_EMBED_ARRAYS)


class TraceFormatError(ValueError):
    """A trace file or object that does not follow the format."""


@dataclass
class ProxyTrace:
    tokens: npt.NDArray[Any]
    token_request: npt.NDArray[np.int64]
    prompt_len: npt.NDArray[np.int32]
    token_topk: npt.NDArray[Any]
    round_request: npt.NDArray[np.int32]
    round_accepted: npt.NDArray[np.int16]
    round_rows: npt.NDArray[np.int16]
    verify_topk: npt.NDArray[Any]
    verify_tokens: npt.NDArray[Any]
    provenance: dict[str, Any]
    token_lookahead: npt.NDArray[Any] | None = None
    token_lookahead_probs: npt.NDArray[np.float16] | None = None
    verify_lookahead: npt.NDArray[Any] | None = None
    verify_lookahead_probs: npt.NDArray[np.float16] | None = None
    token_approx: npt.NDArray[Any] | None = None
    token_approx_probs: npt.NDArray[np.float16] | None = None
    verify_approx: npt.NDArray[Any] | None = None
    verify_approx_probs: npt.NDArray[np.float16] | None = None
    token_approx_embed: npt.NDArray[Any] | None = None
    token_approx_embed_probs: npt.NDArray[np.float16] | None = None

    @property
    def num_requests(self) -> int:
        return int(self.prompt_len.size)

    @property
    def has_lookahead(self) -> bool:
        """Whether the trace records the next-layer lookahead (module doc)."""
        return self.token_lookahead is not None

    @property
    def has_approx(self) -> bool:
        """Whether the trace records route-ahead's approximate router (module doc)."""
        return self.token_approx is not None

    def request_tokens(self, r: int) -> npt.NDArray[Any]:
        return self.tokens[self.token_request[r] : self.token_request[r + 1]]

    def acceptance(self, r: int) -> npt.NDArray[np.int16]:
        result: npt.NDArray[np.int16] = self.round_accepted[self.round_request == r]
        return result

    def validate(self) -> None:
        prov = self.provenance
        missing = [k for k in REQUIRED_PROVENANCE if k not in prov]
        if missing:
            raise TraceFormatError(f"provenance is missing {missing}")
        if prov["format"] != FORMAT or int(prov["version"]) != VERSION:
            raise TraceFormatError(
                f"not a {FORMAT} v{VERSION} trace: {prov['format']} v{prov['version']}"
            )
        n_layers, k, n_exp = int(prov["num_layers"]), int(prov["top_k"]), int(prov["num_experts"])
        R = self.prompt_len.size
        if self.token_request.shape != (R + 1,) or self.token_request[0] != 0:
            raise TraceFormatError("token_request must be R + 1 offsets starting at 0")
        if np.any(np.diff(self.token_request) <= self.prompt_len):
            raise TraceFormatError("every request needs its prompt and at least one output token")
        T = int(self.token_request[-1])
        if self.tokens.shape != (T,):
            raise TraceFormatError(f"tokens has shape {self.tokens.shape}, offsets say {T}")
        for name in ("token_topk", "verify_topk"):
            a = getattr(self, name)
            if a.ndim != 3 or a.shape[1:] != (n_layers, k):
                raise TraceFormatError(f"{name} has shape {a.shape}, expected [*, {n_layers}, {k}]")
            if a.size and (int(a.min()) < 0 or int(a.max()) >= n_exp):
                raise TraceFormatError(f"{name} holds an expert id outside [0, {n_exp})")
        if self.token_topk.shape[0] != T:
            raise TraceFormatError("token_topk must have one row per token")
        for group in OPTIONAL_ARRAYS:
            self._validate_optional(group, n_layers, k, n_exp)
        N = self.round_request.size
        if self.round_accepted.shape != (N,) or self.round_rows.shape != (N,):
            raise TraceFormatError("round arrays must have equal lengths")
        if N and (self.round_request.min() < 0 or self.round_request.max() >= R):
            raise TraceFormatError("round_request names an unknown request")
        if np.any(self.round_accepted < 1) or np.any(self.round_accepted > self.round_rows):
            raise TraceFormatError("round_accepted must be in [1, round_rows]")
        if np.any(self.round_rows > int(prov["block_size"])):
            raise TraceFormatError("a round verified more rows than the block size")
        V = int(self.round_rows.astype(np.int64).sum())
        if self.verify_topk.shape[0] != V or self.verify_tokens.shape != (V,):
            raise TraceFormatError(f"verify arrays must have sum(round_rows) = {V} rows")
        # every request's output = first token (prefill) + its rounds' commits
        for r in range(R):
            out = int(self.token_request[r + 1] - self.token_request[r] - self.prompt_len[r])
            if out != 1 + int(self.acceptance(r).astype(np.int64).sum()):
                raise TraceFormatError(
                    f"request {r}: {out} output tokens but its rounds commit "
                    f"{int(self.acceptance(r).sum())} (+1 from prefill)"
                )

    def _validate_optional(self, group: tuple[str, ...], n_layers: int, k: int, n_exp: int) -> None:
        """One optional group (``token_X``, its probs[, ``verify_X``, its
        probs]): all or none, shaped as the token and verify rows,
        probabilities in [0, 1] as float16."""
        present = [n for n in group if getattr(self, n) is not None]
        if not present:
            return
        kind = group[0].removeprefix("token_")
        if len(present) != len(group):
            missing = sorted(set(group) - set(present))
            raise TraceFormatError(f"{kind} arrays come all or none; missing {missing}")
        pairs = [(group[0], self.token_topk)]
        if len(group) == 4:
            pairs.append((group[2], self.verify_topk))
        for ids_name, rows_of in pairs:
            ids, probs = getattr(self, ids_name), getattr(self, ids_name + "_probs")
            want = (rows_of.shape[0], n_layers, k)
            if ids.shape != want or probs.shape != want:
                raise TraceFormatError(
                    f"{ids_name} {ids.shape} / its probs {probs.shape} must be {list(want)}"
                )
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_exp):
                raise TraceFormatError(f"{ids_name} holds an expert id outside [0, {n_exp})")
            if probs.dtype != np.float16:
                raise TraceFormatError(f"{ids_name}_probs must be float16, got {probs.dtype}")
            p = probs.astype(np.float32)
            if probs.size and not (np.isfinite(p).all() and p.min() >= 0.0 and p.max() <= 1.0):
                raise TraceFormatError(f"{ids_name}_probs must be probabilities in [0, 1]")


def expert_dtype(num_experts: int) -> type[np.integer[Any]]:
    return np.uint8 if num_experts <= 256 else np.int16


def token_dtype(vocab_size: int) -> type[np.integer[Any]]:
    return np.uint16 if vocab_size <= 65536 else np.int32


def save_trace(trace: ProxyTrace, path: str | os.PathLike[str]) -> Path:
    trace.validate()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {name: getattr(trace, name) for name in ARRAYS}
    for group in OPTIONAL_ARRAYS:
        if getattr(trace, group[0]) is not None:
            arrays |= {name: getattr(trace, name) for name in group}
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez_compressed(
        tmp, provenance=np.array(json.dumps(trace.provenance, sort_keys=True)), **arrays
    )
    tmp.replace(out)
    return out


def load_trace(path: str | os.PathLike[str]) -> ProxyTrace:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [n for n in (*ARRAYS, "provenance") if n not in z.files]
            if missing:
                raise TraceFormatError(f"{path}: missing arrays {missing}")
            arrays = {n: z[n] for n in ARRAYS}
            arrays |= {n: z[n] for group in OPTIONAL_ARRAYS for n in group if n in z.files}
            prov = json.loads(str(z["provenance"]))
    except (OSError, ValueError) as e:
        if isinstance(e, TraceFormatError):
            raise
        raise TraceFormatError(f"{path}: not a readable trace ({e})") from e
    trace = ProxyTrace(provenance=prov, **arrays)
    trace.validate()
    return trace
