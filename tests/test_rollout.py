"""Tests for rollout.py: greedy equality with transformers' generate on the bundled model, the
sampler's log-probs against a fresh forward pass, left padding, seeding, ordering, per-row stop
with and without compaction, top-k/top-p, the inverse-CDF sampler on hand-made distributions,
and bad input."""

import copy
import math
import os

import pytest
import torch

from conftest import FAMILIES, ROOT, generate_args, random_ids
from engine.paged import EngineOptions
from engine.speedups import SpeedUps
from model import token_logprobs
from rollout import (
    Completion,
    Sampling,
    generate,
    inverse_cdf,
    sample_keys,
    sample_tokens,
    step_uniforms,
)
from run.checkpoints import load_model

LP_TOL = 1e-3  # sampler log-probs against a fresh forward pass (issue 2, acceptance 2)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    """tiny(family) -> our float32 model of that family's tiny checkpoint (read-only)."""
    cache = {}

    def get(family="llama3"):
        if family not in cache:
            cache[family] = load_model(tiny_ckpt(family))[0]
        return cache[family]
    return get


def tiny_prompts(vocab, lengths=(7, 12, 3, 9), seed=0):
    return [random_ids(1, n, vocab, seed=seed + i)[0].tolist() for i, n in enumerate(lengths)]


def fresh_logprobs(model, prompt, completion, temperature):
    """Log-probs of the completion's tokens under a full forward of prompt + completion."""
    ids = torch.tensor([prompt + completion.tokens])
    with torch.no_grad():
        lp = token_logprobs(model, ids, temperature=temperature, chunk_size=16)[0]
    return lp[len(prompt) - 1:]


def assert_logprobs_match(model, prompts, completions, temperature):
    worst = 0.0
    for c in completions:
        got = torch.tensor(c.logprobs)
        assert len(got) == len(c.tokens) > 0
        want = fresh_logprobs(model, prompts[c.prompt_index], c, temperature)
        worst = max(worst, (got - want).abs().max().item())
    assert worst <= LP_TOL, worst


def tokens_of(completions):
    return [c.tokens for c in completions]


# ---------------------------------------------------------------------------------------------
# The bundled model: greedy equals transformers, log-probs equal a fresh forward
# ---------------------------------------------------------------------------------------------

QUESTIONS = ["What is 2 + 3?",
             "Name three primary colours.",
             "Write one short sentence about the sea and why so many people like to live "
             "near it, then stop."]


def chat_prompts(tokenizer, questions):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def bundled_greedy(smollm2):
    model, tok = smollm2
    prompts = chat_prompts(tok, QUESTIONS)
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: padding matters
    sampling = Sampling(max_new_tokens=32, temperature=0.0, stop_token_ids=[tok.eos_token_id])
    out = generate(model, prompts, sampling, engine=EngineOptions(speed=SpeedUps()))  # as train.py
    return prompts, out


@pytest.mark.slow  # ~5 s: transformers' model and its generate
def test_greedy_matches_transformers_generate(smollm2, smollm2_dir, bundled_greedy):
    from transformers import AutoModelForCausalLM, GenerationConfig
    _, tok = smollm2
    prompts, ours = bundled_greedy
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=eos,
                              pad_token_id=pad)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, generation_config=config)
    for i, c in enumerate(ours):
        want = out[i, width:].tolist()
        if eos in want:
            want = want[:want.index(eos) + 1]
        assert c.tokens == want, (i, tok.decode(c.tokens), tok.decode(want))
        assert c.finish_reason == ("stop" if want[-1] == eos else "length")
    assert ours[0].finish_reason == "stop"  # "2 + 3" is answered well within 32 tokens


@pytest.mark.slow
def test_greedy_left_padding_does_not_change_a_row(smollm2, bundled_greedy):
    model, tok = smollm2
    prompts, batched = bundled_greedy
    shortest = min(range(len(prompts)), key=lambda i: len(prompts[i]))
    alone = generate(model, [prompts[shortest]],
                     Sampling(max_new_tokens=32, temperature=0.0, stop_token_ids=[tok.eos_token_id],
                              seed=0), num_samples=1)
    assert alone[0].tokens == batched[shortest].tokens
    assert alone[0].logprobs == pytest.approx(batched[shortest].logprobs, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_bundled_logprobs_match_forward(smollm2, temperature, top_p):
    model, tok = smollm2
    prompts = chat_prompts(tok, QUESTIONS[:2])
    out = generate(model, prompts,
                   Sampling(max_new_tokens=16, temperature=temperature, top_p=top_p,
                            stop_token_ids=[tok.eos_token_id], seed=3), num_samples=2)
    assert_logprobs_match(model, prompts, out, temperature)


# ---------------------------------------------------------------------------------------------
# Tiny models: log-probs, padding, seeds, ordering
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0),
                                                     (0.7, 0.8, 20)])
@pytest.mark.slow
def test_logprobs_match_forward(tiny, family, temperature, top_p, top_k):
    """The returned log-probs are the tempered, untruncated ones, whatever top-p/top-k kept."""
    model = tiny(family)
    prompts = tiny_prompts(model.config.vocab_size)
    out = generate(model, prompts,
                   Sampling(max_new_tokens=20, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=[], seed=1), num_samples=3)
    assert len(out) == 12 and all(len(c.tokens) == 20 for c in out)
    assert_logprobs_match(model, prompts, out, temperature)


def test_greedy_logprobs_are_untempered(tiny):
    model = tiny("qwen2")
    prompts = tiny_prompts(model.config.vocab_size)
    out = generate(model, prompts, Sampling(max_new_tokens=12, temperature=0.0, seed=0),
                   num_samples=1)
    assert_logprobs_match(model, prompts, out, 1.0)
    for p, c in zip(prompts, out):  # each token is the argmax of its position
        ids = torch.tensor([p + c.tokens])
        with torch.no_grad():
            logits = model(ids)[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == c.tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_left_padding_tiny(tiny, family):
    model = tiny(family)
    prompts = tiny_prompts(model.config.vocab_size, lengths=(3, 30, 11))
    batched = generate(model, prompts, Sampling(max_new_tokens=16, temperature=0.0), num_samples=2)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], Sampling(max_new_tokens=16, temperature=0.0), num_samples=1)[0]
        for c in batched[2 * i:2 * i + 2]:
            assert c.prompt_index == i and c.tokens == alone.tokens
            assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_seed(tiny):
    model = tiny("llama3")
    prompts = tiny_prompts(model.config.vocab_size)
    kw = dict(num_samples=3, max_new_tokens=16, temperature=1.0)
    a = generate(model, prompts, **generate_args(seed=7, **kw))
    b = generate(model, prompts, **generate_args(seed=7, **kw))
    c = generate(model, prompts, **generate_args(seed=8, **kw))
    assert tokens_of(a) == tokens_of(b)
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert tokens_of(a) != tokens_of(c)
    # The G samples of one prompt are different draws, not copies.
    assert len({tuple(x.tokens) for x in a[:3]}) > 1


def test_per_prompt_seed_makes_samples_independent_of_the_batch(tiny):
    """A prompt's samples depend on its own seed only: alone, or beside others, same tokens.
    (This is what makes a DDP run sample what one process samples.)"""
    model = tiny("llama3")
    p0, p1 = tiny_prompts(model.config.vocab_size, lengths=(7, 12))
    kw = dict(num_samples=3, max_new_tokens=12, temperature=1.0)
    both = generate(model, [p0, p1], **generate_args(seed=[5, 6], **kw))
    alone = generate(model, [p1], **generate_args(seed=[6], **kw))
    assert tokens_of(both[3:]) == tokens_of(alone)
    with pytest.raises(ValueError, match="seed"):
        generate(model, [p0, p1], **generate_args(seed=[5], **kw))


def test_prompt_major_order(tiny):
    model = tiny("mistral")
    prompts = tiny_prompts(model.config.vocab_size, lengths=(5, 9, 2))
    out = generate(model, prompts, Sampling(max_new_tokens=10, temperature=0.0), num_samples=3)
    assert all(isinstance(c, Completion) for c in out)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for i, p in enumerate(prompts):  # greedy: every sample of prompt i is prompt i's greedy
        alone = generate(model, [p], Sampling(max_new_tokens=10, temperature=0.0), num_samples=1)[0]
        assert all(c.tokens == alone.tokens for c in out[3 * i:3 * i + 3])
    assert len({tuple(c.tokens) for c in out}) == 3  # and the prompts do differ


def test_num_samples_per_prompt(tiny):
    model = tiny("llama3")
    prompts = tiny_prompts(model.config.vocab_size, lengths=(5, 9, 2))
    out = generate(model, prompts, Sampling(max_new_tokens=8, temperature=1.0, seed=2),
                   num_samples=[2, 1, 3])
    assert [c.prompt_index for c in out] == [0, 0, 1, 2, 2, 2]
    assert_logprobs_match(model, prompts, out, 1.0)


# ---------------------------------------------------------------------------------------------
# Per-row stop and compaction
# ---------------------------------------------------------------------------------------------

def pick_stop_tokens(completions, horizon):
    """Tokens that end about half the rows before `horizon`, but never all of them."""
    rows = {}
    for r, c in enumerate(completions):
        for t in c.tokens[:horizon]:
            rows.setdefault(t, set()).add(r)
    chosen, covered = [], set()
    for t, hit in sorted(rows.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(covered | hit) >= len(completions):
            continue
        chosen.append(t)
        covered |= hit
        if len(covered) >= len(completions) // 2:
            break
    assert len(covered) >= len(completions) // 3, "the draw gives too few early stops"
    return chosen


def decode_batches(model, monkeypatch):
    """-> a list that fills with the row count of each decode step (model.paged with T = 1)."""
    sizes, paged = [], model.paged
    monkeypatch.setattr(model, "paged", lambda tokens, *args, **kw: (
        tokens.shape[1] == 1 and sizes.append(tokens.shape[0])) or paged(tokens, *args, **kw))
    return sizes


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_stop_does_not_change_samples(tiny, family, monkeypatch):
    """A row ends at its first stop token and leaves the batch at once (its blocks freed); the
    other samples stay as they are, because each row's uniforms count its own tokens."""
    model = tiny(family)
    prompts = tiny_prompts(model.config.vocab_size, lengths=(7, 12, 3, 9, 5, 16))
    kw = dict(num_samples=3, max_new_tokens=24, temperature=1.0, seed=11)
    free = generate(model, prompts, **generate_args(stop_token_ids=[], **kw))
    assert all(c.finish_reason == "length" and len(c.tokens) == 24 for c in free)
    stop = pick_stop_tokens(free, horizon=12)

    expected = []
    for c in free:
        cut = next((i for i, t in enumerate(c.tokens) if t in stop), None)
        expected.append((c.tokens, "length") if cut is None else (c.tokens[:cut + 1], "stop"))
    assert any(r == "stop" for _, r in expected) and any(r == "length" for _, r in expected)

    sizes = decode_batches(model, monkeypatch)
    out = generate(model, prompts, **generate_args(stop_token_ids=stop, **kw))
    for c, f, (toks, reason) in zip(out, free, expected):
        assert c.tokens == toks and c.finish_reason == reason
        if reason == "stop":
            assert c.tokens[-1] in stop and not set(c.tokens[:-1]) & set(stop)
        assert len(c.logprobs) == len(c.tokens)
        assert c.logprobs == pytest.approx(f.logprobs[:len(toks)], abs=1e-4)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0] <= len(out)  # shrinks


def test_stop_on_first_token_and_all_rows(tiny):
    model = tiny("llama")
    prompts = tiny_prompts(model.config.vocab_size)
    greedy = generate(model, prompts, Sampling(max_new_tokens=6, temperature=0.0), num_samples=1)
    first = sorted({c.tokens[0] for c in greedy})  # every row stops at step one
    out = generate(model, prompts,
                   Sampling(max_new_tokens=6, temperature=0.0, stop_token_ids=first), num_samples=1)
    for c, g in zip(out, greedy):
        assert c.tokens == g.tokens[:1] and c.finish_reason == "stop"
        assert c.logprobs == pytest.approx(g.logprobs[:1], abs=1e-5)


# ---------------------------------------------------------------------------------------------
# top-k / top-p against greedy
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)])
def test_extreme_truncation_is_greedy(tiny, kw):
    model = tiny("qwen3")
    prompts = tiny_prompts(model.config.vocab_size)
    greedy = generate(model, prompts, Sampling(max_new_tokens=16, temperature=0.0), num_samples=2)
    sampled = generate(model, prompts,
                       **generate_args(num_samples=2, max_new_tokens=16, temperature=1.0, seed=5,
                                       **kw))
    assert tokens_of(sampled) == tokens_of(greedy)
    for s, g in zip(sampled, greedy):  # at temperature 1 both are the policy's own log-probs
        assert s.logprobs == pytest.approx(g.logprobs, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# sample_tokens on hand-made distributions
# ---------------------------------------------------------------------------------------------

P = torch.tensor([0.1, 0.2, 0.3, 0.4])  # cdf 0.1, 0.3, 0.6, 1.0


def _draw(u, probs=P, temperature=1.0, **kw):
    u = torch.tensor(u, dtype=torch.float32)
    logits = probs.log().expand(len(u), -1).contiguous()
    return sample_tokens(logits, u, temperature=temperature, **kw)


def test_inverse_cdf_picks_the_predicted_token():
    tokens, logp = _draw([0.0, 0.05, 0.15, 0.29, 0.31, 0.59, 0.61, 0.99, 0.999999])
    assert tokens.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert torch.allclose(logp, P.log()[tokens], atol=1e-6)


def test_temperature_reshapes_and_logprob_is_tempered():
    # p^(1/0.5) normalised: [1, 4, 9, 16] / 30 -> cdf 1/30, 5/30, 14/30, 1
    tokens, logp = _draw([0.02, 0.04, 0.16, 0.18, 0.46, 0.48], temperature=0.5)
    assert tokens.tolist() == [0, 1, 1, 2, 2, 3]
    want = torch.tensor([1.0, 4.0, 9.0, 16.0]) / 30
    assert torch.allclose(logp, want.log()[tokens], atol=1e-6)


def test_top_k_truncates_but_logprob_does_not():
    # top-2 keeps tokens 2, 3 renormalised to 3/7, 4/7 (cdf in vocabulary order: 0, 0, 3/7, 1).
    tokens, logp = _draw([0.0, 0.2, 0.42, 0.43, 0.9], top_k=2)
    assert tokens.tolist() == [2, 2, 2, 3, 3]
    assert torch.allclose(logp, P.log()[tokens], atol=1e-6)  # untruncated


def test_top_p_keeps_the_smallest_nucleus():
    # Sorted 0.4, 0.3, 0.2, 0.1: top_p 0.5 needs {3, 2} (0.4 < 0.5 <= 0.7).
    tokens, logp = _draw([0.0, 0.5, 0.56, 0.58, 0.99], top_p=0.5)
    assert set(tokens.tolist()) <= {2, 3}
    assert tokens.tolist() == [3, 3, 3, 2, 2]  # 0.4 / 0.7 = 0.571...
    assert torch.allclose(logp, P.log()[tokens], atol=1e-6)
    tokens, _ = _draw([0.0, 0.5, 0.99], top_p=0.35)  # {3} alone holds 0.4 >= 0.35
    assert tokens.tolist() == [3, 3, 3]


def test_temperature_zero_is_argmax_with_untempered_logprob():
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logp = sample_tokens(logits, torch.tensor([0.9, 0.1]), temperature=0.0)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.6, 1.0, 0),
                                                     (1.3, 1.0, 5), (0.9, 0.7, 0),
                                                     (1.0, 0.6, 4)])
def test_empirical_distribution_matches(temperature, top_p, top_k):
    """Uniforms on an even grid hit each token in proportion to its (truncated, renormalised)
    probability, up to the grid spacing."""
    torch.manual_seed(0)
    V, N = 12, 50_000
    logits = torch.randn(V) * 1.5
    probs = torch.softmax(logits / temperature, -1)
    keep = torch.ones(V, dtype=torch.bool)
    if top_k:
        keep &= probs >= probs.topk(top_k).values[-1]
    if top_p < 1:
        sp, order = probs.sort(descending=True)
        nucleus = order[(sp.cumsum(0) - sp) < top_p]
        keep &= torch.zeros(V, dtype=torch.bool).index_fill_(0, nucleus, True)
    want = torch.where(keep, probs, 0.0)
    want = want / want.sum()
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    tokens, logp = sample_tokens(logits.expand(N, V).contiguous(), u.float(), temperature,
                                 top_p, top_k)
    freq = torch.bincount(tokens, minlength=V).double() / N
    assert (freq - want.double()).abs().max() <= 3.0 / N + 1e-5, (freq, want)
    assert torch.allclose(logp, torch.log_softmax(logits / temperature, -1)[tokens], atol=1e-5)
    # Random uniforms agree too, within sampling noise.
    tokens, _ = sample_tokens(logits.expand(N, V).contiguous(), torch.rand(N), temperature,
                              top_p, top_k)
    freq = torch.bincount(tokens, minlength=V).double() / N
    sd = (want.double() * (1 - want.double()) / N).sqrt()
    assert ((freq - want.double()).abs() <= 5 * sd + 1e-9).all()


# ---------------------------------------------------------------------------------------------
# Bad input: a clear ValueError before any work
# ---------------------------------------------------------------------------------------------

def test_bad_input(tiny):
    model = tiny("mistral")
    ctx = model.config.max_seq_len
    ok = [[5, 6, 7]]
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[5, 6], []], Sampling(max_new_tokens=4), num_samples=1)
    with pytest.raises(ValueError, match="prompts"):
        generate(model, [], Sampling(max_new_tokens=4), num_samples=1)
    with pytest.raises(ValueError, match="context"):
        generate(model, [[5] * (ctx - 3)], Sampling(max_new_tokens=4), num_samples=1)
    with pytest.raises(ValueError, match="num_samples"):
        generate(model, ok, Sampling(max_new_tokens=4), num_samples=0)
    with pytest.raises(ValueError, match="num_samples"):
        generate(model, ok + ok, Sampling(max_new_tokens=4), num_samples=[1, 0])
    with pytest.raises(ValueError, match="num_samples"):
        generate(model, ok + ok, Sampling(max_new_tokens=4), num_samples=[1])
    with pytest.raises(ValueError, match="check_every"):
        generate(model, ok, Sampling(max_new_tokens=4), num_samples=1, check_every=0)
    # Exactly at the context is fine.
    out = generate(model, [[5] * (ctx - 4)], Sampling(max_new_tokens=4, temperature=0.0),
                   num_samples=1)
    assert len(out[0].tokens) == 4


def test_length_finish(tiny):
    model = tiny("llama")
    out = generate(model, tiny_prompts(model.config.vocab_size),
                   Sampling(max_new_tokens=5, temperature=1.0, stop_token_ids=[], seed=0),
                   num_samples=2)
    assert all(c.finish_reason == "length" and len(c.tokens) == len(c.logprobs) == 5
               for c in out)
    assert all(math.isfinite(x) and x <= 0 for c in out for x in c.logprobs)


@pytest.mark.parametrize("flags, named", [(["sampler", "--device", "gpu0"], "--device gpu0"),
                                          (["sampler", "--dtypes", "fp32"], "--dtypes"),
                                          (["moe", "--device", "cuda"], "cpu only"),
                                          (["sampling"], "invalid choice"),
                                          (["sampler", "--model", "/no/such/model"], "/no/such/model"),
                                          (["sampler", "--device", "mps"], "runs on cpu or cuda"),
                                          (["sampler", "--threads", "-1"], "--threads must be"),
                                          (["update", "--paths", "ours,vllm"], "--paths: 'vllm'"),
                                          (["refills", "--rounds", "0"], "--repeats and --rounds >= 1")])
@pytest.mark.slow
def test_bench_flags_are_checked_before_any_work(flags, named):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "recipes" / "bench.py")] + flags,
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_refills_runs_and_checks_its_samples(smollm2):
    """`python recipes/bench.py refills` on the bundled model, a few tokens: the rounds one after
    another and in one queue draw the same samples (the bench asserts it) and each prints its
    rate."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "recipes" / "bench.py"), "refills", "--prompts", "2",
                           "--samples", "2", "--new-tokens", "8", "--rounds", "3", "--repeats", "1",
                           "--threads", "1"], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 rounds of 2 prompts x 2 samples" in proc.stdout and "one queue" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Every family: greedy equals transformers' generate, past the sliding window (issue 11)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma3_mm", "gemma2", "qwen3_moe",
                                    "mixtral"])
@pytest.mark.slow
def test_greedy_matches_transformers_every_family(tiny, tiny_ckpt, family):
    """Prompts of 5-12 tokens + 24 new ones run past the window of 16. Ours runs them in one
    left-padded batch; transformers each alone (its sliding window counts padding slots, so a
    padded row would see fewer real tokens there: padding must not change a row)."""
    from transformers import GenerationConfig

    from conftest import PAD_ID, hf_model
    model = tiny(family)
    prompts = tiny_prompts(model.config.vocab_size, lengths=(5, 12, 9))
    ours = generate(model, prompts, Sampling(max_new_tokens=24, temperature=0.0),
                    engine=EngineOptions(speed=SpeedUps()))  # the CPU's kept rows, as train.py's
    hf = hf_model(tiny_ckpt(family))
    config = GenerationConfig(do_sample=False, max_new_tokens=24, min_new_tokens=24,
                              pad_token_id=PAD_ID, eos_token_id=None)
    for p, c in zip(prompts, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()
        assert c.tokens == want, (family, c.tokens, want)
    assert len({t for c in ours for t in c.tokens}) > 2  # not one token repeated
    assert_logprobs_match(model, prompts, ours, 1.0)


def test_recorded_routing_is_what_a_fresh_forward_routes(tiny):
    """record_routing: each completion's experts, position by position (prompt, then tokens),
    equal those of one forward over prompt + completion; the last token's are -1 unless the
    row, stopped but not yet dropped, was fed it.
    Rows are left-padded and compacted as they stop, so the bookkeeping is exercised."""
    from variants.moe import Routing
    model = tiny("qwen3_moe")
    prompts = tiny_prompts(model.config.vocab_size, lengths=(5, 12, 9))
    out = generate(model, prompts,
                   Sampling(max_new_tokens=10, temperature=1.0, stop_token_ids=list(range(4, 40)),
                            seed=4), num_samples=2, record_routing=True)
    assert len({len(c.tokens) for c in out}) > 1  # rows stopped at different steps
    for c in out:
        ids = torch.tensor([prompts[c.prompt_index] + c.tokens])
        fresh = Routing()
        with torch.no_grad():
            model(ids, routing=fresh)
        want = fresh.stacked(model.config)[0]  # (T, L, k)
        assert c.routing.shape == want.shape and c.routing.dtype == torch.int16
        assert torch.equal(c.routing[:-1].long(), want[:-1])
        assert (c.routing[-1] == -1).all() or torch.equal(c.routing[-1].long(), want[-1])
    dense = generate(tiny("llama"), [[5, 6, 7]], Sampling(max_new_tokens=3), record_routing=True)
    assert all(c.routing is None for c in dense)


# ---------------------------------------------------------------------------------------------
# The decode step: counter-based uniforms, compiled == eager, one host read per check
# ---------------------------------------------------------------------------------------------

def test_sample_keys_and_uniforms_are_a_prompts_own():
    """A row's key depends on its prompt's seed and its sample index only; a step's uniforms
    are a function of (key, step): the same alone or beside other rows."""
    both = sample_keys([5, 6, 2**40 + 5], [2, 3, 1])  # (6,)
    assert torch.equal(both[2:5], sample_keys([6], [3])) and torch.equal(both[:2], sample_keys([5], [2]))
    assert both[5] != both[0]  # the seed's high bits count
    assert len(set(both.tolist())) == 6
    for step in (0, 1, 17):
        assert torch.equal(step_uniforms(both, step)[2:5], step_uniforms(sample_keys([6], [3]), step))
        assert torch.equal(step_uniforms(both, step), step_uniforms(both, torch.tensor([step])))
    assert not torch.equal(step_uniforms(both, 0), step_uniforms(both, 1))


def test_step_uniforms_are_uniform():
    keys = sample_keys(range(64), [16] * 64)  # (1024,)
    u = torch.cat([step_uniforms(keys, step) for step in range(64)])  # 65,536 draws
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = len(u) / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 40  # chi-square, 15 degrees of freedom: p ~ 5e-4
    lag = torch.corrcoef(torch.stack([step_uniforms(keys, 3), step_uniforms(keys, 4)]))[0, 1]
    assert abs(lag) < 0.1  # successive steps of a row are not correlated


@pytest.mark.slow  # compiles a tiny model's step: ~5-15 s each
@pytest.mark.parametrize("family, onednn", [("llama3", "1"), ("mistral", "0")])
def test_compiled_step_equals_eager(tiny, family, onednn, monkeypatch):
    """The compiled decode step gives the eager one's greedy tokens and, for one seed, its
    samples and log-probs (within float32 rounding), stop tokens and compaction included, and a
    new batch size, prompt length or cache length is no new compile (shapes are dynamic, the
    cache's read length after its first change). With oneDNN's packed products
    (speed.pack_linears) the compiled step calls them too, as one opaque op."""
    import torch._dynamo

    from engine import speed as S
    monkeypatch.setenv("DAPO_CPU_ONEDNN", onednn)
    S.onednn_dtypes.cache_clear()
    model = S.pack_linears(copy.deepcopy(tiny(family)))  # (the fixture's model stays plain)
    # Every prompt over a block of 16, so no table is one block wide (a size of 1 is a constant
    # to dynamo: a compile of its own, once for each temperature here)
    prompts = tiny_prompts(model.config.vocab_size, lengths=(23, 28, 17, 25, 21))
    torch._dynamo.reset()
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=3, stop_token_ids=[9, 17, 30]),
               dict(temperature=0.8, top_p=0.9, top_k=20, seed=4)):
        kw = dict(num_samples=3, max_new_tokens=24, **kw)
        eager = generate(model, prompts, **generate_args(compile=False, **kw))
        compiled = generate(model, prompts, **generate_args(compile=True, **kw))
        for a, b in zip(eager, compiled):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.profiler.profile() as profile:
        generate(model, prompts[:2], Sampling(max_new_tokens=60, temperature=1.0), num_samples=2,
                 engine=EngineOptions(speed=SpeedUps(compile=True)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    ops = {event.key for event in profile.key_averages()}
    packed = onednn == "1" and torch.backends.mkldnn.is_available()
    assert ("dapo::packed_linear" in ops) == packed
    monkeypatch.undo()
    S.onednn_dtypes.cache_clear()


def test_stream_sees_each_prefix_of_the_result_at_each_check(tiny):
    """generate(stream=...) is called every `check_every` decode steps with the tokens so far:
    prefixes of the final completions (zeros past a row's end), and the samples are the same as
    without it."""
    model = tiny("llama3")
    prompts = tiny_prompts(model.config.vocab_size)
    kwargs = dict(num_samples=2, max_new_tokens=12, temperature=1.0, stop_token_ids=[5, 9], seed=3,
                  compile=False, check_every=4)
    seen = []
    streamed = generate(model, prompts,
                        **generate_args(stream=lambda tokens: seen.append(tokens.tolist()),
                                        **kwargs))
    assert [c.tokens for c in streamed] == [c.tokens for c in generate(model, prompts,
                                                                       **generate_args(**kwargs))]
    assert seen and [len(tokens[0]) for tokens in seen] == sorted(len(t[0]) for t in seen)
    for tokens in seen:
        for row, completion in zip(tokens, streamed):
            cut = min(len(row), len(completion.tokens))
            assert row[:cut] == completion.tokens[:cut] and not any(row[cut:])


def test_the_engine_reads_the_host_once_per_step(tiny, monkeypatch):
    """The host reads a device value once per forward that draws tokens (each decode step, and
    each prefill that completes prompts): the drawn tokens and their log-probs, together (on
    CUDA each read waits for the queue of kernels)."""
    model = tiny("llama3")
    prompts, reads = tiny_prompts(model.config.vocab_size), []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    stats = {}
    generate(model, prompts, Sampling(max_new_tokens=30, temperature=1.0, stop_token_ids=[]),
             num_samples=2, engine=EngineOptions(speed=SpeedUps(compile=False)), stats=stats)
    monkeypatch.undo()
    assert stats["decode_steps"] == 29 and reads == ["tolist"] * (29 + 1), reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_no_host_sync_between_checks_on_cuda(tiny_ckpt, compiled):
    """torch.cuda.set_sync_debug_mode("error") raises at any synchronising call: none may come
    from a decode step (the checks every `check_every` steps are the only ones)."""
    from engine import speedups
    model = load_model(tiny_ckpt("llama3"), dtype=torch.float32, device="cuda")[0]
    prompts = tiny_prompts(model.config.vocab_size)
    kw = dict(num_samples=2, max_new_tokens=12, temperature=1.0, stop_token_ids=[9], seed=1)
    want = generate(model, prompts, **generate_args(compile=compiled, **kw))  # warm-up (and compile)
    step_fn = speedups.compiled_step(model.device) if compiled else speedups.decode_step

    def strict_step(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step_fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    original = speedups.compiled_step if compiled else speedups.decode_step
    try:
        if compiled:
            speedups.compiled_step = lambda device: strict_step
        else:
            speedups.decode_step = strict_step
        got = generate(model, prompts, **generate_args(compile=compiled, **kw))
    finally:
        if compiled:
            speedups.compiled_step = original
        else:
            speedups.decode_step = original
    assert [c.tokens for c in got] == [c.tokens for c in want]


def test_two_level_inverse_cdf_is_the_one_level_one():
    """inverse_cdf in chunks picks what one cumulative sum over the vocabulary picks (integer
    weights: every sum exact), never a zero-weight token, and at the edges u = 0 and u -> 1."""
    g = torch.Generator().manual_seed(0)
    weights = torch.randint(0, 4, (64, 1000), generator=g).float()  # 0 = a truncated token
    weights[:, 997:] = 0  # a zero tail: the padding chunk and the last chunk end on zeros
    weights[0] = 0
    weights[0, 300] = 5  # one token alone
    uniforms = torch.cat([torch.tensor([0.0, 1 - 2**-24]), torch.rand(62, generator=g)])
    cdf = weights.cumsum(-1)
    want = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    for chunk in (7, 256, 1024):
        got = inverse_cdf(weights, uniforms, chunk=chunk)
        assert torch.equal(got, want), chunk
        assert (weights.gather(-1, got[:, None]) > 0).all()


def test_rollout_copies_with_the_model_and_the_engine_alone(tmp_path, tiny):
    """rollout.py copied out with only what it imports, model.py and engine/paged.py (and the
    model's own MoE layer and log-prob kernel), none of the speed-ups' files: it imports, samples
    a tiny random model's weights, and draws what the repository's rollout draws."""
    import shutil
    import subprocess
    import sys
    files = ["rollout.py", "model.py", "engine/__init__.py", "engine/paged.py",
             "engine/chunked_logprobs.py", "variants/__init__.py", "variants/moe.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    model = tiny("llama3")
    torch.save({"config": model.config, "state": model.state_dict()}, tmp_path / "tiny.pt")
    prompts = tiny_prompts(model.config.vocab_size)
    code = f"""
import os, sys, torch
import model, rollout
saved = torch.load("tiny.pt", weights_only=False)
net = model.Transformer(saved["config"])
net.load_state_dict(saved["state"])
out = rollout.generate(net, {prompts}, rollout.Sampling(max_new_tokens=6, seed=3), num_samples=2)
assert all(m.__file__.startswith(os.getcwd()) for m in (model, rollout))
speedups = {{"engine.speed", "engine.cuda_graphs", "engine.flex_decode", "engine.speedups"}}
assert not speedups & set(sys.modules), speedups & set(sys.modules)
print([c.tokens for c in out])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", "")}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = generate(model, prompts, Sampling(max_new_tokens=6, seed=3), num_samples=2)
    assert proc.stdout.strip() == str([c.tokens for c in want])
