"""The sampler's speed-ups, chosen from outside `rollout.py`, as model.py's are applied from outside
the model: `rollout.generate(..., engine=EngineOptions(speed=SpeedUps(...)))`. rollout.py alone
runs the plain decode step on model.PagedKVCache; a SpeedUps picks, for one call:

- the decode step: eager, compiled whole (`compile`), or padded to buckets and on a GPU replayed
  as CUDA graphs (`cuda_graphs`, cuda_graphs.py; with `compile` too, each block compiled);
- the cache: FlexAttention reading the pool in place (`flex_attention`, flex_decode.py), or on a
  CPU with no KV budget the decoding rows kept gathered between eager steps (speed.py);
- the context the call runs in: a CPU's products on packed oneDNN weights (speed.py).

Every choice gives the plain path's samples (tests/test_rollout.py, tests/test_engine.py).
"""

from dataclasses import dataclass

import torch

from engine.cuda_graphs import BucketedStep, CompiledBlocks
from engine.flex_decode import FlexPagedKVCache
from engine.speed import KeptRowsKVCache, sampling_products
from model import PagedKVCache
from rollout import decode_step, sample_tokens, step_uniforms


@dataclass(frozen=True)
class SpeedUps:
    """What a generate call runs faster with; each flag off is the plain path's choice."""
    compile: bool | None = None   # the decode step through torch.compile
    cuda_graphs: bool = False     # decode steps padded to buckets; on a GPU replayed as CUDA graphs
    flex_attention: bool = False  # decode attention over the pool in place (flex_decode.py)

    def __post_init__(self):
        if self.flex_attention and self.compile and self.cuda_graphs:  # CompiledBlocks: one layer
            raise ValueError("SpeedUps: flex_attention with compile and cuda_graphs: one or the "
                             "other")

    def choose(self, model, record, kv_budget):
        """-> (the decode step, the KV cache's class) of a call: the step eager on an MoE or when
        its routes are recorded (experts are read on the host); FlexAttention's cache, or on a CPU
        with no KV budget and an eager step the rows kept gathered (it holds the decoding rows
        once more beside the pool: only where no budget bounds the pool), else the plain one."""
        step = step_function(model, self.compile, record, self.cuda_graphs)
        if self.flex_attention:
            return step, FlexPagedKVCache
        if kv_budget is None and step is decode_step and model.device.type == "cpu":
            return step, KeptRowsKVCache
        return step, PagedKVCache

    def context(self):
        return sampling_products()  # a CPU's products on packed weights (speed.pack_linears)


def step_function(model, compile, record, cuda_graphs=False):
    """The decode step: eager (compile None or False), compiled whole (True; on an H100 its first
    call outlasted 4 minutes: MEASUREMENTS.md "On a GPU"), or with `cuda_graphs` replayed per bucket
    (cuda_graphs.py; with compile, its blocks and draw compiled); eager on an MoE (experts read)."""
    if model.config.num_experts or record:
        return decode_step
    if cuda_graphs:
        step = CompiledBlocks(sample_tokens, step_uniforms) if compile else decode_step
        return BucketedStep(step, capture=model.device.type == "cuda")
    return compiled_step(model.device) if compile else decode_step


_COMPILED = {}


def compiled_step(device):
    """rollout.decode_step through torch.compile, made once per device type: one whole graph
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
