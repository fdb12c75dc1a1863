#!/usr/bin/env bash
# One `nvidia-h200-x2` call for the two paths added untimed at 5663c70: GPU 0 times a speculative
# step stage by stage on the embedded model with the draft head's attention both ways (XLA's dense
# mask and the tree-attention kernel; draft_ms and draft_ms_pallas); GPU 1 runs the tree-attention
# bench on the 8B target shapes, with tokamax's attention where .carry/tokamax was carried.
# Writes $OUT/spec_step_breakdown_draft_attention_h200.json, $OUT/tree_attention_h200_tokamax.json
# and logs.
#
#   bash benchmarks/h200_draft_and_tokamax.sh SECONDS   (repo root, after the model is staged)
set -u
deadline=$(( $(date +%s) + ${1:-540} ))
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
install_carried_tokamax "$out/tokamax_install.log"
CUDA_VISIBLE_DEVICES=0 within python benchmarks/spec_step_breakdown.py --attention pallas --budgets 16 64 256 \
  --draft-attention xla pallas --out "$out/spec_step_breakdown_draft_attention_h200.json" > "$out/step.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 within python benchmarks/tree_attention_bench.py --shapes qwen3-8b --targets-only \
  --out "$out/tree_attention_h200_tokamax.json" > "$out/kernel.log" 2>&1 &
wait
tail -n 8 "$out/step.log"; tail -n 14 "$out/kernel.log"
