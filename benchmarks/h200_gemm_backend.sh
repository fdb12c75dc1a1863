#!/usr/bin/env bash
# Are XLA's Triton GEMMs, as autotuned by default, the right choice for the verify pass's small
# matmuls (M = 16..256 rows of the 576-wide embedded target)? Times XLA_FLAGS settings against the
# default on `nvidia-h200-x2`, each GPU running its settings one after the other:
#   step:  the step stage by stage (Pallas attention, B = 16/64/256);
#   eval:  a small T=0 eval (16 GSM8K prompts, AR and JetSpec at B = 64/256, 512 new tokens).
# Settings: triton (XLA's default), cublas (Triton GEMMs off process-wide: cuBLAS for every dot),
# exhaustive (the Triton GEMM autotuner searches every tiling; at 5d4974f its compile outlasted a
# 430 s call), and loop_cublas: no flags, the generation loop compiled with SpecConfig.gemm_backend
# "cublas" (step: both loop backends in one process, loop_step_ms and loop_step_ms_cublas; eval:
# --gemm-backend cublas, AR left on XLA's GEMMs).
# Writes $OUT/spec_step_breakdown_gemm_NAME_h200.json, $OUT/gemm_NAME.jsonl (report them with
# `python -m jetspec_jax.eval report`) and logs.
#
#   bash benchmarks/h200_gemm_backend.sh SECONDS "GPU0 JOBS" "GPU1 JOBS"   (repo root, model staged)
#   e.g. bash benchmarks/h200_gemm_backend.sh 500 "step:triton step:cublas" "eval:triton eval:cublas"
#        bash benchmarks/h200_gemm_backend.sh 500 "step:loop_cublas" "eval:triton eval:loop_cublas"
set -u
deadline=$(( $(date +%s) + ${1:-540} ))
. benchmarks/h200_env.sh
out=${OUT:-/tmp}
declare -A flags=([triton]="" [cublas]="--xla_gpu_enable_triton_gemm=false"
                  [exhaustive]="--xla_gpu_exhaustive_tiling_search=true" [loop_cublas]="")
declare -A step_args=([loop_cublas]="--gemm-backends xla cublas") eval_args=([loop_cublas]="--gemm-backend cublas")
run_job() {  # GPU, kind:setting
  local gpu=$1 kind=${2%%:*} name=${2#*:}
  local env=(CUDA_VISIBLE_DEVICES=$gpu "XLA_FLAGS=${flags[$name]}" JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_$name)
  case $kind in
    step) env "${env[@]}" bash -c 'within "$@"' _ python benchmarks/spec_step_breakdown.py --attention pallas \
            --budgets 16 64 256 ${step_args[$name]:-} --out "$out/spec_step_breakdown_gemm_${name}_h200.json" ;;
    eval) env "${env[@]}" bash -c 'within "$@"' _ python -m jetspec_jax.eval run --benchmarks gsm8k --limit 16 \
            --methods ar jetspec --budgets 64 256 --temperatures 0 --prompt-bucket 512 --max-new-tokens 512 \
            ${eval_args[$name]:-} --data-dir .carry/evaldata --no-progress --results "$out/gemm_$name.jsonl" ;;
  esac > "$out/${kind}_${name}_gpu$gpu.log" 2>&1
}
export -f within
export deadline out
for gpu in 0 1; do
  jobs=${2:-step:triton step:cublas}
  [ "$gpu" = 1 ] && jobs=${3:-eval:triton eval:cublas}
  { for job in $jobs; do run_job "$gpu" "$job"; done; } &
done
wait
tail -n 5 "$out"/*.log
