"""DAPO's loss and its aggregation, exact under accumulation: the clipped surrogate (eq. 10) and
the token-level mean (eq. 12), with the other aggregations and the rollout correction.

Imports only torch and the standard library, so any function here can be copied out alone.

    policy_loss(logp, old_logp, advantages, mask, ...)  PPO/GRPO/DAPO clipped surrogate (clip-higher,
                                                       dual-clip), aggregated -> (loss, stats)
    ratio_stats(ratio, advantages, active, ...)        its stats: clip fractions, approx KL, ratios
    rollout_weights(old_logp, sampler_logp, mask, ...) rollout correction: TIS / MIS at the token or
                                                       the sequence level
    rollout_weight_sums(weights, mask, level)          their sums, for the batch normalisation
    rollout_rejection(old_logp, sampler_logp, mask, ...) rollout correction: rejection by k1/k2/k3
                                                       per token or per reply (sum, mean, max)
    aggregate(per_token, mask, agg, ...)               the four aggregation modes, with global divisors
    micro_batch_divisors(masks, group_ids, ...)        the global divisors of a mini-batch, computed
                                                       once before its micro-batches (all-reduced)
    kl_estimate(logp, ref_logp, kind)                  Schulman's k1 / k2 / k3, per token

The objectives since DAPO (GSPO, CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, the 80/20 rule), entropy,
GKL and DPO are in objectives.py; they take the same divisors.

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

# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

DIVISORS = ("num_tokens", "num_seqs", "max_tokens", "group_ids", "group_token_counts", "num_groups")


def _as_divisor(value, like: torch.Tensor) -> torch.Tensor:
    """A divisor (int, float or tensor) as a tensor of `like`'s dtype and device."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              **divisors) -> torch.Tensor:
    """Reduce a per-token loss (B, T) over the tokens where `mask` (B, T) is nonzero, by one of
    AGGREGATIONS (below, each beside its equation), or "none": the masked (B, T) loss. A mask
    value other than 1 scales that token's loss, yet it counts as one token in every count.
    `divisors` (DIVISORS): the whole mini-batch's over micro-batches and ranks
    (`micro_batch_divisors`); one left out is this call's own count, clamped to >= 1."""
    if unknown := set(divisors).difference(DIVISORS):  # a misspelt one must not fall back silently
        raise TypeError(f"aggregate: unknown divisors {sorted(unknown)}")
    if agg != "none" and agg not in tuple(AGGREGATIONS):
        raise ValueError(f"unknown agg {agg!r}; expected one of {tuple(AGGREGATIONS)} or 'none'")
    active = mask != 0                                                    # (B, T) bool
    weights = mask.to(per_token.dtype)                                    # (B, T) 1 for 0/1 masks
    # where, not multiply: 0 * NaN is NaN, and padding must never reach the loss or the gradient.
    per_token = torch.where(active, per_token * weights, torch.zeros_like(per_token))  # (B, T)
    return per_token if agg == "none" else AGGREGATIONS[agg](per_token, active, **divisors)


# Each mode takes the loss as `aggregate` masked it (padding zeroed) and `active`, the loss tokens.

def token_mean(per_token, active, num_tokens=None, **_):
    """DAPO eq. 12: 1 / sum_i |o_i| * sum_i sum_t l_it; divisor `num_tokens`."""
    if num_tokens is None:
        num_tokens = active.sum().clamp(min=1)
    return per_token.sum() / _as_divisor(num_tokens, per_token)


def _sequences(active, num_seqs):
    """(B,) |o_i|, each row's loss tokens, and the divisor `num_seqs` (default: the rows with
    at least one)."""
    seq_tokens = active.sum(-1)                                           # (B,)
    return seq_tokens, (seq_tokens > 0).sum().clamp(min=1) if num_seqs is None else num_seqs


def seq_mean_token_mean(per_token, active, num_seqs=None, **_):
    """GRPO: 1/G sum_i 1/|o_i| sum_t l_it; divisor `num_seqs`, |o_i| the row's own."""
    seq_tokens, num_seqs = _sequences(active, num_seqs)
    seq_means = per_token.sum(-1) / seq_tokens.to(per_token.dtype).clamp(min=1)  # (B,)
    return seq_means.sum() / _as_divisor(num_seqs, per_token)


def seq_mean_token_sum_norm(per_token, active, num_seqs=None, max_tokens=None, **_):
    """Dr. GRPO: 1/G sum_i sum_t l_it / MAX_TOKENS; divisors `num_seqs` and `max_tokens`
    (default: T, the padded width here; pass a constant, e.g. the generation budget, when
    micro-batches are padded unevenly)."""
    _, num_seqs = _sequences(active, num_seqs)
    if max_tokens is None:
        max_tokens = per_token.shape[-1]
    return per_token.sum() / (_as_divisor(num_seqs, per_token) * _as_divisor(max_tokens, per_token))


def group_token_mean(per_token, active, group_ids=None, group_token_counts=None, num_groups=None,
                     **_):
    """Per prompt: 1/|groups| sum_g 1/|tokens of g| sum_{i in g} sum_t l_it.
    `group_token_counts` (B,): the token count of row i's group in the whole mini-batch (a group
    may be split over micro-batches); default computed here from `group_ids` (B,). Divisor
    `num_groups` (default: groups with at least one loss token here)."""
    if group_token_counts is None:
        if group_ids is None:
            raise ValueError("agg='group-token-mean' needs group_ids or group_token_counts")
        seq_tokens = active.sum(-1).to(per_token.dtype)                # (B,) |o_i|
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


AGGREGATIONS = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
                "group-token-mean": group_token_mean}


def micro_batch_divisors(masks, group_ids=None, *, max_tokens=None, distributed: bool = False,
                         process_group=None) -> list[dict]:
    """The global divisors of one mini-batch, one dict per micro-batch, as kwargs of `aggregate`,
    `policy_loss` and objectives.py: num_tokens, num_seqs, max_tokens, and with group_ids also
    num_groups and group_token_counts (b_k,).

    masks: this rank's micro-batches, (b_k, T_k) each (uneven rows and widths are fine); at least
        one: a rank with no data passes a (0, T) mask, and under DDP runs as many backwards.
    group_ids: None, or per micro-batch (b_k,) each row's prompt numbered over the GLOBAL
        mini-batch (e.g. over all ranks), so that a group split over micro-batches or ranks counts
        once. max_tokens: Dr. GRPO's constant (the generation budget); default the widest T_k.
    distributed: all-reduce the counts over `process_group`: one all-reduce of a small vector
    (and one of two maxima) per mini-batch, before its first micro-batch's forward.
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


def rollout_weight_sums(weights: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """The sums behind the rollout correction's batch normalisation (verl's
    rollout_is_batch_normalize): level "token", the weights of every loss token and their count;
    level "sequence", each reply's one weight and the replies with a loss token. Summed over a
    step's rows on every rank, w / (sum / count) has mean 1 there.
    (B, T) weights and mask in -> (2,) float64: (sum, count)"""
    active = mask != 0
    if level == "token":
        return torch.stack([(weights.double() * active).sum(), active.sum().double()])
    replied = active.any(-1)                                                     # (B,)
    return torch.stack([weights[:, 0].double()[replied].sum(), replied.sum().double()])


REJECTION_RULES = tuple(f"{where}_k{n}" for where in ("token", "seq_sum", "seq_mean", "seq_max")
                        for n in (1, 2, 3) if (where, n) != ("seq_max", 1))


def rollout_rejection(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *,
                      rule: str, bound: float) -> torch.Tensor:
    """Rollout correction by rejection (verl's rollout_rs): a token, or every token of a reply,
    whose divergence between pi_old and pi_sampler passes the bound U leaves the loss mask, and so
    the divisors (--tis-mode mask keeps a masked token's place instead). No gradient.

        per token, log rho_t = log pi_old(o_t) - log pi_sampler(o_t), Schulman's estimators:
        k1 = -log rho_t               kept while |k1| <= log U   (rho in [1/U, U])
        k2 = (log rho_t)^2 / 2        kept while k2 <= U
        k3 = rho_t - 1 - log rho_t    kept while k3 <= U
        rule token_kN: each token alone; seq_sum_kN, seq_mean_kN, seq_max_kN: the reply's sum,
        mean or max over its loss tokens, for every token of it (a max of k1 would bound one
        side only: there is no seq_max_k1)

    (B, T) log-probs and mask in -> (B, T) bool: the loss tokens kept
    """
    if rule not in REJECTION_RULES:
        raise ValueError(f"unknown rejection rule {rule!r}; expected one of {', '.join(REJECTION_RULES)}")
    if not bound > (1 if rule.endswith("k1") else 0):
        raise ValueError(f"rejection rule {rule} needs a bound > {1 if rule.endswith('k1') else 0}, got {bound}")
    where, kind = rule.rsplit("_", 1)
    active = mask != 0
    stat = torch.where(active, kl_estimate(sampler_logp.detach(), old_logp.detach(), kind),
                       torch.zeros_like(old_logp))                               # (B, T)
    if where == "seq_sum":
        stat = stat.sum(-1, keepdim=True)                                        # (B, 1)
    elif where == "seq_mean":
        stat = stat.sum(-1, keepdim=True) / active.sum(-1, keepdim=True).clamp(min=1)
    elif where == "seq_max":
        stat = torch.where(active, stat, torch.full_like(stat, -torch.inf)).amax(-1, keepdim=True)
    stat = stat.expand_as(old_logp)                                              # (B, T)
    within = stat.abs() <= math.log(bound) if kind == "k1" else stat <= bound
    return active & within


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, eps_low: float = 0.2, eps_high: float = 0.28, clip_c: float | None = None,
                agg: str = "token-mean", num_tokens=None, max_tokens=None, num_seqs=None,
                group_ids=None, group_token_counts=None, num_groups=None, token_weights=None):
    """The clipped surrogate of PPO with DAPO's decoupled clip (clip-higher) and optional dual-clip:
    logp, old_logp, mask (B, T), the log-probs under the policy trained and the one that sampled,
    the loss mask; advantages (B,) per sequence or (B, T) per token.

        r_t = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t) = exp(logp - old_logp)
        objective_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)        DAPO eq. 10
        dual-clip (Ye et al. 2020, arXiv 1912.09729), A_t < 0:  objective_t = max(objective_t, c A_t)
        loss_t = -objective_t          (for A_t < 0 dual-clip caps loss_t at -c A_t)

    times `token_weights` (B, T) when given (no gradient: e.g. `rollout_weights`), then aggregated by
    `agg` with the whole mini-batch's divisors (`**micro_batch_divisors(...)[k]`; left out, this
    call's own counts). Pass fp32 log-probs (the ratio of two bf16 log-probs is coarse). No clamp
    on log r: past ~88 it overflows fp32 and the trainer's non-finite check skips the update.
    -> (loss, stats: `ratio_stats`)"""
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
