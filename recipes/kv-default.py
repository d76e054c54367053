"""A CPU call with no KV budget inside an address-space limit: `rollout.generate` of many long rows
on a tiny 2-layer model (512 bytes of keys and values a position), first with no --kv-budget
(engine/paged.py's default_kv_budget: half the host's free memory, within `ulimit -v`), then with
each explicit budget, last with the pool as it was before that default (every row at its longest,
which may fail); the seconds, the peak mapped and resident memory, the pool each held, and
whether each drew the first call's tokens.

    python recipes/kv-default.py [--rows 4096 --new-tokens 8000 --limit-gib 16 --budget-gib 4
                                  --stop-ids 9]

The limit is set on this process (RLIMIT_AS, as `ulimit -v` sets it) before torch loads. A row
ends at a stop id or at --new-tokens: the random model draws its tokens about evenly (its head
untied: a tied one draws the last token over and over), so rows end after ~55 tokens, a few
after hundreds. `--stop-ids` with no id: every row runs to its limit, and decode attention reads
~67 TB of keys and values at full size (hours on 2 cores).
Figures: MEASUREMENTS.md, "The engine".
"""

import argparse
import os
import resource
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rows", type=int, default=4096)
parser.add_argument("--new-tokens", type=int, default=8000)
parser.add_argument("--prompt-tokens", type=int, default=16)
parser.add_argument("--limit-gib", type=float, default=16.0, help="the address-space limit")
parser.add_argument("--budget-gib", type=float, nargs="+", default=[4.0],
                    help="the explicit runs' budgets")
parser.add_argument("--stop-ids", type=int, nargs="*", default=[9], help="ids that end a row")
parser.add_argument("--no-longest", action="store_true",
                    help="skip the last run, every row at its longest")
args = parser.parse_args()
limit = int(args.limit_gib * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import torch  # noqa: E402 (after the limit: torch's own mappings count against it)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.paged import EngineOptions, default_kv_budget  # noqa: E402
from engine.speed import keep_freed_memory, pack_linears  # noqa: E402
from engine.speedups import SpeedUps  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from rollout import Sampling, generate  # noqa: E402


def tiny_model(context):
    """2 layers, 2 key/value heads of 16: 2 x 2 x 2 x 16 x 4 = 512 bytes a position in fp32;
    random weights, the head untied, its products packed as train.py's sampler's are."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, rope_scaling=None, max_seq_len=context,
                      tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                      layer_types=("full", "full"))
    torch.manual_seed(0)
    return pack_linears(Transformer(cfg).eval())


def peak_rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_mapped_gib():
    """VmPeak: the most address space this process has mapped, what RLIMIT_AS bounds."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmPeak:")) / 2**20


def run(model, prompts, sampling, kv_budget):
    stats, start = {}, time.perf_counter()
    engine = EngineOptions(kv_budget=kv_budget, speed=SpeedUps(compile=False))  # as train.py
    out = generate(model, prompts, sampling, engine=engine, stats=stats)
    pool = stats["pool_blocks"] * stats["block_bytes"] / 2**30
    print(f"  kv_budget={kv_budget}: {time.perf_counter() - start:.0f} s, pool {pool:.2f} GiB, "
          f"waits {stats['waits']}, preemptions {stats['preemptions']}, {stats['decode_steps']} "
          f"decode steps, {sum(len(row.tokens) for row in out)} tokens; peak so far: mapped "
          f"{peak_mapped_gib():.2f} GiB, resident {peak_rss_gib():.2f} GiB", flush=True)
    return [row.tokens for row in out]


def main():
    keep_freed_memory()
    model = tiny_model(args.prompt_tokens + args.new_tokens)
    prompts = [[4 + (7 * i + j) % 60 for j in range(args.prompt_tokens)] for i in range(args.rows)]
    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=1.0, seed=1,
                        stop_token_ids=tuple(args.stop_ids))
    need = args.rows * (args.prompt_tokens + args.new_tokens) * 512 / 2**30
    default = default_kv_budget(model, prompts, [1] * args.rows, args.new_tokens, 16)
    print(f"{args.rows} rows x {args.new_tokens} new tokens: every row at its longest "
          f"{need:.1f} GiB; address-space limit {args.limit_gib:g} GiB; the default budget "
          f"{'none' if default is None else f'{default:.2f} GiB'}", flush=True)
    by_default = run(model, prompts, sampling, None)
    for budget in args.budget_gib:
        same = run(model, prompts, sampling, budget) == by_default
        print(f"  kv_budget={budget}: {'the same' if same else 'DIFFERENT'} tokens", flush=True)
    if not args.no_longest:  # the pool before default_kv_budget: every row at its longest
        try:
            same = run(model, prompts, sampling, need * 1.01) == by_default
            print(f"  every row at its longest: {'the same' if same else 'DIFFERENT'} tokens")
        except (RuntimeError, MemoryError) as error:  # torch's "can't allocate", or Python's
            print(f"  every row at its longest ({need:.1f} GiB): fails: "
                  f"{str(error).splitlines()[0][:160]}")


if __name__ == "__main__":
    main()
