"""Tests for losses.py: hand-computed vectors, exactness under micro-batching and 2-rank gloo, GKL
against a direct pairwise implementation and in bounded memory, non-finite inputs."""

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import losses  # noqa: E402
from losses import (AGGREGATIONS, aggregate, dpo_loss, entropy, gkl_loss, kl_estimate,  # noqa: E402
                    micro_batch_divisors, policy_loss)

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# ---------------------------------------------------------------------------------------------
# Hand-computed vectors
# ---------------------------------------------------------------------------------------------

def test_clip_higher_vector():
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.2, 1.5, 5.0]], dtype=F64)
    logp = ratios.log().requires_grad_()
    loss, stats = policy_loss(logp, torch.zeros_like(logp), torch.ones(1, dtype=F64),
                              torch.ones_like(ratios), eps_low=0.2, eps_high=0.28, agg="none")
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -0.9, -1.0, -1.2, -1.28, -1.28]], dtype=F64))
    loss.sum().backward()
    # clipped tokens (r > 1.28 with A > 0) get no gradient; the others get -r
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.9, -1.0, -1.2, 0.0, 0.0]], dtype=F64))
    assert stats["clip_frac_high"].item() == pytest.approx(2 / 6)
    assert stats["clip_frac_low"].item() == 0.0
    assert stats["ratio_max"].item() == pytest.approx(5.0)
    assert stats["ratio_mean"].item() == pytest.approx(sum([0.5, 0.9, 1, 1.2, 1.5, 5]) / 6)
    assert stats["tokens"].item() == 6


def test_dual_clip_caps_negative_advantage_loss():
    ratios = torch.tensor([[0.5, 1.0, 2.0, 5.0, 20.0]], dtype=F64)
    logp = ratios.log().requires_grad_()
    adv = -torch.ones(1, dtype=F64)
    loss, stats = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(ratios),
                              clip_c=3.0, agg="none")
    # A = -1: loss = max(r, clip(r, 0.8, 1.28)) = 0.8, 1, 2, 5, 20; dual-clip caps it at -c A = 3
    torch.testing.assert_close(loss, torch.tensor([[0.8, 1.0, 2.0, 3.0, 3.0]], dtype=F64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0]], dtype=F64))
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert stats["clip_frac_dual"].item() == pytest.approx(2 / 5)
    no_dual, _ = policy_loss(ratios.log(), torch.zeros_like(ratios), adv, torch.ones_like(ratios), agg="none")
    torch.testing.assert_close(no_dual, torch.tensor([[0.8, 1.0, 2.0, 5.0, 20.0]], dtype=F64))
    with pytest.raises(ValueError):
        policy_loss(ratios.log(), torch.zeros_like(ratios), adv, torch.ones_like(ratios), clip_c=1.0)


def test_aggregation_vectors():
    per_token = torch.tensor([[1.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(4 / 3)
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm", max_tokens=4).item() == pytest.approx(1.0)
    # one prompt holding both rows: its token mean; two prompts: the mean of their token means
    assert aggregate(per_token, mask, "group-token-mean", group_ids=torch.tensor([7, 7])).item() == pytest.approx(4 / 3)
    assert aggregate(per_token, mask, "group-token-mean", group_ids=torch.tensor([0, 1])).item() == pytest.approx(1.5)
    torch.testing.assert_close(aggregate(per_token, mask, "none"), per_token)
    # the same through policy_loss: A = -1 and r = 1 make the per-token loss 1 everywhere
    ones = torch.ones(2, 4, dtype=F64)
    loss, _ = policy_loss(torch.zeros_like(ones), torch.zeros_like(ones), -ones * per_token, mask, agg="token-mean")
    assert loss.item() == pytest.approx(4 / 3)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "sequence-mean")
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "group-token-mean")


def test_empty_micro_batch_gives_zero():
    per_token = torch.zeros(0, 5, dtype=F64)
    for agg in AGGREGATIONS:
        out = aggregate(per_token, torch.zeros(0, 5), agg, group_ids=torch.zeros(0, dtype=torch.long))
        assert out.item() == 0.0
    # all-padding rows with the global divisors of a bigger batch: a zero-weight micro-batch
    out = aggregate(torch.ones(2, 3, dtype=F64), torch.zeros(2, 3), "token-mean", num_tokens=10)
    assert out.item() == 0.0


def test_kl_estimator_vectors():
    logp, ref = torch.tensor(math.log(0.5), dtype=F64), torch.tensor(math.log(0.25), dtype=F64)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    x = torch.randn(100, dtype=F64)
    y = torch.randn(100, dtype=F64)
    assert (kl_estimate(x, y, "k3") >= 0).all() and (kl_estimate(x, y, "k2") >= 0).all()
    for kind in ("k1", "k2", "k3"):
        assert kl_estimate(x, x, kind).abs().max().item() == 0.0
    with pytest.raises(ValueError):
        kl_estimate(x, y, "k4")


def test_dpo_vector():
    t = lambda v: torch.tensor([v], dtype=F64)  # noqa: E731
    loss, stats = dpo_loss(t(-10.0), t(-12.0), t(-11.0), t(-11.0), beta=0.1)
    assert loss.item() == pytest.approx(0.598139, abs=1e-6)
    assert stats["reward_margin"].item() == pytest.approx(0.2)
    assert stats["chosen_reward"].item() == pytest.approx(0.1)
    assert stats["rejected_reward"].item() == pytest.approx(-0.1)
    assert stats["accuracy"].item() == 1.0
    # a global divisor splits the mean over pairs exactly
    pi_c, pi_r, ref_c, ref_r = (torch.randn(5, dtype=F64) for _ in range(4))
    whole, _ = dpo_loss(pi_c, pi_r, ref_c, ref_r, 0.3)
    parts = sum(dpo_loss(pi_c[s], pi_r[s], ref_c[s], ref_r[s], 0.3, num_pairs=5)[0]
                for s in (slice(0, 2), slice(2, 5)))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


O_POLICY = [1.0, -0.5, 0.3, 2.0, -1.2]
O_REF = [0.2, 0.8, -1.0, 2.5, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("settings, expected", [
    (dict(alpha=1.0, beta=1.0, gamma=1.0, temperature=1.0, weight_temperature=1.0), (0.1520041, 0.1953647, 0.3473687)),
    (dict(alpha=1.0, beta=8.0, gamma=0.5, temperature=4.0, weight_temperature=4.0), (0.5071708, 0.0294303, 4.0867967)),
])
def test_gkl_vectors(settings, expected, dtype):
    logits = torch.tensor(O_POLICY, dtype=dtype).view(1, 1, 5)
    ref = torch.tensor(O_REF, dtype=dtype).view(1, 1, 5)
    loss, stats = gkl_loss(logits, ref, torch.ones(1, 1), **settings)
    wmse, kl, gkl = expected
    assert stats["wmse"].item() == pytest.approx(wmse, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(gkl, abs=1e-6)
    assert stats["gkl"].item() == pytest.approx(gkl, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# GKL: against the direct pairwise form, zero at equality, memory
# ---------------------------------------------------------------------------------------------

def _pairwise_gkl(logits, ref, mask, alpha, beta, gamma, temperature, weight_temperature):
    """The O(V^2) definition, by autograd: 1/4 sum_jk p~_j p~_k (d_j - d_k)^2 + KL, token mean."""
    ref = ref.detach()
    w = torch.softmax(ref / weight_temperature, -1) ** gamma               # (B, T, V)
    p = w / w.sum(-1, keepdim=True)
    d = ref - logits                                                       # (B, T, V)
    pair_diff = d[..., :, None] - d[..., None, :]                          # (B, T, V, V)
    wmse = 0.25 * (p[..., :, None] * p[..., None, :] * pair_diff ** 2).sum((-1, -2))
    s_ref = torch.softmax(ref / temperature, -1)
    kl = (s_ref * (torch.log_softmax(ref / temperature, -1) - torch.log_softmax(logits / temperature, -1))).sum(-1)
    term = alpha * kl + beta * wmse                                        # (B, T)
    return (term * mask).sum() / mask.sum()


@pytest.mark.parametrize("settings", [
    dict(alpha=1.0, beta=1.0, gamma=1.0, temperature=1.0, weight_temperature=1.0),
    dict(alpha=0.7, beta=3.0, gamma=0.5, temperature=2.0, weight_temperature=1.5),
    dict(alpha=0.0, beta=1.0, gamma=0.0, temperature=1.0, weight_temperature=1.0),
])
def test_gkl_equals_pairwise_value_and_gradient(settings):
    torch.manual_seed(0)
    logits = (2 * torch.randn(3, 4, 7, dtype=F64)).requires_grad_()
    ref = 2 * torch.randn(3, 4, 7, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    expected = _pairwise_gkl(logits, ref, mask, **settings)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    for chunk_size in (None, 1, 5):
        got, _ = gkl_loss(logits, ref, mask, chunk_size=chunk_size, **settings)
        (grad,) = torch.autograd.grad(got, logits)
        assert abs(got.item() - expected.item()) <= 1e-6
        assert (grad - expected_grad).abs().max().item() <= 1e-6


def test_gkl_zero_at_equality_positive_otherwise_ref_gets_no_gradient():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 11, dtype=F64, requires_grad=True)
    ref = logits.detach().clone().requires_grad_()
    loss, _ = gkl_loss(logits, ref, torch.ones(2, 3), beta=2.0, gamma=0.6, temperature=1.3)
    assert abs(loss.item()) < 1e-12
    loss.backward()
    assert logits.grad.abs().max().item() < 1e-12
    assert ref.grad is None                             # the reference side is detached
    shifted = logits.detach() + 5.0                      # same distribution, shifted logits:
    loss, stats = gkl_loss(shifted, ref.detach(), torch.ones(2, 3))
    assert abs(stats["kl"].item()) < 1e-12 and abs(stats["wmse"].item()) < 1e-12  # d - dbar = 0
    other = logits.detach() + 0.1 * torch.randn(2, 3, 11, dtype=F64)
    for settings in (dict(), dict(alpha=0.0), dict(beta=0.0), dict(gamma=0.3, temperature=3.0)):
        assert gkl_loss(other, ref.detach(), torch.ones(2, 3), **settings)[0].item() > 0


def test_gkl_bf16_input_fp32_math():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 50).to(torch.bfloat16).requires_grad_()
    ref = torch.randn(2, 3, 50).to(torch.bfloat16)
    loss, _ = gkl_loss(logits, ref, torch.ones(2, 3))
    expected = _pairwise_gkl(logits.detach().double(), ref.double(), torch.ones(2, 3, dtype=F64),
                             1.0, 1.0, 1.0, 1.0, 1.0)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


_MEMORY_SCRIPT = r"""
import json, re, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from losses import gkl_loss


def resident_mib(field):  # VmHWM: peak resident memory since the last reset; VmRSS: now
    status = open("/proc/self/status").read()
    return int(re.search(field + r":\s+(\d+)", status).group(1)) / 1024


def reset_peak():  # Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current VmRSS
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return resident_mib("VmRSS"), "VmHWM"
    except OSError:  # fall back to ru_maxrss, a peak that cannot be reset (still a true peak)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, None


def peak_mib(field):
    return resident_mib(field) if field else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


torch.manual_seed(0)
tiny = torch.randn(2, 3, 11, requires_grad=True)       # warm up kernels and thread pools
gkl_loss(tiny, torch.randn(2, 3, 11), torch.ones(2, 3))[0].backward()
logits = torch.randn(2, 8, 151936, requires_grad=True)  # randn writes every page: they count now
ref = torch.randn(2, 8, 151936)
mask = torch.ones(2, 8)
base, field = reset_peak()
loss, stats = gkl_loss(logits, ref, mask, beta=2.0, gamma=0.5)
loss.backward()
extra = peak_mib(field) - base
assert torch.isfinite(logits.grad).all()
del loss, stats
base, field = reset_peak()
probe = torch.ones(50_000_000)                          # 191 MiB, touched: the gauge must see it
probe_mib = peak_mib(field) - base if field else None
print(json.dumps({"inputs_mib": 2 * logits.numel() * 4 / 2**20, "extra_mib": extra,
                  "probe_mib": probe_mib, "gauge": field or "ru_maxrss",
                  "grad_abs_sum": float(logits.grad.abs().sum())}))
"""


@pytest.mark.slow
def test_gkl_full_vocabulary_memory():
    """Forward + backward of GKL on (2, 8, 151936) fp32 logits, peak resident memory measured by
    the kernel in a fresh process (torch allocates outside Python, so tracemalloc cannot see it)."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(ROOT)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result)
    if result["probe_mib"] is not None:
        assert 150 < result["probe_mib"] < 260               # the gauge really sees allocations
    assert math.isfinite(result["grad_abs_sum"]) and result["grad_abs_sum"] > 0
    # The gradient alone is 9.3 MiB; the V x V weight matrix of the authors' code would be
    # 16 * 151936^2 floats (1.3 TiB). "Well under 1 GB": we allow 256 MiB.
    assert result["extra_mib"] < 256, result


# ---------------------------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------------------------

def test_entropy_matches_reference_value_and_gradient():
    torch.manual_seed(3)
    logits = (3 * torch.randn(2, 5, 13, dtype=F64)).requires_grad_()
    reference = torch.distributions.Categorical(logits=logits).entropy()    # (2, 5)
    weights = torch.randn(2, 5, dtype=F64)
    (ref_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    for chunk_size in (None, 1, 3):
        got = entropy(logits, chunk_size=chunk_size)
        assert got.shape == (2, 5)
        torch.testing.assert_close(got, reference.detach(), rtol=0, atol=1e-12)
        (grad,) = torch.autograd.grad((got * weights).sum(), logits)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    bf16 = entropy(logits.detach().to(torch.bfloat16))
    assert bf16.dtype == torch.float32
    assert entropy(torch.zeros(4, 8)).sub(math.log(8)).abs().max().item() < 1e-6


# ---------------------------------------------------------------------------------------------
# Exactness: one mini-batch == the sum of its micro-batches == the sum over two gloo ranks
# ---------------------------------------------------------------------------------------------

LENGTHS = [5, 2, 7, 1, 4, 6, 3]           # loss tokens per row
GROUPS = [0, 0, 1, 1, 1, 2, 2]            # prompt of each row; group 1 straddles splits
DIM, VOCAB = 4, 6


def _rollouts(seed=0):
    """Seeded toy rollouts: per row features, sampled tokens, old log-probs, advantage."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in LENGTHS:
        rows.append({"x": torch.randn(length, DIM, generator=g, dtype=F64),
                     "tokens": torch.randint(0, VOCAB, (length,), generator=g),
                     "old_noise": 0.4 * torch.randn(length, generator=g, dtype=F64),
                     "adv": torch.randn((), generator=g, dtype=F64)})
    weight = torch.randn(DIM, VOCAB, generator=g, dtype=F64)
    ref_weight = weight + 0.3 * torch.randn(DIM, VOCAB, generator=g, dtype=F64)
    return rows, weight, ref_weight


def _micro_batch(rows, indices):
    """Pad the rows to this micro-batch's own longest row (so widths differ between micro-batches)."""
    width = max([LENGTHS[i] for i in indices] or [1])
    b = len(indices)
    out = {"x": torch.zeros(b, width, DIM, dtype=F64), "tokens": torch.zeros(b, width, dtype=torch.long),
           "old_noise": torch.zeros(b, width, dtype=F64), "mask": torch.zeros(b, width, dtype=F64),
           "adv": torch.zeros(b, dtype=F64), "group_ids": torch.tensor([GROUPS[i] for i in indices], dtype=torch.long),
           "chosen": torch.zeros(b, width, dtype=torch.bool)}  # Clip-Cov's / KL-Cov's tokens
    for k, i in enumerate(indices):
        n = LENGTHS[i]
        out["chosen"][k, :n] = (i + torch.arange(n)) % 3 == 0
        out["x"][k, :n], out["tokens"][k, :n] = rows[i]["x"], rows[i]["tokens"]
        out["old_noise"][k, :n], out["mask"][k, :n], out["adv"][k] = rows[i]["old_noise"], 1.0, rows[i]["adv"]
    return out


def _micro_loss(mb, weight, ref_weight, loss_kind, agg, **divisors):
    logits = mb["x"] @ weight                                              # (b, T, V)
    if loss_kind == "gkl":
        return gkl_loss(logits, mb["x"] @ ref_weight, mb["mask"], beta=2.0, gamma=0.5, agg=agg,
                        chunk_size=3, **divisors)[0]
    logp = torch.log_softmax(logits, -1).gather(-1, mb["tokens"][..., None])[..., 0]  # (b, T)
    old_logp = logp.detach() + mb["old_noise"]   # ratios spread over both clip edges
    settings = OBJECTIVE_SETTINGS.get(loss_kind, {"eps_low": 0.2, "eps_high": 0.28, "clip_c": 3.0})
    if loss_kind in losses.CHOOSING:
        settings = {**settings, "chosen": mb["chosen"]}
    if loss_kind in ROLLOUT_CORRECTIONS:  # a sampler a little off pi_old, per token
        sampler = old_logp - 0.5 * mb["old_noise"]
        settings = {**settings, "token_weights": losses.rollout_weights(
            old_logp, sampler, mb["mask"], **ROLLOUT_CORRECTIONS[loss_kind])[0]}
        loss_kind = "policy"
    objective = losses.OBJECTIVES["clip" if loss_kind == "policy" else loss_kind]
    return objective(logp, old_logp, mb["adv"], mb["mask"], agg=agg, **settings, **divisors)[0]


# Clip ranges that the toy ratios cross (the objectives' own defaults are too narrow for them).
OBJECTIVE_SETTINGS = {"gspo": {"eps_low": 0.05, "eps_high": 0.08},
                      "cispo": {"eps_low": 0.3, "eps_high": 0.2},
                      "gmpo": {"eps_low": 0.3, "eps_high": 0.2},
                      "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
                      "clip-cov": {"eps_low": 0.2, "eps_high": 0.28},
                      "kl-cov": {"kl_coef": 0.5}}
# The rollout corrections' weights on the clipped ratio, at bounds the toy ratios cross.
ROLLOUT_CORRECTIONS = {"seq-tis": dict(cap=1.1, level="sequence"),
                       "icepop": dict(cap=1.15, floor=0.9, mode="mask"),
                       "seq-mis": dict(cap=1.1, level="sequence", mode="mask")}
LOSS_KINDS = ["policy", "gkl", "gspo", "cispo", "gmpo", "sapo", "clip-cov", "kl-cov"] + list(ROLLOUT_CORRECTIONS)


def _loss_and_grad(split, loss_kind, agg, use_global_divisors=True, max_tokens=None):
    rows, weight0, ref_weight = _rollouts()
    weight = weight0.clone().requires_grad_()
    micro = [_micro_batch(rows, idx) for idx in split]
    divisors = micro_batch_divisors([m["mask"] for m in micro], [m["group_ids"] for m in micro],
                                    max_tokens=max_tokens)
    total = 0.0
    for mb, div in zip(micro, divisors):
        kwargs = div if use_global_divisors else {"group_ids": mb["group_ids"]}
        loss = _micro_loss(mb, weight, ref_weight, loss_kind, agg, **kwargs)
        loss.backward()
        total += loss.item()
    return total, weight.grad.clone()


def _whole_batch(loss_kind, agg):
    """One piece, every divisor left to its default: the definition the splits must reproduce."""
    rows, weight0, ref_weight = _rollouts()
    weight = weight0.clone().requires_grad_()
    mb = _micro_batch(rows, list(range(len(LENGTHS))))
    loss = _micro_loss(mb, weight, ref_weight, loss_kind, agg, group_ids=mb["group_ids"])
    loss.backward()
    return loss.item(), weight.grad.clone()


UNEVEN_SPLIT = [[0, 1, 2], [3], [4, 5, 6]]


@pytest.mark.parametrize("loss_kind", LOSS_KINDS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batches_sum_to_the_mini_batch(loss_kind, agg):
    whole_loss, whole_grad = _whole_batch(loss_kind, agg)
    assert whole_grad.abs().max() > 1e-3                    # the test has something to compare
    for split in (UNEVEN_SPLIT, [[6, 0], [3, 5, 1, 2], [4]], [[i] for i in range(7)]):
        loss, grad = _loss_and_grad(split, loss_kind, agg)
        assert abs(loss - whole_loss) <= 1e-10
        assert (grad - whole_grad).abs().max().item() <= 1e-6


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "group-token-mean"])
def test_local_divisors_are_not_exact(agg):
    """Dividing each micro-batch by its own counts (the common bug) changes the gradient."""
    _, whole_grad = _whole_batch("policy", agg)
    _, grad = _loss_and_grad(UNEVEN_SPLIT, "policy", agg, use_global_divisors=False)
    assert (grad - whole_grad).abs().max().item() > 1e-3


def test_dr_grpo_needs_a_constant_max_tokens():
    whole_loss, whole_grad = _whole_batch("policy", "seq-mean-token-sum-norm")   # divides by T = 7
    loss, grad = _loss_and_grad(UNEVEN_SPLIT, "policy", "seq-mean-token-sum-norm", max_tokens=7)
    assert (grad - whole_grad).abs().max().item() <= 1e-6
    divisors = micro_batch_divisors([torch.ones(2, 3), torch.ones(1, 9)])
    assert all(d["max_tokens"] == 9 for d in divisors)          # default: the widest micro-batch


def test_micro_batch_divisors_counts():
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1, 1]])]
    gids = [torch.tensor([0, 2]), torch.tensor([2])]
    d0, d1 = micro_batch_divisors(masks, gids, max_tokens=16)
    assert d0["num_tokens"].item() == 6 and d0["num_seqs"].item() == 2 and d0["max_tokens"] == 16
    assert d0["num_groups"].item() == 2                      # group 1 does not exist, group 2 has tokens
    assert d0["group_token_counts"].tolist() == [2, 4] and d1["group_token_counts"].tolist() == [4]


def _dist_worker(rank, world_size, init_file, out_file):
    """Rank r of 2: its own rows (uneven counts of rows and tokens), its own micro-batches."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    splits = {0: [[0, 1, 2], [3]], 1: [[4], [5, 6]]}     # rank 0: 4 rows 15 tokens; rank 1: 3 rows 13
    results = {}
    for loss_kind in LOSS_KINDS:
        for agg in AGGREGATIONS:
            rows, weight0, ref_weight = _rollouts()
            weight = weight0.clone().requires_grad_()
            micro = [_micro_batch(rows, idx) for idx in splits[rank]]
            divisors = micro_batch_divisors([m["mask"] for m in micro], [m["group_ids"] for m in micro],
                                            distributed=True)
            loss_sum = torch.zeros((), dtype=F64)
            for mb, div in zip(micro, divisors):
                loss = _micro_loss(mb, weight, ref_weight, loss_kind, agg, **div)
                loss.backward()
                loss_sum += loss.detach()
            # The SUM convention: each rank's loss is its share of the global sum, so gradients
            # are summed (DDP would average them: multiply the loss by world_size there).
            dist.all_reduce(weight.grad, op=dist.ReduceOp.SUM)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
            results[f"{loss_kind}/{agg}"] = {"loss": loss_sum.item(), "grad": weight.grad.flatten().tolist()}
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path):
    out_file = tmp_path / "results.json"
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    results = json.loads(out_file.read_text())
    for loss_kind in LOSS_KINDS:
        for agg in AGGREGATIONS:
            whole_loss, whole_grad = _whole_batch(loss_kind, agg)
            got = results[f"{loss_kind}/{agg}"]
            assert abs(got["loss"] - whole_loss) <= 1e-10, (loss_kind, agg)
            grad = torch.tensor(got["grad"], dtype=F64).view_as(whole_grad)
            assert (grad - whole_grad).abs().max().item() <= 1e-6, (loss_kind, agg)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs, padding
# ---------------------------------------------------------------------------------------------

def test_non_finite_inputs_give_non_finite_loss():
    logp = torch.full((2, 3), -1.0, dtype=F64)
    mask = torch.ones(2, 3)
    adv = torch.ones(2, dtype=F64)
    for bad in (math.nan, math.inf, -math.inf):
        for agg in AGGREGATIONS:
            x = logp.clone()
            x[1, 2] = bad
            loss, _ = policy_loss(x, logp, adv, mask, agg=agg, group_ids=torch.tensor([0, 1]))
            assert not torch.isfinite(loss), (bad, agg)
    nan_adv = torch.tensor([1.0, math.nan], dtype=F64)
    assert not torch.isfinite(policy_loss(logp, logp, nan_adv, mask)[0])
    logits = torch.randn(1, 2, 5, dtype=F64)
    logits[0, 1, 3] = math.nan
    assert not torch.isfinite(gkl_loss(logits, torch.randn(1, 2, 5, dtype=F64), torch.ones(1, 2))[0])
    assert not torch.isfinite(gkl_loss(torch.randn(1, 2, 5, dtype=F64), logits, torch.ones(1, 2))[0])
    assert not torch.isfinite(entropy(logits)).all()
    assert not torch.isfinite(dpo_loss(torch.tensor([math.nan]), torch.tensor([0.0]), torch.tensor([0.0]),
                                       torch.tensor([0.0]), 0.1)[0])
    assert not torch.isfinite(kl_estimate(torch.tensor([-math.inf]), torch.tensor([-1.0]), "k3")).all()


def test_padding_never_reaches_loss_or_gradient():
    torch.manual_seed(4)
    logp = torch.randn(2, 4, dtype=F64).requires_grad_()
    old = torch.randn(2, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=F64)
    clean, _ = policy_loss(logp, old, torch.tensor([1.0, -1.0], dtype=F64), mask, clip_c=3.0)
    (clean_grad,) = torch.autograd.grad(clean, logp)
    garbage_logp = logp.detach().clone()
    garbage_logp[0, 3], garbage_logp[1, 3] = math.nan, math.inf
    garbage_logp.requires_grad_()
    garbage_old = old.clone()
    garbage_old[0, 2] = -math.inf
    loss, stats = policy_loss(garbage_logp, garbage_old, torch.tensor([1.0, -1.0], dtype=F64), mask, clip_c=3.0)
    (grad,) = torch.autograd.grad(loss, garbage_logp)
    assert loss.item() == pytest.approx(clean.item(), abs=1e-12)
    torch.testing.assert_close(grad, clean_grad)
    assert all(torch.isfinite(v) for v in stats.values())
    logits = torch.randn(2, 4, 6, dtype=F64)
    garbage_logits = logits.clone()
    garbage_logits[0, 3] = math.nan
    garbage_logits.requires_grad_()
    loss, _ = gkl_loss(garbage_logits, logits, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(garbage_logits.grad).all()
    ent_logits = garbage_logits.detach().clone().requires_grad_()
    aggregate(entropy(ent_logits), mask).backward()
    assert torch.isfinite(ent_logits.grad).all()


def test_modules_import_only_torch_and_the_standard_library():
    for name in ("losses.py", "dapo.py"):
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for root in roots:
                assert root == "torch" or root == "__future__" or root in sys.stdlib_module_names, (name, root)
    # the rule every aggregation keeps is stated where a reader meets it, and explained in the README
    assert losses.__doc__ and "whole mini-batch" in losses.__doc__ and "micro_batch_divisors" in losses.__doc__
    assert "### Exact under any split" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# The objectives since DAPO: hand-computed values and gradients, and an independent form of each
# ---------------------------------------------------------------------------------------------

def _grad_of(fn, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_()
    loss, stats = fn(logp, *args, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, stats


def test_gspo_vector():
    # Row 0: log-ratios 0.1, 0.3 -> s_0 = e^0.2 = 1.221403, A = 1; row 1: -0.2 -> s_1 = e^-0.2 =
    # 0.818731, A = -1 (one token, padded). Wide clip: J = (1.221403 - 0.818731) / 2 = 0.201336;
    # d loss / d logp: row 0, each token -(1/2) s_0 (1/2) = -0.305351; row 1 +(1/2) s_1 = 0.409365.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=F64)
    old = logp - torch.tensor([[0.1, 0.3], [-0.2, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, grad, stats = _grad_of(losses.gspo_loss, logp, old, adv, mask, eps_low=0.5, eps_high=0.5)
    assert loss == pytest.approx(-0.201336, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.305351, -0.305351], [0.409365, 0.0]], dtype=F64), atol=1e-6)
    assert stats["clip_frac_high"] == 0 and stats["ratio_max"] == pytest.approx(1.221403, abs=1e-6)
    # Clip range 0.1: s_0 -> 1.1 and s_1 -> 0.9, both the pessimistic side: J = (1.1 - 0.9) / 2,
    # and no gradient at all (the whole sequence is clipped, not some of its tokens).
    loss, grad, stats = _grad_of(losses.gspo_loss, logp, old, adv, mask, eps_low=0.1, eps_high=0.1)
    assert loss == pytest.approx(-0.1, abs=1e-12) and grad.abs().max() == 0
    assert stats["clip_frac_high"] == pytest.approx(2 / 3) and stats["clip_frac_low"] == pytest.approx(1 / 3)


def test_gspo_equals_its_sequence_form():
    """The paper's own form, one ratio per sequence: the same loss and gradient."""
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 5, generator=g, dtype=F64)
    old = logp.detach() + 0.05 * torch.randn(4, 5, generator=g, dtype=F64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4])[:, None]).to(F64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    loss, grad, _ = _grad_of(losses.gspo_loss, logp, old, adv, mask, eps_low=0.02, eps_high=0.03)
    x = logp.clone().requires_grad_()
    s = torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1))             # (B,)
    want = -torch.minimum(s * adv, s.clamp(0.98, 1.03) * adv).mean()
    want.backward()
    assert loss == pytest.approx(want.item(), abs=1e-12)
    assert torch.allclose(grad, x.grad, atol=1e-12) and x.grad.abs().max() > 0.01


def test_cispo_vector():
    # r = e^0.5 = 1.648721 (cut to 1.2) and e^-1 = 0.367879 (no lower bound), A = 2, token mean:
    # loss = -(1.2 * 2 * -1.0 + 0.367879 * 2 * -2.0) / 2 = 1.935759; d loss / d logp = -w A / 2.
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    old = torch.tensor([[-1.5, -1.0]], dtype=F64)
    loss, grad, stats = _grad_of(losses.cispo_loss, logp, old, torch.tensor([2.0], dtype=F64),
                                 torch.ones(1, 2, dtype=F64), eps_low=1.0, eps_high=0.2)
    assert loss == pytest.approx(1.935759, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1.2, -0.367879]], dtype=F64), atol=1e-6)
    assert stats["clip_frac_high"] == 0.5 and stats["clip_frac_low"] == 0
    # PPO's clip would give the first token no gradient; CISPO keeps both tokens' gradients.
    _, ppo_grad, _ = _grad_of(losses.policy_loss, logp, old, torch.tensor([2.0], dtype=F64),
                              torch.ones(1, 2, dtype=F64), eps_low=0.2, eps_high=0.2)
    assert ppo_grad[0, 0] == 0 and grad[0, 0] != 0


def test_gmpo_vector():
    # Row 0, A = 1, log-ratios 0.6 (capped at 0.4) and -0.2: exp(mean(0.4, -0.2)) = e^0.1; row 1,
    # A = -1, log-ratios -0.6 (floored at -0.4) and 0.2: e^-0.1. loss = -(e^0.1 - e^-0.1) / 2 =
    # -0.100167; the clipped tokens get no gradient, the others -A e^(+-0.1) / 2 / 2.
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=F64)
    old = logp - torch.tensor([[0.6, -0.2], [-0.6, 0.2]], dtype=F64)
    loss, grad, stats = _grad_of(losses.gmpo_loss, logp, old, torch.tensor([1.0, -1.0], dtype=F64),
                                 torch.ones(2, 2, dtype=F64), eps_low=0.4, eps_high=0.4)
    assert loss == pytest.approx(-(math.exp(0.1) - math.exp(-0.1)) / 2, abs=1e-12)
    want = torch.tensor([[0.0, -math.exp(0.1) / 4], [0.0, math.exp(-0.1) / 4]], dtype=F64)
    assert torch.allclose(grad, want, atol=1e-12)
    assert stats["clip_frac_high"] == 0.25 and stats["clip_frac_low"] == 0.25


def test_gmpo_equals_the_geometric_mean_of_clipped_ratios():
    """The paper's form: |A| prod_t min(r_t, clip(r_t))^(1/|o|) for A > 0 (max for A < 0)."""
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(3, 4, generator=g, dtype=F64)
    old = logp + 0.5 * torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.ones(3, 4, dtype=F64)
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=F64)
    loss, _, _ = _grad_of(losses.gmpo_loss, logp, old, adv, mask, eps_low=0.3, eps_high=0.2)
    r = torch.exp(logp - old)
    low, high = math.exp(-0.3), math.exp(0.2)
    pessimistic = torch.where(adv[:, None] > 0, torch.minimum(r, r.clamp(low, high)),
                              torch.maximum(r, r.clamp(low, high)))
    geometric = pessimistic.prod(-1) ** (1 / 4)
    assert loss == pytest.approx(-(adv * geometric).mean().item(), abs=1e-12)


def test_sapo_vector():
    # At r = 1 the gate is 4 / tau * 1/2: loss = -(2 / 1.0 * 1 - 2 / 1.05 * 1) / 2 = -0.047619,
    # and its gradient the plain policy gradient, -A / 2 per (one-token) sequence.
    logp = torch.tensor([[-1.0], [-2.0]], dtype=F64)
    loss, grad, stats = _grad_of(losses.sapo_loss, logp, logp.clone(), torch.tensor([1.0, -1.0], dtype=F64),
                                 torch.ones(2, 1, dtype=F64), tau_pos=1.0, tau_neg=1.05)
    assert loss == pytest.approx(-(2.0 - 2.0 / 1.05) / 2, abs=1e-12)
    assert torch.allclose(grad, torch.tensor([[-0.5], [0.5]], dtype=F64), atol=1e-12)
    # Off-policy the gradient fades smoothly: 4 s (1 - s) r with s = sigmoid(tau (r - 1)).
    r = 1.5
    sig = 1 / (1 + math.exp(-(r - 1)))
    _, grad, _ = _grad_of(losses.sapo_loss, logp[:1], logp[:1] - math.log(r),
                          torch.tensor([1.0], dtype=F64), torch.ones(1, 1, dtype=F64))
    assert grad.item() == pytest.approx(-4 * sig * (1 - sig) * r, abs=1e-12)


@pytest.mark.parametrize("objective", ["gspo", "gmpo"])
def test_sequence_objectives_refuse_token_advantages(objective):
    with pytest.raises(ValueError, match="one advantage per sequence"):
        losses.OBJECTIVES[objective](torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                     torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------
# Rollout correction and the tokens chosen over a mini-batch: hand-computed vectors
# ---------------------------------------------------------------------------------------------

# log pi_old - log pi_sampler: row 0: 0.5, -1.0, 0.0 (sum -0.5); row 1: -0.8, 0.9 (sum 0.1), pad.
ROLLOUT_OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]], dtype=F64)
ROLLOUT_SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.9, 5.0]], dtype=F64)
ROLLOUT_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)


@pytest.mark.parametrize("settings,weights,cut", [
    (dict(cap=1.5), [[1.5, 0.367879, 1.0], [0.449329, 1.5]], [[1, 0, 0], [0, 1]]),         # TIS
    (dict(cap=1.05, level="sequence"), [[0.606531] * 3, [1.05] * 2], [[0, 0, 0], [1, 1]]),
    (dict(cap=2.0, floor=0.5, mode="mask"), [[1.648721, 0.0, 1.0], [0.0, 0.0]],          # IcePop
     [[0, 1, 0], [1, 1]]),
    (dict(cap=1.05, level="sequence", mode="mask"), [[0.606531] * 3, [0.0, 0.0]],        # MIS
     [[0, 0, 0], [1, 1]]),
], ids=["token-truncate", "sequence-truncate", "token-mask", "sequence-mask"])
def test_rollout_weights_vectors(settings, weights, cut):
    got, got_cut = losses.rollout_weights(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, **settings)
    assert torch.allclose(got[0], torch.tensor(weights[0], dtype=F64), atol=1e-6)
    assert torch.allclose(got[1, :2], torch.tensor(weights[1], dtype=F64), atol=1e-6)
    assert got_cut[0].tolist() == [bool(c) for c in cut[0]]
    assert got_cut[1].tolist() == [bool(c) for c in cut[1]] + [False]  # padding is never counted
    with pytest.raises(ValueError):
        losses.rollout_weights(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, cap=1.0, floor=2.0, mode="mask")


def test_masked_tokens_keep_their_place_in_the_divisor():
    """IcePop's objective: a masked token contributes 0 to a sum still divided by every token."""
    logp = ROLLOUT_OLD.clone().requires_grad_()
    weights, _ = losses.rollout_weights(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, cap=2.0,
                                        floor=0.5, mode="mask")
    loss, _ = losses.policy_loss(logp, ROLLOUT_OLD, torch.tensor([1.0, -1.0], dtype=F64),
                                 ROLLOUT_MASK, token_weights=weights)
    loss.backward()
    # ratio 1 everywhere: loss_t = -A w_t; only row 0's tokens 0 and 2 are kept; 5 loss tokens.
    assert loss.item() == pytest.approx(-(1.648721 + 1.0) / 5, abs=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([-1.648721 / 5, 0.0, -1.0 / 5], abs=1e-6)
    assert logp.grad[1].abs().max().item() == 0.0


def test_high_entropy_tokens_vector():
    entropy_ = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7])
    # the 0.6-quantile of 0.1 0.3 0.5 0.7 0.9 is 0.58: the top 40% are 0.9 and 0.7
    assert losses.high_entropy_tokens(entropy_, 0.4).tolist() == [False, False, True, False, True]
    assert losses.high_entropy_tokens(entropy_, 1.0).all()
    assert losses.high_entropy_tokens(torch.full((4,), 0.2), 0.25).all()  # ties all pass
    assert losses.high_entropy_tokens(torch.zeros(0), 0.2).numel() == 0
    with pytest.raises(ValueError):
        losses.high_entropy_tokens(entropy_, 0.0)


def test_covariance_choices_vectors():
    # mean log pi -2, mean A 0: Cov = (1)(1), (0)(1), (-1)(-2)
    covariance = losses.token_covariance(torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([1.0, 1.0, -2.0]))
    assert covariance.tolist() == [1.0, 0.0, 2.0]
    assert losses.kl_cov_tokens(covariance, fraction=0.34).tolist() == [False, False, True]
    assert losses.kl_cov_tokens(covariance, fraction=0.7).tolist() == [True, False, True]
    assert losses.kl_cov_tokens(covariance, fraction=1e-9).sum() == 1  # at least one token
    # Clip-Cov draws among 1 < Cov < 5 not already clipped: positions 1 and 4.
    covariance = torch.tensor([0.5, 2.0, 3.0, 6.0, 4.0])
    clipped = torch.tensor([False, False, True, False, False])
    one = losses.clip_cov_tokens(covariance, clipped, fraction=0.2, low=1.0, high=5.0,
                                 generator=torch.Generator().manual_seed(0))
    assert one.sum() == 1 and (one[1] or one[4])
    again = losses.clip_cov_tokens(covariance, clipped, fraction=0.2, low=1.0, high=5.0,
                                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(one, again)  # the draw is the generator's
    both = losses.clip_cov_tokens(covariance, clipped, fraction=1.0, low=1.0, high=5.0)
    assert both.tolist() == [False, True, False, False, True]  # no more than the candidates


def test_kl_cov_loss_vector():
    # r = e^0.2, e^-0.5; A = 2; token 1 chosen, coef 0.5, token mean over 2:
    # loss = (-2 e^0.2 + (-2 e^-0.5 + 0.5 * 0.5)) / 2
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    old = torch.tensor([[-1.2, -1.5]], dtype=F64)
    chosen = torch.tensor([[False, True]])
    loss, grad, stats = _grad_of(losses.kl_cov_loss, logp, old, torch.tensor([2.0], dtype=F64),
                                 torch.ones(1, 2), chosen=chosen, kl_coef=0.5)
    r0, r1 = math.exp(0.2), math.exp(-0.5)
    assert loss == pytest.approx((-2 * r0 - 2 * r1 + 0.25) / 2, abs=1e-12)
    # d/dlogp: -A r_t, and for the chosen token + coef sign(log r) = -0.5
    assert grad[0].tolist() == pytest.approx([-2 * r0 / 2, (-2 * r1 - 0.5) / 2], abs=1e-12)
    assert stats["clip_frac_high"] == 0 and stats["clip_frac_low"] == 0


def test_clip_cov_loss_drops_the_chosen_gradients_only():
    torch.manual_seed(5)
    logp, old = torch.randn(2, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
    advantages = torch.tensor([0.7, -1.2], dtype=F64)
    chosen = torch.tensor([[True, False, False, False], [False, False, True, False]])
    _, grad, _ = _grad_of(losses.clip_cov_loss, logp, old, advantages, mask, chosen=chosen,
                          eps_low=1.0, eps_high=1.0)
    _, plain_grad, _ = _grad_of(losses.policy_loss, logp, old, advantages, mask, eps_low=1.0, eps_high=1.0)
    assert grad[chosen].abs().max() == 0
    assert torch.equal(grad[~chosen], plain_grad[~chosen])  # the same divisor for the rest
