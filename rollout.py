"""Sampling: many prompts x G samples through a paged KV cache with continuous batching.

    completions = generate(model, prompts, num_samples=G, max_new_tokens=64, temperature=1.0,
                           stop_token_ids=[tokenizer.eos_token_id], seed=0)

How one call runs (the design of vLLM and nano-vllm, in plain PyTorch):
1. Keys and values live in a pool of fixed-size blocks (`PagedKVCache`, model.py; `BlockPool`
   counts who holds each block). Each prompt waits in a queue with its G rows (`Engine`).
2. `Engine.admit` moves prompts in while free blocks and the row cap allow; `Engine.prefill` runs
   their positions through the model in chunks of at most `prefill_tokens`, once per prompt: its
   G rows share its blocks, and a row copies a shared block only when it first writes into it.
3. `Engine.decode`: every running row feeds its last token (`Transformer.paged`, reading only its
   own blocks) and draws the next by inverse CDF (cumulative sum + searchsorted: at a 49k
   vocabulary ~30x cheaper than torch.multinomial; in two levels, `inverse_cdf`) with one
   uniform per row, a hash of (the prompt's seed, the sample's index, the row's token count): no
   generator, and a row's sample never depends on the rows around it or on when it ran. The
   host reads the drawn tokens once per step; a row that stops frees its blocks at once and a
   waiting prompt takes them. A row that finds no free block preempts the newest running row,
   which frees its blocks and is recomputed when admitted again: never out of memory.
4. The pool is sized by `kv_budget` (see `pool_blocks`); a row that cannot fit alone is refused
   before any work.
5. `on_group` hears of each prompt whose last row has ended, and may queue more prompts into the
   same running call (dynamic sampling's next round, refills.py).

Each completion's `.logprobs` are those of the distribution the token was drawn from: the logits
divided by the temperature, before top-k/top-p truncation (at temperature 1, the policy's own
log-probs). The trainer computes its own at the same temperature and logs the gap. At
temperature 0 (greedy) they are the untempered policy's log-probs.

`python bench.py sampler` times this sampler, eager and compiled, against transformers'
`generate`, eager and with a compiled static cache, on the same weights, batch, lengths and
dtype, side by side in one process. Tests: `python -m pytest tests/test_rollout.py
tests/test_engine.py`.
"""

import itertools
import json
import os
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cuda_graphs import BucketedStep, bucket
from model import PagedKVCache, Transformer
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
             top_p=1.0, top_k=0, stop_token_ids=(), seed=0, compile=None, check_every=None,
             record_routing=False, stream=None, kv_budget=None, max_rows=None, block_size=16,
             prefill_tokens=8192, stats=None, on_group=None, cuda_graphs=False):
    """prompts: list of token-id lists; num_samples: int, or one int per prompt; seed: int, or one
    int per prompt. compile: run the decode step through torch.compile (None: eager,
    see `step_function`). record_routing: on an MoE model, each Completion's `.routing`
    holds the experts every position went to (for routing replay). stream: called every
    `check_every` decode steps (None: 1) with the tokens so far, (B, longest), 0 past a row's
    end (demo.py). on_group: called as each prompt's last row ends, with the prompt's index and
    its Completions; it may return more prompts for the same queue, (prompts, num_samples, seeds)
    as lists, numbered on from those so far (dynamic sampling's refills, refills.py); they share
    the pool and row cap sized for the call's own prompts.
    cuda_graphs: decode steps padded to buckets and, on a GPU, replayed as CUDA graphs (not with
    compile, an MoE or record_routing; see `step_function`).
    The engine: kv_budget, GiB of KV blocks (None: every row at its longest on a CPU; on CUDA
    also at most 90% of the free memory, see `pool_blocks`); max_rows running at once (None: all);
    block_size, positions a block holds; prefill_tokens, the most prompt tokens one prefill
    forward computes. stats: a dict the call fills with the engine's counts: waits, preemptions,
    prefill_tokens, decode_steps, pool_blocks, peak_blocks, blocks_in_use (0 at the end),
    block_bytes.
    -> list[Completion], prompt-major. The same seed gives the same samples, whatever the budget.
    """
    counts, seeds = _check_inputs(model, prompts, num_samples, max_new_tokens, temperature, top_p,
                                  top_k, check_every, seed)
    if block_size < 1 or prefill_tokens < 1 or (max_rows is not None and max_rows < 1):
        raise ValueError(f"generate: need block_size, prefill_tokens and max_rows >= 1; got "
                         f"{block_size}, {prefill_tokens}, {max_rows}")
    rows, record = max_rows or sum(counts), record_routing and model.config.num_experts > 0
    step_fn = step_function(model, compile, record, cuda_graphs)
    captured = isinstance(step_fn, BucketedStep) and step_fn.capture  # graphs on a GPU
    engine = Engine(model, pool_blocks(model, prompts, counts, max_new_tokens, block_size, kv_budget,
                                       rows, captured),
                    block_size, rows, prefill_tokens, record)
    engine.add(prompts, counts, seeds, max_new_tokens)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    stop_ids, steps = set(stop_token_ids), 0
    while engine.busy():
        engine.admit()
        if engine.prefilling:  # prompts first: their rows join the next decode step
            engine.prefill(sampling, stop_ids, max_new_tokens)
        else:
            engine.decode(step_fn, sampling, stop_ids, max_new_tokens)
            steps += 1
            if stream and steps % (check_every or 1) == 0:
                stream(tokens_so_far(engine.rows))
        for index in engine.groups_ended():
            more = on_group(index, [row.completion() for row in engine.groups[index]]) \
                if on_group else None
            if more:
                queue_more(engine, more, max_new_tokens, sampling, check_every)
    if stats is not None:
        stats.update(engine.counts())
    return [row.completion() for row in engine.rows]


def queue_more(engine, more, max_new_tokens, sampling, check_every):
    """Queues what on_group returned, (prompts, num_samples, seeds), checked as a call's own
    prompts are (and its seeds one per prompt: an int would repeat the first prompts' streams)."""
    prompts, counts, seeds = more
    if not isinstance(seeds, (list, tuple)):
        raise ValueError(f"generate: on_group's seeds must be one int per prompt, got {seeds!r}")
    counts, seeds = _check_inputs(engine.model, prompts, counts, max_new_tokens, *sampling.values(),
                                  check_every, seeds)
    refuse_unfit(prompts, max_new_tokens, engine.block_size, engine.cache.block_bytes,
                 engine.pool.size)
    engine.add(prompts, counts, seeds, max_new_tokens)


@dataclass
class Row:
    """One sample being drawn: its prompt, its tokens so far, and the blocks holding its keys."""
    index: int  # its place among all rows (prompt-major): its random stream
    prompt_index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    table: list[int] = field(default_factory=list)  # its KV blocks, in order
    cached: int = 0  # positions whose keys and values are in its blocks
    finish: str | None = None  # "stop" or "length" once it has ended
    routes: torch.Tensor | None = None  # (P + N_new, L, k) when recording MoE routing

    def completion(self):
        length = len(self.prompt) + len(self.tokens)
        return Completion(self.prompt_index, self.tokens, self.logprobs, self.finish,
                          None if self.routes is None else self.routes[:length].cpu())


@dataclass
class Prefill:
    """Positions to compute before rows can decode: a prompt, once for all of its rows; or a
    preempted row's prompt and tokens but the last (recomputed, then decoding goes on)."""
    rows: list[Row]
    context: list[int]
    table: list[int] = field(default_factory=list)
    done: int = 0  # positions computed so far

    @property
    def fresh(self):  # a prompt's first prefill: its logits give each row's first token
        return not self.rows[0].tokens


def prompt_groups(rows, counts):
    """Rows (prompt-major) -> one list of rows per prompt."""
    ends = list(itertools.accumulate(counts))
    return [rows[end - c:end] for c, end in zip(counts, ends)]


class BlockPool:
    """The KV cache's blocks: a free list and a reference count per block (nano-vllm's block
    manager). Block 0 is the cache's scratch block, never handed out."""

    def __init__(self, size):
        self.size = size
        self.free = list(range(size - 1, 0, -1))  # pop() hands out low ids first
        self.refs = [0] * size
        self.peak = 0  # the most blocks in use at once

    def allocate(self):
        block = self.free.pop()
        self.refs[block] = 1
        self.peak = max(self.peak, self.size - 1 - len(self.free))
        return block

    def share(self, blocks, times=1):
        for block in blocks:
            self.refs[block] += times

    def release(self, blocks):
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)


def pool_blocks(model, prompts, counts, max_new_tokens, block_size, kv_budget, rows=None,
                cuda_graphs=False):
    """The pool's size in blocks (the scratch block included): what every row needs at its
    longest, no more; within kv_budget GiB when given, and on CUDA within 90% of the memory free
    beside the decode step's working memory (`rows` at once, all by default; `cuda_graphs`).
    A row that cannot fit alone is refused here, before any work, with the arithmetic."""
    cfg = model.config
    block_bytes = PagedKVCache.bytes_per_block(cfg, block_size, model.dtype)
    longest = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]  # blocks a row
    blocks = 1 + sum(n * c for n, c in zip(longest, counts))
    budget = kv_budget * 2**30 if kv_budget is not None else None
    if model.device.type == "cuda":
        working = decode_working_bytes(cfg, rows or sum(counts), cuda_graphs)
        free = 0.9 * max(0, torch.cuda.mem_get_info(model.device)[0] - working)
        budget = free if budget is None else min(budget, free)
    if budget is not None:
        blocks = min(blocks, int(budget // block_bytes))
    refuse_unfit(prompts, max_new_tokens, block_size, block_bytes, blocks)
    return blocks


def decode_working_bytes(cfg, rows, cuda_graphs=False) -> int:
    """A decode step's memory beside the KV pool: float32 logits and two more (B, V) float32
    tensors in sampling, 12 bytes a row a vocabulary entry; under CUDA graphs the graphs' own pool
    holds them again, at the bucket of rows (cuda_graphs.bucket)."""
    one = rows * cfg.vocab_size * 12
    return one + bucket(rows) * cfg.vocab_size * 12 if cuda_graphs else one


def refuse_unfit(prompts, max_new_tokens, block_size, block_bytes, blocks):
    """A ValueError with the arithmetic when a row of `prompts` cannot fit alone in a pool of
    `blocks` (the scratch block included)."""
    longest = max(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)  # blocks a row
    if blocks < 1 + longest:
        raise ValueError(
            f"generate: a row of {max(len(p) for p in prompts)} prompt + {max_new_tokens} new "
            f"tokens needs {longest} blocks of {block_size} positions ({block_bytes} bytes "
            f"each, {longest * block_bytes / 2**30:.3g} GiB) and the scratch block; the KV "
            f"budget holds {blocks} blocks, one of them scratch: raise it, or lower "
            f"max_new_tokens")


class Engine:
    """Continuous batching over the paged cache: prompts wait in a queue and are admitted while
    blocks and the row cap allow; their prefill runs in chunks; each decode step feeds every
    running row one token; a row that ends frees its blocks at once, and a row that finds no free
    block preempts the newest running row (its blocks freed, recomputed when admitted again)."""

    def __init__(self, model, num_blocks, block_size, max_rows, prefill_tokens, record):
        self.model, self.max_rows, self.prefill_tokens, self.record = \
            model, max_rows, prefill_tokens, record
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.pool, self.block_size = BlockPool(num_blocks), block_size
        self.waiting, self.prefilling, self.decoding = deque(), [], []  # Prefill, Prefill, Row
        self.rows, self.groups, self.ended = [], [], []  # every Row; each prompt's; ended, unread
        self.keys = torch.zeros(0, dtype=torch.long, device=model.device)  # (B,) random streams
        self.stats = dict(waits=0, preemptions=0, prefill_tokens=0, decode_steps=0)

    def add(self, prompts, counts, seeds, max_new_tokens):
        """Queues prompts with counts[i] rows each, numbered on from those so far (prompt-major);
        recording routes, each row with its (P + N_new, L, k) buffer (-1: dense layers, and
        positions never fed)."""
        first_row, first_prompt, cfg = len(self.rows), len(self.groups), self.model.config
        rows = [Row(first_row + r, first_prompt + i, list(prompts[i])) for r, i in enumerate(
            i for i, c in enumerate(counts) for _ in range(c))]
        for row in rows if self.record else ():
            row.routes = torch.full((len(row.prompt) + max_new_tokens, cfg.num_layers,
                                     cfg.experts_per_token), -1, dtype=torch.int16)
        groups = prompt_groups(rows, counts)
        self.rows += rows
        self.groups += groups
        self.keys = torch.cat([self.keys, sample_keys(seeds, counts).to(self.model.device)])
        self.waiting.extend(Prefill(group, list(prompts[i])) for i, group in enumerate(groups))

    def groups_ended(self):
        """-> the indices of the prompts whose last row ended since the last call."""
        prompts = {row.prompt_index for row in self.ended}
        self.ended = []
        return sorted(i for i in prompts if all(row.finish for row in self.groups[i]))

    def busy(self):
        return bool(self.waiting or self.prefilling or self.decoding)

    def counts(self):
        """What generate's `stats` receives."""
        return dict(self.stats, peak_blocks=self.pool.peak, pool_blocks=self.pool.size,
                    blocks_in_use=self.pool.size - 1 - len(self.pool.free),
                    block_bytes=self.cache.block_bytes)

    def admit(self):
        """Moves queued prefills in, oldest first, while blocks (a prompt's, plus one of its own
        for each row; with nothing running, the prompt's alone) and row slots allow; a prompt's
        rows split when not all fit."""
        while self.waiting:
            job = self.waiting[0]
            need = -(-len(job.context) // self.block_size)
            running = len(self.decoding) + sum(len(j.rows) for j in self.prefilling)
            spare = len(self.pool.free) - need  # blocks left for the rows' own
            fit = min(len(job.rows), self.max_rows - running,
                      spare if running or spare < 0 else max(spare, 1))
            if fit < 1:
                self.stats["waits"] += 1
                return
            self.waiting.popleft()
            if fit < len(job.rows):  # the rest wait, to prefill the prompt again for themselves
                self.waiting.appendleft(Prefill(job.rows[fit:], job.context))
                job = Prefill(job.rows[:fit], job.context)
            job.table = [self.pool.allocate() for _ in range(need)]
            self.prefilling.append(job)

    def prefill(self, sampling, stop_ids, max_new_tokens):
        """One forward over the next chunks of the admitted prefills, at most `prefill_tokens`
        positions in all; a prompt that completes draws each of its rows' first token."""
        chunks, left = [], self.prefill_tokens
        for job in self.prefilling:
            n = min(len(job.context) - job.done, left)
            if n < 1:
                break
            chunks.append((job, n))
            left -= n
        tokens = pad_rows([job.context[job.done:job.done + n] for job, n in chunks])  # (b, T)
        start = self.tensor([job.done for job, _ in chunks])  # (b,)
        count = self.tensor([n for _, n in chunks])  # (b,)
        routing = Routing() if self.record else None
        logits = self.model.paged(tokens.to(self.model.device), start, count,
                                  self.tables([job.table for job, _ in chunks]), self.cache,
                                  routing, with_logits=any(job.fresh for job, _ in chunks))
        self.stats["prefill_tokens"] += sum(n for _, n in chunks)
        routes = routing.stacked(self.model.config).short().cpu() if routing else None  # (b, T, L, k)
        drawing, source = [], []  # the rows of completed prompts, and their chunk's index
        for i, (job, n) in enumerate(chunks):
            for row in job.rows if routes is not None else ():
                row.routes[job.done:job.done + n] = routes[i, :n]
            job.done += n
            if job.done == len(job.context):
                self.prefilling.remove(job)
                self.start_decoding(job)
                if job.fresh:
                    drawing += job.rows
                    source += [i] * len(job.rows)
        if drawing:  # their first tokens, all in one draw
            rows = self.tensor([row.index for row in drawing])
            uniforms = step_uniforms(self.keys[rows], 0)
            drawn, logp = sample_tokens(logits[self.tensor(source)], uniforms, **sampling)
            self.take(drawing, drawn, logp, stop_ids, max_new_tokens)

    def start_decoding(self, job):
        """The prefill's rows join the decode batch, sharing its blocks (a block one of them
        writes into is copied first)."""
        self.pool.share(job.table, len(job.rows) - 1)
        for row in job.rows:
            row.table, row.cached = list(job.table), len(job.context)
            self.decoding.append(row)

    def decode(self, step_fn, sampling, stop_ids, max_new_tokens):
        """Every running row feeds its last token and draws the next (one host read)."""
        self.make_room()
        rows = self.decoding
        index = self.tensor([row.index for row in rows])  # (b,)
        fed = self.tensor([row.tokens[-1] for row in rows])  # (b,)
        start = self.tensor([row.cached for row in rows])  # (b,) the fed token's position
        draws = self.tensor([len(row.tokens) for row in rows])  # (b,) each row's step
        routing = Routing() if self.record else None
        drawn, logp = step_fn(self.model, fed, start, self.tables([r.table for r in rows]),
                              self.cache, self.keys[index], draws, *sampling.values(), routing)
        routes = routing.stacked(self.model.config).short().cpu() if routing else None  # (b, 1, L, k)
        for i, row in enumerate(rows):
            if routes is not None:  # the fed token's experts
                row.routes[row.cached] = routes[i, 0]
            row.cached += 1
        self.stats["decode_steps"] += 1
        self.take(list(rows), drawn, logp, stop_ids, max_new_tokens)

    def take(self, rows, drawn, logp, stop_ids, max_new_tokens):
        """Appends each row's drawn token (b,) and log-prob (b,); rows that end leave."""
        # One read from the device: ids below 2^53 and float32 log-probs are exact in float64.
        drawn, logp = torch.stack([drawn.double(), logp.double()]).tolist()
        for row, token, lp in zip(rows, drawn, logp):
            row.tokens.append(int(token))
            row.logprobs.append(lp)
            if int(token) in stop_ids or len(row.tokens) == max_new_tokens:
                row.finish = "stop" if int(token) in stop_ids else "length"
                self.decoding.remove(row)
                self.pool.release(row.table)
                row.table = []
                self.ended.append(row)

    def make_room(self):
        """Gives each running row, oldest first, a block of its own for the position it writes:
        a new one at a block's start, a copy of a shared one. With none free, the newest running
        row is preempted (it may be this row)."""
        i = 0
        while i < len(self.decoding):
            row = self.decoding[i]
            b = row.cached // self.block_size
            if b < len(row.table) and self.pool.refs[row.table[b]] == 1:
                i += 1
                continue
            if not self.pool.free:
                self.preempt(self.decoding[-1])
                continue  # row i again, unless it was the one preempted
            block = self.pool.allocate()
            if b < len(row.table):  # copy on write
                self.cache.copy_block(row.table[b], block)
                self.pool.release([row.table[b]])
                row.table[b] = block
            else:
                row.table.append(block)
            i += 1

    def preempt(self, row):
        """Frees a running row's blocks; it waits first in the queue to be recomputed (its prompt
        and tokens but the last), then decodes on: its random stream counts its own tokens."""
        self.decoding.remove(row)
        self.pool.release(row.table)
        row.table, row.cached = [], 0
        self.waiting.appendleft(Prefill([row], row.prompt + row.tokens[:-1]))
        self.stats["preemptions"] += 1

    def tensor(self, values):
        return torch.tensor(values, dtype=torch.long, device=self.model.device)

    def tables(self, tables):
        """Block tables -> (b, nb) long on the device, padded with the scratch block 0."""
        return pad_rows(tables).to(self.model.device)


def pad_rows(rows):
    """Lists of ints -> (len(rows), longest) long, right-padded with 0."""
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def tokens_so_far(rows):
    """(B, longest) long: each row's tokens, 0 past its end (what `stream` is given)."""
    return pad_rows([row.tokens or [0] for row in rows])


def step_function(model, compile, record, cuda_graphs=False):
    """The decode step: eager unless `compile` is True (None: eager on every device; on an H100
    the whole step's first compile for Qwen2.5-0.5B outlasted 4 minutes, MEASUREMENTS.md "On a
    GPU") or `cuda_graphs` (padded to buckets, replayed as CUDA graphs on a GPU: cuda_graphs.py;
    the same padding, eager, elsewhere); eager on an MoE (it groups tokens by expert with a host
    read) and when recording routes (eager work)."""
    if model.config.num_experts or record:
        return decode_step
    if cuda_graphs:
        return BucketedStep(decode_step, capture=model.device.type == "cuda")
    return compiled_step(model.device) if compile else decode_step


def decode_step(model, fed, start, tables, cache, keys, draws, temperature, top_p, top_k,
                routing=None):
    """Feeds each row's last token fed (b,) at position start (b,) and draws its next:
    -> tokens (b,), logprobs (b,). draws (b,): each row's index in its random stream.
    One graph for torch.compile."""
    logits = model.paged(fed[:, None], start, torch.ones_like(start), tables, cache,
                         routing)  # (b, V) float32
    return sample_tokens(logits, step_uniforms(keys, draws), temperature, top_p, top_k)


_COMPILED = {}


def compiled_step(device):
    """decode_step through torch.compile, made once per device type: one whole graph
    (fullgraph), shapes dynamic (a new row count or table width is no new compile). Without
    duck shapes: by default, sizes equal when first seen share one symbol, so a batch of 64 rows
    would be fixed at 64 along with a head size of 64."""
    if device.type not in _COMPILED:
        _COMPILED[device.type] = torch.compile(decode_step, fullgraph=True, dynamic=True)
    return without_duck_shapes(_COMPILED[device.type])


def without_duck_shapes(compiled):
    def step(*args):
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # read when compiling
            return compiled(*args)
    return step
