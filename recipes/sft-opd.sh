#!/usr/bin/env bash
# Beyond a sparse reward: DAPO alone against on-policy distillation from a teacher (alone, and
# added to DAPO's advantage) and against a supervised warm start before DAPO, the same student.
# The teacher is a default run's final/ (trained first unless TEACHER=PATH names one); the warm start
# a short SFT run on the task's "Answer: X" replies, whose final/ the sft+dapo arm starts from.
#
#   bash recipes/sft-opd.sh            # CPU: bundled SmolLM2-135M, synthetic sums, 3 seeds
#   SIZE=gpu bash recipes/sft-opd.sh   # GPU: Qwen2.5-1.5B-Instruct teaching 0.5B on GSM8K
# Ends with the table (mean +- sd over seeds) and comparison.png beside the runs; an SFT stage's
# minutes are in its own run (OUT/sft-sS), before the sft+dapo arm's.
source "$(dirname "$0")/common.sh"
OUT=${OUT:-runs/sft-opd-${SIZE:-cpu}}
ARMS=${ARMS:-"dapo opd opd+dapo sft+dapo"}
if [ "${SIZE:-cpu}" = gpu ]; then
    TEACHER=${TEACHER:-Qwen/Qwen2.5-1.5B-Instruct}
    SFT_FLAGS="--model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k --eval-data gsm8k --eval-limit 500
               --prompts-per-step 64 --steps 100 --micro-batch-tokens 8192 --time-limit 0"
else
    TEACHER=${TEACHER:-$OUT/teacher/final}
    SFT_FLAGS="--data arithmetic --steps 20 --eval-limit 50 --eval-every 10 --time-limit 0"
fi
stage() {  # a run the arms start from, once (resumed where it stopped): said under DRY_RUN
    local dir=$1
    shift
    [ -e "$dir/final/config.json" ] && return
    [ -e "$dir/config.json" ] && set -- ${PYTHON:-python} train.py --resume "$dir"
    if [ -n "${DRY_RUN:-}" ]; then echo "  (first) $*"; else train_one "$dir" "$@"; fi
}
# The teacher is trained here only where it is this recipe's own ($TEACHER not given) and an arm
# distills from it.
if [ "${SIZE:-cpu}" = cpu ] && [ "$TEACHER" = "$OUT/teacher/final" ] && [[ " $ARMS " == *" opd"* ]]; then
    stage "$OUT/teacher" ${PYTHON:-python} train.py --out "$OUT/teacher" --time-limit 0
fi
CPU_FLAGS="--data arithmetic --max-new-tokens 64 --prompts-per-step 8 --samples 8 --steps 10
           --lr 1e-5 --lr-schedule cosine --warmup-steps 2 --temperature 0.8 --mini-batches 4
           --max-refills 0 --overlong-cache 0.25 --eval-limit 50 --eval-every 5 --time-limit 0"
GPU_FLAGS="--model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k --eval-data gsm8k --eval-limit 500
           --eval-every 20 --prompts-per-step 128 --samples 8 --max-new-tokens 1024 --steps 200
           --mini-batches 2 --micro-batch-tokens 8192 --time-limit 0"
ARM_PRESET=([opd]=opd [opd+dapo]=dapo [sft+dapo]=dapo)
ARM_FLAGS=([opd]="--teacher $TEACHER --label opd" [opd+dapo]="--teacher $TEACHER --label opd+dapo"
           [sft+dapo]="--model $OUT/sft-s{seed}/final --label sft+dapo")
if [[ " $ARMS " == *" sft+dapo "* ]]; then  # the warm starts, one a seed, before the arms
    for seed in ${SEEDS:-0 1 2}; do
        stage "$OUT/sft-s$seed" ${PYTHON:-python} train.py --preset sft --seed "$seed" --out "$OUT/sft-s$seed" $SFT_FLAGS
    done
fi
run_study sft-opd
