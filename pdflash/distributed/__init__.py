"""Expert-parallel offload over torch.distributed (issue 18).

One process per rank (torchrun environment, or :func:`launch`); attention and
dense parts replicated; experts partitioned by an :class:`ExpertPlacement`;
per MoE layer the routed rows go to their experts' owners with
``all_to_all_single`` and come back the same way (:mod:`.moe`). Each rank's
:class:`~pdflash.cache.ExpertCache`, H2D issuer and route-ahead copies work on
its own experts over its own link, and each rank's host store packs (and
pins) only its own experts (``load_adapter(owned_experts=``
:func:`owned_experts_of` ``)``): host memory per rank is the model's
expert bytes over ``N`` for a balanced placement, not all of them.
:mod:`.simulate` predicts the scaling
from measured single-GPU rows.
"""

from .group import (
    RankGroup,
    current_group,
    distributed_available,
    free_port,
    init_from_env,
    launch,
    shutdown,
)
from .lockstep import replicated_config
from .moe import (
    BusiestRankByteCost,
    ExchangeStats,
    ExpertParallelBatcher,
    ExpertParallelMoE,
    ShardedCacheView,
    install_expert_parallel,
    shard_bounds,
)
from .placement import (
    ExpertPlacement,
    FrequencyBalancedPlacement,
    RoundRobinPlacement,
    check_every_rank_owns_experts,
    frequency_from_topk,
    frequency_from_trace,
    owned_experts_of,
    owned_mask,
    placement_for,
    ranks_without_experts,
)
from .rank_budget import RankRepair, repair_rank_budget

__all__ = [
    "BusiestRankByteCost",
    "ExchangeStats",
    "ExpertParallelBatcher",
    "ExpertParallelMoE",
    "ExpertPlacement",
    "FrequencyBalancedPlacement",
    "RankGroup",
    "RankRepair",
    "RoundRobinPlacement",
    "ShardedCacheView",
    "check_every_rank_owns_experts",
    "current_group",
    "distributed_available",
    "free_port",
    "frequency_from_topk",
    "frequency_from_trace",
    "init_from_env",
    "install_expert_parallel",
    "launch",
    "owned_experts_of",
    "owned_mask",
    "placement_for",
    "ranks_without_experts",
    "repair_rank_budget",
    "replicated_config",
    "shard_bounds",
    "shutdown",
]
