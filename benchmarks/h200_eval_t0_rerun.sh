#!/usr/bin/env bash
# T=0 eval of every benchmark (64 prompts, AIME25's 30), all methods and budgets, at one commit on
# `nvidia-h200-x2`, into fresh results files: after the tree-build and kernel changes of f984905 the
# archived T=0 rows (h200_eval_session.sh) came from two engine versions. Then the Qwen3-8B-shaped
# cost model at budgets 32 and 128. Resumes like h200_eval_session.sh: call it again until all is there.
# TAG (default empty) goes into the results names, so a rerun after a later engine change starts new
# files (e.g. TAG=_allkernels, the engine of a4cca3c) instead of resuming complete ones.
#
#   bash benchmarks/h200_eval_t0_rerun.sh SECONDS [TAG]   (repo root, after the model is staged)
set -u
deadline=$(( $(date +%s) + ${1:-560} ))
tag=${2:-}
. benchmarks/h200_env.sh
runs=/tmp/t0run$tag
shopt -s nullglob  # no archive of this tag yet: nothing to unpack
unpack_archived "$runs" eval/results/h200_bf16_t0${tag}_[ghm]*.jsonl.gz  # a later session resumes archived files
common=(--limit 64 --temperatures 0 --prompt-bucket 512 --max-new-tokens 512 --data-dir .carry/evaldata --no-progress)

CUDA_VISIBLE_DEVICES=0 within python -m jetspec_jax.eval run --benchmarks gsm8k math500 aime25 "${common[@]}" \
  --results "$runs/h200_bf16_t0${tag}_gsm8k_math500_aime25.jsonl" >> "$runs/gpu0.log" 2>&1 &&
  { [ -f "$runs/cost.done" ] || { CUDA_VISIBLE_DEVICES=0 within python benchmarks/spec_step_breakdown.py \
    --target qwen3-8b-shaped --contexts 1024 4096 --budgets 32 128 --attention pallas \
    --out "$runs/qwen3_8b_cost_b32_b128${tag}_h200.json" >> "$runs/cost.log" 2>&1 && touch "$runs/cost.done"; }; } &
CUDA_VISIBLE_DEVICES=1 within python -m jetspec_jax.eval run --benchmarks humaneval mbpp mt_bench "${common[@]}" \
  --results "$runs/h200_bf16_t0${tag}_humaneval_mbpp_mtbench.jsonl" >> "$runs/gpu1.log" 2>&1 &
wait
for f in "$runs"/*.jsonl; do echo "$f: $(wc -l < "$f") lines"; done
tail -n 3 "$runs"/*.log
tar czf "${OUT:-/tmp}/t0run$tag.tgz" -C /tmp "t0run$tag"
