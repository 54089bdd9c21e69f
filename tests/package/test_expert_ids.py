"""The one expert-id range check (pdflash.protocols.checked_flat_ids) and the
places that validate flat expert ids through it."""

from __future__ import annotations

import numpy as np
import pytest

from pdflash.cache.eviction import LayerCyclicPolicy, RouteAheadPolicy
from pdflash.protocols import checked_flat_ids, expert_mask


def test_checked_flat_ids_accepts_and_flattens() -> None:
    ids = checked_flat_ids([[0, 5], [11, 3]], 12)
    assert ids.dtype == np.int64
    assert ids.tolist() == [0, 5, 11, 3]
    assert checked_flat_ids([], 0).size == 0


@pytest.mark.parametrize(("ids", "bad"), [([0, 12, -1], 12), ([3, -2, 40], -2)])
def test_checked_flat_ids_names_the_first_bad_id(ids: list[int], bad: int) -> None:
    with pytest.raises(ValueError, match=rf"expert id {bad} out of range \[0, 12\)"):
        checked_flat_ids(ids, 12)


def test_callers_share_the_check_and_keep_state_on_error() -> None:
    with pytest.raises(ValueError, match=r"expert id 6 out of range \[0, 6\)"):
        expert_mask([1, 6], 2, 3)
    for policy in (RouteAheadPolicy(), LayerCyclicPolicy(2, 3)):
        policy.reset(6)
        policy.set_predicted([1, 4])
        with pytest.raises(ValueError, match=r"expert id -1 out of range \[0, 6\)"):
            policy.set_predicted([2, -1])
        assert np.flatnonzero(policy.predicted).tolist() == [1, 4]
