"""speed.py: the CPU speed-ups applied from outside the model give the model's own results (the
same tokens, F.linear's logits to rounding), stay off where they are not faster, follow every
change of a weight, and nothing of them acts at import.

    python -m pytest tests/test_speed.py -q
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, generate_args, needs_cpp_compiler, random_ids
from engine import speed as S
from model import token_logprobs
from run.checkpoints import load_model
from test_model import TOL, _assert_same_grads, _grads, _padded_batch, loaded, max_diff  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


IMPORTS = """
import torch
from torch.optim import optimizer
hooks = len(optimizer._global_optimizer_post_hooks)
import sys
sys.path.insert(0, "recipes")
import bench, dapo, data, demo, eval, losses, model
from run import checkpoints
from tasks import episodes
from run import launch
from variants import objectives
import rollout, train
from engine import speed
assert len(optimizer._global_optimizer_post_hooks) == hooks, "an optimizer hook at import"
assert not hasattr(torch.ops.dapo, "packed_linear"), "a library op at import"
print("clean")
"""


def test_nothing_is_registered_at_import():
    """Importing the model, the sampler, the trainer and every entry point registers no optimizer
    hook and no library op (whoever copies model.py inherits nothing global); speed.pack_linears
    registers them, once, when it is called; model.py holds no CPU kernel machinery."""
    out = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["clean"], out.stderr
    for name in ("model.py", "engine/chunked_logprobs.py", "engine/paged.py"):  # the model and what it reads
        source = (ROOT / name).read_text()
        assert not any(word in source for word in ("mkldnn", "mallopt", "register_optimizer",
                                                   "torch.library", "onednn")), name


def test_pack_linears_swaps_the_projections_and_registers_once(loaded):
    """pack_linears: every projection of attention and the MLPs and the head become PackedLinear
    (the same parameters and names), the MoE router stays plain; what the packed products need
    is registered once, however many models are packed."""
    from torch.optim import optimizer
    for family in ("llama", "qwen3_moe"):
        model = copy.deepcopy(loaded(family)[0])
        names = dict(model.state_dict())
        registered, hooks = bool(S._REGISTERED), len(optimizer._global_optimizer_post_hooks)
        assert S.pack_linears(model) is model and hasattr(torch.ops.dapo, "packed_linear")
        assert len(optimizer._global_optimizer_post_hooks) == hooks + (not registered)
        S.pack_linears(model)  # again: nothing more registered
        assert len(optimizer._global_optimizer_post_hooks) == hooks + (not registered)
        assert all(model.state_dict()[k] is v or torch.equal(model.state_dict()[k], v)
                   for k, v in names.items()) and model.state_dict().keys() == names.keys()
        kinds = {name: type(m).__name__ for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)}
        assert all(kind == ("Linear" if name.endswith("router") else "PackedLinear")
                   for name, kind in kinds.items()), kinds
        assert any(name.endswith("router") for name in kinds) == (family == "qwen3_moe")


@pytest.fixture
def onednn(monkeypatch):
    """onednn(True/False): speed.onednn_dtypes forced (DAPO_CPU_ONEDNN), undone afterwards."""
    def force(on):
        monkeypatch.setenv("DAPO_CPU_ONEDNN", "1" if on else "0")
        S.onednn_dtypes.cache_clear()
    yield force
    monkeypatch.undo()
    S.onednn_dtypes.cache_clear()


@pytest.mark.parametrize("cpuinfo, fp32", [
    ("vendor_id : AuthenticAMD\nflags : fma avx2", True),            # an AVX2-only EPYC
    ("vendor_id : AuthenticAMD\nflags : avx2 avx512f avx512_bf16", True),
    ("vendor_id : GenuineIntel\nflags : avx2 avx512f avx512_bf16", False),  # MKL's own kernels
    ("vendor_id : AuthenticAMD\nflags : fma avx", False)])
def test_fp32_sampling_products_are_packed_on_amd_with_avx2_or_avx512(onednn, monkeypatch,
                                                                       cpuinfo, fp32):
    """fp32 sampling products on packed oneDNN on AMD CPUs with AVX2 or AVX-512, where they were
    measured faster than MKL's (MEASUREMENTS.md, "The sampler"); DAPO_CPU_ONEDNN forces either way."""
    for forced in (True, False):
        onednn(forced)
        assert (torch.float32 in S.onednn_dtypes()) == forced
    monkeypatch.delenv("DAPO_CPU_ONEDNN")
    monkeypatch.setattr(S, "cpu_feature", lambda override, present: present(cpuinfo))
    S.onednn_dtypes.cache_clear()
    assert (torch.float32 in S.onednn_dtypes()) == fp32


def test_sampling_products_stay_on_until_the_last_sampler_returns(onednn):
    """Two samplers that overlap (demo.py's two threads): the first to return leaves the packed
    products on for the other, and they are off once both have returned."""
    onednn(True)
    first, second = S.sampling_products(), S.sampling_products()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    try:
        assert torch.float32 in S._ONEDNN_DTYPES
    finally:  # closed even if the assertion fails: no later test runs inside a sampler
        second.__exit__(None, None, None)
    assert S._ONEDNN_DTYPES == frozenset()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q, k, v projections
def test_sampling_products_run_on_onednn_with_f_linear_results(loaded, onednn, family):
    """Inside speed.sampling_products, where oneDNN is faster, every fp32 product of the model
    runs on oneDNN's packed weights (none through aten::linear: MKL) with F.linear's results to
    fp32 rounding; outside it, and where oneDNN is not faster, F.linear as before."""
    ours = S.pack_linears(copy.deepcopy(loaded(family)[0]))
    ids = random_ids(3, 9, ours.config.vocab_size, seed=5)

    def profiled_logits():
        with torch.no_grad(), S.sampling_products(), torch.profiler.profile() as profile:
            logits = ours(ids)
        return logits, {event.key for event in profile.key_averages()}

    with torch.no_grad():
        want = ours(ids)
    onednn(True)
    got, ops = profiled_logits()
    assert "mkldnn::_linear_pointwise" in ops and "aten::linear" not in ops
    assert max_diff(got, want) < TOL
    assert not S._ONEDNN_DTYPES  # the context put it back
    onednn(False)
    got, ops = profiled_logits()
    assert "mkldnn::_linear_pointwise" not in ops and torch.equal(got, want)


def test_sampler_on_onednn_gives_the_same_greedy_tokens(loaded, onednn):
    """rollout.generate takes oneDNN's products where they are faster, with F.linear's tokens:
    those of the packed model with oneDNN off, and of a copy never packed (which stays on
    F.linear inside the sampler too)."""
    from rollout import generate
    plain = copy.deepcopy(loaded("llama")[0])
    ours = S.pack_linears(copy.deepcopy(plain))
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(num_samples=1, max_new_tokens=8, temperature=0.0, seed=0, compile=False)
    onednn(False)
    want = generate(ours, prompts, **generate_args(**kw))
    onednn(True)
    with torch.profiler.profile() as profile:
        got = generate(ours, prompts, **generate_args(**kw))
    assert "mkldnn::_linear_pointwise" in {event.key for event in profile.key_averages()}
    with torch.profiler.profile() as profile:
        unpacked = generate(plain, prompts, **generate_args(**kw))
    assert "mkldnn::_linear_pointwise" not in {event.key for event in profile.key_averages()}
    assert [c.tokens for c in got] == [c.tokens for c in want] == [c.tokens for c in unpacked]


def test_pack_linears_reaches_lora_bases_and_leaves_nf4_bases(loaded, onednn):
    """On a LoRA model (packed before add_lora, as launch.setup does, or after it) each adapter's
    frozen base is PackedLinear, the adapter itself not; an NF4 base (quantize.py) keeps its
    class. The sampler's products give the unpacked model's logits to fp32 rounding."""
    from variants.lora import LoRALinear, add_lora
    from variants.quantize import NF4Linear, quantize_lora_bases
    onednn(True)
    torch.manual_seed(0)
    plain = add_lora(copy.deepcopy(loaded("llama")[0]), rank=4, alpha=8.0)
    for adapter in plain.modules():
        if isinstance(adapter, LoRALinear):
            torch.nn.init.normal_(adapter.lora_b, std=0.02)  # (B = 0 would hide the adapters)
    before = S.pack_linears(add_lora(copy.deepcopy(loaded("llama")[0]), rank=4, alpha=8.0))
    before.load_state_dict(plain.state_dict())
    after = S.pack_linears(copy.deepcopy(plain))
    ids = random_ids(3, 9, plain.config.vocab_size, seed=5)
    with torch.no_grad():
        want = plain(ids)
        for model in (before, after):
            adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
            assert adapters and all(type(m.base) is S.PackedLinear for m in adapters)
            with S.sampling_products():
                assert max_diff(model(ids), want) < TOL
        quantized = S.pack_linears(quantize_lora_bases(copy.deepcopy(plain)))
        assert all(type(m.base) is NF4Linear for m in quantized.modules()
                   if isinstance(m, LoRALinear))
        with S.sampling_products():
            assert max_diff(quantized(ids), quantize_lora_bases(copy.deepcopy(plain))(ids)) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("update", ["fused AdamW", "copy_", ".to()"])
def test_packed_weights_follow_updates(loaded, onednn, update):
    """A weight changed after it was packed (an optimizer's step, fused ones included, which
    leave version counters as they were; the sampler copy's refresh; new storage) is packed again
    before its next product: the sampler gives F.linear's tokens, not the old weights' (which a
    stale packed copy would give). An unchanged weight is packed once."""
    from rollout import generate
    model = S.pack_linears(copy.deepcopy(loaded("llama")[0]))
    prompts, kw = [[5, 6, 7], [8, 9]], dict(max_new_tokens=8, temperature=0.0, compile=False)
    onednn(True)
    before = [c.tokens for c in generate(model, prompts, **generate_args(**kw))]  # packs every weight
    with torch.profiler.profile() as profile:
        generate(model, prompts, **generate_args(**kw))
    assert "mkldnn::_reorder_linear_weight" not in {e.key for e in profile.key_averages()}
    g = torch.Generator().manual_seed(0)
    new = {p: p + torch.randn(p.shape, generator=g) * 0.5 for p in model.parameters()}
    if update == "fused AdamW":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            if update == "copy_":
                p.copy_(new[p])
            elif update == ".to()":
                p.data = new[p].detach().double().to(p.dtype)  # new storage, same version
    after = [c.tokens for c in generate(model, prompts, **generate_args(**kw))]
    onednn(False)
    assert after == [c.tokens for c in generate(model, prompts, **generate_args(**kw))] and after != before


FAULTS = """
import resource, sys, torch
from engine import speed
if sys.argv[1] == "keep":
    speed.keep_freed_memory()
for step in range(100):  # a sampling step's logits, shifted and exp'd: (64, 49k) float32, 12.6 MB
    if step == 10:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = torch.ones(64, 49152)
    shifted = logits - 1
    probs = shifted.exp()
    del logits, shifted, probs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_freed_blocks_are_not_faulted_in_again():
    """speed.keep_freed_memory: blocks the size of a sampling step's logits, freed and taken
    again at every step, stay in the heap: at most a step's blocks faulted in once after the first
    steps (where the heap still grows), not every page of every step.
    Without it glibc maps such blocks afresh, in some processes and not others (its threshold
    moves with what was freed before); here its threshold is pinned at its starting 128 KB, the
    case where every page of every step is faulted in (~9,000 a step)."""
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=ROOT, check=True,
                             capture_output=True, text=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}).stdout
        return int(out.split()[-1])
    assert faults("keep") < 10_000 < 500_000 < faults("default")  # 90 steps, 3 x 3,072 pages each


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                         and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                    reason="oneDNN runs no bf16 on this CPU")
def test_bf16_sampling_products_run_on_packed_onednn(loaded, onednn):
    """In bf16 (where oneDNN runs it: AVX-512, AMX), the sampler's products take the packed
    weights too, with F.linear's logits to bf16 rounding."""
    onednn(True)  # whatever DAPO_CPU_ONEDNN the suite runs under
    model = S.pack_linears(copy.deepcopy(loaded("qwen2")[0]).to(torch.bfloat16))
    ids = random_ids(3, 9, model.config.vocab_size, seed=5)
    with torch.no_grad():
        want = model(ids).float()
        with S.sampling_products(), torch.profiler.profile() as profile:
            got = model(ids).float()
    assert "mkldnn::_linear_pointwise" in {event.key for event in profile.key_averages()}
    assert max_diff(got, want) < 0.05 * want.abs().max()


@pytest.mark.slow  # compiles one tiny block's forward and backward: ~10-30 s
@needs_cpp_compiler
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: soft cap, four norms a block
def test_compiled_blocks_equal_eager_and_sampling_stays_eager(tiny_ckpt, family):
    """speed.compile_blocks: the same log-probs and gradients as the eager blocks (with and
    without activation checkpointing); a forward with a KV cache (prefill, decode) takes the eager
    blocks, so sampling makes no new graph and gives the eager model's tokens."""
    from rollout import generate
    eager, _ = load_model(tiny_ckpt(family))
    compiled, _ = load_model(tiny_ckpt(family))
    S.compile_blocks(compiled.train())
    eager.train()
    ids, mask = _padded_batch(eager.config.vocab_size, seed=41)

    def loss(model):
        return lambda: token_logprobs(model, ids, mask, temperature=0.7).sum()

    with torch.profiler.profile() as profile:
        compiled_grads = _grads(compiled, loss(compiled))
    assert any(e.key.startswith("Torch-Compiled Region") for e in profile.key_averages())
    _assert_same_grads(compiled_grads, _grads(eager, loss(eager)))
    compiled.gradient_checkpointing = True
    _assert_same_grads(_grads(compiled, loss(compiled)), _grads(eager, loss(eager)))
    with torch.no_grad():  # the scoring forward: a graph of its own, made here
        assert max_diff(token_logprobs(compiled, ids, mask), token_logprobs(eager, ids, mask)) < TOL
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(num_samples=2, max_new_tokens=6, temperature=1.0, seed=3, compile=False)
    with torch.compiler.set_stance("fail_on_recompile"):  # a cached forward through a compiled
        got = generate(compiled.eval(), prompts, **generate_args(**kw))    # block would need a new graph
    want = generate(eager.eval(), prompts, **generate_args(**kw))
    assert [c.tokens for c in got] == [c.tokens for c in want]


def test_compile_blocks_refuses_a_mixture_of_experts(tiny_ckpt):
    moe_model, _ = load_model(tiny_ckpt("qwen3_moe"))
    with pytest.raises(ValueError, match="Mixture-of-Experts"):
        S.compile_blocks(moe_model)


def test_expandable_cuda_segments_unless_the_environment_says_otherwise(monkeypatch):
    from engine import speed
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    speed.expandable_cuda_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own
    speed.expandable_cuda_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
