"""Tests for dapo.py: advantage vectors, group filtering, dynamic sampling (bounded, reported,
surplus carry, adversarial path), adaptive budget, efficiency bonus, DPO pairs, presets."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dapo  # noqa: E402
from dapo import (LADDER, PRESET_KEYS, PRESETS, adaptive_num_samples, adversarial_requests,  # noqa: E402
                  classify_group, dpo_pairs, dynamic_sample, efficiency_bonus, group_advantages,
                  keep_groups, step_dpo_pairs, update_accuracy)
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


def test_rloo_is_reward_minus_mean_of_the_others():
    torch.manual_seed(0)
    r = torch.randn(12, dtype=F64)
    adv = group_advantages(r, 4, "rloo")
    for i in range(12):
        g = i // 4
        others = [r[j] for j in range(4 * g, 4 * g + 4) if j != i]
        assert adv[i].item() == pytest.approx((r[i] - sum(others) / 3).item())


def test_reinforce_baseline_is_group_centred_then_whitened():
    torch.manual_seed(1)
    r = torch.randn(16, dtype=F64)
    adv = group_advantages(r, 4, "reinforce_baseline", eps=0.0)
    centred = r - r.view(4, 4).mean(1).repeat_interleave(4)
    expected = (centred - centred.mean()) / centred.std()
    torch.testing.assert_close(adv, expected)
    assert adv.mean().abs().item() < 1e-12 and adv.std().item() == pytest.approx(1.0)


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
    for kind in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        assert group_advantages(r, 3, kind).abs().max().item() == 0.0


# ---------------------------------------------------------------------------------------------
# Group filtering and dynamic sampling
# ---------------------------------------------------------------------------------------------

def test_keep_groups():
    r = torch.tensor([1.0, 1, 1, 1, -1, 1, -1, -1, -1])
    assert keep_groups(r, 3).tolist() == [False, True, False]
    assert keep_groups([0.0, 1.0, 1.0, 0.5, 0.5], [2, 1, 2]).tolist() == [True, False, False]


def test_classify_group():
    assert classify_group({"rewards": [1.0, 1.0]}) == "all_correct"
    assert classify_group({"rewards": [-1.0, -1.0]}) == "all_wrong"
    assert classify_group({"rewards": [0.0, 0.0]}) == "all_wrong"               # 1/0 accuracy reward
    assert classify_group({"rewards": [1.0, -1.0]}) == "informative"
    # with "correct", eq. 11 is on correctness: overlong penalties alone carry no signal
    assert classify_group({"rewards": [-1.0, -1.4], "correct": [False, False]}) == "all_wrong"
    assert adversarial_requests([{"rewards": [1, 1]}, {"rewards": [1, -1]}, {"rewards": [-1, -1]}]) == \
        [(0, "harder"), (2, "hint")]


def _group(rewards, prompt="p"):
    return {"rewards": list(rewards), "prompt": prompt}


def test_dynamic_sampling_never_hangs_on_signal_less_groups():
    calls = []

    def sampler(round_index, num_missing, prompts):
        calls.append((round_index, num_missing, list(prompts)))
        return [_group([1, 1, 1, 1]), _group([-1, -1, -1, -1]), _group([1, 1, 1, 1])]

    kept, report = dynamic_sample(sampler, want_groups=4, max_rounds=5)
    assert kept == [] and len(calls) == 5
    assert report["rounds"] == 5 and report["missing"] == 4 and report["kept"] == 0
    assert report["sampled_groups"] == 15 and report["dropped"] == 15
    assert report["dropped_all_correct"] == 10 and report["dropped_all_wrong"] == 5
    assert [c[1] for c in calls] == [4] * 5
    # no budget at all, a sampler returning nothing: still a report
    assert dynamic_sample(sampler, 3, 0)[1]["missing"] == 3
    _, report = dynamic_sample(lambda *args: [], 3, 4)
    assert report["rounds"] == 4 and report["missing"] == 3


def _mixed_sampler(log):
    """Each round: 4 groups, 2 of them informative, each tagged with its round."""
    def sampler(round_index, num_missing, prompts):
        log.append(num_missing)
        return [_group([1, -1], f"r{round_index}a"), _group([1, 1]), _group([-1, 1], f"r{round_index}b"),
                _group([-1, -1])]
    return sampler


def test_dynamic_sampling_fills_exactly_and_drops_surplus():
    log = []
    kept, report = dynamic_sample(_mixed_sampler(log), want_groups=5, max_rounds=10)
    assert [g["prompt"] for g in kept] == ["r0a", "r0b", "r1a", "r1b", "r2a"]
    assert log == [5, 3, 1]
    assert report["rounds"] == 3 and report["kept"] == 5 and report["missing"] == 0
    assert report["informative"] == 6 and report["surplus_dropped"] == 1 and report["surplus_carried"] == 0
    assert report["carry"] == [] and report["carried_in"] == 0
    assert report["dropped_all_correct"] == 3 and report["dropped_all_wrong"] == 3


def test_dynamic_sampling_keep_surplus_carries_to_next_step():
    kept, report = dynamic_sample(_mixed_sampler([]), 5, 10, keep_surplus=True)
    assert report["surplus_carried"] == 1 and report["surplus_dropped"] == 0
    assert [g["prompt"] for g in report["carry"]] == ["r2b"]
    kept2, report2 = dynamic_sample(_mixed_sampler([]), 5, 10, carry=report["carry"], keep_surplus=True)
    assert [g["prompt"] for g in kept2][:2] == ["r2b", "r0a"]      # carried-in groups first
    assert report2["carried_in"] == 1 and len(kept2) == 5 and report2["surplus_carried"] == 0
    # more carried in than wanted: no sampling, the extra (two steps stale) is dropped
    many = [_group([1, -1], f"c{i}") for i in range(4)]
    kept3, report3 = dynamic_sample(_mixed_sampler([]), 3, 10, carry=many, keep_surplus=True)
    assert report3["rounds"] == 0 and len(kept3) == 3 and report3["surplus_dropped"] == 1


def test_adversarial_transform_re_asks_signal_less_prompts():
    seen_prompts = []

    def sampler(round_index, num_missing, prompts):
        seen_prompts.append(list(prompts))
        if round_index == 0:
            return [_group([1, 1, 1], "easy"), _group([-1, -1, -1], "hopeless"), _group([1, -1, 1], "ok")]
        # the transformed prompts come back informative
        return [_group([1, -1, -1], p) for p in prompts]

    def transform(group, how):
        return f"{group['prompt']}+{how}"

    kept, report = dynamic_sample(sampler, want_groups=3, max_rounds=3, transform=transform)
    assert seen_prompts == [[], ["easy+harder", "hopeless+hint"]]
    assert [g["prompt"] for g in kept] == ["ok", "easy+harder", "hopeless+hint"]
    assert report["adversarial_prompts"] == 2 and report["rounds"] == 2 and report["missing"] == 0
    # a transform may decline (None); without transform nothing is injected
    seen_prompts.clear()
    dynamic_sample(sampler, 3, 2, transform=lambda g, how: None if how == "hint" else g["prompt"] + "!")
    assert seen_prompts == [[], ["easy!"]]
    seen_prompts.clear()
    dynamic_sample(sampler, 3, 2)
    assert seen_prompts == [[], []]


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
        assert preset.get("adv_estimator", "grpo") in dapo.ADVANTAGE_KINDS
        assert preset.get("loss_agg", "token-mean") in AGGREGATIONS
        assert preset.get("kl", "none") in ("none", "k1", "k2", "k3", "gkl")
        assert preset.get("algo", "pg") in ("pg", "dpo")
        assert preset.get("clip_c") is None or preset["clip_c"] > 1


def test_dapo_preset_is_the_paper():
    p = PRESETS["dapo"]
    assert (p["eps_low"], p["eps_high"], p["clip_c"], p["loss_agg"]) == (0.2, 0.28, 10.0, "token-mean")
    assert p["dynamic_sampling"] and p["overlong_penalty"] and not p["overlong_filter"]
    assert (p["overlong_cache"], p["kl"], p["correct_reward"], p["wrong_reward"]) == (4096, "none", 1.0, -1.0)
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
