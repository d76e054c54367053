#!/usr/bin/env bash
# DAPO's ablation ladder (Yu et al. 2025, Table 1): naive GRPO, then + overlong filtering,
# + clip-higher, + soft overlong punishment, + token-level loss, + dynamic sampling, each rung
# adding one component to the one before (dapo.LADDER), every rung at 16 updates per step.
#
#   bash recipes/ladder.sh              # CPU: bundled SmolLM2-135M, synthetic sums, 3 seeds
#   SIZE=gpu bash recipes/ladder.sh     # GPU: Qwen2.5-1.5B-Instruct on DAPO-Math-17k, AIME avg@32
#   SEEDS=0 EXTRA="--steps 5" OUT=runs/try bash recipes/ladder.sh   # a quick look
# Ends with the table (mean +- sd over seeds) and comparison.png beside the runs.
source "$(dirname "$0")/common.sh"
ARMS=${ARMS:-"ladder-0-naive-grpo ladder-1-overlong-filtering ladder-2-clip-higher ladder-3-soft-overlong
      ladder-4-token-level-loss ladder-5-dynamic-sampling"}
CPU_FLAGS="--data arithmetic --max-new-tokens 64 --prompts-per-step 8 --samples 8 --steps 10
           --lr 1e-5 --lr-schedule cosine --warmup-steps 2 --temperature 0.8 --max-refills 1
           --eval-limit 50 --eval-every 5 --time-limit 0"
GPU_FLAGS="--model Qwen/Qwen2.5-1.5B-Instruct --data dapo-math-17k --eval-data aime24
           --eval-limit 30 --eval-samples 32 --eval-every 20 --prompts-per-step 512 --samples 16
           --max-new-tokens 8192 --steps 300 --lr 1e-6 --warmup-steps 20 --max-refills 3
           --activation-checkpointing --micro-batch-size 8 --time-limit 0"
run_study ladder
