"""Where a decode step's time goes. A step of the paged engine is about 50 small operations a
layer (1,295 in all at Qwen2.5-0.5B's 24 layers); on a GPU each is at least one kernel, and a
kernel this small takes microseconds however little it does, so a step can be bound by their
number even replayed as a CUDA graph.

    python recipes/decode-profile.py [--device meta|cpu|cuda] [--rows 64 --context 511]
        [--shape qwen2.5-0.5b|tiny] [--steps 20] [--fused]

Printed: the operations one `rollout.decode_step` runs, by kind, views left out (they launch
nothing); on the meta device that is all (shapes only: any machine, any size, no memory). On a
CPU or CUDA: the wall milliseconds of a step, eager. On CUDA also: replayed as a CUDA graph
(cuda_graphs.BucketedStep), and what capturing that graph took (a `generate` call captures one
for each bucket of rows and blocks its steps come in); the kernels' own time a step by kind
(torch.profiler), against which the gaps between them show. --fused: then the same with each
block and the draw compiled (cuda_graphs.CompiledBlocks: one graph every layer reuses, one for
the draw; what `SpeedUps(compile=True, cuda_graphs=True)` replays): whether fewer, fused kernels
pay. The
model is random, in bf16; each row has --context positions cached in blocks of its own and feeds
one token; temperature 1.
"""

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [HERE, os.path.join(HERE, "recipes")]
from importlib import import_module  # noqa: E402

from engine.cuda_graphs import BucketedStep, CompiledBlocks  # noqa: E402
from engine.paged import bucket  # noqa: E402
from model import ModelConfig, PagedKVCache, Transformer  # noqa: E402
from rollout import decode_step, sample_tokens, step_uniforms  # noqa: E402

SHAPES = {
    "qwen2.5-0.5b": import_module("engine-host").QWEN_05B,  # the host's measure uses it too
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                 rope_theta=1e4, rope_scaling=None, max_seq_len=4096, tie_word_embeddings=True,
                 qkv_bias=True, qk_norm=False, layer_types=("full",) * 2),
}
NO_KERNEL = {"aten._unsafe_view.default"}  # a view in all but its schema


class CountOps(TorchDispatchMode):
    """Counts the operations run inside it by name, views left out; `in_layers` those run while
    `inside` is set (by hooks on the layers)."""

    def __init__(self):
        super().__init__()
        self.counts, self.in_layers, self.inside = collections.Counter(), 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func) not in NO_KERNEL:
            self.counts[str(func).removeprefix("aten.")] += 1
            self.in_layers += self.inside
        return func(*args, **(kwargs or {}))


def count_ops(model, inputs):
    """-> CountOps of one decode step, the operations inside the model's layers told apart."""
    ops = CountOps()
    hooks = [hook(lambda *_, inside=inside: setattr(ops, "inside", inside))
             for layer in model.layers for hook, inside in (
                 (layer.register_forward_pre_hook, True), (layer.register_forward_hook, False))]
    try:
        with ops:
            decode_step(model, *inputs)
    finally:
        for handle in hooks:
            handle.remove()
    return ops


def step_inputs(cfg, rows, context, device, block_size=16):
    """One decode step's arguments after `rows` rows have cached `context` positions each."""
    blocks = -(-(context + 1) // block_size)  # a row's, the fed token's position included
    cache = PagedKVCache(cfg, 1 + rows * blocks, block_size, torch.bfloat16, device)
    tables = 1 + torch.arange(rows * blocks, device=device).view(rows, blocks)  # (b, nb)
    longs = lambda value: torch.full((rows,), value, dtype=torch.long, device=device)  # noqa: E731
    fed, start, keys, draws = longs(7), longs(context), torch.arange(rows, device=device), longs(1)
    return fed, start, tables, cache, keys, draws, 1.0, 1.0, 0  # temperature, top_p, top_k


def refuse_what_cannot_fit(parser, cfg, args, block_size=16):
    """A usage error, before any allocation, when the KV cache of --rows x --context would not fit
    in 90% of the device's free memory (the meta device holds no memory: any size counts)."""
    if args.device == "meta":
        return
    blocks = 1 + args.rows * -(-(args.context + 1) // block_size)  # as step_inputs sizes it
    need = blocks * PagedKVCache.bytes_per_block(cfg, block_size, torch.bfloat16)
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else \
        os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.9 * free:
        parser.error(f"--rows {args.rows} x --context {args.context}: the KV cache needs "
                     f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is free on {args.device}; "
                     f"lower them (--device meta counts the operations at any size)")


def ms_a_step(step, model, inputs, steps):
    """The median wall milliseconds of a step, each ending in the host read the engine makes."""
    times = []
    for _ in range(steps + 3):  # 3 to warm up (and, under graphs, to capture)
        begin = time.perf_counter()
        tokens, _ = step(model, *inputs)
        tokens.tolist()
        times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times[3:])


def kernels_a_step(step, model, inputs, steps):
    """-> (the kernels' own milliseconds a step, the kernels a step, the top kinds by time);
    copies between host and device (the step's one read of its tokens) are not kernels."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(model, *inputs)[0].tolist()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    by_kind = collections.Counter()
    for e in kernels:
        by_kind[e.name[:60]] += e.device_time / steps / 1e3
    return sum(by_kind.values()), len(kernels) / steps, by_kind.most_common(12)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="meta", choices=("meta", "cpu", "cuda"))
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=511, help="positions each row has "
                        "cached (511: with the fed token, 32 blocks of 16, a bucket whole, so "
                        "that a CUDA graph does the eager step's work)")
    parser.add_argument("--steps", type=int, default=20, help="steps timed (after 3 more)")
    parser.add_argument("--fused", action="store_true", help="then time it again with each "
                        "block and the draw compiled (needs a C++ compiler on a CPU)")
    args = parser.parse_args()
    for flag, value in (("--rows", args.rows), ("--context", args.context), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{flag}: at least 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    device, cfg = torch.device(args.device), ModelConfig(**SHAPES[args.shape])
    refuse_what_cannot_fit(parser, cfg, args)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(torch.bfloat16).eval()
    inputs = step_inputs(cfg, args.rows, args.context, device)
    with torch.no_grad():
        ops, layers = count_ops(model, inputs), cfg.num_layers
        total = sum(ops.counts.values())
        print(f"decode step, {args.shape} shape, {args.rows} rows x {args.context} positions "
              f"cached, bf16, {device_name(device)}")
        print(f"  operations a step (views left out): {total:,}; in the {layers} layers "
              f"{ops.in_layers:,} ({ops.in_layers / layers:.1f} each), outside them "
              f"{total - ops.in_layers}")
        print("  by kind: " + ", ".join(f"{k} {v}" for k, v in ops.counts.most_common()))
        if device.type == "meta":
            return
        report_times("eager", decode_step, model, inputs, args.steps, device)
        if args.fused:
            blocks = CompiledBlocks(sample_tokens, step_uniforms)
            report_times("blocks and draw compiled", blocks, model, inputs, args.steps, device)
            from torch._dynamo.utils import counters
            print(f"  blocks and draw compiled: {counters['stats']['unique_graphs']} graphs compiled")


def report_times(label, step, model, inputs, steps, device):
    """Prints the wall milliseconds of a `step` (decode_step, or CompiledBlocks) run as it is;
    on CUDA also replayed as a CUDA graph, what its capture took, and its kernels by kind."""
    print(f"  {label}: {ms_a_step(step, model, inputs, steps):.2f} ms a step")
    if device.type != "cuda":
        return
    graphs = BucketedStep(step, capture=True)
    graphs(model, *inputs)[0].tolist()  # its first call captures the bucket's graph
    b, nb = inputs[2].shape  # the block tables
    padded = "" if (bucket(b), bucket(nb)) == (b, nb) else \
        f" (padded to a bucket of {bucket(b)} rows, {bucket(nb)} blocks: more work than eager's)"
    replayed = ms_a_step(graphs, model, inputs, steps)
    print(f"  {label}, CUDA graph: {replayed:.2f} ms a step{padded}; its capture "
          f"{1e3 * graphs.capture_seconds:.0f} ms (2 warm-up steps and the capture)")
    busy, count, top = kernels_a_step(step, model, inputs, steps)
    print(f"  {label}, kernels: {count:.0f} a step, {busy:.2f} ms of their own time a step; "
          f"by kind (ms a step):")
    for name, ms in top:
        print(f"    {ms:7.3f}  {name}")


def device_name(device):
    """The GPU's name, or the CPU's with its bf16 flags and threads, for the report."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from bench import cpu_name
        return f"{cpu_name()}, {torch.get_num_threads()} threads"
    return "meta device"


if __name__ == "__main__":
    main()
