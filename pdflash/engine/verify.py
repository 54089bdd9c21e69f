"""The verify: one target forward over the chosen batch, then acceptance per
request. It returns outcomes and commits nothing: the engine commits each
outcome (KV rollback, tokens, stream) and keeps the books.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pdflash.engine.acceptance import AcceptanceModel
from pdflash.engine.attention import device_int64
from pdflash.engine.kv_cache import PagedKVCache
from pdflash.engine.requests import Request
from pdflash.engine.sampling import (
    greedy_accept,
    rejection_accept,
    sample_from,
    target_probs,
)
from pdflash.engine.target import Chunk, ForwardOutput, TargetRunner
from pdflash.engine.timing import ComputeTimer


@dataclass
class VerifyOutcome:
    """What one request's verified block yields; nothing of it is applied yet."""

    request: Request
    #: the request's KV length before the verify (its anchor's position)
    start: int
    #: drafts accepted (0..grant-1)
    accepted: int = 0
    #: accepted drafts then the bonus token
    tokens: tuple[int, ...] = ()
    #: the acceptance model forced the length (else the target decided)
    forced: bool = False
    #: target features of the committed positions (for the next draft), if drafting
    features: torch.Tensor | None = None
    #: acceptance of this request raised (the engine ends only this request)
    error: Exception | None = None

    @property
    def kv_length(self) -> int:
        """The request's KV length once committed: anchor + accepted drafts."""
        return self.start + self.accepted + 1


@dataclass
class VerifyResult:
    output: ForwardOutput
    #: ``(layers, experts)``: what any request of the batch routed to
    routed_union: npt.NDArray[np.bool_]
    outcomes: list[VerifyOutcome]


class Verifier:
    """Runs the verify forward of a batch and decides each request's
    acceptance (greedy prefix + bonus, lossless rejection sampling, or a
    forced length). It changes no request and no KV length beyond the
    forward's own appends, which the engine keeps or rolls back per outcome;
    the only state it advances is randomness (the requests' sampling
    generators, the acceptance model's draws)."""

    def __init__(
        self,
        runner: TargetRunner,
        kv: PagedKVCache,
        timer: ComputeTimer,
        acceptance: AcceptanceModel,
        device: torch.device,
        *,
        keep_features: bool,
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.timer = timer
        self.acceptance = acceptance
        self.device = device
        self.keep_features = keep_features

    def run(self, batch: Sequence[tuple[Request, int]]) -> VerifyResult:
        """Verify ``batch`` (request, tokens granted) in one forward. Raises
        only if the forward raises; an acceptance that raises is the
        outcome's ``error``. On a ``BaseException`` (e.g.
        ``KeyboardInterrupt``) after the forward, every request's KV is
        rolled back to its start before it propagates."""
        starts: list[int] = []
        # NOTE: one host->device copy for every anchor of the batch (a tensor
        # built from a list per request is one blocking copy each on CUDA),
        # and every request's anchor and drafts in one concatenation (one
        # launch, not one per request): the chunks' tokens are its slices
        anchors = anchor_tensor([req for req, _ in batch], self.device)
        parts: list[torch.Tensor] = []
        sizes: list[int] = []
        for i, (req, grant) in enumerate(batch):
            assert req.anchor is not None and req.drafts is not None
            drafts = req.drafts[: grant - 1]
            parts += [anchors[i : i + 1], drafts]
            sizes.append(1 + int(drafts.shape[0]))
            starts.append(self.kv.length(req.request_id))
        tokens = torch.split(torch.cat(parts), sizes) if parts else ()
        chunks = [
            Chunk(req.request_id, toks, True) for (req, _), toks in zip(batch, tokens, strict=True)
        ]
        with self.timer.forward("verify"):
            out = self.runner.forward(chunks)
        try:
            routed_union = np.asarray(out.routed.any(axis=0), dtype=np.bool_)
            greedy_host = self._greedy_to_host(batch, out.logits, out.logits_flat)
            outcomes: list[VerifyOutcome] = []
            for i, (req, grant) in enumerate(batch):
                outcome = VerifyOutcome(req, starts[i])
                try:
                    self._accept(outcome, grant, out, i, greedy_host)
                except Exception as exc:
                    outcome.error = exc
                outcomes.append(outcome)
        except BaseException:
            for (req, _), start in zip(batch, starts, strict=True):
                if self.kv.length(req.request_id) > start:
                    self.kv.truncate(req.request_id, start)
            raise
        return VerifyResult(out, routed_union, outcomes)

    def _accept(
        self,
        outcome: VerifyOutcome,
        grant: int,
        out: ForwardOutput,
        i: int,
        greedy_host: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        req = outcome.request
        logits = out.logits[i]
        n = grant - 1
        assert req.drafts is not None
        drafts = req.drafts[:n]
        forced = self.acceptance.forced_accepts(req.request_id, n)
        if req.params.greedy:
            # the same drafts and argmax, already on the host (one copy per batch)
            drafts, argmax = greedy_host[i]
            if forced is None:
                acc, bonus = greedy_accept(drafts, argmax)
            else:
                acc, bonus = forced, int(argmax[forced])
        else:
            tp = target_probs(logits, req.params)
            if forced is None:
                assert req.draft_probs is not None or n == 0
                dp = req.draft_probs[:n] if req.draft_probs is not None else tp[:0]
                acc, bonus = rejection_accept(drafts, dp, tp, req.generator)
            else:
                acc = forced
                bonus = int(sample_from(tp[acc : acc + 1], req.generator)[0])
        outcome.accepted = int(acc)
        outcome.tokens = (*(int(t) for t in drafts[:acc].tolist()), int(bonus))
        outcome.forced = forced is not None
        outcome.features = out.features[i][: acc + 1] if self.keep_features else None

    def _greedy_to_host(
        self,
        batch: Sequence[tuple[Request, int]],
        logits: Sequence[torch.Tensor],
        logits_flat: torch.Tensor | None = None,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """For each greedy request of the batch (by position): its granted
        drafts and the target's argmax rows, on the host.

        NOTE: acceptance reads these values on the host anyway; reading each
        request's with its own ``int()``/``tolist()`` meant about three
        device syncs per request per step. Here every argmax is launched
        first and all of them (and the drafts) come back in one copy. When
        every request is greedy and ``logits_flat`` holds every request's
        rows in order (``logits`` its slices), the argmax is one kernel over
        it (the same rows, so the same values) instead of one per request.
        """
        rows = [i for i, (req, _) in enumerate(batch) if req.params.greedy]
        if not rows:
            return {}
        counts = [int(t.shape[0]) for t in logits]
        joint: list[torch.Tensor] | None = None
        if (
            logits_flat is not None
            and len(rows) == len(batch) == len(logits)
            and int(logits_flat.shape[0]) == sum(counts)
        ):
            joint = list(torch.split(torch.argmax(logits_flat, dim=-1), counts))
        parts: list[torch.Tensor] = []
        sizes: list[int] = []
        for i in rows:
            req, grant = batch[i]
            assert req.drafts is not None
            drafts = req.drafts[: grant - 1].reshape(-1).to(torch.int64)
            if joint is not None:
                argmax = joint[i].to(torch.int64)
            else:
                argmax = torch.argmax(logits[i], dim=-1).reshape(-1).to(torch.int64)
            parts += [drafts, argmax]
            sizes += [int(drafts.numel()), int(argmax.numel())]
        host = torch.split(torch.cat(parts).cpu(), sizes)
        return {i: (host[2 * j], host[2 * j + 1]) for j, i in enumerate(rows)}


def anchor_tensor(reqs: Sequence[Request], device: torch.device) -> torch.Tensor:
    """``[len(reqs)]`` int64 anchors on the device, in one asynchronous copy."""
    anchors: list[int] = [int(r.anchor) for r in reqs if r.anchor is not None]
    if len(anchors) != len(reqs):
        raise ValueError("every request needs an anchor")
    return device_int64([anchors], device)[0]
