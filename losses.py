"""Per-token objectives and their aggregation: every loss of the codebase, exact under accumulation.

Imports only torch and the standard library, so any function here can be copied out alone.

    policy_loss(logp, old_logp, advantages, mask, ...)  PPO/GRPO/DAPO clipped surrogate (clip-higher,
                                                       dual-clip), aggregated -> (loss, stats)
    gspo_loss, cispo_loss, gmpo_loss, sapo_loss,       the objectives since DAPO, same arguments
    clip_cov_loss, kl_cov_loss                         (OBJECTIVES: by --objective name)
    high_entropy_tokens, clip_cov_tokens, kl_cov_tokens  tokens chosen over the whole mini-batch
    rollout_weights(old_logp, sampler_logp, mask, ...) rollout correction: TIS / MIS at the token or
                                                       the sequence level
    aggregate(per_token, mask, agg, ...)               the four aggregation modes, with global divisors
    micro_batch_divisors(masks, group_ids, ...)        the global divisors of a mini-batch, computed
                                                       once before its micro-batches (all-reduced)
    kl_estimate(logp, ref_logp, kind)                  Schulman's k1 / k2 / k3, per token
    entropy(logits, chunk_size)                        entropy from logits, chunked, fp32 math
    gkl_loss(logits, ref_logits, mask, ...)            Generalized KL to the reference (Cui et al. 2025)
    gkl_per_token(logits, ref_logits, ...)             the same, per position, unaggregated
    dpo_loss(pi_chosen, pi_rejected, ref_chosen, ...)  DPO (Rafailov et al. 2023) -> (loss, stats)

Every aggregation takes its divisors from the whole mini-batch over micro-batches and ranks
(`micro_batch_divisors`), so that the sum of the micro-batch losses and gradients is the
mini-batch's, exactly, however it was split (the README's "Exact under any split" explains why).
Positions with mask 0 never touch a loss or its gradient, even if they hold inf or NaN; a
non-finite value at a counted position gives a non-finite loss, for the trainer to see.

    python -m pytest tests/test_losses.py -q
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "group-token-mean")

# Chunks of the (tokens, V) logits hold about this many elements (16 MiB in fp32), so the
# temporaries of entropy / GKL stay small at any vocabulary (27 rows of a 152k vocabulary).
CHUNK_ELEMENTS = 2**22


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

def _as_divisor(value, like: torch.Tensor) -> torch.Tensor:
    """A divisor (int, float or tensor) as a tensor of `like`'s dtype and device."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", *,
              num_tokens=None, num_seqs=None, max_tokens=None, group_ids=None,
              group_token_counts=None, num_groups=None) -> torch.Tensor:
    """Reduce a per-token loss (B, T) over the tokens where `mask` (B, T) is nonzero.

    `mask` is 0/1 (bool or float). A float value other than 1 scales that token's loss, but the
    token still counts as one token in every count (as in `micro_batch_divisors`).

    Every mode is sum_{i,t} w_{i,t} l_{i,t} (module docstring); the divisors, when given, are those
    of the whole mini-batch across micro-batches and ranks (see `micro_batch_divisors`):

      "token-mean"               DAPO eq. 12:  1/sum_i|o_i| * sum_i sum_t l_it.
                                 Divisor `num_tokens` (default: mask.sum()).
      "seq-mean-token-mean"      GRPO:  1/G sum_i 1/|o_i| sum_t l_it.  Divisor `num_seqs`
                                 (default: rows with at least one loss token); |o_i| is the row's own.
      "seq-mean-token-sum-norm"  Dr. GRPO:  1/G sum_i sum_t l_it / MAX_TOKENS. Divisors `num_seqs`
                                 and `max_tokens` (default: T, the padded width here; pass a constant,
                                 e.g. the generation budget, when micro-batches are padded unevenly).
      "group-token-mean"         per prompt:  1/|groups| sum_g 1/|tokens of g| sum_{i in g} sum_t l_it.
                                 `group_token_counts` (B,): the token count of row i's group in the
                                 whole mini-batch (a group may be split over micro-batches); default
                                 computed here from `group_ids` (B,). Divisor `num_groups` (default:
                                 groups with at least one loss token here).
      "none"                     the masked per-token loss (B, T), not reduced.

    Defaults computed here are clamped to >= 1, so a micro-batch with no loss tokens gives 0.
    """
    active = mask != 0                                                    # (B, T) bool
    weights = mask.to(per_token.dtype)                                    # (B, T) 1 for 0/1 masks
    # where, not multiply: 0 * NaN is NaN, and padding must never reach the loss or the gradient.
    per_token = torch.where(active, per_token * weights, torch.zeros_like(per_token))  # (B, T)
    if agg == "none":
        return per_token
    if agg == "token-mean":
        if num_tokens is None:
            num_tokens = active.sum().clamp(min=1)
        return per_token.sum() / _as_divisor(num_tokens, per_token)

    seq_tokens = active.sum(-1).to(per_token.dtype)                       # (B,) |o_i|
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm") and num_seqs is None:
        num_seqs = (seq_tokens > 0).sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        seq_means = per_token.sum(-1) / seq_tokens.clamp(min=1)           # (B,)
        return seq_means.sum() / _as_divisor(num_seqs, per_token)
    if agg == "seq-mean-token-sum-norm":
        if max_tokens is None:
            max_tokens = per_token.shape[-1]
        return per_token.sum() / (_as_divisor(num_seqs, per_token) * _as_divisor(max_tokens, per_token))
    if agg == "group-token-mean":
        return _group_token_mean(per_token, seq_tokens, group_ids, group_token_counts, num_groups)
    raise ValueError(f"unknown agg {agg!r}; expected one of {AGGREGATIONS} or 'none'")


def _group_token_mean(per_token, seq_tokens, group_ids, group_token_counts, num_groups):
    """aggregate's "group-token-mean": per_token (B, T) masked, seq_tokens (B,) |o_i|."""
    if group_token_counts is None:
        if group_ids is None:
            raise ValueError("agg='group-token-mean' needs group_ids or group_token_counts")
        group_ids = torch.as_tensor(group_ids, device=per_token.device).long()  # (B,)
        _, row_group = torch.unique(group_ids, return_inverse=True)    # (B,) in 0..K-1
        totals = torch.zeros(int(row_group.max()) + 1 if row_group.numel() else 0,
                             dtype=per_token.dtype, device=per_token.device)
        totals.index_add_(0, row_group, seq_tokens)                    # (K,)
        group_token_counts = totals[row_group]                         # (B,)
        if num_groups is None:
            num_groups = (totals > 0).sum().clamp(min=1)
    elif num_groups is None:
        raise ValueError("pass num_groups together with group_token_counts")
    counts = _as_divisor(group_token_counts, per_token)               # (B,)
    row_weight = torch.where(counts > 0, 1.0 / (counts.clamp(min=1) * _as_divisor(num_groups, per_token)),
                             torch.zeros_like(counts))                # (B,)
    return (per_token.sum(-1) * row_weight).sum()


def micro_batch_divisors(masks, group_ids=None, *, max_tokens=None, distributed: bool = False,
                         process_group=None) -> list[dict]:
    """The global divisors of one mini-batch, as `aggregate` / `policy_loss` / `gkl_loss` kwargs.

    masks: this rank's micro-batches of the mini-batch, a list of (b_k, T_k) masks (uneven rows,
        uneven padding widths are fine). Every rank must pass at least one (a rank with no data
        passes a (0, T) mask; it still has to run the same number of backward passes under DDP).
    group_ids: None, or a list of (b_k,) integer tensors: the prompt (group) of each row, numbered
        in the GLOBAL mini-batch (e.g. the prompt's index over all ranks), so that a group split
        over micro-batches or ranks is counted once.
    max_tokens: Dr. GRPO's constant (the generation budget); default the widest T_k (all ranks).
    distributed: all-reduce the counts over `process_group` (torch.distributed must be initialised).

    Returns one dict per micro-batch: num_tokens, num_seqs, max_tokens, and with group_ids also
    num_groups and group_token_counts (b_k,). One call costs one all-reduce of a small vector
    (plus one of two maxima), once per mini-batch, before the first micro-batch's forward pass.
    """
    if len(masks) == 0:
        raise ValueError("pass at least one micro-batch mask (an empty (0, T) one if need be)")
    device = masks[0].device
    num_tokens = sum(m.ne(0).sum() for m in masks)
    num_seqs = sum(m.ne(0).any(-1).sum() for m in masks)
    widest = max(m.shape[-1] for m in masks)
    num_group_ids = 0
    if group_ids is not None:
        group_ids = [torch.as_tensor(g, device=device).long() for g in group_ids]
        num_group_ids = max([int(g.max()) + 1 for g in group_ids if g.numel()] or [0])

    if distributed:
        import torch.distributed as dist
        maxima = torch.tensor([widest, num_group_ids], dtype=torch.int64, device=device)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=process_group)
        widest, num_group_ids = int(maxima[0]), int(maxima[1])

    # One vector holds every count, so one all-reduce (SUM) makes them global.
    counts = torch.zeros(2 + num_group_ids, dtype=torch.int64, device=device)
    counts[0], counts[1] = num_tokens, num_seqs
    if group_ids is not None:
        for m, g in zip(masks, group_ids):
            counts[2:].index_add_(0, g, m.ne(0).sum(-1))                  # tokens per global group id
    if distributed:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)

    shared = {"num_tokens": counts[0], "num_seqs": counts[1],
              "max_tokens": widest if max_tokens is None else max_tokens}
    out = []
    for k in range(len(masks)):
        div = dict(shared)
        if group_ids is not None:
            group_totals = counts[2:]                                    # (num_group_ids,)
            div["num_groups"] = (group_totals > 0).sum()
            div["group_token_counts"] = group_totals[group_ids[k]]       # (b_k,)
        out.append(div)
    return out


# ---------------------------------------------------------------------------------------------
# Policy gradient
# ---------------------------------------------------------------------------------------------

def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020), with d = ref_logp - logp = log(ref(x) / pi(x)):

        k1 = -d                 unbiased, high variance, can be negative
        k2 = d^2 / 2            biased, low variance, >= 0
        k3 = e^d - d - 1        unbiased, low variance, >= 0 (GRPO's choice, DeepSeekMath)
    """
    d = ref_logp - logp                                                   # (B, T)
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.expm1(d) - d   # e^d - 1 - d, without cancellation for small d
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")


def rollout_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *,
                    cap: float, floor: float = 0.0, level: str = "token", mode: str = "truncate"):
    """Rollout correction: weights for the gap between the policy that sampled (pi_sampler, here a
    bf16 copy of the policy, or vLLM elsewhere) and the trainer's pi_old, no gradient.

        rho_t = pi_old(o_t) / pi_sampler(o_t)      level "token": each token its own ratio
        rho   = prod_t rho_t                       level "sequence": one ratio per row, every token
        truncate (TIS, Yao et al. 2025):           w = min(rho, C)
        mask (MIS; IcePop, arXiv 2510.18855):      w = rho if floor <= rho <= C, else 0

    A masked token keeps its place in the aggregation's divisors, as in IcePop's objective (verl's
    rejection sampling takes it out of the loss mask instead). (B, T) log-probs and mask in
    -> ((B, T) weights, (B, T) bool: the loss tokens whose weight was cut or masked)
    """
    if not cap > 0 or not 0 <= floor <= cap:
        raise ValueError(f"rollout correction needs 0 <= floor <= cap and cap > 0, got {floor}, {cap}")
    active = mask != 0
    log_ratio = torch.where(active, old_logp.detach() - sampler_logp.detach(),
                            torch.zeros_like(old_logp))                          # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_logp)          # (B, T) log rho_i
    elif level != "token":
        raise ValueError(f"unknown rollout-correction level {level!r}; expected token or sequence")
    ratio = torch.exp(log_ratio)                                                 # (B, T)
    if mode == "truncate":
        return ratio.clamp(max=cap), active & (ratio > cap)
    if mode == "mask":
        inside = (ratio >= floor) & (ratio <= cap)
        return torch.where(inside, ratio, torch.zeros_like(ratio)), active & ~inside
    raise ValueError(f"unknown rollout-correction mode {mode!r}; expected truncate or mask")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, eps_low: float = 0.2, eps_high: float = 0.28, clip_c: float | None = None,
                agg: str = "token-mean", num_tokens=None, max_tokens=None, num_seqs=None,
                group_ids=None, group_token_counts=None, num_groups=None, token_weights=None):
    """The clipped surrogate of PPO with DAPO's decoupled clip (clip-higher) and optional dual-clip.

    logp, old_logp, mask: (B, T) (token log-probs under the policy being trained, under the policy
    that sampled, and the loss mask); advantages: (B,) per sequence or (B, T) per token.

        r_t = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t) = exp(logp - old_logp)
        objective_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)        DAPO eq. 10
        dual-clip (Ye et al. 2020, arXiv 1912.09729), A_t < 0:  objective_t = max(objective_t, c A_t)
        loss_t = -objective_t          (for A_t < 0 dual-clip caps loss_t at -c A_t)

    times `token_weights` (B, T) when given (no gradient: e.g. `rollout_weights`), then aggregated by
    `agg` with the whole mini-batch's divisors (`**micro_batch_divisors(...)[k]`; left out, this
    call's own counts). Pass fp32 log-probs (the ratio of two bf16 log-probs is coarse). No clamp
    on log r: past ~88 it overflows fp32 and the trainer's non-finite check skips the update.
    -> (loss, stats: `ratio_stats`)
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip needs c > 1, got {clip_c}")
    active = mask != 0                                                    # (B, T)
    if advantages.dim() == 1:
        advantages = advantages[:, None]                                  # (B, 1): one per sequence
    advantages = advantages.to(logp.dtype).expand_as(logp)                # (B, T)

    # Padding may hold anything; zero it before exp so that it reaches neither loss nor gradient.
    log_ratio = torch.where(active, logp - old_logp, torch.zeros_like(logp))  # (B, T)
    ratio = torch.exp(log_ratio)                                          # (B, T)  r_t
    unclipped = ratio * advantages                                        # (B, T)  r_t A_t
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages  # (B, T)
    objective = torch.minimum(unclipped, clipped)                         # (B, T)  DAPO eq. 10
    if clip_c is not None:
        dual = torch.maximum(objective, clip_c * advantages)              # (B, T)  max(., c A_t)
        objective = torch.where(advantages < 0, dual, objective)          # (B, T)
    per_token_loss = -objective                                           # (B, T)
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()          # (B, T)

    loss = aggregate(per_token_loss, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     max_tokens=max_tokens, group_ids=group_ids,
                     group_token_counts=group_token_counts, num_groups=num_groups)
    # A non-finite log-prob at a counted token can hide behind the clip (r = inf, A > 0 gives
    # min(inf, 1 + eps_high)); 0 * (sum of counted log-ratios) changes no finite value or gradient
    # but turns such an input into a NaN loss that the trainer sees.
    loss = loss + 0.0 * log_ratio.sum()
    return loss, ratio_stats(ratio, advantages, active, logp, old_logp, eps_low, eps_high, clip_c)


@torch.no_grad()
def ratio_stats(ratio, advantages, active, logp, old_logp, eps_low, eps_high, clip_c=None):
    """0-d tensors over the loss tokens (`active`, (B, T)):
      clip_frac_low   A < 0 and r < 1 - eps_low   (clipped: no gradient)
      clip_frac_high  A > 0 and r > 1 + eps_high  (clipped: no gradient)
      clip_frac_dual  A < 0 and r > c             (dual-clipped: no gradient)
      approx_kl       k3 estimate of KL(pi_old || pi_theta) (samples come from pi_old)
      ratio_mean, ratio_max, tokens (the loss-token count, to weight these stats across calls)"""
    count = active.sum()
    n = count.clamp(min=1).to(logp.dtype)

    def frac(flags):  # fraction of loss tokens where flags hold
        return (flags & active).sum().to(logp.dtype) / n

    negative, positive = advantages < 0, advantages > 0
    return {
        "clip_frac_low": frac(negative & (ratio < 1.0 - eps_low)),
        "clip_frac_high": frac(positive & (ratio > 1.0 + eps_high)),
        "clip_frac_dual": frac(negative & (ratio > clip_c)) if clip_c is not None
        else torch.zeros((), dtype=logp.dtype, device=logp.device),
        "approx_kl": torch.where(active, kl_estimate(old_logp.detach(), logp.detach(), "k3"),
                                 torch.zeros_like(logp)).sum() / n,
        "ratio_mean": torch.where(active, ratio, torch.zeros_like(ratio)).sum() / n,
        # ratios are > 0, so padding set to 0 never wins; with no loss tokens this reads 0
        "ratio_max": torch.where(active, ratio, torch.zeros_like(ratio)).max()
        if ratio.numel() else torch.zeros((), dtype=logp.dtype, device=logp.device),
        "tokens": count.to(logp.dtype),
    }


# ---------------------------------------------------------------------------------------------
# Policy objectives since DAPO: each replaces policy_loss's clipped surrogate, with the same
# arguments (the divisors of the whole mini-batch, `token_weights`) and the same stats.
# ---------------------------------------------------------------------------------------------

def _sequence_advantages(advantages, logp, name):
    if advantages.dim() != 1:
        raise ValueError(f"{name} is defined with one advantage per sequence: pass (B,), got "
                         f"{tuple(advantages.shape)}")
    return advantages.to(logp.dtype)[:, None].expand_as(logp)           # (B, T)


def _token_ratios(logp, old_logp, advantages, mask):
    """-> the loss tokens (B, T) bool, advantages (B, T) (one per sequence spread over its tokens,
    or one per token), log r_t (0 at padding, so it reaches neither loss nor gradient) and r_t."""
    active = mask != 0
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logp.dtype).expand_as(logp)              # (B, T)
    log_ratio = torch.where(active, logp - old_logp, torch.zeros_like(logp))  # (B, T)
    return active, advantages, log_ratio, torch.exp(log_ratio)


def gspo_loss(logp, old_logp, advantages, mask, *, eps_low=3e-4, eps_high=4e-4,
              agg="seq-mean-token-mean", token_weights=None, **divisors):
    """GSPO (arXiv 2507.18071): the importance ratio and its clip at the sequence level,

        s_i = (pi_theta(o_i | q) / pi_old(o_i | q))^(1/|o_i|) = exp(1/|o_i| sum_t log r_it)
        J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    written per token as GSPO-token does (s_it = sg[s_i] pi_theta(o_it) / sg[pi_theta(o_it)]):
    the same value and, with one advantage per sequence, the same gradient, so the
    divisors work as everywhere. The paper averages over sequences ("seq-mean-token-mean"); its
    clip range is 3e-4 / 4e-4 (section 5.1). advantages: (B,). -> (loss, stats: `ratio_stats`
    of s_i, so a clip fraction counts the tokens of clipped sequences)
    """
    active = mask != 0                                                   # (B, T)
    advantages = _sequence_advantages(advantages, logp, "GSPO")          # (B, T)
    log_ratio = torch.where(active, logp - old_logp, torch.zeros_like(logp))  # (B, T) log r_it
    seq_log_ratio = log_ratio.sum(-1) / active.sum(-1).clamp(min=1)      # (B,) log s_i
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # (B, T) value: log s_i
    ratio = torch.exp(torch.where(active, token_log_ratio, torch.zeros_like(logp)))  # (B, T) s_it
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token_loss = -torch.minimum(ratio * advantages, clipped)         # (B, T)
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    # 0 * (counted log-ratios): a non-finite log-prob makes the loss non-finite (as policy_loss)
    loss = aggregate(per_token_loss, mask, agg, **divisors) + 0.0 * log_ratio.sum()
    return loss, ratio_stats(ratio, advantages, active, logp, old_logp, eps_low, eps_high)


def cispo_loss(logp, old_logp, advantages, mask, *, eps_low=1.0, eps_high=0.2, agg="token-mean",
               token_weights=None, **divisors):
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update,

        J = 1/sum_i |o_i| sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it log pi_theta(o_it)

    so every token keeps a gradient (PPO's clip drops the tokens whose ratio left the range).
    The paper sets no lower bound (eps_low 1.0: the weight only stays >= 0) and tunes only the
    upper one (0.2, verl's CISPO recipe); token-level mean as DAPO's. -> (loss, stats; the clip
    fractions count weights cut at either bound, whatever the advantage's sign)
    """
    active = mask != 0
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logp.dtype).expand_as(logp)              # (B, T)
    log_ratio = torch.where(active, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)                                         # (B, T) r_it
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()  # (B, T) sg(clip(r))
    per_token_loss = -weight * advantages * torch.where(active, logp, torch.zeros_like(logp))
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    loss = aggregate(per_token_loss, mask, agg, **divisors) + 0.0 * log_ratio.sum()
    stats = ratio_stats(ratio, advantages, active, logp, old_logp, eps_low, eps_high)
    n = active.sum().clamp(min=1).to(logp.dtype)
    stats["clip_frac_low"] = ((ratio < 1.0 - eps_low) & active).sum().to(logp.dtype) / n
    stats["clip_frac_high"] = ((ratio > 1.0 + eps_high) & active).sum().to(logp.dtype) / n
    return loss, {name: value.detach() for name, value in stats.items()}


def gmpo_loss(logp, old_logp, advantages, mask, *, eps_low=0.4, eps_high=0.4,
              agg="seq-mean-token-mean", token_weights=None, **divisors):
    """GMPO (arXiv 2507.20673): the geometric mean of a sequence's token ratios in place of
    the arithmetic mean, each clipped in log space (to [e^-eps_low, e^eps_high], the paper's 0.4):

        J = 1/G sum_i A_i exp(1/|o_i| sum_t sgn(A_i) min(sgn(A_i) log r_it,
                                                          sgn(A_i) clip(log r_it, -eps_low, eps_high)))

    (for A_i > 0 a token's log-ratio is capped at eps_high, for A_i < 0 floored at -eps_low: the
    pessimistic side, as PPO's min). One value per sequence, given to each of its tokens, so the
    paper's mean over sequences is "seq-mean-token-mean". advantages: (B,). -> (loss, stats; the
    clip fractions count clipped tokens, in ratio space)
    """
    active = mask != 0
    advantages = _sequence_advantages(advantages, logp, "GMPO")          # (B, T)
    log_ratio = torch.where(active, logp - old_logp, torch.zeros_like(logp))  # (B, T)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-eps_low, eps_high))
    mean_log = (pessimistic * active).sum(-1) / active.sum(-1).clamp(min=1)  # (B,) log of the mean
    per_token_loss = -advantages * torch.exp(mean_log)[:, None]          # (B, T), one value a row
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    loss = aggregate(per_token_loss, mask, agg, **divisors) + 0.0 * log_ratio.sum()
    ratio = torch.exp(log_ratio)
    return loss, ratio_stats(ratio, advantages, active, logp, old_logp,
                             1.0 - math.exp(-eps_low), math.exp(eps_high) - 1.0)


def sapo_loss(logp, old_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05,
              agg="seq-mean-token-mean", token_weights=None, **divisors):
    """SAPO (arXiv 2511.20347): a smooth gate in place of the hard clip,

        f(r) = 4 / tau * sigmoid(tau (r - 1)),   J = 1/G sum_i 1/|o_i| sum_t f(r_it) A_it,
        tau = tau_pos where A > 0, tau_neg where A <= 0   (1.0 and 1.05: the paper's, verl's)

    whose gradient, 4 sigmoid (1 - sigmoid) r grad log pi, is the policy gradient at r = 1 and
    fades smoothly as r leaves 1, faster for negative advantages. -> (loss, stats; no clipping:
    its clip fractions are 0)
    """
    active, advantages, log_ratio, ratio = _token_ratios(logp, old_logp, advantages, mask)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)              # (B, T) f(r)
    per_token_loss = -gate * advantages
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    loss = aggregate(per_token_loss, mask, agg, **divisors) + 0.0 * log_ratio.sum()
    stats = ratio_stats(ratio, advantages, active, logp, old_logp, math.inf, math.inf)
    return loss, stats


# ---------------------------------------------------------------------------------------------
# Tokens chosen over the whole mini-batch: the 80/20 rule, Clip-Cov and KL-Cov. Each choice takes
# a figure of every loss token of the mini-batch on all ranks, (N,) in one order, and returns
# (N,) bool; the trainer computes the figures in a forward without gradient before the
# mini-batch's first backward and gives each micro-batch its part, so the choice does not depend
# on the split.
# ---------------------------------------------------------------------------------------------

def high_entropy_tokens(entropy: torch.Tensor, top_fraction: float) -> torch.Tensor:
    """The 80/20 rule (Wang et al. 2025, arXiv 2506.01939, eq. 5): the policy gradient reaches only
    the tokens whose entropy is in the batch's top rho, I[H_t >= tau_rho] objective_t, tau_rho the
    (1 - rho)-quantile of the batch's entropies (rho 0.2: the paper's). The other tokens keep their
    place in the divisors, as in the paper's eq. 5. (N,) -> (N,) bool"""
    if not 0 < top_fraction <= 1:
        raise ValueError(f"the high-entropy fraction must be in (0, 1], got {top_fraction}")
    if entropy.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    # The quantile with linear interpolation, as TRL's torch.quantile (which refuses > 2^24 values).
    ordered = torch.sort(entropy.double()).values                                 # (N,)
    position = (1.0 - top_fraction) * (ordered.numel() - 1)
    below, above = ordered[math.floor(position)], ordered[math.ceil(position)]
    threshold = below + (position - math.floor(position)) * (above - below)
    return entropy.double() >= threshold


def token_covariance(logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Each token's term of the batch covariance of log pi and A (Cui et al. 2025, arXiv
    2505.22617, eq. 11): Cov_t = (log pi_t - mean log pi) (A_t - mean A), means over the batch's
    loss tokens; large where a confident token has a large advantage. (N,) -> (N,)"""
    return (logp - logp.mean()) * (advantages - advantages.mean())


def clip_cov_tokens(covariance, clipped, *, fraction, low, high, generator=None) -> torch.Tensor:
    """Clip-Cov's choice (arXiv 2505.22617, sec. 4): r N tokens (at least one) drawn at random among
    those with low < Cov_t < high that the clip has not already cut (`clipped`). r = 2e-4,
    bounds 1 and 5: the paper's and verl's recipe. (N,) -> (N,) bool"""
    candidates = torch.nonzero((covariance > low) & (covariance < high) & ~clipped).flatten()
    count = min(max(int(fraction * covariance.numel()), 1), candidates.numel())
    drawn = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
    chosen = torch.zeros_like(covariance, dtype=torch.bool)
    chosen[drawn] = True
    return chosen


def kl_cov_tokens(covariance, *, fraction) -> torch.Tensor:
    """KL-Cov's choice (arXiv 2505.22617, sec. 4): the r N tokens (at least one) of largest
    covariance; r = 2e-3, the paper's recipe. (N,) -> (N,) bool"""
    count = min(max(int(fraction * covariance.numel()), 1), covariance.numel())
    chosen = torch.zeros_like(covariance, dtype=torch.bool)
    chosen[torch.topk(covariance, count).indices] = True
    return chosen


def clip_cov_loss(logp, old_logp, advantages, mask, *, chosen=None, token_weights=None, **settings):
    """Clip-Cov (arXiv 2505.22617, eq. 12): the clipped surrogate, with the chosen tokens'
    gradient removed (weight 0; they keep their place in the divisors):

        loss_t = -objective_t  if t not chosen,   0 (no gradient)  if t chosen

    chosen: (B, T) bool from `clip_cov_tokens`. Settings and stats are `policy_loss`'s."""
    weights = torch.ones_like(logp) if token_weights is None else token_weights.detach()
    if chosen is not None:
        weights = weights * (~chosen).to(logp.dtype)                    # (B, T)
    return policy_loss(logp, old_logp, advantages, mask, token_weights=weights, **settings)


def kl_cov_loss(logp, old_logp, advantages, mask, *, chosen=None, kl_coef=1.0, agg="token-mean",
                token_weights=None, **divisors):
    """KL-Cov (arXiv 2505.22617, eq. 13): the unclipped ratio for every token, and on the chosen
    tokens a penalty on how far the policy moved:

        loss_t = -r_t A_t + kl_coef I[t chosen] |log pi_theta(o_t) - log pi_old(o_t)|

    kl_coef 1: the paper's recipe. chosen: (B, T) bool from `kl_cov_tokens`. -> (loss, stats;
    nothing is clipped: its clip fractions are 0)"""
    active, advantages, log_ratio, ratio = _token_ratios(logp, old_logp, advantages, mask)
    per_token_loss = -ratio * advantages
    if chosen is not None:
        per_token_loss = per_token_loss + kl_coef * chosen.to(logp.dtype) * log_ratio.abs()
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    loss = aggregate(per_token_loss, mask, agg, **divisors) + 0.0 * log_ratio.sum()
    return loss, ratio_stats(ratio, advantages, active, logp, old_logp, math.inf, math.inf)


# --objective: the surrogate the policy-gradient update minimises (policy_loss is DAPO's).
OBJECTIVES = {"clip": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss, "gmpo": gmpo_loss,
              "sapo": sapo_loss, "clip-cov": clip_cov_loss, "kl-cov": kl_cov_loss}
CHOOSING = ("clip-cov", "kl-cov")  # the objectives that take `chosen` tokens
SEQUENCE_LEVEL = ("gspo", "gmpo")  # one ratio per sequence: one advantage per sequence, no token choice


# ---------------------------------------------------------------------------------------------
# Entropy and GKL: chunked over tokens, with the gradient written out, so that neither the
# forward nor the backward ever holds a float32 copy of the whole (tokens, V) logits.
# ---------------------------------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for fp16/bf16/fp32 inputs; fp64 stays fp64 (tests)."""
    return torch.promote_types(dtype, torch.float32)


def _rows_per_chunk(vocab: int, chunk_size: int | None) -> int:
    return max(1, chunk_size if chunk_size is not None else CHUNK_ELEMENTS // max(vocab, 1))


class _Entropy(torch.autograd.Function):
    """H(z) = -sum_j p_j log p_j, p = softmax(z);  dH/dz_j = -p_j (log p_j + H)."""

    @staticmethod
    def forward(ctx, logits, rows):                                       # logits (N, V)
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # (N,)
        for start in range(0, logits.shape[0], rows):
            logp = torch.log_softmax(logits[start:start + rows].to(dtype), -1)  # (n, V)
            out[start:start + rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, out)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):                                          # grad_out (N,)
        logits, out = ctx.saved_tensors
        grad = torch.empty_like(logits)                                   # (N, V)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            logp = torch.log_softmax(logits[start:stop].to(out.dtype), -1)   # (n, V)
            g = -logp.exp() * (logp + out[start:stop, None])                 # (n, V) dH/dz
            g_row = grad_out[start:stop, None].to(out.dtype)                 # (n, 1)
            # Rows with no weight (padding) get exactly 0, even if their logits are garbage.
            grad[start:stop] = torch.where(g_row != 0, g_row * g, torch.zeros_like(g)).to(grad.dtype)
        return grad, None


def entropy(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: (..., V) -> (...), in fp32 (fp64 stays fp64).

    Chunked over the leading rows (`chunk_size` rows at a time; default about CHUNK_ELEMENTS
    elements), forward and backward, so no full fp32 copy of the logits is ever made. Differentiable
    (for an entropy bonus).
    """
    flat = logits.reshape(-1, logits.shape[-1])                           # (N, V)
    return _Entropy.apply(flat, _rows_per_chunk(logits.shape[-1], chunk_size)).reshape(logits.shape[:-1])


class _GKL(torch.autograd.Function):
    """Per-token GKL term, its KL part and its wMSE part; gradient only to the policy logits.

    With d = o_ref - o, p~ the smoothed weights, s = softmax(o / T), s_ref = softmax(o_ref / T):
        d KL / d o   = (s - s_ref) / T
        d wMSE / d o = -p~ (d - dbar)      (the dbar term drops out: sum_j p~_j (d_j - dbar) = 0)
    """

    @staticmethod
    def forward(ctx, logits, ref_logits, alpha, beta, gamma, temperature, weight_temperature, rows):
        dtype = _compute_dtype(logits.dtype)
        n = logits.shape[0]
        kl = torch.empty(n, dtype=dtype, device=logits.device)           # (N,)
        wmse = torch.empty_like(kl)                                       # (N,)
        for start in range(0, n, rows):
            stop = start + rows
            o = logits[start:stop].to(dtype)                              # (n, V) o_policy
            o_ref = ref_logits[start:stop].to(dtype)                      # (n, V)
            log_s_ref = torch.log_softmax(o_ref / temperature, -1)        # (n, V)
            log_s = torch.log_softmax(o / temperature, -1)                # (n, V)
            kl[start:stop] = (log_s_ref.exp() * (log_s_ref - log_s)).sum(-1)  # KL(s_ref || s)
            p, d, d_bar = _gkl_weights_and_diffs(o, o_ref, gamma, weight_temperature)
            wmse[start:stop] = 0.5 * (p * (d - d_bar) ** 2).sum(-1)      # 1/2 sum_j p~_j (d_j - dbar)^2
        term = alpha * kl + beta * wmse
        ctx.save_for_backward(logits, ref_logits)
        ctx.settings = (alpha, beta, gamma, temperature, weight_temperature, rows, dtype)
        ctx.mark_non_differentiable(kl, wmse)
        return term, kl, wmse

    @staticmethod
    def backward(ctx, grad_term, _grad_kl, _grad_wmse):                   # grad_term (N,)
        logits, ref_logits = ctx.saved_tensors
        alpha, beta, gamma, temperature, weight_temperature, rows, dtype = ctx.settings
        grad = torch.zeros_like(logits)                                   # (N, V)
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            g_row = grad_term[start:stop, None].to(dtype)                 # (n, 1)
            o = logits[start:stop].to(dtype)                              # (n, V)
            o_ref = ref_logits[start:stop].to(dtype)                      # (n, V)
            s = torch.softmax(o / temperature, -1)                        # (n, V)
            s_ref = torch.softmax(o_ref / temperature, -1)                # (n, V)
            p, d, d_bar = _gkl_weights_and_diffs(o, o_ref, gamma, weight_temperature)
            g = alpha * (s - s_ref) / temperature - beta * p * (d - d_bar)  # (n, V) dterm/do
            # Rows with no weight (padding) get exactly 0, even if their logits are garbage.
            g = torch.where(g_row != 0, g_row * g, torch.zeros_like(g))
            grad[start:stop] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def _gkl_weights_and_diffs(o, o_ref, gamma, weight_temperature):
    """p~ = w / sum(w) with w = softmax(o_ref / T2)^gamma; d = o_ref - o; dbar = sum_j p~_j d_j.

    In log space: log w = gamma * log_softmax(o_ref / T2), and p~ = softmax(log w), which is the
    same as softmax(gamma * o_ref / T2): the smoothed weights are a softmax at temperature T2/gamma.
    """
    log_w = gamma * torch.log_softmax(o_ref / weight_temperature, -1)    # (n, V)
    p = torch.softmax(log_w, -1)                                          # (n, V) p~
    d = o_ref - o                                                         # (n, V) raw logits, not / T
    d_bar = (p * d).sum(-1, keepdim=True)                                 # (n, 1)
    return p, d, d_bar


def gkl_per_token(logits: torch.Tensor, ref_logits: torch.Tensor, *, alpha: float = 1.0,
                  beta: float = 1.0, gamma: float = 1.0, temperature: float = 1.0,
                  weight_temperature: float = 1.0, chunk_size: int | None = None):
    """The GKL term of each position, unaggregated (see gkl_loss): (..., V) -> term, kl, wmse (...).

    For callers that compute the logits a slice of positions at a time and aggregate once at the
    end (the gradient reaches `logits` through `term` only)."""
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)                               # (N, V)
    flat_ref = ref_logits.detach().reshape(-1, vocab)                     # (N, V)
    term, kl, wmse = _GKL.apply(flat_logits, flat_ref, float(alpha), float(beta), float(gamma),
                                float(temperature), float(weight_temperature),
                                _rows_per_chunk(vocab, chunk_size))       # (N,) each
    shape = logits.shape[:-1]
    return term.reshape(shape), kl.reshape(shape), wmse.reshape(shape)


def gkl_of_hidden(hidden, ref_hidden, weight, ref_weight, settings, softcap=None):
    """GKL term per position from the two bodies' outputs: (b, c, H) -> (b, c). softcap: the
    family's final-logit cap (Gemma 2), cap * tanh(z / cap)."""
    logits, ref_logits = F.linear(hidden, weight), F.linear(ref_hidden, ref_weight)  # (b, c, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
        ref_logits = softcap * torch.tanh(ref_logits / softcap)
    return gkl_per_token(logits, ref_logits, **settings)[0]


def gkl_loss(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor, *,
             alpha: float = 1.0, beta: float = 1.0, gamma: float = 1.0, temperature: float = 1.0,
             weight_temperature: float = 1.0, agg: str = "token-mean", num_tokens=None,
             max_tokens=None, num_seqs=None, group_ids=None, group_token_counts=None, num_groups=None,
             chunk_size: int | None = None):
    """Generalized KL divergence to the reference policy (Cui et al. 2025, arXiv 2503.08038), per
    token, aggregated like `policy_loss` (same divisor arguments, same exactness).

    logits, ref_logits: (B, T, V), the policy's and the reference's logits at the same positions
    (any dtype; fp32 math); mask: (B, T). Per token, with o = policy logits, o_ref = reference logits (no gradient):

        d = o_ref - o,     w_j = softmax(o_ref / T2)_j^gamma,     p~ = w / sum_j w_j
        wMSE = 1/4 sum_jk p~_j p~_k (d_j - d_k)^2  =  1/2 sum_j p~_j (d_j - dbar)^2,
               dbar = sum_j p~_j d_j                     (DKL/IKL, Cui et al. 2024, arXiv 2305.13948)
        KL   = KL(softmax(o_ref / T) || softmax(o / T))
        GKL  = alpha * KL + beta * wMSE

    Decisions (tests/test_losses.py checks them on hand-computed V = 5 vectors):
      * d uses the RAW logits, not logits / T; only the KL part and the weights see temperatures.
      * KL is not multiplied by T^2.
      * the MSE is the centred O(V) form: never the V x V matrix of the authors' code, and not
        2 S0 S2 - 2 S1^2, which cancels catastrophically.
      * the paper's class-wise global weights are left out (no class label per token).
    KL is the paper's soft-label cross-entropy minus the reference's entropy (a constant), so the
    term is 0 when the two agree. The gradient reaches the policy through both KL and wMSE.

    Memory: chunked over tokens (`chunk_size` rows; default about CHUNK_ELEMENTS elements), forward
    and backward (the backward recomputes), fp32 math. Extra memory beyond the inputs is the
    gradient plus a few chunk-sized temporaries, at any vocabulary size.

    Returns (loss, stats); stats: kl, wmse, gkl (token means over this call's loss tokens), tokens.
    """
    term, kl, wmse = gkl_per_token(logits, ref_logits, alpha=alpha, beta=beta, gamma=gamma,
                                   temperature=temperature, weight_temperature=weight_temperature,
                                   chunk_size=chunk_size)                 # (B, T) each
    loss = aggregate(term, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     max_tokens=max_tokens, group_ids=group_ids,
                     group_token_counts=group_token_counts, num_groups=num_groups)
    with torch.no_grad():
        active = mask != 0                                                # (B, T)
        n = active.sum().clamp(min=1).to(term.dtype)

        def token_mean(x):
            return torch.where(active, x.reshape(mask.shape), torch.zeros_like(term)).sum() / n

        stats = {"kl": token_mean(kl), "wmse": token_mean(wmse), "gkl": token_mean(term.detach()),
                 "tokens": active.sum().to(term.dtype)}
    return loss, stats


# ---------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------

def dpo_loss(pi_chosen: torch.Tensor, pi_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, *, num_pairs=None):
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290, eq. 7):

        loss = -log sigma( beta log(pi(y_w)/ref(y_w)) - beta log(pi(y_l)/ref(y_l)) )

    Inputs (P,): summed log-probs of each pair's chosen (y_w) and rejected (y_l) completion under
    the policy and the reference (for Step-DPO, summed over the diverging step only). Mean over
    pairs; `num_pairs` gives the divisor of the whole mini-batch (exact under accumulation).

    Returns (loss, stats): chosen_reward, rejected_reward (beta * log-ratio means), reward_margin,
    accuracy (fraction of pairs with chosen reward > rejected reward), pairs.
    """
    chosen_reward = beta * (pi_chosen - ref_chosen)                       # (P,)
    rejected_reward = beta * (pi_rejected - ref_rejected)                 # (P,)
    margin = chosen_reward - rejected_reward                              # (P,)
    if num_pairs is None:
        num_pairs = max(margin.numel(), 1)
    loss = -F.logsigmoid(margin).sum() / _as_divisor(num_pairs, margin)      # eq. 7
    with torch.no_grad():
        pairs = max(margin.numel(), 1)
        stats = {"chosen_reward": chosen_reward.sum() / pairs,
                 "rejected_reward": rejected_reward.sum() / pairs,
                 "reward_margin": margin.sum() / pairs,
                 "accuracy": (margin > 0).to(margin.dtype).sum() / pairs,
                 "pairs": margin.new_tensor(float(margin.numel()))}
    return loss, stats
