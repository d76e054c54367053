"""Tests for dapo.py: advantage vectors, group filtering and adversarial requests, adaptive budget,
efficiency bonus, DPO pairs, presets. (The dynamic-sampling loop itself: tests/test_train.py.)"""

import math
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dapo  # noqa: E402
from dapo import (LADDER, PRESET_KEYS, PRESETS, adaptive_num_samples, adversarial_requests,  # noqa: E402
                  dpo_pairs, efficiency_bonus, group_advantages, keep_groups,
                  reinforce_baseline_advantages, step_dpo_pairs, update_accuracy)
from losses import AGGREGATIONS  # noqa: E402

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------

def test_advantage_vectors():
    r = torch.tensor([1.0, -1.0, -1.0, -1.0])
    torch.testing.assert_close(group_advantages(r, 4, "grpo"), torch.tensor([1.5, -0.5, -0.5, -0.5]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(group_advantages(r, 4, "rloo"), torch.tensor([2.0, -2 / 3, -2 / 3, -2 / 3]))
    torch.testing.assert_close(group_advantages(r, 4, "dr_grpo"), torch.tensor([1.5, -0.5, -0.5, -0.5]))
    with pytest.raises(ValueError):
        group_advantages(r, 4, "ppo")
    with pytest.raises(ValueError):
        group_advantages(r, 3, "grpo")



def test_reinforce_pp_an_empty_reply_has_no_returns_at_any_gamma():
    """A batch of an empty reply and one of kl [0.1, 0.2], beta 1, reward 1, gamma 0.9 by hand:
    step rewards [-0.1, 0.8], G = [-0.1 + 0.9 x 0.8, 0.8] = [0.62, 0.8]; the empty reply gets no
    returns (gamma 1 already did). Whitened over the two tokens: mean 0.71, unbiased variance
    2 x 0.09^2 = 0.0162, so -+0.09 / sqrt(0.0162) = -+1 / sqrt(2)."""
    from dapo import kl_penalised_returns, reinforce_pp_advantages
    for gamma in (0.9, 1.0):
        assert kl_penalised_returns(1.0, [], 1.0, gamma=gamma).tolist() == []
    assert kl_penalised_returns(1.0, [0.1, 0.2], 1.0, gamma=0.9).tolist() == pytest.approx([0.62, 0.8])
    adv = reinforce_pp_advantages([0.5, 1.0], [[], [0.1, 0.2]], [True, True], beta=1.0, gamma=0.9)
    assert adv[0] == [] and adv[1] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-4)


def test_reinforce_whitening_is_verls_masked_whiten():
    """verl_F.masked_whiten: (x - mean) * rsqrt(var + 1e-8), var unbiased. A tiny variance tells it
    from (x - mean) / (std + 1e-6): returns [0, 1e-4] have mean 5e-5 and var 2 x (5e-5)^2 = 5e-9,
    so -+5e-5 / sqrt(1.5e-8) = -+1 / sqrt(6) = -+0.408 (std + 1e-6 gives 0.697, a biased var 0.845).
    REINFORCE++-baseline, rewards [0, 2e-4] in one group of 1-token replies: centred -+1e-4, var
    2e-8, so -+1e-4 / sqrt(3e-8) = -+1 / sqrt(3) (std + 1e-6: 0.702)."""
    from dapo import reinforce_pp_advantages
    sixth, third = 1 / math.sqrt(6), 1 / math.sqrt(3)
    assert dapo.whiten([0.0, 1e-4], center=True).tolist() == pytest.approx([-sixth, sixth], rel=1e-9)
    adv = reinforce_pp_advantages([0.0, 1e-4], [[0.0], [0.0]], [True, True], beta=1.0)
    assert adv == [pytest.approx([-sixth], rel=1e-9), pytest.approx([sixth], rel=1e-9)]
    adv = reinforce_baseline_advantages([0.0, 2e-4], 2, [1, 1])
    assert adv.tolist() == pytest.approx([-third, third], rel=1e-9)

def test_rloo_is_reward_minus_mean_of_the_others():
    torch.manual_seed(0)
    r = torch.randn(12, dtype=F64)
    adv = group_advantages(r, 4, "rloo")
    for i in range(12):
        g = i // 4
        others = [r[j] for j in range(4 * g, 4 * g + 4) if j != i]
        assert adv[i].item() == pytest.approx((r[i] - sum(others) / 3).item())


def test_reinforce_baseline_whitens_over_tokens_as_its_reference_code():
    """The issue's case, by hand: rewards [0, 1, 0 | 1, 0, 0], replies of 9, 1, 4, 4, 1, 1
    tokens. Centred: -1/3 and 2/3; over the 20 tokens mu = -1/12, so c - mu is -1/4 and 3/4, and
    sigma^2 = (15 x 1/16 + 5 x 9/16) / 19: -0.5627 and 1.6882 (OpenRLHF's and verl's figures)."""
    adv = reinforce_baseline_advantages([0.0, 1.0, 0.0, 1.0, 0.0, 0.0], 3, [9, 1, 4, 4, 1, 1], eps=0.0)
    sigma = math.sqrt((15 / 16 + 5 * 9 / 16) / 19)
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.75, -0.25, 0.75, -0.25, -0.25],
                                                 dtype=F64) / sigma)
    assert adv[0].item() == pytest.approx(-0.5627, abs=1e-4) and adv[1].item() == pytest.approx(1.6882, abs=1e-4)
    # Weighted by tokens: the mean over samples is not 0, the mean over tokens is.
    tokens = torch.tensor([9, 1, 4, 4, 1, 1], dtype=F64)
    assert abs(adv.mean().item()) > 0.1 and abs((adv * tokens).sum().item()) < 1e-9


def test_reinforce_baseline_group_of_one_keeps_its_raw_score():
    """Groups [1.0] and [0.5, -0.5] with 2, 1 and 1 tokens: centred 1.0 (alone: no group mean),
    0.5, -0.5; over the 4 tokens mu = 0.5 and sigma^2 = (2 x 0.25 + 0 + 1) / 3 = 0.5. A row of no
    loss tokens (length 0) is left out of mu and sigma but still gets its advantage."""
    adv = reinforce_baseline_advantages([1.0, 0.5, -0.5, 3.0], [1, 2, 1], [2, 1, 1, 0], eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, 0.0, -1.0, 2.5], dtype=F64) / math.sqrt(0.5))


def test_variable_group_sizes_match_group_by_group():
    torch.manual_seed(2)
    sizes = [3, 5, 2, 1, 4]
    r = torch.randn(sum(sizes), dtype=F64)
    for kind in ("grpo", "dr_grpo", "rloo"):
        got = group_advantages(r, sizes, kind)
        parts = [group_advantages(part, len(part), kind) for part in torch.split(r, sizes)]
        torch.testing.assert_close(got, torch.cat(parts))
    # a group of one has no baseline
    assert group_advantages(r, sizes, "grpo")[10].item() == 0.0
    assert group_advantages(r, sizes, "rloo")[10].item() == 0.0
    with pytest.raises(ValueError):
        group_advantages(r, [3, 5], "grpo")


def test_all_equal_group_has_zero_advantage():
    r = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    for kind in ("grpo", "dr_grpo", "rloo"):
        assert group_advantages(r, 3, kind).abs().max().item() == 0.0
    # Shaped rewards of one value that float32 cannot hold exactly (0.1): the mean rounds, and
    # (r - mean) / (std + eps) used to turn the rounding into advantages of ~1e-2 noise.
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, -0.3, 0.1], dtype=torch.float32)
    for kind in ("grpo", "dr_grpo", "rloo"):
        adv = group_advantages(r, 3, kind)
        assert adv.dtype == torch.float32 and adv[:3].tolist() == [0.0, 0.0, 0.0], kind
        assert adv[3:].abs().min().item() > 0


def test_whitening_is_the_same_over_ranks_as_in_one_process():
    """REINFORCE++-baseline under DDP: each rank whitens its rows with the token moments summed
    over ranks, and gets what one process gets on the whole batch (unbiased std in both)."""
    torch.manual_seed(3)
    r, lengths = torch.randn(16, dtype=F64), torch.randint(0, 30, (16,))
    whole = reinforce_baseline_advantages(r, 4, lengths)
    halves = [(r[:8], lengths[:8]), (r[8:], lengths[8:])]

    def token_moments(rewards, lengths):  # count, sum, sum of squares over a half's tokens
        centred, tokens = group_advantages(rewards, 4, "dr_grpo"), lengths.to(F64)
        return torch.stack([tokens.sum(), (tokens * centred).sum(), (tokens * centred ** 2).sum()])
    parts = []
    for rank, (mine, mine_lengths) in enumerate(halves):
        other = token_moments(*halves[1 - rank])  # what all_reduce adds: the other rank's
        parts.append(reinforce_baseline_advantages(mine, 4, mine_lengths, reduce=lambda m: m + other))
    torch.testing.assert_close(torch.cat(parts), whole)


# ---------------------------------------------------------------------------------------------
# Group filtering (eq. 11) and adversarial requests
# ---------------------------------------------------------------------------------------------

def test_keep_groups():
    r = torch.tensor([1.0, 1, 1, 1, -1, 1, -1, -1, -1])
    assert keep_groups(r, 3).tolist() == [False, True, False]
    assert keep_groups([0.0, 1.0, 1.0, 0.5, 0.5], [2, 1, 2]).tolist() == [True, False, False]


def test_keep_groups_on_correctness_and_adversarial_requests():
    # eq. 11 filters on correctness: an all-wrong group whose rewards differ only through a
    # shaping term (overlong, perplexity) carries no signal
    assert keep_groups([False, False, True, False, True, True], 2).tolist() == [False, True, False]
    assert keep_groups([True, True, False, False, True, False], [2, 2, 2]).tolist() == [False, False, True]
    assert adversarial_requests([True, True, True, False, False, False], [2, 2, 2]) == \
        [(0, "harder"), (2, "hint")]
    assert adversarial_requests([1, 1, 0, 1, 0, 0], 2) == [(0, "harder"), (2, "hint")]
    assert adversarial_requests([], []) == []


# ---------------------------------------------------------------------------------------------
# Adaptive budget, efficiency bonus
# ---------------------------------------------------------------------------------------------

def test_adaptive_budget_sums_to_total_within_bounds():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 40)
        low = rng.randint(1, 6)
        high = rng.randint(low, 24)
        total = rng.randint(n * low, n * high)
        accuracies = [rng.choice([None, 0.0, 1.0, rng.random()]) for _ in range(n)]
        counts = adaptive_num_samples(accuracies, total, low, high)
        assert sum(counts) == total and len(counts) == n
        assert all(low <= c <= high for c in counts)


def test_adaptive_budget_favours_uncertain_prompts():
    counts = adaptive_num_samples([0.5, 0.95, 0.0, None, 1.0], total=40, min_samples=2, max_samples=16)
    assert counts == [15, 6, 3, 14, 2]                    # sqrt(p(1-p)) weights, floor 0.1
    # unknown counts as 0.5; easy and hopeless share the floor (equal up to integer rounding)
    counts = adaptive_num_samples([0.5, 0.95, 0.0, None, 1.0], total=41, min_samples=2, max_samples=16)
    assert counts[0] == counts[3] > counts[1] > counts[2] >= counts[4] >= counts[2] - 1
    assert adaptive_num_samples([0.1] * 4, 32, 2, 16) == [8, 8, 8, 8]
    with pytest.raises(ValueError):
        adaptive_num_samples([0.5, 0.5], 40, 2, 16)


def test_accuracy_tracker():
    tracker = {}
    assert tracker.get("q1") is None
    assert update_accuracy(tracker, "q1", 1.0) == 1.0
    assert update_accuracy(tracker, "q1", 0.0, decay=0.75) == 0.75


def test_efficiency_bonus():
    correct = torch.tensor([1, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    lengths = torch.tensor([10, 30, 1, 500, 5, 7, 20, 3])
    bonus = efficiency_bonus(correct, lengths, 4, weight=0.2)
    # group 0: correct mean 20 -> +0.1 / -0.1; group 1: one correct -> 0; wrong answers 0 (even short)
    torch.testing.assert_close(bonus, torch.tensor([0.1, -0.1, 0, 0, 0, 0, 0, 0]))
    torch.manual_seed(3)
    for _ in range(50):
        c = torch.rand(24) < 0.5
        lens = torch.randint(1, 1000, (24,))
        b = efficiency_bonus(c, lens, [6, 6, 4, 8], weight=0.3)
        assert (b[~c] == 0).all()
        assert (b.abs() <= 0.3 + 1e-7).all()
    # clipped at -weight for very long correct answers
    assert efficiency_bonus([1, 1, 1], [1, 1, 1000], 3, 0.5)[2].item() == pytest.approx(-0.5)


# ---------------------------------------------------------------------------------------------
# DPO pairs
# ---------------------------------------------------------------------------------------------

def test_dpo_pairs():
    r = [1, -1, -1, 1, -1, -1, -1, -1, 1, 1, -1, -1]
    assert dpo_pairs(r, 4) == [(0, 2), (8, 11)]
    assert dpo_pairs(r, 4, max_pairs_per_group=2) == [(0, 2), (3, 1), (8, 11), (9, 10)]
    assert dpo_pairs([1, 1, -1], [2, 1]) == []


def test_step_dpo_pairs():
    sep = 0
    tokens = [[5, 6, 0, 7, 8, 0, 9],          # group 0, correct
              [5, 6, 0, 7, 3, 4, 0, 2],       # group 0, wrong: shares step 1, parts ways at step 2
              [5, 6, 0, 7, 8, 0],             # group 1, correct
              [5, 6, 0]]                      # group 1, wrong, a step-prefix of the correct one
    pairs = step_dpo_pairs(tokens, [1, -1, 1, -1], 2, [sep])
    assert pairs == [{"chosen": 0, "rejected": 1, "prefix_len": 3, "chosen_end": 6, "rejected_end": 7}]
    # the diverging step: tokens [3, 6) of the chosen, [3, 7) of the rejected
    assert tokens[0][3:6] == [7, 8, 0] and tokens[1][3:7] == [7, 3, 4, 0]
    # different from the first token: nothing shared
    assert step_dpo_pairs([[1, 0], [2, 0]], [1, -1], 2, {0}) == \
        [{"chosen": 0, "rejected": 1, "prefix_len": 0, "chosen_end": 2, "rejected_end": 2}]


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

def test_presets_use_known_keys_and_values():
    required = {"dapo", "grpo", "dr_grpo", "rloo", "reinforce_baseline", "dpo", "dapo-gkl",
                "dapo-adversarial", "dapo-ppl"} | {name for name, _ in LADDER}
    assert required <= set(PRESETS)
    for name, preset in PRESETS.items():
        assert set(preset) <= PRESET_KEYS, (name, set(preset) - PRESET_KEYS)
        assert preset.get("adv_estimator", "grpo") in dapo.ADVANTAGE_ESTIMATORS
        assert preset.get("loss_agg", "token-mean") in AGGREGATIONS
        assert preset.get("kl", "none") in ("none", "k1", "k2", "k3", "gkl")
        assert preset.get("algo", "pg") in ("pg", "dpo", "sft")
        assert preset.get("clip_c") is None or preset["clip_c"] > 1


def test_dapo_preset_is_the_paper():
    p = PRESETS["dapo"]
    assert (p["eps_low"], p["eps_high"], p["clip_c"], p["loss_agg"]) == (0.2, 0.28, 10.0, "token-mean")
    assert p["dynamic_sampling"] and p["overlong_penalty"] and not p["overlong_filter"]
    assert (p["overlong_cache"], p["kl"], p["correct_reward"], p["wrong_reward"]) == (0.2, "none", 1.0, -1.0)
    assert p["mini_batches"] == 16  # 512 prompts x 16 samples in mini-batches of 512: 16 updates
    assert (p["lr"], p["warmup_steps"], p["weight_decay"], p["grad_clip"]) == (1e-6, 20, 0.1, 1.0)
    assert (p["temperature"], p["top_p"]) == (1.0, 1.0)
    g = PRESETS["grpo"]
    assert (g["eps_low"], g["eps_high"], g["loss_agg"], g["kl"], g["kl_coef"]) == (0.2, 0.2, "seq-mean-token-mean", "k3", 0.04)
    assert not g["dynamic_sampling"]


def _diff(a, b):
    return {k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>")}


def test_ladder_adds_one_component_per_step():
    names = [name for name, _ in LADDER]
    assert names == ["ladder-0-naive-grpo", "ladder-1-overlong-filtering", "ladder-2-clip-higher",
                     "ladder-3-soft-overlong", "ladder-4-token-level-loss", "ladder-5-dynamic-sampling"]
    expected_changes = [{"overlong_filter"}, {"eps_high"},
                        {"overlong_filter", "overlong_penalty", "overlong_cache"}, {"loss_agg"},
                        {"dynamic_sampling", "max_refills", "keep_surplus"}]
    for (prev, _), (name, change), expected in zip(LADDER, LADDER[1:], expected_changes):
        assert _diff(PRESETS[prev], PRESETS[name]) == expected == set(change), name
    assert PRESETS["ladder-0-naive-grpo"]["loss_agg"] == "seq-mean-token-mean"
    assert PRESETS["ladder-0-naive-grpo"]["eps_high"] == 0.2
    # the top rung is DAPO apart from dual-clip and the training hyper-parameters
    assert _diff(PRESETS["ladder-5-dynamic-sampling"], PRESETS["dapo"]) == \
        {"clip_c", "lr", "warmup_steps", "weight_decay", "grad_clip", "temperature", "top_p"}


def test_variant_presets_switch_their_flag_on_top_of_dapo():
    variants = {"dapo-gkl": "kl", "dapo-adversarial": "adversarial", "dapo-ppl": "ppl_penalty",
                "dapo-adaptive-budget": "adaptive_budget", "dapo-balanced": "efficiency_weight"}
    for name, flag in variants.items():
        assert PRESETS[name][flag] not in (False, 0.0, "none"), name
        assert flag in _diff(PRESETS["dapo"], PRESETS[name])
        assert {k: v for k, v in PRESETS[name].items() if k in PRESETS["dapo"] and k not in
                _diff(PRESETS["dapo"], PRESETS[name])} == {k: v for k, v in PRESETS["dapo"].items()
                                                          if k not in _diff(PRESETS["dapo"], PRESETS[name])}
    assert PRESETS["dapo-gkl"]["kl"] == "gkl" and PRESETS["dpo"]["algo"] == "dpo"


def test_reinforce_pp_returns_and_normalisation_vectors():
    # KL 0.1, -0.2, 0.3: sums to the end 0.2, 0.1, 0.3; beta 0.5 -> 1 - 0.1, 1 - 0.05, 1 - 0.15
    returns = dapo.kl_penalised_returns(1.0, [0.1, -0.2, 0.3], 0.5)
    assert returns.tolist() == pytest.approx([0.9, 0.95, 0.85], abs=1e-12)
    # 1, 2, 3: mean 2, unbiased std 1
    assert dapo.whiten([1.0, 2.0, 3.0], center=True, eps=0.0).tolist() == [-1.0, 0.0, 1.0]
    assert dapo.whiten([1.0, 2.0, 3.0], eps=0.0).tolist() == [1.0, 2.0, 3.0]  # no centring
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]  # two ranks' moments add up
    total = dapo.moments(parts[0]) + dapo.moments(parts[1])
    assert dapo.whiten(parts[1], total, center=True, eps=0.0).tolist() == [1.0]


def test_passk_gives_the_best_reply_its_margin_over_the_runner_up():
    """grpo_passk by hand: group [0, 1, 0.5] -> the best (index 1) gets (1 - 0.5) / std, std the
    unbiased 0.5; a tie for the best gives 0; a group of one, 0."""
    from dapo import passk_advantages
    adv = passk_advantages([0.0, 1.0, 0.5, 1.0, 1.0, 0.0, 2.0], [3, 3, 1], eps=0.0)
    assert adv.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_opo_subtracts_the_length_weighted_group_mean():
    """opo by hand: rewards [1, 0 | 1, 0] with lengths [3, 1 | 0, 0]: baseline (3*1 + 1*0) / 4 =
    0.75 -> [0.25, -0.75]; a group whose replies reach no loss keeps its rewards; a group of one
    keeps its raw reward."""
    from dapo import opo_advantages
    adv = opo_advantages([1.0, 0.0, 1.0, 0.0, -1.0], [2, 2, 1], [3, 1, 0, 0, 5])
    assert adv.tolist() == pytest.approx([0.25, -0.75, 1.0, 0.0, -1.0])


def test_gpg_scales_the_centred_reward_by_the_batch_over_its_non_zero_rewards():
    """gpg by hand: 0/1 rewards [1, 0 | 0, 0 | 1]: alpha = 5 / 2; centred [0.5, -0.5 | 0, 0 | 1
    (a group of one keeps its reward)] -> [1.25, -1.25, 0, 0, 2.5]. Split over two 'ranks' whose
    counts are added, each gives its rows of the whole."""
    from dapo import gpg_advantages
    rewards, sizes = [1.0, 0.0, 0.0, 0.0, 1.0], [2, 2, 1]
    whole = gpg_advantages(rewards, sizes)
    assert whole.tolist() == pytest.approx([1.25, -1.25, 0.0, 0.0, 2.5])
    first = torch.tensor([4.0, 1.0])   # rank 0: rows 0-3, one non-zero; rank 1: row 4, one
    second = torch.tensor([1.0, 1.0])
    mine = gpg_advantages(rewards[:4], [2, 2], reduce=lambda counts: counts + second)
    theirs = gpg_advantages(rewards[4:], [1], reduce=lambda counts: counts + first)
    assert torch.cat([mine, theirs]).tolist() == pytest.approx(whole.tolist())


def test_reinforce_pp_returns_discounted_by_gamma():
    """--gamma by hand: kl [0.1, 0.2, 0.3], beta 1, reward 1 -> step rewards [-0.1, -0.2, 0.7];
    gamma 0.5: G = [-0.1 + 0.5 * 0.15, -0.2 + 0.5 * 0.7, 0.7] = [-0.025, 0.15, 0.7]; gamma 1:
    summed to the end, [0.4, 0.5, 0.7], and a gamma a hair below 1 agrees with it."""
    from dapo import kl_penalised_returns
    kl = [0.1, 0.2, 0.3]
    assert kl_penalised_returns(1.0, kl, 1.0, gamma=0.5).tolist() == pytest.approx([-0.025, 0.15, 0.7])
    assert kl_penalised_returns(1.0, kl, 1.0).tolist() == pytest.approx([0.4, 0.5, 0.7])
    assert kl_penalised_returns(1.0, kl, 1.0, gamma=1 - 1e-12).tolist() == pytest.approx([0.4, 0.5, 0.7])
