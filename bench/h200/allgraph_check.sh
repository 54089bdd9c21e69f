#!/usr/bin/env bash
# One H200 call (~2-2.5 minutes wall: build ~30 s, then hard timeouts of
# 35 s (GPU tests), 40 s (Qwen3) and 45 s (gpt-oss bf16), so at most ~2.6
# minutes; MXFP4=1 adds gpt-oss with MXFP4 experts, 1 layer, up to 60 s more:
# the same command alone took 39 s of wall on the H200, over the 35 s it had)
# for
# issue 13's per-layer all-hit target with the layer's device work replayed
# from a CUDA graph (pdflash.models.resident_graphs): the offloaded MoE block
# with every routed expert resident, eager (the main fields) and replayed
# (by_resident_graphs.on), both timed in the same 5 interleaved rounds of 20
# calls beside plain grouped_mm on the same active experts, at 16/64/256
# tokens, Qwen3-30B-A3B and gpt-oss-20b shapes (2 layers each, cache 0.5).
# Targets: back-to-back <= 1.25x grouped_mm_active_us and <= 2x
# hbm_roofline_us. Each side: back-to-back CUDA events (*_us), host issue
# time per call (*_host_us), device-only time queued behind a spin kernel
# (*_device_us).
#   OUT=/path bash bench/h200/allgraph_check.sh
# Steps (through bench/h200/run.sh), each under a hard timeout:
#   gputests     replays equal eager bit for bit over routings and token
#                counts and follow each new routing; a replay makes no host
#                sync in <= 6 torch calls; close frees the graphs' memory;
#                the eager all-resident layer still syncs nothing; the CPU
#                selection tests (<= 35 s)
#   moe_qwen3 / moe_gptoss (/ moe_gptoss_mxfp4)   pdflash-bench moe rows with
#                --resident-graphs both
#   summary      allgraph_summary.json (bench/h200/allgraph_summary.py): per
#                arch, layer and token count, eager and graph side by side
# Everything (log.txt, results.jsonl, gputests.txt, the summary) is packed
# into ONE file, $OUT/allgraph_check.tgz, after every step; nothing else is
# left under $OUT (the work happens in $WORK, default /tmp/allgraph_check).
# SMOKE=1: the same steps on the tiny CPU shapes, no GPU tests (a local
# check of the script: the recorded side then runs eagerly, reason
# not_cuda; device times and the roofline are null with the reason).
# The steps are bench/h200/allhit_check.sh's, with these tests, side and
# summary.
export NAME=allgraph_check SIDE="--resident-graphs both" SUMMARY=allgraph_summary.py
export TESTS="tests/models/test_resident_graphs_gpu.py tests/models/test_resident_graphs.py tests/models/test_models_gpu.py::test_all_resident_layer_runs_grouped_without_a_host_sync"
export TT=${TT:-35} TQ=${TQ:-40} TG=${TG:-45} TM=${TM:-60}
exec bash "$(dirname "$0")/allhit_check.sh"
