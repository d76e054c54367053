"""The objectives since DAPO, each in place of its clipped ratio (losses.policy_loss, eq. 10), the
tokens they choose, and the other losses of the codebase: entropy, GKL, DPO (r_t = pi / pi_old).

    gspo_loss            min(s A, clip(s) A), s = exp(mean_t log r_t)    GSPO, arXiv 2507.18071
    cispo_loss           sg(clip(r_t)) A_t log pi(o_t)                   CISPO, arXiv 2506.13585
    gmpo_loss            A exp(mean_t clip(log r_t))                     GMPO, arXiv 2507.20673
    sapo_loss            4 / tau sigmoid(tau (r_t - 1)) A_t              SAPO, arXiv 2511.20347
    high_entropy_tokens  eq. 5: I[H_t >= tau_rho] objective_t            80/20, arXiv 2506.01939
    clip_cov_loss        eq. 12: no gradient on the chosen tokens        Clip-Cov, arXiv 2505.22617
    kl_cov_loss          eq. 13: -r_t A_t + k I[chosen] |log r_t|        KL-Cov, arXiv 2505.22617
                         (token_covariance eq. 11; clip_cov_tokens, kl_cov_tokens choose)
    entropy              -sum_j p_j log p_j, chunked, fp32 math
    gkl_loss             alpha KL + beta wMSE to the reference           GKL, arXiv 2503.08038
    dpo_loss             eq. 7: -log sigma(beta (d_w - d_l)), d = log pi/ref   DPO, arXiv 2305.18290

Every function takes the same divisors as losses.policy_loss (losses.micro_batch_divisors), so
the micro-batches and ranks of a mini-batch give one device's update, exactly. OBJECTIVES: the
--objective choices ("clip" is losses.policy_loss). Imports only torch, the standard library and
losses.

    python -m pytest tests/test_objectives.py -q
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from losses import _as_divisor, aggregate, policy_loss, ratio_stats

# Chunks of the (tokens, V) logits hold about this many elements (16 MiB in fp32), so the
# temporaries of entropy / GKL stay small at any vocabulary (27 rows of a 152k vocabulary).
CHUNK_ELEMENTS = 2**22


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

    Decisions (tests/test_objectives.py checks them on hand-computed V = 5 vectors):
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
