"""Train a language model with DAPO (or GRPO, Dr. GRPO, RLOO, REINFORCE-baseline, DPO) on math.

    python train.py                       # the offline default: bundled SmolLM2-135M-Instruct,
                                          # synthetic arithmetic, on a laptop CPU (README: timings)
    python train.py --preset dapo --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k --max-new-tokens 1024
    torchrun --nproc_per_node 8 train.py --preset dapo --model Qwen/Qwen2.5-1.5B-Instruct \\
        --data dapo-math-17k --prompts-per-step 512 --samples 16 --max-new-tokens 4096
    python train.py --resume runs/NAME    # continue a run exactly where it stopped
    python train.py --plot runs/NAME      # its learning curve, runs/NAME/curve.png
    python train.py --bench               # seconds per step: rollout / scoring / update

DAPO (Yu et al. 2025, arXiv 2503.14476) is GRPO (Shao et al. 2024, arXiv 2402.03300) with a rule
reward (eq. 7), no KL term, and four changes, numbered as in dapo.py (the paper's order):
  1. Clip-higher (eq. 10): eps_low 0.2, eps_high 0.28. The ratio leaves 1 only after the first of
     the mu updates of a step (or on groups carried off-policy), so this acts only with
     --mini-batches > 1 (the paper takes 16).
  2. Dynamic sampling (eq. 11): drop the groups whose G answers are all right or all wrong, and
     sample more prompts until the batch is full or --max-refills rounds are spent.
  3. Token-level loss (eq. 12): divide by the number of tokens of the whole mini-batch.
  4. Overlong reward shaping (eq. 13): truncated samples masked, or punished softly.

One training step (`train_step`), numbered as the code below:
  1. Sample G completions of each prompt and reward them (eq. 7, change 4's punishment); a task
     in turns (episodes.py) samples G episodes, rewarded by their outcome, a row per turn.
  2. Filter and refill the groups (change 2).
  3. Advantages within each group (eq. 9).
  4. Old log-probs: the trainer scores the batch before its first update (pi_old of eq. 10).
  5. mu updates, each on 1/mu of the batch, accumulated over micro-batches with the token counts
     of the whole mini-batch over all ranks as divisors (changes 1, 3 and 4's mask).
  6. Metrics: named sums, reduced over ranks in one call; rank 0 writes them.
--steps, --warmup-steps and the learning-rate schedule count these training steps, as the paper
and verl do; the log also counts optimizer updates.

A run directory (--out) holds config.json (every flag), metrics.jsonl (a line per step),
eval.jsonl (held-out accuracy), checkpoint.pt (the latest; the one before it is kept as
checkpoint-previous.pt) and final/ (save_model: loadable by load_model and by transformers).
"""

import argparse
import contextlib
import copy
import dataclasses
import datetime
import itertools
import json
import math
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import config
import dapo
import data
import episodes
import losses
import quantize
import rewards
import runs
import sharding
import verify
from checkpoints import cpu_has_bf16, load_model, save_model
from lora import add_lora, lora_disabled
from model import token_logprobs
from moe import Routing, load_balancing_loss
from rollout import line_break_ids, stop_token_ids

# ---- the batch a step carries, and what a run holds ---------------------------------------------

@dataclass(frozen=True)
class Rollouts:
    """G episodes of each of several prompts, prompt-major, a row per completion (an episode of
    several turns has a row per turn, consecutive): what a step carries from sampling to the
    update. Every field holds one entry per row, except `records` and `group_sizes` (one per
    group); steps 3 and 4 return copies with `advantages` and `old_logprobs` filled in."""
    records: list           # per group: the prompt's data record
    group_sizes: list       # per group: its rows (G_i episodes' turns; the adaptive budget varies G_i)
    prompts: list           # prompt token ids
    tokens: list            # completion token ids, ending with the stop token if one came
    sampler_logprobs: list  # the sampler's log-probs of those tokens
    truncated: list         # ran out of --max-new-tokens
    rewards: list           # the episode's reward, all terms included
    correct: list           # the episode's answer is right (what eq. 11 filters on)
    reward_parts: list      # every reward term by name, for the log
    stale: list             # sampled by the previous step's policy (--keep-surplus)
    advantages: list = None     # step 3
    old_logprobs: list = None   # step 4; None entries: on-policy (the update's own, detached)
    turn: list = None       # its turn in its episode (episodes.py); None: every episode one turn
    routing: list = None        # --routing-replay: the sampler's experts, (prompt + tokens, L, k)

    @property
    def num_groups(self):
        return len(self.group_sizes)

    def group_index(self):
        """(N,) the group of each completion."""
        return [g for g, size in enumerate(self.group_sizes) for _ in range(size)]

    def group_starts(self):
        """(groups,) where each group's completions start."""
        return [sum(self.group_sizes[:g]) for g in range(self.num_groups)]

    def episode_starts(self):
        """The rows that open an episode (its turns are the rows up to the next one): an episode's
        outcome (rewards, correct) is on each of its turns, read once here."""
        return [i for i, turn in enumerate(self.turn or [0] * len(self.tokens)) if turn == 0]

    def episode_index(self):
        """(N,) the episode of each completion."""
        starts = set(self.episode_starts())
        return [n - 1 for n in itertools.accumulate(int(i in starts) for i in range(len(self.tokens)))]

    def episodes_per_group(self):
        """(groups,) each group's number of episodes (its G; group_sizes counts turns)."""
        starts = set(self.episode_starts())
        return [sum(i in starts for i in range(first, first + size))
                for first, size in zip(self.group_starts(), self.group_sizes)]

    def select(self, groups):
        """The groups at these indices, in this order."""
        groups, starts = list(groups), self.group_starts()
        rows = [i for g in groups for i in range(starts[g], starts[g] + self.group_sizes[g])]
        return Rollouts(**{f.name: None if getattr(self, f.name) is None else
                           [getattr(self, f.name)[i] for i in
                            (groups if f.name in ("records", "group_sizes") else rows)]
                           for f in dataclasses.fields(self)})

    @staticmethod
    def concat(parts):
        return Rollouts(**{f.name: None if any(getattr(p, f.name) is None for p in parts) else
                           [x for p in parts for x in getattr(p, f.name)]
                           for f in dataclasses.fields(Rollouts)})


# One completion of one token, for micro-batches that carry no loss (policy_micro_batches masks it).
STAND_IN = Rollouts(records=[{}], group_sizes=[1], prompts=[[0]], tokens=[[0]],
                    sampler_logprobs=[[0.0]], truncated=[False], rewards=[0.0], correct=[False],
                    reward_parts=[{}], stale=[True], advantages=[0.0], old_logprobs=[None])


@dataclass(frozen=True)
class Progress:
    """What a checkpoint restores besides the weights, the optimizer and the random states."""
    step: int = 0                  # training steps done
    updates: int = 0               # optimizer updates done (mu per step)
    train_seconds: float = 0.0     # across resumes: the time limit counts the whole run
    accuracy_ema: float = None     # training accuracy, moving average (the curriculum reads it)
    skipped_updates: int = 0       # non-finite losses or gradients, left out
    prompt_accuracy: dict = field(default_factory=dict)  # per prompt id, all ranks' samples
    carry: Rollouts = None         # this rank's surplus groups for the next step


@dataclass
class Run:
    """The long-lived objects of a run (a step's data flows through Rollouts, not here)."""
    args: argparse.Namespace
    rank: int
    world: int
    model: torch.nn.Module      # the policy; under torchrun wrapped in DDP (forward and backward)
    policy: torch.nn.Module     # the same module unwrapped (parameters, head, saving)
    sampler: torch.nn.Module    # what rollouts run on: a bf16 copy where bf16 is fast, or policy
    reference: torch.nn.Module  # frozen copy for KL / GKL / DPO, or None (none, or --ref lora-off)
    tokenizer: object
    stop_ids: list
    step_separators: list       # token ids that end a line (Step-DPO's steps)
    optimizer: torch.optim.Optimizer
    source: object              # data.ArithmeticTask or a list of records
    stream: data.PromptStream   # this rank's slice of every batch
    heldout: list               # held-out records, or None
    bf16: bool                  # updates under bf16 autocast
    variant_rng: random.Random  # draws the adversarial variants
    run_lock: object            # rank 0's hold on the run directory (run.lock), else None


# ---- one training step --------------------------------------------------------------------------

def train_step(run, progress):
    """One training step, numbered as in the module docstring. -> (progress after it, its log row,
    a few of its completions for samples.jsonl)"""
    args = run.args
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(progress.step, args)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        kept, sampled, surplus, asked = collect_rollouts(run, progress)  # 1-2
    sampled_at = time.perf_counter()
    batch = with_advantages(run, kept)                                   # 3
    batch = with_old_logprobs(run, batch)                                # 4
    scored_at = time.perf_counter()
    run.policy.train()
    update_sums, update_maxima = update(run, batch)                      # 5
    updated_at = time.perf_counter()
    refresh_sampler(run)  # under FSDP: the weights gathered for the next rollouts
    end = time.perf_counter()
    seconds = {"rollout": sampled_at - start, "scoring": scored_at - sampled_at,
               "update": updated_at - scored_at, "refresh": end - updated_at}
    row = step_metrics(run, progress, sampled, kept, surplus, asked,     # 6
                       update_sums, {**update_maxima, "peak_memory_mib": peak_memory_mib(args)},
                       seconds)

    ema = row["accuracy"] if progress.accuracy_ema is None else \
        0.8 * progress.accuracy_ema + 0.2 * row["accuracy"]
    if args.curriculum and isinstance(run.source, data.ArithmeticTask) and ema > args.curriculum:
        run.source.harder()  # the task never runs out of headroom
        ema = 0.5 * args.curriculum
    row["accuracy_ema"] = ema
    progress = replace(progress, step=progress.step + 1, updates=row["updates"],
                       train_seconds=progress.train_seconds + end - start, accuracy_ema=ema,
                       skipped_updates=row["skipped_updates_total"], carry=surplus,
                       prompt_accuracy=shared_prompt_accuracy(run, progress, sampled)
                       if args.adaptive_budget else {})
    row["train_seconds"] = progress.train_seconds
    shown = batch if batch.tokens else (sampled or [batch])[0]  # every group dropped: round 1's
    return progress, row, sample_lines(run, shown, progress.step)


# ---- 1-2: sample, reward, filter ----------------------------------------------------------------

def reward_options(args, completion):
    """rewards.math_reward's keyword arguments for one completion under this run's flags."""
    options = {"correct": args.correct_reward, "wrong": args.wrong_reward}
    if args.format_reward != "none":
        options.update(format_style=args.format_reward, format_weight=args.format_weight)
    if args.overlong_penalty:  # change 4, eq. 13
        options.update(length=len(completion.tokens), max_len=args.max_new_tokens,
                       cache_len=config.overlong_cache_tokens(args))
    if args.ppl_penalty != "off":
        mean_nll = -sum(completion.logprobs) / max(1, len(completion.logprobs))
        options.update(mean_nll=mean_nll, ppl_threshold=args.ppl_threshold, ppl_window=args.ppl_window)
    return options


def sample_and_reward(run, records, num_samples, seeds):
    """Step 1: num_samples[i] episodes of records[i] from the sampler (one turn each for a math
    problem, episodes.py), each rewarded by its last turn's answer; that outcome, with every
    turn's overlong punishment (change 4 applies per turn), is the reward of all its turns."""
    args, tokenizer = run.args, run.tokenizer
    played = episodes.play(run.sampler.eval(), tokenizer, records, num_samples, seeds,
                           template=args.template, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p,
                           stop_token_ids=run.stop_ids, compile=config.compile_choice(args),
                           record_routing=args.routing_replay)
    group = [g for g, n in enumerate(num_samples) for _ in range(n)]  # (E,) prompt of each episode
    scored = [rewards.math_reward(turns[-1].text, records[g]["answer"],
                                  **reward_options(args, turns[-1].completion))
              for turns, g in zip(played, group)]
    earlier = [sum(rewards.overlong_penalty(len(t.completion.tokens), args.max_new_tokens,
                                            config.overlong_cache_tokens(args)) for t in turns[:-1])
               if args.overlong_penalty else 0.0 for turns in played]  # (E,)
    correct = [parts["accuracy"] > 0 for _, parts in scored]
    bonus = [0.0] * len(played)
    if args.efficiency_weight:  # balanced reasoning: short right answers score a little more
        lengths = [sum(len(t.completion.tokens) for t in turns) for turns in played]
        bonus = dapo.efficiency_bonus(correct, lengths, num_samples, args.efficiency_weight).tolist()
    episode_rewards = [r + e + b for (r, _), e, b in zip(scored, earlier, bonus)]
    parts = [{**p, "overlong": p["overlong"] + e, "efficiency": b}
             for (_, p), e, b in zip(scored, earlier, bonus)]
    rows = [(e, turn) for e, turns in enumerate(played) for turn in turns]  # (N,) episode-major
    rows_per_group = [0] * len(records)
    for g, turns in zip(group, played):
        rows_per_group[g] += len(turns)
    return Rollouts(records=list(records), group_sizes=rows_per_group,
                    prompts=[turn.prompt for _, turn in rows],
                    tokens=[turn.completion.tokens for _, turn in rows],
                    sampler_logprobs=[turn.completion.logprobs for _, turn in rows],
                    truncated=[turn.completion.finish_reason == "length" for _, turn in rows],
                    rewards=[episode_rewards[e] for e, _ in rows], correct=[correct[e] for e, _ in rows],
                    reward_parts=[parts[e] for e, _ in rows], stale=[False] * len(rows),
                    turn=[t for turns in played for t in range(len(turns))],
                    routing=[turn.completion.routing for _, turn in rows] if args.routing_replay else None)


def collect_rollouts(run, progress):
    """Steps 1-2: sample and reward this rank's prompts; with dynamic sampling (change 2) keep
    the groups with 0 < #correct < G and sample again, up to --max-refills more rounds. Never
    loops forever and never fails on the budget (verl raises): the step trains on what it has.
    -> (kept groups, every round's rollouts, surplus groups to carry, adversarial prompts asked)
    """
    args = run.args
    want = args.prompts_per_step // run.world
    rounds = 1 + args.max_refills if args.dynamic_sampling else 1
    carry = progress.carry
    kept = [carry.select(range(min(want, carry.num_groups)))] if carry else []  # stale: use first
    sampled, requests, asked = [], [], 0
    for round_index in range(rounds):
        have = sum(part.num_groups for part in kept)
        if have >= want:
            break
        # The adversarial variants of the last round's signal-less prompts first, then fresh ones.
        records = requests + (next(run.stream)[:want - len(requests)] if len(requests) < want else [])
        # A seed per prompt from its position, unique over ranks: without refills the samples do
        # not depend on the number of ranks.
        first = run.stream.step * args.prompts_per_step + run.rank * want
        seeds = [random.Random(f"{args.seed}:{progress.step}:{round_index}:{first + i}").getrandbits(62)
                 for i in range(len(records))]
        counts = [args.samples] * len(records)
        if args.adaptive_budget:
            counts = dapo.adaptive_num_samples([progress.prompt_accuracy.get(r["id"]) for r in records],
                                               total=len(records) * args.samples, min_samples=2,
                                               max_samples=2 * args.samples)
        batch = sample_and_reward(run, records, counts, seeds)
        sampled.append(batch)
        if not args.dynamic_sampling:
            return batch, sampled, None, 0
        informative = dapo.keep_groups(batch.correct, batch.group_sizes).tolist()  # eq. 11
        kept.append(batch.select(g for g, keep in enumerate(informative) if keep))
        last_round = round_index + 1 == rounds or have + sum(informative) >= want
        requests = [] if last_round or not args.adversarial else adversarial_variants(run, batch)
        asked += len(requests)
    kept = Rollouts.concat(kept)
    surplus = None
    if args.keep_surplus and kept.num_groups > want:  # trained next step, off-policy
        surplus = kept.select(range(want, kept.num_groups))
        surplus = replace(surplus, stale=[True] * len(surplus.stale))
    return kept.select(range(min(want, kept.num_groups))), sampled, surplus, asked


def adversarial_variants(run, batch):
    """The harder (all right) or hinted (all wrong) variants of a round's signal-less prompts,
    those that still fit the prompt budget (a hint or a distractor makes a prompt longer)."""
    budget = run.policy.config.max_seq_len - run.args.max_new_tokens
    variants = []
    for g, how in dapo.adversarial_requests(batch.correct, batch.group_sizes):
        record = batch.records[g]
        variant = data.harder_variant(record, run.variant_rng) if how == "harder" \
            else data.hint_variant(record)
        if variant is not None and len(data.format_prompt(variant, run.tokenizer, run.args.template)) <= budget:
            variants.append(variant)
    return variants


# ---- 3-4: advantages, old log-probs -------------------------------------------------------------

def with_advantages(run, batch):
    """Step 3: group-relative advantages (eq. 9, or the --adv-estimator)."""
    # One advantage per episode (the group: a prompt's G episodes), given to each of its turns.
    rewards_ = torch.tensor([batch.rewards[i] for i in batch.episode_starts()],
                            dtype=torch.float64)  # (E,)
    sizes = batch.episodes_per_group()
    if run.args.adv_estimator == "reinforce_baseline":  # whitened over all ranks' samples
        centred = dapo.group_advantages(rewards_, sizes, "dr_grpo")
        advantages = dapo.whiten(centred, all_reduce(dapo.moments(centred)))
    else:
        advantages = dapo.group_advantages(rewards_, sizes, run.args.adv_estimator)
    return replace(batch, advantages=advantages[batch.episode_index()].tolist())  # (N,)


@torch.no_grad()
def with_old_logprobs(run, batch):
    """Step 4: pi_old of eq. 10, the trainer's log-probs before this step's first update. With
    one update per step they equal the update's own (detached), so nothing is computed here.
    Groups carried from the last step keep their sampler's log-probs: that policy sampled them."""
    args = run.args
    old = [list(lp) if stale else None for lp, stale in zip(batch.sampler_logprobs, batch.stale)]
    if args.mini_batches > 1 and args.algo == "pg":  # (DPO has no ratio)
        fresh, size = [i for i, stale in enumerate(batch.stale) if not stale], args.micro_batch_size
        # As many forwards on every rank (stand-ins where a rank has fewer rows): under FSDP each
        # forward gathers weights with the other ranks.
        for k in range(micro_batch_count(len(fresh), size)):
            rows = fresh[k * size:(k + 1) * size]
            ids, attn, _, start = pack([batch.prompts[i] for i in rows] or [[0]],
                                       [batch.tokens[i] for i in rows] or [[0]], args.device)
            routing = moe_routing(run, replay_experts(run, batch, rows, ids.shape[1] - start)
                                  if rows else None)
            with autocast(run):
                hidden = run.policy(ids, attn, return_hidden=True, routing=routing)
                logp = token_logprobs(run.policy, ids, attn, start=start, hidden=hidden,
                                      temperature=args.temperature).float().cpu()  # (b, C)
            for j, i in enumerate(rows):
                old[i] = logp[j, :len(batch.tokens[i])].tolist()
    return replace(batch, old_logprobs=old)


# ---- 5: the updates -----------------------------------------------------------------------------

def update(run, batch):
    """Step 5: --mini-batches optimizer updates, each on the next 1/mu of this rank's samples
    (or DPO pairs). -> (named sums, named maxima) over the updates"""
    args, mu = run.args, run.args.mini_batches
    units = preference_pairs(run, batch) if args.algo == "dpo" else list(range(len(batch.tokens)))
    # The prompts' ids over all ranks, for the per-prompt aggregation: this rank's come after the
    # groups of the ranks before it.
    first_group = sum(gather(batch.num_groups, run.world)[:run.rank]) \
        if args.loss_agg == "group-token-mean" else None
    # Mini-batch m is the m-th mu-th of all ranks' units in rank order, as in one process (each
    # rank splitting its own units would group other samples whenever ranks keep unequal numbers).
    counts = gather(len(units), run.world)
    offset, total = sum(counts[:run.rank]), sum(counts)
    sums, maxima = {}, {}
    for m in range(mu):  # mu parts whose sizes differ by one at most
        part = units[max(0, m * total // mu - offset):max(0, (m + 1) * total // mu - offset)]
        step_sums, step_maxima = dpo_update(run, batch, part) if args.algo == "dpo" \
            else policy_gradient_update(run, batch, part, first_group)
        sums, maxima = add(sums, step_sums), top(maxima, step_maxima)
    return sums, maxima


def policy_gradient_update(run, batch, rows, first_group=None):
    """One update on the mini-batch `rows`: the token counts of the whole mini-batch, over all
    ranks, are every micro-batch's divisors, so the update is exactly one device's (change 3).
    first_group: this rank's first prompt id over all ranks (only the per-prompt mean needs it)."""
    micro = policy_micro_batches(run, batch, rows, first_group or 0)
    divisors = losses.micro_batch_divisors(
        [mb["mask"] for mb in micro],
        [mb["group_ids"] for mb in micro] if first_group is not None else None,
        max_tokens=run.args.max_new_tokens, distributed=run.world > 1)
    if int(divisors[0]["num_tokens"]) == 0:  # no loss token on any rank: nothing to learn
        return {"empty_updates": 1}, {}
    micro = [{**mb, "divisors": d} for mb, d in zip(micro, divisors)]
    return optimizer_update(run, micro, policy_gradient_loss)


def policy_micro_batches(run, batch, rows, first_group):
    """The mini-batch `rows` of `batch` as tensors, micro-batch by micro-batch."""
    size, device = run.args.micro_batch_size, run.args.device
    group = [first_group + g for g in batch.group_index()]  # prompt ids over all ranks
    out, count = [], micro_batch_count(len(rows), size)
    for k in range(count):
        part = rows[k * size:(k + 1) * size]
        # A rank with fewer micro-batches than another runs zero-weight stand-ins.
        rollouts, part = (batch, part) if part else (STAND_IN, [0])
        ids, attn, mask, start = pack([rollouts.prompts[i] for i in part],
                                      [rollouts.tokens[i] for i in part], device)
        # change 4, overlong filtering: truncated completions carry no loss
        keep = [rollouts is not STAND_IN and not (run.args.overlong_filter and rollouts.truncated[i])
                for i in part]
        old = [rollouts.old_logprobs[i] for i in part]
        out.append({
            "ids": ids, "attn": attn, "start": start,
            "mask": mask * torch.tensor(keep, device=device)[:, None],                       # (b, C)
            "advantages": torch.tensor([rollouts.advantages[i] for i in part], device=device),  # (b,)
            "old": pad_rows([o or [] for o in old], mask.shape[1], device),                  # (b, C)
            "has_old": torch.tensor([o is not None for o in old], device=device),             # (b,)
            "sampler": pad_rows([rollouts.sampler_logprobs[i] for i in part], mask.shape[1], device),
            "fresh": torch.tensor([not rollouts.stale[i] for i in part], device=device),      # (b,)
            "group_ids": torch.tensor([group[i] if rollouts is batch else 0 for i in part],
                                      device=device),                                        # (b,)
            "replay": replay_experts(run, rollouts, part, mask.shape[1]),  # (b, P+C, L, k)
            # the router loss: a mean over the micro-batches of every rank (stand-ins: none)
            "aux_weight": 0.0 if rollouts is STAND_IN else 1.0 / (count * run.world)})
    return out


def replay_experts(run, rollouts, rows, completion_width):
    """--routing-replay: the sampler's experts laid out as pack() lays out the tokens,
    (b, P+C, L, k), -1 (route freely) on padding and on tokens the sampler never fed; else None."""
    if not run.args.routing_replay or rollouts.routing is None:  # (stand-ins have none)
        return None
    cfg = run.policy.config
    prompts, tokens = [rollouts.prompts[i] for i in rows], [rollouts.tokens[i] for i in rows]
    P = max(len(p) for p in prompts)
    replay = torch.full((len(rows), P + completion_width, cfg.num_layers, cfg.experts_per_token),
                        -1, dtype=torch.long)  # (b, P+C, L, k)
    for j, (i, p, t) in enumerate(zip(rows, prompts, tokens)):
        replay[j, P - len(p):P + len(t)] = rollouts.routing[i].long()  # prompt left-padded
    return replay.to(run.args.device)


def moe_routing(run, replay=None):
    """What the update's forward records (the router logits, for the load-balancing loss) and
    replays (the sampler's experts), on an MoE policy; None on a dense one."""
    return Routing(replay) if run.policy.config.num_experts else None


def policy_gradient_loss(run, mb):
    """The objective of eq. 10 on one micro-batch (changes 1 and 3), with the optional entropy
    bonus, KL / GKL term and TIS weights. -> (loss, named sums for the log, named maxima)"""
    args, mask, divisors = run.args, mb["mask"], mb["divisors"]
    routing = moe_routing(run, mb["replay"])
    hidden = run.model(mb["ids"], mb["attn"], return_hidden=True, routing=routing)  # (b, P+C, H)
    logp, entropy = token_logprobs(run.policy, mb["ids"], mb["attn"], start=mb["start"],
                                   temperature=args.temperature, with_entropy=True,
                                   entropy_grad=args.entropy_coef > 0, hidden=hidden)  # (b, C)
    old = torch.where(mb["has_old"][:, None], mb["old"], logp.detach())  # (b, C) pi_old
    weights = losses.tis_weights(old, mb["sampler"], args.tis_cap) if args.tis_cap else None
    loss, stats = losses.policy_loss(logp, old, mb["advantages"], mask, eps_low=args.eps_low,
                                     eps_high=args.eps_high, clip_c=args.clip_c, agg=args.loss_agg,
                                     token_weights=weights, **divisors)
    if args.entropy_coef:
        loss = loss - args.entropy_coef * losses.aggregate(entropy, mask, args.loss_agg, **divisors)
    tokens = float(stats["tokens"])
    sums = {name: float(stats[name]) * tokens for name in
            ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean")}
    fresh = (mask != 0) & mb["fresh"][:, None]  # (b, C) the sampler's own tokens, this policy's
    sums.update(loss_tokens=tokens, entropy=float((entropy.detach() * (mask != 0)).sum()),
                mismatch=float(((old - mb["sampler"]).abs() * fresh).sum()),
                mismatch_tokens=float(fresh.sum()))
    if weights is not None:
        sums["tis_weight"] = float((weights * (mask != 0)).sum())
    if routing is not None:  # Switch Transformer's load-balancing loss, always logged
        cfg = run.policy.config
        aux = load_balancing_loss(routing, cfg.num_experts, cfg.experts_per_token, mb["attn"])
        if args.router_aux_coef:
            loss = loss + args.router_aux_coef * mb["aux_weight"] * aux
        sums.update(router_aux_loss=float(aux) * (mb["aux_weight"] > 0),
                    router_aux_batches=float(mb["aux_weight"] > 0))
    if args.kl != "none":
        kl_loss, per_token = kl_term(run, mb, hidden, logp)
        loss = loss + args.kl_coef * kl_loss
        sums["kl"] = float((per_token.detach() * (mask != 0)).sum())
    return loss, sums, {"ratio_max": float(stats["ratio_max"])}


def kl_term(run, mb, hidden, logp, positions=64):
    """k1/k2/k3 (Schulman) of the sampled tokens, or GKL (Cui et al. 2025) over the vocabulary,
    aggregated like the policy loss. -> (loss, per-token term (b, C))

    hidden (b, P+C, H): the policy body's output, already computed for the log-probs. GKL needs
    whole logit rows of both policies; they are made `positions` at a time and made again in
    backward (checkpoint), so no (b, C, V) tensor or its gradient is ever held.
    """
    args, mask, start = run.args, mb["mask"], mb["start"]
    ids, attn, C = mb["ids"], mb["attn"], mb["mask"].shape[1]
    if args.kl == "gkl":
        with torch.no_grad():
            ref_hidden = reference_forward(run, lambda m: m(ids, attn, return_hidden=True))
            ref_hidden = ref_hidden[:, start - 1:start - 1 + C]  # (b, C, H)
            ref_weight = reference_forward(run, lambda m: m.output.weight)  # (V, H)
        hidden = hidden[:, start - 1:start - 1 + C]  # (b, C, H): position t predicts token t
        settings = dict(alpha=args.gkl_alpha, beta=args.gkl_beta, gamma=args.gkl_gamma,
                        temperature=args.gkl_temperature,
                        weight_temperature=args.gkl_weight_temperature)
        per_token = torch.cat([
            checkpoint(gkl_of_hidden, hidden[:, s:s + positions], ref_hidden[:, s:s + positions],
                       run.policy.output.weight, ref_weight, settings,
                       run.policy.config.final_softcap, use_reentrant=False)
            for s in range(0, C, positions)], dim=1)  # (b, C)
    else:
        with torch.no_grad():
            ref_logp = reference_forward(run, lambda m: token_logprobs(
                m, ids, attn, start=start, temperature=args.temperature))  # (b, C)
        per_token = losses.kl_estimate(logp, ref_logp, args.kl)  # (b, C)
    return losses.aggregate(per_token, mask, args.loss_agg, **mb["divisors"]), per_token


def gkl_of_hidden(hidden, ref_hidden, weight, ref_weight, settings, softcap=None):
    """GKL term per position from the two bodies' outputs: (b, c, H) -> (b, c). softcap: the
    family's final-logit cap (Gemma 2), cap * tanh(z / cap)."""
    logits, ref_logits = F.linear(hidden, weight), F.linear(ref_hidden, ref_weight)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
        ref_logits = softcap * torch.tanh(ref_logits / softcap)
    return losses.gkl_per_token(logits, ref_logits, **settings)[0]


def preference_pairs(run, batch):
    """(chosen, rejected, (start, end) of each) from correct-vs-wrong completions of a prompt;
    Step-DPO keeps the loss on the first line where the two part ways."""
    if run.args.dpo_pairs == "step":
        pairs = dapo.step_dpo_pairs(batch.tokens, batch.rewards, batch.group_sizes, run.step_separators)
        return [(p["chosen"], p["rejected"], (p["prefix_len"], p["chosen_end"]),
                 (p["prefix_len"], p["rejected_end"])) for p in pairs]
    return [(c, r, (0, len(batch.tokens[c])), (0, len(batch.tokens[r])))
            for c, r in dapo.dpo_pairs(batch.rewards, batch.group_sizes)]


def dpo_update(run, batch, pairs):
    """One DPO update (Rafailov et al. 2023) on these pairs, divided by the pairs of all ranks."""
    size = max(1, run.args.micro_batch_size // 2)
    num_pairs = all_reduce(torch.tensor(float(len(pairs))))
    if float(num_pairs) == 0:
        return {"empty_updates": 1}, {}
    micro = []
    for k in range(micro_batch_count(len(pairs), size)):
        part = pairs[k * size:(k + 1) * size]
        rows = [(i, span) for c, r, span_c, span_r in part for i, span in ((c, span_c), (r, span_r))]
        ids, attn, mask, start = pack([batch.prompts[i] for i, _ in rows] or [[0]],
                                      [batch.tokens[i] for i, _ in rows] or [[0]], run.args.device)
        span_mask = torch.zeros_like(mask)
        for j, (_, (begin, end)) in enumerate(rows):
            span_mask[j, begin:end] = 1
        micro.append({"ids": ids, "attn": attn, "start": start, "mask": mask * span_mask,
                      "pairs": len(part), "num_pairs": num_pairs})
    return optimizer_update(run, micro, dpo_loss)


def dpo_loss(run, mb):
    ids, attn, start, mask = mb["ids"], mb["attn"], mb["start"], mb["mask"]
    temperature = run.args.temperature
    seq_logp = (token_logprobs(run.model, ids, attn, start=start, temperature=temperature)
                * mask).sum(-1)  # (2b,) chosen, rejected, chosen, ...
    names = ("chosen_reward", "rejected_reward", "reward_margin", "accuracy")
    if not mb["pairs"]:  # a stand-in: same names, no weight (every rank logs the same names)
        return seq_logp.sum() * 0, {f"dpo_{n}": 0.0 for n in names} | {"pairs": 0, "pair_tokens": 0}, {}
    with torch.no_grad():
        ref = (reference_forward(run, lambda m: token_logprobs(
            m, ids, attn, start=start, temperature=temperature)) * mask).sum(-1)  # (2b,)
    loss, stats = losses.dpo_loss(seq_logp[0::2], seq_logp[1::2], ref[0::2], ref[1::2],
                                  run.args.dpo_beta, num_pairs=mb["num_pairs"])
    return loss, ({f"dpo_{n}": float(stats[n]) * mb["pairs"] for n in names}
                  | {"pairs": mb["pairs"], "pair_tokens": float(attn.sum())}), {}  # prompts + replies


def optimizer_update(run, micro, loss_of):
    """Backward on every micro-batch (DDP all-reduces on the last, FSDP reduce-scatters on
    each), clip, step. A non-finite loss
    or gradient on any rank leaves weights and optimizer state as they were, and is counted."""
    run.optimizer.zero_grad(set_to_none=True)
    sums, maxima, total = {}, {}, torch.zeros((), dtype=torch.float64)
    for k, mb in enumerate(micro):
        last = k == len(micro) - 1
        no_sync = run.model.no_sync() if not last and run.model is not run.policy else contextlib.nullcontext()
        with no_sync, autocast(run):
            loss, mb_sums, mb_maxima = loss_of(run, mb)
            # DDP and FSDP average gradients over ranks; the divisors are already global, so
            # scale back up to make that average a sum (the update then equals one device's).
            (loss * run.world).backward()
        total += float(loss.detach())
        sums, maxima = add(sums, mb_sums), top(maxima, mb_maxima)
    grad_norm = sharding.full(torch.nn.utils.clip_grad_norm_(run.policy.parameters(), run.args.grad_clip))
    finite = math.isfinite(float(all_reduce(total))) and math.isfinite(float(grad_norm))
    if finite:
        run.optimizer.step()
    else:
        run.optimizer.zero_grad(set_to_none=True)
    sums.update(updates=1, skipped_updates=int(not finite),
                grad_norm=float(grad_norm) if finite else 0.0)
    return sums, maxima


def micro_batch_count(items, size):
    """Micro-batches of `size` items on the rank that has the most: DDP all-reduces once per
    backward, so every rank runs that many (the short ones add zero-weight stand-ins)."""
    count = torch.tensor(math.ceil(items / size))
    return max(1, int(all_reduce(count, dist.ReduceOp.MAX)))


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


def pad_rows(rows, width, device):
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width])
    return out.to(device)


# ---- 6: metrics ---------------------------------------------------------------------------------

REWARD_TERMS = ("correct", "format", "format_ok", "integer", "xml_count", "overlong", "ppl",
                "efficiency")  # rewards.math_reward's components, and the efficiency bonus


def update_means(args):
    """The policy-gradient metrics logged as means per loss token."""
    return ["clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean",
            "entropy"] + ["kl"] * (args.kl != "none") + ["tis_weight"] * bool(args.tis_cap)


def step_metrics(run, progress, sampled, kept, surplus, asked, update_sums, update_maxima, seconds):
    """Step 6: the step's metrics as named sums (and maxima) over all ranks. -> the log row"""
    args = run.args
    done = Rollouts.concat(sampled) if sampled else STAND_IN.select([])
    lengths = [len(t) for t in done.tokens]  # (N,) per turn
    firsts = done.episode_starts()           # an episode's outcome, once
    # Turns followed by another turn of their episode: what they wrote is carried as memory.
    memories = [lengths[i] for i, turn in enumerate(done.turn or []) if i + 1 < len(lengths)
                and done.turn[i + 1] > 0]
    sums = {"samples": len(firsts), "correct": sum(done.correct[i] for i in firsts),
            "reward": sum(done.rewards[i] for i in firsts), "length": sum(lengths),
            "turns": len(lengths), "memory_tokens": sum(memories), "memories": len(memories),
            "truncated": sum(done.truncated), "ranks": 1, "adversarial_prompts": asked,
            "groups_sampled": sum(b.num_groups for b in sampled), "groups_kept": kept.num_groups,
            "groups_missing": args.prompts_per_step // run.world - kept.num_groups,
            "groups_carried": surplus.num_groups if surplus else 0,
            "update_tokens": sum(len(p) + len(t) for p, t in zip(kept.prompts, kept.tokens)),
            **{f"reward_{name}": sum(done.reward_parts[i].get(name, 0.0) for i in firsts)
               for name in REWARD_TERMS}, **update_sums}
    # The largest context of a turn, prompt and completion: what a turn's budget must hold.
    context = max((len(p) + len(t) for p, t in zip(done.prompts, done.tokens)), default=0)
    total = reduce_metrics(sums, {"rounds": len(sampled), "context_max": context, **update_maxima})
    ranks, n, turns = total["ranks"], max(1.0, total["samples"]), max(1.0, total["turns"])
    updates = total.get("updates", 0.0) / ranks
    applied = updates - total.get("skipped_updates", 0.0) / ranks
    tokens = total.get("loss_tokens", 0.0)  # policy-gradient loss tokens (none under DPO)
    row = {"step": progress.step + 1, "updates": progress.updates + int(applied),
           "lr": run.optimizer.param_groups[0]["lr"], "level": getattr(run.source, "level", None),
           "reward": total["reward"] / n, "accuracy": total["correct"] / n,
           **{f"reward_{name}": total[f"reward_{name}"] / n for name in REWARD_TERMS},
           "response_length": total["length"] / turns, "truncated": total["truncated"] / turns,
           "turns_per_episode": total["turns"] / n,
           "memory_length": total["memory_tokens"] / max(1.0, total["memories"]),
           "context_max": int(total["context_max"]),
           **{name: int(total[name]) for name in ("groups_sampled", "groups_kept", "groups_missing",
                                                   "groups_carried", "adversarial_prompts")},
           "groups_kept_per_rank": gather(kept.num_groups, run.world), "rounds": int(total["rounds"]),
           # None when no update had a policy-gradient loss token (DPO, or every group dropped)
           **{name: total.get(name, 0.0) / tokens if tokens else None for name in update_means(args)},
           "ratio_max": total.get("ratio_max"),
           "peak_memory_mib": total["peak_memory_mib"],  # the largest over ranks
           "sampler_trainer_mismatch": total.get("mismatch", 0.0) / max(1.0, total.get("mismatch_tokens", 0.0)),
           "grad_norm": total.get("grad_norm", 0.0) / max(1.0, applied * ranks),
           "skipped_updates": int(updates - applied), "empty_updates": int(total.get("empty_updates", 0) / ranks),
           "skipped_updates_total": progress.skipped_updates + int(updates - applied)}
    if "router_aux_batches" in total:  # an MoE policy
        row["router_aux_loss"] = total["router_aux_loss"] / max(1.0, total["router_aux_batches"])
    if args.algo == "dpo":
        row.update(pairs=int(total.get("pairs", 0)), **{name: total[name] / max(1.0, total["pairs"])
                                                       for name in total if name.startswith("dpo_")})
    for stage in ("rollout", "scoring", "update", "refresh"):
        row[f"seconds_{stage}"] = seconds[stage]
    row["tokens_per_second_rollout"] = total["length"] / ranks / max(seconds["rollout"], 1e-9)
    # DPO reads its pairs only, not every kept sample, and scores no old log-probs.
    trained = total.get("pair_tokens", 0.0) if args.algo == "dpo" else total["update_tokens"]
    row["tokens_per_second_update"] = trained / ranks / max(seconds["update"], 1e-9)
    # Scoring (step 4) is a pass of its own only with several updates per step.
    row["tokens_per_second_scoring"] = (total["update_tokens"] / ranks / max(seconds["scoring"], 1e-9)
                                        if args.mini_batches > 1 and args.algo != "dpo" else None)
    return row


def peak_memory_mib(args):
    """This step's peak of allocated GPU memory, or on the CPU the process's peak resident set
    so far (the system keeps no per-step peak there), in MiB."""
    if args.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def sample_lines(run, batch, step):
    """A few of the step's completions with their rewards and advantages, for samples.jsonl:
    what the model actually says as it learns. (When every group was dropped, the first round's,
    whose advantages are all 0.)"""
    starts = batch.group_starts()
    lines = []
    for i in range(min(run.args.log_samples, len(batch.tokens))):
        group = max(g for g, start in enumerate(starts) if start <= i)
        lines.append({"step": step, "turn": batch.turn[i] if batch.turn else 0,
                      "prompt": batch.records[group]["prompt"],
                      "answer": batch.records[group]["answer"],
                      "completion": run.tokenizer.decode(batch.tokens[i], skip_special_tokens=True),
                      "reward": batch.rewards[i],
                      "advantage": batch.advantages[i] if batch.advantages else 0.0,
                      "truncated": batch.truncated[i], **batch.reward_parts[i]})
    return lines


def shared_prompt_accuracy(run, progress, sampled):
    """Every rank's prompt accuracies of this step folded into one running table, the same on
    every rank (the adaptive budget reads it; prompts move between ranks each epoch)."""
    seen = []
    for batch in sampled:
        firsts = set(batch.episode_starts())
        for record, start, size in zip(batch.records, batch.group_starts(), batch.group_sizes):
            outcomes = [batch.correct[i] for i in range(start, start + size) if i in firsts]
            seen.append((record["id"], sum(outcomes) / len(outcomes)))
    table = dict(progress.prompt_accuracy)
    for rank_seen in gather(seen, run.world):
        for prompt_id, accuracy in rank_seen:
            dapo.update_accuracy(table, prompt_id, accuracy)
    return table


# ---- the loop -----------------------------------------------------------------------------------

def main(argv=None):
    args, explicit = config.parse_config(argv)
    if args.plot:
        return runs.plot(args.plot)
    if args.bench and "steps" not in explicit:
        args.steps = 3
    run = setup(args)
    progress = load_checkpoint(run) if args.resume else Progress()
    rank0, writes = run.rank == 0, run.rank == 0 and not args.bench
    if writes:
        open_run_directory(run, progress)
        print(describe(run), flush=True)
        if run.heldout and progress.step == 0:
            evaluate_and_log(run, progress)
    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=progress.step, disable=not writes, desc="train", unit="step",
               dynamic_ncols=True)
    limit = args.time_limit * 60 or math.inf  # seconds of training; 0: none
    last_save, over_time = time.monotonic(), progress.train_seconds > limit  # (a resumed run)
    while progress.step < args.steps and not over_time:
        progress, row, examples = train_step(run, progress)
        # Every rank must stop at the same step (or the others hang in the next collective), and
        # their clocks differ (rank 0 alone evaluates): the decisions are maxed over ranks.
        flags = reduce_metrics({}, {
            "over_time": float(progress.train_seconds > limit),
            "save_due": float(time.monotonic() - last_save > args.checkpoint_minutes * 60 or bool(
                args.checkpoint_every and progress.step % args.checkpoint_every == 0))})
        over_time = flags["over_time"] > 0
        if args.bench:
            print(f"step {progress.step}: rollout {row['seconds_rollout']:.1f} s, scoring "
                  f"{row['seconds_scoring']:.1f} s, update {row['seconds_update']:.1f} s, sampler "
                  f"refresh {row['seconds_refresh']:.2f} s", flush=True)
            continue
        if rank0:
            runs.append_line(os.path.join(args.out, "metrics.jsonl"), row)
            for line in examples:
                runs.append_line(os.path.join(args.out, "samples.jsonl"), line)
            bar.update(1)
            bar.set_postfix_str(f"acc {row['accuracy']:.2f} kept {row['groups_kept']}/"
                                f"{row['groups_sampled']} len {row['response_length']:.0f} | "
                                f"{progress.train_seconds / 60:.1f}" + (f"/{args.time_limit:g}"
                                                                         * bool(args.time_limit)) + " min")
            if run.heldout and args.eval_every and progress.step % args.eval_every == 0:
                evaluate_and_log(run, progress)
        if flags["save_due"] or over_time or progress.step == args.steps:
            save_checkpoint(run, progress)
            last_save = time.monotonic()
    bar.close()
    if over_time and rank0:
        print(f"time limit of {args.time_limit:g} minutes reached after {progress.step} steps", flush=True)
    if not args.bench:  # under FSDP every rank takes part in gathering the weights
        final = sharding.gathered_model(run.policy, run.sampler) if args.fsdp else run.policy
        if writes:
            finish(run, progress, final)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        # The DDP wrapper still holds the backend; freed during the interpreter's shutdown, its
        # worker threads sometimes abort the process ("terminate called without an active
        # exception", seen here about once in 40 gloo runs). Everything is written: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def finish(run, progress, final):
    """The held-out accuracy at the end (unless just measured), final/ (the `final` model's
    weights), and a summary line."""
    args, evals = run.args, []
    if run.heldout:
        evals = runs.read_lines(os.path.join(args.out, "eval.jsonl"))
        if not evals or evals[-1]["step"] != progress.step:
            evals.append({"step": progress.step, **evaluate_and_log(run, progress)})
    save_model(final, run.tokenizer, os.path.join(args.out, "final"))
    summary = {"out": args.out, "steps": progress.step, "updates": progress.updates,
               "train_minutes": round(progress.train_seconds / 60, 2),
               "skipped_updates": progress.skipped_updates}
    if evals:
        summary.update(heldout_before=evals[0]["pass@1"], heldout_after=evals[-1]["pass@1"])
    print(json.dumps(summary), flush=True)


# ---- setup, evaluation, checkpoints -------------------------------------------------------------

def setup(args):
    """The model, its copies, the optimizer and the data of a run -> Run."""
    rank, world, device = setup_distributed()
    args.device = device
    args.out = args.resume or args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    writes = rank == 0 and not args.bench
    if writes and not args.resume:  # a bad --out fails now, not after loading (checked again later)
        try:
            runs.check_new(args.out)
        except runs.RunError as error:
            sys.exit(f"train.py: {error}")
    run_lock = claim_run_directory(args) if writes and args.resume else None  # before any work
    if args.prompts_per_step % world:
        sys.exit(f"train.py: --prompts-per-step {args.prompts_per_step} must be a multiple of the "
                 f"{world} ranks")
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    try:
        policy, tokenizer = load_model(args.model, dtype=torch.float32, device=device)
    except (OSError, ValueError) as e:
        sys.exit(f"train.py: --model: {e}")
    refuse_mismatches(args, policy)
    policy.train()
    policy.gradient_checkpointing = args.activation_checkpointing
    if args.lora_rank:
        add_lora(policy, rank=args.lora_rank, alpha=args.lora_alpha)
    if args.quantize == "nf4":
        try:
            quantize.quantize_lora_bases(policy)
        except ValueError as e:
            sys.exit(f"train.py: {e}")
    if args.template is None:
        args.template = "none" if str(args.data).startswith(("arithmetic", "memory")) else "dapo"
    try:  # every row is checked before any training
        source, heldout = load_data(args, tokenizer, policy.config.max_seq_len)
    except data.DataError as e:
        sys.exit(f"train.py: --data: {e}")
    if writes and not args.resume:  # a new run: once its model and data passed their checks
        run_lock = claim_run_directory(args)
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and (device.type == "cuda" or cpu_has_bf16()))
    model, sampler, reference = policy_copies(args, policy, bf16)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    return Run(
        args=args, rank=rank, world=world, policy=policy, tokenizer=tokenizer, model=model,
        sampler=sampler, reference=reference,
        # Every reply of the memory task is one line (episodes.py): its sampler stops at a break.
        stop_ids=stop_token_ids(tokenizer) + (line_break_ids(tokenizer)
                                              if isinstance(source, episodes.MemoryTask) else []),
        step_separators=line_break_ids(tokenizer)
        if args.algo == "dpo" and args.dpo_pairs == "step" else [],
        optimizer=torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay,
                                    betas=(0.9, 0.999), fused=True),  # one kernel for all tensors
        source=source, heldout=heldout, bf16=bf16, run_lock=run_lock,
        stream=data.PromptStream(source, args.prompts_per_step, seed=args.seed, rank=rank, world_size=world),
        variant_rng=random.Random(f"{args.seed}:adversarial:{rank}"))


def refuse_mismatches(args, policy):
    """Flags that cannot act on this model or launch, refused by name before any work."""
    if (args.routing_replay or args.router_aux_coef) and not policy.config.num_experts:
        sys.exit(f"train.py: --routing-replay and --router-aux-coef act on a Mixture-of-Experts "
                 f"model; {args.model or 'the bundled model'} ({policy.config.model_type}) "
                 "has no experts")
    if (args.routing_replay or args.router_aux_coef) and args.algo == "dpo":
        sys.exit("train.py: --routing-replay and --router-aux-coef act on the policy-gradient "
                 "update (--algo pg), not on DPO")
    if args.fsdp and not dist.is_initialized():
        sys.exit("train.py: --fsdp shards the model over torchrun's ranks: launch with torchrun "
                 "(`torchrun --nproc_per_node N train.py --fsdp ...`, N = 1 works too)")


def policy_copies(args, policy, bf16):
    """What trains and samples beside the policy -> (the module the update runs through: the
    DDP wrapper or, under --fsdp, the sharded policy itself; the sampler; the reference or None).
    Rollouts run on a bf16 copy where bf16 is fast (and on a whole copy under FSDP), refreshed
    after every step."""
    device = args.device
    sampler = copy.deepcopy(policy).to(torch.bfloat16 if bf16 else torch.float32).eval() \
        if (bf16 and not args.lora_rank) or args.fsdp else policy
    needs_reference = (args.kl != "none" or args.algo == "dpo") and args.ref == "frozen"
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if needs_reference else None
    if args.fsdp:
        sharding.shard(policy, bf16_on_cuda=bf16 and device.type == "cuda")
        if reference is not None:
            sharding.shard(reference, bf16_on_cuda=bf16 and device.type == "cuda")
        sharding.copy_trainable(sampler, policy)  # rank 0's weights (shard broadcast them)
        return policy, sampler, reference
    model = torch.nn.parallel.DistributedDataParallel(
        policy, device_ids=[device.index] if device.type == "cuda" else None) \
        if dist.is_initialized() else policy
    return model, sampler, reference


def claim_run_directory(args):
    """Rank 0's hold on the run directory (runs.lock), so that no second process writes it; a new
    run's directory is created in the same step as the check that it is new. -> the lock"""
    try:
        if not args.resume:
            runs.create(args.out)
        return runs.lock(args.out)
    except runs.RunError as error:
        sys.exit(f"train.py: {error}")


def load_data(args, tokenizer, context):
    """-> (training source: ArithmeticTask or records, held-out records or None), all checked."""
    max_prompt = context - args.max_new_tokens
    if max_prompt < 1:
        raise data.DataError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt "
                             f"in the model's context of {context}")
    heldout = None
    if str(args.data).startswith(("arithmetic", "memory")):
        task = episodes.MemoryTask if str(args.data).startswith("memory") else data.ArithmeticTask
        source = task.from_spec(args.data)
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


def describe(run):
    """What this run is, in a few lines (every flag is in config.json)."""
    args = run.args
    params = sum(p.numel() for p in run.policy.parameters()) / 1e6
    precision = "bf16 rollouts and autocast updates, fp32 weights" if run.bf16 else "float32"
    cpu = " with the CPU defaults" if args.model is None and args.preset in ("dapo", "dapo-memory") else ""
    method = f"{args.algo} {args.adv_estimator}, {args.loss_agg}, clip {args.eps_low}/{args.eps_high}" \
        if args.algo == "pg" else f"DPO ({args.dpo_pairs} pairs), beta {args.dpo_beta}"
    return "\n".join([
        f"model     {args.model or 'bundled SmolLM2-135M-Instruct'}: {params:.0f}M parameters, "
        f"{precision}" + (f", LoRA rank {args.lora_rank}" if args.lora_rank else "")
        + (f", base in {args.quantize.upper()}" if args.quantize != "none" else ""),
        f"data      {args.data} (template {args.template}), held-out: "
        f"{len(run.heldout) if run.heldout else 'none'}",
        f"method    preset {args.preset}{cpu}: {method}, dynamic sampling "
        f"{'on' if args.dynamic_sampling else 'off'}",
        f"each step {args.prompts_per_step} prompts x {args.samples} samples of <= "
        f"{args.max_new_tokens} tokens, {args.mini_batches} update(s), lr {args.lr:g} ({args.lr_schedule})",
        f"length    {args.steps} steps" + (f" or {args.time_limit:g} training minutes" if args.time_limit else ""),
        f"run       {args.out} (every flag: config.json)"])


def lr_at(step, args):
    """Learning rate of training step `step` (0-based), shared by its mu updates: linear warm-up
    over --warmup-steps, then constant (DAPO) or a cosine decay that would reach 10% at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def autocast(run):
    return torch.autocast(run.args.device.type, dtype=torch.bfloat16) if run.bf16 \
        else contextlib.nullcontext()


def reference_forward(run, fn):
    """fn(model) under the reference policy: the frozen copy, or the policy with LoRA off."""
    if run.reference is not None:
        return fn(run.reference)
    with lora_disabled(run.policy):
        return fn(run.policy)


def refresh_sampler(run):
    if run.sampler is not run.policy:
        sharding.copy_trainable(run.sampler, run.policy)


@torch.no_grad()
def heldout_accuracy(run, samples=1, temperature=0.0, top_p=1.0, rows_per_call=64):
    """Mean accuracy of `samples` episodes of each held-out problem: greedy pass@1, or avg@k at
    a temperature as DAPO reports (eval.py also reports pass@k and maj@k). -> (accuracy, mean
    length of a turn, truncated fraction of turns)"""
    args, tokenizer = run.args, run.tokenizer
    first_prompts = [data.format_prompt(episodes.next_turn(r, 0), tokenizer, args.template)
                     for r in run.heldout]
    order = sorted(range(len(run.heldout)), key=lambda i: len(first_prompts[i]))  # less padding
    right, length, truncated, turns = 0, 0, 0, 0
    per_call = max(1, rows_per_call // samples)
    for at in range(0, len(order), per_call):
        rows = order[at:at + per_call]
        played = episodes.play(run.sampler.eval(), tokenizer, [run.heldout[i] for i in rows],
                               samples, at, template=args.template, max_new_tokens=args.max_new_tokens,
                               temperature=temperature, top_p=top_p, stop_token_ids=run.stop_ids,
                               compile=config.compile_choice(args))
        for j, episode in enumerate(played):  # prompt-major: problem rows[j // samples]
            right += verify.is_correct(episode[-1].text, run.heldout[rows[j // samples]]["answer"])
            length += sum(len(t.completion.tokens) for t in episode)
            truncated += sum(t.completion.finish_reason == "length" for t in episode)
            turns += len(episode)
    n = len(run.heldout) * samples
    return right / n, length / max(1, turns), truncated / max(1, turns)


def evaluate_and_log(run, progress):
    """Held-out accuracy, greedy (and avg@k with --eval-samples), into eval.jsonl."""
    args, started = run.args, time.perf_counter()
    accuracy, length, truncated = heldout_accuracy(run)
    result = {"pass@1": accuracy, "n": len(run.heldout), "mean_length": length, "truncated": truncated}
    if args.eval_samples:
        result["avg@k"], _, _ = heldout_accuracy(run, args.eval_samples, args.eval_temperature,
                                                  args.eval_top_p)
        result["k"] = args.eval_samples
    sampled = f", avg@{args.eval_samples} {result['avg@k']:.3f}" if args.eval_samples else ""
    print(f"step {progress.step}: held-out accuracy {accuracy:.3f}{sampled} on {result['n']} "
          f"problems ({time.perf_counter() - started:.0f} s)", flush=True)
    runs.append_line(os.path.join(run.args.out, "eval.jsonl"),
                     {"step": progress.step, "train_seconds": progress.train_seconds, **result})
    return result


def save_checkpoint(run, progress):
    """checkpoint.pt, written whole before it replaces the last one, which stays as
    checkpoint-previous.pt. Each rank's own state (RNGs, data position, carried groups) is
    gathered; rank 0 writes."""
    per_rank = gather({"rng": runs.rng_state(), "variant_rng": run.variant_rng.getstate(),
                       "data": run.stream.state_dict(),
                       "carry": dataclasses.asdict(progress.carry) if progress.carry else None},
                      run.world)
    weights = {"model": run.policy.state_dict(), "optimizer": run.optimizer.state_dict()} \
        if not run.args.fsdp else {"shards": sharding.save_shards(run.args.out, progress.step,
                                                                  run.policy, run.optimizer)}
    if run.rank == 0:
        runs.save_checkpoint(run.args.out, {
            **weights, "per_rank": per_rank, "progress": {
                f.name: getattr(progress, f.name) for f in dataclasses.fields(progress) if f.name != "carry"}})
        if run.args.fsdp:
            sharding.drop_shards(run.args.out, keep=runs.checkpoint_values(run.args.out, "shards"))


def load_checkpoint(run):
    """The run's state at its last checkpoint -> Progress (a fresh one if there is none yet)."""
    try:
        state = runs.load_checkpoint(run.args.out)
    except runs.RunError as error:
        sys.exit(f"train.py: --resume: {error}")
    if state is None:  # killed before its first checkpoint: start over
        return Progress()
    if "progress" not in state:
        sys.exit(f"train.py: --resume: {run.args.out} was written by an older train.py; start anew")
    if ("shards" in state) != run.args.fsdp:
        sys.exit(f"train.py: --resume: {run.args.out} was written "
                 f"{'with' if 'shards' in state else 'without'} --fsdp; resume it the same way")
    if run.args.fsdp:
        sharding.load_shards(run.args.out, state["shards"], run.policy, run.optimizer)
    else:
        run.policy.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
    # A run resumed on more ranks than it had: new ranks take rank 0's data position and RNGs,
    # no carried groups, and their own fresh variant RNG (on fewer ranks, the missing ranks'
    # carried groups are dropped: they were surplus).
    per_rank = state["per_rank"]
    mine = per_rank[run.rank] if run.rank < len(per_rank) else \
        {**per_rank[0], "carry": None, "variant_rng": None}
    runs.set_rng_state(mine["rng"])
    run.stream.load_state_dict(mine["data"])
    if mine["variant_rng"] is not None:
        run.variant_rng.setstate(runs.as_random_state(mine["variant_rng"]))
    refresh_sampler(run)
    carry = Rollouts(**mine["carry"]) if mine["carry"] else None
    return Progress(**state["progress"], carry=carry)


def open_run_directory(run, progress):
    """config.json (on resume too: the flags given then, e.g. more --steps, hold for the next
    resume); on resume, the log lines written after the checkpoint go (the steps after it run
    again), the step-0 evaluation too if no checkpoint was written yet."""
    args = run.args
    runs.write_config(args.out, {k: v for k, v in vars(args).items()
                                 if k not in ("device", "resume", "bench", "plot")})
    runs.trim_log(os.path.join(args.out, "metrics.jsonl"), progress.step)
    runs.trim_log(os.path.join(args.out, "samples.jsonl"), progress.step)
    runs.trim_log(os.path.join(args.out, "eval.jsonl"), progress.step if progress.step else -1)


# ---- distributed --------------------------------------------------------------------------------

def setup_distributed():
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; plain `python train.py` is one process."""
    if "RANK" not in os.environ:  # not under torchrun
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Under torchrun a process group even for one rank, so that `--nproc_per_node 1` runs the
    # same collectives and DDP wrapper as many ranks (the GPU check relies on it).
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    # Rank 0 alone evaluates and writes checkpoints while the others wait in a collective: allow
    # more than NCCL's default 10 minutes for that.
    timeout = datetime.timedelta(hours=2)
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=timeout)
    return rank, world, torch.device("cpu")


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """`tensor` summed (or `op`) over ranks, in place; a no-op in one process. NCCL reduces CUDA
    tensors only, so a CPU tensor goes through the GPU and back."""
    if not dist.is_initialized():
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_gpu = tensor.to(torch.cuda.current_device())
        dist.all_reduce(on_gpu, op=op)
        return tensor.copy_(on_gpu)
    dist.all_reduce(tensor, op=op)
    return tensor


def add(a, b):
    """Two dicts of named sums added name by name."""
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


def top(a, b):
    """Two dicts of named maxima, maxed name by name."""
    return {k: max(a.get(k, -math.inf), b.get(k, -math.inf)) for k in a.keys() | b.keys()}


def reduce_metrics(sums, maxima):
    """Named sums added over ranks and named maxima maxed over ranks, in one call (every rank
    passes the same names). -> one dict."""
    out = {}
    for values, op in ((sums, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
        names = sorted(values)
        reduced = all_reduce(torch.tensor([float(values[n]) for n in names], dtype=torch.float64), op)
        out.update(zip(names, reduced.tolist()))
    return out


def gather(obj, world):
    """[obj of rank 0, obj of rank 1, ...] on every rank (any picklable object)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    main()
