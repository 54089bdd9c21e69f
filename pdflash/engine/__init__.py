"""The DFlash serving engine: drafter, paged KV, batched verify, sessions.

Entry points: :class:`Engine` with :class:`EngineConfig` (``EngineConfig.preset``
gives the docs/design.md §6 baselines B0/B1/B2/B3/PD), :func:`load_drafter` /
:func:`write_synthetic_drafter` for DFlash draft checkpoints, and
:func:`pdflash.bench.engine_run.run_spec` (in the benchmark harness, not in
this package) for one benchmark run.

Example (B1: DFlash, FCFS batching, experts offloaded to a 20% cache)::

    issuer = H2DIssuer()
    target = load_adapter(target_dir, device="cuda", issuer=issuer, cache_fraction=0.2)
    drafter = load_drafter(drafter_dir, device="cuda")
    engine = Engine(target, EngineConfig.preset("B1", block_size=16, max_running=8),
                    drafter=drafter, expert_cache=target.cache, device="cuda")
    rid = engine.add_request(prompt_ids, SamplingParams(), max_new_tokens=128,
                             on_token=lambda rid, tok: print(tok))
    engine.run_until_done()
    print(engine.request(rid).metrics)
"""

from __future__ import annotations

from pdflash._guard import ConcurrentUseError
from pdflash.engine.acceptance import (
    AcceptanceModel,
    ForcedAcceptance,
    ModelAcceptance,
    default_mean_tau,
)
from pdflash.engine.batching import (
    BatchDecision,
    DeficitBatcher,
    FCFSBatcher,
    VerifyBatcher,
    VerifyDemand,
)
from pdflash.engine.config import BASELINES, EngineConfig
from pdflash.engine.drafter import (
    DFlashDrafter,
    DrafterConfig,
    load_drafter,
    write_synthetic_drafter,
)
from pdflash.engine.engine import (
    Engine,
    Request,
    RequestMetrics,
    RequestState,
    StepReport,
    TokenCallbackError,
)
from pdflash.engine.kv_cache import KVCacheFull, PagedKVCache
from pdflash.engine.pd_controller import (
    FixedParts,
    PartsPolicy,
    PartsState,
    PDController,
    RestingPolicy,
    RestStep,
    StepMeasurement,
)
from pdflash.engine.replay import RoutingSource, TraceAcceptance, TraceRouting
from pdflash.engine.sampling import SamplingParams

__all__ = [
    "BASELINES",
    "AcceptanceModel",
    "BatchDecision",
    "ConcurrentUseError",
    "DFlashDrafter",
    "DeficitBatcher",
    "DrafterConfig",
    "Engine",
    "EngineConfig",
    "FCFSBatcher",
    "FixedParts",
    "ForcedAcceptance",
    "KVCacheFull",
    "ModelAcceptance",
    "PDController",
    "PagedKVCache",
    "PartsPolicy",
    "PartsState",
    "Request",
    "RequestMetrics",
    "RequestState",
    "RestStep",
    "RestingPolicy",
    "RoutingSource",
    "SamplingParams",
    "StepMeasurement",
    "StepReport",
    "TokenCallbackError",
    "TraceAcceptance",
    "TraceRouting",
    "VerifyBatcher",
    "VerifyDemand",
    "default_mean_tau",
    "load_drafter",
    "write_synthetic_drafter",
]
