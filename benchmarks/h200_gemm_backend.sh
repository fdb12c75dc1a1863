#!/usr/bin/env bash
# Are XLA's Triton GEMMs the right choice for the verify pass's small matmuls (M = 16..256 rows of the
# 576-wide embedded target)? Each setting is timed on the same GPU as its baseline, on `nvidia-h200-x2`:
#   GPU 0: the step stage by stage (Pallas attention, B = 16/64/256), XLA's default, then with
#          Triton GEMMs off (cuBLAS for every dot);
#   GPU 1: a small T=0 eval (16 GSM8K prompts, AR and JetSpec at B = 64/256, 512 new tokens), the
#          same two settings.
# Writes $OUT/spec_step_breakdown_gemm_{triton,cublas}_h200.json, $OUT/gemm_{triton,cublas}.jsonl
# (report them with `python -m jetspec_jax.eval report`) and logs.
#
#   bash benchmarks/h200_gemm_backend.sh SECONDS   (repo root, after the model is staged)
set -u
deadline=$(( $(date +%s) + ${1:-540} ))
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
cublas="--xla_gpu_enable_triton_gemm=false"
step() {  # name, XLA_FLAGS
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=$2 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_$1 within python \
    benchmarks/spec_step_breakdown.py --attention pallas --budgets 16 64 256 \
    --out "$out/spec_step_breakdown_gemm_$1_h200.json" > "$out/step_$1.log" 2>&1
}
eval_run() {  # name, XLA_FLAGS
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS=$2 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_$1 within python -m jetspec_jax.eval run \
    --benchmarks gsm8k --limit 16 --methods ar jetspec --budgets 64 256 --temperatures 0 --prompt-bucket 512 \
    --max-new-tokens 512 --data-dir .carry/evaldata --no-progress --results "$out/gemm_$1.jsonl" > "$out/eval_$1.log" 2>&1
}
{ step triton ""; step cublas "$cublas"; } &
{ eval_run triton ""; eval_run cublas "$cublas"; } &
wait
tail -n 12 "$out"/*.log
