"""Which loss tokens carry a gradient, and with what weight, beyond DAPO's mask: the 80/20 rule
(arXiv 2506.01939: only the mini-batch's highest-entropy tokens), Clip-Cov and KL-Cov's choice by
Cov(log pi, A) (arXiv 2505.22617), and the rollout corrections' weights (truncated or masked
importance sampling, per token or per sequence: losses.rollout_weights).

The choices are made over every loss token of the whole mini-batch on all ranks, as the papers'
batch statistics are (TRL and verl choose within each micro-batch, so their choice changes with
the split): a forward without gradient gives each token's entropy and log-prob, the ranks gather
them in one order, and each micro-batch gets its part. Tokens left out keep their place in the
divisors, as in the papers' equations. train.update calls `chosen_tokens` before a mini-batch's
first backward, and train.policy_gradient_loss `token_weights`, only when one of them is on.
"""

import random

import torch

import data
import losses
from model import completion_logprobs
from run import distributed
from run.distributed import all_reduce, gather
from variants import objectives

# The log's name of each choice's share of loss tokens.
CHOICE_METRICS = {"high_entropy": "high_entropy_frac", "covariance": "cov_chosen_frac"}


def token_choices(args):
    """The choices of tokens this run makes over each mini-batch: "high_entropy" (the 80/20 rule),
    "covariance" (Clip-Cov, KL-Cov); none by default."""
    return ["high_entropy"] * (args.high_entropy_fraction < 1) + \
        ["covariance"] * (args.objective in objectives.CHOOSING)


def chosen_tokens(run, micro, seed):
    """The tokens the 80/20 rule (--high-entropy-fraction) and Clip-Cov / KL-Cov choose among every
    loss token of the mini-batch on all ranks: each token's figures from a forward without
    gradient (the weights the update's forwards see), gathered in one order over ranks (a rank's
    after those of the ranks before it), the choice (Clip-Cov's draw seeded by `seed`, the same on
    every rank), and each micro-batch's part. -> per micro-batch {name: (b, C) bool}"""
    args, names = run.args, token_choices(run.args)
    mine = [token_figures(args, mb, *current_logprobs(run, mb)) for mb in micro]
    ranks = gather({key: torch.cat([f[key] for f in mine]) for key in mine[0]}, run.world)
    every = {key: torch.cat([r[key] for r in ranks]) for key in ranks[0]}  # (N,) each
    whole = {}
    if "high_entropy" in names:
        whole["high_entropy"] = objectives.high_entropy_tokens(every["entropy"], args.high_entropy_fraction)
    if "covariance" in names:
        covariance = objectives.token_covariance(every["logp"], every["advantage"])  # eq. 11
        whole["covariance"] = objectives.kl_cov_tokens(covariance, fraction=args.cov_fraction) \
            if args.objective == "kl-cov" else objectives.clip_cov_tokens(
                covariance, every["clipped"], fraction=args.cov_fraction, low=args.clip_cov_low,
                high=args.clip_cov_high, generator=torch.Generator().manual_seed(
                    random.Random(seed).getrandbits(62)))
    start, out = sum(len(r["entropy"]) for r in ranks[:run.rank]), []
    for mb in micro:  # this rank's tokens, back into each micro-batch's (b, C) layout
        active = mb.mask != 0
        count = int(active.sum())
        out.append({name: torch.zeros_like(active).masked_scatter(
            active, flags[start:start + count].to(active.device)) for name, flags in whole.items()})
        start += count
    return out


@torch.no_grad()
def current_logprobs(run, mb):
    """A micro-batch's (b, C) log-probs and entropies under the weights the update's forwards
    see, on the CPU."""
    with distributed.autocast(run.args.device, run.bf16):
        return completion_logprobs(run.policy, mb.ids, mb.attn, mb.start, mb.replay,
                                   run.args.temperature, with_entropy=True)


def token_figures(args, mb, logp, entropy):
    """One micro-batch's loss tokens flat (n,) on the CPU, from its log-probs and entropies (b, C)
    under the current weights: entropy, log-prob, advantage, and whether the clip already cuts
    it (Clip-Cov leaves those out)."""
    active = (mb.mask != 0).cpu()
    ratio = torch.exp(logp - torch.where(mb.has_old[:, None].cpu(), mb.old.cpu(), logp))  # (b, C)
    advantages = (mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
                  ).float().cpu().expand_as(logp)                                    # (b, C)
    clipped = ((advantages > 0) & (ratio > 1 + args.eps_high)) | (
        (advantages < 0) & (ratio < 1 - args.eps_low))
    return {"entropy": entropy[active], "logp": logp[active], "advantage": advantages[active],
            "clipped": clipped[active]}


def rollout_weight_scale(run, batch):
    """--tis-normalize: 1 / the mean rollout-correction weight over the step's loss tokens
    (replies, at --tis-level sequence) on every rank, before --tis-reject, as verl normalises over
    its training batch; 1 when off. Every row's pi_old was scored in step 3. -> float"""
    args = run.args
    if not args.tis_normalize:
        return 1.0
    width = max([len(t) for t in batch.tokens] + [1])
    kept = [not (args.overlong_filter and truncated) for truncated in batch.truncated]
    mask = data.pad_rows([[float(k)] * len(t) for t, k in zip(batch.tokens, kept)], width, "cpu")
    old = data.pad_rows(batch.old_logprobs, width, "cpu").double()            # (N, C)
    sampler = data.pad_rows(batch.sampler_logprobs, width, "cpu").double()    # (N, C)
    weights, _ = losses.rollout_weights(old, sampler, mask, cap=args.tis_cap, floor=args.tis_floor,
                                        level=args.tis_level, mode=args.tis_mode)
    total, count = all_reduce(losses.rollout_weight_sums(weights, mask, args.tis_level)).tolist()
    return count / total if total > 1e-8 * count else 1.0  # verl: left alone at a mean <= 1e-8


def token_weights(args, mb, old, chosen):
    """Each loss token's weight (no gradient), or None for all ones: the rollout correction
    (--tis-cap, over its step mean with --tis-normalize) times the 80/20 rule's choice.
    -> (weights (b, C) or None, named sums)"""
    active, weights, sums = mb.mask != 0, None, {}
    if args.tis_cap:
        # Over the reply's tokens before --tis-reject, as verl weighs a sequence and as
        # rollout_weight_scale normalises: a rejected token still counts in its reply's rho =
        # prod_t rho_t; rejection then takes tokens out of the loss (mb.mask), never the weight's.
        weights, cut = losses.rollout_weights(old, mb.sampler, mb.unrejected, cap=args.tis_cap,
                                              floor=args.tis_floor, level=args.tis_level,
                                              mode=args.tis_mode)                # (b, C)
        weights = weights * mb.weight_scale
        sums.update(tis_weight=float((weights * active).sum()), tis_cut_frac=float((cut & active).sum()))
    if args.tis_reject:
        sums["tis_rejected"] = float(mb.unrejected.sum() - mb.mask.sum())
    if "high_entropy" in chosen:
        kept = chosen["high_entropy"].to(old.dtype)
        weights = kept if weights is None else weights * kept
        sums["high_entropy_frac"] = float(chosen["high_entropy"].sum())
    return weights, sums
