"""The policy: a decoder of the Llama, Gemma and Qwen3-MoE families in plain PyTorch, its paged
KV cache and its token log-probs.

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
          a decode step's one query row as two plain matrix products instead.
          Sliding-window layers (Mistral, Gemma's local layers) see only the last `window`
          positions: a per-layer mask, in the full forward and over the KV cache alike.
    mlp:  SwiGLU, down(silu(gate(x)) * up(x)); Gemma GeGLU (tanh GELU); or MoE: k of E such MLPs
          per token, tokens grouped by expert.

Also here: `PagedKVCache` (keys and values in fixed-size blocks that rows hold through block
tables) and `Transformer.paged`, the sampler's forward over it (engine/paged.py keeps the
blocks and the queue); `token_logprobs` (log-probs and entropies of given tokens, the vocabulary
projection in chunks recomputed in backward by engine/chunked_logprobs.py: no (B, T, V) tensor is
held). Beside it: variants/moe.py (the experts), variants/lora.py, run/checkpoints.py
(`load_model`, `save_model`), engine/speed.py (CPU speed-ups applied from outside: packed sampling
products, compiled blocks), recipes/bench.py (speed against transformers).

    python -m pytest tests/test_model.py     # parity with transformers, family by family
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.chunked_logprobs import chunked_logprobs
from variants.moe import MoE, Routing

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
        if cache is not None:  # the sampler: each row's keys and values through its block table
            y = cache.attend(layer, q, k, v, mask, self.scale, self.softcap)
        elif self.softcap or T == 1:  # Gemma 2's tanh, or one query row: attend_grouped says why
            y = attend_grouped(q, k, v, mask, self.scale, self.softcap)
        else:
            y = attend(q, k, v, mask, expand_kv=q.is_cuda and mask is not None and T > 1,
                       scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


def attend(q, k, v, mask, expand_kv=False, scale=None):
    """softmax(q k^T * scale + mask) v with grouped-query heads: q (B, Hq, T, D), k and v
    (B, Hkv, S, D), query head h reading key/value head h // (Hq / Hkv); mask (B, 1, T, S) bool,
    or None (plain causal); scale None: 1 / sqrt(D). `enable_gqa` reads shared heads in place, but
    CUDA's fused kernels take grouped heads or a mask, not both: `expand_kv` copies the heads out
    for the memory-efficient kernel (the fallback makes (B, Hq, T, S) scores a layer)."""
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
    Forms the (B, Hq, T, S) scores, so it is for decode steps (T = 1) and Gemma 2's soft cap:
    its tanh fits no fused kernel, and one query row is two small matrix products (on the CPU
    5-10x faster than SDPA's flash kernel; on CUDA they read the grouped heads in place, where
    SDPA with a mask and grouped heads copies them).
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv * T, D)  # (B, Hkv, G*T, D): a group's query heads stacked
    # k q^T, not q k^T: a strided view of keys the matrix product reads in place as its left
    # operand, but copies (3x slower on the CPU) when transposed.
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


def attend_paged(q, k, v, mask, scale=None, cap=None):
    """`attend_grouped` (decode steps, Gemma 2's cap) over keys and values laid out heads first,
    as `PagedKVCache.write` gathers them: q (b, Hq, T, D), k and v (Hkv, b, S, D), mask (b, 1, T,
    S) bool. Batched over (Hkv, b), the matrix products read the gathered keys in place."""
    b, Hq, T, D = q.shape
    Hkv, S = k.shape[0], k.shape[2]
    qh = q.reshape(b, Hkv, Hq // Hkv * T, D).transpose(0, 1)  # (Hkv, b, G*T, D)
    scores = (qh @ k.transpose(-1, -2)).view(Hkv, b, Hq // Hkv, T, S) * (scale or D ** -0.5)
    if cap:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~mask[None], float("-inf"))  # mask (1, b, 1, T, S)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    y = probs.view(Hkv, b, -1, S) @ v  # (Hkv, b, G*T, D)
    return y.transpose(0, 1).reshape(b, Hq, T, D)


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
        self.mlp = MoE(cfg, [MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)]) \
            if self.is_moe else MLP(cfg)
        self.post_attn_norm = RMSNorm(C, eps, offset=True) if gemma else None
        self.post_mlp_norm = RMSNorm(C, eps, offset=True) if gemma else None

    def forward(self, x, cos, sin, mask, cache=None, layer=0, routing=None):
        h = self.attn(self.attn_norm(x), cos, sin, mask, cache, layer)
        x = x + (h if self.post_attn_norm is None else self.post_attn_norm(h))
        h = self.mlp_norm(x)
        h = self.mlp(h, routing, layer) if self.is_moe else self.mlp(h)
        return x + (h if self.post_mlp_norm is None else self.post_mlp_norm(h))


# ----------------------------------------------------------------------------- KV cache

class PagedKVCache:
    """Keys and values in a pool of fixed-size blocks that every row shares (PagedAttention: Kwon
    et al. 2023, "Efficient Memory Management for LLM Serving"): position p of a row lives at
    slot p % block_size of block table[p // block_size], its block table listing its blocks in
    order. A row holds the blocks its length needs, frees them when it stops, and shares its
    prompt's with the prompt's other rows (engine/paged.py keeps the tables and reference counts).
    Block 0 is scratch: padding writes into it, tables are padded with it, attention masks it.
    `Transformer.paged` sets `slots`, `tables` and `positions` for one forward."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device):
        # A layer's keys and values in one tensor, heads first: one gather reads both, as they go
        # into attend_paged's products, batched over (heads, rows), with no copy.
        shape = (2, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # (2, Hkv, N, bs, D)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.block_size = block_size
        self.block_bytes = self.bytes_per_block(cfg, block_size, dtype)
        self.slots = None  # (b*T,) the flat slot each new token's k, v go to
        self.tables = None  # (b, nb) each row's blocks, padded with block 0
        self.positions = None  # (b, T) each new token's position in its row
        # A decode step's rows in groups of like width, [(first row, end, blocks read)] (paged.py's
        # read_groups): a group reads its own widest row's blocks; None: all read the widest's.
        self.row_groups = None

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
        """Keys and values of one block in every layer."""
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def store(self, layer, k, v):
        """Writes the new keys and values k, v (b, Hkv, T, D) at their `slots`."""
        b, H, T, D = k.shape
        new = torch.stack((k.transpose(0, 1), v.transpose(0, 1)))  # (2, Hkv, b, T, D), one copy
        self.kv[layer].view(2, H, -1, D).index_copy_(2, self.slots, new.view(2, H, b * T, D))

    def write(self, layer, k, v):
        """Stores k, v; -> each row's keys and values gathered through its table, (Hkv, b, S, D)."""
        self.store(layer, k, v)
        return self.gather(layer, self.tables)

    def gather(self, layer, tables):
        """Block tables (b, nb) -> the keys and values they list, (Hkv, b, nb * block_size, D) each."""
        pool = self.kv[layer]
        H, D = pool.shape[1], pool.shape[-1]
        rows = pool.index_select(2, tables.reshape(-1)).view(2, H, tables.shape[0], -1, D)
        return rows[0], rows[1]  # (2, Hkv, b, S, D) split

    def attend(self, layer, q, k, v, mask, scale=None, softcap=None):
        """Stores k, v (b, Hkv, T, D); q (b, Hq, T, D) attends to its row's, mask (b, 1, T, S)."""
        if self.row_groups and q.shape[2] == 1:  # a decode step, each group of rows at its own width
            self.store(layer, k, v)
            return torch.cat([attend_paged(q[a:e], *self.gather(layer, self.tables[a:e, :width]),
                                           mask[a:e, ..., :width * self.block_size], scale, softcap)
                              for a, e, width in self.row_groups])  # (b, Hq, 1, D)
        k, v = self.write(layer, k, v)  # (Hkv, b, S, D), heads first: position s at index s
        if softcap or q.shape[2] == 1:  # a decode step (or Gemma 2's cap)
            return attend_paged(q, k, v, mask, scale, softcap)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # a prefill chunk: (b, Hkv, S, D)
        return attend(q, k, v, mask, expand_kv=q.is_cuda, scale=scale)

    def copy_block(self, source: int, target: int):
        """Copies one block's keys and values in every layer (a shared block a row writes into)."""
        for pool in self.kv:
            pool[:, :, target] = pool[:, :, source]


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
        self.compiled_layers = None  # speed.compile_blocks: the blocks through torch.compile

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

    def forward(self, input_ids, attention_mask=None, last_only=False, return_hidden=False,
                routing: Routing | None = None):
        """input_ids (B, T) -> logits (B, T, V) (or (B, 1, V) with last_only). attention_mask
        (B, T): 1 real token, 0 padding (anywhere: prompts left-padded, replies right-padded). Such
        a batch runs packed to the left: each row's real tokens gathered, in order, to its first
        columns and its padding after them, so that plain causal attention is each row's own (no
        (B, 1, T, T) mask is made or kept for backward; flash attention on CUDA), then the hidden
        states gathered back into place. return_hidden: the final normed hidden states (B, T, C)
        instead of logits (token_logprobs applies the head in chunks). routing: an MoE's experts
        recorded (or replayed), see Routing."""
        order = None
        if attention_mask is not None:  # (B, T): real tokens first, in order (a stable sort)
            order = torch.argsort(~attention_mask.bool(), dim=1, stable=True)
            input_ids = input_ids.gather(1, order)
        inner = routing if order is None or routing is None else routing.reordered(order)
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)[None]  # (1, T): the same in every row
        x = self.embed(input_ids)  # (B, T, C)
        rotary, masks = self.rotary(positions, x.dtype), self.attention_masks(T, x.device)
        layers = self.compiled_layers or self.layers  # speed.compile_blocks
        for i, layer in enumerate(layers):
            kind = self.config.layer_types[i]
            args = (x, *rotary[kind], masks[kind])
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, *args, None, i, inner, use_reentrant=False)
            else:
                x = layer(*args, None, i, inner)
        if order is not None:  # every token back to its own column
            x = x.gather(1, torch.argsort(order, dim=1)[:, :, None].expand_as(x))
            if routing is not None:
                routing.record_back(inner, order)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)  # (B, T, C)
        return x if return_hidden else self.logits(x)  # (B, T, V)

    def paged(self, tokens, start, count, tables, cache: PagedKVCache, routing=None,
              with_logits=True):
        """The sampler's forward over a paged KV cache: each row's `count` new tokens (tokens
        (b, T), right-padded) at positions start, start + 1, ... after the `start` it has cached
        (b,), its blocks `tables` (b, nb). A prefill chunk (T > 1) or a decode step (T = 1); each
        row attends to its own positions only, however long the others are.
        -> logits (b, V) float32 of each row's last new token (None without with_logits)."""
        b, T = tokens.shape
        bs = cache.block_size
        positions = start[:, None] + torch.arange(T, device=tokens.device)  # (b, T)
        real = torch.arange(T, device=tokens.device) < count[:, None]  # (b, T)
        block = tables.gather(1, (positions // bs).clamp(max=tables.shape[1] - 1))  # (b, T)
        cache.slots = torch.where(real, block * bs + positions % bs, 0).view(-1)  # pads: block 0
        cache.tables, cache.positions = tables, positions
        key_pos = torch.arange(tables.shape[1] * bs, device=tokens.device)  # (S,) slot s = position s
        full = (key_pos <= positions[:, :, None])[:, None]  # (b, 1, T, S) causal, own keys only
        masks = {"full": full, "sliding": full}
        if self.config.sliding_window:  # Mistral, Gemma: only keys at positions > p - window
            near = (positions[:, :, None] - key_pos) < self.config.sliding_window
            masks["sliding"] = full & near[:, None]
        x = self.embed(tokens)  # (b, T, C)
        rotary = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            kind = self.config.layer_types[i]
            x = layer(x, *rotary[kind], masks[kind], cache, i, routing)
        if not with_logits:
            return None
        last = x[torch.arange(b, device=x.device), (count - 1).clamp(min=0)]  # (b, C)
        return self.logits(self.norm(last)).float()  # (b, V)

    def rotary(self, positions, dtype):
        """{"full": (cos, sin), "sliding": (cos, sin)}, each (B, 1, T, D); Gemma 3's sliding
        layers rotate at their own base."""
        full = self.rope(positions, dtype, self.inv_freq)
        if self.config.local_rope_theta is None:
            return {"full": full, "sliding": full}
        return {"full": full, "sliding": self.rope(positions, dtype, self.inv_freq_local)}

    def attention_masks(self, T, device):
        """{"full": mask, "sliding": mask} for rows packed to the left, each None (plain causal)
        or one (1, 1, T, T) bool mask for every row: a sliding layer's query at position p sees
        only keys at positions > p - window (Mistral, Gemma: the window counts the query itself).
        """
        window = self.config.sliding_window
        if not window or T <= window:
            return {"full": None, "sliding": None}  # the window never binds
        position = torch.arange(T, device=device)
        distance = position[:, None] - position[None, :]  # (T, T) query minus key
        return {"full": None, "sliding": ((distance >= 0) & (distance < window))[None, None]}


def token_logprobs(model: Transformer, input_ids, attention_mask=None, *, start=1,
                   temperature=1.0, chunk_size=64, with_entropy=False, entropy_grad=False,
                   hidden=None):
    """logp[:, j] = log p(ids[:, start+j] | ids[:, :start+j]): input_ids (B, T) -> logp (B, T-start)
    float32, and with with_entropy each distribution's entropy (a gradient only with entropy_grad).
    A trainer passes start = the prompt length: the head runs on completion positions only, B *
    chunk_size rows at a time (chunked_logprobs.py: peak ~B * chunk_size * V floats). `temperature`
    divides the logits, as the sampler's did. `hidden`: the body's output (B, T, C) for these ids,
    when the caller already ran it (GKL needs it too: the body runs once)."""
    if not 1 <= start < input_ids.shape[1]:
        raise ValueError(f"token_logprobs: start={start} outside [1, {input_ids.shape[1]})")
    if hidden is None:
        hidden = model(input_ids, attention_mask, return_hidden=True)  # (B, T, C)
    hidden = hidden[:, start - 1:-1]  # (B, T-start, C): position t predicts token t+1
    targets = input_ids[:, start:]  # (B, T-start)
    model = getattr(model, "module", model)  # (a DDP wrapper has .module)
    weight, softcap = model.output.weight, model.config.final_softcap
    B, T = targets.shape
    logp, ent = chunked_logprobs(hidden.reshape(B * T, -1), weight, targets.reshape(-1),
                                 temperature, B * chunk_size, with_entropy,
                                 entropy_grad and torch.is_grad_enabled(), softcap)
    logp = logp.view(B, T)  # (B, T-start)
    return (logp, ent.view(B, T)) if with_entropy else logp


def completion_logprobs(model, ids, attn, start, replay, temperature, with_entropy=False):
    """(b, C) fp32 log-probs of the completions in `ids` (from position `start`) under `model`,
    on the CPU (and their entropies, with_entropy); an MoE replays the experts in `replay`
    (b, T, L, k) (the sampler's: --routing-replay), or routes afresh where it is None."""
    routing = Routing(replay) if model.config.num_experts else None
    hidden = model(ids, attn, return_hidden=True, routing=routing)
    out = token_logprobs(model, ids, attn, start=start, hidden=hidden, temperature=temperature,
                         with_entropy=with_entropy)
    return tuple(x.float().cpu() for x in out) if with_entropy else out.float().cpu()
