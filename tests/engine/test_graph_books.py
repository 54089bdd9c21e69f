"""The CUDA-graph runner's shape keys and counters (pdflash.engine.graphs):
what a row's ``cuda_graphs`` field is built from."""

from __future__ import annotations

import dataclasses

from pdflash.engine.graphs import BucketKey, DraftKey, GraphStats


def test_shape_keys_count_rows_and_keys_before_the_sink() -> None:
    bucket = BucketKey(requests=4, queries=16, key_width=129)
    draft = DraftKey(requests=4, queries=16, context=7, key_width=129, features=8, dtype="f32")
    for key in (bucket, draft):
        assert key.rows == 64 and key.keys == 128
    # the fields stay the dataclasses' own, in order (keys hash by them)
    assert [f.name for f in dataclasses.fields(BucketKey)] == ["requests", "queries", "key_width"]
    assert [f.name for f in dataclasses.fields(DraftKey)] == [
        "requests",
        "queries",
        "context",
        "key_width",
        "features",
        "dtype",
    ]
    assert draft == DraftKey(4, 16, 7, 129, 8, "f32") and bucket == BucketKey(4, 16, 129)


def test_stats_as_dict_names_every_counter() -> None:
    stats = GraphStats(captures=3, recaptures=1, replays=40, capture_failures=2)
    stats.validated, stats.replay_mismatches, stats.piecewise_steps, stats.evicted = 5, 1, 6, 2
    stats.fallbacks.update({"too_wide": 2, "experts_missing": 3})
    assert stats.as_dict() == {
        "captures": 3,
        "recaptures": 1,
        "replays": 40,
        "capture_failures": 2,
        "validated": 5,
        "replay_mismatches": 1,
        "piecewise_steps": 6,
        "evicted": 2,
        "prepared": 0,
        "eager_fallbacks": 5,
        "eager_fallback_reasons": {"experts_missing": 3, "too_wide": 2},
    }
    assert list(stats.as_dict()) == [
        "captures",
        "recaptures",
        "replays",
        "capture_failures",
        "validated",
        "replay_mismatches",
        "piecewise_steps",
        "evicted",
        "prepared",
        "eager_fallbacks",
        "eager_fallback_reasons",
    ]


def test_a_new_counter_reaches_as_dict_without_listing_it() -> None:
    @dataclasses.dataclass
    class MoreStats(GraphStats):
        warm_replays: int = 0

    more = MoreStats(replays=2, warm_replays=7)
    out = more.as_dict()
    assert out["warm_replays"] == 7 and out["replays"] == 2
    assert set(out) == set(GraphStats().as_dict()) | {"warm_replays"}
