#!/usr/bin/env bash
# The H200 sessions behind eval/results and the sessions' benchmark JSONs, on `nvidia-h200-x2`:
# GPU 0 runs the timing benchmarks, an fp32 losslessness check and the eval queue for GSM8K, MATH-500
# and HumanEval; GPU 1 runs the eval queue for MBPP, MT-Bench and AIME25.
# Every step resumes (result files are appended line by line), so the script is simply called again
# in the next device call until everything is there; all results are packed into $OUT/session.tgz.
# A fresh machine starts from the archived runs in eval/results (gunzipped), so a later session
# continues them; archive the returned files there again with gzip -9. (The recorded run used this
# script as of commit d9bb84c: results named gpu0/gpu1.jsonl, 200 s for the fp32 check, benchmarks
# and fp32 check on GPU 1 before its eval queue.) The kernel benchmark times the kernel of commit
# 88616e7 alongside if .carry/baseline/tree_attention_88616e7.py is there (git show 88616e7:kernels/...).
#
#   bash benchmarks/h200_eval_session.sh SECONDS [no-benches]   (repo root, after the model is staged)
# no-benches: GPU 0 skips the timing benchmarks (their JSONs are in benchmarks/results already).
set -u
budget=${1:-560}
benches=${2:-benches}
deadline=$(( $(date +%s) + budget ))
. benchmarks/h200_env.sh  # before the `within` below, which takes a per-step limit and replaces env's
left() { echo $(( deadline - $(date +%s) )); }
within() {  # SECONDS command...: runs it for at most SECONDS and never past the deadline
  local t=$1 l; l=$(left); shift
  [ "$l" -gt 10 ] || return 1
  timeout $(( t < l ? t : l )) "$@"
}

runs=/tmp/evalrun bench=/tmp/evalrun/bench
mkdir -p "$bench"
unpack_archived "$runs" eval/results/h200_bf16_{gsm8k,mbpp}*.jsonl.gz eval/results/h200_fp32_*.jsonl.gz
data=.carry/evaldata
common=(--prompt-bucket 512 --max-new-tokens 512 --data-dir "$data" --no-progress)

eval_queue() {  # gpu results-file benchmarks...
  local gpu=$1 results=$2; shift 2
  for limit in 32 64; do
    CUDA_VISIBLE_DEVICES=$gpu within 100000 python -m jetspec_jax.eval run --benchmarks "$@" --limit $limit \
      --temperatures 0 "${common[@]}" --results "$results" || return
    CUDA_VISIBLE_DEVICES=$gpu within 100000 python -m jetspec_jax.eval run --benchmarks "$@" --limit $limit \
      --temperatures 1 --methods ar jetspec ddtree --budgets 64 256 "${common[@]}" --results "$results" || return
  done
}

once() {  # name timeout command...: runs a GPU 0 step unless an earlier call finished it
  local name=$1 t=$2; shift 2
  [ -f "$bench/$name.done" ] && return
  CUDA_VISIBLE_DEVICES=0 within "$t" "$@" >> "$bench/$name.log" 2>&1 && touch "$bench/$name.done"
}

gpu0() {  # its eval queue last: the 64-prompt runs of its benchmarks are already archived
  [ "$benches" = no-benches ] || timing_benchmarks
  once fp32_lossless 400 python -m jetspec_jax.eval run --dtype float32 --limit 3 \
    --methods ar jetspec ddtree dflash --budgets 16 256 "${common[@]}" --results "$runs/h200_fp32_lossless_check.jsonl"
  eval_queue 0 "$runs/h200_bf16_gsm8k_math500_humaneval.jsonl" gsm8k math500 humaneval >> "$runs/gpu0.log" 2>&1
}

timing_benchmarks() {
  local baseline=.carry/baseline/tree_attention_88616e7.py
  once tree_attention 280 python benchmarks/tree_attention_bench.py --shapes qwen3-8b --batches 1 \
    $([ -f $baseline ] && echo --baseline-kernel $baseline) --out "$bench/tree_attention_h200_session4.json"
  once embedded_pallas 200 python benchmarks/spec_step_breakdown.py --attention pallas --budgets 16 64 256 \
    --out "$bench/spec_step_breakdown_pallas_h200_session4.json"
}

nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
gpu0 &
eval_queue 1 "$runs/h200_bf16_mbpp_mtbench_aime25.jsonl" mbpp mt_bench aime25 >> "$runs/gpu1.log" 2>&1 &
wait
for f in "$runs"/*.jsonl; do echo "$f: $(wc -l < "$f") lines"; done
tail -n 3 "$runs"/*.log "$bench"/*.log
tar czf "${OUT:-/tmp}/session.tgz" -C /tmp evalrun
