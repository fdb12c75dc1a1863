#!/usr/bin/env bash
# One `nvidia-h200-x2` session for an engine change (here: the one-kernel cache compaction, the
# two-stage top-k, the head-blocked tree attention): first the measurements that isolate it, then
# the T=0 eval of every benchmark at this commit into results named with TAG.
#   GPU 0: the step stage by stage with both compactions, then whole generations profiled;
#   GPU 1: the tree-attention sweep and the target shapes;
#   then both: benchmarks/h200_eval_t0_rerun.sh with the time left (call it again to finish).
# Writes $OUT/spec_step_breakdown_compaction_h200.json, $OUT/spec_step_profile_h200.json,
# $OUT/tree_attention_h200_targets.json, $OUT/t0run$TAG.tgz and logs.
#
#   bash benchmarks/h200_engine_session.sh SECONDS TAG   (repo root, after the model is staged)
set -u
start=$(date +%s)
deadline=$(( start + 210 ))  # for the measurements; the eval below gets the rest
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
{ CUDA_VISIBLE_DEVICES=0 within python benchmarks/spec_step_breakdown.py --attention pallas --budgets 16 64 256 \
    --compactions pallas xla --out "$out/spec_step_breakdown_compaction_h200.json"
  CUDA_VISIBLE_DEVICES=0 within python benchmarks/spec_step_profile.py --budgets 64 256 --new-tokens 128 \
    --out "$out/spec_step_profile_h200.json"; } > "$out/step.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 within python benchmarks/tree_attention_bench.py --shapes qwen3-8b --targets-only \
  --out "$out/tree_attention_h200_targets.json" > "$out/kernel.log" 2>&1 &
wait
tail -n 12 "$out/step.log" "$out/kernel.log"
bash benchmarks/h200_eval_t0_rerun.sh $(( ${1:-560} - ($(date +%s) - start) )) "${2:-}"
