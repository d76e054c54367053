"""What a flag adds beyond DAPO: each file one concept, reached from `train.py` only when a flag asks.

- `objectives.py`: the objectives since DAPO (GSPO, CISPO, GMPO, SAPO, Clip-Cov, KL-Cov), entropy,
  GKL, DPO's loss; `token_choice.py`: which tokens carry a gradient (80/20, Cov), rollout weights.
- `reference.py`: what reads a reference policy: the KL / GKL term and DPO's update.
- `refills.py`: dynamic sampling's rounds (eq. 11), one after another or in one running queue;
  harder variants of solved prompts, a sampling budget by difficulty.
- `lora.py`, `quantize.py`: LoRA adapters; the frozen base in 4-bit NormalFloat.
- `moe.py`: Mixture-of-Experts MLPs (the model's, for Qwen3-MoE and Mixtral), routing replay.
- `sft.py`: supervised fine-tuning on given completions, a step of its own kind (--algo sft).
- `distill.py`: on-policy distillation, a teacher's per-token term in the advantage (--teacher).
"""
