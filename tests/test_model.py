"""Tests for model.py: logit parity with transformers on tiny random checkpoints of every family
(and on the bundled SmolLM2 against transformers' own GGUF loading), checkpoint loading and
saving (sharded, round trip, LoRA merged on save, clear errors), the KV cache, chunked token
log-probs and their gradients, LoRA."""

import dataclasses
import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import model as M
from conftest import EOS_ID, FAMILIES, PAD_ID, WINDOW, hf_model, random_ids, tiny_checkpoint
from model import PagedKVCache, token_logprobs
from run import checkpoints
from run.checkpoints import load_model, save_model
from variants import moe
from variants.lora import LoRALinear, add_lora, lora_disabled, merge_lora
from variants.moe import Routing

TOL = 1e-4  # float32 logit parity (issue 2, acceptance 1)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def left_pad(rows, pad=PAD_ID):
    """list of 1-D id tensors -> ids (B, T) left-padded, mask (B, T)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def randomise_lora_(model, seed=0, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(scale * torch.randn(m.lora_b.shape, generator=g))


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    """loaded(family) -> (ours, hf), both float32 eval, built once per module. Read-only."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_ckpt(family)
            cache[family] = (load_model(path)[0], hf_model(path))
        return cache[family]
    return get


# ---------------------------------------------------------------------------------------------
# Logit parity with transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(loaded, family):
    ours, hf = loaded(family)
    # The checkpoint really exercises every weight: no norm left at ones, no bias at zeros.
    for name, p in ours.named_parameters():
        if "norm" in name or name.endswith("bias"):
            assert not torch.all(p == 1) and not torch.all(p == 0), name
    ids = random_ids(2, 100, ours.config.vocab_size, seed=1)  # 100 > original context 64 (llama3)
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert out.shape == ref.shape == (2, 100, ours.config.vocab_size)
    assert out.dtype == torch.float32
    assert max_diff(out, ref) <= TOL, max_diff(out, ref)
    assert ref.std() > 0.5  # logits of a useful scale, so the tolerance means something


def test_family_features_are_read(loaded):
    """What each family adds reached our config (else parity would be luck)."""
    assert loaded("llama")[0].config.tie_word_embeddings
    assert loaded("llama")[0].output.weight is loaded("llama")[0].tok_embeddings.weight
    l3 = loaded("llama3")[0]
    assert l3.config.rope_scaling["rope_type"] == "llama3" and not l3.config.tie_word_embeddings
    assert loaded("qwen2")[0].config.qkv_bias
    q3 = loaded("qwen3")[0]
    assert q3.config.qk_norm and q3.config.head_dim == 32


def test_llama3_rope_scaling_changes_logits(loaded):
    """Without Llama 3's frequency scaling the logits are visibly wrong: the parity test above
    can tell the two apart."""
    ours, hf = loaded("llama3")
    plain = dataclasses.replace(ours.config, rope_scaling=None)
    assert not torch.allclose(M.rope_inv_freq(plain), ours.inv_freq)
    ids = random_ids(1, 100, ours.config.vocab_size, seed=2)
    saved = ours.inv_freq
    try:
        ours.inv_freq = M.rope_inv_freq(plain)
        with torch.no_grad():
            wrong = ours(ids)
    finally:
        ours.inv_freq = saved
    with torch.no_grad():
        assert max_diff(wrong, hf(ids).logits) > 100 * TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_matches_unpadded_transformers(loaded, family):
    """Each left-padded row's logits on its real positions equal transformers on that row alone."""
    ours, hf = loaded(family)
    lengths = [37, 21, 6]
    rows = [random_ids(1, n, ours.config.vocab_size, seed=10 + n)[0] for n in lengths]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask)
        for i, r in enumerate(rows):
            ref = hf(r[None]).logits[0]
            got = out[i, ids.shape[1] - len(r):]
            assert max_diff(got, ref) <= TOL, (i, max_diff(got, ref))
        assert torch.isfinite(out).all()  # padding positions too


def test_sharded_checkpoint_loads(tmp_path):
    path = tiny_checkpoint("llama3", tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    ours, _ = load_model(path)
    ids = random_ids(2, 30, ours.config.vocab_size, seed=3)
    with torch.no_grad():
        assert max_diff(ours(ids), hf_model(path)(ids).logits) <= TOL


def test_load_dtype_and_tokenizer(tiny_ckpt, loaded):
    path = tiny_ckpt("llama")
    bf, tok = load_model(path, dtype=torch.bfloat16, device="cpu")
    assert bf.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf.parameters())
    assert not bf.training
    assert tok.eos_token_id == EOS_ID and tok("t5 t6 </s>")["input_ids"] == [5, 6, EOS_ID]
    ids = random_ids(1, 20, bf.config.vocab_size, seed=4)
    with torch.no_grad():
        assert max_diff(bf(ids), loaded("llama")[0](ids)) < 0.2  # bf16 rounding only


def test_rotary_frequencies_stay_float32_whatever_the_dtype(loaded):
    """Casting a model (e.g. train.py's bf16 rollout copy) must not round its rotary frequencies:
    in bf16 they would be up to ~0.7 rad off at position 4096."""
    import copy
    ours = loaded("llama")[0]
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu")):
        m = cast(copy.deepcopy(ours))
        assert m.inv_freq.dtype == torch.float32
        assert torch.equal(m.inv_freq, M.rope_inv_freq(ours.config))


def test_expanded_kv_heads_equal_grouped_attention():
    """model.attend's CUDA path (key/value heads copied out for the masked fused kernel) computes
    what enable_gqa does, with a padding mask and with plain causal attention."""
    torch.manual_seed(0)
    B, Hq, Hkv, T, D = 2, 6, 2, 5, 8
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (causal[None] & torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)[:, None])
    mask = (mask | torch.eye(T, dtype=torch.bool))[:, None]  # (B, 1, T, T)
    for m in (mask, None):
        grouped = M.attend(q, k, v, m)
        expanded = M.attend(q, k, v, m, expand_kv=True)
        assert torch.allclose(grouped, expanded, atol=1e-6)
    # and both equal the textbook formula, query head h reading key/value head h // (Hq / Hkv)
    kk, vv = k[:, [h // 3 for h in range(Hq)]], v[:, [h // 3 for h in range(Hq)]]
    scores = (q @ kk.transpose(-1, -2)) / D ** 0.5
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv
    assert torch.allclose(M.attend(q, k, v, mask, expand_kv=True), want, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# save_model
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_save_model_round_trips_through_transformers(tiny_ckpt, tmp_path, family):
    ours, tok = load_model(tiny_ckpt(family))
    out = save_model(ours, tok, str(tmp_path / "saved"))
    ids = random_ids(2, 40, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        want = ours(ids)
        assert max_diff(hf_model(out)(ids).logits, want) <= TOL
        assert max_diff(load_model(out)[0](ids), want) <= TOL


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen3_moe", "gemma3_mm"])
def test_save_model_merges_lora(tiny_ckpt, tmp_path, family):
    """Tied and untied heads; adapters on experts; a multimodal checkpoint saved as text."""
    ours, tok = load_model(tiny_ckpt(family))
    ids = random_ids(2, 30, ours.config.vocab_size, seed=6)
    with torch.no_grad():
        base = ours(ids)
    add_lora(ours, rank=4, alpha=8.0)
    randomise_lora_(ours)
    with torch.no_grad():
        adapted = ours(ids)
    assert max_diff(adapted, base) > 1e-2  # the adapters matter
    out = save_model(ours, tok, str(tmp_path / "merged"))
    with torch.no_grad():
        assert max_diff(hf_model(out)(ids).logits, adapted) <= TOL
        assert max_diff(load_model(out)[0](ids), adapted) <= TOL
        # The live model keeps its adapters.
        assert any(isinstance(m, LoRALinear) for m in ours.modules())
        assert max_diff(ours(ids), adapted) == 0
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert not any("lora" in n or ".base." in n for n in names)


def test_save_model_replaces_atomically(tiny_ckpt, tmp_path):
    ours, tok = load_model(tiny_ckpt("qwen2"))
    out = str(tmp_path / "run" / "final")
    save_model(ours, tok, out)
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(0.5)
    save_model(ours, tok, out)  # over an existing directory
    assert sorted(os.listdir(tmp_path / "run")) == ["final"]  # no temporary left behind
    ids = random_ids(1, 10, ours.config.vocab_size, seed=7)
    with torch.no_grad():
        assert max_diff(load_model(out)[0](ids), ours(ids)) <= TOL


def test_saved_model_and_eval_results_follow_the_umask(tiny_ckpt, tmp_path):
    """final/ and eval.py's results are written under temporary names (private, 0700 and 0600,
    by default) and renamed: they get the permissions the user's umask gives any file."""
    import stat

    import eval as ev
    ours, tok = load_model(tiny_ckpt("llama"))
    old = os.umask(0o022)
    try:
        save_model(ours, tok, str(tmp_path / "final"))
        ev.write_jsonl_atomic(str(tmp_path / "results.jsonl"), [{"a": 1}])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "final").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "results.jsonl").st_mode) == 0o644


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------

def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        load_model(str(tmp_path))


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "no-such-dir"))
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "no-such-file.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))  # a directory without a checkpoint


def test_corrupt_safetensors_names_the_file(tmp_path):
    path = tiny_checkpoint("llama", tmp_path / "ckpt")
    weights = os.path.join(path, "model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path)


def test_damaged_pytorch_model_bin_is_one_line_that_never_advises_running_its_code(tmp_path):
    """A truncated pytorch_model.bin, and one that holds more than tensors: a ValueError naming
    the file, never torch's advice to load it with weights_only=False (which runs its code)."""
    path = tiny_checkpoint("llama", tmp_path / "ckpt")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    weights = os.path.join(path, "pytorch_model.bin")
    torch.save(tensors, weights)
    assert load_model(path)[0] is not None  # whole, it loads
    data = open(weights, "rb").read()
    for damaged in (data[:len(data) // 2], None):
        if damaged is None:
            torch.save({"weights": tensors, "code": os.getcwd}, weights)  # a function inside
        else:
            open(weights, "wb").write(damaged)
        with pytest.raises(ValueError, match="pytorch_model.bin: cannot read it") as error:
            load_model(path)
        assert "weights_only" not in str(error.value) and error.value.__cause__ is None


def _rewrite_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = tiny_checkpoint("llama3", tmp_path / "ckpt")
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = tiny_checkpoint("llama3", tmp_path / "ckpt")
    _rewrite_tensors(path, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra\.weight"):
        load_model(path)


def test_misshaped_tensor_is_named(tmp_path):
    path = tiny_checkpoint("qwen2", tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_tensors(path, lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(path)


# ---------------------------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bundled_second_load_is_fast(smollm2):
    t = time.perf_counter()
    model, tok = load_model()  # the session fixture already converted the GGUF once
    elapsed = time.perf_counter() - t
    assert elapsed < 5.0, f"second load_model() took {elapsed:.1f} s"
    assert model.config.vocab_size == 49152 and tok.eos_token_id is not None
    assert tok.chat_template  # the chat template survived the conversion
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), smollm2[0].parameters()))


@pytest.mark.slow
def test_bundled_matches_transformers_gguf(smollm2):
    """Our conversion + model against transformers reading the GGUF file itself (~25 s)."""
    model, tok = smollm2
    gguf = checkpoints.bundled_gguf_path()
    hf = hf_model(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Explain."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        diff = max_diff(model(ids), hf(ids).logits)
    assert diff <= 1e-3, diff


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "llama3", "qwen3", "mistral", "gemma3", "gemma2",
                                    "qwen3_moe", "mixtral"])  # 24 tokens: past the window of 16
def test_paged_forward_matches_full_forward(loaded, family):
    """Rows of different lengths, their blocks scattered through the pool: a 10-token prefill
    chunk, a 3-token one, then one token at a time give, at every position, the logits of one
    full forward of each row alone."""
    ours, _ = loaded(family)
    lengths, block_size = [24, 19, 15], 4
    rows = [random_ids(1, n, ours.config.vocab_size, seed=20 + n)[0] for n in lengths]
    blocks = torch.randperm(3 * 6, generator=torch.Generator().manual_seed(0)) + 1  # not 0
    tables = blocks.view(3, 6)  # (b, nb): 6 blocks of 4 positions a row, in no order
    cache = PagedKVCache(ours.config, 1 + 3 * 6, block_size, torch.float32, "cpu")
    with torch.no_grad():
        for start, end in [(0, 10), (10, 13)] + [(t, t + 1) for t in range(13, 24)]:
            count = torch.tensor([max(0, min(end, n) - start) for n in lengths])  # (b,)
            live = count > 0
            tokens = torch.stack([torch.cat([r, torch.zeros(24, dtype=torch.long)])[start:end]
                                  for r in rows])  # (b, T), right-padded
            logits = ours.paged(tokens[live], torch.full((int(live.sum()),), start),
                                count[live], tables[live], cache)  # (b', V)
            for got, i in zip(logits, live.nonzero()[:, 0].tolist()):
                last = start + int(count[i]) - 1
                want = ours(rows[i][None, :last + 1])[0, -1]
                assert max_diff(got, want) <= TOL, (start, i)


def test_paged_forward_writes_only_its_rows_blocks(loaded):
    """Padding tokens write into the scratch block 0 only: every other block not in the rows'
    tables keeps its contents."""
    ours, _ = loaded("llama")
    cache = PagedKVCache(ours.config, 8, 4, torch.float32, "cpu")
    for pool in cache.kv:
        pool.fill_(7.0)
    tokens = random_ids(2, 6, 128)
    with torch.no_grad():
        ours.paged(tokens, torch.tensor([0, 0]), torch.tensor([6, 2]),
                   torch.tensor([[3, 5], [6, 0]]), cache, with_logits=False)
    for pool in cache.kv:
        untouched = pool[:, :, [1, 2, 4, 7]]
        assert (untouched == 7.0).all() and not (pool[:, :, [3, 5, 6]] == 7.0).all()


# ---------------------------------------------------------------------------------------------
# token_logprobs
# ---------------------------------------------------------------------------------------------

def direct_logprobs(model, ids, mask, temperature):
    logits = model(ids, mask).float()[:, :-1] / temperature  # (B, T-1, V)
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _padded_batch(vocab, seed=30):
    rows = [random_ids(1, n, vocab, seed=seed + n)[0] for n in (23, 17, 9)]
    return left_pad(rows)  # T = 23: 22 targets, chunk 5 does not divide it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])  # gemma2: soft-capped logits
def test_token_logprobs_match_direct(loaded, family, temperature):
    ours, _ = loaded(family)
    ids, mask = _padded_batch(ours.config.vocab_size)
    with torch.no_grad():
        want_lp, want_ent = direct_logprobs(ours, ids, mask, temperature)
        lp, ent = token_logprobs(ours, ids, mask, temperature=temperature, chunk_size=5,
                                 with_entropy=True)
        lp_only = token_logprobs(ours, ids, mask, temperature=temperature, chunk_size=5)
    assert lp.shape == ent.shape == (3, 22) and lp.dtype == torch.float32
    assert max_diff(lp, want_lp) <= 1e-5
    assert max_diff(ent, want_ent) <= 1e-5
    assert torch.equal(lp_only, lp)
    assert not torch.allclose(ent, torch.zeros_like(ent))


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_grads(a, b, tol=1e-5):
    """max |difference| <= tol, relative to the gradient's own scale where that exceeds 1
    (float32 sums of O(10) terms in a different order differ by a few 1e-6 relative)."""
    assert a.keys() == b.keys() and a
    for n in a:
        scale = max(1.0, b[n].abs().max().item())
        assert max_diff(a[n], b[n]) <= tol * scale, (n, max_diff(a[n], b[n]), scale)
        assert b[n].abs().max() > 0 or ".experts." in n, n  # (an expert may get no token)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "qwen3_moe"])
def test_token_logprobs_gradient_and_checkpointing(tiny_ckpt, family):
    ours, _ = load_model(tiny_ckpt(family))  # own copy: gradients and a flag get set
    ours.train()
    for p in ours.parameters():
        p.requires_grad_(True)
    ids, mask = _padded_batch(ours.config.vocab_size, seed=40)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(3, 22, generator=g), torch.randn(3, 22, generator=g)
    w_lp, w_ent = w_lp * mask[:, 1:], w_ent * mask[:, 1:]

    def chunked():  # entropy with a gradient: the checkpointed autograd path
        lp, ent = token_logprobs(ours, ids, mask, temperature=0.7, chunk_size=5,
                                 with_entropy=True, entropy_grad=True)
        return (w_lp * lp).sum() + (w_ent * ent).sum()

    def direct():
        lp, ent = direct_logprobs(ours, ids, mask, 0.7)
        return (w_lp * lp).sum() + (w_ent * ent).sum()

    def chunked_logp():  # log-probs only: ChunkedLogprobs' hand-written backward
        lp, ent = token_logprobs(ours, ids, mask, temperature=0.7, chunk_size=5, with_entropy=True)
        assert not ent.requires_grad
        return (w_lp * lp).sum()

    def direct_logp():
        return (w_lp * direct_logprobs(ours, ids, mask, 0.7)[0]).sum()

    want, want_logp = _grads(ours, direct), _grads(ours, direct_logp)
    _assert_same_grads(_grads(ours, chunked), want)
    _assert_same_grads(_grads(ours, chunked_logp), want_logp)
    ours.gradient_checkpointing = True
    _assert_same_grads(_grads(ours, chunked), want)
    _assert_same_grads(_grads(ours, chunked_logp), want_logp)
    _assert_same_grads(_grads(ours, direct), want)


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora(tiny_ckpt, family):
    ours, _ = load_model(tiny_ckpt(family))
    ids = random_ids(2, 25, ours.config.vocab_size, seed=50)
    with torch.no_grad():
        base = ours(ids)
    add_lora(ours, rank=4, alpha=8.0)
    adapters = [m for m in ours.modules() if isinstance(m, LoRALinear)]
    assert len(adapters) == 7 * ours.config.num_layers

    # Only the adapters train.
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all("lora_a" in n or "lora_b" in n for n in trainable)
    assert len(trainable) == 2 * len(adapters)

    with torch.no_grad():
        assert max_diff(ours(ids), base) <= 1e-6  # lora_b starts at zero
    randomise_lora_(ours, seed=1)
    with torch.no_grad():
        adapted = ours(ids)
        assert max_diff(adapted, base) > 1e-2
        with lora_disabled(ours):
            assert max_diff(ours(ids), base) <= 1e-6
        assert max_diff(ours(ids), adapted) == 0  # switched back on

    # Gradient reaches both adapter matrices (lora_a through the now non-zero lora_b).
    ours.zero_grad()
    ours(ids).logsumexp(-1).sum().backward()
    assert all(m.lora_a.grad is not None and m.lora_a.grad.abs().sum() > 0 for m in adapters)
    assert all(m.lora_b.grad is not None and m.lora_b.grad.abs().sum() > 0 for m in adapters)

    merge_lora(ours)
    assert not any(isinstance(m, LoRALinear) for m in ours.modules())
    with torch.no_grad():
        assert max_diff(ours(ids), adapted) <= TOL


def test_cpu_bf16_detection_can_be_forced(monkeypatch):
    """DAPO_CPU_BF16 runs the other CPU kind's path on this one (the suite is run with both)."""
    from run.checkpoints import cpu_has_bf16
    monkeypatch.setenv("DAPO_CPU_BF16", "1")
    assert cpu_has_bf16() is True
    monkeypatch.setenv("DAPO_CPU_BF16", "0")
    assert cpu_has_bf16() is False
    monkeypatch.delenv("DAPO_CPU_BF16")
    info = open("/proc/cpuinfo").read()
    assert cpu_has_bf16() == ("amx_bf16" in info or ("avx512_bf16" in info and "AuthenticAMD" in info))


# ---------------------------------------------------------------------------------------------
# Broken checkpoints fail at load, naming the file (and the tensor), not in the middle of a run


def _copy_checkpoint(tiny_ckpt, tmp_path):
    import shutil
    return shutil.copytree(tiny_ckpt("llama"), tmp_path / "ckpt")


def _edit_config(directory, change):
    path = directory / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize("change, message", [
    (lambda cfg: [cfg], r"config.json: expected a JSON object, got a list"),
    (lambda cfg: {**cfg, "hidden_size": -64}, r"config.json: field 'hidden_size' must be a positive"),
    (lambda cfg: {**cfg, "num_key_value_heads": 0}, r"config.json: field 'num_key_value_heads'"),
    (lambda cfg: {**cfg, "vocab_size": 100}, r"the tokenizer has 128 tokens but the model's "
                                               r"vocabulary only 100"),
])
def test_bad_config_is_named_at_load(tiny_ckpt, tmp_path, change, message):
    directory = _copy_checkpoint(tiny_ckpt, tmp_path)
    _edit_config(directory, change)
    with pytest.raises(ValueError, match=message):
        load_model(str(directory))


@pytest.mark.parametrize("change, message", [
    (lambda cfg: {**cfg, "sliding_window": -4}, r"config.json: sliding_window must be a positive"),
    (lambda cfg: {**cfg, "layer_types": ["full_attention"]}, r"config.json: layer_types has 1 "),
    (lambda cfg: {**cfg, "hidden_activation": "relu"}, r"hidden_activation='relu' is not supported"),
])
def test_bad_gemma_config_is_named_at_load(tiny_ckpt, tmp_path, change, message):
    import shutil
    directory = shutil.copytree(tiny_ckpt("gemma3"), tmp_path / "ckpt")
    _edit_config(directory, change)
    with pytest.raises(ValueError, match=message):
        load_model(str(directory))


def test_special_tokens_past_the_vocabulary_are_let_through(tiny_ckpt, tmp_path):
    """Gemma 3 1B's tokenizer has <image_soft_token> one past the text vocabulary: a special
    token that text never yields. An ordinary token there is still an error."""
    from transformers import AutoTokenizer
    directory = _copy_checkpoint(tiny_ckpt, tmp_path)  # vocabulary 128, tokenizer 128
    tok = AutoTokenizer.from_pretrained(directory)
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    tok.save_pretrained(directory)
    model, tok = load_model(str(directory))
    assert len(tok) == 129 and model.config.vocab_size == 128
    tok.add_tokens(["ordinary"])
    tok.save_pretrained(directory)
    with pytest.raises(ValueError, match="the tokenizer has 130 tokens"):
        load_model(str(directory))


def test_non_finite_weights_name_the_tensor(tiny_ckpt, tmp_path):
    directory = _copy_checkpoint(tiny_ckpt, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight holds NaN"):
        load_model(str(directory))


def test_broken_tokenizer_names_its_files(tiny_ckpt, tmp_path):
    directory = _copy_checkpoint(tiny_ckpt, tmp_path)
    (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Wor')
    with pytest.raises(ValueError, match=r"cannot read the tokenizer \(.*tokenizer.json"):
        load_model(str(directory))


# ---------------------------------------------------------------------------------------------
# Model families: Gemma 3 / 2, sliding windows, Mixture-of-Experts (issue 11)
# ---------------------------------------------------------------------------------------------

def test_new_family_features_are_read(loaded):
    """What each new family adds reached our config (else parity would be luck)."""
    g3 = loaded("gemma3")[0].config
    assert g3.gemma and g3.qk_norm and g3.tie_word_embeddings and g3.attn_scale == 24 ** -0.5
    assert g3.layer_types == ("sliding", "full", "sliding") and g3.sliding_window == WINDOW
    assert g3.local_rope_theta == 1e4 and g3.rope_theta == 1e6
    assert g3.rope_scaling["rope_type"] == "linear" and g3.final_softcap is None
    mm = loaded("gemma3_mm")[0].config
    assert mm.multimodal and mm.layer_types == g3.layer_types and mm.hf_config["architectures"] == [
        "Gemma3ForCausalLM"]
    g2 = loaded("gemma2")[0].config
    assert g2.attn_softcap == 4.0 and g2.final_softcap == 3.0 and not g2.qk_norm
    assert g2.local_rope_theta is None
    moe = loaded("qwen3_moe")[0].config
    assert (moe.num_experts, moe.experts_per_token, moe.norm_topk_prob) == (8, 2, True)
    assert moe.moe_layers == (True, False, True) and moe.qk_norm
    mixtral = loaded("mixtral")[0].config
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (4, 48, True)
    assert mixtral.moe_layers == (True, True) and mixtral.layer_types == ("sliding", "sliding")
    assert loaded("mistral")[0].config.max_seq_len == 256  # no longer capped at the window


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma2"])
def test_sliding_window_changes_logits_past_it(loaded, family):
    """Without the window the logits past it are visibly wrong (parity above tells them apart),
    and within it identical."""
    ours, hf = loaded(family)
    ids = random_ids(1, 3 * WINDOW, ours.config.vocab_size, seed=8)
    saved = ours.config
    try:
        ours.config = dataclasses.replace(saved, sliding_window=None)
        with torch.no_grad():
            unwindowed = ours(ids)
    finally:
        ours.config = saved
    with torch.no_grad():
        want = hf(ids).logits
    assert max_diff(unwindowed[:, :WINDOW], want[:, :WINDOW]) <= TOL
    assert max_diff(unwindowed[:, WINDOW:], want[:, WINDOW:]) > 100 * TOL


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "qwen3_moe"])
def test_bf16_matches_transformers_bf16(tmp_path, family):
    """In bfloat16 too: Gemma's embedding scale rounded to bf16 (hidden 48: sqrt(48) is not a
    bf16 number) and its (1 + w) norms in float32, as transformers does them. The gap to float32
    is the yardstick (bf16 rounding itself)."""
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint(family, tmp_path / "ckpt", hidden_size=48)
    ours, _ = load_model(path, dtype=torch.bfloat16)
    ids = random_ids(2, 30, ours.config.vocab_size, seed=14)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits
        gap = max_diff(want, hf_model(path)(ids).logits)
        diff = max_diff(ours(ids), want)
    assert gap > 0.05 and diff <= 0.1 * gap, (diff, gap)


def test_gemma2_soft_capping(loaded):
    """Logits stay inside (-cap, cap), and dropping the attention cap changes them."""
    ours, hf = loaded("gemma2")
    ids = random_ids(2, 30, ours.config.vocab_size, seed=9)
    with torch.no_grad():
        out = ours(ids)
        assert out.abs().max() < 3.0 and out.abs().max() > 2.0  # the cap binds
        for layer in ours.layers:
            layer.attn.softcap = None
        try:
            uncapped = ours(ids)
        finally:
            for layer in ours.layers:
                layer.attn.softcap = 4.0
    assert max_diff(uncapped, out) > 100 * TOL


def test_multimodal_gemma3_skips_the_vision_tower_and_saves_text(tiny_ckpt, tmp_path):
    """The checkpoint holds a vision tower (read past by name); save_model writes a text-only
    Gemma3ForCausalLM that AutoModelForCausalLM loads to the same logits."""
    from transformers import AutoModelForCausalLM
    path = tiny_ckpt("gemma3_mm")
    names = set(load_file(os.path.join(path, "model.safetensors")))
    assert any(n.startswith(checkpoints.SKIPPED_PREFIXES) for n in names)
    ours, tok = load_model(path)
    out = save_model(ours, tok, str(tmp_path / "text"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert not any("vision" in n for n in load_file(os.path.join(out, "model.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    ids = random_ids(2, 40, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        assert max_diff(hf(ids).logits, ours(ids)) <= TOL


def test_moe_router_logits_and_aux_loss_match_transformers(loaded):
    """Router logits per layer, and the load-balancing loss (with padding masked out), equal
    transformers' (load_balancing_loss_func)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    ours, hf = loaded("qwen3_moe")
    ids, mask = left_pad([random_ids(1, n, ours.config.vocab_size, seed=n)[0] for n in (20, 13)])
    routing = Routing()
    with torch.no_grad():
        ours(ids, mask, routing=routing)
        ref = hf(ids, attention_mask=mask, output_router_logits=True).router_logits
    assert sorted(routing.logits) == [0, 2] and len(ref) == 2  # layer 1 is dense
    real = mask.reshape(-1).bool()
    for layer, want in zip([0, 2], ref):
        assert max_diff(routing.logits[layer][real], want[real]) <= 1e-5
    cfg = ours.config
    aux = moe.load_balancing_loss(routing, cfg.num_experts, cfg.experts_per_token, mask)
    want = load_balancing_loss_func(tuple(ref), cfg.num_experts, cfg.experts_per_token, mask)
    assert abs(float(aux) - float(want)) <= 1e-5 and float(aux) > 1.0
    assert routing.experts[0].shape == (2, 20, 2)


def test_moe_routing_replay(tiny_ckpt):
    """Replaying recorded experts reproduces the logits; after the router moves (an update),
    replay keeps the sampler's experts where free routing would not; -1 routes freely."""
    ours, _ = load_model(tiny_ckpt("qwen3_moe"))
    ids = random_ids(2, 24, ours.config.vocab_size, seed=11)
    recorded = Routing()
    with torch.no_grad():
        base = ours(ids, routing=recorded)
        replay = recorded.stacked(ours.config)  # (B, T, L, k), -1 on the dense layer
        assert replay.shape == (2, 24, 3, 2) and (replay[:, :, 1] == -1).all()
        assert torch.equal(ours(ids, routing=Routing(replay)), base)
        assert torch.equal(ours(ids, routing=Routing(torch.full_like(replay, -1))), base)
        for layer in ours.layers:  # an update that changes the routing
            if layer.is_moe:
                layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
        free, replayed = Routing(), Routing(replay)
        ours(ids, routing=free)
        ours(ids, routing=replayed)
    assert not torch.equal(free.experts[0], recorded.experts[0])
    assert all(torch.equal(replayed.experts[i], recorded.experts[i]) for i in (0, 2))


def test_moe_aux_loss_gradient_with_checkpointing(tiny_ckpt):
    """The aux loss reaches the routers, with and without activation checkpointing alike."""
    ours, _ = load_model(tiny_ckpt("qwen3_moe"))
    ids = random_ids(2, 16, ours.config.vocab_size, seed=12)
    cfg = ours.config

    def router_grads():
        ours.zero_grad(set_to_none=True)
        routing = Routing()
        ours(ids, routing=routing)
        moe.load_balancing_loss(routing, cfg.num_experts, cfg.experts_per_token).backward()
        return [ours.layers[i].mlp.router.weight.grad.clone() for i in (0, 2)]

    plain = router_grads()
    ours.gradient_checkpointing = True
    checkpointed = router_grads()
    for a, b in zip(plain, checkpointed):
        assert a.abs().max() > 0 and max_diff(a, b) <= 1e-6


def test_moe_lora_wraps_attention_and_experts(tiny_ckpt):
    ours, _ = load_model(tiny_ckpt("qwen3_moe"))
    ids = random_ids(2, 20, ours.config.vocab_size, seed=13)
    add_lora(ours, rank=4, alpha=8.0)
    cfg = ours.config
    adapters = [m for m in ours.modules() if isinstance(m, LoRALinear)]
    # 4 attention projections per layer; 3 per expert (2 MoE layers) or per dense MLP (1 layer)
    assert len(adapters) == 4 * 3 + 3 * (2 * cfg.num_experts + 1)
    randomise_lora_(ours, seed=2)
    with torch.no_grad():
        adapted = ours(ids)
    merge_lora(ours)
    with torch.no_grad():
        assert max_diff(ours(ids), adapted) <= TOL


def _fake_hub(monkeypatch, tmp_path, config):
    """huggingface_hub's downloads replaced: config.json comes from `config` (or is missing),
    any other download is recorded (and fails the test if it happens)."""
    import huggingface_hub
    fetched = []
    repo_dir = tmp_path / "hub"
    repo_dir.mkdir()
    if config is not None:
        (repo_dir / "config.json").write_text(json.dumps(config))

    def hf_hub_download(repo_id, filename, **kwargs):
        fetched.append(filename)
        if not (repo_dir / filename).exists():
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(repo_dir / filename)

    def snapshot_download(repo_id, **kwargs):
        fetched.append("snapshot: weights and tokenizer")
        raise AssertionError("weights fetched before the config was checked")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return fetched


def test_hub_id_reads_config_before_any_weight(monkeypatch, tmp_path):
    """An unsupported architecture, or no config.json, fails after fetching config.json alone,
    with the reason, before any weight moves (acceptance 4)."""
    fetched = _fake_hub(monkeypatch, tmp_path, {"model_type": "gpt2", "architectures": [
        "GPT2LMHeadModel"], "n_embd": 64})
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"unsupported architecture model_type='gpt2'"):
        load_model("someone/gpt2-like")
    assert fetched == ["config.json"] and time.perf_counter() - t < 5


def test_hub_id_without_config_fails_before_any_weight(monkeypatch, tmp_path):
    fetched = _fake_hub(monkeypatch, tmp_path, None)
    with pytest.raises(FileNotFoundError, match=r"someone/no-config: .*config.json.*EntryNotFound"):
        load_model("someone/no-config")
    assert fetched == ["config.json"]


def test_gated_hub_id_fails_with_the_reason_before_any_weight(monkeypatch, tmp_path):
    import types

    import huggingface_hub
    fetched = _fake_hub(monkeypatch, tmp_path, None)

    def gated(repo_id, filename, **kwargs):
        fetched.append(filename)
        raise huggingface_hub.errors.GatedRepoError(
            f"Cannot access gated repo. Access to model {repo_id} is restricted.",
            response=types.SimpleNamespace(headers={}, status_code=401, request=None))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    with pytest.raises(FileNotFoundError,
                       match=r"GatedRepoError: .*google/gemma-3-1b-it is restricted"):
        load_model("google/gemma-3-1b-it")
    assert fetched == ["config.json"]


def test_unsupported_directory_never_opens_its_weights(tmp_path):
    """A local directory: the weight file would raise if read; the config's error comes first."""
    from transformers import GPT2Config
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
        load_model(str(tmp_path))


# config.json files as the hub has them (abridged to what the model reads)
GEMMA3_4B_IT = {  # an image-text checkpoint: its text_config lists only what differs
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                      "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
GEMMA3_1B_IT = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
                "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
                "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
                "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
                "final_logit_softcapping": None, "attn_logit_softcapping": None}
GEMMA2_2B_IT = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "rope_theta": 10000.0,
                "max_position_embeddings": 8192}


@pytest.mark.parametrize("hub", [GEMMA3_4B_IT, GEMMA3_1B_IT, GEMMA2_2B_IT],
                         ids=["gemma-3-4b-it", "gemma-3-1b-it", "gemma-2-2b-it"])
def test_hub_gemma_configs_read_as_transformers_reads_them(hub):
    """Layer kinds, window, rotary bases and scaling, sizes: what transformers' own config class
    makes of the same file (its defaults filling an image-text checkpoint's text_config)."""
    from transformers import AutoConfig
    ours = checkpoints.model_config(json.loads(json.dumps(hub)))
    tf_cfg = AutoConfig.for_model(**hub)
    text = getattr(tf_cfg, "text_config", tf_cfg)
    assert ours.layer_types == tuple(t.split("_")[0] for t in text.layer_types)
    assert ours.sliding_window == text.sliding_window
    for key, value in [("vocab_size", text.vocab_size), ("head_dim", text.head_dim),
                       ("num_kv_heads", text.num_key_value_heads),
                       ("max_seq_len", text.max_position_embeddings),
                       ("attn_scale", text.query_pre_attn_scalar ** -0.5),
                       ("attn_softcap", getattr(text, "attn_logit_softcapping", None)
                        if ours.model_type == "gemma2" else None),
                       ("final_softcap", text.final_logit_softcapping),
                       ("tie_word_embeddings", text.tie_word_embeddings)]:
        assert getattr(ours, key) == value, key
    rope = text.rope_parameters
    if ours.model_type == "gemma3_text":
        assert ours.local_rope_theta == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    assert ours.rope_theta == rope["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == rope.get("factor")


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                 "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
                 "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
                 "use_sliding_window": False, "max_window_layers": 48, "rms_norm_eps": 1e-06,
                 "tie_word_embeddings": False}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_act": "silu", "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 32768, "rope_theta": 1e6, "sliding_window": None,
                "rms_norm_eps": 1e-05, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}


@pytest.mark.parametrize("hub", [QWEN3_30B_A3B, MIXTRAL_8X7B],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_hub_moe_configs(hub):
    ours = checkpoints.model_config(dict(hub))
    assert ours.layer_types == ("full",) * hub["num_hidden_layers"] and ours.sliding_window is None
    assert ours.num_experts == hub.get("num_experts", hub.get("num_local_experts"))
    assert ours.experts_per_token == hub["num_experts_per_tok"] and ours.norm_topk_prob
    assert ours.moe_intermediate_size == hub.get("moe_intermediate_size", hub["intermediate_size"])
    assert all(ours.moe_layers) and len(ours.moe_layers) == hub["num_hidden_layers"]
    assert ours.rope_theta == 1e6 and ours.rope_scaling is None


# ---------------------------------------------------------------------------------------------
# A padded batch runs packed to the left: each row's own, no (B, 1, T, T) mask (issue 40)
# ---------------------------------------------------------------------------------------------

def _both_padded(vocab):
    """Three rows as the trainer lays them out, prompt left-padded and reply right-padded, real
    lengths 2 + 20, 9 + 14, 5 + 3 (past the window of 16): ids (3, T), mask (3, T), real spans."""
    spans = [(0, 2, 20), (1, 9, 14), (2, 5, 3)]  # (row, prompt, reply)
    P, C = 9, 20
    ids = torch.full((3, P + C), PAD_ID, dtype=torch.long)
    mask = torch.zeros(3, P + C, dtype=torch.long)
    for row, p, c in spans:
        ids[row, P - p:P + c] = random_ids(1, p + c, vocab, seed=50 + row)[0]
        mask[row, P - p:P + c] = 1
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_batch_is_each_row_alone_in_logits_gradients_and_routes(tiny_ckpt, family):
    """Every family (sliding windows, Gemma 2's soft caps, MoE routes): each row's logits on its
    real positions, and the gradient of a weighted sum of them, equal each row run alone with no
    padding; an MoE's recorded experts and router logits come back in the rows' own order; no
    tensor kept for backward holds B x T x T elements (the mask the batch once carried)."""
    ours = load_model(tiny_ckpt(family))[0].train()
    ids, mask = _both_padded(ours.config.vocab_size)
    B, T = ids.shape
    weights = torch.randn(B, T, ours.config.vocab_size, generator=torch.Generator().manual_seed(2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        routing = Routing() if ours.config.num_experts else None
        logits = ours(ids, mask, routing=routing)  # (B, T, V)
    masks = [t for t in saved if t.shape == (B, 1, T, T) or (t.dtype == torch.bool and t.dim() == 4)]
    assert not masks, [t.shape for t in masks]
    batch = _grads(ours, lambda: (ours(ids, mask) * weights * mask[:, :, None]).sum())
    alone = []
    for row in range(B):
        real = mask[row].bool()
        row_routing = Routing() if ours.config.num_experts else None
        got = ours(ids[row][real][None], routing=row_routing)[0]
        assert max_diff(logits[row][real], got) <= TOL, row
        if routing is not None:
            assert all(torch.equal(routing.experts[k][row][real], e[0]) for k, e in row_routing.experts.items())
            layer = next(iter(routing.logits))
            assert max_diff(routing.logits[layer].view(B, T, -1)[row][real], row_routing.logits[layer]) <= TOL
        alone.append(_grads(ours, lambda: (ours(ids[row][real][None])[0] * weights[row][real]).sum()))
    _assert_same_grads(batch, {n: sum(g[n] for g in alone) for n in batch})


def test_the_bundled_models_conversion_is_done_by_one_process_at_a_time(tmp_path):
    """checkpoint_directory converts the GGUF under held_lock: a second process (torchrun's
    ranks, pytest's workers on a fresh machine) waits for the first instead of converting into
    the same folder at once."""
    import subprocess
    import sys
    lock = str(tmp_path / "converted.lock")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import checkpoints\n"
            "print('ready', flush=True)\n"
            "with checkpoints.held_lock(sys.argv[2]): print('in', flush=True)")
    with checkpoints.held_lock(lock):
        waiting = subprocess.Popen([sys.executable, "-c", code,
                                    os.path.dirname(os.path.abspath(checkpoints.__file__)), lock],
                                   stdout=subprocess.PIPE, text=True)
        assert waiting.stdout.readline() == "ready\n"
        time.sleep(1)
        assert waiting.poll() is None  # at the lock
    assert waiting.communicate(timeout=60)[0] == "in\n" and waiting.returncode == 0
