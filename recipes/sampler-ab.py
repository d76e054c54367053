"""Another checkout's sampler against this one's, side by side in one process, on the bundled
model: tok/s of rollout.generate (eager, packed products, in the dtype train.py samples in here)
and whether the two draw the same tokens.

    git worktree add /tmp/before <commit>
    python recipes/sampler-ab.py /tmp/before [--prompts 8 --samples 8 --new-tokens 64 --stops]
        [--dtype float32] [--alone]

Each checkout's model.py, rollout.py, engine/, run/checkpoints.py and what they import (OWN)
are imported on their own (engine/speed.py once: its op registers once per process; its
pack_linears is given each checkout's classes), with freed memory kept as train.py keeps it; the
runs alternate, each first in every other round, after a warm-up call of each; the ratio of the
two is printed round by round. --alone: then each checkout draws each prompt of the last round
alone, and the rows that equal its own all-at-once draws, and the other checkout's, are counted
(how far a sampler's samples depend on the rows beside them).
"""

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported once per checkout: the packages whole, and the flat modules of a checkout from before
# the packages (one with engine.py at its root: its speed.py is this checkout's engine/speed.py).
OWN = ("model", "rollout", "data", "engine", "variants", "run", "tasks", "moe", "chunked_logprobs",
       "cuda_graphs", "flex_decode", "checkpoints", "lora", "quantize", "verify", "speed")
SHARED = ("engine.speed",)  # imported once: its op registers once per process
WHERE = {"engine": "engine.paged", "checkpoints": "run.checkpoints"}  # short names of the modules


def own(name):
    return name not in SHARED and name.split(".")[0] in OWN


def flat(path):
    """Whether the checkout at path is of the layout before the packages (engine.py at its root)."""
    return os.path.isfile(os.path.join(path, "engine.py"))


def import_checkout(path, names=("rollout", "checkpoints", "model")):
    """-> {name: module} of the checkout at path, for `names` (short: "engine" is engine/paged.py,
    or a flat checkout's engine.py), without disturbing sys.modules."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if own(name)}
    if flat(path):  # its `import speed` is this checkout's, as its own was shared before
        sys.modules["speed"] = importlib.import_module("engine.speed")
    sys.path.insert(0, path)
    try:
        return {name: importlib.import_module(name if flat(path) else WHERE.get(name, name))
                for name in names if not (flat(path) and name == "engine.speedups")}
    finally:
        sys.path.remove(path)
        for name in [name for name in sys.modules if own(name)]:
            sys.modules.pop(name)
        sys.modules.update(saved)


def pack_checkout(model, classes):
    """speed.pack_linears on a checkout's model: it finds the attention and MLP projections by
    their classes, and a checkout's classes are its own (without this, only the head is packed).
    A LoRA base would be found by this checkout's LoRALinear: the bundled model has none."""
    from engine import speed
    saved = speed.Attention, speed.MLP
    speed.Attention, speed.MLP = classes.Attention, classes.MLP
    try:
        return speed.pack_linears(model)
    finally:
        speed.Attention, speed.MLP = saved


def load_checkout(path, dtype, stops):
    """-> (generate, the bundled model packed, stop ids, tokenizer) of the checkout at path."""
    from engine.speed import PackedLinear
    modules = import_checkout(path, ("rollout", "checkpoints", "model", "engine", "engine.speedups"))
    model, tokenizer = modules["checkpoints"].load_model(None, dtype=dtype, device="cpu")
    model = pack_checkout(model, modules["model"])
    if not all(type(m) is PackedLinear for m in model.modules()  # (the bundled model is dense)
               if isinstance(m, torch.nn.Linear)):
        raise SystemExit(f"{path}: not every projection was packed; the two would not be the "
                         f"sampler train.py runs")
    stop_ids = modules["rollout"].stop_token_ids(tokenizer) if stops else []
    return with_options(modules), model, stop_ids, tokenizer


def with_options(modules):
    """A checkout's generate, called with flat keywords: its own Sampling and, speed-ups as
    train.py's (eager), its own EngineOptions and SpeedUps (a flat checkout's takes the keywords)."""
    rollout, paged, speedups = modules["rollout"], modules["engine"], modules.get("engine.speedups")
    if speedups is None:
        return lambda model, prompts, num_samples, **sampling: rollout.generate(
            model, prompts, num_samples=num_samples, compile=False, **sampling)

    def generate(model, prompts, num_samples, **sampling):
        engine = paged.EngineOptions(speed=speedups.SpeedUps(compile=False))
        return rollout.generate(model, prompts, rollout.Sampling(**sampling),
                                num_samples=num_samples, engine=engine)
    return generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", help="a checkout of this repository (e.g. a git worktree)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stops", action="store_true", help="stop at the chat template's end of "
                        "turn (replies of their own lengths) instead of running to the limit")
    parser.add_argument("--repeats", type=int, default=4, help="timed rounds (even: each "
                        "checkout first in half of them)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the sampler's weights (default: train.py's choice on this CPU)")
    parser.add_argument("--alone", action="store_true", help="also draw each prompt alone")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.before, "rollout.py")):
        parser.error(f"{args.before}: no rollout.py there; give a checkout of this repository")
    sys.path.insert(0, HERE)
    import bench  # noqa: E402 (this checkout's; speed.py comes with it, once)
    from engine.speed import keep_freed_memory
    from run.checkpoints import cpu_has_bf16
    keep_freed_memory()  # as train.py and bench.py do: freed blocks are not faulted in again
    dtype = getattr(torch, args.dtype or ("bfloat16" if cpu_has_bf16() else "float32"))
    paths = {name: load_checkout(path, dtype, args.stops)
             for name, path in (("before", os.path.abspath(args.before)), ("this", HERE))}
    prompts = bench.bench_prompts(paths["this"][3], args.prompts)
    times, tokens = {name: [] for name in paths}, {name: [] for name in paths}
    for repeat in range(args.repeats + 1):  # the first round warms up
        # Each goes first in every other round: the first of a pair ran ~4% faster here.
        for name in sorted(paths, reverse=repeat % 2 == 1):
            start = time.perf_counter()
            out = draw(paths[name], prompts, args.samples, repeat,
                       args.new_tokens if repeat else 4)
            if repeat:
                times[name].append(time.perf_counter() - start)
                tokens[name].append([c.tokens for c in out])
    # (with stops, bf16 rounding may give the two replies of other lengths: each its own count)
    drawn = {name: [sum(map(len, run)) for run in tokens[name]] for name in paths}
    print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
          f"stops {'on' if args.stops else 'off'}, {str(dtype)[6:]}, {bench.cpu_name()}, "
          f"{torch.get_num_threads()} threads; tokens a run {drawn['this']}")
    speed = {name: [n / t for n, t in zip(drawn[name], times[name])] for name in paths}  # tok/s
    for name in paths:
        print(f"  {name:6s} {statistics.median(speed[name]):7.1f} tok/s (median)  "
              f"seconds {[round(t, 2) for t in times[name]]}")
    # Each round's two runs share the machine's state of the moment: their ratio is steadier
    # than the ratio of the medians when the machine drifts between rounds.
    ratios = sorted(t / b for b, t in zip(speed["before"], speed["this"]))
    print(f"  this / before in tok/s, round by round: median {statistics.median(ratios):.3f}x, "
          f"middle half {ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios) - 1) // 4]:.3f}x, "
          f"all {ratios[0]:.3f}-{ratios[-1]:.3f}x")
    for repeat, (a, b) in enumerate(zip(tokens["before"], tokens["this"])):
        differ = [row for row, (x, y) in enumerate(zip(a, b)) if x != y]
        print(f"  run {repeat + 1}: {len(a) - len(differ)} of {len(a)} rows the same tokens"
              + (f" (rows {differ} differ)" if 0 < len(differ) <= 8 else ""))
    if args.alone:
        alone_against_together(paths, prompts, {name: runs[-1] for name, runs in tokens.items()},
                               args)


def draw(checkout, prompts, samples, seed, new_tokens):
    """A checkout's generate (from load_checkout) on `prompts`, as every run here draws."""
    generate, model, stops, _ = checkout
    return generate(model, prompts, num_samples=samples, temperature=0.8, seed=seed,
                    max_new_tokens=new_tokens, stop_token_ids=stops)


def alone_against_together(paths, prompts, together, args):
    """Each checkout draws each prompt alone with the seed generate gives it in the last round
    (seed * 1_000_003 + its index), and counts the rows equal to `together`, its own and the
    other checkout's draws of all prompts at once."""
    seed, alone = args.repeats, {}
    for name, checkout in paths.items():
        alone[name] = [c.tokens for i, prompt in enumerate(prompts) for c in draw(
            checkout, [prompt], args.samples, [seed * 1_000_003 + i], args.new_tokens)]
    for name, other in (("before", "this"), ("this", "before")):
        own = sum(a == b for a, b in zip(alone[name], together[name]))
        across = sum(a == b for a, b in zip(alone[name], together[other]))
        print(f"  {name} alone: {own} of {len(alone[name])} rows as its own all at once, "
              f"{across} as {other}'s all at once")


if __name__ == "__main__":
    main()
