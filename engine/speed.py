"""CPU speed-ups, applied to the model from outside (as gpt-fast's quantize.py and nanochat's fp8.py
are): the model file holds the model, in plain nn.Linear; nothing here acts at import.

    pack_linears(model)      the sampler's products on oneDNN with weights packed once (a CPU)
    sampling_products()      the context a sampler runs in (SpeedUps.context): packed products on
    KeptRowsKVCache          the paged cache keeping the decoding rows' keys gathered between
                             steps (a CPU's eager decode steps with no KV budget: SpeedUps.choose)
    keep_freed_memory()      glibc keeps freed blocks: no page faults at every decode step
    compile_blocks(model)    torch.compile each block for the training and scoring forwards

The entry points (run/launch.setup for train.py, eval.py, bench.py, demo.py) call them; figures, with
`python recipes/bench.py sampler` side by side: MEASUREMENTS.md, "The sampler".
"""

import contextlib
import ctypes
import functools
import os
import sys
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from model import MLP, Attention, PagedKVCache, Transformer
from variants.lora import LoRALinear

# ----------------------------------------------------------------------------- packed products

_ONEDNN_DTYPES = frozenset()  # set by sampling_products while a sampler runs (one for the process)


class PackedLinear(nn.Linear):
    """nn.Linear, whose products on a CPU, inside `sampling_products` and without gradients, go
    through oneDNN with the weight packed once into its kernels' blocked layout. In bf16 that is
    the library F.linear calls, minus the reordering of the weight at every call; in fp32 F.linear
    calls MKL, slower than packed oneDNN on AMD processors, with AVX2 or AVX-512 (MEASUREMENTS.md,
    "The sampler"). Gradients stay with F.linear (oneDNN's op has no backward)."""

    def forward(self, x):
        if x.dtype in _ONEDNN_DTYPES and x.dtype == self.weight.dtype and x.device.type == "cpu" \
                and not torch.is_grad_enabled():
            if torch.compiler.is_compiling():  # one opaque op: the packed copy stays out of graphs
                return torch.ops.dapo.packed_linear(x, self.weight, self.bias)
            return _packed_linear(x, self.weight, self.bias)  # (not through the dispatcher)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: Transformer) -> Transformer:
    """The projections of every attention and MLP (experts' included) and the head become
    PackedLinear, in place (the same parameters and state-dict names), a LoRA adapter's base
    included, before add_lora or after it; the MoE router stays plain nn.Linear, so routing is
    unchanged. Registers, once per process, what the packed products need (`_register`)."""
    _register()
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            for linear in module.children():
                linear = linear.base if isinstance(linear, LoRALinear) else linear  # its frozen W
                if type(linear) is nn.Linear:  # (an NF4 base, quantize.py, keeps its own class)
                    linear.__class__ = PackedLinear
    if type(model.output) is nn.Linear:
        model.output.__class__ = PackedLinear
    return model


# weight -> (what it was when packed, the packed copy). Keyed by identity and held weakly: a
# model's packed copies go with it. A weight written in place (the sampler's refresh, a load) is
# packed again at its next use, as is one given new storage (.to(), .data =), and every
# parameter of an optimizer that has stepped (a fused AdamW step leaves version counters as they
# were).
_PACKED = torch.utils.weak.WeakIdKeyDictionary()


def packed(weight):
    """weight (out, in) -> its oneDNN-packed copy (an opaque tensor), made once per state."""
    state = (weight._version, weight.data_ptr(), weight.dtype)
    packed_state, copy = _PACKED.get(weight, (None, None))
    if packed_state != state:
        copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # tuned for 64 rows
        _PACKED[weight] = (state, copy)
    return copy


def _forget_stepped(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            _PACKED.pop(parameter, None)


def _packed_linear(x, weight, bias):
    """x (..., in) -> x W^T + b (..., out), on W's packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [], "")


_REGISTERED = []  # what _register made, once per process
_REGISTER_LOCK = threading.Lock()


def _register():
    """Once per process, at the first pack_linears: the optimizer hook that drops the packed copies
    of stepped parameters (after any optimizer's step), and the packed product as an operator of
    its own, for a compiled decode step (Inductor calls it as it is). Registered plainly:
    torch.library.custom_op's wrapper costs ~6 us more a call; eager calls _packed_linear itself,
    ~10 us less than through the dispatcher."""
    with _REGISTER_LOCK:
        if _REGISTERED:
            return
        library = torch.library.Library("dapo", "DEF")
        library.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
        library.impl("packed_linear", _packed_linear, "CPU")
        torch.library.register_fake("dapo::packed_linear", lib=library)(
            lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))
        _REGISTERED.extend([library, register_optimizer_step_post_hook(_forget_stepped)])


@functools.cache
def onednn_dtypes() -> frozenset:
    """The dtypes whose sampling products run on packed oneDNN weights: bf16 wherever oneDNN runs
    it (AVX-512, AMX); fp32 on AMD CPUs with AVX2 or AVX-512, where MKL's fp32 product is slower.
    DAPO_CPU_ONEDNN=0 turns both off, 1 forces fp32's (read once per process)."""
    if os.environ.get("DAPO_CPU_ONEDNN") == "0" or not torch.backends.mkldnn.is_available():
        return frozenset()
    amd = cpu_feature("DAPO_CPU_ONEDNN", lambda info: "AuthenticAMD" in info and "avx2" in info)
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return frozenset(dtype for dtype, on in ((torch.float32, amd), (torch.bfloat16, bf16)) if on)


def cpu_feature(override: str, present) -> bool:
    """present(the text of /proc/cpuinfo), unless the environment variable `override` is 1 or 0;
    False where there is no /proc/cpuinfo (off Linux)."""
    forced = os.environ.get(override)
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            return present(f.read())
    except OSError:
        return False


_SAMPLERS = 0  # samplers running now, counted under a lock (demo.py samples in two threads)
_SAMPLERS_LOCK = threading.Lock()


@contextlib.contextmanager
def sampling_products():
    """Within it (a rollout.generate call given SpeedUps), a CPU's PackedLinear products run on
    packed oneDNN weights where that is faster (`onednn_dtypes`), until the last sampler running (of any thread) has
    returned. A model never given to pack_linears computes as it would outside."""
    global _ONEDNN_DTYPES, _SAMPLERS
    dtypes = onednn_dtypes()  # (before counting: should it raise, no sampler is left counted)
    with _SAMPLERS_LOCK:
        _SAMPLERS += 1
        _ONEDNN_DTYPES = dtypes
    try:
        yield
    finally:
        with _SAMPLERS_LOCK:
            _SAMPLERS -= 1
            if _SAMPLERS == 0:
                _ONEDNN_DTYPES = frozenset()


# ----------------------------------------------------------------------------- kept rows

class KeptRowsKVCache(PagedKVCache):
    """The paged cache, with the decoding rows' keys and values also kept gathered from one
    decode step to the next, as a static cache holds them: a step writes its token into the pool
    and into the copy, and attention reads the copy, (2, Hkv, b, S, D) a layer, in place. The
    paged cache alone gathers every row's blocks in every layer at every step: 8% of a CPU decode
    step when no row stops early (MEASUREMENTS.md, "The engine"). The copy is gathered again when
    the rows change (a prefill, a row that ends, a block copied on write) or their tables widen
    (every block_size steps). It holds the decoding rows' keys once more beside the pool, so
    SpeedUps.choose (speedups.py) takes it for a CPU's eager decode steps with no KV budget only.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = []  # per layer (keys, values), (Hkv, b, S, D) each, gathered when needed
        self.kept_tables = None  # (b, nb) the tables the copy was gathered through; None: none
        self.at = None  # (b,) each row's new token's index in the flattened copy
        self.gathers = 0  # layers gathered (the tests count them)

    def write(self, layer, k, v):
        _, H, T, D = k.shape
        if T > 1:  # a prefill chunk: rows join, blocks change hands
            self.kept_tables = None
            return super().write(layer, k, v)
        if layer == 0:
            self.follow()
        if len(self.kept) == layer:  # the pool's own write and gather, new token included
            self.kept.append(super().write(layer, k, v))  # keys, values (Hkv, b, S, D)
            self.gathers += 1
            return self.kept[layer]
        self.store(layer, k, v)  # the new token into the pool, and into the copy at each row's
        for kept, new in zip(self.kept[layer], (k, v)):  # place; new (b, Hkv, 1, D)
            kept.view(H, -1, D).index_copy_(1, self.at, new[:, :, 0].transpose(0, 1))
        return self.kept[layer]

    def follow(self):
        """Before a decode step's first layer: does the copy still hold these rows? The same
        width, each block it was gathered through in place; a row may have taken a new block
        where its table had padding (block 0). If not, this step gathers it again."""
        old, tables = self.kept_tables, self.tables  # (b, nb) each
        if old is None or old.shape != tables.shape or \
                not torch.equal(tables.masked_fill(old == 0, 0), old):
            self.kept, self.kept_tables = [], tables
        rows = torch.arange(tables.shape[0], device=tables.device)
        self.at = rows * tables.shape[1] * self.block_size + self.positions[:, 0]  # (b,)


# ----------------------------------------------------------------------------- memory

def expandable_cuda_segments():
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the environment already says
    otherwise: every step a rollout frees its KV pool (tens of GB at scale) and the update then
    asks for activations of other sizes; the caching allocator grows a segment in place instead
    of holding freed blocks of every size apart (fragmentation: out of memory with memory free).
    Read at CUDA's first allocation, so an entry point calls it before any (train.py's setup).
    Nothing on a CPU reads it."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def keep_freed_memory():
    """glibc's malloc hands a freed block over 128 KB back to the system, and the next step's
    block of that size is faulted in again page by page: a CPU decode step's logits and their
    sampling temporaries ((64, 49k) each) cost 10-20% of the step so (MEASUREMENTS.md, "The
    sampler"). This process keeps blocks up to 32 MB in its heap after they are freed. An entry
    point's call (train.py, eval.py, bench.py, demo.py); nothing where the C library has no
    mallopt."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB from the heap
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: shrink the heap only past 2 GB free
    except (OSError, AttributeError):  # a C library without mallopt (musl has one that does nothing)
        pass


# ----------------------------------------------------------------------------- compiling

def compile_blocks(model: Transformer) -> Transformer:
    """torch.compile each block, the usual way to compile a training forward: one small graph
    that every block reuses (compile time of one block), under activation checkpointing and
    sharding alike; shapes dynamic, so new sequence lengths do not recompile. Forwards without a
    KV cache (training, scoring) take the compiled blocks; prefill and decode keep the eager ones,
    whose cache writes would make a graph per layer (rollout.py compiles its own decode step).
    Sets model.compiled_layers: they wrap the same modules, no weight is copied."""
    if model.config.num_experts:  # the experts' grouping reads counts back to the host
        raise ValueError("compile_blocks: a Mixture-of-Experts model stays eager")
    model.compiled_layers = [torch.compile(block, dynamic=True) for block in model.layers]
    return model
