"""Train a language model with DAPO (or GRPO, Dr. GRPO, RLOO, REINFORCE-baseline, DPO) on math.

    python train.py                       # the offline default: bundled SmolLM2-135M-Instruct,
                                          # synthetic arithmetic, on a laptop CPU
    python train.py --preset dapo --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k --max-new-tokens 1024
    torchrun --nproc_per_node 8 train.py --preset dapo --model Qwen/Qwen2.5-1.5B-Instruct \\
        --data dapo-math-17k --prompts-per-step 512 --samples 16 --max-new-tokens 4096
    python train.py --resume runs/NAME    # continue a run exactly where it stopped
    python train.py --bench               # seconds per step: rollout / scoring / update

DAPO (Yu et al. 2025, arXiv 2503.14476) is GRPO (Shao et al. 2024, arXiv 2402.03300) with a rule
reward (eq. 7), no KL term, and four changes, numbered as in dapo.py: (1) clip-higher (eq. 10;
it acts only with --mini-batches > 1, the paper's 16), (2) dynamic sampling (eq. 11), (3) a
token-level loss (eq. 12), (4) overlong reward shaping (eq. 13).
One training step (`train_step`), numbered as the code below:
  1. Sample G completions of each prompt and reward them (eq. 7 and 13); a task in turns
     (tasks/episodes.py) samples G episodes, rewarded by their outcome, a row per turn.
  2. Filter and refill the groups (eq. 11; the rounds in variants/refills.py).
  3. Old log-probs: the trainer scores the batch before its first update (pi_old of eq. 10).
  4. Advantages within each group (eq. 9), or per token (REINFORCE++, which reads pi_old).
  5. Updates on mini-batches of 1/mu of a full batch, accumulated over micro-batches with the
     token counts of the whole mini-batch over all ranks as divisors (eq. 10 and 12).
  6. Metrics: named sums, reduced over ranks in one call; rank 0 writes them.
--steps counts these training steps; the schedule counts those that made an optimizer step.
Steps 1 and 2 are one call (`collect_rollouts`): the rounds of dynamic sampling run as one queue
(variants/refills.py). What is not DAPO stays beside this file, reached where a flag asks: the
run's setup, checkpoints and logs in run/launch.py, the held-out evaluation in run/evaluation.py,
step 6's metrics in run/metrics.py, tasks in turns in tasks/episodes.py, the objectives since DAPO
in variants/objectives.py and variants/token_choice.py, the reference policy's terms and DPO in
variants/reference.py, routing replay in variants/moe.py.
"""

import dataclasses
import functools
import itertools
import math
import signal
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from tqdm import tqdm

import dapo
import data
import losses
import rewards
import rollout
from model import completion_logprobs, token_logprobs
from run import config, distributed, evaluation, launch, memory_plan, metrics
from run.distributed import add, all_reduce, gather, reduce_metrics, top
from tasks import episodes
from variants import distill, moe, objectives, reference, refills, sft, token_choice
from variants.moe import Routing

# ---- the batch a step carries -------------------------------------------------------------------

@dataclass(frozen=True)
class Rollouts:
    """What a step carries from sampling to the update: G episodes of each of several prompts,
    prompt-major, a row per completion (an episode in turns: a row per turn, consecutive), one
    entry per row in every field but `records` and `group_sizes` (one per group). Steps 3 and
    4 return copies with `old_logprobs` and `advantages`."""
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
    advantages: list = None     # step 4
    old_logprobs: list = None   # step 3; None entries: on-policy (the update's own, detached)
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


class Collected(NamedTuple):
    """Steps 1-2 on this rank."""
    kept: Rollouts     # the groups the update trains on
    sampled: list      # every round's Rollouts as sampled (the metrics read them)
    surplus: Rollouts  # kept groups beyond the batch, carried to the next step, or None
    asked: int         # adversarial variants asked (--adversarial)


class StepResult(NamedTuple):
    """One training step's outcome."""
    progress: object   # launch.Progress after the step
    row: dict          # its line of metrics.jsonl
    samples: list      # a few of its completions, for samples.jsonl


# ---- one training step --------------------------------------------------------------------------

def train_step(run, progress):
    """One training step, numbered as in the module docstring. -> StepResult"""
    args = run.args
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(progress.trained_steps, args)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        collected = collect_rollouts(run, progress)                      # 1-2
    sampled_at = time.perf_counter()
    rollout_peak = launch.peak_memory_mib(args) if args.device.type == "cuda" else None
    batch = with_old_logprobs(run, collected.kept)                       # 3
    batch = with_advantages(run, batch)                                  # 4
    batch = distill.with_teacher(run, batch, scored_logprobs)  # --teacher: its term a token
    scored_at = time.perf_counter()
    run.policy.train()
    update_sums, update_maxima = update(run, batch, progress.step)       # 5
    updated_at = time.perf_counter()
    launch.refresh_sampler(run)  # under FSDP: the weights gathered for the next rollouts
    end = time.perf_counter()
    seconds = {"rollout": sampled_at - start, "scoring": scored_at - sampled_at,
               "update": updated_at - scored_at, "refresh": end - updated_at}
    done = Rollouts.concat(collected.sampled) if collected.sampled else STAND_IN.select([])
    row = metrics.step_metrics(run, progress, collected, done, update_sums,  # 6
                               {**update_maxima, "peak_memory_mib": launch.peak_memory_mib(args)},
                               seconds)

    if rollout_peak is not None:  # this rank's, beside the step's (memory_plan.py's two phases)
        row["peak_memory_mib_rollout"] = rollout_peak
    row.update(distill.logged(run, batch))  # --teacher: log pi_student - log pi_teacher a token
    row["accuracy_ema"] = ema = data.curriculum_step(run.source, progress.accuracy_ema,
                                                     row["accuracy"], args.curriculum)
    progress = replace(progress, step=progress.step + 1, updates=row["updates"],
                       trained_steps=progress.trained_steps + bool(update_sums.get("updates")),
                       train_seconds=progress.train_seconds + end - start, accuracy_ema=ema,
                       skipped_updates=row["skipped_updates_total"], carry=collected.surplus,
                       prompt_accuracy=refills.shared_prompt_accuracy(run, progress, collected.sampled)
                       if args.adaptive_budget else {})
    row["train_seconds"], row["trained_steps"] = progress.train_seconds, progress.trained_steps
    shown = batch if batch.tokens else (collected.sampled or [batch])[0]  # all dropped: round 1's
    return StepResult(progress, row, samples=launch.sample_lines(run, shown, progress.step))


# ---- 1-2: sample, reward, filter ----------------------------------------------------------------

def sample_and_reward(run, records, num_samples, seeds):
    """Step 1: num_samples[i] completions of records[i] from the sampler, each rewarded by its
    answer (eq. 7) and length (change 4's punishment). A task in turns plays whole episodes
    instead, a row per turn (episodes.py)."""
    args, tokenizer, sampler = run.args, run.tokenizer, run.sampler.eval()
    if args.tools or any(episodes.in_turns(record) for record in records):
        return Rollouts(**episodes.play_and_reward(sampler, tokenizer, records, num_samples, seeds,
                                                   args, run.stop_ids, run.reward_function))
    prompts = [data.format_prompt(record, tokenizer, args.template) for record in records]
    done = rollout.generate(sampler, prompts, num_samples=num_samples,
                            **config.sampling_options(args, run.stop_ids, seeds))  # prompt-major
    return rewarded(run, records, num_samples, prompts, done)


def rewarded(run, records, num_samples, prompts, done):
    """The Rollouts of records[i]'s completions (done: prompt-major, prompt_index into records)."""
    args, tokenizer = run.args, run.tokenizer
    records_ = [records[c.prompt_index] for c in done]
    scored = [rewards.task_reward(record.get("reply_prefix", "") + tokenizer.decode(
        c.tokens, skip_special_tokens=True), record, function=run.reward_function,
        **config.reward_options(args, c)) for record, c in zip(records_, done)]
    correct = [parts["accuracy"] > 0 for _, parts in scored]
    bonus = [0.0] * len(done)
    if args.efficiency_weight:  # balanced reasoning: short right answers score a little more
        bonus = dapo.efficiency_bonus(correct, [len(c.tokens) for c in done], num_samples,
                                      args.efficiency_weight).tolist()
    return Rollouts(records=list(records), group_sizes=list(num_samples),
                    prompts=[prompts[c.prompt_index] for c in done], tokens=[c.tokens for c in done],
                    sampler_logprobs=[c.logprobs for c in done],
                    truncated=[c.finish_reason == "length" for c in done],
                    rewards=[r + b for (r, _), b in zip(scored, bonus)], correct=correct,
                    reward_parts=[{**p, "efficiency": b} for (_, p), b in zip(scored, bonus)],
                    stale=[False] * len(done), turn=[0] * len(done),
                    routing=[c.routing for c in done] if args.routing_replay else None)


def collect_rollouts(run, progress):
    """Steps 1-2: sample and reward this rank's prompts; with dynamic sampling (change 2) keep
    the groups with 0 < #correct < G and sample again, up to --max-refills more rounds. Never
    loops forever and never fails on the budget (verl raises): the step trains on what it has.
    -> Collected (kept groups, every round's rollouts, surplus groups to carry, variants asked)
    """
    args = run.args
    want = args.prompts_per_step // run.world
    if not args.dynamic_sampling:
        batch = sample_and_reward(run, *refills.round_prompts(run, progress, 0, [], want))
        return Collected(batch, [batch], surplus=None, asked=0)
    carry = progress.carry
    kept = [carry.select(range(min(want, carry.num_groups)))] if carry else []  # stale: use first
    rounds, have = 1 + args.max_refills, sum(part.num_groups for part in kept)
    if rounds > 1 and not args.adversarial and not refills.takes_turns(run):  # while rows run
        sampled = [Rollouts.concat(groups) for groups in
                   refills.rounds_in_one_queue(run, progress, want, have, rounds, rewarded)]
        asked = 0
    else:
        sampled, asked = refills.rounds_in_turn(run, progress, want, have, rounds, sample_and_reward)
    kept = Rollouts.concat(kept + [batch.select(g for g, signal in enumerate(
        refills.with_signal(batch)) if signal) for batch in sampled])
    surplus = None
    if args.keep_surplus and kept.num_groups > want:  # trained next step, off-policy
        surplus = kept.select(range(want, kept.num_groups))
        surplus = replace(surplus, stale=[True] * len(surplus.stale))
    return Collected(kept.select(range(min(want, kept.num_groups))), sampled, surplus, asked)


# ---- 3-4: old log-probs, advantages -------------------------------------------------------------

def with_advantages(run, batch):
    """Step 4: group-relative advantages (eq. 9, or the --adv-estimator)."""
    if run.args.adv_estimator == "reinforce_pp":  # one per token, the KL to the reference inside
        return replace(batch, advantages=reinforce_pp_advantages(run, batch))
    # One advantage per episode (the group: a prompt's G episodes), given to each of its turns.
    rewards_ = torch.tensor([batch.rewards[i] for i in batch.episode_starts()],
                            dtype=torch.float64)  # (E,)
    tokens = episode_loss_tokens(batch, run.args.overlong_filter) \
        if run.args.adv_estimator in dapo.READ_LENGTHS else None
    # (reinforce_baseline and gpg read the whole batch: their sums are reduced over ranks)
    advantages = dapo.sequence_advantages(run.args.adv_estimator, rewards_,
                                          batch.episodes_per_group(), tokens, all_reduce)
    return replace(batch, advantages=advantages[batch.episode_index()].tolist())  # (N,)


def episode_loss_tokens(batch, overlong_filter):
    """(E,) float64: each episode's loss tokens over its turns (for the estimators that read
    lengths, dapo.READ_LENGTHS)."""
    counted = [len(t) * (not (overlong_filter and cut))
               for t, cut in zip(batch.tokens, batch.truncated)]  # (N,) each row's
    return torch.zeros(len(batch.episode_starts()), dtype=torch.float64).index_add_(
        0, torch.tensor(batch.episode_index(), dtype=torch.long),
        torch.tensor(counted, dtype=torch.float64))  # (E,)


def reinforce_pp_advantages(run, batch):
    """REINFORCE++'s per-token advantages (dapo.reinforce_pp_advantages): the k1 KL of pi_old (step
    3) to the reference at every token, normalised over every token of the batch on all ranks. A
    turn of an episode is a row: its returns hold its own tokens' KL."""
    args, rows = run.args, list(range(len(batch.tokens)))
    kl = [torch.zeros(len(t), dtype=torch.float64) for t in batch.tokens]     # (T_i,) each
    if args.reward_kl_coef > 0:
        reference_logprobs = scored_logprobs(run, batch, rows, under_reference=True)
        kl = [torch.tensor(batch.old_logprobs[i], dtype=torch.float64)
              - torch.tensor(reference_logprobs[i], dtype=torch.float64) for i in rows]
    counted = [not (args.overlong_filter and truncated) for truncated in batch.truncated]
    return dapo.reinforce_pp_advantages(batch.rewards, kl, counted, args.reward_kl_coef, all_reduce,
                                        getattr(args, "gamma", 1.0))  # (runs from before --gamma)


@torch.no_grad()
def with_old_logprobs(run, batch):
    """Step 3: pi_old of eq. 10, the trainer's log-probs before this step's first update. With
    one update this step they equal the update's own (detached), so nothing is computed here
    (REINFORCE++ needs them for its advantages all the same). Groups carried from the last step
    keep their sampler's log-probs: that policy sampled them."""
    args = run.args
    old = [list(lp) if stale else None for lp, stale in zip(batch.sampler_logprobs, batch.stale)]
    if args.algo == "pg" and (update_count(run, batch) > 1 or config.reads_old_logprobs(args)):
        fresh = [i for i, stale in enumerate(batch.stale) if not stale]
        for i, logp in zip(fresh, scored_logprobs(run, batch, fresh)):
            old[i] = logp
    return replace(batch, old_logprobs=old)


@torch.no_grad()
def scored_logprobs(run, batch, rows, under_reference=False, model=None):
    """The token log-probs of `rows` of `batch` under the policy (the reference, or `model`: the
    --teacher), a micro-batch at a time; the policy replays the sampler's experts (--routing-replay),
    the others route on their own as in reference.kl_term. -> per row, a list"""
    args, out = run.args, {}
    for part in micro_batch_rows(run, batch, rows):
        ids, attn, _, start = data.pack([batch.prompts[i] for i in part] or [[0]],
                                        [batch.tokens[i] for i in part] or [[0]], args.device)
        replay = None if under_reference or model is not None or not part else moe.replay_rows(
            batch.routing, batch.prompts, batch.tokens, part, ids.shape[1] - start,
            run.policy.config, args.device)
        score = functools.partial(completion_logprobs, ids=ids, attn=attn, start=start,
                                  replay=replay, temperature=args.temperature)
        with distributed.autocast(run.args.device, run.bf16):
            logp = reference.reference_forward(run, score) if under_reference else score(model or run.policy)
        out.update({i: logp[j, :len(batch.tokens[i])].tolist() for j, i in enumerate(part)})
    return [out[i] for i in rows]  # (micro-batches by tokens go longest first)


# ---- 5: the updates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class MicroBatch:
    """Rows of one mini-batch as tensors: b rows, P prompt and C completion positions."""
    ids: torch.Tensor         # (b, P+C) prompts left-padded, completions right-padded
    attn: torch.Tensor        # (b, P+C)
    start: int                # P: where the completions start
    mask: torch.Tensor        # (b, C) the loss tokens (change 4 masks truncated completions)
    advantages: torch.Tensor  # (b,), or (b, C) one per token (REINFORCE++)
    old: torch.Tensor         # (b, C) pi_old, where has_old (else the update's own, detached)
    has_old: torch.Tensor     # (b,)
    sampler: torch.Tensor     # (b, C) the sampler's log-probs
    fresh: torch.Tensor       # (b,) sampled by this step's policy (not carried)
    group_ids: torch.Tensor   # (b,) prompt ids over all ranks (the per-prompt aggregation)
    replay: torch.Tensor      # (b, P+C, L, k) the sampler's experts (--routing-replay), or None
    aux_weight: float         # this micro-batch's share of the router loss (stand-ins: 0)
    weight_scale: float       # 1 / the step's mean rollout weight (--tis-normalize), else 1
    unrejected: torch.Tensor  # (b, C) the loss tokens before --tis-reject took some out of `mask`


def update(run, batch, step=0):
    """Step 5: optimizer updates on mini-batches of a full batch's 1/mu (`update_count`: a step
    whose dynamic sampling fell short makes fewer updates, not smaller ones; the paper and verl
    fix the mini-batch's size). For each: its micro-batches, the whole mini-batch's token counts
    over all ranks as every micro-batch's divisors (change 3: the update is exactly one device's),
    the tokens chosen over the whole mini-batch (80/20, Clip-Cov, KL-Cov), loss and backward on
    each micro-batch, then one clipped optimizer step. -> (named sums, named maxima)"""
    args, count = run.args, update_count(run, batch)
    if args.algo == "dpo":
        return reference.dpo_update(run, batch, count)
    # Prompt ids over all ranks for the per-prompt aggregation (this rank's after the ranks' before)
    first_group = sum(gather(batch.num_groups, run.world)[:run.rank]) \
        if args.loss_agg == "group-token-mean" else None
    sums, maxima = {}, {}
    scale = token_choice.rollout_weight_scale(run, batch)  # --tis-normalize, over the whole step
    for index, rows in enumerate(distributed.mini_batches(list(range(len(batch.tokens))), count)):
        micro = policy_micro_batches(run, batch, rows, first_group or 0, scale)
        divisors = losses.micro_batch_divisors(
            [mb.mask for mb in micro], [mb.group_ids for mb in micro] if first_group is not None
            else None, max_tokens=args.max_new_tokens, distributed=run.world > 1)
        if int(divisors[0]["num_tokens"]) == 0:  # no loss token on any rank: nothing to learn
            sums = add(sums, {"empty_updates": 1})
            continue
        chosen = [{}] * len(micro)
        if token_choice.token_choices(args):  # the 80/20 rule, Clip-Cov, KL-Cov
            chosen = token_choice.chosen_tokens(run, micro, f"{args.seed}:{step}:{index}")
        run.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        precision = functools.partial(distributed.autocast, run.args.device, run.bf16)
        for k, (mb, divisor, choice) in enumerate(zip(micro, divisors, chosen)):
            with distributed.accumulating(run.model, last=k == len(micro) - 1), precision():
                loss, mb_sums, mb_maxima = policy_gradient_loss(run, mb, divisor, choice)
                # DDP/FSDP average gradients over ranks; the divisors are global: x world, a sum
                (loss * run.world).backward()
            loss_sum += float(loss.detach())
            sums, maxima = add(sums, mb_sums), top(maxima, mb_maxima)
        sums = add(sums, distributed.optimizer_step(run.optimizer, run.policy, loss_sum, args.grad_clip))
    return sums, maxima


def update_count(run, batch):
    """This step's optimizer updates, the same on every rank: mu for a full batch, ceil(mu x
    groups kept / --prompts-per-step) for one that dynamic sampling left short (mini-batches of
    1/mu of a full batch, in prompts), none for an empty one."""
    kept = sum(gather(batch.num_groups, run.world))
    return math.ceil(run.args.mini_batches * kept / run.args.prompts_per_step)


def micro_batch_rows(run, batch, rows):
    """`rows` of `batch` split into micro-batches (--micro-batch-size rows, at most
    --micro-batch-tokens padded positions), as many on every rank: a rank with fewer gets empty
    ones (stand-ins), since DDP reduces gradients at the last backward and FSDP gathers weights
    with the other ranks at each forward."""
    sizes = [(len(batch.prompts[i]), len(batch.tokens[i])) for i in rows]
    parts = data.micro_batches(rows, sizes, run.args.micro_batch_size, run.args.micro_batch_tokens)
    return parts + [[]] * (distributed.micro_batch_count(len(parts)) - len(parts))


def policy_micro_batches(run, batch, rows, first_group, weight_scale=1.0):
    """The mini-batch `rows` of `batch` as MicroBatches."""
    device, args = run.args.device, run.args
    group = [first_group + g for g in batch.group_index()]  # prompt ids over all ranks
    parts = micro_batch_rows(run, batch, rows)
    out, count = [], len(parts)
    for part in parts:
        # A rank with fewer micro-batches than another runs zero-weight stand-ins.
        rollouts, part = (batch, part) if part else (STAND_IN, [0])
        packed = data.pack([rollouts.prompts[i] for i in part], [rollouts.tokens[i] for i in part],
                           device)
        width = packed.mask.shape[1]
        # change 4, overlong filtering: truncated completions carry no loss
        keep = [rollouts is not STAND_IN and not (args.overlong_filter and rollouts.truncated[i])
                for i in part]
        old = [rollouts.old_logprobs[i] for i in part]
        advantages = [rollouts.advantages[i] for i in part]  # per row, or per token (REINFORCE++)
        advantages = data.pad_rows(advantages, width, device) if isinstance(advantages[0], list) \
            else torch.tensor(advantages, device=device)  # (b,) or (b, C)
        old_logp = data.pad_rows([o or [] for o in old], width, device)
        sampler = data.pad_rows([rollouts.sampler_logprobs[i] for i in part], width, device)
        mask = unrejected = packed.mask * torch.tensor(keep, device=device)[:, None]
        if args.tis_reject:  # rejected tokens leave the mask, and so the divisors
            mask = mask * losses.rollout_rejection(old_logp, sampler, mask, rule=args.tis_reject,
                                                   bound=args.tis_reject_bound)
        out.append(MicroBatch(
            ids=packed.ids, attn=packed.attn, start=packed.start, mask=mask,
            advantages=advantages, old=old_logp,
            has_old=torch.tensor([o is not None for o in old], device=device), sampler=sampler,
            fresh=torch.tensor([not rollouts.stale[i] for i in part], device=device),
            group_ids=torch.tensor([group[i] if rollouts is batch else 0 for i in part], device=device),
            replay=moe.replay_rows(rollouts.routing, rollouts.prompts, rollouts.tokens, part, width,
                                   run.policy.config, device) if run.args.routing_replay else None,
            # the router loss: a mean over the micro-batches of every rank (stand-ins: none)
            aux_weight=0.0 if rollouts is STAND_IN else 1.0 / (count * run.world),
            weight_scale=weight_scale, unrejected=unrejected))
    return out


def policy_gradient_loss(run, mb, divisors, chosen=None):
    """The objective of eq. 10 on one micro-batch (changes 1 and 3), or the --objective's; the
    terms beyond DAPO (`added_terms`) where a flag asks for them. -> (loss, named sums for the
    log, named maxima)"""
    args, mask, chosen = run.args, mb.mask, chosen or {}
    routing = Routing(mb.replay) if run.policy.config.num_experts else None  # MoE: record, replay
    hidden = run.model(mb.ids, mb.attn, return_hidden=True, routing=routing)  # (b, P+C, H)
    logp, entropy = token_logprobs(run.policy, mb.ids, mb.attn, start=mb.start,
                                   temperature=args.temperature, with_entropy=True,
                                   entropy_grad=args.entropy_coef > 0, hidden=hidden)  # (b, C)
    old = torch.where(mb.has_old[:, None], mb.old, logp.detach())  # (b, C) pi_old
    weights, sums = token_choice.token_weights(args, mb, old, chosen) \
        if args.tis_cap or args.tis_reject or chosen else (None, {})  # rollout correction, 80/20
    objective = objectives.OBJECTIVES[args.objective]  # losses.policy_loss: eq. 10
    settings = config.objective_settings(args, chosen.get("covariance"))
    loss, stats = objective(logp, old, mb.advantages, mask, agg=args.loss_agg, token_weights=weights,
                            **settings, **divisors)
    tokens = float(stats["tokens"])
    sums.update({name: float(stats[name]) * tokens for name in
                 ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean")})
    fresh = (mask != 0) & mb.fresh[:, None]  # (b, C) the sampler's own tokens, this policy's
    sums.update(loss_tokens=tokens, entropy=float((entropy.detach() * (mask != 0)).sum()),
                mismatch=float(((old - mb.sampler).abs() * fresh).sum()),
                mismatch_tokens=float(fresh.sum()))
    if args.entropy_coef or args.kl != "none" or routing is not None or "covariance" in chosen:
        loss, more = added_terms(run, mb, divisors, loss, (hidden, logp, entropy), routing, chosen)
        sums.update(more)
    return loss, sums, {"ratio_max": float(stats["ratio_max"])}


def added_terms(run, mb, divisors, loss, forward, routing, chosen):
    """The terms beyond DAPO's loss: the entropy bonus (--entropy-coef), the MoE router's
    load-balancing loss (always logged), the KL or GKL term to the reference (--kl).
    forward: the micro-batch's (hidden, logp, entropy). -> (loss, named sums)"""
    args, (hidden, logp, entropy), sums = run.args, forward, {}
    if args.entropy_coef:
        loss = loss - args.entropy_coef * losses.aggregate(entropy, mb.mask, args.loss_agg, **divisors)
    if "covariance" in chosen:
        sums["cov_chosen_frac"] = float(chosen["covariance"].sum())
    if routing is not None:  # Switch Transformer's load-balancing loss
        aux, aux_sums = moe.router_loss(routing, run.policy.config, mb.attn, mb.aux_weight)
        if args.router_aux_coef:
            loss = loss + args.router_aux_coef * mb.aux_weight * aux
        sums.update(aux_sums)
    if args.kl != "none":
        kl_loss, per_token = reference.kl_term(run, mb, divisors, hidden, logp)
        loss = loss + args.kl_coef * kl_loss
        sums["kl"] = float((per_token.detach() * (mb.mask != 0)).sum())
    return loss, sums


# ---- the loop -----------------------------------------------------------------------------------

def main(argv=None):
    args, explicit = config.parse_config(argv)
    if args.plan_only is not None:  # the memory plan, printed; no weight read
        raise SystemExit(memory_plan.plan_only(args, launch.load_data))
    if args.bench and "steps" not in explicit:
        args.steps = 3
    try:  # Ctrl-C before the steps (loading, the step-0 evaluation): one line, nothing lost
        run = launch.setup(args)
        progress, carried = launch.load_checkpoint(run) if args.resume else (launch.Progress(), None)
        progress = replace(progress, carry=Rollouts(**carried) if carried else None)
        if run.rank == 0 and not args.bench:
            launch.open_run_directory(run, progress)
            run = replace(run, tracker=launch.open_tracking(run, progress))  # --report-to
            print(launch.describe(run), flush=True)
        if run.heldout and progress.step == 0 and not args.bench:  # every rank: its share
            evaluation.evaluate_and_log(run, progress)
    except KeyboardInterrupt:
        raise launch.interrupted_before_steps(args) from None
    # Signals: at the end of a step, checkpointed; a --reward call under way ends (UserReward.stop).
    with launch.StopRequest(getattr(run.reward_function, "stop", None)) as stop, run.tracker:
        progress, ended = train_steps(run, progress, stop)
        if ended == "stopped":  # not finished: no final/, an exit status that says so
            if run.rank == 0:
                print(f"stopped after step {progress.step}, checkpointed: python train.py --resume "
                      f"{args.out}", flush=True)
            return distributed.shut_down(exit_status=128 + (stop.signum or signal.SIGTERM))
        if ended == "time" and run.rank == 0:
            print(f"time limit of {args.time_limit:g} minutes reached after {progress.step} steps", flush=True)
        if not args.bench:
            launch.finish(run, progress)  # every rank: under FSDP they gather the weights together
    distributed.shut_down()


def train_steps(run, progress, stop):
    """Steps until --steps, the time limit or a stop request; rank 0 logs them; checkpoints by
    time, every --checkpoint-every steps and at the end. -> (progress, "steps" | "time" | "stopped")"""
    args, writes = run.args, run.rank == 0 and not run.args.bench
    bar = tqdm(total=args.steps, initial=progress.step, disable=not writes, desc="train", unit="step",
               dynamic_ncols=True)
    limit = args.time_limit * 60 or math.inf  # seconds of training; 0: none
    last_save, over_time, stopping = time.monotonic(), progress.train_seconds > limit, False
    watch = metrics.Watch(args, launch.answer_format(run), launch.logged_rows(run) if writes else [])
    while progress.step < args.steps and not over_time and not stopping:
        if args.algo == "sft":  # a supervised step (variants/sft.py) in place of the RL step
            progress, row, examples = sft.sft_step(run, progress, lr_at(progress.trained_steps, args))
        else:
            progress, row, examples = train_step(run, progress)
        # Every rank must stop at the same step (or the others hang in the next collective), and
        # their clocks differ (rank 0 alone writes): the decisions are maxed over ranks.
        by_time = args.checkpoint_minutes and time.monotonic() - last_save > args.checkpoint_minutes * 60
        by_steps = args.checkpoint_every and progress.step % args.checkpoint_every == 0
        flags = reduce_metrics({}, {
            "over_time": float(progress.train_seconds > limit), "stop": float(stop.signum is not None),
            "save_due": float(bool(by_time or by_steps)),
            "reward_stopped": float(getattr(run.reward_function, "stopped", False))})
        over_time, stopping = flags["over_time"] > 0, flags["stop"] > 0
        if args.bench:  # seconds per part of the step, nothing written
            launch.print_seconds(progress.step, row)
            continue
        if writes:  # metrics.jsonl, samples.jsonl, the bar
            launch.log_step(run, progress, row, examples, bar, watch)
        # (not once a stop signal ended --reward's calls: every held-out reply would score wrong)
        if run.heldout and args.eval_every and progress.step % args.eval_every == 0 \
                and not flags["reward_stopped"]:
            evaluation.evaluate_and_log(run, progress)  # every rank: its share of the problems
        if flags["save_due"] or over_time or stopping or progress.step == args.steps:
            launch.save_checkpoint(run, progress)
            last_save = time.monotonic()
    bar.close()
    return progress, "stopped" if stopping else "time" if over_time else "steps"


# ---- the learning rate -------------------------------------------------------------------------

def lr_at(step, args):
    """Learning rate of the step after `step` steps that updated, shared by its updates: linear warm-up
    over --warmup-steps, then constant (DAPO) or a cosine decay that would reach 10% at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


if __name__ == "__main__":
    main()
