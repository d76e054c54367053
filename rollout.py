"""Batched sampling: many prompts x G samples in one batch, on our own KV cache.

    completions = generate(model, prompts, num_samples=G, max_new_tokens=64, temperature=1.0,
                           stop_token_ids=[tokenizer.eos_token_id], seed=0)

How one call runs:
1. Prompts (token-id lists) are left-padded to a common length and prefilled once each.
2. Each prompt's cache rows are copied to its G sample rows (prompt-major: prompt 0's G samples
   come first in the output).
3. Decode loop: `decode_step` feeds one token per row (`Transformer.decode`, written into the
   cache in place) and samples the next by inverse CDF (cumulative sum + searchsorted: at a 49k
   vocabulary ~30x cheaper than torch.multinomial; in two levels, `inverse_cdf`) with one
   uniform per row, a hash of (the
   prompt's seed, the sample's index, the step): no generator, no loop over prompts, and a
   prompt's samples never depend on the batch around it. The step is one torch.compile graph
   (`compile=True`).
4. The host reads the batch only every `check_every` steps: to end when every row has stopped
   (at its first stop token), and, once a quarter of the rows have stopped, to drop the finished
   rows so they stop costing work.

Each completion's `.logprobs` are those of the distribution the token was drawn from: the logits
divided by the temperature, before top-k/top-p truncation (at temperature 1, the policy's own
log-probs). The trainer computes its own at the same temperature and logs the gap. At
temperature 0 (greedy) they are the untempered policy's log-probs.

`python bench.py sampler` times this sampler, eager and compiled, against transformers'
`generate`, eager and with a compiled static cache, on the same weights, batch, lengths and
dtype, side by side in one process. Tests: `python -m pytest tests/test_rollout.py`.
"""

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model import KVCache, Transformer
from speed import sampling_products
from moe import Routing


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int]  # generated tokens, ending with the stop token when one was produced
    logprobs: list[float] = field(repr=False)  # one per generated token
    finish_reason: str  # "stop" or "length"
    # With record_routing on an MoE model: (prompt + tokens, L, k) int16, the experts each
    # position was routed to (-1: dense layers, and the last token, which was never fed).
    routing: torch.Tensor | None = field(default=None, repr=False)


# End-of-turn tokens of common chat templates (ChatML/Qwen/SmolLM, Llama 3, Phi-3, Gemma). The
# model ends its turn with one; a tokenizer's eos is often the base model's end-of-text instead.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def stop_token_ids(tokenizer, model_dir=None):
    """Token ids that end a response: the tokenizer's eos, the eos ids of the checkpoint's
    generation_config.json (read from `model_dir`, or the tokenizer's own directory), and the
    end-of-turn tokens (END_OF_TURN_TOKENS) that its chat template writes."""
    ids = set()

    def add(value):
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token_id, int) and token_id >= 0:
                ids.add(token_id)

    add(tokenizer.eos_token_id)
    directory = model_dir or getattr(tokenizer, "name_or_path", None)
    config_path = os.path.join(str(directory), "generation_config.json") if directory else None
    if config_path and os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                add(json.load(f).get("eos_token_id"))
        except (OSError, ValueError):
            pass  # a broken generation config only costs the extra stop ids
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # some tokenizers keep several named templates
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, str):
        vocab = tokenizer.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if token in template and token in vocab:
                add(vocab[token])
    if not ids:
        raise ValueError("stop_token_ids: the tokenizer has no eos token and no end-of-turn token")
    return sorted(ids)


def line_break_ids(tokenizer):
    """The token ids whose text holds a line break (a one-line reply stops at them; Step-DPO's
    steps end at them)."""
    return [i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])]


def sample_tokens(logits, uniforms, temperature=1.0, top_p=1.0, top_k=0):
    """logits (B, V) float32, uniforms (B,) in [0, 1) -> tokens (B,), logprobs (B,).

    The log-prob is under softmax(logits / temperature) before any truncation.
    """
    if temperature == 0:
        tokens = logits.argmax(-1)  # (B,)
        logp = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        return tokens, logp
    # Unnormalised probabilities: one exp pass over the vocabulary instead of two (logsumexp and
    # then softmax); every use below scales by the total, so normalising is never needed.
    scaled = logits if temperature == 1 else logits / temperature  # (B, V)
    shifted = scaled - scaled.amax(-1, keepdim=True)  # (B, V), <= 0 so exp cannot overflow
    probs = shifted.exp()  # (B, V) proportional to softmax(scaled)
    logz = probs.sum(-1).log()  # (B,) log-normaliser of exp(shifted), before truncation
    if top_k and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        # Nucleus: keep the smallest prefix of the sorted distribution with mass >= top_p.
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
        cdf = sorted_probs.cumsum(-1)  # (B, V)
        sorted_probs = torch.where(cdf - sorted_probs < top_p * cdf[:, -1:], sorted_probs, 0.0)
        cdf = sorted_probs.cumsum(-1)
        picked = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)  # (B, 1)
        tokens = order.gather(-1, picked.clamp(max=probs.shape[-1] - 1)).squeeze(-1)
    else:
        tokens = inverse_cdf(probs, uniforms)  # (B,)
    logp = shifted.gather(-1, tokens[:, None]).squeeze(-1) - logz  # (B,)
    return tokens, logp


def inverse_cdf(weights, uniforms, chunk=256):
    """weights (B, V) >= 0, unnormalised; uniforms (B,) in [0, 1) -> (B,) the first index whose
    cumulative weight exceeds u * total: a draw from weights / total.

    In two levels, as one cumulative sum over the whole vocabulary costs 10x more than a sum:
    the chunk whose cumulative mass passes the target, then the index inside that chunk.
    """
    B, V = weights.shape
    chunks = F.pad(weights, (0, -V % chunk)).view(B, -1, chunk)  # (B, K, C), zero weights added
    chunk_cdf = chunks.sum(-1).cumsum(-1)  # (B, K)
    target = uniforms[:, None] * chunk_cdf[:, -1:]  # (B, 1)
    k = torch.searchsorted(chunk_cdf, target, right=True).clamp(max=chunk_cdf.shape[1] - 1)
    below = torch.where(k > 0, chunk_cdf.gather(-1, (k - 1).clamp(min=0)), 0.0)  # (B, 1)
    row = chunks.gather(1, k[:, :, None].expand(B, 1, chunk)).squeeze(1)  # (B, C) chunk k
    inside = torch.searchsorted(row.cumsum(-1), target - below, right=True)  # (B, 1)
    # Rounding between the levels may overshoot the chunk: stay on its last nonzero weight.
    last = ((row > 0) * torch.arange(chunk, device=row.device)).amax(-1, keepdim=True)  # (B, 1)
    return (k * chunk + torch.minimum(inside, last)).squeeze(-1)  # (B,)


# Counter-based random numbers (the idea of Salmon et al. 2011, "Parallel random numbers: as easy
# as 1, 2, 3"): the uniform of sample row r at decode step t is a hash of (r's key, t), so a whole
# step's uniforms are one vectorised computation on the device, with no generator state, and a
# row's stream depends on its prompt's seed and its sample index only, never on the batch around
# it. The mixer is a 32-bit integer hash (Wellons' "lowbias32"), in int64, its multipliers chosen
# below 2^31 in magnitude so that no product overflows (compiled C++ must not rely on wrapping).

def hash32(x):
    """x int64 (any shape, or an int) in [0, 2^32) -> a well-mixed int64 in [0, 2^32)."""
    x = (x + 0x9E3779B9) & 0xFFFFFFFF  # so that 0 does not map to 0
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * -0x7B935975) & 0xFFFFFFFF  # 0x846CA68B - 2^32: the same low 32 bits, |x c| < 2^63
    return x ^ (x >> 16)


def sample_keys(seeds, counts):
    """seeds: one int per prompt (its low 64 bits count); counts: samples per prompt.
    -> (B,) int64 keys, prompt-major: row j of prompt i keyed by (seeds[i], j)."""
    low = torch.tensor([int(s) % 2**32 for s in seeds])  # (N,)
    high = torch.tensor([int(s) // 2**32 % 2**32 for s in seeds])  # (N,)
    prompt_keys = hash32(hash32(low) ^ high)  # (N,)
    sample_index = torch.cat([torch.arange(c) for c in counts])  # (B,) j within its prompt
    return hash32(prompt_keys.repeat_interleave(torch.tensor(counts)) ^ sample_index)  # (B,)


def step_uniforms(keys, step):
    """keys (b,) int64, step: an int or a (1,) int64 tensor -> (b,) float32 uniforms in [0, 1),
    24 random bits each."""
    bits = hash32(keys ^ hash32(step))  # (b,)
    return (bits >> 8).float() / 2**24


def _check_inputs(model, prompts, num_samples, max_new_tokens, temperature, top_p, top_k,
                  check_every, seed):
    """-> samples per prompt, seed per prompt; or a ValueError naming the bad argument."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        if len(p) + max_new_tokens > model.config.max_seq_len:
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens; with max_new_tokens="
                             f"{max_new_tokens} that exceeds the model's context of "
                             f"{model.config.max_seq_len}")
    counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else list(num_samples)
    if len(counts) != len(prompts) or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"generate: num_samples must be an int >= 1 or one such int per prompt, "
                         f"got {num_samples!r}")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if check_every is not None and (not isinstance(check_every, int) or check_every < 1):
        raise ValueError(f"generate: check_every must be an int >= 1 or None, got {check_every!r}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"generate: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                         f"{temperature}, {top_p}, {top_k}")
    seeds = ([seed * 1_000_003 + i for i in range(len(prompts))] if isinstance(seed, int)
             else list(seed))
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: seed must be an int or one int per prompt, got {seed!r}")
    return counts, seeds


@torch.no_grad()
@sampling_products()  # a CPU's products on packed oneDNN weights (speed.pack_linears)
def generate(model: Transformer, prompts, *, num_samples=1, max_new_tokens=256, temperature=1.0,
             top_p=1.0, top_k=0, stop_token_ids=(), seed=0, compile=None, compact_fraction=0.25,
             check_every=None, record_routing=False, stream=None):
    """prompts: list of token-id lists; num_samples: int, or one int per prompt; seed: int, or one
    int per prompt. compile: run the decode step through torch.compile (None: where it is faster,
    see `compiled_by_default`). check_every: steps between the host's looks at which rows have
    stopped (None: 8 on a GPU, where a look stalls the queue of kernels; 1 on a CPU, where it
    costs nothing and each look can end the loop sooner). record_routing: on an MoE model, each
    Completion's `.routing` holds the experts every position went to (for routing replay).
    stream: called at each host look with the tokens so far, (B, steps), 0 past a stop (demo.py).
    -> list[Completion], prompt-major. The same seed gives the same samples.
    """
    counts, seeds = _check_inputs(model, prompts, num_samples, max_new_tokens, temperature, top_p,
                                  top_k, check_every, seed)
    record = record_routing and model.config.num_experts > 0
    step_fn = step_function(model, compile, record)
    check_every = check_every or (8 if model.device.type == "cuda" else 1)

    # 1. Prefill each prompt once, then give each of its samples a copy of its cache rows.
    cache, logits, row_prompt, routes = prefill(model, prompts, counts, max_new_tokens, record)
    B, device, prompt_len = len(row_prompt), model.device, cache.max_len - max_new_tokens
    keys = sample_keys(seeds, counts).to(device)  # (B,) each row's random stream
    tokens, logp = sample_tokens(logits, step_uniforms(keys, 0), temperature, top_p, top_k)
    tokens = tokens.clone()  # (B,) not a view: a compiled step would recompile for a view's base
    out_tokens, out_logp, lengths, stopped = output_buffers(B, max_new_tokens, device)
    stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    active = torch.arange(B, device=device)  # rows still in the batch (some may have stopped)

    # 2. Decode: one token per row per step, on the device throughout; the host reads the batch
    #    only every `check_every` steps (to stop, or to drop finished rows).
    for step in range(max_new_tokens):
        running = ~stopped[active]  # (b,) rows whose token counts
        out_tokens[active, step] = torch.where(running, tokens, 0)
        out_logp[active, step] = torch.where(running, logp, 0.0)
        hit = running & torch.isin(tokens, stop_ids)  # (b,)
        lengths[active] = torch.where(hit, step + 1, lengths[active])
        stopped[active] = stopped[active] | hit
        if step + 1 == max_new_tokens:
            break
        if (step + 1) % check_every == 0:
            if stream:
                stream(out_tokens[:, :step + 1].clone())  # (B, steps), the caller's to keep
            done, rows = look_at_stops(stopped, active, compact_fraction)
            if done:
                break
            if rows is not None:  # finished rows cost a forward per step; dropping them, one copy
                cache.select_rows(rows)
                active, tokens, keys = active[rows], tokens[rows], keys[rows]
        routing = Routing() if record else None
        # The filled slots only, in buckets of 32 (compiled: one recompile makes it a symbol).
        cache.visible = min(cache.max_len, -(-(prompt_len + step + 1) // 32) * 32)
        draw = torch.full((1,), step + 1, dtype=torch.long, device=device)  # a fill, not a copy
        tokens, logp = step_fn(model, tokens, cache, keys, draw, temperature, top_p, top_k,
                               routing)  # (b,), (b,): the next token of each row
        if record:  # the token fed at this step sits at position prompt_len + step
            routes[active, prompt_len + step] = routing.stacked(model.config)[:, 0].short()
    return completions(prompts, row_prompt, out_tokens, out_logp, lengths, stopped, routes,
                       prompt_len)


def step_function(model, compile, record):
    """The decode step: through torch.compile where that is faster (compile None:
    `compiled_by_default`), eager on an MoE (it groups tokens by expert with a host read) and
    when recording routes (eager work)."""
    if compile is None:
        compile = compiled_by_default(model)
    return compiled_step(model.device) if compile and model.config.num_experts == 0 \
        and not record else decode_step


def output_buffers(rows, max_new_tokens, device):
    """What the decode loop fills: tokens (B, N_new), their log-probs (B, N_new), each row's
    length (B,; the budget until it stops) and whether it stopped (B,)."""
    return (torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device),
            torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device),
            torch.full((rows,), max_new_tokens, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.bool, device=device))


def look_at_stops(stopped, active, compact_fraction):
    """The host's one read of the batch: -> (every row stopped?, the rows to keep when at least
    compact_fraction of the batch has stopped, else None)."""
    keep = ~stopped[active]  # (b,)
    left = int(keep.sum())  # the host read
    if left == 0:
        return True, None
    if len(active) - left >= max(1, compact_fraction * len(active)):
        return False, keep.nonzero().squeeze(-1)
    return False, None


def prefill(model, prompts, counts, max_new_tokens, record):
    """Left-pads the prompts, runs them through the model once into a new KV cache, and copies
    each prompt's cache rows to its samples'.
    -> cache (decoding), logits (B, V) of the last prompt token, row_prompt (B,), routes or None."""
    device = model.device
    prompt_len = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), prompt_len, dtype=torch.long)  # (N, P), left-padded
    real = torch.zeros(len(prompts), prompt_len, dtype=torch.long)  # (N, P)
    for i, p in enumerate(prompts):
        ids[i, prompt_len - len(p):] = torch.tensor(p)
        real[i, prompt_len - len(p):] = 1
    cache = KVCache(model.config, len(prompts), prompt_len + max_new_tokens, model.dtype, device)
    routing = Routing() if record else None
    logits = model(ids.to(device), real.to(device), cache=cache, last_only=True,
                   routing=routing)[:, -1].float()  # (N, V)
    row_prompt = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(counts))  # (B,)
    cache.select_rows(row_prompt.to(device))
    cache.decoding = True
    routes = (routes_buffer(model, routing, row_prompt.to(device), max_new_tokens) if record
              else None)  # (B, P + N_new, L, k)
    return cache, logits[row_prompt.to(device)], row_prompt, routes


def decode_step(model, tokens, cache, keys, draw, temperature, top_p, top_k, routing=None):
    """Feeds each row's last token (b,) and samples its next: -> tokens (b,), logprobs (b,).
    draw (1,): the step's index in each row's random stream. One graph for torch.compile."""
    logits = model.decode(tokens, cache, routing)  # (b, V) float32
    return sample_tokens(logits, step_uniforms(keys, draw), temperature, top_p, top_k)


def compiled_by_default(model) -> bool:
    """Where `generate` compiles its decode step unless told: measured faster there."""
    return model.device.type == "cuda"


_COMPILED = {}


def compiled_step(device):
    """decode_step through torch.compile, made once per device type: one whole graph
    (fullgraph), shapes dynamic (a new batch size or prompt length is no new compile). Not CUDA
    graphs yet: they skip a graph whose inputs (the cache) are written in place, and compaction
    would re-record them; measuring that on a GPU is still to do. Without duck shapes: by default, sizes equal when first seen share one symbol, so a batch of 64 rows
    would be fixed at 64 along with a head size of 64."""
    if device.type not in _COMPILED:
        _COMPILED[device.type] = torch.compile(decode_step, fullgraph=True, dynamic=True)
    return without_duck_shapes(_COMPILED[device.type])


def without_duck_shapes(compiled):
    def step(*args):
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # read when compiling
            return compiled(*args)
    return step


def completions(prompts, row_prompt, out_tokens, out_logp, lengths, stopped, routes, prompt_len):
    """The decode loop's tensors -> list[Completion], one per row (prompt-major)."""
    out_tokens, out_logp = out_tokens.cpu(), out_logp.cpu()
    lengths, stopped = lengths.cpu().tolist(), stopped.cpu().tolist()
    routes = routes.cpu() if routes is not None else None
    starts = [prompt_len - len(prompts[int(g)]) for g in row_prompt]  # each row's first real slot
    return [Completion(prompt_index=int(row_prompt[r]), tokens=out_tokens[r, :lengths[r]].tolist(),
                       logprobs=out_logp[r, :lengths[r]].tolist(),
                       finish_reason="stop" if stopped[r] else "length",
                       routing=routes[r, starts[r]:prompt_len + lengths[r]] if routes is not None
                       else None)
            for r in range(len(row_prompt))]


def routes_buffer(model, routing, row_prompt, max_new_tokens):
    """(B, P + max_new_tokens, L, k) int16: each sample row's prompt experts (as the prefill
    routed them), then -1 until a token is fed at that position."""
    prompt = routing.stacked(model.config).index_select(0, row_prompt)  # (B, P, L, k)
    B, P, L, k = prompt.shape
    routes = torch.full((B, P + max_new_tokens, L, k), -1, dtype=torch.int16, device=prompt.device)
    routes[:, :P] = prompt
    return routes
