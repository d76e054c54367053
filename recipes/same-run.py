"""Is the default run the same after a change? Runs `python train.py` (the offline default, its
own flags untouched) in two checkouts, one after the other, stops each after its first steps,
and compares what they wrote: the step-0 held-out evaluation (eval.jsonl), every metric of the
first steps (metrics.jsonl) and their logged completions (samples.jsonl), timings aside.

    git worktree add /tmp/before HEAD~1          # the checkout to compare against
    python recipes/same-run.py /tmp/before       # this checkout against it, 3 steps each
    python recipes/same-run.py /tmp/before --steps 2 --keep runs/same
    python recipes/same-run.py /tmp/before --flags "--max-refills 3"   # the default and these

Exit status 0 when they agree, 1 (with the first differences printed) when not. A refactor that
is meant to leave behaviour unchanged must pass it on one machine (floating-point results differ
between kinds of CPU, so both runs are made here, in one go).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What may differ between two runs of the same computation: clocks, memory, the run's own path.
TIMING = ("seconds", "tokens_per_second", "train_seconds", "peak_memory_mib", "train_minutes")


def run_default(checkout, out, steps, flags=()):
    """`python train.py --out OUT [FLAGS]` in `checkout` until metrics.jsonl holds `steps` lines,
    then SIGTERM (the run stops at the end of the step under way, checkpointed)."""
    log = open(out + ".log", "w")
    proc = subprocess.Popen([sys.executable, "train.py", "--out", out, *flags], cwd=checkout,
                            stdout=log, stderr=subprocess.STDOUT)
    metrics = os.path.join(out, "metrics.jsonl")
    while proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= steps:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(2)
    proc.wait()
    if not os.path.exists(metrics) or len(open(metrics).read().splitlines()) < steps:
        sys.exit(f"same-run.py: {checkout}: the run ended before {steps} steps (see {out}.log)")


def lines(out, name, count):
    """The first `count` lines of a run's log, timings left out."""
    with open(os.path.join(out, name)) as f:
        rows = [json.loads(line) for line in f.read().splitlines()[:count]]
    return [{key: value for key, value in row.items() if not key.startswith(TIMING)} for row in rows]


def differences(before, after, steps):
    """-> a line per field that differs, first the step-0 evaluation, then step by step."""
    found = []
    for name, count in (("eval.jsonl", 1), ("metrics.jsonl", steps), ("samples.jsonl", None)):
        a, b = lines(before, name, count or 10**9), lines(after, name, count or 10**9)
        if name == "samples.jsonl":  # the first steps' completions
            a, b = ([row for row in rows if row["step"] <= steps] for rows in (a, b))
        if len(a) != len(b):
            found.append(f"{name}: {len(a)} lines before, {len(b)} after")
        for i, (row_a, row_b) in enumerate(zip(a, b)):
            for key in sorted(set(row_a) | set(row_b)):
                if row_a.get(key, "(missing)") != row_b.get(key, "(missing)"):
                    found.append(f"{name} line {i + 1} {key}: {row_a.get(key, '(missing)')!r} "
                                 f"before, {row_b.get(key, '(missing)')!r} after")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the checkout to compare this one against")
    parser.add_argument("--steps", type=int, default=3, help="training steps compared")
    parser.add_argument("--keep", help="write the two runs here (before/, after/), not to a temp dir")
    parser.add_argument("--flags", default="", help="train.py flags added to the default run's, "
                        "one string")
    args = parser.parse_args(argv)
    if args.steps < 1:
        sys.exit(f"same-run.py: --steps must be >= 1, got {args.steps}")
    if not os.path.exists(os.path.join(args.before, "train.py")):
        sys.exit(f"same-run.py: {args.before}: no train.py there")
    with tempfile.TemporaryDirectory() as scratch:
        base = args.keep or scratch
        os.makedirs(base, exist_ok=True)
        runs = {side: os.path.abspath(os.path.join(base, side)) for side in ("before", "after")}
        for side, checkout in (("before", args.before), ("after", ROOT)):
            print(f"{side}: python train.py {args.flags} in {checkout} ...", flush=True)
            run_default(os.path.abspath(checkout), runs[side], args.steps, args.flags.split())
        found = differences(runs["before"], runs["after"], args.steps)
    for line in found[:40]:
        print(line)
    print(f"{len(found)} differences in the step-0 evaluation and the first {args.steps} steps "
          f"(timings aside)" if found else f"the same: the step-0 evaluation and the first "
          f"{args.steps} steps' metrics and completions (timings aside)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
