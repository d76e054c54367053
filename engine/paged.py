"""The rollout engine: a paged KV cache's blocks and continuous batching, the design of vLLM and
nano-vllm in plain PyTorch. `rollout.generate` runs it and passes the draws (the first token's
and the decode step, with its sampling settings); the engine keeps blocks, rows and the queue.

1. Keys and values live in a pool of fixed-size blocks (`PagedKVCache`, model.py; `BlockPool`
   counts who holds each block). Each prompt waits in a queue with its G rows (`Engine`).
2. `Engine.admit` moves prompts in while free blocks and the row cap allow; `Engine.prefill` runs
   their positions through the model in chunks of at most `prefill_tokens`, once per prompt: its
   G rows share its blocks, and a row copies a shared block only when it first writes into it.
3. `Engine.decode`: every running row feeds its last token (`Transformer.paged`, reading only its
   own blocks) and draws the next. The host reads the drawn tokens once per step; a row that
   stops frees its blocks at once and a waiting prompt takes them. A row that finds no free
   block preempts the newest running row, which frees its blocks and is recomputed when admitted
   again: never out of memory.
4. The pool is sized by a KV budget (`pool_blocks`; with none given, the memory free: a GPU's,
   its allocator's cache included, or a share of a CPU's host); a row that cannot fit alone is
   refused before any work (`refuse_unfit`).

Tests: `python -m pytest tests/test_engine.py`.
"""

import itertools
import os
import resource
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model import PagedKVCache
from variants.moe import Routing


@dataclass(frozen=True)
class EngineOptions:
    """The engine's knobs, for `rollout.generate(..., engine=EngineOptions(...))`."""
    kv_budget: float | None = None  # GiB of KV blocks (None: every row at its longest, within
    #                                 90% of a GPU's free memory, half a CPU's: `pool_blocks`,
    #                                 `default_kv_budget`)
    max_rows: int | None = None     # rows running at once (None: all)
    block_size: int = 16            # positions a block holds
    prefill_tokens: int = 8192      # the most positions one prefill forward computes
    # The speed-ups, chosen outside this file: None (the plain decode step and PagedKVCache), or
    # an object with choose(model, record, kv_budget) -> (decode step, cache class) and context()
    # (engine/speedups.py's SpeedUps).
    speed: object = None

    def __post_init__(self):
        if self.block_size < 1 or self.prefill_tokens < 1 or \
                (self.max_rows is not None and self.max_rows < 1):
            raise ValueError(f"generate: need block_size, prefill_tokens and max_rows >= 1; got "
                             f"{self.block_size}, {self.prefill_tokens}, {self.max_rows}")


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


def blocks_at_longest(prompt, max_new_tokens, block_size):
    """The blocks a row of `prompt` holds at its longest: ceil((P + max_new_tokens) / bs)."""
    return -(-(len(prompt) + max_new_tokens) // block_size)


def bucket(n):
    """The smallest power of two >= n (n >= 1): the rows a CUDA graph's step is padded to."""
    return 1 << (n - 1).bit_length()


def pool_blocks(model, prompts, counts, max_new_tokens, block_size, kv_budget, rows=None,
                cuda_graphs=False, cache=PagedKVCache, draw=16):
    """The pool's size in blocks (the scratch block included): what every row needs at its
    longest, no more; within kv_budget GiB when given, and on CUDA within 90% of the memory free
    (`free_cuda_bytes`: the allocator's cache counted free) beside the decode step's working
    memory (`rows` at once, all by default; `cuda_graphs`; the draw's `draw` bytes a row a
    vocabulary entry, `draw_bytes`), with the maps a `cache` class keeps for each block too
    where it has them (FlexAttention's grow with the pool: flex_decode.FlexPagedKVCache.map_bytes).
    A row that cannot fit alone is refused here, before any work, with the arithmetic."""
    cfg, rows = model.config, rows or sum(counts)
    block_bytes = PagedKVCache.bytes_per_block(cfg, block_size, model.dtype)
    longest = [blocks_at_longest(p, max_new_tokens, block_size) for p in prompts]
    blocks = 1 + sum(n * c for n, c in zip(longest, counts))
    if kv_budget is not None:
        blocks = min(blocks, int(kv_budget * 2**30 // block_bytes))
    if model.device.type == "cuda":
        # FlexAttention reads the pool in place: no gathered keys; its maps grow with the pool,
        # counted as decode_working_bytes counts the step (under graphs, their pool holds them
        # again at the bucket of rows)
        map_bytes = getattr(cache, "map_bytes", None)
        working = decode_working_bytes(cfg, rows, cuda_graphs, block_size=block_size,
                                       positions=0 if map_bytes else max(longest) * block_size,
                                       width=model.dtype.itemsize, draw=draw)
        free = 0.9 * max(0, free_cuda_bytes(model.device) - working)
        maps = (map_bytes(cfg, rows) + (map_bytes(cfg, bucket(rows)) if cuda_graphs else 0)
                if map_bytes else 0)
        blocks = min(blocks, int(free // (block_bytes + maps)))
    refuse_unfit(prompts, max_new_tokens, block_size, block_bytes, blocks)
    return blocks


def free_cuda_bytes(device) -> int:
    """What a pool may take on a GPU: the driver's free memory and what PyTorch's caching
    allocator holds reserved but unallocated, less the free parts of segments partly in use (the
    allocator cannot hand those back). A step's pool and update are freed into that cache, which
    the driver counts as used: the next step's pool, sized from the driver's figure alone, would
    find almost nothing free. An allocation the cache cannot serve makes the allocator release its
    unused segments and try again, so they are free to the pool."""
    free, _ = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    return free + cached - stats.get("inactive_split_bytes.all.current", 0)


HOST_SHARE = 0.5  # of the host's free memory, for a CPU call's KV blocks when no budget is given


def free_host_bytes() -> int | None:
    """What a pool may take on a CPU: the memory Linux calls available (MemAvailable: free, and
    the page cache it can drop), within a container's limit (cgroup v2's memory.max less its
    memory.current) and the process's address-space limit (ulimit -v) less what it maps already.
    None where /proc does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        available = min(available, limit - mapped)
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            ceiling = f.read().strip()
            if ceiling != "max":
                available = min(available, int(ceiling) - int(g.read()))
    except (OSError, ValueError):  # no cgroup v2 here, or no limit
        pass
    return max(0, available)


def default_kv_budget(model, prompts, counts, max_new_tokens, block_size, rows=None, draw=16):
    """A CPU call's KV budget in GiB when none is given: None (no bound) where every row at its
    longest fits in HOST_SHARE of the host's free memory beside the decode step, together with
    the decoding rows' keys gathered once more (engine/speed.py's KeptRowsKVCache, the CPU's
    choice with no budget: at most every row at the widest row's length); else that share, split
    between the ranks of the node (LOCAL_WORLD_SIZE, as torchrun sets it), and never less than
    one row at its longest: the pool waits and preempts within it, the samples unchanged. The
    other half is what the call grows as it runs (its rows' tokens and log-probs; the heap glibc
    keeps). On CUDA None: pool_blocks bounds the pool by the GPU's free memory."""
    free = free_host_bytes() if model.device.type == "cpu" else None
    if free is None:
        return None
    cfg, rows = model.config, rows or sum(counts)
    block_bytes = PagedKVCache.bytes_per_block(cfg, block_size, model.dtype)
    longest = [blocks_at_longest(p, max_new_tokens, block_size) for p in prompts]
    need = sum(n * c for n, c in zip(longest, counts)) * block_bytes  # every row at its longest
    gathered = min(rows, sum(counts)) * max(longest) * block_bytes  # KeptRowsKVCache's copy
    working = decode_working_bytes(cfg, rows, positions=max(longest) * block_size,  # a layer's
                                   width=model.dtype.itemsize, draw=draw)  # gather, or the draw
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")  # (torchrun's; anything else: one rank)
    ranks = int(ranks) if ranks.isascii() and ranks.isdigit() and int(ranks) > 0 else 1
    room = HOST_SHARE * max(0, free - working) / ranks
    if need + gathered <= room:
        return None
    return max(room, (1 + max(longest)) * block_bytes) / 2**30  # (one row: refused by no default)


def draw_bytes(temperature=1.0, top_p=1.0, top_k=0) -> int:
    """Bytes a row a vocabulary entry that rollout.sample_tokens holds at its peak, in (B, V)
    tensors of 4 bytes an entry (masks 1, top-p's int64 order 8): the float32 logits, shifted and
    their exp (probs), 12, and a temperature's scaled copy, 4; then inverse_cdf's padded copy, 4
    (the plain draw: 16), or top-k's kept probs and their mask, 5, or top-p's sorted probs 4,
    their order 8, cdf 4, the kept ones and their mask 5, 21. Greedy (temperature 0): the logits
    and logsumexp's exp, 8."""
    if temperature == 0:
        return 8
    held = 12 if temperature == 1 else 16
    return held + (21 if top_p < 1 else 5 if top_k else 4)


def gathered_bytes(cfg, rows, positions, width) -> int:
    """One layer's keys and values gathered through the rows' tables (PagedKVCache.write's
    index_select): (2, Hkv, rows, S, D) of `width` bytes, S = `positions`, the widest table's."""
    return 2 * cfg.num_kv_heads * rows * positions * cfg.head_dim * width


def decode_attention_bytes(cfg, rows, positions, width) -> int:
    """One layer's decode attention over gathered rows: the gathered keys and values, and
    attend_paged's scores (Hkv, rows, G, 1, S), masked (`width` bytes) beside their float32 copy
    and its softmax, width + 8 bytes an entry (float32: the scores and the softmax, 8; Gemma 2's
    cap holds scores, scores / cap and its tanh at once, 12)."""
    scores = width + 8 if width < 4 else 12 if cfg.attn_softcap else 8
    return gathered_bytes(cfg, rows, positions, width) + cfg.num_heads * rows * positions * scores


def decode_working_bytes(cfg, rows, cuda_graphs=False, *, positions=0, block_size=16, width=4,
                         kept_rows=False, draw=16) -> int:
    """A decode step's memory beside the KV pool and the weights, `rows` rows at once, the widest
    table `positions` long (its blocks x block_size; 0: attention reads the pool in place, as
    FlexAttention does), the sampler's weights `width` bytes: the larger of one layer's attention
    and the draw, rows x V x `draw` bytes (`draw_bytes`; 16 the plain draw's), which never live
    at once. Kept rows (speed.KeptRowsKVCache) hold every layer's gathered keys and values
    through the draw: L x gathered + max(scores, draw). Under CUDA graphs the step runs padded
    (rows, and blocks, each to a bucket: cuda_graphs.pad_inputs) and the graphs' own pool holds
    it again."""
    if cuda_graphs:
        rows, positions = padded(rows, positions, block_size)
    attention = decode_attention_bytes(cfg, rows, positions, width)
    drawn = rows * cfg.vocab_size * draw
    if kept_rows:
        gathered = gathered_bytes(cfg, rows, positions, width)
        step = cfg.num_layers * gathered + max(attention - gathered, drawn)
    else:
        step = max(attention, drawn)
    return 2 * step if cuda_graphs else step


def padded(rows, positions, block_size):
    """A decode step's rows and widest table as cuda_graphs.pad_inputs pads them for a CUDA
    graph: each to a bucket, the table in whole blocks."""
    return bucket(rows), bucket(-(-positions // block_size)) * block_size if positions else 0


def refuse_unfit(prompts, max_new_tokens, block_size, block_bytes, blocks):
    """A ValueError with the arithmetic when a row of `prompts` cannot fit alone in a pool of
    `blocks` (the scratch block included)."""
    why = unfit(max(len(p) for p in prompts), max_new_tokens, block_size, block_bytes, blocks)
    if why:
        raise ValueError(f"generate: {why}: raise the KV budget, or lower max_new_tokens")


def unfit(prompt_length, max_new_tokens, block_size, block_bytes, blocks) -> str | None:
    """Why a row of `prompt_length` prompt tokens and `max_new_tokens` new ones cannot fit alone
    in a pool of `blocks` (the scratch block included), with the arithmetic; None if it fits."""
    longest = -(-(prompt_length + max_new_tokens) // block_size)
    if blocks >= 1 + longest:
        return None
    return (f"a row of {prompt_length} prompt + {max_new_tokens} new tokens needs {longest} "
            f"blocks of {block_size} positions ({block_bytes} bytes each, "
            f"{longest * block_bytes / 2**30:.3g} GiB) and the scratch block; the KV budget "
            f"holds {max(blocks, 0)} blocks, one of them scratch")


class Engine:
    """Continuous batching over the paged cache: prompts wait in a queue and are admitted while
    blocks and the row cap allow; their prefill runs in chunks; each decode step feeds every
    running row one token; a row that ends frees its blocks at once, and a row that finds no free
    block preempts the newest running row (its blocks freed, recomputed when admitted again)."""

    def __init__(self, model, num_blocks, block_size, max_rows, prefill_tokens, record,
                 cache=PagedKVCache, grouped=False):
        self.model, self.max_rows, self.prefill_tokens, self.record = \
            model, max_rows, prefill_tokens, record
        # grouped: each decode step's rows sorted widest first and read in groups of like width
        # (`read_groups`): an eager step's choice; compiled steps and CUDA graphs keep one shape.
        self.grouped = grouped
        # `cache`: model.PagedKVCache's class, or one of the speed-ups' (engine/speedups.py)
        self.cache = cache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.pool, self.block_size = BlockPool(num_blocks), block_size
        self.waiting, self.prefilling, self.decoding = deque(), [], []  # Prefill, Prefill, Row
        self.rows, self.groups, self.ended = [], [], []  # every Row; each prompt's; ended, unread
        self.keys = torch.zeros(0, dtype=torch.long, device=model.device)  # (B,) random streams
        # Each row's table again, on the host, written where a decoding row's table changes: a
        # step's tables are one gather, not a conversion of every row's ints, which grew with the
        # context (MEASUREMENTS.md, "The engine"). (B, the most blocks a row may need), 0 past a
        # row's table: a table only grows while its row decodes, and a preempted row's comes
        # back as long (its recomputed positions are the ones it had cached).
        self.host_tables = torch.zeros(0, 0, dtype=torch.long)
        # blocks_read: what decode attention gathers; blocks_held: what its rows' tables list
        self.stats = dict(waits=0, preemptions=0, prefill_tokens=0, decode_steps=0,
                          blocks_read=0, blocks_held=0)

    def add(self, prompts, counts, keys, max_new_tokens):
        """Queues prompts with counts[i] rows each, numbered on from those so far (prompt-major),
        keys (sum(counts),) int64 their random streams (rollout.sample_keys); recording routes,
        each row with its (P + N_new, L, k) buffer (-1: dense layers, and positions never fed)."""
        first_row, first_prompt, cfg = len(self.rows), len(self.groups), self.model.config
        rows = [Row(first_row + r, first_prompt + i, list(prompts[i])) for r, i in enumerate(
            i for i, c in enumerate(counts) for _ in range(c))]
        for row in rows if self.record else ():
            row.routes = torch.full((len(row.prompt) + max_new_tokens, cfg.num_layers,
                                     cfg.experts_per_token), -1, dtype=torch.int16)
        groups = prompt_groups(rows, counts)
        widest = max(blocks_at_longest(p, max_new_tokens, self.block_size) for p in prompts)
        wider = max(0, widest - self.host_tables.shape[1])
        self.host_tables = F.pad(self.host_tables, (0, wider, 0, len(rows)))  # rows and blocks
        self.rows += rows
        self.groups += groups
        self.keys = torch.cat([self.keys, keys.to(self.model.device)])
        self.waiting.extend(Prefill(group, list(prompts[i])) for i, group in enumerate(groups))

    def groups_ended(self):
        """-> the indices of the prompts whose last row ended since the last call."""
        prompts = {row.prompt_index for row in self.ended}
        self.ended = []
        return sorted(i for i in prompts if all(row.finish for row in self.groups[i]))

    def busy(self):
        return bool(self.waiting or self.prefilling or self.decoding)

    def counts(self):
        """What generate's `stats` receives: waits, preemptions, prefill_tokens, decode_steps,
        pool_blocks, peak_blocks, blocks_in_use (0 at the end), block_bytes."""
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

    def prefill(self, draw_first, stop_ids, max_new_tokens):
        """One forward over the next chunks of the admitted prefills, at most `prefill_tokens`
        positions in all; a prompt that completes draws each of its rows' first token,
        draw_first(logits (n, V), keys (n,)) -> tokens (n,), logprobs (n,)."""
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
            keys = self.keys[self.tensor([row.index for row in drawing])]
            drawn, logp = draw_first(logits[self.tensor(source)], keys)
            self.take(drawing, drawn, logp, stop_ids, max_new_tokens)

    def start_decoding(self, job):
        """The prefill's rows join the decode batch, sharing its blocks (a block one of them
        writes into is copied first)."""
        self.pool.share(job.table, len(job.rows) - 1)
        for row in job.rows:
            row.table, row.cached = list(job.table), len(job.context)
            self.decoding.append(row)
        self.host_tables[[row.index for row in job.rows], :len(job.table)] = torch.tensor(job.table)

    def decode(self, step_fn, sampling, stop_ids, max_new_tokens):
        """Every running row feeds its last token and draws the next (one host read)."""
        self.make_room()
        rows = self.decoding
        widths = [len(row.table) for row in rows]
        groups = [(0, len(rows), max(widths))]  # every row read at the widest
        if self.grouped:  # widest first (a stable sort), each group read at its own width
            rows = sorted(rows, key=lambda row: -len(row.table))
            widths = sorted(widths, reverse=True)
            groups = read_groups(widths)
        self.stats["blocks_held"] += sum(widths)  # (FlexAttention reads these alone; graphs pad)
        self.stats["blocks_read"] += sum((end - first) * width for first, end, width in groups)
        on_host = torch.tensor([row.index for row in rows])  # (b,)
        index = on_host.to(self.model.device)
        fed = self.tensor([row.tokens[-1] for row in rows])  # (b,)
        start = self.tensor([row.cached for row in rows])  # (b,) the fed token's position
        draws = self.tensor([len(row.tokens) for row in rows])  # (b,) each row's step
        routing = Routing() if self.record else None
        self.cache.row_groups = groups if self.grouped else None
        try:
            drawn, logp = step_fn(self.model, fed, start, self.decoding_tables(rows, on_host),
                                  self.cache, self.keys[index], draws, *sampling.values(), routing)
        finally:
            self.cache.row_groups = None  # (a prefill of one position would read them otherwise)
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
            self.host_tables[row.index, b] = block
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

    def decoding_tables(self, rows, index):
        """The decoding rows' tables as `tables` gives them, gathered from host_tables by the
        rows' indices (b,) on the host."""
        widest = max(len(row.table) for row in rows)
        return self.host_tables[index, :widest].to(self.model.device)  # (b, nb)


READ_OVER = 1.25  # the most blocks a group of rows reads, over the blocks its rows hold


def read_groups(widths) -> list[tuple[int, int, int]]:
    """A decode step's rows, by their tables' widths in blocks (widest first) -> [(first row, end
    row, blocks each reads)]: consecutive rows, each group grown while its rows, all read at its
    first (widest) row's width, read at most READ_OVER x the blocks they hold. In all, attention
    reads at most READ_OVER x what the rows hold, where reading every row at the batch's widest
    reads up to (rows x widest) / held: several times over in RL's long tail (MEASUREMENTS.md,
    "The engine"). widths [8, 7, 2, 2, 1] -> [(0, 2, 8), (2, 5, 2)]."""
    groups, first, held = [], 0, 0
    for i, width in enumerate(widths):
        if (i + 1 - first) * widths[first] > READ_OVER * (held + width):  # row i starts a group
            groups.append((first, i, widths[first]))
            first, held = i, 0
        held += width
    return groups + [(first, len(widths), widths[first])]


def pad_rows(rows):
    """Lists of ints -> (len(rows), longest) long, right-padded with 0: one tensor of all the
    ints, placed by a mask (a tensor a row took twice the host's time at 256 rows)."""
    lengths = [len(r) for r in rows]
    out = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    out[torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(rows)), dtype=torch.long)  # row by row, in order
    return out


def tokens_so_far(rows):
    """(B, longest) long: each row's tokens, 0 past its end (what `stream` is given)."""
    return pad_rows([row.tokens or [0] for row in rows])
