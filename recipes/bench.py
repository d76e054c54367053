"""Benchmarks, each side by side with transformers on the same weights in one process (ratios,
never absolute times, compare across machines; every report names its CPU or GPU).

    python recipes/bench.py sampler   # rollout.generate eager and compiled vs transformers' generate eager
                              # and static-cache compiled: tok/s, ratios, matmul-only bound, compile
    python recipes/bench.py engine    # RL's long tail: under a KV budget, static waves vs the paged engine;
                              # on CUDA, the engine eager and under CUDA graphs vs transformers
    python recipes/bench.py refills   # dynamic sampling's rounds one after another vs in one queue
    python recipes/bench.py update    # forward + backward + AdamW tok/s (fp32, bf16 autocast), log-prob memory
    python recipes/bench.py moe       # a small Qwen3-MoE's forward + backward tok/s
    python recipes/bench.py sampler --device cuda --model DIR   # on a GPU (recipes/gpu-check.sh makes DIR)

A whole training step's time split (rollout / scoring / update) is `python train.py --bench`.
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's root

from engine import paged
from engine.paged import EngineOptions
from engine.speed import compile_blocks, keep_freed_memory, pack_linears, sampling_products
from engine.speedups import SpeedUps
from model import PagedKVCache, Transformer, token_logprobs
from rollout import Sampling, generate
from run.checkpoints import (
    _read_safetensors,
    converted_dir,
    cpu_has_bf16,
    empty_model,
    load_model,
    load_state_dict_strict,
    read_config,
)

# ----------------------------------------------------------------------------- the sampler

def sync(device):
    if device.type == "cuda":  # kernels run asynchronously: wait before reading the clock
        torch.cuda.synchronize(device)


def matmul_bound_seconds(model: Transformer, rows: int, repeats=5, sampler=True) -> float:
    """Time of the matrix products alone in one decode step at `rows` rows, measured here on the
    sampler's kernels (speed.sampling_products: on a CPU, oneDNN's with packed weights), the
    fastest at hand; sampler=False: on F.linear's, which transformers calls."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {layer.in_features: torch.randn(rows, layer.in_features, dtype=model.dtype,
                                         device=model.device) for layer in layers}
    times = []
    with torch.no_grad(), sampling_products() if sampler else contextlib.nullcontext():
        for _ in range(repeats):
            sync(model.device)
            t = time.perf_counter()
            for layer in layers:
                layer(xs[layer.in_features])
            sync(model.device)
            times.append(time.perf_counter() - t)
    return min(times)


def bench_prompts(tokenizer, count):
    questions = [f"What is {a} + {b}?" for a, b in zip(range(3, 200, 13), range(90, 7, -5))]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False)
             for q in questions][:count]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def first_call(paths, name, call):
    """call() -> its result; if it raises, the error is printed and `name` leaves `paths` (a
    dict or list), so that one failing path costs a GPU lease none of the others' figures."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 (any failure: reported, the rest measured)
        print(f"  {name}: failed, left out: {type(error).__name__}: {error}", flush=True)
        if isinstance(paths, dict):
            del paths[name]
        else:
            paths.remove(name)


def timed(run, device):
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def left_padded(prompts, pad, device):
    """Prompts as transformers' generate takes a batch -> ids (N, P) left-padded with `pad`, and
    the mask (N, P) bool of real tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    starts = torch.tensor([width - len(p) for p in prompts], device=device)
    return ids, torch.arange(width, device=device)[None] >= starts[:, None]


def bench_paths(ours, hf, prompts, args):
    """{name: run()}: our sampler eager, compiled and (on CUDA) under CUDA graphs, transformers'
    generate eager and with its fastest documented setup (static cache, forward through
    torch.compile), same batch."""
    device, rows = ours.device, args.prompts * args.samples
    pad = hf.generation_config.pad_token_id
    hf_ids, hf_mask = left_padded(prompts, pad, device)
    width = hf_ids.shape[1]
    hf_compiled = torch.compile(hf.forward, fullgraph=True,
                                mode="reduce-overhead" if device.type == "cuda" else None)

    def ours_run(compiled, graphs=False):
        sampling = Sampling(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
        engine = EngineOptions(speed=SpeedUps(compile=compiled, cuda_graphs=graphs))
        out = generate(ours, prompts, sampling, num_samples=args.samples, engine=engine)
        assert all(len(c.tokens) == args.new_tokens for c in out)

    def hf_run(static):
        with torch.no_grad():
            out = hf.generate(hf_ids, attention_mask=hf_mask.long(), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, num_return_sequences=args.samples,
                              cache_implementation="static" if static else None)
        assert out.shape == (rows, width + args.new_tokens)

    def hf_static_compiled():
        hf.forward = hf_compiled
        try:
            hf_run(static=True)
        finally:
            del hf.forward  # back to the class's eager forward

    paths = {"ours eager": lambda: ours_run(False), "ours compiled": lambda: ours_run(True),
             "ours, CUDA graphs": lambda: ours_run(False, graphs=True),
             "transformers eager": lambda: hf_run(False),
             "transformers static+compiled": hf_static_compiled}
    if device.type != "cuda":  # off a GPU the padded steps run eagerly: nothing to time
        del paths["ours, CUDA graphs"]
    return {name: run for name, run in paths.items() if PATH_KEYS[name] in args.paths}


# --paths names each path by a short key (what a shell command can say)
PATH_KEYS = {"ours eager": "ours", "ours compiled": "ours-compiled", "ours, CUDA graphs": "ours-graphs",
             "transformers eager": "hf",
             "transformers static+compiled": "hf-compiled", "ours": "ours",
             "paged": "ours", "paged, CUDA graphs": "ours-graphs",
             "paged, FlexAttention": "ours-flex",
             "paged, FlexAttention, CUDA graphs": "ours-flex-graphs",
             "paged, blocks compiled, CUDA graphs": "ours-blocks-graphs",
             "ours, blocks compiled": "ours-compiled", "transformers": "hf"}
PATHS = list(dict.fromkeys(PATH_KEYS.values()))  # ours, ours-compiled, ours-graphs, hf, ...


def bandwidth_bound(model: Transformer, rows: int, context: float) -> float:
    """Decode's memory-bandwidth bound in tok/s: a step reads every weight once (the tied or
    untied output matrix in full) and each row's keys and values so far, `context` positions on
    average; the device's bandwidth is measured here by a 1 GiB copy (bytes read + written)."""
    bytes_per_s = measured_bandwidth(model.device)
    weights = sum(p.nbytes for p in model.parameters())
    kv = rows * context * PagedKVCache.bytes_per_block(model.config, 1, model.dtype)
    print(f"  bandwidth measured {bytes_per_s / 1e12:.2f} TB/s; a step reads {weights / 1e9:.2f} GB "
          f"of weights and {kv / 1e9:.2f} GB of keys and values")
    return rows * bytes_per_s / (weights + kv)


def measured_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB copy on `device`, bytes read + written (the best of 5)."""
    src = torch.empty(2 ** 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / min(timed(lambda: dst.copy_(src), device) for _ in range(5))


def bench_sampler(args):
    """Tokens per second of each path (median of alternated runs), the ratio to transformers'
    eager generate, the fraction of the matmul-only bound, and each path's first-call time
    (compiling included) for every dtype."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    device = torch.device(args.device)
    _, tokenizer = load_model(args.model, device="cpu")
    prompts = bench_prompts(tokenizer, args.prompts)
    tokens = args.prompts * args.samples * args.new_tokens
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
          f"temperature 1, no early stop, {where}")
    dtypes = args.dtypes.split(",") if args.dtypes else (
        ["float32", "bfloat16"] if cpu_has_bf16() or device.type == "cuda" else ["float32"])
    if "bfloat16" not in dtypes and not args.dtypes:  # (not when asked for fp32 alone)
        print("bfloat16 skipped: this CPU has no native bf16 matrix instructions (AVX-512 BF16 or "
              "AMX), so bf16 runs slower than fp32 here; force it with --dtypes float32,bfloat16")
    for dtype in [getattr(torch, d) for d in dtypes]:
        ours = pack_linears(load_model(args.model, dtype=dtype, device=device)[0])  # as train.py's
        hf = AutoModelForCausalLM.from_pretrained(args.model or converted_dir(),
                                                  dtype=dtype).to(device).eval()
        hf.generation_config.pad_token_id = tokenizer.pad_token_id or 0
        paths = bench_paths(ours, hf, prompts, args)
        first = {}
        for name, run in list(paths.items()):  # compiles here; printed at once: it can take minutes
            first[name] = first_call(paths, name, lambda: timed(run, device))
            if name in paths:
                print(f"  {name}: first call {first[name]:.1f} s", flush=True)
        if not paths:
            continue  # every path failed (each reported)
        baseline = "transformers eager" if "transformers eager" in paths else next(iter(paths))
        times = {name: [] for name in paths}
        for _ in range(args.repeats):  # alternate, so drift hits every path alike
            for name, run in paths.items():
                times[name].append(timed(run, device))
        rate = {name: tokens / statistics.median(t) for name, t in times.items()}
        rows = args.prompts * args.samples
        bound = rows / matmul_bound_seconds(ours, rows)  # tok/s
        plain = rows / matmul_bound_seconds(ours, rows, sampler=False)
        print(f"{str(dtype).replace('torch.', '')}: matmul-only bound {bound:.0f} tok/s "
              f"(on F.linear's kernels: {plain:.0f})")
        if device.type == "cuda":
            context = statistics.mean(map(len, prompts)) + args.new_tokens / 2
            print(f"  memory-bandwidth bound {bandwidth_bound(ours, rows, context):.0f} tok/s")
        for name in paths:
            ratio = rate[name] / rate[baseline]
            print(f"  {name:30s} {rate[name]:7.0f} tok/s  {ratio:5.2f}x {PATH_KEYS[baseline]}  "
                  f"{rate[name] / bound:4.0%} of the matmul bound  first call {first[name]:6.1f} s")


# ----------------------------------------------------------------------------- the engine

def long_tail_stops(vocab_size, new_tokens, at_limit=0.05):
    """Stop ids that end a near-uniform draw with probability p each step, p such that a fraction
    `at_limit` of rows reaches `new_tokens`: (1 - p)^N = at_limit. Lengths then fall like RL's,
    most short and a few at the limit."""
    p = 1 - at_limit ** (1 / new_tokens)
    return list(range(vocab_size - round(p * vocab_size), vocab_size))


def quarter_waves(prompts, samples, new_tokens, block_size=16):
    """Static batching in four waves of consecutive prompts -> (the waves, the KV blocks the
    largest needs with every row at its longest, the scratch block included): the budget, about
    a quarter of what all rows at once need."""
    size = -(-len(prompts) // 4)
    waves = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    need = max(1 + sum(samples * -(-(len(p) + new_tokens) // block_size) for p in wave)
               for wave in waves)
    return waves, need


def bench_engine(args):
    """RL's long tail. On a CPU, under one KV budget (about a quarter of what every row at its
    longest needs): static batching in four waves that fit it, each waiting for its longest row,
    against the paged engine's continuous batching (decode attention reading each group of rows
    at its own width, paged.read_groups, and every row at the widest, as before it); the engine
    with a budget of every row (the plain cache, read in groups) and with none (the rows kept
    gathered, speed.KeptRowsKVCache). On CUDA, all
    rows at once: the engine eager and under CUDA graphs, its decode attention gathered or
    through FlexAttention (flex_decode.py), its blocks eager or compiled, against transformers'
    generate (its batch waits for its longest row) and the memory-bandwidth bound. Our paths draw the same
    samples (checked; in bf16 on CUDA, counted: other shapes may round differently); the model
    samples near uniformly (temperature 10^4) and `long_tail_stops` draws the lengths."""
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    model = pack_linears(model)
    prompts, G, N = bench_prompts(tokenizer, args.prompts), args.samples, args.new_tokens
    stops = long_tail_stops(model.config.vocab_size, N)
    static = 1 + sum(G * -(-(len(p) + N) // 16) for p in prompts)  # blocks: every row at its longest
    waves, budget_blocks = quarter_waves(prompts, G, N)
    block_bytes = PagedKVCache.bytes_per_block(model.config, 16, dtype)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    setting = (f"KV budget {budget_blocks} blocks of 16 ({budget_blocks * block_bytes / 2**20:.0f} "
               f"MiB, 1/4 of {static}); waves of {[len(w) * G for w in waves]} rows"
               if device.type == "cpu" else "all rows at once")
    print(f"{len(prompts)} prompts x {G} samples, up to {N} new tokens, {len(stops)} stop ids "
          f"(5% of rows at the limit), {where}; {setting}"
          + (f"; at most {args.max_rows} rows decoding at once" if args.max_rows else ""))
    stats = {}

    def run(name, new_tokens=N):
        sampling = Sampling(max_new_tokens=new_tokens, temperature=1e4, stop_token_ids=stops, seed=7)
        if name == "transformers":
            return hf_long_tail(hf, prompts, G, new_tokens, stops)
        if name == "static waves":
            return static_waves(model, waves, G, sampling)
        budget = budget_blocks if name.startswith("paged, budget") else \
            static if name.startswith("paged, all rows") else None
        engine = EngineOptions(kv_budget=budget and budget * block_bytes / 2**30,
                               max_rows=args.max_rows or None, speed=path_speed_ups(name))
        return paged_tokens(model, prompts, G, sampling, engine, stats.setdefault(name, {}),
                            at_the_widest="widest" in name)
    hf = hf_model(args.model, dtype, device, tokenizer) if device.type == "cuda" else None
    names = engine_paths(device, args.paths)
    for name in list(names):  # warm-up: kernels chosen, libraries loaded
        first_call(names, name, lambda: run(name, new_tokens=8))
    outputs, times = timed_paths(names, run, args.repeats, device)
    ours = [name for name in names if name != "transformers"]
    if not ours:
        return print("  no path of ours ran")
    report_engine(outputs, times, ours[0], stats, N, budget_blocks, block_bytes,
                  exact=device.type == "cpu")
    if device.type == "cuda":
        print(f"  memory-bandwidth bound {long_tail_bound(model, prompts, G, outputs[ours[0]]):.0f} "
              f"tok/s (the engine's lengths)")


def engine_paths(device, paths):
    """bench_engine's paths: on CUDA those of `paths` (--paths); on a CPU the static waves and
    the engine under a budget (read in groups, and at the widest), a budget of every row (the
    plain cache) and none (the rows kept gathered)."""
    if device.type == "cuda":
        return [name for name in ["paged", "paged, CUDA graphs", "paged, FlexAttention",
                                  "paged, FlexAttention, CUDA graphs",
                                  "paged, blocks compiled, CUDA graphs", "transformers"]
                if PATH_KEYS[name] in paths]
    return ["static waves", "paged, budget", "paged, budget, at the widest",
            "paged, all rows (a budget)", "paged, no budget"]


def path_speed_ups(name):
    return SpeedUps(compile="blocks compiled" in name, cuda_graphs=name.endswith("CUDA graphs"),
                    flex_attention="FlexAttention" in name)


def paged_tokens(model, prompts, samples, sampling, engine, stats, at_the_widest=False):
    """generate's rows' tokens; `at_the_widest`: every row of a decode step reads the widest
    row's blocks, as before paged.read_groups (one group: READ_OVER unbounded)."""
    over = math.inf if at_the_widest else paged.READ_OVER
    with mock.patch.object(paged, "READ_OVER", over):
        out = generate(model, prompts, sampling, num_samples=samples, stats=stats, engine=engine)
    return [c.tokens for c in out]


def timed_paths(names, run, repeats, device):
    """Each path's output and wall times over `repeats` alternated runs (so that a slower moment
    of the machine hits all) -> (outputs, times); a path that fails leaves `names`, reported."""
    def measured(name):
        sync(device)
        begin = time.perf_counter()
        out = run(name)
        sync(device)
        return out, time.perf_counter() - begin
    outputs, times = {}, {name: [] for name in names}
    for _ in range(repeats):
        for name in list(names):
            result = first_call(names, name, lambda: measured(name))
            if result is not None:
                outputs[name] = result[0]
                times[name].append(result[1])
    return {n: outputs[n] for n in names}, {n: times[n] for n in names}


def static_waves(model, waves, samples, sampling):
    """Each wave of prompts in a call of its own, with the seeds the whole batch's call gives
    them (so the same samples) -> each row's tokens."""
    out = []
    for w, wave in enumerate(waves):
        start = sum(len(v) for v in waves[:w])
        seeds = [sampling.seed * 1_000_003 + start + i for i in range(len(wave))]
        out += generate(model, wave, replace(sampling, seed=seeds), num_samples=samples,
                        engine=EngineOptions(speed=SpeedUps()))
    return [c.tokens for c in out]


def report_engine(outputs, times, reference, stats, N, budget_blocks, block_bytes, exact):
    """Rows with the `reference` path's tokens (all of them where `exact`), its lengths, and each
    path's tok/s (of its own tokens: transformers draws other samples) against its."""
    for name in outputs:
        if name not in (reference, "transformers"):
            same = sum(a == b for a, b in zip(outputs[name], outputs[reference]))
            assert not exact or same == len(outputs[name]), name
            print(f"  {name}: {same} of {len(outputs[name])} rows the {reference} path's tokens")
    lengths = sorted(map(len, outputs[reference]))
    print(f"{sum(lengths)} tokens; lengths: median {lengths[len(lengths) // 2]}, "
          f"{sum(n == N for n in lengths)} of {len(lengths)} at the limit")
    first = sum(map(len, outputs[reference])) / statistics.median(times[reference])
    for name in outputs:
        rate = sum(map(len, outputs[name])) / statistics.median(times[name])
        held = stats[name]["pool_blocks"] if name in stats else budget_blocks
        pool = f"KV pool {held * block_bytes / 2**20:6.0f} MiB" if name != "transformers" else ""
        extra = (f", peak {stats[name]['peak_blocks']} in use, {stats[name]['preemptions']} "
                 f"preemptions, attention read {reads(stats[name])}" if name in stats else "")
        if "graph_buckets" in stats.get(name, {}):  # on a GPU a graph captured for each, timed
            captures = stats[name]["capture_seconds"]  # the last run's, as its stats are
            extra += (f", {stats[name]['graph_buckets']} buckets of rows and blocks, captures "
                      f"{captures:.2f} s (without them "
                      f"{sum(map(len, outputs[name])) / (times[name][-1] - captures):.0f} tok/s)")
        print(f"  {name:26s} {rate:7.0f} tok/s  {rate / first:5.2f}x  {pool}{extra}")


def reads(stats) -> str:
    """How many blocks decode attention read, over the blocks its rows' tables held (each step's
    sum; the kept rows' copy reads as the widest row does; FlexAttention reads each row's own and
    CUDA graphs pad the rows, neither counted here: the eager gather's figure)."""
    return f"{stats['blocks_read'] / max(1, stats['blocks_held']):.2f}x the blocks held"


def hf_model(path, dtype, device, tokenizer):
    """transformers' model of the same checkpoint, for generate (its pad id set)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path or converted_dir(), dtype=dtype).to(device).eval()
    hf.generation_config.pad_token_id = tokenizer.pad_token_id or 0
    return hf


def hf_long_tail(hf, prompts, samples, new_tokens, stops):
    """transformers' generate on every row at once, ending a row at any of `stops` -> each
    row's tokens up to and including its stop."""
    device, pad = hf.device, hf.generation_config.pad_token_id
    ids, mask = left_padded(prompts, pad, device)
    width = ids.shape[1]
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask.long(), do_sample=True, temperature=1e4,
                          top_k=0, top_p=1.0, max_new_tokens=new_tokens, eos_token_id=stops,
                          num_return_sequences=samples)
    rows, stop = out[:, width:].tolist(), set(stops)
    return [r[:next((i + 1 for i, t in enumerate(r) if t in stop), len(r))] for r in rows]


def long_tail_bound(model, prompts, samples, rows_tokens) -> float:
    """tok/s at the memory-bandwidth bound for these lengths: every step reads each weight once
    and the longest row needs one step a token; a row's t-th token reads its prompt + t keys and
    values."""
    bytes_per_s = measured_bandwidth(model.device)
    weights = sum(p.nbytes for p in model.parameters())
    per_position = PagedKVCache.bytes_per_block(model.config, 1, model.dtype)
    lengths = [len(r) for r in rows_tokens]
    prompt_of_row = [len(p) for p in prompts for _ in range(samples)]
    kv = sum(n * (P + (n - 1) / 2) for P, n in zip(prompt_of_row, lengths)) * per_position
    seconds = (max(lengths) * weights + kv) / bytes_per_s
    return sum(lengths) / seconds


def bench_refills(args):
    """Dynamic sampling's refill rounds (change 2) when no group has a signal, so that every
    round is needed: rounds one after another, each waiting for its longest row, against the
    rounds in one running queue, each queued as refills.rounds_in_one_queue queues it (as soon as
    the groups still running cannot fill the batch: here, when a group of the round before
    ends). The same samples (checked); lengths drawn as `bench_engine`'s."""
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    model = pack_linears(model)
    prompts, G, N, R = bench_prompts(tokenizer, args.prompts), args.samples, args.new_tokens, args.rounds
    sampling = Sampling(max_new_tokens=N, temperature=1e4,
                        stop_token_ids=long_tail_stops(model.config.vocab_size, N))
    engine = EngineOptions(speed=SpeedUps(compile=False))
    seeds = [[1_000_003 * r + i for i in range(len(prompts))] for r in range(R)]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    print(f"{R} rounds of {len(prompts)} prompts x {G} samples, up to {N} new tokens (5% of rows "
          f"at the limit), no group with a signal, {where}")

    def in_turn():
        return [c for r in range(R) for c in generate(model, prompts, replace(sampling, seed=seeds[r]),
                                                      num_samples=G, engine=engine)]

    def one_queue():
        queued, running = 1, len(prompts)  # rounds queued; groups not yet ended

        def on_group(index, completions):
            nonlocal queued, running
            running -= 1
            if queued < R and running < len(prompts):  # the batch cannot fill: the next round
                queued, running = queued + 1, running + len(prompts)
                return prompts, [G] * len(prompts), seeds[queued - 1]
        return generate(model, prompts, replace(sampling, seed=seeds[0]), num_samples=G,
                        engine=engine, on_group=on_group)
    paths = {"rounds in turn": in_turn, "one queue": one_queue}
    outputs = {name: path() for name, path in paths.items()}  # warm-up, and the samples compared
    assert [c.tokens for c in outputs["one queue"]] == [c.tokens for c in outputs["rounds in turn"]]
    tokens = sum(len(c.tokens) for c in outputs["rounds in turn"])
    times = {name: [] for name in paths}
    for _ in range(args.repeats):  # alternated, so that a slower moment of the machine hits both
        for name, path in paths.items():
            times[name].append(timed(path, device))
    for name in paths:
        rate = tokens / statistics.median(times[name])
        print(f"  {name:15s} {rate:7.0f} tok/s  "
              f"{statistics.median(times['rounds in turn']) / statistics.median(times[name]):5.2f}x")


# ----------------------------------------------------------------------------- the update

def _bench_logprob_memory(path: str, batch: int, length: int, chunked: bool):
    """Runs in a fresh process: peak resident memory of one log-prob pass over the vocabulary."""
    def peak_mib():  # the kernel's high-water mark of resident memory (VmHWM)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024

    torch.manual_seed(0)
    model, _ = load_model(path, dtype=torch.float32, device="cpu")
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


def saved_for_backward(model, batch, length):
    """KiB kept for backward a token (each storage once) by the update's forward on `batch` rows
    of `length` positions, prompts left-padded and replies right-padded as the trainer lays them."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    attn = torch.ones_like(ids)
    for i in range(batch):
        attn[i, :8 * i], attn[i, length - 4 * i:] = 0, 0
    storages = {}

    def keep(t):
        storages[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        token_logprobs(model.train(), ids, attn, start=length // 2)
    return sum(storages.values()) / (batch * length) / 1024


def bench_memory(args):
    """Peak memory of the log-probs over the vocabulary: ours chunked against the naive path;
    the bytes a token the update's forward keeps for backward."""
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
    model = load_model(args.model, dtype=torch.float32)[0]
    for batch, length in ((8, 256), (2, 1024)):
        kept = saved_for_backward(model, batch, length)
        model.gradient_checkpointing = True
        recomputed = saved_for_backward(model, batch, length)
        model.gradient_checkpointing = False
        print(f"  kept for backward, fp32, {batch} x {length} padded rows: {kept:.0f} KiB a token; "
              f"with --activation-checkpointing {recomputed:.0f} KiB")


def bench_update(args):
    """Forward + backward + AdamW tokens/s: ours eager and with its blocks compiled, against
    transformers, in fp32 and (where bf16 is native) under bf16 autocast."""
    import statistics

    from transformers import AutoModelForCausalLM
    model_dir = args.model or converted_dir()
    B, T, device = args.train_batch, args.train_length, torch.device(args.device)
    torch.manual_seed(0)
    vocab = read_config(os.path.join(model_dir, "config.json")).vocab_size
    ids = torch.randint(0, vocab, (B, T), device=device)
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

    precisions = update_precisions(args.dtypes, device)
    results = {}
    for name, autocast in precisions:
        runs = {"ours": (load_model(args.model, dtype=torch.float32, device=device)[0], step_ours)}
        if not runs["ours"][0].config.num_experts:  # (a Mixture-of-Experts model stays eager)
            compiled, _ = load_model(args.model, dtype=torch.float32, device=device)
            runs["ours, blocks compiled"] = (compile_blocks(compiled), step_ours)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        runs["transformers"] = (hf, step_hf)
        runs = {k: (m.train(), fn) for k, (m, fn) in runs.items() if PATH_KEYS[k] in args.paths}
        baseline = "transformers" if "hf" in args.paths else next(iter(runs))
        # fused AdamW for both: what train.py uses, and transformers' Trainer default
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-6, fused=True) for k, (m, _) in runs.items()}
        times = _alternated_times(runs, opts, autocast, args.repeats, device)
        for k in runs:
            results[(name, k)] = B * T / statistics.median(times[k][1:])
        for k in runs:
            print(f"  {name:14s} {k:22s} {results[(name, k)]:6.0f} tok/s   "
                  f"{results[(name, k)] / results[(name, baseline)]:.2f}x {baseline}"
                  f"   first step {times[k][0]:5.1f} s")
        del hf, opts, runs
    if len(precisions) > 1 and "ours" in args.paths:
        print(f"  bf16 autocast / float32 (ours): "
              f"{results[('bf16 autocast', 'ours')] / results[('float32', 'ours')]:.2f}x")


def update_precisions(dtypes, device):
    """[(name, autocast context maker)] bench_update times: float32, and bf16 autocast where bf16
    is native (a GPU, a CPU with bf16 matrix instructions) or `dtypes` (--dtypes
    float32,bfloat16) names it."""
    precisions = [("float32", contextlib.nullcontext)]
    if cpu_has_bf16() or device.type == "cuda" or dtypes:
        precisions.append(("bf16 autocast", lambda: torch.autocast(device.type, dtype=torch.bfloat16)))
    else:
        print("  (bf16 autocast skipped: this CPU has no native bf16 matrix instructions)")
    if dtypes:
        wanted = {{"float32": "float32", "bfloat16": "bf16 autocast"}.get(d) for d in dtypes.split(",")}
        precisions = [p for p in precisions if p[0] in wanted]
    return precisions


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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["sampler", "engine", "refills", "update", "moe"])
    parser.add_argument("--model", default=None, help="checkpoint dir / .gguf / hub id "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (moe and the memory part: "
                        "cpu only)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: torch's; 1 on a machine shared with others)")
    sampler = parser.add_argument_group("sampler")
    sampler.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    sampler.add_argument("--samples", type=int, default=4, help="samples per prompt")
    sampler.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    sampler.add_argument("--rounds", type=int, default=4, help="refills: rollout rounds")
    sampler.add_argument("--max-rows", type=int, default=0, help="engine: the most rows decoding at "
                         "once (0: all); fewer, and rows join as others end, at other lengths")
    sampler.add_argument("--dtypes", default=None, help="comma-separated, e.g. float32,bfloat16 "
                         "(default: both where the device has native bf16, else float32; update: "
                         "bfloat16 means bf16 autocast)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="sampler, update and engine on CUDA: which paths to time, "
                        "comma-separated, of ours, ours-compiled, ours-graphs (CUDA graphs, on "
                        "CUDA only), ours-flex, ours-flex-graphs (engine: decode attention through "
                        "FlexAttention), ours-blocks-graphs (engine: CUDA graphs of each block "
                        "compiled), hf (transformers eager), hf-compiled (sampler only)")
    update = parser.add_argument_group("update")
    update.add_argument("--batch", type=int, default=8, help="log-prob memory: rows")
    update.add_argument("--length", type=int, default=512, help="log-prob memory: tokens per row")
    update.add_argument("--train-batch", type=int, default=8, help="update speed: rows")
    update.add_argument("--train-length", type=int, default=256, help="update speed: tokens per row")
    moe = parser.add_argument_group("moe")
    moe.add_argument("--moe-batch", type=int, default=8, help="MoE speed: rows")
    moe.add_argument("--moe-length", type=int, default=256, help="MoE speed: tokens per row")
    args = parser.parse_args(argv)
    device = checked_device(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as train.py does: a freed block is not faulted in again at every step
    try:  # a model that is not there, or only partly: one line, no traceback
        if args.what == "sampler":
            bench_sampler(args)
        elif args.what == "engine":
            bench_engine(args)
        elif args.what == "refills":
            bench_refills(args)
        elif args.what == "update":
            if device.type == "cpu":
                bench_memory(args)
            bench_update(args)
        else:
            bench_moe(args)
    except (OSError, ValueError) as error:
        parser.exit(2, f"bench.py: {error}\n")


def checked_device(parser, args) -> torch.device:
    """Every flag checked before any work (a usage error naming it); --paths becomes a list."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: not a device name (cpu, cuda, cuda:1, ...)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: this project runs on cpu or cuda")
    if args.threads < 0 or args.repeats < 1 or args.rounds < 1:
        parser.error(f"--threads must be >= 0 (0: torch's), --repeats and --rounds >= 1; got "
                     f"{args.threads}, {args.repeats}, {args.rounds}")
    if args.what == "moe" and device.type != "cpu":
        parser.error("moe: --device cpu only")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch build or machine has no CUDA device")
    for name in (args.dtypes or "float32").split(","):
        if name not in ("float32", "bfloat16", "float16"):
            parser.error(f"--dtypes: {name!r} is not one of float32, bfloat16, float16")
    args.paths = args.paths.split(",")
    for key in args.paths:
        if key not in PATHS:
            parser.error(f"--paths: {key!r} is not one of {', '.join(PATHS)}")
    return device


if __name__ == "__main__":
    sys.exit(main())
