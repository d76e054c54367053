#!/usr/bin/env bash
# GRPO against DPO on correct-vs-wrong pairs of the same prompt, beside DAPO and the other
# critic-free estimators (RLOO, REINFORCE-baseline, Dr. GRPO): accuracy, the step that reaches
# it, throughput and peak memory. The GPU size follows the study's setup: Qwen2.5-3B-Instruct
# with LoRA r = 16 on GSM8K, the XML format reward (correct +2, format +0.5, an integer answer,
# the tag count).
#
#   bash recipes/grpo-vs-dpo.sh           # CPU: bundled SmolLM2-135M, synthetic sums, 3 seeds
#   SIZE=gpu bash recipes/grpo-vs-dpo.sh  # GPU: Qwen2.5-3B-Instruct + LoRA on GSM8K
# Ends with the table (mean +- sd over seeds) and comparison.png beside the runs.
source "$(dirname "$0")/common.sh"
ARMS=${ARMS:-"grpo dpo dapo rloo reinforce_baseline dr_grpo"}
CPU_FLAGS="--data arithmetic --max-new-tokens 64 --prompts-per-step 8 --samples 8 --steps 10
           --lr 1e-5 --lr-schedule cosine --warmup-steps 2 --temperature 0.8 --mini-batches 4
           --max-refills 1 --eval-limit 50 --eval-every 5 --time-limit 0"
GPU_FLAGS="--model Qwen/Qwen2.5-3B-Instruct --data gsm8k --eval-data gsm8k --eval-limit 1319
           --eval-every 25 --template xml --format-reward xml --format-weight 0.5
           --correct-reward 2 --wrong-reward 0 --lora-rank 16 --lora-alpha 32 --ref lora-off
           --prompts-per-step 64 --samples 8 --max-new-tokens 512 --steps 250 --lr 5e-6
           --warmup-steps 10 --max-refills 3 --micro-batch-size 16 --time-limit 0"
run_study grpo-vs-dpo
