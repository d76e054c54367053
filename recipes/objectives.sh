#!/usr/bin/env bash
# DAPO's clipped ratio against the objectives since (objectives.OBJECTIVES): GSPO's sequence-level
# ratio, CISPO's clipped weight that keeps every token's gradient, GMPO's geometric mean; each
# with the rest of DAPO unchanged and its paper's clip range and aggregation (dapo.PRESETS).
# Several updates a step (4 on the CPU, 16 on the GPU): at one the ratio is 1 and each is the
# plain policy gradient under its aggregation.
# The CPU flags set every value the dapo preset's CPU defaults would (config.CPU_DEFAULTS), so
# that the arms differ in their objective only.
#
#   bash recipes/objectives.sh              # CPU: bundled SmolLM2-135M, synthetic sums, 3 seeds
#   SIZE=gpu bash recipes/objectives.sh     # GPU: Qwen2.5-1.5B-Instruct on DAPO-Math-17k, AIME
#   ARMS="dapo sapo" bash recipes/objectives.sh   # SAPO beside DAPO
# Ends with the table (mean +- sd over seeds) and comparison.png beside the runs.
source "$(dirname "$0")/common.sh"
ARMS=${ARMS:-"dapo gspo cispo gmpo"}
CPU_FLAGS="--data arithmetic --max-new-tokens 64 --prompts-per-step 8 --samples 8 --steps 10
           --lr 1e-5 --lr-schedule cosine --warmup-steps 2 --temperature 0.8 --mini-batches 4
           --max-refills 1 --overlong-cache 0.25 --eval-limit 50 --eval-every 5 --time-limit 0"
GPU_FLAGS="--model Qwen/Qwen2.5-1.5B-Instruct --data dapo-math-17k --eval-data aime24
           --eval-limit 30 --eval-samples 32 --eval-every 20 --prompts-per-step 512 --samples 16
           --max-new-tokens 8192 --steps 300 --lr 1e-6 --warmup-steps 20 --max-refills 3
           --mini-batches 16 --activation-checkpointing --micro-batch-size 8 --time-limit 0"
run_study objectives
