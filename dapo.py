"""DAPO between rollouts and the loss: advantages, dynamic sampling and its variants, presets.

DAPO (Yu et al. 2025, arXiv 2503.14476) as four differences from GRPO, each a flag in PRESETS:
  1. Clip-higher: eps_low 0.2, eps_high 0.28 (eq. 10)                 -> losses.policy_loss
  2. Dynamic sampling: keep only groups with 0 < #correct < G (eq. 11), refill the batch
                                                                        -> keep_groups, dynamic_sample
  3. Token-level loss: 1 / sum_i |o_i| over the whole batch (eq. 12)  -> losses.aggregate "token-mean"
  4. Overlong reward shaping: soft punishment in a cache window (eq. 13) -> rewards.overlong_penalty
and the +1/-1 rule reward (eq. 7), no KL term.

Imports only torch and the standard library, so any function here can be copied out alone.

    group_advantages(rewards, group_size, kind, eps)   grpo / dr_grpo / rloo / reinforce_baseline
    keep_groups(rewards, group_size)                   eq. 11: which groups carry a learning signal
    classify_group(group)                              "informative" | "all_correct" | "all_wrong"
    dynamic_sample(sample_groups, want_groups, ...)    fill a batch with informative groups, bounded
    adversarial_requests(groups)                       which signal-less groups to re-ask, and how
    adaptive_num_samples(accuracies, total, ...)       difficulty-adaptive samples per prompt
    update_accuracy(tracker, prompt_id, accuracy)      running per-prompt accuracy (EMA, plain dict)
    efficiency_bonus(correct, lengths, group_size, w)  balanced reasoning: token-efficiency term
    dpo_pairs(rewards, group_size)                     (chosen, rejected) pairs from rollouts
    step_dpo_pairs(token_lists, rewards, ...)          the same, restricted to the first differing step
    PRESETS, PRESET_KEYS, LADDER                       named flag sets (train.py's argparse dests)

`group_size` is everywhere an int (G samples per prompt) or a list of ints (one per prompt, for
the adaptive budget); rewards are flat (N,), prompt-major.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable

import torch

ADVANTAGE_KINDS = ("grpo", "dr_grpo", "rloo", "reinforce_baseline")


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
                                   torch.tensor(sizes, device=device))


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
        reinforce_baseline  A_i = r_i - mean(r), then whitened over all N (REINFORCE++-baseline)

    mean / std are over the completion's own group. A group of one has no baseline: advantage 0.
    `reinforce_baseline` whitens over the rewards passed in: pass the whole batch (all ranks) for a
    rank-independent result.
    """
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    sizes = _group_sizes(rewards.numel(), group_size)
    index = _group_index(sizes, rewards.device)                            # (N,)
    size = torch.tensor(sizes, dtype=rewards.dtype, device=rewards.device)  # (groups,)
    group_sum = torch.zeros_like(size).index_add_(0, index, rewards)       # (groups,)
    centred = rewards - (group_sum / size)[index]                          # (N,) r_i - mean(r)

    if kind == "dr_grpo":
        return centred
    if kind == "grpo":
        square_sum = torch.zeros_like(size).index_add_(0, index, centred * centred)  # (groups,)
        std = (square_sum / (size - 1).clamp(min=1)).sqrt()               # (groups,) unbiased
        return centred / (std[index] + eps)
    if kind == "rloo":
        factor = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
        return centred * factor[index]
    if kind == "reinforce_baseline":
        if centred.numel() < 2:
            return centred
        return (centred - centred.mean()) / (centred.std() + eps)
    raise ValueError(f"unknown advantage kind {kind!r}; expected one of {ADVANTAGE_KINDS}")


# ---------------------------------------------------------------------------------------------
# Dynamic sampling (DAPO eq. 11) and its adversarial variant
# ---------------------------------------------------------------------------------------------

def keep_groups(rewards, group_size) -> torch.Tensor:
    """(groups,) bool: True where a group's rewards are not all equal.

    DAPO eq. 11 keeps groups with 0 < |{o_i | is_equivalent(a, o_i)}| < G; with a reward that is a
    function of correctness (+1/-1 or 1/0) that is exactly "not all equal". A group whose rewards
    are all equal has every advantage 0 and gives no gradient (it still counts in a token-mean).
    """
    rewards = torch.as_tensor(rewards)
    sizes = _group_sizes(rewards.numel(), group_size)
    return torch.stack([g.max() > g.min() for g in torch.split(rewards, sizes)]) if sizes \
        else torch.zeros(0, dtype=torch.bool)


def _correct_flags(group: dict) -> list[bool]:
    """A group's correctness: its "correct" list if present, else reward > 0 (true for the +1/-1
    rule reward of DAPO eq. 7 and for 1/0 accuracy rewards, also with DAPO's overlong penalty)."""
    if "correct" in group:
        return [bool(c) for c in group["correct"]]
    return [float(r) > 0 for r in group["rewards"]]


def classify_group(group: dict) -> str:
    """"informative" (0 < #correct < G, DAPO eq. 11), "all_correct" or "all_wrong".

    `group` is a dict with "rewards" (list of floats) and optionally "correct" (list of bools).
    """
    correct = _correct_flags(group)
    if len(correct) > 0 and all(correct):
        return "all_correct"
    if not any(correct):
        return "all_wrong"
    return "informative"


def adversarial_requests(groups: list[dict]) -> list[tuple[int, str]]:
    """Adversarial dynamic sampling, the policy half (this project's variant).

    A group with no learning signal is not just dropped: its prompt is asked again, changed so that
    the policy's answers are likely to disagree. All correct -> "harder" (e.g. an irrelevant
    distractor sentence that leaves the answer unchanged, larger operands); all wrong -> "hint"
    (e.g. a partial solution). Returns [(index into groups, "harder" | "hint")]; the task supplies
    the change itself as `transform(group, how)` (see `dynamic_sample`).
    """
    requests = []
    for index, group in enumerate(groups):
        kind = classify_group(group)
        if kind == "all_correct":
            requests.append((index, "harder"))
        elif kind == "all_wrong":
            requests.append((index, "hint"))
    return requests


def dynamic_sample(sample_groups: Callable[[int, int, list], list[dict]], want_groups: int,
                   max_rounds: int, *, carry: list[dict] | None = None, keep_surplus: bool = False,
                   transform: Callable[[dict, str], object] | None = None):
    """DAPO's dynamic sampling (eq. 11): sample until the batch holds `want_groups` informative
    groups, within a budget of `max_rounds` sampling rounds (1 + the number of refills).

    sample_groups(round_index, num_missing, prompts) -> list of groups. Called once per round.
        round_index: 0, 1, ...; num_missing: informative groups still wanted (the sampler decides how
        many fresh prompts to draw; the paper draws a full batch each round); prompts: prompts to
        sample in this round before fresh ones (the adversarial variants of the previous round's
        signal-less groups; [] without `transform`). A group is a dict with at least "rewards"
        (list of floats), optionally "correct" (list of bools, then eq. 11 is applied to it), and
        whatever else the task needs (prompt, completions, ...): it is passed through untouched.
    carry: informative groups kept from the previous step (with keep_surplus); they are used first.
    keep_surplus: informative groups beyond `want_groups` are dropped (the paper), or carried into
        the next step's batch (then one step stale; report["surplus_carried"] says how many).
    transform(group, how) -> prompt or None: the task's adversarial change ("harder" or "hint", see
        `adversarial_requests`); its prompts are sampled in the next round. None: no adversarial
        sampling.

    With dynamic sampling off, do not call this: sample once and keep every group (naive GRPO keeps
    the signal-less groups, whose tokens still count in a token-mean). Rounds are not optimizer
    steps: step counters and learning-rate schedules count updates, not sampling rounds.

    Never raises on the budget and never loops forever (verl raises when its budget is spent; here
    the step trains on what it has and the report says so). Returns (kept_groups, report):
      kept_groups: at most `want_groups` informative groups, carried-in ones first.
      report: rounds, sampled_groups, informative, kept, carried_in, dropped (signal-less groups),
        dropped_all_correct, dropped_all_wrong, missing (want_groups - kept), surplus_dropped,
        surplus_carried, adversarial_prompts (prompts from `transform` handed to the sampler), all
        ints; and "carry": the list of groups to pass as `carry=` next step (pop it before logging).
    """
    carry = list(carry or [])
    kept = carry[:want_groups]                       # stale by one step: use them before they age
    report = {"rounds": 0, "sampled_groups": 0, "informative": 0, "kept": 0,
              "carried_in": len(kept), "dropped": 0, "dropped_all_correct": 0,
              "dropped_all_wrong": 0, "missing": 0, "surplus_dropped": len(carry) - len(kept),
              "surplus_carried": 0, "adversarial_prompts": 0}
    surplus: list[dict] = []
    prompts: list = []
    for round_index in range(max_rounds):
        if len(kept) >= want_groups:
            break
        groups = sample_groups(round_index, want_groups - len(kept), prompts)
        report["rounds"] += 1
        report["sampled_groups"] += len(groups)
        signal_less = []
        for group in groups:
            kind = classify_group(group)
            if kind != "informative":
                signal_less.append(group)
                report["dropped"] += 1
                report[f"dropped_{kind}"] += 1
                continue
            report["informative"] += 1
            if len(kept) < want_groups:
                kept.append(group)
            else:
                surplus.append(group)
        # Adversarial variant: re-ask this round's signal-less prompts, changed, in the next round
        # (only if there is a next round and the batch is not full yet).
        prompts = []
        if transform is not None and len(kept) < want_groups and round_index + 1 < max_rounds:
            for index, how in adversarial_requests(signal_less):
                new_prompt = transform(signal_less[index], how)
                if new_prompt is not None:
                    prompts.append(new_prompt)
            report["adversarial_prompts"] += len(prompts)

    next_carry = surplus if keep_surplus else []
    report["surplus_carried"] = len(next_carry)
    report["surplus_dropped"] += len(surplus) - len(next_carry)
    report["kept"] = len(kept)
    report["missing"] = max(0, want_groups - len(kept))
    report["carry"] = next_carry
    return kept, report


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
    "algo", "adv_estimator", "loss_agg", "eps_low", "eps_high", "clip_c", "entropy_coef",
    # reward
    "correct_reward", "wrong_reward", "overlong_filter", "overlong_penalty", "overlong_cache",
    "ppl_penalty", "ppl_threshold", "ppl_window", "efficiency_weight",
    # sampling
    "dynamic_sampling", "max_refills", "keep_surplus", "adversarial", "adaptive_budget",
    "temperature", "top_p",
    # regularisation toward the reference
    "kl", "kl_coef", "gkl_alpha", "gkl_beta", "gkl_gamma", "gkl_temperature", "gkl_weight_temperature",
    # DPO
    "dpo_beta",
    # optimisation
    "lr", "warmup_steps", "weight_decay", "grad_clip",
}

# DAPO's run (paper §4.1): AdamW, lr 1e-6 constant after a 20-step warm-up, weight decay 0.1, grad
# clip 1.0, eps 0.2 / 0.28, dual-clip c = 10, token-level loss, dynamic sampling, soft overlong
# punishment with a 4,096-token cache (on a 20,480 budget: scale the cache to your budget), no KL,
# no entropy bonus, +1/-1 rule reward (eq. 7), sampling at temperature 1.0.
_DAPO = {
    "algo": "pg", "adv_estimator": "grpo", "loss_agg": "token-mean",
    "eps_low": 0.2, "eps_high": 0.28, "clip_c": 10.0, "entropy_coef": 0.0,
    "correct_reward": 1.0, "wrong_reward": -1.0,
    "overlong_filter": False, "overlong_penalty": True, "overlong_cache": 4096,
    "ppl_penalty": False, "efficiency_weight": 0.0,
    "dynamic_sampling": True, "max_refills": 10, "keep_surplus": False,
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
    "ppl_penalty": False, "efficiency_weight": 0.0, "entropy_coef": 0.0,
}

# DAPO Table 1, replayable on any model and task: each step adds one component to the one before.
# KL is off throughout (DAPO §2.3 removes it). The training hyper-parameters are left to train.py
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
    "ppl_penalty": False, "efficiency_weight": 0.0,
    "dynamic_sampling": False, "adversarial": False, "adaptive_budget": False,
    "kl": "none", "kl_coef": 0.0,
}
LADDER = [  # (preset name, the flags this rung changes relative to the previous rung)
    ("ladder-0-naive-grpo", {}),
    ("ladder-1-overlong-filtering", {"overlong_filter": True}),
    ("ladder-2-clip-higher", {"eps_high": 0.28}),
    ("ladder-3-soft-overlong", {"overlong_filter": False, "overlong_penalty": True, "overlong_cache": 4096}),
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
    "reinforce_baseline": {**_BASELINE, "adv_estimator": "reinforce_baseline"},
    # DPO on correct-vs-incorrect pairs of the same prompt (dpo_pairs), against a frozen reference.
    "dpo": {"algo": "dpo", "dpo_beta": 0.1, "correct_reward": 1.0, "wrong_reward": -1.0,
            "dynamic_sampling": False, "overlong_filter": False, "overlong_penalty": False,
            "kl": "none", "kl_coef": 0.0, "lr": 1e-6, "temperature": 1.0, "top_p": 1.0},
    **_ladder(),
    # The proposed changes, each on top of DAPO. Coefficients are starting points, not tuned.
    "dapo-gkl": {**_DAPO, "kl": "gkl", "kl_coef": 0.01, "gkl_alpha": 1.0, "gkl_beta": 1.0,
                 "gkl_gamma": 1.0, "gkl_temperature": 1.0, "gkl_weight_temperature": 1.0},
    "dapo-adversarial": {**_DAPO, "adversarial": True},
    # Soft perplexity penalty beside the overlong one (DAPO eq. 13 in shape; rewards.py's
    # perplexity_penalty computes it). Units are the completion's mean per-token NLL in nats (log
    # perplexity): 0 up to perplexity 4, falling linearly to -1 at log 4 + log 4 (perplexity 16).
    "dapo-ppl": {**_DAPO, "ppl_penalty": True, "ppl_threshold": math.log(4.0),
                 "ppl_window": math.log(4.0)},
    "dapo-adaptive-budget": {**_DAPO, "adaptive_budget": True},
    "dapo-balanced": {**_DAPO, "efficiency_weight": 0.1},
}
