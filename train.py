"""Train a language model with DAPO (or GRPO, Dr. GRPO, RLOO, REINFORCE-baseline, DPO) on math.

    python train.py                                   # the offline default: bundled SmolLM2-135M,
                                                      # synthetic arithmetic, ~25 minutes on a CPU
    python train.py --preset dapo --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k --max-new-tokens 1024
    torchrun --nproc_per_node 8 train.py --preset dapo --model Qwen/Qwen2.5-1.5B-Instruct \\
        --data dapo-math-17k --prompts-per-step 512 --samples 16 --mini-batches 16 --max-new-tokens 4096
    python train.py --resume runs/NAME                # continue a run exactly where it stopped
    python train.py --bench                           # seconds per step: rollout / scoring / update

DAPO (Yu et al. 2025, arXiv 2503.14476) as differences from GRPO (Shao et al. 2024), in the order
one training step below applies them:
  1. Rule reward +1 / -1 (eq. 7), optionally plus the soft overlong punishment (eq. 13).
  2. Dynamic sampling (eq. 11): groups whose G rewards are all equal carry no gradient; drop them
     and sample more prompts until the batch is full or the refill budget is spent.
  3. Group-normalised advantages, as GRPO (eq. 9).
  4. Clip-higher (eq. 10): eps_low 0.2, eps_high 0.28, so unlikely tokens can still grow.
  5. Token-level loss (eq. 12): the sum over every token of the mini-batch divided by the number of
     those tokens, not a mean of per-sequence means. Exact here under gradient accumulation and
     DDP: the token count is summed over micro-batches and all-reduced over ranks before backward.
  6. No KL term (optional here: k1/k2/k3 or GKL against a reference).

One step (DESIGN.md "One training step"): prompts -> rollout.generate -> rewards -> dynamic
sampling (bounded refills) -> advantages -> old log-probs -> `mini_batches` updates, each
accumulated over micro-batches with the global token count as divisor -> metrics (rank 0 writes).
Step counters and the learning-rate schedule count optimizer updates, not sampling rounds.

A run directory (--out) holds config.json, metrics.jsonl (one JSON object per step), checkpoint.pt
(the latest, written atomically) and final/ (save_model: loadable by load_model and transformers).
"""

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dapo
import data
import losses
import rewards
from model import (add_lora, cpu_has_bf16, load_model, lora_disabled, save_model,
                   token_logprobs)
from rollout import Completion, generate

# ----------------------------------------------------------------------------- configuration

# The offline default: the `dapo` preset scaled to a 2-core CPU and a 135M model. What differs from
# the paper's run, and why:
CPU_DEFAULTS = {
    "lr": 1e-5,            # 1e-6 is tuned for 7B-32B models and ~10k updates; 135M needs larger
    "warmup_steps": 2,     # a 20-update warm-up would be most of a 20-minute run
    "steps": 45,           # ~15 minutes of training on 2 cores (the time limit is a safety net)
    "lr_schedule": "cosine",  # at a constant 1e-5 held-out accuracy peaked at ~11 minutes and
                              # then drifted down (81% -> 68%); decaying the rate holds the gain
    "overlong_cache": 16,  # DAPO's 4096 / 20480 cache ratio is ~1/5 of the budget; here 16 / 64
    "max_refills": 0,      # a refill is another whole rollout round; on a CPU it is cheaper to
                           # train on the informative groups found (the update shrinks with them)
    "temperature": 0.8,    # at 1.0 this model is right ~3x less often than greedy: most groups
                           # would be all wrong and carry no signal
}


def build_parser():
    p = argparse.ArgumentParser(description="DAPO and relatives on math problems.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--preset", default="dapo", choices=sorted(dapo.PRESETS),
                   help="named flag set from dapo.PRESETS; explicit flags override it")
    g.add_argument("--out", default=None, help="run directory (never overwritten); default runs/<time>")
    g.add_argument("--resume", default=None, help="continue the run in this directory")
    g.add_argument("--seed", type=int, default=0, help="seed for data, sampling and init")
    g.add_argument("--steps", type=int, default=1000, help="optimizer updates to run at most")
    g.add_argument("--time-limit", type=float, default=20.0,
                   help="minutes of training (evaluation excluded); 0 = no limit")
    g.add_argument("--bench", action="store_true", help="time a few steps and exit")
    g.add_argument("--plot", metavar="RUN_DIR", default=None,
                   help="only draw RUN_DIR/curve.png from its metrics (needs matplotlib)")
    g.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="checkpoint dir, .gguf file or hub id; default the bundled SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="update precision: bfloat16 = autocast with fp32 master weights (auto: "
                        "bf16 on CUDA and on CPUs with native bf16)")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward (saves GPU memory)")
    g.add_argument("--ref", default="frozen", choices=["frozen", "lora-off"],
                   help="reference policy for KL/GKL/DPO: a frozen copy, or the LoRA base")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="arithmetic",
                   help="gsm8k, math500, aime24, dapo-math-17k, arithmetic[:key=value,...] or a "
                        ".jsonl/.json/.parquet file")
    g.add_argument("--template", default=None, choices=list(data.TEMPLATES),
                   help="prompt template (default: none for arithmetic, dapo otherwise)")
    g.add_argument("--eval-data", default=None,
                   help="held-out data (default: the arithmetic held-out split, or none)")
    g.add_argument("--eval-limit", type=int, default=200, help="held-out problems per evaluation")
    g.add_argument("--eval-every", type=int, default=5, help="steps between held-out "
                   "evaluations (0 = before and after only)")
    g.add_argument("--curriculum", type=float, default=0.75,
                   help="arithmetic: raise the difficulty when the training accuracy (moving "
                        "average) passes this (0 = never)")
    g = p.add_argument_group("sampling")
    g.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step, all ranks")
    g.add_argument("--samples", type=int, default=8, help="G: completions per prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, help="completion budget (L_max)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
                   help="DAPO eq. 11: drop groups whose rewards are all equal, refill")
    g.add_argument("--max-refills", type=int, default=10, help="extra rollout rounds per step")
    g.add_argument("--keep-surplus", action=argparse.BooleanOptionalAction, default=False,
                   help="carry surplus informative groups into the next step (one step stale)")
    g.add_argument("--adversarial", action=argparse.BooleanOptionalAction, default=False,
                   help="re-ask signal-less prompts as harder / hinted variants")
    g.add_argument("--adaptive-budget", action=argparse.BooleanOptionalAction, default=False,
                   help="more samples for prompts near 50%% accuracy, same total")
    g = p.add_argument_group("reward")
    g.add_argument("--correct-reward", type=float, default=1.0, help="reward of a right answer")
    g.add_argument("--wrong-reward", type=float, default=-1.0, help="reward of a wrong answer")
    g.add_argument("--overlong-penalty", action=argparse.BooleanOptionalAction, default=False,
                   help="DAPO eq. 13 soft overlong punishment")
    g.add_argument("--overlong-cache", type=int, default=4096, help="L_cache of eq. 13")
    g.add_argument("--overlong-filter", action=argparse.BooleanOptionalAction, default=False,
                   help="truncated completions get zero loss weight")
    g.add_argument("--ppl-penalty", action=argparse.BooleanOptionalAction, default=False,
                   help="soft perplexity penalty (rewards.perplexity_penalty)")
    g.add_argument("--ppl-threshold", type=float, default=math.log(4.0), help="mean NLL (nats)")
    g.add_argument("--ppl-window", type=float, default=math.log(4.0), help="mean NLL window")
    g.add_argument("--efficiency-weight", type=float, default=0.0,
                   help="balanced reasoning: bonus for short correct answers")
    g = p.add_argument_group("algorithm")
    g.add_argument("--algo", default="pg", choices=["pg", "dpo"], help="policy gradient or DPO")
    g.add_argument("--adv-estimator", default="grpo", choices=list(dapo.ADVANTAGE_KINDS),
                   help="advantage estimator")
    g.add_argument("--loss-agg", default="token-mean", choices=list(losses.AGGREGATIONS),
                   help="loss aggregation")
    g.add_argument("--eps-low", type=float, default=0.2, help="lower clip range")
    g.add_argument("--eps-high", type=float, default=0.28, help="upper clip range (clip-higher)")
    g.add_argument("--clip-c", type=float, default=None, help="dual-clip constant (None = off)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus")
    g.add_argument("--kl", default="none", choices=["none", "k1", "k2", "k3", "gkl"],
                   help="regulariser toward the reference")
    g.add_argument("--kl-coef", type=float, default=0.0, help="its weight")
    g.add_argument("--gkl-alpha", type=float, default=1.0, help="GKL: weight of the KL part")
    g.add_argument("--gkl-beta", type=float, default=1.0, help="GKL: weight of the wMSE part")
    g.add_argument("--gkl-gamma", type=float, default=1.0, help="GKL: weight smoothing power")
    g.add_argument("--gkl-temperature", type=float, default=1.0, help="GKL: KL temperature")
    g.add_argument("--gkl-weight-temperature", type=float, default=1.0,
                   help="GKL: weight temperature")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="DPO beta")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    g.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up, in updates")
    g.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                   help="after warm-up: constant (DAPO), or cosine decay to 10%% at --steps")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm")
    g.add_argument("--mini-batches", type=int, default=1,
                   help="updates per rollout step (mu); 1 = on-policy, no old-log-prob pass")
    g.add_argument("--micro-batch-size", type=int, default=16, help="sequences per backward pass")
    return p


def parse_config(argv=None):
    """Flags < preset < explicit flags. Without any flag: the CPU-scaled dapo preset."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    preset = dict(dapo.PRESETS[args.preset])
    explicit = {a.dest for a in parser._actions for opt in a.option_strings
                if any(x == opt or x.startswith(opt + "=") for x in argv)}
    if args.model is None and args.preset == "dapo" and not args.resume:
        preset.update(CPU_DEFAULTS)  # the offline default run (see CPU_DEFAULTS)
    for key, value in preset.items():
        if key not in explicit:
            setattr(args, key, value)
    check_config(args, parser)
    return args, explicit


def check_config(args, parser):
    positive = ["steps", "prompts_per_step", "samples", "max_new_tokens", "micro_batch_size",
                "mini_batches", "eval_limit", "checkpoint_every"]
    for key in positive:
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.lr <= 0:
        parser.error("need --temperature >= 0, 0 < --top-p <= 1, --lr > 0")
    if args.temperature == 0:
        parser.error("--temperature 0 samples G identical completions: no group signal")
    if args.samples < 2 and args.algo == "pg":
        parser.error("--samples must be >= 2: group advantages need G >= 2")
    if args.ref == "lora-off" and args.lora_rank == 0 and (args.kl != "none" or args.algo == "dpo"):
        parser.error("--ref lora-off needs --lora-rank > 0")
    if args.mini_batches > args.prompts_per_step * args.samples:
        parser.error("--mini-batches exceeds the number of sequences per step")


def lr_factor(update, args):
    """Linear warm-up over `warmup_steps` updates, then constant or cosine down to 10%."""
    if update < args.warmup_steps:
        return (update + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (update - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- distributed

def setup_distributed():
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; plain `python train.py` is one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    # Rank 0 alone evaluates and writes checkpoints while the others wait in a collective: allow
    # more than NCCL's default 10 minutes for that.
    timeout = datetime.timedelta(hours=2)
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=timeout)
    return rank, world, torch.device("cpu")


def all_reduce(tensor, op=None):
    """Sums (or `op`) `tensor` over ranks, in place; a no-op in one process. NCCL reduces CUDA
    tensors only, so a CPU tensor goes through the GPU and back."""
    if not dist.is_initialized():
        return tensor
    op = op or dist.ReduceOp.SUM
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_gpu = tensor.to(torch.cuda.current_device())
        dist.all_reduce(on_gpu, op=op)
        return tensor.copy_(on_gpu)
    dist.all_reduce(tensor, op=op)
    return tensor


# ----------------------------------------------------------------------------- rollout + reward

def sample_groups(policy, tokenizer, records, args, stop_ids, seeds, num_samples):
    """Samples `num_samples[i]` completions of records[i] and scores them. -> list of groups."""
    prompts = [data.format_prompt(r, tokenizer, args.template) for r in records]
    completions = generate(policy, prompts, num_samples=num_samples,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, stop_token_ids=stop_ids, seed=seeds)
    cache_len = args.overlong_cache if args.overlong_cache < args.max_new_tokens \
        else max(1, args.max_new_tokens // 5)  # DAPO's 4096 of 20480, scaled to the budget
    groups, start = [], 0
    for record, prompt, count in zip(records, prompts, num_samples):
        group = {"record": record, "prompt": prompt, "completions": [], "rewards": [],
                 "correct": [], "components": [], "truncated": []}
        for c in completions[start:start + count]:
            text = tokenizer.decode(c.tokens, skip_special_tokens=True)
            mean_nll = -sum(c.logprobs) / max(1, len(c.logprobs))
            reward, parts = rewards.math_reward(
                text, record["answer"], correct=args.correct_reward, wrong=args.wrong_reward,
                **({"length": len(c.tokens), "max_len": args.max_new_tokens,
                    "cache_len": cache_len} if args.overlong_penalty else {}),
                **({"mean_nll": mean_nll, "ppl_threshold": args.ppl_threshold,
                    "ppl_window": args.ppl_window} if args.ppl_penalty else {}))
            group["completions"].append(c)
            group["rewards"].append(reward)
            group["correct"].append(parts["accuracy"] > 0)
            group["components"].append(parts)
            group["truncated"].append(c.finish_reason == "length")
        if args.efficiency_weight:
            bonus = dapo.efficiency_bonus(group["correct"], [len(c.tokens) for c in group["completions"]],
                                          count, args.efficiency_weight)
            group["rewards"] = [r + float(b) for r, b in zip(group["rewards"], bonus)]
            for parts, b in zip(group["components"], bonus):
                parts["efficiency"] = float(b)
        groups.append(group)
        start += count
    return groups


def transform_for(task_rng):
    """Adversarial dynamic sampling: the task's harder / hinted variant of a signal-less prompt."""
    def transform(group, how):
        record = group["record"]
        return data.harder_variant(record, task_rng) if how == "harder" else data.hint_variant(record)
    return transform


# ----------------------------------------------------------------------------- the update

def pack(prompts, completions, device):
    """Prompts left-padded, completions right-padded, in one (B, P + C) batch.

    -> input_ids (B, P+C), attention_mask (B, P+C), loss_mask (B, C), P
    """
    P = max(len(p) for p in prompts)
    C = max(1, max(len(c) for c in completions))
    ids = torch.zeros(len(prompts), P + C, dtype=torch.long)
    attn = torch.zeros(len(prompts), P + C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p):P + len(c)] = 1
    return ids.to(device), attn.to(device), attn[:, P:].to(device), P


def policy_logprobs(model, ids, attn, P, args, with_entropy=False):
    return token_logprobs(model, ids, attn, start=P, temperature=args.temperature,
                          with_entropy=with_entropy)


def split_micro_batches(rows, size, num):
    """`num` lists of row indices of at most `size` (some empty when ranks are uneven)."""
    chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
    return chunks + [[] for _ in range(num - len(chunks))]


def pg_update(model, ref_forward, optimizer, scheduler, samples, args, world, autocast):
    """`mini_batches` optimizer updates over this rank's samples. -> metrics dict.

    samples: dict of lists: prompt, tokens, advantage, group_id (global), sampler_logp, old_logp.
    """
    inner = getattr(model, "module", model)
    n = len(samples["prompt"])
    stats_sum, skipped, empty, grad_norms = {}, 0, 0, []
    mini_size = math.ceil(n / args.mini_batches) if n else 0
    for m in range(args.mini_batches):
        rows = list(range(m * mini_size, min(n, (m + 1) * mini_size)))
        # Every rank must run the same number of backward passes (DDP's all-reduce is per
        # backward): pad with empty micro-batches up to the largest count over ranks.
        num_micro = torch.tensor(math.ceil(len(rows) / args.micro_batch_size), device=args.device)
        num_micro = max(1, int(all_reduce(num_micro, dist.ReduceOp.MAX if dist.is_initialized() else None)))
        micro = split_micro_batches(rows, args.micro_batch_size, num_micro)
        packed = []
        for mb in micro:
            if mb:
                packed.append(pack([samples["prompt"][i] for i in mb],
                                   [samples["tokens"][i] for i in mb], args.device))
            else:  # a zero-weight stand-in: one token of padding, loss multiplied by 0
                packed.append(pack([[0]], [[0]], args.device))
        masks = [pk[2] * (1 if mb else 0) for pk, mb in zip(packed, micro)]
        if args.overlong_filter:  # truncated completions carry no gradient
            masks = [mk * torch.tensor([0 if samples["truncated"][i] else 1 for i in mb] or [0],
                                       device=args.device)[:, None] for mk, mb in zip(masks, micro)]
        gids = [torch.tensor([samples["group_id"][i] for i in mb] or [0], device=args.device)
                for mb in micro]
        # Global divisors of this mini-batch: summed over micro-batches, all-reduced over ranks.
        divisors = losses.micro_batch_divisors(masks, gids, max_tokens=args.max_new_tokens,
                                               distributed=dist.is_initialized())
        if int(divisors[0]["num_tokens"]) == 0:  # no loss token on any rank: nothing to learn
            empty += 1
            continue
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=args.device)
        for k, (mb, (ids, attn, _, P), mask, div) in enumerate(zip(micro, packed, masks, divisors)):
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last or world == 1 else model.no_sync()
            with sync, autocast():
                # One pass of the body (through DDP: one forward, one backward) feeds every term.
                hidden = model(ids, attn, return_hidden=True)  # (b, P+C, H)
                logp, ent = token_logprobs(inner, ids, attn, start=P, temperature=args.temperature,
                                           with_entropy=True, entropy_grad=args.entropy_coef > 0,
                                           hidden=hidden)
                logp = logp[:, :mask.shape[1]]  # (b, C)
                if mb:
                    old = pad_rows([samples["old_logp"][i] for i in mb], mask.shape[1], args.device) \
                        if args.mini_batches > 1 else logp.detach()
                    adv = torch.tensor([samples["advantage"][i] for i in mb], device=args.device)
                else:
                    old, adv = logp.detach(), torch.zeros(1, device=args.device)
                loss, st = losses.policy_loss(logp, old, adv, mask, eps_low=args.eps_low,
                                              eps_high=args.eps_high, clip_c=args.clip_c,
                                              agg=args.loss_agg, **div, group_ids=gids[k])
                if args.entropy_coef:
                    ent_term, _ = losses.aggregate(ent[:, :mask.shape[1]], mask, args.loss_agg, **div,
                                                   group_ids=gids[k])
                    loss = loss - args.entropy_coef * ent_term
                if args.kl != "none":
                    loss = loss + args.kl_coef * kl_term(inner, ref_forward, hidden, ids, attn, P,
                                                         logp, mask, div, gids[k], args)
                # DDP averages gradients over ranks; the divisors are already global, so scale
                # back up to make the all-reduce a sum (the update equals one device's).
                (loss * world).backward()
            step_loss += loss.detach()
            weight = mask.sum()
            for key, value in {**st, "entropy": (ent[:, :mask.shape[1]] * mask).sum() / weight.clamp(min=1)}.items():
                stats_sum[key] = stats_sum.get(key, 0.0) + float(value.detach() if torch.is_tensor(value) else value) * float(weight)
            stats_sum["_tokens"] = stats_sum.get("_tokens", 0.0) + float(weight)
            if mb and args.mini_batches == 1:
                for j, i in enumerate(mb):  # on-policy: these are the old log-probs
                    samples["old_logp"][i] = logp[j, :len(samples["tokens"][i])].detach().float().cpu().tolist()
        grad_norm = torch.nn.utils.clip_grad_norm_(inner.parameters(), args.grad_clip)
        finite = torch.isfinite(all_reduce(step_loss.clone())) & torch.isfinite(grad_norm)
        if bool(finite):
            optimizer.step()
            scheduler.step()
            grad_norms.append(float(grad_norm))
        else:  # leave weights and optimizer state as they were; count it
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
    tokens = max(stats_sum.pop("_tokens", 0.0), 1.0)
    out = {k: v / tokens for k, v in stats_sum.items() if k != "tokens"}
    out.update(skipped_updates=skipped, empty_updates=empty,
               grad_norm=sum(grad_norms) / max(1, len(grad_norms)))
    return out


def kl_term(model, ref_forward, hidden, ids, attn, P, logp, mask, div, gids, args, positions=64):
    """k1/k2/k3 (Schulman) of the sampled tokens, or GKL (Cui et al. 2025) over the vocabulary.

    hidden (b, P+C, H): the policy body's output for ids, already computed for the log-probs.
    GKL needs whole logit rows of both policies; they are made `positions` at a time and made
    again in backward (checkpoint), so no (b, C, V) tensor or its gradient is ever held.
    """
    C = mask.shape[1]
    if args.kl == "gkl":
        with torch.no_grad():
            ref_hidden = ref_forward(lambda m: m(ids, attn, return_hidden=True))[:, P - 1:P - 1 + C]
            ref_weight = ref_forward(lambda m: m.output.weight)  # (V, H)
        hidden = hidden[:, P - 1:P - 1 + C]  # (b, C, H): position t predicts completion token t

        def term_of(h, h_ref):  # (b, c, H) -> (b, c)
            return losses.gkl_per_token(
                F.linear(h, model.output.weight), F.linear(h_ref, ref_weight),
                alpha=args.gkl_alpha, beta=args.gkl_beta, gamma=args.gkl_gamma,
                temperature=args.gkl_temperature, weight_temperature=args.gkl_weight_temperature)[0]

        per_token = torch.cat([checkpoint(term_of, hidden[:, s:s + positions],
                                          ref_hidden[:, s:s + positions], use_reentrant=False)
                               for s in range(0, C, positions)], dim=1)  # (b, C)
    else:
        with torch.no_grad():
            ref_logp = ref_forward(lambda m: policy_logprobs(m, ids, attn, P, args))[:, :C]
        per_token = losses.kl_estimate(logp, ref_logp, args.kl)
    loss = losses.aggregate(per_token, mask, args.loss_agg, **div, group_ids=gids)
    return loss[0] if isinstance(loss, tuple) else loss


def pad_rows(rows, width, device):
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width])
    return out.to(device)


def dpo_update(model, ref_forward, optimizer, scheduler, groups, args, world, autocast):
    """DPO (Rafailov et al. 2023) on correct-vs-incorrect completions of the same prompt."""
    rewards_flat = [r for g in groups for r in g["rewards"]]
    sizes = [len(g["rewards"]) for g in groups]
    flat = [(g["prompt"], c.tokens) for g in groups for c in g["completions"]]
    pairs = dapo.dpo_pairs(rewards_flat, sizes) if flat else []
    num_pairs = torch.tensor(float(len(pairs)), device=args.device)
    all_reduce(num_pairs)
    optimizer.zero_grad(set_to_none=True)
    per = max(1, args.micro_batch_size // 2)
    num_micro = torch.tensor(max(1, math.ceil(len(pairs) / per)), device=args.device)
    all_reduce(num_micro, dist.ReduceOp.MAX if dist.is_initialized() else None)
    stats = {}
    for k in range(int(num_micro)):
        chunk = pairs[k * per:(k + 1) * per]
        rows = [flat[i] for pair in chunk for i in pair] or [([0], [0])]
        ids, attn, mask, P = pack([r[0] for r in rows], [r[1] for r in rows], args.device)
        sync = contextlib.nullcontext() if k == int(num_micro) - 1 or world == 1 else model.no_sync()
        with sync, autocast():
            seq_logp = (policy_logprobs(model, ids, attn, P, args) * mask).sum(-1)  # (2b,)
            with torch.no_grad():
                ref = (ref_forward(lambda m: policy_logprobs(m, ids, attn, P, args)) * mask).sum(-1)
            if chunk:
                loss, st = losses.dpo_loss(seq_logp[0::2], seq_logp[1::2], ref[0::2], ref[1::2],
                                           args.dpo_beta, num_pairs=num_pairs.clamp(min=1))
            else:
                loss, st = seq_logp.sum() * 0, {}
            (loss * world).backward()
        for key, v in st.items():
            stats[key] = stats.get(key, 0.0) + float(v) * len(chunk)
    grad_norm = torch.nn.utils.clip_grad_norm_(getattr(model, "module", model).parameters(), args.grad_clip)
    skipped = 0
    if torch.isfinite(grad_norm) and len(pairs) + float(num_pairs) > 0:
        optimizer.step()
        scheduler.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        skipped = int(not torch.isfinite(grad_norm))
    out = {k: v / max(1, len(pairs)) for k, v in stats.items() if k != "pairs"}
    out.update(pairs=len(pairs), skipped_updates=skipped, grad_norm=float(grad_norm))
    return out


# ----------------------------------------------------------------------------- checkpoints

def atomic_torch_save(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash leaves the previous checkpoint whole


def drop_lines_after(path, step):
    """Keeps the JSON lines of `path` whose "step" is <= step; a torn last line goes too."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                pass
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)  # a crash here leaves the old file whole


def rng_state():
    # CUDA: this rank's own device only (a resume may see a different number of GPUs).
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(as_random_state(state["python"]))
    if torch.cuda.is_available() and torch.is_tensor(state.get("cuda")):
        torch.cuda.set_rng_state(state["cuda"])


def as_random_state(state):
    """random.getstate() after a torch.save round trip (its inner tuple may come back a list)."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in state)


def groups_to_plain(groups):
    """Carried groups as dicts and lists only, so that torch.load(weights_only=True) reads them."""
    return [{**g, "completions": [dataclasses.asdict(c) for c in g["completions"]]} for g in groups]


def groups_from_plain(groups):
    return [{**g, "completions": [Completion(**c) for c in g["completions"]]} for g in groups]


# ----------------------------------------------------------------------------- main

def load_data(args, tokenizer, context):
    """-> (training source: ArithmeticTask or records, held-out records or None), all checked."""
    max_prompt = context - args.max_new_tokens
    if max_prompt < 1:
        raise data.DataError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt "
                             f"in the model's context of {context}")
    heldout = None
    if str(args.data).startswith("arithmetic"):
        source = data.ArithmeticTask.from_spec(args.data)
        if args.eval_data is None:
            heldout = source.heldout(args.eval_limit)
    else:
        source = data.load_records(args.data, tokenizer=tokenizer, template=args.template,
                                   max_prompt_tokens=max_prompt)
    if args.eval_data:
        heldout = data.load_records(args.eval_data, split="test", limit=args.eval_limit,
                                    tokenizer=tokenizer, template=args.template,
                                    max_prompt_tokens=max_prompt)
    return source, heldout


def evaluate_heldout(policy, tokenizer, records, args, stop_ids):
    import eval as evaluation
    summary, _ = evaluation.evaluate(policy, tokenizer, records, k=1, temperature=0.0,
                                     max_new_tokens=args.max_new_tokens, template=args.template,
                                     batch_size=64, progress=False)
    return summary


def plot_run(run_dir):
    """Learning curve of a run directory -> run_dir/curve.png (needs matplotlib, optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("train.py: --plot needs matplotlib (pip install matplotlib)")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    evals = []
    if os.path.exists(os.path.join(run_dir, "eval.jsonl")):
        with open(os.path.join(run_dir, "eval.jsonl")) as f:
            evals = [json.loads(l) for l in f if l.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["train_seconds"] / 60 for r in rows], [r["accuracy"] for r in rows], ".", alpha=0.5,
            label="training samples (temperature %.1f, rising difficulty)" % rows[0].get("temperature", 1.0)
            if "temperature" in rows[0] else "training samples")
    ax.plot([e["train_seconds"] / 60 for e in evals], [e["pass@1"] for e in evals], "o-",
            label=f"held-out, greedy ({evals[0]['n']} problems)" if evals else "held-out")
    ax.set_xlabel("training minutes (evaluation excluded)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    out = os.path.join(run_dir, "curve.png")
    fig.savefig(out, dpi=100)
    print(out)


def main(argv=None):
    args, explicit = parse_config(argv)
    if args.plot:
        return plot_run(args.plot)
    if args.bench and "steps" not in explicit:
        args.steps = 3
    rank, world, device = setup_distributed()
    args.device = device
    if args.resume:
        config_path = os.path.join(args.resume, "config.json")
        if not os.path.isfile(config_path):
            sys.exit(f"train.py: --resume {args.resume}: no config.json there (not a run directory)")
        with open(config_path) as f:
            saved = json.load(f)
        # The saved config wins, except what this command line sets explicitly (e.g. --steps).
        keep = {k: getattr(args, k) for k in explicit | {"resume"}}
        for key, value in saved.items():
            setattr(args, key, value)
        args.__dict__.update(keep)
        args.out, args.device = args.resume, device
    elif args.out is None:
        args.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if not args.resume and not args.bench and os.path.exists(args.out):
        sys.exit(f"train.py: --out {args.out} already exists; use --resume {args.out} or a new --out")
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)

    use_bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and (
        device.type == "cuda" or cpu_has_bf16()))
    try:
        model, tokenizer = load_model(args.model, dtype=torch.float32, device=device)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: --model: {e}")
    model.train()
    model.gradient_checkpointing = args.activation_checkpointing
    if args.lora_rank:
        add_lora(model, rank=args.lora_rank, alpha=args.lora_alpha)
    if args.template is None:
        args.template = "none" if str(args.data).startswith("arithmetic") else "dapo"
    import eval as evaluation
    stop_ids = evaluation.stop_token_ids(tokenizer)

    # Data: validated in full before any training.
    try:
        source, heldout = load_data(args, tokenizer, model.config.max_seq_len)
    except data.DataError as e:
        sys.exit(f"train.py: --data: {e}")
    stream = data.PromptStream(source, args.prompts_per_step, seed=args.seed, rank=rank,
                               world_size=world)


    # Reference policy (KL, GKL, DPO): a frozen copy, or the same weights with LoRA off.
    ref_model = None
    if (args.kl != "none" or args.algo == "dpo") and args.ref == "frozen":
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    def ref_forward(fn):
        if ref_model is not None:
            return fn(ref_model)
        with lora_disabled(model):
            return fn(getattr(model, "module", model))

    # Rollouts run in bf16 on a copy refreshed after each update (and after a resume), where
    # bf16 is fast.
    rollout_model = None
    if use_bf16 and not args.lora_rank:
        rollout_model = copy.deepcopy(model).to(torch.bfloat16).eval()

    @torch.no_grad()
    def refresh_rollout_copy():
        if rollout_model is not None:
            for p_roll, p in zip(rollout_model.parameters(), inner.parameters()):
                p_roll.copy_(p)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999), fused=True)  # one kernel for all tensors
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    inner = getattr(model, "module", model)

    def autocast():
        if use_bf16:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # State that a checkpoint restores.
    step, carry, accuracy_tracker, train_acc_ema, resumed_seconds = 0, [], {}, None, 0.0
    counters = {"skipped_updates": 0, "missing_groups": 0}
    checkpoint_path = os.path.join(args.out, "checkpoint.pt")
    rank_state = {}
    if args.resume and os.path.exists(checkpoint_path):
        # On the CPU: RNG states must stay there; load_state_dict copies the rest to the device.
        ckpt = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        inner.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        per_rank = ckpt.get("per_rank") or [  # a first-version checkpoint shared these two
            {**rngs, "data": ckpt["data"], "accuracy_tracker": ckpt["accuracy_tracker"]}
            for rngs in ckpt["rng"]]
        # A run resumed on more ranks than it had: new ranks take rank 0's data position and
        # RNGs, no carried groups, and their own fresh adversarial RNG. (On fewer ranks, the
        # groups the missing ranks carried are dropped: they were surplus.)
        rank_state = (per_rank[rank] if rank < len(per_rank) else
                      {k: v for k, v in per_rank[0].items() if k not in ("carry", "adversarial")})
        set_rng_state(rank_state)
        stream.load_state_dict(rank_state["data"])
        accuracy_tracker = rank_state["accuracy_tracker"]
        step, train_acc_ema, counters = ckpt["step"], ckpt["train_acc_ema"], ckpt["counters"]
        resumed_seconds = ckpt.get("train_seconds", 0.0)
        carry = groups_from_plain(rank_state.get("carry", []))  # surplus groups, --keep-surplus
        refresh_rollout_copy()
    if rank == 0 and not args.bench:
        os.makedirs(args.out, exist_ok=True)
        if not args.resume:
            with open(os.path.join(args.out, "config.json"), "w") as f:
                json.dump({k: v for k, v in vars(args).items() if k != "device"}, f, indent=2)
        # On resume, drop the log lines written after the checkpoint (they will be written again).
        drop_lines_after(os.path.join(args.out, "metrics.jsonl"), step)
        # With no checkpoint yet the run starts over, its step-0 evaluation included.
        drop_lines_after(os.path.join(args.out, "eval.jsonl"), step if step else -1)
        print(f"config: {json.dumps({k: v for k, v in vars(args).items() if k != 'device'}, default=str)}")

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    policy_for_rollout = lambda: rollout_model if rollout_model is not None else inner
    if heldout and rank == 0 and not args.bench and step == 0:
        t = time.perf_counter()
        before = evaluate_heldout(policy_for_rollout().eval(), tokenizer, heldout, args, stop_ids)
        inner.train()
        log(f"held-out accuracy before training: {before['pass@1']:.3f} on {before['n']} problems "
            f"({time.perf_counter() - t:.0f} s)")
        with open(os.path.join(args.out, "eval.jsonl"), "a") as f:
            f.write(json.dumps({"step": 0, "train_seconds": 0.0, **before}) + "\n")

    task_rng = random.Random(f"{args.seed}:adversarial:{rank}")  # draws the harder variants
    if "adversarial" in rank_state:
        task_rng.setstate(as_random_state(rank_state["adversarial"]))
    train_seconds = resumed_seconds  # the time limit counts the whole run, across resumes
    bench_rows = []
    from tqdm import tqdm
    bar = tqdm(total=None if args.time_limit else args.steps, initial=step,
               disable=rank != 0 or args.bench, desc="train", unit="step")
    while step < args.steps:
        # Every rank must stop at the same step (or the others hang in the next collective),
        # and their clocks differ: stop when any rank is over the limit.
        over = torch.tensor(float(bool(args.time_limit) and train_seconds > args.time_limit * 60))
        if all_reduce(over, dist.ReduceOp.MAX) > 0:
            log(f"time limit of {args.time_limit} minutes reached after {step} steps")
            break
        t0 = time.perf_counter()
        per_rank = args.prompts_per_step // world

        # 1-2. Rollout and reward, with dynamic sampling (bounded refills).
        policy = policy_for_rollout().eval()
        timing = {"rollout": 0.0, "scoring": 0.0}
        gen_tokens = [0]

        def sample_round(round_index, num_missing, extra_prompts):
            records = list(extra_prompts)
            fresh = next(stream) if round_index == 0 or len(records) < per_rank else []
            records = (records + fresh)[:max(per_rank, len(records))]
            if args.adaptive_budget:
                accs = [accuracy_tracker.get(r["id"]) for r in records]
                counts = dapo.adaptive_num_samples(accs, total=len(records) * args.samples,
                                                   min_samples=2, max_samples=2 * args.samples)
            else:
                counts = [args.samples] * len(records)
            ts = time.perf_counter()
            # A seed per prompt from its global position: samples do not depend on world size.
            first = stream.step * args.prompts_per_step + rank * per_rank
            seeds = [random.Random(f"{args.seed}:{step}:{round_index}:{first + i}").getrandbits(62)
                     for i in range(len(records))]
            groups = sample_groups(policy, tokenizer, records, args, stop_ids, seeds, counts)
            timing["rollout"] += time.perf_counter() - ts
            gen_tokens[0] += sum(len(c.tokens) for g in groups for c in g["completions"])
            for g in groups:
                dapo.update_accuracy(accuracy_tracker, g["record"]["id"],
                                     sum(g["correct"]) / len(g["correct"]))
            all_groups.extend(groups)
            return groups

        all_groups = []
        with torch.no_grad():
            if args.dynamic_sampling and args.algo == "pg":
                groups, report = dapo.dynamic_sample(
                    sample_round, per_rank, 1 + args.max_refills, carry=carry,
                    keep_surplus=args.keep_surplus,
                    transform=transform_for(task_rng) if args.adversarial else None)
                carry = report.pop("carry")
            else:
                groups = sample_round(0, per_rank, [])
                report = {"rounds": 1, "kept": len(groups), "missing": 0}
        t_rollout = time.perf_counter() - t0

        # 3. Advantages over each kept group (group ids numbered globally for the aggregation).
        ts = time.perf_counter()
        inner.train()
        samples = {"prompt": [], "tokens": [], "advantage": [], "group_id": [], "truncated": [],
                   "sampler_logp": [], "old_logp": []}
        if groups:
            flat_rewards = torch.tensor([r for g in groups for r in g["rewards"]])
            sizes = [len(g["rewards"]) for g in groups]
            kind = args.adv_estimator
            if kind == "reinforce_baseline" and world > 1:
                adv = dapo.group_advantages(flat_rewards, sizes, "dr_grpo")
                # whiten over all ranks' samples, not this rank's share
                moments = all_reduce(torch.tensor([adv.sum(), (adv ** 2).sum(), adv.numel()],
                                                  dtype=torch.float64))
                mean = moments[0] / moments[2]
                std = (moments[1] / moments[2] - mean ** 2).clamp(min=0).sqrt()
                adv = ((adv - mean) / (std + 1e-6)).float()
            else:
                adv = dapo.group_advantages(flat_rewards, sizes, kind)
        else:
            adv = torch.zeros(0)
            if args.adv_estimator == "reinforce_baseline" and world > 1:
                all_reduce(torch.zeros(3, dtype=torch.float64))
        i = 0
        for gi, g in enumerate(groups):
            for c, trunc in zip(g["completions"], g["truncated"]):
                samples["prompt"].append(g["prompt"])
                samples["tokens"].append(c.tokens)
                samples["advantage"].append(float(adv[i]))
                samples["group_id"].append(rank * 100_000 + gi)
                samples["truncated"].append(trunc)
                samples["sampler_logp"].append(c.logprobs)
                samples["old_logp"].append(None)
                i += 1
        if args.mini_batches > 1 and samples["prompt"]:  # old log-probs, before any update
            with torch.no_grad(), autocast():
                for s in range(0, len(samples["prompt"]), args.micro_batch_size):
                    rows = range(s, min(len(samples["prompt"]), s + args.micro_batch_size))
                    ids, attn, mask, P = pack([samples["prompt"][r] for r in rows],
                                              [samples["tokens"][r] for r in rows], device)
                    lp = policy_logprobs(inner, ids, attn, P, args).float().cpu()
                    for j, r in enumerate(rows):
                        samples["old_logp"][r] = lp[j, :len(samples["tokens"][r])].tolist()
        t_scoring = time.perf_counter() - ts

        # 4-5. Updates.
        ts = time.perf_counter()
        if args.algo == "dpo":
            upd = dpo_update(model, ref_forward, optimizer, scheduler, groups, args, world, autocast)
        else:
            upd = pg_update(model, ref_forward, optimizer, scheduler, samples, args, world, autocast)
        refresh_rollout_copy()
        t_update = time.perf_counter() - ts
        step += 1
        train_seconds += time.perf_counter() - t0

        # Metrics: summed over ranks, written by rank 0.
        all_c = [parts for g in all_groups for parts in g["components"]]
        lengths = [len(c.tokens) for g in all_groups for c in g["completions"]]
        mism = [abs(a - b) for i2 in range(len(samples["prompt"])) if samples["old_logp"][i2]
                for a, b in zip(samples["sampler_logp"][i2], samples["old_logp"][i2])]
        upd_tokens = sum(len(t) + len(p) for t, p in zip(samples["tokens"], samples["prompt"]))
        sums = torch.tensor([len(all_c), sum(p["accuracy"] for p in all_c),
                             sum(r for g in all_groups for r in g["rewards"]),
                             sum(lengths), sum(g["truncated"].count(True) for g in all_groups),
                             len(groups), float(report.get("missing", 0)), len(mism), sum(mism),
                             gen_tokens[0], upd_tokens, len(all_groups),
                             sum(p.get("overlong", 0.0) for p in all_c),
                             sum(p.get("format", 0.0) for p in all_c),
                             sum(p.get("ppl", 0.0) for p in all_c),
                             sum(p.get("efficiency", 0.0) for p in all_c),
                             report.get("surplus_carried", 0), report.get("adversarial_prompts", 0)],
                            dtype=torch.float64)
        all_reduce(sums)
        kept_per_rank = [len(groups)]
        if world > 1:
            kept_per_rank = [None] * world
            dist.all_gather_object(kept_per_rank, len(groups))
        n = max(1.0, float(sums[0]))
        train_acc = float(sums[1]) / n
        train_acc_ema = train_acc if train_acc_ema is None else 0.8 * train_acc_ema + 0.2 * train_acc
        counters["skipped_updates"] += upd.get("skipped_updates", 0)
        counters["missing_groups"] += int(sums[6])
        level = getattr(source, "level", None)
        if (args.curriculum and isinstance(source, data.ArithmeticTask)
                and train_acc_ema > args.curriculum):
            source.harder()  # the task never runs out of headroom
            train_acc_ema = 0.5 * args.curriculum
        row = {
            "step": step, "lr": scheduler.get_last_lr()[0], "level": level,
            "reward": float(sums[2]) / n, "accuracy": train_acc, "accuracy_ema": train_acc_ema,
            "reward_overlong": float(sums[12]) / n, "reward_format": float(sums[13]) / n,
            "reward_ppl": float(sums[14]) / n, "reward_efficiency": float(sums[15]) / n,
            "response_length": float(sums[3]) / n, "truncated": float(sums[4]) / n,
            "groups_sampled": int(sums[11]), "groups_kept": int(sums[5]),
            "groups_missing": int(sums[6]), "groups_carried": int(sums[16]),
            "adversarial_prompts": int(sums[17]), "groups_kept_per_rank": kept_per_rank,
            "rounds": report.get("rounds", 1),
            "sampler_trainer_mismatch": float(sums[8]) / max(1.0, float(sums[7])),
            **{k: v for k, v in upd.items()},
            "skipped_updates_total": counters["skipped_updates"],
            "seconds_rollout": t_rollout, "seconds_scoring": t_scoring, "seconds_update": t_update,
            "tokens_per_second_rollout": float(sums[9]) / max(t_rollout, 1e-9),
            "tokens_per_second_update": float(sums[10]) / max(t_update, 1e-9),
            # Re-scoring (old log-probs) is a pass of its own only with several mini-batches.
            "tokens_per_second_scoring": (float(sums[10]) / max(t_scoring, 1e-9)
                                          if args.mini_batches > 1 else None),
            "train_seconds": train_seconds,
        }
        if args.bench:
            bench_rows.append(row)
            log(f"step {step}: rollout {t_rollout:.1f} s, scoring {t_scoring:.1f} s, update "
                f"{t_update:.1f} s ({row['tokens_per_second_rollout']:.0f} / "
                f"{row['tokens_per_second_update']:.0f} tok/s)")
            continue
        if rank == 0:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix_str(f"acc {train_acc:.2f} kept {int(sums[5])}/{int(sums[11])} "
                                f"len {row['response_length']:.0f}")
        if heldout and rank == 0 and args.eval_every and step % args.eval_every == 0:
            res = evaluate_heldout(policy_for_rollout().eval(), tokenizer, heldout, args, stop_ids)
            inner.train()
            log(f"step {step}: held-out accuracy {res['pass@1']:.3f}")
            with open(os.path.join(args.out, "eval.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "train_seconds": train_seconds, **res}) + "\n")
        if step % args.checkpoint_every == 0 or step == args.steps:
            # What each rank alone holds: its RNGs, its data position (refills draw different
            # numbers of batches on different ranks), its prompts' accuracies, and the groups it
            # carries into the next step.
            per_rank = [{**rng_state(), "adversarial": task_rng.getstate(),
                         "data": stream.state_dict(), "accuracy_tracker": accuracy_tracker,
                         "carry": groups_to_plain(carry)}]
            if world > 1:
                gathered = [None] * world
                dist.all_gather_object(gathered, per_rank[0])
                per_rank = gathered
            if rank == 0:
                atomic_torch_save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(),
                                   "scheduler": scheduler.state_dict(), "per_rank": per_rank,
                                   "step": step, "train_acc_ema": train_acc_ema,
                                   "counters": counters, "train_seconds": train_seconds},
                                  checkpoint_path)
    bar.close()

    if args.bench:
        for key in ("seconds_rollout", "seconds_scoring", "seconds_update"):
            vals = [r[key] for r in bench_rows]
            log(f"{key}: mean {sum(vals) / len(vals):.2f}")
    elif rank == 0:
        after = None
        if heldout:
            eval_path = os.path.join(args.out, "eval.jsonl")
            last = {"step": -1}
            if os.path.exists(eval_path):
                with open(eval_path) as f:
                    last = ([json.loads(l) for l in f if l.strip()] or [last])[-1]
            if last["step"] == step:  # evaluated at this very step already
                after = last
            else:
                after = evaluate_heldout(policy_for_rollout().eval(), tokenizer, heldout, args, stop_ids)
                with open(os.path.join(args.out, "eval.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "train_seconds": train_seconds, **after}) + "\n")
        save_model(inner, tokenizer, os.path.join(args.out, "final"))
        summary = {"out": args.out, "steps": step, "train_minutes": round(train_seconds / 60, 2),
                   "skipped_updates": counters["skipped_updates"]}
        if after:
            with open(os.path.join(args.out, "eval.jsonl")) as f:
                first = json.loads(f.readline())
            summary.update({"heldout_before": first["pass@1"], "heldout_after": after["pass@1"]})
        print(json.dumps(summary), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        # The DDP wrapper still holds the backend; freed during the interpreter's shutdown, its
        # worker threads sometimes abort the process ("terminate called without an active
        # exception", seen here about once in 40 gloo runs). Everything is written: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
