#!/usr/bin/env bash
# Both heads for the embedded model, trained for the same STEPS on the same regenerated data, one per
# GPU of `nvidia-h200-x2` (GPU 0: the JetSpec causal head, GPU 1: the bidirectional DFlash/DDTree
# head), then their tau side by side on held-out GSM8K test questions (head_tau.py, one run). The
# shipped heads come from `560 7000`, called twice (train/results/*/RESULTS.md).
# Resumes: the regenerated data and the checkpoints stay in /tmp/heads_runSTEPS while the machine is warm,
# so call it again until both runs reach STEPS (each process stops cleanly, checkpoint and export,
# a minute before the deadline). Packs each exported head with its metrics into
# $OUT/head-{jetspec,dflash}$STEPS$RUN_TAG.tgz, the tau JSON, logs and data manifest into
# $OUT/heads$STEPS$RUN_TAG.tgz.
#
#   bash benchmarks/h200_train_heads.sh SECONDS STEPS   (repo root, after the model is staged)
#
# TRAIN_OVERRIDES adds config overrides to both runs (e.g. 'data.samples_per_prompt=4
# data.temperature=0.8' for four sampled answers per prompt) and RUN_TAG names such a variant: it
# goes into the run folder and the archives' names, so variants don't resume each other.
#
# The training prompts (.carry/data, 16 MB) don't fit in the model's last staging call: send them in
# a call of their own before it (carry [".carry/data"], command `cp -r .carry/data /tmp/traindata`)
# and set TRAIN_DATA=/tmp/traindata; the last call carries .carry/evaldata for the tau step.
set -u
deadline=$(( $(date +%s) + ${1:-560} ))
steps=${2:?STEPS: training steps of each head, e.g. 7000}
. benchmarks/h200_env.sh
tag=${RUN_TAG:-}
run=/tmp/heads_run$steps$tag  # per STEPS: the schedule (so the checkpoints) depends on it
mkdir -p "$run"
# the shipped heads' recipe (train/results/*/RESULTS.md), the cosine schedule planned over STEPS
common=("data.data_dir=${TRAIN_DATA:-.carry/data}" "data.regen_dir=$run/regen" data.max_new_tokens=320 data.max_prompt_tokens=256
        'data.sources={"gsm8k":-1,"math":3000,"mbpp":-1,"chat":-1}' "run.out_dir=$run" "optim.total_steps=$steps" ${TRAIN_OVERRIDES:-})
seconds_left() { echo $(( deadline - $(date +%s) - 60 )); }  # a minute kept for the archives
minutes_left() { awk -v s="$(seconds_left)" 'BEGIN { printf "%.2f", s / 60 }'; }

CUDA_VISIBLE_DEVICES=0 within python -m jetspec_jax.train --config smollm2-135m-jetspec --stage regenerate \
  "${common[@]}" >> "$run/regenerate.log" 2>&1
for head in jetspec dflash; do
  gpu=$([ "$head" = jetspec ] && echo 0 || echo 1)
  [ "$(seconds_left)" -ge 60 ] && CUDA_VISIBLE_DEVICES=$gpu within python -m jetspec_jax.train \
    --config "smollm2-135m-$head" --stage train "${common[@]}" "run.max_minutes=$(minutes_left)" \
    "run.export_head=$run/heads/smollm2-135m-$head" >> "$run/train-$head.log" 2>&1 &
done
wait
tail -n 2 "$run"/train-*.log
done_steps() { tail -n 1 "$run/smollm2-135m-$1/metrics.jsonl" 2>/dev/null | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('step', 0))"; }
tau_json="$run/head_tau_h200_bf16_both_heads_$steps$tag.json"
if [ ! -f "$tau_json" ] && [ "$(done_steps jetspec)" -ge "$steps" ] && [ "$(done_steps dflash)" -ge "$steps" ]; then
  CUDA_VISIBLE_DEVICES=0 within python benchmarks/head_tau.py --head "$run/heads/smollm2-135m-jetspec" \
    --head "$run/heads/smollm2-135m-dflash" --data-dir .carry/evaldata --max-new-tokens 192 \
    --out "$tau_json" >> "$run/head_tau.log" 2>&1
fi
out=${OUT:-/tmp}
for head in jetspec dflash; do  # one archive each: a head is ~14 MB, the device returns files up to 16 MiB
  tar czf "$out/head-$head$steps$tag.tgz" -C "$run" "heads/smollm2-135m-$head" "smollm2-135m-$head/metrics.jsonl"
done
tar czf "$out/heads$steps$tag.tgz" -C "$run" regen/manifest.json $(cd "$run" && ls head_tau_*.json *.log 2>/dev/null)
ls -la "$out"/head*"$steps$tag".tgz
