#!/usr/bin/env bash
# The tree-attention benchmark on `nvidia-h200-x2`, the two head shapes side by side: Qwen3-8B's on
# GPU 0 and the embedded model's on GPU 1, each sweeping the tunings on the target shapes first.
# Writes $OUT/tree_attention_h200_{qwen3_8b,smollm2_135m}.json (after every row, so a cut run keeps
# what it measured) and their logs.
#
#   bash benchmarks/h200_kernel_bench.sh SECONDS   (repo root; needs no staged model or wheels)
#
# With .carry/tokamax carried (benchmarks/stage_tokamax.sh fills it), tokamax's attention is timed
# too: pip takes from those wheels only what the GPU image lacks.
set -u
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
install_carried_tokamax "$out/tokamax_install.log"
gpu=0
for shape in qwen3-8b smollm2-135m; do
  CUDA_VISIBLE_DEVICES=$gpu timeout "${1:-540}" python benchmarks/tree_attention_bench.py --shapes "$shape" \
    --out "$out/tree_attention_h200_${shape//[-.]/_}.json" > "$out/tree_attention_${shape}.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
tail -n 45 "$out"/tree_attention_*.log
