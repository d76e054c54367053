"""What compares the policy with a reference policy (the frozen copy, or the policy with LoRA off,
--ref): the KL or GKL term added to the policy-gradient loss (--kl), and DPO's update (--algo
dpo), which train.py's step 5 calls in place of its own.

    python train.py --kl k3 --kl-coef 0.001        # GRPO's KL term (Shao et al. 2024)
    python train.py --kl gkl                       # GKL over the vocabulary (Cui et al. 2025)
    python train.py --preset dpo                   # online DPO on correct-vs-wrong pairs
"""

import functools
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

import dapo
import data
import losses
from model import token_logprobs
from run import distributed
from run.distributed import add, all_reduce
from variants import objectives
from variants.lora import lora_disabled


def reference_forward(run, fn):
    """fn(model) under the reference policy: the frozen copy, or the policy with LoRA off."""
    if run.reference is not None:
        return fn(run.reference)
    with lora_disabled(run.policy):
        return fn(run.policy)


# ---- the KL / GKL term -------------------------------------------------------------------------

def kl_term(run, mb, divisors, hidden, logp, positions=64):
    """k1/k2/k3 (Schulman) of the sampled tokens, or GKL (Cui et al. 2025) over the vocabulary,
    aggregated like the policy loss. -> (loss, per-token term (b, C))

    hidden (b, P+C, H): the policy body's output, already computed for the log-probs. GKL needs
    whole logit rows of both policies; they are made `positions` at a time and made again in
    backward (checkpoint), so no (b, C, V) tensor or its gradient is ever held.
    """
    args, mask, start = run.args, mb.mask, mb.start
    ids, attn, C = mb.ids, mb.attn, mb.mask.shape[1]
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
            checkpoint(objectives.gkl_of_hidden, hidden[:, s:s + positions], ref_hidden[:, s:s + positions],
                       run.policy.output.weight, ref_weight, settings,
                       run.policy.config.final_softcap, use_reentrant=False)
            for s in range(0, C, positions)], dim=1)  # (b, C)
    else:
        with torch.no_grad():
            ref_logp = reference_forward(run, lambda m: token_logprobs(
                m, ids, attn, start=start, temperature=args.temperature))  # (b, C)
        per_token = losses.kl_estimate(logp, ref_logp, args.kl)  # (b, C)
    return losses.aggregate(per_token, mask, args.loss_agg, **divisors), per_token


# ---- DPO ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PairBatch:
    """Preference pairs as tensors, each pair's chosen row followed by its rejected row."""
    ids: torch.Tensor    # (2b, P+C)
    attn: torch.Tensor   # (2b, P+C)
    start: int           # P
    mask: torch.Tensor   # (2b, C) the span the loss reads (Step-DPO: the first differing line)
    pairs: int           # b (0: a stand-in, no loss)
    num_pairs: torch.Tensor  # pairs of the whole mini-batch over all ranks (the divisor)


def preference_pairs(run, batch):
    """(chosen, rejected, (start, end) of each) from correct-vs-wrong completions of a prompt;
    Step-DPO keeps the loss on the first line where the two part ways."""
    if run.args.dpo_pairs == "step":
        pairs = dapo.step_dpo_pairs(batch.tokens, batch.rewards, batch.group_sizes, run.step_separators)
        return [(p["chosen"], p["rejected"], (p["prefix_len"], p["chosen_end"]),
                 (p["prefix_len"], p["rejected_end"])) for p in pairs]
    return [(c, r, (0, len(batch.tokens[c])), (0, len(batch.tokens[r])))
            for c, r in dapo.dpo_pairs(batch.rewards, batch.group_sizes)]


def dpo_update(run, batch, count):
    """`count` DPO updates (Rafailov et al. 2023; train.update_count: fewer on a short batch) on
    the step's pairs, each divided by the pairs of its mini-batch over all ranks.
    -> (named sums, named maxima)"""
    sums, maxima = {}, {}
    for pairs in distributed.mini_batches(preference_pairs(run, batch), count):
        micro = pair_batches(run, batch, pairs)
        if float(micro[0].num_pairs) == 0:
            sums = add(sums, {"empty_updates": 1})
            continue
        run.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        precision = functools.partial(distributed.autocast, run.args.device, run.bf16)
        for k, mb in enumerate(micro):
            with distributed.accumulating(run.model, last=k == len(micro) - 1), precision():
                loss, mb_sums = dpo_loss(run, mb)
                (loss * run.world).backward()  # DDP averages over ranks: make it a sum
            loss_sum += float(loss.detach())
            sums = add(sums, mb_sums)
        sums = add(sums, distributed.optimizer_step(run.optimizer, run.policy, loss_sum,
                                                    run.args.grad_clip))
    return sums, maxima


def pair_batches(run, batch, pairs):
    """These pairs as PairBatches of --micro-batch-size rows (stand-ins where a rank has fewer)."""
    size = max(1, run.args.micro_batch_size // 2)
    num_pairs = all_reduce(torch.tensor(float(len(pairs))))
    out = []
    for k in range(distributed.micro_batch_count(math.ceil(len(pairs) / size))):
        part = pairs[k * size:(k + 1) * size]
        rows = [(i, span) for c, r, span_c, span_r in part for i, span in ((c, span_c), (r, span_r))]
        packed = data.pack([batch.prompts[i] for i, _ in rows] or [[0]],
                           [batch.tokens[i] for i, _ in rows] or [[0]], run.args.device)
        span_mask = torch.zeros_like(packed.mask)
        for j, (_, (begin, end)) in enumerate(rows):
            span_mask[j, begin:end] = 1
        out.append(PairBatch(ids=packed.ids, attn=packed.attn, start=packed.start,
                             mask=packed.mask * span_mask, pairs=len(part), num_pairs=num_pairs))
    return out


def dpo_loss(run, mb):
    """DPO's loss on one PairBatch -> (loss, named sums for the log). The log-probs are the
    policies' own, untempered (as TRL's): the sampling temperature would change the implicit
    reward beta * log(pi / pi_ref) and so the effective beta."""
    seq_logp = (token_logprobs(run.model, mb.ids, mb.attn, start=mb.start) * mb.mask).sum(-1)  # (2b,)
    names = ("chosen_reward", "rejected_reward", "reward_margin", "accuracy")
    if not mb.pairs:  # a stand-in: same names, no weight (every rank logs the same names)
        return seq_logp.sum() * 0, {f"dpo_{n}": 0.0 for n in names} | {"pairs": 0, "pair_tokens": 0}
    with torch.no_grad():
        ref = (reference_forward(run, lambda m: token_logprobs(m, mb.ids, mb.attn, start=mb.start))
               * mb.mask).sum(-1)  # (2b,)
    chosen, rejected = seq_logp[0::2], seq_logp[1::2]  # rows alternate: chosen, rejected, ...
    loss, stats = objectives.dpo_loss(chosen, rejected, ref[0::2], ref[1::2], run.args.dpo_beta,
                                      num_pairs=mb.num_pairs)
    return loss, ({f"dpo_{n}": float(stats[n]) * mb.pairs for n in names}
                  | {"pairs": mb.pairs, "pair_tokens": float(mb.attn.sum())})  # prompts + replies
