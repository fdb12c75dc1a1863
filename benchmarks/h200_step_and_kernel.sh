#!/usr/bin/env bash
# One `nvidia-h200-x2` call for what the Pallas tree builder and the kernel options still need
# measured: GPU 0 times a speculative step stage by stage on the embedded model with both tree
# builders (the first, Pallas, builds the trees of the whole step), then profiles whole generations
# (GPU work vs launch gaps per step); GPU 1 runs the tree-attention sweep (incl. the head-blocked
# layout, tree_in_last_split and low_precision_partials) and the target shapes.
# Writes $OUT/spec_step_breakdown_tree_builders_h200.json, $OUT/spec_step_profile_h200.json,
# $OUT/tree_attention_h200_targets.json and logs.
#
#   bash benchmarks/h200_step_and_kernel.sh SECONDS   (repo root, after the model is staged)
set -u
deadline=$(( $(date +%s) + ${1:-540} ))
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
{ CUDA_VISIBLE_DEVICES=0 within python benchmarks/spec_step_breakdown.py --attention pallas \
    --budgets 16 32 64 128 256 --tree-builders pallas xla --out "$out/spec_step_breakdown_tree_builders_h200.json"
  CUDA_VISIBLE_DEVICES=0 within python benchmarks/spec_step_profile.py --budgets 16 64 256 \
    --out "$out/spec_step_profile_h200.json"; } > "$out/step.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 within python benchmarks/tree_attention_bench.py --shapes qwen3-8b --targets-only \
  --out "$out/tree_attention_h200_targets.json" > "$out/kernel.log" 2>&1 &
wait
tail -n 40 "$out/step.log"; tail -n 12 "$out/kernel.log"
