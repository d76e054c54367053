#!/usr/bin/env bash
# The small-model DAPO case study's three proposed changes, each against plain DAPO: adversarial
# prompts re-asked in place of dropped signal-less groups (dapo-adversarial), a soft perplexity
# penalty in place of the overlong punishment (dapo-ppl), and the Generalized KL divergence
# re-added toward the reference (dapo-gkl).
#
#   bash recipes/proposed.sh            # CPU: bundled SmolLM2-135M, synthetic sums, 3 seeds
#   SIZE=gpu bash recipes/proposed.sh   # GPU: Qwen2.5-1.5B-Instruct on GSM8K
# Ends with the table (mean +- sd over seeds) and comparison.png beside the runs.
source "$(dirname "$0")/common.sh"
ARMS=${ARMS:-"dapo dapo-adversarial dapo-ppl dapo-gkl"}
CPU_FLAGS="--data arithmetic --max-new-tokens 64 --prompts-per-step 8 --samples 8 --steps 10
           --lr 1e-5 --lr-schedule cosine --warmup-steps 2 --temperature 0.8 --mini-batches 4
           --max-refills 1 --eval-limit 50 --eval-every 5 --time-limit 0"
GPU_FLAGS="--model Qwen/Qwen2.5-1.5B-Instruct --data gsm8k --eval-data gsm8k --eval-limit 500
           --eval-every 20 --prompts-per-step 128 --samples 8 --max-new-tokens 1024 --steps 300
           --lr 1e-6 --warmup-steps 10 --max-refills 3 --micro-batch-size 16 --time-limit 0"
run_study proposed
