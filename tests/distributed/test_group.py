"""RankGroup: how many ranks share a host (their cores are split between
them: pdflash.hybrid.rank_cpus)."""

from __future__ import annotations

import pytest
import torch

from pdflash.distributed import RankGroup, distributed_available, launch

CPU = torch.device("cpu")


def test_a_group_knows_how_many_ranks_share_its_host() -> None:
    two_hosts = RankGroup(
        rank=3, world_size=4, local_rank=1, device=CPU, backend="gloo", local_world_size=2
    )
    assert two_hosts.ranks_on_host == 2
    # unknown (not under torchrun's LOCAL_WORLD_SIZE): every rank on one host
    assert (
        RankGroup(rank=1, world_size=2, local_rank=1, device=CPU, backend="gloo").ranks_on_host == 2
    )
    for local_rank, local_world in ((2, 2), (0, 3), (0, 0)):
        with pytest.raises(ValueError, match="local_world_size"):
            RankGroup(
                rank=0,
                world_size=2,
                local_rank=local_rank,
                device=CPU,
                backend="gloo",
                local_world_size=local_world,
            )


def _on_host(group: RankGroup) -> tuple[int, int]:
    return group.local_rank, group.ranks_on_host


@pytest.mark.skipif(not distributed_available(), reason="torch.distributed with gloo needed")
@pytest.mark.timeout(120)
def test_launched_ranks_read_the_local_world_size() -> None:
    assert launch(_on_host, 2, device="cpu") == [(0, 2), (1, 2)]
