"""quantize.py: the NF4 code book against its definition, the quantisation error within what a
4-bit code allows, the backward that dequantises again, a quantised tiny model's logits near the
unquantised ones, a LoRA run on a quantised base changing only the adapters, the weights' memory,
save_model merging into the dequantised weights, and the flags refused by name."""

import pytest
import torch

from conftest import hf_model, random_ids
from run.checkpoints import load_model, save_model
from variants import quantize
from variants.lora import add_lora
from variants.quantize import NF4, NF4Linear, dequantize, nf4_levels

pytestmark = pytest.mark.usefixtures("one_thread")


def test_code_book_is_the_papers():
    """16 levels, -1 and 1 at the ends, 0 exact; the listed table equals the construction from
    normal quantiles (QLoRA, appendix E)."""
    assert NF4.shape == (16,) and NF4[0] == -1 and NF4[-1] == 1 and NF4[7] == 0
    assert torch.all(NF4[1:] > NF4[:-1])
    assert torch.allclose(nf4_levels(), NF4, atol=1e-6, rtol=0)


def test_quantisation_error_within_half_a_step():
    """Every value goes to its nearest level: the error is at most half the largest gap between
    neighbouring levels times its block's absmax (and brute force picks the same levels)."""
    torch.manual_seed(0)
    weight = torch.randn(48, 128) * torch.rand(48, 1) * 3
    codes, absmax = quantize.quantize(weight)
    assert codes.dtype == torch.uint8 and codes.numel() == weight.numel() // 2
    back = dequantize(codes, absmax, weight.shape, torch.float32)
    half_gap = (NF4[1:] - NF4[:-1]).max() / 2
    bound = absmax.repeat_interleave(64).reshape(weight.shape) * half_gap
    assert torch.all((back - weight).abs() <= bound + 1e-6)
    blocks = weight.reshape(-1, 64) / absmax[:, None]
    nearest = NF4[(blocks[..., None] - NF4).abs().argmin(-1)] * absmax[:, None]
    assert torch.allclose(back.reshape(-1, 64), nearest, atol=1e-6)
    exact = NF4[torch.randint(0, 16, (4, 64))] * torch.tensor([[0.5], [2.0], [1.0], [3.0]])
    exact[:, 0] = torch.tensor([0.5, 2.0, 1.0, 3.0])  # the block's absmax is one of its values
    assert torch.equal(dequantize(*quantize.quantize(exact), exact.shape, torch.float32), exact)


def test_backward_dequantises_to_the_same_gradient():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=True)
    layer = NF4Linear(linear)
    x = torch.randn(3, 5, 64, requires_grad=True)
    layer(x).square().sum().backward()
    want = x.detach().clone().requires_grad_(True)
    (want @ layer.weight.T + linear.bias).square().sum().backward()
    assert torch.allclose(x.grad, want.grad, atol=1e-5)


def quantised(path, rank=4):
    model = add_lora(load_model(path)[0], rank=rank)
    return quantize.quantize_lora_bases(model)


def test_quantised_logits_are_near_the_unquantised(tiny_ckpt):
    """4 bits a weight: about 10% relative error on normally distributed weights (20 dB, as a
    4-bit code of a Gaussian gives), which 3 layers carry into the logits as about a third of
    their size (measured: 0.35 here, and 0.35 with 87.5% of top-1 tokens kept on the bundled
    135M model); a missing scale or a wrong level would be off by far more."""
    path = tiny_ckpt("llama3")
    plain, ours = load_model(path)[0], quantised(path)
    weight = plain.layers[0].attn.wq.weight
    back = ours.layers[0].attn.wq.base.weight
    assert 0.05 < ((back - weight).norm() / weight.norm()).item() < 0.12
    ids = random_ids(2, 40, plain.config.vocab_size, seed=3)
    with torch.no_grad():
        want, got = plain(ids), ours(ids)
    relative = ((got - want).norm() / want.norm()).item()
    assert 0 < relative < 0.5, relative


def test_weight_memory_is_about_a_quarter_of_bf16(tiny_ckpt):
    """The base projections' bytes: half a byte a weight plus a float32 maximum per 64, against
    bf16's 2 bytes: 28%."""
    model = quantised(tiny_ckpt("llama3"))
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    weights = sum(m.codes.numel() * 2 for m in layers)
    stored = sum(m.codes.numel() + m.absmax.numel() * 4 for m in layers)
    assert stored / (2 * weights) == pytest.approx(0.5625 / 2)
    assert quantize.weight_bytes(model) < quantize.weight_bytes(add_lora(load_model(tiny_ckpt("llama3"))[0], rank=4))


def test_lora_on_a_quantised_base_trains_only_the_adapters(tmp_path):
    """Two training steps: every adapter moved, nothing else (codes, maxima, norms, embeddings)."""
    import train
    from run import config, launch
    from test_train import BASE, digit_checkpoint, digit_data
    args, _ = config.parse_config(["--model", digit_checkpoint(tmp_path / "m"), "--data",
                                   digit_data(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run"),
                                   "--lora-rank", "4", "--quantize", "nf4", "--lr", "1e-2",
                                   "--no-dynamic-sampling"] + BASE)
    run = launch.setup(args)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    progress = launch.Progress()
    for _ in range(2):
        progress, _, _ = train.train_step(run, progress)
    after = run.policy.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    adapters = {k for k in before if "lora_" in k}
    assert moved == adapters and adapters
    assert any(k.endswith("codes") for k in before) and run.sampler is run.policy


def test_save_model_merges_into_the_dequantised_weights(tiny_ckpt, tmp_path):
    """final/ holds base (dequantised) + B A * scale: transformers' model of it gives the
    quantised model's logits."""
    model = quantised(tiny_ckpt("qwen2"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    out = str(tmp_path / "final")
    save_model(model, None, out)
    ids = random_ids(2, 20, model.config.vocab_size, seed=4)
    with torch.no_grad():
        assert (model(ids) - hf_model(out)(ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "nf4"], "--quantize nf4 freezes the base in 4 bits: it needs --lora-rank > 0"),
    (["--quantize", "nf4", "--lora-rank", "4", "--fsdp"], "--quantize nf4 with --fsdp"),
])
def test_bad_combinations_are_refused(extra, message, capsys):
    from run import config
    with pytest.raises(SystemExit):
        config.parse_config(["--model", "x"] + extra)
    assert message in capsys.readouterr().err


def test_a_weight_that_does_not_split_into_blocks_is_named():
    with pytest.raises(ValueError, match=r"--quantize nf4: a \(5, 3\) weight does not split into blocks of 64"):
        NF4Linear(torch.nn.Linear(3, 5))
