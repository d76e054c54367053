"""The host's share of a decode step, another checkout's engine against this one's, side by side in
one process: what engine.paged.Engine.decode does around the model's step (block tables and inputs built
from Python lists, the pool's bookkeeping, each row's token appended). A GPU waits on it every
step: a step's tokens are read back once, and the next step is built only then.

    git worktree add /tmp/before <commit>
    python recipes/engine-host.py /tmp/before [--rows 256 --prompt 300 --new-tokens 512]

The model is Qwen2.5-0.5B's shape on the meta device (no memory; the pool holds every row at its
longest) and its step is stubbed: token 7 and log-prob 0 for every row, on the CPU, at once. Every
row runs to --new-tokens (tables grow to their longest). Printed: the mean host milliseconds of a
decode step over a call, the checkouts alternating, each first in every other round. Not counted:
the copies of a step's inputs to the GPU and their wait (five small tensors a step).
"""

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "recipes"))
from importlib import import_module  # noqa: E402

import_checkout = import_module("sampler-ab").import_checkout  # the same separate imports

QWEN_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                rope_theta=1e6, rope_scaling=None, max_seq_len=32768, tie_word_embeddings=True,
                qkv_bias=True, qk_norm=False, layer_types=("full",) * 24)


def stub_step(model, fed, start, tables, cache, keys, draws, *sampling_and_routing):
    """The decode step's contract, no model: each row's next token and its log-prob, (b,) each,
    on the CPU (its inputs are on the meta device: no values)."""
    return torch.full(fed.shape, 7), torch.zeros(fed.shape)


def host_ms_a_step(modules, rows, prompt, new_tokens, block_size=16):
    """One generate-like call of `rows` rows (prompts of `prompt` tokens, 16 samples each) through
    a checkout's Engine -> the mean wall milliseconds of its decode steps."""
    config = modules["model"].ModelConfig(**QWEN_05B)
    with torch.device("meta"):
        model = modules["model"].Transformer(config)
    prompts, counts = [[5] * prompt for _ in range(rows // 16)], [16] * (rows // 16)
    blocks = 1 + rows * -(-(prompt + new_tokens) // block_size)
    engine = modules["engine"].Engine(model, blocks, block_size, rows, 10**9, record=False)
    engine.add(prompts, counts, torch.arange(rows), new_tokens)
    first = lambda logits, keys: (torch.full(keys.shape, 7), torch.zeros(keys.shape))  # noqa: E731
    sampling, seconds, steps = dict(temperature=1.0, top_p=1.0, top_k=0), 0.0, 0
    while engine.busy():
        engine.admit()
        if engine.prefilling:  # on meta: shapes only, no arithmetic
            engine.prefill(first, set(), new_tokens)
            continue
        start = time.perf_counter()
        engine.decode(stub_step, sampling, set(), new_tokens)
        seconds, steps = seconds + time.perf_counter() - start, steps + 1
    return 1e3 * seconds / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", help="a checkout of this repository (e.g. a git worktree)")
    parser.add_argument("--rows", type=int, default=256, help="a multiple of 16")
    parser.add_argument("--prompt", type=int, default=300, help="tokens a prompt")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    if not any(os.path.isfile(os.path.join(args.before, *name)) for name in
               [("engine", "paged.py"), ("engine.py",)]):
        parser.error(f"{args.before}: no engine/paged.py there; give a checkout of this repository")
    if args.rows < 16 or args.rows % 16:
        parser.error(f"--rows: a multiple of 16, got {args.rows}")
    for flag, value, least in (("--prompt", args.prompt, 1), ("--new-tokens", args.new_tokens, 2),
                               ("--repeats", args.repeats, 1)):
        if value < least:
            parser.error(f"{flag}: at least {least}, got {value}")
    sys.path.insert(0, HERE)
    from bench import cpu_name
    checkouts = {name: import_checkout(path, ("model", "engine"))
                 for name, path in (("before", os.path.abspath(args.before)), ("this", HERE))}
    ms = {name: [] for name in checkouts}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in sorted(checkouts, reverse=repeat % 2 == 1):
            took = host_ms_a_step(checkouts[name], args.rows, args.prompt, args.new_tokens)
            if repeat:
                ms[name].append(took)
    print(f"{args.rows} rows, prompts of {args.prompt}, {args.new_tokens} new tokens, "
          f"{cpu_name()}, {torch.get_num_threads()} threads: host ms a decode step")
    for name, values in ms.items():
        print(f"  {name:6s} median {statistics.median(values):.3f} ms  "
              f"{[round(v, 3) for v in values]}")
    ratios = sorted(b / t for b, t in zip(ms["before"], ms["this"]))
    print(f"  before / this, round by round: median {statistics.median(ratios):.2f}x, "
          f"all {ratios[0]:.2f}-{ratios[-1]:.2f}x")


if __name__ == "__main__":
    main()
