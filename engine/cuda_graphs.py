"""Decode steps replayed as CUDA graphs (the model runner of nano-vllm and vLLM), applied from
outside the model and the sampler: `SpeedUps(cuda_graphs=True)` (speedups.py) hands
`rollout.generate`'s engine a `BucketedStep`.

A decode step of a few hundred rows is hundreds of small kernels, and on a GPU their launches, not
the arithmetic, set its time. A CUDA graph records the kernels once and replays them in one launch,
but only for fixed shapes and fixed memory. So the step's inputs are padded to a bucket: the rows to
the next power of two, each block table to the next power of two of blocks. A padding row feeds
token 0 at position 0 through a table of the scratch block 0 (which attention never reads for a
real row: its positions there are past the row's own), and its draw is thrown away. One graph per
(rows, blocks) bucket, captured the first time the bucket comes in a `generate` call and replayed
after; the graphs share one memory pool and live as long as the call's KV cache, whose addresses
they hold, so each call captures its own (what a capture costs: MEASUREMENTS.md, "On a GPU").

Off a GPU the same padding runs eagerly, so the CPU tests check everything but the capture
(`tests/test_engine.py`); `tests/test_gpu.py` checks the capture on CUDA.

A graph replays a step's kernels, but each is still a kernel: ~50 a layer (RMSNorm alone is 8 in
bf16; `recipes/decode-profile.py` counts them). With `compile=True` the graphs capture
`CompiledBlocks` instead: each block through torch.compile, whose kernels fuse a layer's
elementwise work around its matrix products.
"""

import copy
import functools
import time

import torch

from engine.paged import bucket
from model import Block, PagedKVCache


class BucketedStep:
    """rollout.decode_step on inputs padded to a bucket; on CUDA through one captured graph per
    bucket. Called as decode_step is; returns the real rows' tokens (b,) and log-probs (b,)."""

    def __init__(self, decode_step, capture):
        self.decode_step, self.capture = decode_step, capture
        self.graphs = {}  # (rows, blocks, sampling) -> (graph, static inputs, static outputs)
        self.pool = None  # the memory pool the graphs share
        self.buckets = set()  # the (rows, blocks) buckets this call's steps came in
        self.capture_seconds = 0.0  # wall time of the captures, their warm-ups included

    def __call__(self, model, fed, start, tables, cache, keys, draws, temperature, top_p, top_k,
                 routing=None):
        b, nb = tables.shape
        rows, blocks = bucket(b), bucket(nb)
        padded = pad_inputs(fed, start, tables, keys, draws, rows, blocks)
        sampling = (temperature, top_p, top_k)
        self.buckets.add((rows, blocks))
        if not self.capture:
            tokens, logp = self.decode_step(model, *padded[:3], cache, *padded[3:], *sampling)
            return tokens[:b], logp[:b]
        key = (rows, blocks, sampling)
        if key not in self.graphs:
            begin = time.perf_counter()
            self.graphs[key] = self.captured(model, cache, [torch.zeros_like(x) for x in padded],
                                             sampling)
            torch.cuda.synchronize()
            self.capture_seconds += time.perf_counter() - begin
        graph, inputs, (tokens, logp) = self.graphs[key]
        for static, value in zip(inputs, padded):
            static.copy_(value)
        graph.replay()
        return tokens[:b].clone(), logp[:b].clone()  # the next replay overwrites the outputs

    def counts(self):
        """What generate's `stats` receives: graph_buckets, the (rows, blocks) buckets the call's
        steps came in (on a GPU a graph captured for each), and capture_seconds (with
        CompiledBlocks, the compiles their warm-ups ran too)."""
        return dict(graph_buckets=len(self.buckets), capture_seconds=self.capture_seconds)

    def captured(self, model, cache, inputs, sampling):
        """Captures the step on static `inputs` (all padding: the warm-up and the capture write
        only into the scratch block) -> (graph, inputs, outputs)."""
        def step():
            return self.decode_step(model, *inputs[:3], cache, *inputs[3:], *sampling)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # kernels choose their workspaces before the capture
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        self.pool = graph.pool()
        return graph, inputs, outputs


def pad_inputs(fed, start, tables, keys, draws, rows, blocks):
    """The step's inputs, b rows -> `rows` rows, tables (b, nb) -> (rows, blocks); padding is 0
    everywhere: token 0 at position 0 through the scratch block."""
    b, nb = tables.shape
    padded_tables = torch.zeros(rows, blocks, dtype=tables.dtype, device=tables.device)
    padded_tables[:b, :nb] = tables
    extend = lambda x: torch.cat([x, x.new_zeros(rows - b)])  # noqa: E731
    return extend(fed), extend(start), padded_tables, extend(keys), extend(draws)


# ----------------------------------------------------------------------------- compiled blocks

@functools.cache
def compiled_block():
    """Block.forward through torch.compile, once per process, in one graph (a break would split
    the fusion: an error instead); shapes dynamic, so a new bucket of rows or blocks is no new
    compile (but for 1, which torch.compile specialises)."""
    return torch.compile(Block.forward, fullgraph=True, dynamic=True)


@functools.cache
def compiled_sampling(sample_tokens, step_uniforms):
    """rollout's draw of a step's tokens from its logits (its functions handed in) through
    torch.compile, once per process: ~60 operations, each a pass over a (rows, vocabulary) tensor
    or its chunks (at 256 rows and Qwen2.5's 152k tokens, 156 MB in float32 each), fused into a
    few."""

    def draw(logits, keys, draws, temperature, top_p, top_k):
        return sample_tokens(logits, step_uniforms(keys, draws), temperature, top_p, top_k)
    return torch.compile(draw, fullgraph=True, dynamic=True)


class CompiledBlocks:
    """rollout.decode_step with each block's forward compiled, and its sampling (rollout's
    `sample_tokens` and `step_uniforms`, handed in): SpeedUps(compile=True, cuda_graphs=True).
    Compiling the whole step unrolls every layer into one graph (its first call outlasted 4
    minutes on an H100, MEASUREMENTS.md "On a GPU"); a block compiles
    once and every layer reuses the graph, as nothing in it names its layer: each layer is handed
    the cache of its own keys and values alone (`one_layer`) as layer 0. The blocks' forwards are
    swapped for the step only (the prefill stays eager). Under CUDA graphs the compiles run in a
    bucket's warm-up steps, so a call's capture_seconds hold them."""

    def __init__(self, sample_tokens, step_uniforms):
        self.draw = (sample_tokens, step_uniforms)

    def __call__(self, model, fed, start, tables, cache, keys, draws, temperature, top_p, top_k,
                 routing=None):
        # FlexAttention's cache and an MoE's routing read the layer's index, which is 0 here
        if type(cache) is not PagedKVCache or model.config.num_experts:
            raise ValueError(f"CompiledBlocks: each block runs as layer 0 on a cache of its own "
                             f"layer, which {type(cache).__name__} and an MoE cannot")
        if any("forward" in vars(layer) for layer in model.layers):
            raise RuntimeError("CompiledBlocks: a block's forward is swapped already")
        try:
            for layer in model.layers:
                layer.forward = functools.partial(self.compiled_forward, layer)
            logits = model.paged(fed[:, None], start, torch.ones_like(start), tables, cache)
        finally:
            for layer in model.layers:
                vars(layer).pop("forward", None)  # the class's eager forward again
        return compiled_sampling(*self.draw)(logits, keys, draws, temperature, top_p, top_k)

    @staticmethod
    def compiled_forward(block, x, cos, sin, mask, cache=None, layer=0, routing=None):
        if cache is None:  # any other forward through the block meanwhile: as it was
            return Block.forward(block, x, cos, sin, mask, cache, layer, routing)
        # Without duck shapes: 64 rows would otherwise share one size with a head of 64.
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # read when compiling
            return compiled_block()(block, x, cos, sin, mask, one_layer(cache, layer), 0, routing)


def one_layer(cache, layer):
    """The paged cache as one layer sees it: that layer's keys and values as its only layer, the
    step's slots and tables shared (a copy of the object, not of the memory)."""
    view = copy.copy(cache)
    view.kv = [cache.kv[layer]]
    return view
