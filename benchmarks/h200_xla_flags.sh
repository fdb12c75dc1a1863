#!/usr/bin/env bash
# Does XLA's GPU command-buffer setting change our step times? The same small T=0 eval (8 GSM8K
# prompts, AR and JetSpec at B = 16/64/256, 512 new tokens) under three XLA_FLAGS settings on
# `nvidia-h200-x2`: the default (fusions, cuBLAS, custom calls and cuDNN are recorded into CUDA graphs,
# but while loops and conditionals run from the host, one predicate read-back per iteration), with
# while loops and conditionals recorded too, and that plus unrolling loops of known trip count. Then
# the tree-attention bench on the target shapes. Results in $OUT (eval report them there).
#
#   bash benchmarks/h200_xla_flags.sh SECONDS   (repo root, after the model is staged)
set -u
deadline=$(( $(date +%s) + ${1:-540} ))
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
eval_run() {  # GPU, name, XLA_FLAGS
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS=$3 within python -m jetspec_jax.eval run --benchmarks gsm8k --limit 8 \
    --methods ar jetspec --budgets 16 64 256 --temperatures 0 --prompt-bucket 512 --max-new-tokens 512 \
    --data-dir .carry/evaldata --no-progress --results "$out/xla_flags_$2.jsonl" > "$out/xla_flags_$2.log" 2>&1
}
graphs="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
{ eval_run 0 default "" ; eval_run 0 graphs_unrolled "$graphs --xla_gpu_command_buffer_unroll_loops=true"; } &
{ eval_run 1 graphs "$graphs"
  CUDA_VISIBLE_DEVICES=1 within python benchmarks/tree_attention_bench.py --shapes qwen3-8b --targets-only \
    --out "$out/tree_attention_h200_targets.json" > "$out/tree_attention_targets.log" 2>&1; } &
wait
tail -n 4 "$out"/*.log
