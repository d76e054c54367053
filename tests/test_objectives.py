"""Tests for objectives.py: hand-computed vectors and an independent form of each objective since
DAPO, the tokens chosen over a mini-batch, GKL against a direct pairwise implementation and in
bounded memory, entropy, DPO, non-finite inputs. Their exactness under micro-batching and 2-rank
gloo is tested with DAPO's loss, in tests/test_losses.py."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import losses  # noqa: E402
from variants import objectives  # noqa: E402
from variants.objectives import dpo_loss, entropy, gkl_loss  # noqa: E402

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


# ---------------------------------------------------------------------------------------------
# Hand-computed vectors
# ---------------------------------------------------------------------------------------------

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
from variants.objectives import gkl_loss


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
    loss, grad, stats = _grad_of(objectives.gspo_loss, logp, old, adv, mask, eps_low=0.5, eps_high=0.5)
    assert loss == pytest.approx(-0.201336, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-0.305351, -0.305351], [0.409365, 0.0]], dtype=F64), atol=1e-6)
    assert stats["clip_frac_high"] == 0 and stats["ratio_max"] == pytest.approx(1.221403, abs=1e-6)
    # Clip range 0.1: s_0 -> 1.1 and s_1 -> 0.9, both the pessimistic side: J = (1.1 - 0.9) / 2,
    # and no gradient at all (the whole sequence is clipped, not some of its tokens).
    loss, grad, stats = _grad_of(objectives.gspo_loss, logp, old, adv, mask, eps_low=0.1, eps_high=0.1)
    assert loss == pytest.approx(-0.1, abs=1e-12) and grad.abs().max() == 0
    assert stats["clip_frac_high"] == pytest.approx(2 / 3) and stats["clip_frac_low"] == pytest.approx(1 / 3)


def test_gspo_equals_its_sequence_form():
    """The paper's own form, one ratio per sequence: the same loss and gradient."""
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 5, generator=g, dtype=F64)
    old = logp.detach() + 0.05 * torch.randn(4, 5, generator=g, dtype=F64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4])[:, None]).to(F64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    loss, grad, _ = _grad_of(objectives.gspo_loss, logp, old, adv, mask, eps_low=0.02, eps_high=0.03)
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
    loss, grad, stats = _grad_of(objectives.cispo_loss, logp, old, torch.tensor([2.0], dtype=F64),
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
    loss, grad, stats = _grad_of(objectives.gmpo_loss, logp, old, torch.tensor([1.0, -1.0], dtype=F64),
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
    loss, _, _ = _grad_of(objectives.gmpo_loss, logp, old, adv, mask, eps_low=0.3, eps_high=0.2)
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
    loss, grad, stats = _grad_of(objectives.sapo_loss, logp, logp.clone(), torch.tensor([1.0, -1.0], dtype=F64),
                                 torch.ones(2, 1, dtype=F64), tau_pos=1.0, tau_neg=1.05)
    assert loss == pytest.approx(-(2.0 - 2.0 / 1.05) / 2, abs=1e-12)
    assert torch.allclose(grad, torch.tensor([[-0.5], [0.5]], dtype=F64), atol=1e-12)
    # Off-policy the gradient fades smoothly: 4 s (1 - s) r with s = sigmoid(tau (r - 1)).
    r = 1.5
    sig = 1 / (1 + math.exp(-(r - 1)))
    _, grad, _ = _grad_of(objectives.sapo_loss, logp[:1], logp[:1] - math.log(r),
                          torch.tensor([1.0], dtype=F64), torch.ones(1, 1, dtype=F64))
    assert grad.item() == pytest.approx(-4 * sig * (1 - sig) * r, abs=1e-12)


@pytest.mark.parametrize("objective", ["gspo", "gmpo"])
def test_sequence_objectives_refuse_token_advantages(objective):
    with pytest.raises(ValueError, match="one advantage per sequence"):
        objectives.OBJECTIVES[objective](torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                         torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------
# The tokens chosen over a mini-batch: hand-computed vectors
# ---------------------------------------------------------------------------------------------

def test_high_entropy_tokens_vector():
    entropy_ = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7])
    # the 0.6-quantile of 0.1 0.3 0.5 0.7 0.9 is 0.58: the top 40% are 0.9 and 0.7
    assert objectives.high_entropy_tokens(entropy_, 0.4).tolist() == [False, False, True, False, True]
    assert objectives.high_entropy_tokens(entropy_, 1.0).all()
    assert objectives.high_entropy_tokens(torch.full((4,), 0.2), 0.25).all()  # ties all pass
    assert objectives.high_entropy_tokens(torch.zeros(0), 0.2).numel() == 0
    with pytest.raises(ValueError):
        objectives.high_entropy_tokens(entropy_, 0.0)


def test_covariance_choices_vectors():
    # mean log pi -2, mean A 0: Cov = (1)(1), (0)(1), (-1)(-2)
    covariance = objectives.token_covariance(torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([1.0, 1.0, -2.0]))
    assert covariance.tolist() == [1.0, 0.0, 2.0]
    assert objectives.kl_cov_tokens(covariance, fraction=0.34).tolist() == [False, False, True]
    assert objectives.kl_cov_tokens(covariance, fraction=0.7).tolist() == [True, False, True]
    assert objectives.kl_cov_tokens(covariance, fraction=1e-9).sum() == 1  # at least one token
    # Clip-Cov draws among 1 < Cov < 5 not already clipped: positions 1 and 4.
    covariance = torch.tensor([0.5, 2.0, 3.0, 6.0, 4.0])
    clipped = torch.tensor([False, False, True, False, False])
    one = objectives.clip_cov_tokens(covariance, clipped, fraction=0.2, low=1.0, high=5.0,
                                     generator=torch.Generator().manual_seed(0))
    assert one.sum() == 1 and (one[1] or one[4])
    again = objectives.clip_cov_tokens(covariance, clipped, fraction=0.2, low=1.0, high=5.0,
                                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(one, again)  # the draw is the generator's
    both = objectives.clip_cov_tokens(covariance, clipped, fraction=1.0, low=1.0, high=5.0)
    assert both.tolist() == [False, True, False, False, True]  # no more than the candidates


def test_kl_cov_loss_vector():
    # r = e^0.2, e^-0.5; A = 2; token 1 chosen, coef 0.5, token mean over 2:
    # loss = (-2 e^0.2 + (-2 e^-0.5 + 0.5 * 0.5)) / 2
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    old = torch.tensor([[-1.2, -1.5]], dtype=F64)
    chosen = torch.tensor([[False, True]])
    loss, grad, stats = _grad_of(objectives.kl_cov_loss, logp, old, torch.tensor([2.0], dtype=F64),
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
    _, grad, _ = _grad_of(objectives.clip_cov_loss, logp, old, advantages, mask, chosen=chosen,
                          eps_low=1.0, eps_high=1.0)
    _, plain_grad, _ = _grad_of(losses.policy_loss, logp, old, advantages, mask, eps_low=1.0, eps_high=1.0)
    assert grad[chosen].abs().max() == 0
    assert torch.equal(grad[~chosen], plain_grad[~chosen])  # the same divisor for the rest


# ---------------------------------------------------------------------------------------------
# Non-finite inputs, padding
# ---------------------------------------------------------------------------------------------

def test_non_finite_inputs_give_non_finite_loss():
    logits = torch.randn(1, 2, 5, dtype=F64)
    logits[0, 1, 3] = math.nan
    assert not torch.isfinite(gkl_loss(logits, torch.randn(1, 2, 5, dtype=F64), torch.ones(1, 2))[0])
    assert not torch.isfinite(gkl_loss(torch.randn(1, 2, 5, dtype=F64), logits, torch.ones(1, 2))[0])
    assert not torch.isfinite(entropy(logits)).all()
    assert not torch.isfinite(dpo_loss(torch.tensor([math.nan]), torch.tensor([0.0]), torch.tensor([0.0]),
                                       torch.tensor([0.0]), 0.1)[0])


def test_padding_never_reaches_loss_or_gradient():
    torch.manual_seed(4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=F64)
    logits = torch.randn(2, 4, 6, dtype=F64)
    garbage_logits = logits.clone()
    garbage_logits[0, 3] = math.nan
    garbage_logits.requires_grad_()
    loss, _ = gkl_loss(garbage_logits, logits, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(garbage_logits.grad).all()
    ent_logits = garbage_logits.detach().clone().requires_grad_()
    losses.aggregate(entropy(ent_logits), mask).backward()
    assert torch.isfinite(ent_logits.grad).all()
