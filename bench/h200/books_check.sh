#!/usr/bin/env bash
# The books branch on the H200: the eager offloaded verify step's parts with
# the expert cache's books split per method (--detail: books.acquire,
# books.release, books.free_capacity, books.pin_layer, ...), once with the
# native books (the branch) and once with the pure-Python reference books
# (pdflash._reference.cachebooks: the numpy code the cache ran before the
# branch, switched in for the run by giving ExpertCache books=the reference
# class), on the issue-14/16 shape. Steps (bench/h200/run.sh style):
#   ref_miss / new_miss  eager_host --stream (PD's streaming prefetcher),
#       gpt-oss-20b preset, 4 layers, 16 experts top-4, cache 0.2, c=1 x 2
#       tokens: layers with misses (acquire, release, free_capacity, ...)
#   ref_hit / new_hit    the same with cache 1.0: every layer resident
#       (pin_layer, defer_access, unpin_layer)
#   evict_wait           new_miss again (5 steps) with ExpertCache._evict
#       watched: per eviction, how many release events it found, how many
#       were still pending (query() False) when the host came to wait, and
#       the host's time in Event.synchronize (stderr line "evict_wait" in
#       log.txt: evictions events pending waits wait_s)
#   tests                tests/cache (the native/reference differential
#       tests among them) on the GPU box
# Compare parts_us.books and detail_us_mean["books.*"] (us per step; divide
# by the 4 layers) between ref_* and new_*; forward_us too. Every other part
# should be about equal. NOTE: the reference books cost more than main's
# cache did (they also range-check every index, as the native books do; on
# the CPU box 224 vs 191 us per layer), so new vs ref overstates the gain a
# little; bench/results/cpu/books-2026-12-02/README.md has main vs branch.
# Every result and the log are packed into ONE file, $OUT/books_check.tar.gz.
# Expected: build ~30-60 s, each host step ~10-15 s (10 steps; evict_wait
# 5), tests ~15 s: about 2 minutes.
#   OUT=/path bash bench/h200/books_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
ARGS="--device cuda --arch gpt_oss --requests 1 --tokens 2 --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --steps 10 --count-steps 1 --detail"
REF="import sys, functools; import pdflash.cache.expert_cache as m; from pdflash._reference.cachebooks import CacheBooks as R; m.ExpertCache.__init__ = functools.partialmethod(m.ExpertCache.__init__, books=R); from pdflash.bench.eager_host import main; sys.exit(main())"
EVW="import sys, time, atexit, torch; import pdflash.cache.expert_cache as m; st = [0, 0, 0, 0, 0.0]; ev = torch.cuda.Event; sync = ev.synchronize; ev.synchronize = lambda self: (t := time.perf_counter(), sync(self), st.__setitem__(3, st[3] + 1), st.__setitem__(4, st[4] + time.perf_counter() - t))[1]; real = m.ExpertCache._evict; found = lambda self, slots: list({id(e): e for e in self._events[slots] if e is not None}.values()); note = lambda evs: (st.__setitem__(0, st[0] + 1), st.__setitem__(1, st[1] + len(evs)), st.__setitem__(2, st[2] + sum(not e.query() for e in evs))); m.ExpertCache._evict = lambda self, slots: (note(found(self, slots)), real(self, slots))[1]; atexit.register(lambda: print(\"evict_wait evictions events pending waits wait_s:\", *st, file=sys.stderr)); from pdflash.bench.eager_host import main; sys.exit(main())"
PACK="$OUT/books_check.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "ref_miss=timeout 45 python3 -P -c '$REF' $ARGS --stream --cache-fraction 0.2" \
  "new_miss=timeout 45 python3 -P -m pdflash.bench.eager_host $ARGS --stream --cache-fraction 0.2" \
  "ref_hit=timeout 45 python3 -P -c '$REF' $ARGS --stream --cache-fraction 1.0" \
  "new_hit=timeout 45 python3 -P -m pdflash.bench.eager_host $ARGS --stream --cache-fraction 1.0" \
  "evict_wait=timeout 40 python3 -P -c '$EVW' ${ARGS/--steps 10/--steps 5} --stream --cache-fraction 0.2" \
  "tests=timeout 60 python3 -P -m pytest -q -p no:cacheprovider tests/cache"
rc=$?
ls -la "$OUT"
exit $rc
