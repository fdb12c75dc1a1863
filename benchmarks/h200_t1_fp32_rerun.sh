#!/usr/bin/env bash
# After an engine change, what h200_eval_t0_rerun.sh leaves at the old engine, on `nvidia-h200-x2`:
#   GPU 0: the fp32 losslessness check (3 prompts of each benchmark, every method, B = 16 and 256),
#          then T=1 (AR, JetSpec, DDTree at B = 64 and 256) on GSM8K, MATH-500 and AIME25;
#   GPU 1: the tree-attention target shapes (times the current merge), then T=1 on HumanEval, MBPP
#          and MT-Bench.
# Results go to files named with TAG (e.g. _allkernels); resumes like h200_eval_t0_rerun.sh, so call
# it again until all is there. Packs everything into $OUT/t1run$TAG.tgz.
#
#   bash benchmarks/h200_t1_fp32_rerun.sh SECONDS TAG   (repo root, after the model is staged)
set -u
deadline=$(( $(date +%s) + ${1:-560} ))
tag=${2:?TAG names the results files, e.g. _allkernels}
. benchmarks/h200_env.sh
runs=/tmp/t1run$tag
shopt -s nullglob  # no archive of this tag yet: nothing to unpack
unpack_archived "$runs" eval/results/h200_bf16_t1${tag}_*.jsonl.gz eval/results/h200_fp32_lossless_check${tag}.jsonl.gz
common=(--prompt-bucket 512 --max-new-tokens 512 --data-dir .carry/evaldata --no-progress)
t1=(--limit 64 --temperatures 1 --methods ar jetspec ddtree --budgets 64 256 "${common[@]}")

{ CUDA_VISIBLE_DEVICES=0 within python -m jetspec_jax.eval run --dtype float32 --limit 3 \
    --methods ar jetspec ddtree dflash --budgets 16 256 "${common[@]}" \
    --results "$runs/h200_fp32_lossless_check$tag.jsonl" &&
  CUDA_VISIBLE_DEVICES=0 within python -m jetspec_jax.eval run --benchmarks gsm8k math500 aime25 "${t1[@]}" \
    --results "$runs/h200_bf16_t1${tag}_gsm8k_math500_aime25.jsonl"; } >> "$runs/gpu0.log" 2>&1 &
{ [ -f "$runs/kernel.done" ] || { CUDA_VISIBLE_DEVICES=1 within python benchmarks/tree_attention_bench.py \
    --shapes qwen3-8b --targets-only --out "$runs/tree_attention_h200_targets$tag.json" && touch "$runs/kernel.done"; }
  CUDA_VISIBLE_DEVICES=1 within python -m jetspec_jax.eval run --benchmarks humaneval mbpp mt_bench "${t1[@]}" \
    --results "$runs/h200_bf16_t1${tag}_humaneval_mbpp_mtbench.jsonl"; } >> "$runs/gpu1.log" 2>&1 &
wait
for f in "$runs"/*.jsonl; do echo "$f: $(wc -l < "$f") lines"; done
tail -n 3 "$runs"/*.log
tar czf "${OUT:-/tmp}/t1run$tag.tgz" -C /tmp "t1run$tag"
