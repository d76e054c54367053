"""Tests for losses.py: hand-computed vectors, exactness under micro-batching and 2-rank gloo (of
DAPO's loss and of every loss in objectives.py: they share its divisors), non-finite inputs.
objectives.py's own tests are in tests/test_objectives.py."""

import ast
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import losses  # noqa: E402
from losses import AGGREGATIONS, aggregate, kl_estimate, micro_batch_divisors, policy_loss  # noqa: E402
from variants import objectives  # noqa: E402
from variants.objectives import gkl_loss  # noqa: E402

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


def test_aggregate_refuses_a_misspelt_divisor_and_an_unknown_mode():
    """A divisor by a wrong name must not fall back silently to the micro-batch's own count (the
    update would then differ between splits); an unknown mode names the known ones."""
    per_token, mask = torch.ones(2, 3, dtype=F64), torch.ones(2, 3)
    with pytest.raises(TypeError, match="num_token"):
        aggregate(per_token, mask, "token-mean", num_token=5)
    for agg in ("token_mean", ["token-mean"]):
        with pytest.raises(ValueError, match="seq-mean-token-mean"):
            aggregate(per_token, mask, agg)
    assert aggregate(per_token, mask, "token-mean", num_tokens=12).item() == 0.5


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
    if loss_kind in objectives.CHOOSING:
        settings = {**settings, "chosen": mb["chosen"]}
    if loss_kind in ROLLOUT_CORRECTIONS:  # a sampler a little off pi_old, per token
        sampler = old_logp - 0.5 * mb["old_noise"]
        settings = {**settings, "token_weights": losses.rollout_weights(
            old_logp, sampler, mb["mask"], **ROLLOUT_CORRECTIONS[loss_kind])[0]}
        loss_kind = "policy"
    objective = objectives.OBJECTIVES["clip" if loss_kind == "policy" else loss_kind]
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


def test_modules_import_only_torch_and_the_standard_library():
    also = {"losses.py": set(), "variants/objectives.py": {"losses"}, "dapo.py": set()}  # besides torch, stdlib
    for name, allowed in also.items():
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for root in roots:
                ok = root in {"torch", "__future__", *allowed} or root in sys.stdlib_module_names
                assert ok, (name, root)
    # losses.py holds DAPO's loss; the objectives since DAPO, GKL and DPO are objectives.py's
    defined = {node.name for node in ast.parse((ROOT / "losses.py").read_text()).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    moved = {"gspo_loss", "cispo_loss", "gmpo_loss", "sapo_loss", "gkl_loss", "dpo_loss", "clip_cov_loss",
             "kl_cov_loss"}
    assert not defined & moved, defined & moved
    assert all(callable(getattr(objectives, name)) for name in moved)
    assert objectives.OBJECTIVES["clip"] is losses.policy_loss
    # the rule every aggregation keeps is stated where a reader meets it, and explained in the README
    assert losses.__doc__ and "whole mini-batch" in losses.__doc__ and "micro_batch_divisors" in losses.__doc__
    assert "### Exact under any split" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# Rollout correction: hand-computed vectors
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


# log rho per token, row 0: 0.5, -1.0, 0.0; row 1: -0.8, 0.9. Schulman's estimates of it:
#   k1 = -log rho:            -0.5, 1.0, 0.0      |  0.8, -0.9        sums 0.5 | -0.1
#   k2 = (log rho)^2 / 2:      0.125, 0.5, 0.0    |  0.32, 0.405      sums 0.625 | 0.725, max 0.5 | 0.405
#   k3 = rho - 1 - log rho:    0.148721, 0.367879, 0.0 | 0.249329, 0.559603
#                              (sum 0.516600, mean 0.172200 | sum 0.808932, max 0.559603)
@pytest.mark.parametrize("rule,bound,kept", [
    ("token_k1", 2.0, [[1, 0, 1], [0, 0]]),        # |k1| <= log 2 = 0.693
    ("token_k2", 0.4, [[1, 0, 1], [1, 0]]),
    ("token_k3", 0.3, [[1, 0, 1], [1, 0]]),
    ("seq_sum_k1", 1.5, [[0, 0, 0], [1, 1]]),      # |0.5| > log 1.5 = 0.405 >= |-0.1|
    ("seq_mean_k1", 1.15, [[0, 0, 0], [1, 1]]),    # |0.1667| > log 1.15 = 0.1398 >= |-0.05|
    ("seq_sum_k2", 0.7, [[1, 1, 1], [0, 0]]),
    ("seq_mean_k2", 0.3, [[1, 1, 1], [0, 0]]),     # 0.2083 | 0.3625
    ("seq_max_k2", 0.45, [[0, 0, 0], [1, 1]]),
    ("seq_sum_k3", 0.6, [[1, 1, 1], [0, 0]]),
    ("seq_mean_k3", 0.173, [[1, 1, 1], [0, 0]]),
    ("seq_max_k3", 0.5, [[1, 1, 1], [0, 0]]),
])
def test_rollout_rejection_vectors(rule, bound, kept):
    got = losses.rollout_rejection(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, rule=rule, bound=bound)
    assert got.tolist() == [[bool(k) for k in kept[0]], [bool(k) for k in kept[1]] + [False]]


def test_rollout_rejection_refuses_what_it_cannot_mean():
    for rule, bound in [("seq_max_k1", 2.0), ("token_k4", 1.0), ("token_k1", 1.0), ("seq_sum_k3", 0.0)]:
        with pytest.raises(ValueError, match=rule):
            losses.rollout_rejection(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, rule=rule, bound=bound)


def test_rejected_tokens_leave_the_divisor():
    """verl's rejection takes a token out of the loss mask: unlike IcePop's mask, the divisor
    shrinks with it, and the kept tokens' gradients grow to match."""
    logp = ROLLOUT_OLD.clone().requires_grad_()
    kept = losses.rollout_rejection(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, rule="token_k2", bound=0.4)
    loss, stats = losses.policy_loss(logp, ROLLOUT_OLD, torch.tensor([1.0, -1.0], dtype=F64),
                                     ROLLOUT_MASK * kept)
    loss.backward()
    # ratio 1: loss_t = -A_t; kept: row 0 tokens 0 and 2 (A = 1), row 1 token 0 (A = -1); 3 tokens.
    assert stats["tokens"] == 3 and loss.item() == pytest.approx(-(1 + 1 - 1) / 3, abs=1e-12)
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, 0.0, -1 / 3], [1 / 3, 0.0, 0.0]], dtype=F64))


@pytest.mark.parametrize("level,cap,sums", [
    ("token", 1.5, [1.5 + 0.367879 + 1.0 + 0.449329 + 1.5, 5]),  # every loss token's weight
    ("sequence", 1.05, [0.606531 + 1.05, 2]),                     # each reply's one weight
])
def test_rollout_weight_sums_vectors(level, cap, sums):
    """--tis-normalize divides by sum / count; padding and empty replies count for nothing."""
    weights, _ = losses.rollout_weights(ROLLOUT_OLD, ROLLOUT_SAMPLER, ROLLOUT_MASK, cap=cap, level=level)
    assert losses.rollout_weight_sums(weights, ROLLOUT_MASK, level).tolist() == pytest.approx(sums, abs=1e-6)
    empty = torch.cat([ROLLOUT_MASK, torch.zeros(1, 3, dtype=F64)])       # a reply with no loss token
    weights = torch.cat([weights, torch.full((1, 3), 1.5, dtype=F64)])
    assert losses.rollout_weight_sums(weights, empty, level).tolist() == pytest.approx(sums, abs=1e-6)


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
