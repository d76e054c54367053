"""Sampling: many prompts x G samples through a paged KV cache with continuous batching.

    sampling = Sampling(max_new_tokens=64, temperature=1.0, stop_token_ids=[tokenizer.eos_token_id])
    completions = generate(model, prompts, sampling, num_samples=G)

How one call runs: `Engine` (engine/paged.py, the design of vLLM and nano-vllm) keeps the keys and
values in a pool of fixed-size blocks, admits the prompts while blocks allow, prefills each prompt
once for its G rows, and feeds every running row its last token at each decode step; a row that
stops frees its blocks for a waiting prompt, and one that finds none free preempts the newest.
This file draws the tokens: by inverse CDF (cumulative sum + searchsorted: at a 49k vocabulary
~30x cheaper than torch.multinomial; in two levels, `inverse_cdf`) with one uniform per row, a
hash of (the prompt's seed, the sample's index, the row's token count): no generator, so a row's
sample never depends on the rows around it, on when it ran, or on the KV budget. `on_group` hears
of each prompt whose last row has ended, and may queue more prompts into the same running call
(dynamic sampling's next round, variants/refills.py). This file and engine/paged.py run the
plain decode step; the speed-ups (a compiled step, CUDA graphs, FlexAttention, a CPU's packed
products) are handed in from outside: `engine=EngineOptions(speed=SpeedUps(...))`
(engine/speedups.py).

Each completion's `.logprobs` are those of the distribution the token was drawn from: the logits
divided by the temperature, before top-k/top-p truncation (at temperature 1, the policy's own
log-probs). The trainer computes its own at the same temperature and logs the gap. At
temperature 0 (greedy) they are the untempered policy's log-probs.

`python recipes/bench.py sampler` times this sampler, eager and compiled, against transformers'
`generate`, eager and with a compiled static cache, on the same weights, batch, lengths and
dtype, side by side in one process. Tests: `python -m pytest tests/test_rollout.py
tests/test_engine.py`.
"""

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.paged import (Engine, EngineOptions, default_kv_budget, draw_bytes, pool_blocks,
                          refuse_unfit, tokens_so_far)
from model import PagedKVCache, Transformer


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
    """logits (B, V) float32, uniforms (B,) in [0, 1) -> tokens (B,), logprobs (B,), the log-prob
    under softmax(logits / temperature) before any truncation."""
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
    cumulative weight exceeds u * total: a draw from weights / total. In two levels, as one
    cumulative sum over the whole vocabulary costs 10x more than a sum: the chunk whose
    cumulative mass passes the target, then the index inside that chunk."""
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


@dataclass(frozen=True)
class Sampling:
    """How a call's rows draw their tokens (nano-vllm's SamplingParams)."""
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0        # nucleus: the fewest most likely tokens of mass >= top_p
    top_k: int = 0            # 0: every token
    stop_token_ids: tuple | list = ()  # ids that end a row (kept as its last token)
    seed: int | list = 0      # an int, or one per prompt: with the sample's index, its random stream


def _check_inputs(model, prompts, num_samples, sampling, check_every, seed):
    """-> samples per prompt, seed per prompt; or a ValueError naming the bad argument."""
    max_new_tokens = sampling.max_new_tokens
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
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
        raise ValueError(f"generate: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                         f"{sampling.temperature}, {sampling.top_p}, {sampling.top_k}")
    seeds = ([seed * 1_000_003 + i for i in range(len(prompts))] if isinstance(seed, int)
             else list(seed))
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: seed must be an int or one int per prompt, got {seed!r}")
    return counts, seeds


@torch.no_grad()
def generate(model: Transformer, prompts, sampling=Sampling(), *, num_samples=1,
             engine=EngineOptions(), record_routing=False, stream=None, check_every=None,
             on_group=None, stats=None):
    """prompts: token-id lists; num_samples: an int, or one per prompt; engine: EngineOptions (the
    KV budget, the row cap, speed-ups chosen outside this file). record_routing: an MoE's
    Completions hold each position's experts. stream: called every `check_every` decode steps
    (None: 1) with the tokens so far, (B, longest), 0 past a row's end. on_group(prompt index, its
    Completions), as each prompt's last row ends, may return (prompts, num_samples, seeds) to
    queue on, numbered on from those so far (variants/refills.py). stats: a dict, given the
    engine's counts. -> list[Completion], prompt-major; the same seed, the same samples."""
    counts, seeds = _check_inputs(model, prompts, num_samples, sampling, check_every, sampling.seed)
    rows, record = engine.max_rows or sum(counts), record_routing and model.config.num_experts > 0
    draw = draw_bytes(sampling.temperature, sampling.top_p, sampling.top_k)  # its memory, a row
    budget = engine.kv_budget if engine.kv_budget is not None else default_kv_budget(
        model, prompts, counts, sampling.max_new_tokens, engine.block_size, rows, draw)  # a CPU's
    speed = engine.speed  # None: the plain step and cache
    step_fn, cache = speed.choose(model, record, budget) if speed else (decode_step, PagedKVCache)
    graphs = getattr(step_fn, "capture", False)  # CUDA graphs hold the step's memory once more
    with speed.context() if speed else contextlib.nullcontext():
        blocks = pool_blocks(model, prompts, counts, sampling.max_new_tokens, engine.block_size,
                             budget, rows, graphs, cache, draw)
        grouped = step_fn is decode_step and cache is PagedKVCache  # an eager step reads by groups
        running = Engine(model, blocks, engine.block_size, rows, engine.prefill_tokens, record,
                         cache, grouped)
        running.add(prompts, counts, sample_keys(seeds, counts), sampling.max_new_tokens)
        run_engine(running, step_fn, sampling, stream, check_every, on_group)
    if stats is not None:
        stats.update(running.counts(), **getattr(step_fn, "counts", dict)())  # BucketedStep's too
    return [completion(row) for row in running.rows]


def run_engine(running, step_fn, sampling, stream, check_every, on_group):
    """Prefills and decode steps of the `running` Engine until no row is left: prompts first
    (their rows join the next decode step), and on_group's further prompts queued as each group
    ends."""
    draw = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    stop_ids, max_new_tokens, steps = set(sampling.stop_token_ids), sampling.max_new_tokens, 0

    def draw_first(logits, keys):  # a prompt's rows' first tokens: draw 0 of each row's stream
        return sample_tokens(logits, step_uniforms(keys, 0), **draw)

    while running.busy():
        running.admit()
        if running.prefilling:
            running.prefill(draw_first, stop_ids, max_new_tokens)
        else:
            running.decode(step_fn, draw, stop_ids, max_new_tokens)
            steps += 1
            if stream and steps % (check_every or 1) == 0:
                stream(tokens_so_far(running.rows))
        for index in running.groups_ended():
            more = on_group(index, [completion(row) for row in running.groups[index]]) \
                if on_group else None
            if more:
                queue_more(running, more, sampling, check_every)


def completion(row):
    """An engine/paged.py Row's result."""
    routing = None if row.routes is None else row.routes[:len(row.prompt) + len(row.tokens)].cpu()
    return Completion(row.prompt_index, row.tokens, row.logprobs, row.finish, routing)


def queue_more(running, more, sampling, check_every):
    """Queues what on_group returned, (prompts, num_samples, seeds), checked as a call's own
    prompts are (and its seeds one per prompt: an int would repeat the first prompts' streams)."""
    prompts, counts, seeds = more
    if not isinstance(seeds, (list, tuple)):
        raise ValueError(f"generate: on_group's seeds must be one int per prompt, got {seeds!r}")
    counts, seeds = _check_inputs(running.model, prompts, counts, sampling, check_every, seeds)
    refuse_unfit(prompts, sampling.max_new_tokens, running.block_size, running.cache.block_bytes,
                 running.pool.size)
    running.add(prompts, counts, sample_keys(seeds, counts), sampling.max_new_tokens)


def decode_step(model, fed, start, tables, cache, keys, draws, temperature, top_p, top_k,
                routing=None):
    """Feeds each row's last token fed (b,) at position start (b,) and draws its next:
    -> tokens (b,), logprobs (b,). draws (b,): each row's index in its random stream.
    One graph for torch.compile."""
    logits = model.paged(fed[:, None], start, torch.ones_like(start), tables, cache,
                         routing)  # (b, V) float32
    return sample_tokens(logits, step_uniforms(keys, draws), temperature, top_p, top_k)
