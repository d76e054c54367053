"""DAPO between rollouts and the loss: advantages, group filtering and its variants, presets.

DAPO (Yu et al. 2025, arXiv 2503.14476) changes four things in GRPO, numbered here and in train.py
in the paper's order (its sections 3.1-3.4), each a flag in PRESETS:
  1. Clip-higher: eps_low 0.2, eps_high 0.28 (eq. 10)                 -> losses.policy_loss
     (the ratio differs from 1 only after the first of mu updates per step: the paper takes 16)
  2. Dynamic sampling: keep only groups with 0 < #correct < G (eq. 11) -> keep_groups; train.py
     samples more prompts until the batch is full or its refill budget is spent
  3. Token-level loss: 1 / sum_i |o_i| over the whole batch (eq. 12)  -> losses.aggregate "token-mean"
  4. Overlong reward shaping (eq. 13 and §3.4): truncated samples masked, or punished softly in a
     cache window                                                      -> rewards.overlong_penalty
and the +1/-1 rule reward (eq. 7), no KL term.

Imports only torch and the standard library, so any function here can be copied out alone.

    group_advantages(rewards, group_size, kind, eps)   grpo / dr_grpo / rloo
    reinforce_baseline_advantages(rewards, ...)        REINFORCE++-baseline, whitened over tokens
    whiten(values, moments, eps), moments(values)      batch whitening, exact under DDP
    kl_penalised_returns(reward, kl, beta)             REINFORCE++: returns with a KL in the reward
    keep_groups(correct, group_size)                   eq. 11: which groups carry a learning signal
    adversarial_requests(correct, group_size)          which signal-less groups to re-ask, and how
    adaptive_num_samples(accuracies, total, ...)       difficulty-adaptive samples per prompt
    update_accuracy(tracker, prompt_id, accuracy)      running per-prompt accuracy (EMA, plain dict)
    efficiency_bonus(correct, lengths, group_size, w)  balanced reasoning: token-efficiency term
    dpo_pairs(rewards, group_size)                     (chosen, rejected) pairs from rollouts
    step_dpo_pairs(token_lists, rewards, ...)          the same, restricted to the first differing step
    PRESETS, PRESET_KEYS, LADDER                       named flag sets (train.py's argparse dests)

`group_size` is everywhere an int (G samples per prompt) or a list of ints (one per prompt, for
the adaptive budget); rewards and correctness flags are flat (N,), prompt-major.
"""

from __future__ import annotations

import heapq
import math

import torch

ADVANTAGE_KINDS = ("grpo", "dr_grpo", "rloo")  # one per sequence, by group alone
ADVANTAGE_ESTIMATORS = ADVANTAGE_KINDS + ("grpo_passk", "opo", "gpg", "reinforce_baseline",
                                         "reinforce_pp")  # --adv-estimator
READ_LENGTHS = ("reinforce_baseline", "opo")  # the estimators that weigh replies by their tokens


def _group_sizes(num_items: int, group_size) -> list[int]:
    """The size of each group, checked against the number of items."""
    if isinstance(group_size, int):
        if group_size <= 0 or num_items % group_size:
            raise ValueError(f"{num_items} items do not split into groups of {group_size}")
        return [group_size] * (num_items // group_size)
    sizes = [int(g) for g in group_size]
    if any(g <= 0 for g in sizes) or sum(sizes) != num_items:
        raise ValueError(f"group sizes {sizes} do not add up to {num_items} items")
    return sizes


def _group_index(sizes: list[int], device=None) -> torch.Tensor:
    """(N,) the group of each item: [0]*G0 + [1]*G1 + ..."""
    return torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                   torch.tensor(sizes, dtype=torch.long, device=device))


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------

def group_advantages(rewards, group_size, kind: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages (N,) from rewards (N,), one scalar per completion, for G completions per prompt.

        grpo                A_i = (r_i - mean(r)) / (std(r) + eps)        GRPO (DeepSeekMath, arXiv
                                                                          2402.03300), DAPO eq. 9;
                                                                          std unbiased
        dr_grpo             A_i = r_i - mean(r)                           Dr. GRPO (arXiv 2503.20783)
        rloo                A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r))
                                                                          RLOO (arXiv 2402.14740)

    mean / std are over the completion's own group. A group of one has no baseline: advantage 0.
    A group whose rewards are all equal gets exactly 0 (else the mean's rounding error, divided by
    a std just as tiny, becomes an advantage of order 1e-2). fp64 arithmetic; the result has the
    rewards' floating dtype.
    """
    rewards = torch.as_tensor(rewards)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    values = rewards.to(torch.float64)                                     # (N,)
    sizes = _group_sizes(values.numel(), group_size)
    index = _group_index(sizes, values.device)                             # (N,)
    size = torch.tensor(sizes, dtype=torch.float64, device=values.device)  # (groups,)
    group_sum = torch.zeros_like(size).index_add_(0, index, values)        # (groups,)
    group_max = torch.full_like(size, -math.inf).scatter_reduce(0, index, values, "amax")
    group_min = torch.full_like(size, math.inf).scatter_reduce(0, index, values, "amin")
    constant = (group_max == group_min)[index]                             # (N,) all-equal group
    centred = torch.where(constant, 0.0, values - (group_sum / size)[index])  # (N,) r_i - mean(r)

    if kind == "dr_grpo":
        advantages = centred
    elif kind == "grpo":
        square_sum = torch.zeros_like(size).index_add_(0, index, centred * centred)  # (groups,)
        std = (square_sum / (size - 1).clamp(min=1)).sqrt()               # (groups,) unbiased
        advantages = centred / (std[index] + eps)
    elif kind == "rloo":
        factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
        advantages = centred * factor[index]
    else:
        raise ValueError(f"unknown advantage kind {kind!r}; expected one of {ADVANTAGE_KINDS}")
    return advantages.to(out_dtype)


def passk_advantages(rewards, group_size, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's pass@k advantage (arXiv 2503.19595; verl's compute_grpo_passk_outcome_advantage):
    in each group only the best reply learns, by its margin over the runner-up,

        A_best = (r_max - r_second) / (std(r) + eps),   A_i = 0 for every other reply

    std unbiased over the group; a tie for the best gives 0 (verl picks one of the tied, whose
    margin is 0); a group of one has no runner-up: 0 (verl refuses it). -> (N,) fp64"""
    values = torch.as_tensor(rewards, dtype=torch.float64)                   # (N,)
    advantages, start = torch.zeros_like(values), 0
    for size in _group_sizes(values.numel(), group_size):
        group = values[start:start + size]                                   # (G,)
        if size > 1:
            top = torch.topk(group, 2)
            advantages[start + top.indices[0]] = (top.values[0] - top.values[1]) / (group.std() + eps)
        start += size
    return advantages


def opo_advantages(rewards, group_size, lengths) -> torch.Tensor:
    """OPO (arXiv 2505.23585; verl's compute_opo_outcome_advantage): the optimal baseline for
    exactly on-policy training, each group's rewards weighted by their replies' lengths, no std:

        A_i = r_i - sum_j L_j r_j / sum_j L_j       (L_j: reply j's loss tokens, in i's group)

    A group of one keeps its raw reward (verl: a baseline of 0), as does a group none of whose
    replies reaches the loss. -> (N,) fp64"""
    values = torch.as_tensor(rewards, dtype=torch.float64)                   # (N,)
    tokens = torch.as_tensor(lengths, dtype=torch.float64)                   # (N,) L_i
    sizes = _group_sizes(values.numel(), group_size)
    index = _group_index(sizes)                                              # (N,)
    weighted = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, index, tokens * values)
    total = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, index, tokens)
    baseline = torch.where((torch.tensor(sizes) > 1) & (total > 0), weighted / total.clamp(min=1), 0.0)
    return values - baseline[index]


def gpg_advantages(rewards, group_size, reduce=None) -> torch.Tensor:
    """GPG (arXiv 2504.02546; verl's compute_gpg_outcome_advantage): the group-centred reward,
    scaled up by how few rewards are not zero in the whole batch,

        A_i = alpha (r_i - mean_{group(i)}(r)),   alpha = N / max(1, #{j : r_j != 0})

    (with 0/1 rewards, alpha = samples / correct ones: a batch with few right answers is not
    learned from more weakly). N and the count are the whole batch's: `reduce` adds them over
    ranks. A group of one: a mean of 0 (verl), A = alpha r. -> (N,) fp64"""
    values = torch.as_tensor(rewards, dtype=torch.float64)                   # (N,)
    sizes = torch.tensor(_group_sizes(values.numel(), group_size), dtype=torch.long)
    alone = torch.repeat_interleave(sizes == 1, sizes)                       # (N,)
    centred = torch.where(alone, values, group_advantages(values, group_size, "dr_grpo"))
    counts = torch.tensor([float(values.numel()), float((values != 0).sum())], dtype=torch.float64)
    counts = reduce(counts) if reduce else counts
    return counts[0] / counts[1].clamp(min=1) * centred


def reinforce_baseline_advantages(rewards, group_size, lengths, reduce=None,
                                  eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262), normalised as its authors' code does
    (OpenRLHF; verl's compute_rf_baseline_outcome_advantage): each reward minus its group's mean,
    given to every token of its reply, then whitened over every loss token of the batch:

        c_i = r_i - mean_{group(i)}(r)           (0 in an all-equal group; a group of one keeps
                                                  r_i: the batch mean below is its baseline)
        A_i = (c_i - mu) / sqrt(sigma^2 + eps),  mu = sum_i L_i c_i / sum_i L_i,
              sigma^2 = sum_i L_i (c_i - mu)^2 / (sum_i L_i - 1)          (unbiased)
        eps = 1e-8, verl_F.masked_whiten's (verl's epsilon argument of 1e-6 goes unused there)

    A long reply weighs more, and the advantages' mean over samples is not 0. lengths (N,): each
    row's loss tokens (0: a row that reaches no loss). reduce: adds the batch's token `moments`
    over ranks (an all-reduce), so that every rank whitens as one process would.
    -> (N,) fp64, one advantage per row, the same at each of its tokens"""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)                  # (N,)
    sizes = torch.tensor(_group_sizes(rewards.numel(), group_size), dtype=torch.long)
    alone = torch.repeat_interleave(sizes == 1, sizes)                       # (N,)
    centred = torch.where(alone, rewards, group_advantages(rewards, group_size, "dr_grpo"))
    tokens = torch.as_tensor(lengths, dtype=torch.float64)                   # (N,) L_i
    token_moments = torch.stack([tokens.sum(), (tokens * centred).sum(),
                                 (tokens * centred * centred).sum()])       # over the tokens
    return whiten(centred, reduce(token_moments) if reduce else token_moments, eps, center=True)


def sequence_advantages(kind: str, rewards, group_size, lengths, reduce=None) -> torch.Tensor:
    """--adv-estimator `kind`'s advantage for each reply (all but reinforce_pp, one per token):
    rewards (N,), groups, lengths (N,) each reply's loss tokens; `reduce` adds a sum over ranks
    where the estimator reads the whole batch. -> (N,)"""
    if kind == "reinforce_baseline":
        return reinforce_baseline_advantages(rewards, group_size, lengths, reduce)
    if kind == "opo":
        return opo_advantages(rewards, group_size, lengths)
    if kind == "gpg":
        return gpg_advantages(rewards, group_size, reduce)
    if kind == "grpo_passk":
        return passk_advantages(rewards, group_size)
    return group_advantages(rewards, group_size, kind)


def moments(values) -> torch.Tensor:
    """(3,) fp64: count, sum and sum of squares of `values`; add these over ranks for `whiten`."""
    values = torch.as_tensor(values, dtype=torch.float64)
    return torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64),
                        values.sum(), (values * values).sum()])


def whiten(values, batch_moments=None, eps: float = 1e-8, center: bool = False) -> torch.Tensor:
    """values / sqrt(var + eps), var the unbiased variance over the whole batch; with `center`,
    (values - mean) / sqrt(var + eps) (REINFORCE++'s normalisation, verl's masked_whiten).

    `batch_moments`: `moments` of the whole batch (count, sum, sum of squares; of tokens, when
    each value stands for several), e.g. summed over ranks (then every rank divides by the same
    std as one process would); default the values' own. Fewer than 2: returned unchanged.
    """
    values = torch.as_tensor(values, dtype=torch.float64)
    count, total, square_total = (moments(values) if batch_moments is None
                                  else torch.as_tensor(batch_moments, dtype=torch.float64)).tolist()
    if count < 2:
        return values
    # verl_F.masked_whiten: (x - mean) * rsqrt(var + 1e-8), var = sum (x - mean)^2 / (n - 1)
    # (masked_var, unbiased). Its masked_mean divides by n + 1e-8: a relative 1e-8 / n, left out.
    variance = max(0.0, (square_total - total * total / count) / (count - 1))
    return (values - total / count * center) / math.sqrt(variance + eps)


def kl_penalised_returns(reward: float, kl, beta: float, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262, eqs. 3-4): the outcome reward at the last token and
    a KL penalty at every token, discounted by gamma to each token (gamma 1: summed to the end):

        r_t = I(t = T) r(x, y) - beta KL_t,   KL_t = log pi_old(o_t) - log pi_ref(o_t)   (k1)
        G_t = sum_{s >= t} gamma^(s - t) r_s      (gamma 1: r(x, y) - beta sum_{s >= t} KL_s)

    kl: (T,) per token -> (T,) fp64 returns, empty for T = 0 (normalise them over the batch with
    `whiten(..., center=True)`)."""
    kl = torch.as_tensor(kl, dtype=torch.float64)
    if kl.numel() == 0:  # a reply of no tokens has no last token to carry r(x, y): no returns
        return torch.zeros(0, dtype=torch.float64)
    if gamma == 1.0:
        to_the_end = torch.flip(torch.cumsum(torch.flip(kl, [0]), 0), [0])  # (T,) sum_{s >= t}
        return reward - beta * to_the_end
    step_rewards = (-beta * kl).tolist()                                     # r_t
    step_rewards[-1] += reward
    returns, running = [0.0] * len(step_rewards), 0.0
    for t in reversed(range(len(step_rewards))):  # (Python floats: a tensor op a token is slower)
        running = step_rewards[t] + gamma * running
        returns[t] = running
    return torch.tensor(returns, dtype=torch.float64)


def reinforce_pp_advantages(rewards, kl, counted, beta: float, reduce=None, gamma: float = 1.0) -> list:
    """REINFORCE++'s advantages (arXiv 2501.03262): each row's returns (`kl_penalised_returns`,
    kl[i] the k1 KL of row i's tokens), normalised (mean and std) over every token of the rows
    that reach the loss (`counted`: change 4's filter drops truncated rows) of the whole batch.
    `reduce`: adds the batch's `moments` over ranks (e.g. an all-reduce), so every rank
    normalises as one process would. -> per row, a list of token advantages"""
    returns = [kl_penalised_returns(reward, k, beta, gamma) for reward, k in zip(rewards, kl)]
    kept = [r for r, c in zip(returns, counted) if c]
    kept_moments = moments(torch.cat(kept) if kept else torch.zeros(0))
    flat = torch.cat(returns) if returns else torch.zeros(0, dtype=torch.float64)  # (sum T_i,)
    normalised = whiten(flat, reduce(kept_moments) if reduce else kept_moments, center=True)
    return [part.tolist() for part in normalised.split([len(r) for r in returns])]


# ---------------------------------------------------------------------------------------------
# Group filtering (DAPO eq. 11) and its adversarial variant
# ---------------------------------------------------------------------------------------------

def task_scores(reward_parts, correct) -> list[float]:
    """(N,) each row's score before any shaping term, what eq. 11 compares within a group: its
    "correct" part (the rule reward's +1 / -1, a --reward function's value), else its correctness."""
    return [parts.get("correct", float(right)) for parts, right in zip(reward_parts, correct)]


def keep_groups(correct, group_size) -> torch.Tensor:
    """(groups,) bool: True where a group carries a learning signal, 0 < #correct < G (eq. 11).

    `correct` (N,): each completion's correctness (bool or 0/1). Any per-completion score works
    the same way ("not all equal"), but filter on correctness, as DAPO does: with a shaping term
    (overlong, perplexity) the rewards of an all-wrong group may still differ a little.
    """
    values = torch.as_tensor(correct).to(torch.float64)
    sizes = _group_sizes(values.numel(), group_size)
    return torch.stack([g.max() > g.min() for g in torch.split(values, sizes)]) if sizes \
        else torch.zeros(0, dtype=torch.bool)


def adversarial_requests(correct, group_size) -> list[tuple[int, str]]:
    """Adversarial dynamic sampling, the policy half (this project's variant).

    A group with no learning signal is not just dropped: its prompt is asked again, changed so that
    the policy's answers are likely to disagree. All correct -> "harder" (e.g. an irrelevant
    distractor sentence that leaves the answer unchanged, larger operands); all wrong -> "hint"
    (e.g. a partial solution). Returns [(group index, "harder" | "hint")]; the task supplies the
    change itself (data.harder_variant, data.hint_variant).
    """
    values = [bool(c) for c in torch.as_tensor(correct).tolist()]
    requests, start = [], 0
    for index, size in enumerate(_group_sizes(len(values), group_size)):
        group = values[start:start + size]
        if all(group):
            requests.append((index, "harder"))
        elif not any(group):
            requests.append((index, "hint"))
        start += size
    return requests


# ---------------------------------------------------------------------------------------------
# Difficulty-adaptive sample budget
# ---------------------------------------------------------------------------------------------

def adaptive_num_samples(accuracies, total: int, min_samples: int, max_samples: int,
                         floor: float = 0.1) -> list[int]:
    """Samples per prompt, more where the recent accuracy p is near 0.5 (this project's variant).

    Weight w = max(sqrt(p (1 - p)), floor): the standard deviation of a prompt's 0/1 rewards, which
    is what the group-relative advantage feeds on; easy (p ~ 1) and hopeless (p ~ 0) prompts keep a
    floor. Unknown accuracy (None) counts as 0.5. Every prompt first gets `min_samples`; the rest of
    `total` is handed out one sample at a time to the prompt with the largest w / (n + 1) (the
    D'Hondt rule: proportional to w, in integers), never beyond `max_samples`. The result sums to
    exactly `total`, each entry in [min_samples, max_samples]; deterministic (ties: lower index).
    """
    n = len(accuracies)
    if min_samples < 1 or min_samples > max_samples:
        raise ValueError(f"need 1 <= min_samples <= max_samples, got {min_samples}, {max_samples}")
    if not n * min_samples <= total <= n * max_samples:
        raise ValueError(f"{total} samples cannot be split over {n} prompts within "
                         f"[{min_samples}, {max_samples}] each")
    weights = []
    for p in accuracies:
        p = 0.5 if p is None else min(max(float(p), 0.0), 1.0)
        weights.append(max(math.sqrt(p * (1.0 - p)), floor))
    counts = [min_samples] * n
    heap = [(-w / (min_samples + 1), i) for i, w in enumerate(weights) if min_samples < max_samples]
    heapq.heapify(heap)
    for _ in range(total - n * min_samples):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < max_samples:
            heapq.heappush(heap, (-weights[i] / (counts[i] + 1), i))
    return counts


def update_accuracy(tracker: dict, prompt_id, accuracy: float, decay: float = 0.5) -> float:
    """Running per-prompt accuracy in a plain dict: EMA, new = decay * old + (1 - decay) * accuracy
    (the first observation is taken as is). Returns the new value; tracker.get(id) is None for an
    unseen prompt, which `adaptive_num_samples` reads as 0.5."""
    old = tracker.get(prompt_id)
    tracker[prompt_id] = accuracy if old is None else decay * old + (1.0 - decay) * accuracy
    return tracker[prompt_id]


# ---------------------------------------------------------------------------------------------
# Balanced reasoning
# ---------------------------------------------------------------------------------------------

def efficiency_bonus(correct, lengths, group_size, weight: float) -> torch.Tensor:
    """A token-efficiency term added to the correctness reward (this project's variant of the
    length-aware rewards in the literature). Within each group, for a correct completion of length L:

        bonus = clip(weight * (mean_L_correct - L) / mean_L_correct, -weight, weight)

    where mean_L_correct is the mean length of the group's correct completions: shorter than its
    correct peers scores higher, longer lower. Wrong completions get 0: they never gain from being
    short. A group with no correct completion gets 0 everywhere. With +1/-1 rewards and weight < 1,
    a correct answer always outscores a wrong one. Returns (N,) float.
    """
    correct = torch.as_tensor(correct).bool()                              # (N,)
    lengths = torch.as_tensor(lengths).to(torch.float32)                   # (N,)
    sizes = _group_sizes(correct.numel(), group_size)
    index = _group_index(sizes, correct.device)                            # (N,)
    num_correct = torch.zeros(len(sizes), device=correct.device).index_add_(0, index, correct.float())
    len_correct = torch.zeros(len(sizes), device=correct.device).index_add_(0, index, lengths * correct)
    mean_len = (len_correct / num_correct.clamp(min=1))[index]            # (N,) mean correct length
    bonus = weight * (mean_len - lengths) / mean_len.clamp(min=1e-6)       # (N,)
    bonus = bonus.clamp(-weight, weight)
    return torch.where(correct, bonus, torch.zeros_like(bonus))


# ---------------------------------------------------------------------------------------------
# DPO pairs from rollouts
# ---------------------------------------------------------------------------------------------

def dpo_pairs(rewards, group_size, max_pairs_per_group: int = 1) -> list[tuple[int, int]]:
    """(chosen, rejected) indices into the flat batch: completions of the same prompt, the chosen
    with a strictly higher reward (with +1/-1 rewards: a correct one and an incorrect one).

    Deterministic: sort each group by reward, highest first (stable: ties keep their order), then
    pair the k-th best with the k-th worst, k = 0, 1, ..., while the best still beats the worst,
    up to `max_pairs_per_group` pairs. No completion is used twice.
    """
    rewards = torch.as_tensor(rewards).tolist()
    sizes = _group_sizes(len(rewards), group_size)
    pairs = []
    start = 0
    for size in sizes:
        members = range(start, start + size)
        order = sorted(members, key=lambda i: -rewards[i])                # stable
        for k in range(min(size // 2, max_pairs_per_group)):
            chosen, rejected = order[k], order[size - 1 - k]
            if not rewards[chosen] > rewards[rejected]:
                break
            pairs.append((chosen, rejected))
        start += size
    return pairs


def _split_steps(tokens: list[int], step_sep_ids: set[int]) -> list[list[int]]:
    """Steps of a completion: each ends with (and includes) a separator token; the last may not."""
    steps, current = [], []
    for token in tokens:
        current.append(token)
        if token in step_sep_ids:
            steps.append(current)
            current = []
    if current:
        steps.append(current)
    return steps


def step_dpo_pairs(token_lists, rewards, group_size, step_sep_ids,
                   max_pairs_per_group: int = 1) -> list[dict]:
    """Step-DPO pairs (Lai et al. 2024, arXiv 2406.18629): the pairs of `dpo_pairs`, with the loss
    restricted to the first reasoning step where the two completions differ.

    token_lists: the completions' token ids (list of lists); step_sep_ids: the ids that end a step
    (e.g. the newline tokens). Step-DPO locates the first *erroneous* step of a wrong answer; here
    the first step where a correct and a wrong completion of the same prompt part ways stands in
    for it. Returns dicts with chosen, rejected (indices), prefix_len (tokens of the shared steps:
    the common context), chosen_end, rejected_end (end of each one's diverging step): the DPO loss
    uses log-probs summed over tokens [prefix_len, chosen_end) and [prefix_len, rejected_end).
    Pairs where one completion is a step-prefix of the other (an empty diverging step) are skipped.
    """
    separators = set(int(t) for t in step_sep_ids)
    out = []
    for chosen, rejected in dpo_pairs(rewards, group_size, max_pairs_per_group):
        chosen_steps = _split_steps(list(token_lists[chosen]), separators)
        rejected_steps = _split_steps(list(token_lists[rejected]), separators)
        prefix_len, k = 0, 0
        while k < min(len(chosen_steps), len(rejected_steps)) and chosen_steps[k] == rejected_steps[k]:
            prefix_len += len(chosen_steps[k])
            k += 1
        if k >= len(chosen_steps) or k >= len(rejected_steps):
            continue                                   # one is a step-prefix of the other
        out.append({"chosen": chosen, "rejected": rejected, "prefix_len": prefix_len,
                    "chosen_end": prefix_len + len(chosen_steps[k]),
                    "rejected_end": prefix_len + len(rejected_steps[k])})
    return out


# ---------------------------------------------------------------------------------------------
# Presets: plain dicts of train.py flag values (argparse dests). A preset may leave a key out;
# train.py's default then applies. `--preset NAME` loads one; explicit flags override it.
# ---------------------------------------------------------------------------------------------

PRESET_KEYS = {
    # algorithm
    "algo", "adv_estimator", "loss_agg", "objective", "eps_low", "eps_high", "clip_c",
    "sapo_tau_pos", "sapo_tau_neg", "entropy_coef",
    # reward
    "correct_reward", "wrong_reward", "overlong_filter", "overlong_penalty", "overlong_cache",
    "ppl_penalty", "ppl_threshold", "ppl_window", "efficiency_weight", "format_reward",
    "format_weight",
    # sampling
    "dynamic_sampling", "max_refills", "keep_surplus", "adversarial", "adaptive_budget",
    "temperature", "top_p",
    # regularisation toward the reference
    "kl", "kl_coef", "gkl_alpha", "gkl_beta", "gkl_gamma", "gkl_temperature", "gkl_weight_temperature",
    # DPO, on-policy distillation
    "dpo_beta", "dpo_pairs", "teacher_coef", "verifier_coef",
    # optimisation
    "lr", "warmup_steps", "lr_schedule", "weight_decay", "grad_clip", "mini_batches",
    # the objectives since DAPO and the rollout correction
    "reward_kl_coef", "tis_cap", "tis_level", "tis_mode", "tis_floor", "tis_normalize", "tis_reject",
    "tis_reject_bound", "high_entropy_fraction", "cov_fraction",
    "clip_cov_low", "clip_cov_high", "kl_cov_coef",
    # the task (a preset made for one, as dapo-memory)
    "data", "max_new_tokens", "eval_limit",
}

# DAPO's run (paper §4.1): AdamW, lr 1e-6 constant after a 20-step warm-up, weight decay 0.1, grad
# clip 1.0, eps 0.2 / 0.28, dual-clip c = 10, token-level loss, dynamic sampling, soft overlong
# punishment with a 4,096-token cache on a 20,480-token budget (a fifth: the cache is a fraction of
# the budget here), no KL, no entropy bonus, +1/-1 rule reward (eq. 7), sampling at temperature
# 1.0, and 512 prompts x 16 samples per step in mini-batches of 512 samples: 16 updates per step.
_DAPO = {
    "algo": "pg", "adv_estimator": "grpo", "loss_agg": "token-mean",
    "eps_low": 0.2, "eps_high": 0.28, "clip_c": 10.0, "entropy_coef": 0.0,
    "correct_reward": 1.0, "wrong_reward": -1.0,
    "overlong_filter": False, "overlong_penalty": True, "overlong_cache": 0.2,
    "ppl_penalty": "off", "efficiency_weight": 0.0, "format_reward": "none",
    "dynamic_sampling": True, "max_refills": 10, "keep_surplus": False, "mini_batches": 16,
    "adversarial": False, "adaptive_budget": False,
    "kl": "none", "kl_coef": 0.0,
    "lr": 1e-6, "warmup_steps": 20, "weight_decay": 0.1, "grad_clip": 1.0,
    "temperature": 1.0, "top_p": 1.0,
}

# The critic-free baselines: same +1/-1 reward as DAPO so that presets differ in the algorithm only.
_BASELINE = {
    "algo": "pg", "loss_agg": "token-mean", "eps_low": 0.2, "eps_high": 0.2, "clip_c": None,
    "correct_reward": 1.0, "wrong_reward": -1.0,
    "dynamic_sampling": False, "overlong_filter": False, "overlong_penalty": False,
    "kl": "none", "kl_coef": 0.0, "adversarial": False, "adaptive_budget": False,
    "ppl_penalty": "off", "efficiency_weight": 0.0, "entropy_coef": 0.0, "format_reward": "none",
}

# DAPO Table 1, replayable on any model and task: each step adds one component to the one before.
# KL is off throughout (DAPO §2.3 removes it). Every rung takes the paper's 16 updates per step
# (at one update the ratio is 1 and rung 2, clip-higher, would change nothing). The training hyper-parameters are left to train.py
# (so the ladder runs at any scale); clip_c stays None (dual-clip is not a rung). Hence
# ladder-5 == dapo except clip_c (None vs 10) and lr / warmup / weight decay / grad clip /
# temperature / top_p, which the ladder does not set. Rung 3 swaps overlong filtering for the soft
# punishment (DAPO's recipe uses the punishment, which grades the truncated samples that the filter
# would mask), so its component is the pair of flags.
_LADDER_0 = {
    "algo": "pg", "adv_estimator": "grpo", "loss_agg": "seq-mean-token-mean",
    "eps_low": 0.2, "eps_high": 0.2, "clip_c": None, "entropy_coef": 0.0,
    "correct_reward": 1.0, "wrong_reward": -1.0,
    "overlong_filter": False, "overlong_penalty": False,
    "ppl_penalty": "off", "efficiency_weight": 0.0, "format_reward": "none",
    "dynamic_sampling": False, "adversarial": False, "adaptive_budget": False,
    "kl": "none", "kl_coef": 0.0, "mini_batches": 16,
}
LADDER = [  # (preset name, the flags this rung changes relative to the previous rung)
    ("ladder-0-naive-grpo", {}),
    ("ladder-1-overlong-filtering", {"overlong_filter": True}),
    ("ladder-2-clip-higher", {"eps_high": 0.28}),
    ("ladder-3-soft-overlong", {"overlong_filter": False, "overlong_penalty": True, "overlong_cache": 0.2}),
    ("ladder-4-token-level-loss", {"loss_agg": "token-mean"}),
    ("ladder-5-dynamic-sampling", {"dynamic_sampling": True, "max_refills": 10, "keep_surplus": False}),
]


def _ladder() -> dict[str, dict]:
    presets, current = {}, dict(_LADDER_0)
    for name, change in LADDER:
        current = {**current, **change}
        presets[name] = dict(current)
    return presets


PRESETS: dict[str, dict] = {
    "dapo": dict(_DAPO),
    # GRPO (DeepSeekMath, arXiv 2402.03300): sequence-mean of token-means, symmetric clip,
    # k3 KL to the reference with beta 0.04 (its eq. 3-4).
    "grpo": {**_BASELINE, "adv_estimator": "grpo", "loss_agg": "seq-mean-token-mean",
             "kl": "k3", "kl_coef": 0.04},
    # Dr. GRPO (arXiv 2503.20783): no std division, sum over tokens / a constant budget, no KL.
    "dr_grpo": {**_BASELINE, "adv_estimator": "dr_grpo", "loss_agg": "seq-mean-token-sum-norm"},
    "rloo": {**_BASELINE, "adv_estimator": "rloo"},
    # REINFORCE++ (arXiv 2501.03262): token returns with a k1 KL to the reference in the reward,
    # normalised over the batch's tokens; beta 1e-4 as OpenRLHF's README example.
    "reinforce_pp": {**_BASELINE, "adv_estimator": "reinforce_pp", "reward_kl_coef": 1e-4},
    "reinforce_baseline": {**_BASELINE, "adv_estimator": "reinforce_baseline"},
    # GRPO's pass@k advantage (arXiv 2503.19595): the best reply of a group learns, by its margin.
    "grpo_passk": {**_BASELINE, "adv_estimator": "grpo_passk"},
    # OPO (arXiv 2505.23585): the length-weighted baseline, for exactly on-policy updates (mu 1).
    "opo": {**_BASELINE, "adv_estimator": "opo", "mini_batches": 1},
    # GPG (arXiv 2504.02546): the policy gradient itself (one update a step: ratio 1, nothing
    # clipped), 0/1 rewards, the alpha-scaled group-centred advantage, no KL.
    "gpg": {**_BASELINE, "adv_estimator": "gpg", "wrong_reward": 0.0, "mini_batches": 1},
    # DPO on correct-vs-incorrect pairs of the same prompt (dpo_pairs), against a frozen reference.
    "dpo": {"algo": "dpo", "dpo_beta": 0.1, "dpo_pairs": "full", "correct_reward": 1.0,
            "wrong_reward": -1.0, "dynamic_sampling": False, "overlong_filter": False,
            "overlong_penalty": False, "kl": "none", "kl_coef": 0.0, "lr": 1e-6,
            "temperature": 1.0, "top_p": 1.0},
    # Step-DPO (Lai et al. 2024, arXiv 2406.18629): the same pairs, the loss on the first step
    # (line) where the correct and the wrong completion part ways (step_dpo_pairs).
    "step-dpo": {"algo": "dpo", "dpo_beta": 0.1, "dpo_pairs": "step", "correct_reward": 1.0,
                 "wrong_reward": -1.0, "dynamic_sampling": False, "overlong_filter": False,
                 "overlong_penalty": False, "kl": "none", "kl_coef": 0.0, "lr": 1e-6,
                 "temperature": 1.0, "top_p": 1.0},
    **_ladder(),
    # The proposed changes, each on top of DAPO. Coefficients are starting points, not tuned.
    "dapo-gkl": {**_DAPO, "kl": "gkl", "kl_coef": 0.01, "gkl_alpha": 1.0, "gkl_beta": 1.0,
                 "gkl_gamma": 1.0, "gkl_temperature": 1.0, "gkl_weight_temperature": 1.0},
    "dapo-adversarial": {**_DAPO, "adversarial": True},
    # A soft perplexity penalty in place of the soft overlong punishment (DAPO eq. 13 in shape;
    # rewards.perplexity_penalty). Units are the completion's mean per-token NLL in nats (log
    # perplexity): 0 up to perplexity 4, falling linearly to -1 at log 4 + log 4 (perplexity 16).
    # `--ppl-penalty beside` keeps both.
    "dapo-ppl": {**_DAPO, "ppl_penalty": "replace", "overlong_penalty": False,
                 "ppl_threshold": math.log(4.0), "ppl_window": math.log(4.0)},
    "dapo-adaptive-budget": {**_DAPO, "adaptive_budget": True},
    # Long tasks in turns, carried by the model's own memory (episodes.py): a shop's diary read a
    # page a turn, asked at the end for day 1's sale, so the memory written at page 1 must be kept
    # past the later pages; one outcome reward for the whole episode, given to every turn. A reply
    # is one short line after "Memory:" or "Answer:", so each turn's budget is small. (The running
    # total, `ask=total`, is past what the bundled model learns in a CPU run: MEASUREMENTS.md,
    # "Tasks in turns".)
    "dapo-memory": {**_DAPO, "data": "memory:pages=3,max=9,filler=2,ask=first", "max_new_tokens": 16,
                    "eval_limit": 50},
    "dapo-balanced": {**_DAPO, "efficiency_weight": 0.1},
    # On-policy distillation alone (variants/distill.py; needs --teacher): each token's advantage
    # the teacher's log-prob less the student's, no verifier's term, so no group is without signal
    # (dynamic sampling off); DAPO's clip-higher and token-level loss kept.
    "opd": {**_DAPO, "verifier_coef": 0.0, "teacher_coef": 1.0, "dynamic_sampling": False,
            "overlong_penalty": False},
    # Supervised fine-tuning on the data's completions (variants/sft.py): one update a batch.
    "sft": {"algo": "sft", "lr": 1e-5, "warmup_steps": 10, "lr_schedule": "cosine",
            "mini_batches": 1, "dynamic_sampling": False, "weight_decay": 0.0, "grad_clip": 1.0},
    # The objectives since DAPO (objectives.OBJECTIVES), each in place of DAPO's clipped ratio with the
    # rest of DAPO kept (dynamic sampling, overlong shaping, the updates per step), at its paper's
    # clip range and aggregation.
    # GSPO (arXiv 2507.18071, section 5.1): a sequence-level ratio clipped to [1 - 3e-4, 1 + 4e-4].
    "gspo": {**_DAPO, "objective": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "clip_c": None,
             "loss_agg": "seq-mean-token-mean"},
    # CISPO (MiniMax-M1, arXiv 2506.13585): no lower bound on the weight; the upper 0.2 is verl's
    # CISPO recipe (the paper tunes it and gives no value); token-level mean.
    "cispo": {**_DAPO, "objective": "cispo", "eps_low": 1.0, "eps_high": 0.2, "clip_c": None,
              "loss_agg": "token-mean"},
    # GMPO (arXiv 2507.20673): token log-ratios clipped to [-0.4, 0.4], a mean over sequences.
    "gmpo": {**_DAPO, "objective": "gmpo", "eps_low": 0.4, "eps_high": 0.4, "clip_c": None,
             "loss_agg": "seq-mean-token-mean"},
    # SAPO (arXiv 2511.20347): the smooth gate at tau 1.0 / 1.05, a mean over sequences.
    "sapo": {**_DAPO, "objective": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
             "clip_c": None, "loss_agg": "seq-mean-token-mean"},
    # Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617, verl's recipe/entropy): Clip-Cov
    # removes the gradient of 2e-4 of the tokens, drawn among those of covariance in (1, 5), with
    # the clip widened to [0, 2] (clip ratio 1); KL-Cov penalises the top 2e-3 by covariance with
    # kl_coef 1 and no clip. Both token-level means.
    "clip-cov": {**_DAPO, "objective": "clip-cov", "eps_low": 1.0, "eps_high": 1.0, "clip_c": None,
                 "cov_fraction": 2e-4, "clip_cov_low": 1.0, "clip_cov_high": 5.0,
                 "loss_agg": "token-mean"},
    "kl-cov": {**_DAPO, "objective": "kl-cov", "cov_fraction": 2e-3, "kl_cov_coef": 1.0,
               "clip_c": None, "loss_agg": "token-mean"},
    # The 80/20 rule (arXiv 2506.01939): DAPO's gradient on the top 20% of tokens by entropy only.
    "dapo-high-entropy": {**_DAPO, "high_entropy_fraction": 0.2},
    # Rollout correction between the sampler and the trainer, on top of DAPO: truncated IS per
    # token (Yao et al. 2025, cap 2) or per sequence (the product of the token ratios, cap 2);
    # masked IS per token (IcePop, arXiv 2510.18855: ratios outside [0.5, 5] masked) or per
    # sequence (MIS, Yao et al.'s follow-up: sequences above 2 masked).
    "tis": {**_DAPO, "tis_cap": 2.0},
    "seq-tis": {**_DAPO, "tis_cap": 2.0, "tis_level": "sequence"},
    "icepop": {**_DAPO, "tis_cap": 5.0, "tis_floor": 0.5, "tis_mode": "mask"},
    "seq-mis": {**_DAPO, "tis_cap": 2.0, "tis_level": "sequence", "tis_mode": "mask"},
}
