"""Evaluate a model on a math benchmark: pass@1, avg@k, pass@k, maj@k, response length.

    # the bundled SmolLM2-135M-Instruct, greedy, on 200 held-out problems of the synthetic task (CPU)
    python eval.py --data arithmetic --limit 200

    # a trained run's final model (any directory written by checkpoints.save_model) on the same problems
    python eval.py --model runs/my-run/final --data arithmetic --limit 200

    # a Qwen model on a GPU: greedy GSM8K, then DAPO's protocol on AIME 2024 (avg@32, T 1.0, top-p 0.7)
    python eval.py --model Qwen/Qwen2.5-1.5B-Instruct --data gsm8k --max-new-tokens 1024
    python eval.py --model Qwen/Qwen2.5-Math-7B --data math500 --template boxed --max-new-tokens 4096
    python eval.py --model Qwen/Qwen2.5-Math-7B --data aime24 --k 32 --temperature 1.0 --top-p 0.7 \\
        --max-new-tokens 20480 --batch-size 4

`--data` is whatever data.load_records takes: gsm8k, math500, aime24, dapo-math-17k (hub),
arithmetic[:key=value,...] (synthetic; split "test" is its fixed held-out set, 200 problems unless
--limit says otherwise), countdown[:key=value,...] (tasks/countdown.py; its held-out problems, judged by
its own reward), or a local .jsonl/.json/.parquet file with the hub's field names (`--reward
FILE.py:FUNCTION` judges its replies with your own function); or the memory task in turns,
memory[:key=value,...] (tasks/episodes.py; its held-out diaries, 50 unless --limit says otherwise, as
the dapo-memory preset evaluates).

    # a memory run's model on 12-page diaries, four times longer than it was trained on
    python eval.py --model runs/my-memory-run/final --data memory:pages=12,max=9,filler=2,ask=first --limit 50

How one evaluation runs, and what each metric means: run/evaluation.py (train.py's held-out
evaluation calls the same `evaluate`, so a checkpoint gets the same numbers from both). Prompts
are formatted with data.format_prompt; the template defaults by data: the bare question ("none")
for the synthetic tasks (arithmetic, memory), as train.py prompts them; the DAPO "Answer:"
instruction ("dapo") for everything else. A memory record is an episode of a turn a page, each
reply one line (the sampler also stops at a line break, as in training).

Outputs: a tqdm progress bar on stderr; one JSON line per problem (id, problem, the rendered
prompt, answer, responses, extracted answers, correct flags, lengths, finish reasons, the voted
answer; a memory record adds each episode's replies) written atomically (temporary file, then
rename) to --out, by default `eval-<data>-<YYYYmmdd-HHMMSS>.jsonl` beside the evaluated model (in
the folder holding a model directory: a run's final/ -> the run's directory), or under runs/eval/
for the bundled model or a hub id; and stdout ends with exactly one
JSON line: model, data, n, k, pass@1, avg@k, pass@k, maj@k, temperature, mean_length, truncated,
seconds, out, and the other settings. --out is checked before any work: never the --data file,
an existing file only with --overwrite, a folder that can be written, no other eval.py writing it
(.<name>.lock beside it while one runs). If the results still cannot be written at the end, the
summary line comes out all the same (with "out": null), exit code 1.

Tests: python -m pytest tests/test_eval.py -q   (add `-m "not slow"` to skip the bundled-model run)
"""

import argparse
import contextlib
import functools
import json
import math
import os
import re
import sys
import tempfile
import time

import torch

import data
import rewards
import rollout
from engine.speed import keep_freed_memory, pack_linears
from run import checkpoints, config, launch, runs
from run.evaluation import DEFAULT_ROWS, evaluate
from tasks import countdown, episodes

BUNDLED_NAME = "bundled:SmolLM2-135M-Instruct"


# ----------------------------------------------------------------------------- command line

def task_name(data_name):
    return str(data_name).split(":", 1)[0]


def default_max_new_tokens(data_name):
    """256 for the arithmetic task (the untrained model's answers run up to ~100 tokens), 16 a turn
    for the memory task (its one-line replies, as the dapo-memory preset), 1024 for benchmarks."""
    return {"arithmetic": 256, "memory": 16, "countdown": 256}.get(task_name(data_name), 1024)


def default_out_path(data_name, model=None):
    """eval-<data>-<YYYYmmdd-HHMMSS>.jsonl (a data file's folder and stem name it) beside the model:
    in the folder holding a model directory, else (the bundled model, a hub id, a .gguf file, a
    folder it cannot write) under runs/eval/."""
    beside = os.path.dirname(os.path.abspath(model)) if model and os.path.isdir(model) else None
    folder = beside if beside and os.access(beside, os.W_OK) else os.path.join("runs", "eval")
    name = str(data_name)
    if os.path.isfile(name):
        data_folder = os.path.basename(os.path.dirname(os.path.abspath(name)))
        name = f"{data_folder}-{os.path.splitext(os.path.basename(name))[0]}"
    name = re.sub(r"[^A-Za-z0-9._=-]+", "-", name).strip("-") or "data"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, number = os.path.join(folder, f"eval-{name}-{stamp}.jsonl"), 1
    while os.path.exists(path):
        path, number = os.path.join(folder, f"eval-{name}-{stamp}-{number}.jsonl"), number + 1
    return path


def write_jsonl_atomic(path, rows):
    """One JSON object per line, to a temporary file in the same folder, then renamed onto `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".eval-", suffix=".tmp", dir=folder)
    os.chmod(tmp, 0o666 & ~checkpoints.current_umask())  # as any file the user writes (not 0600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _float_in(low, high=math.inf, low_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > low if low_open else value >= low) or value > high or not math.isfinite(value):
            bound = f"> {low}" if low_open else f">= {low}"
            raise argparse.ArgumentTypeError(
                f"must be {bound}" + (f" and <= {high}" if high != math.inf else "") + f", got {text}")
        return value
    return parse


def build_parser():
    parser = argparse.ArgumentParser(
        prog="eval.py", description="pass@1 / avg@k / pass@k / maj@k of a model on a math benchmark.",
        usage="%(prog)s [--model M] [--data D] [--k K] [FLAG ...] (all flags: --help)", allow_abbrev=False,
        epilog="See the module docstring (python -c 'import eval; help(eval)') for metric "
               "definitions and example command lines.")
    what = parser.add_argument_group("what to evaluate")
    what.add_argument("--model", default=None,
                      help="checkpoint directory (e.g. a run's final model written by save_model), "
                           ".gguf file or hub id (default: the bundled SmolLM2-135M-Instruct)")
    what.add_argument("--data", default="arithmetic",
                      help="gsm8k, math500, aime24, dapo-math-17k, arithmetic[:key=value,...], "
                           "countdown[:key=value,...], memory[:key=value,...] (in turns) or a "
                           "local .jsonl/.json/.parquet file (default: arithmetic)")
    what.add_argument("--split", default="test",
                      help="dataset split; for arithmetic, 'test' is the fixed held-out set "
                           "(default: test; math500 and aime24 have one split and ignore it)")
    what.add_argument("--limit", type=_int_at_least(1), default=None,
                      help="evaluate the first N problems (default: all; arithmetic and "
                           "countdown: 200, memory: 50)")
    judge_flags(what)
    what.add_argument("--template", choices=data.TEMPLATES, default=None,
                      help="prompt template (default: 'none', the bare question, for arithmetic "
                           "and memory; 'dapo' otherwise)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--k", type=_int_at_least(1), default=1,
                          help="samples per problem, for avg@k, pass@k and maj@k (default: 1)")
    sampling.add_argument("--temperature", type=_float_in(0.0), default=None,
                          help="0 is greedy (default: 0 when k is 1, else 1.0; k > 1 needs T > 0)")
    sampling.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0,
                          help="nucleus sampling mass, in (0, 1] (default: 1.0; DAPO evaluates "
                               "with 0.7)")
    sampling.add_argument("--top-k", type=_int_at_least(0), default=0,
                          help="keep the k most likely tokens, 0 = all (default: 0)")
    sampling.add_argument("--max-new-tokens", type=_int_at_least(1), default=None,
                          help="response budget in tokens, per turn (default: 256 for "
                               "arithmetic, 16 for memory, 1024 otherwise)")
    sampling.add_argument("--seed", type=_int_at_least(0), default=0, help="sampling seed (default: 0)")
    run = parser.add_argument_group("how to run")
    run.add_argument("--batch-size", type=_int_at_least(1), default=None,
                     help=f"prompts per generate call, each with k samples (default: "
                          f"{DEFAULT_ROWS} // k, at least 1)")
    run.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                     help="weights and compute dtype; auto = bfloat16 on CUDA or on a CPU with "
                          "bf16 instructions, else float32 (default: auto)")
    run.add_argument("--device", default=None,
                     help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    run.add_argument("--out", default=None,
                     help="per-problem results, one JSON line each (default: "
                          "eval-<data>-<YYYYmmdd-HHMMSS>.jsonl beside a model directory, else "
                          "under runs/eval/); never the --data file, and an existing file only "
                          "with --overwrite")
    run.add_argument("--overwrite", action="store_true", help="let --out replace an existing file")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def judge_flags(group):
    """The tools the model may call and who judges its replies, as train.py's flags."""
    group.add_argument("--tools", default="", metavar="NAMES",
                       help="tools the model may call, as train.py --tools: calculator, python")
    group.add_argument("--unsandboxed-python", action="store_true",
                       help="as train.py's: --tools python where bubblewrap cannot isolate it")
    group.add_argument("--reward", default="", metavar="FILE.py:FUNCTION",
                       help="judge replies with your own reward function, as train.py --reward "
                            "does: right when it says so (default: the answer checker)")
    group.add_argument("--reward-timeout", type=float, default=rewards.TIME_LIMIT, metavar="SECONDS",
                       help="--reward's time limit a call, as train.py's: a reply not judged by "
                            "then is not right (0: none)")


def resolve_dtype(name, device):
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" or checkpoints.cpu_has_bf16() else torch.float32


def parse_args(argv=None):
    """The command line, every value checked before any work (a usage error, exit 2, names the
    flag). -> (parser, args)"""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.temperature is None:
        args.temperature = 0.0 if args.k == 1 else 1.0
    if args.temperature == 0 and args.k > 1:
        parser.error(f"argument --k: k={args.k} with --temperature 0 would give {args.k} identical "
                     "greedy samples; pass --temperature > 0 (e.g. 1.0) or --k 1")
    if not 0 <= args.reward_timeout < math.inf:
        parser.error(f"argument --reward-timeout: seconds >= 0 (0: none), got {args.reward_timeout:g}")
    if args.reward_timeout != rewards.TIME_LIMIT and not args.reward:
        parser.error("argument --reward-timeout: acts only with --reward (the answer checker never hangs)")
    args.out = args.out or default_out_path(args.data, args.model)
    check_out_path(parser, args)
    return parser, args


def check_out_path(parser, args):
    """--out must not be the data it reads, must not replace a file unasked, and must be
    writable: found out now, not after the whole evaluation."""
    out = args.out
    if os.path.isdir(out):
        parser.error(f"argument --out: {out} is a directory; give a file name")
    if os.path.exists(out) and os.path.exists(args.data) and os.path.samefile(out, args.data):
        parser.error(f"argument --out: {out} is the --data file; the results would overwrite it")
    if os.path.exists(out) and not args.overwrite:
        parser.error(f"argument --out: {out} exists; pick another name or pass --overwrite")
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".eval-check-"):
            pass
    except OSError as error:
        parser.error(f"argument --out: cannot write in {folder}: {error.strerror or error}")


@contextlib.contextmanager
def claim_out(parser, args):
    """Holds .<--out's name>.lock beside --out (runs.hold_lock) until the results are written or
    the run fails, so that a second eval.py given the same --out stops now, not after both
    evaluated and one run's rows silently replaced the other's. A killed run's lock never blocks."""
    folder, name = os.path.split(os.path.realpath(args.out))  # (one lock however --out is spelled)
    path = os.path.join(folder, f".{name}.lock")
    try:
        handle, holder = runs.hold_lock(path, "eval.py")
    except OSError as error:
        parser.error(f"argument --out: cannot write in {folder}: {error.strerror or error}")
    if handle is None:
        parser.error(f"argument --out: {args.out} is being written by {holder}: wait for it to finish "
                     "or pick another --out")
    try:
        check_out_path(parser, args)  # again: a run that held the lock until now may have written it
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # before letting go: a run that opened it meanwhile makes a new one
        handle.close()


def load_eval_records(parser, args):
    """--data's records, before the model loads; a bad name or file is a usage error."""
    looks_like_path = os.sep in args.data or args.data.endswith(data.FILE_EXTENSIONS)
    if looks_like_path and not os.path.exists(args.data):
        parser.error(f"argument --data: no such file: {args.data}")
    if task_name(args.data) in ("memory", "countdown") and args.split != "test":
        parser.error(f"argument --split: the {task_name(args.data)} task has its held-out "
                     f"problems only (test), got {args.split!r}")
    try:
        records = episodes.MemoryTask.from_spec(args.data).heldout(args.limit or 50) \
            if task_name(args.data) == "memory" else \
            countdown.CountdownTask.from_spec(args.data).heldout(args.limit or 200) \
            if task_name(args.data) == "countdown" else \
            data.load_records(args.data, split=args.split, limit=args.limit)
    except data.DataError as error:
        parser.error(f"argument --data: {error}")
    if args.limit is not None and len(records) < args.limit:
        print(f"eval.py: note: {args.data} has only {len(records)} problems (--limit {args.limit})",
              file=sys.stderr)
    return records


def reward_judge(parser, args, records):
    """Who decides a reply is right: --reward's function (checked on the first record, as
    train.py checks it), Countdown's own, or None: verify.is_correct against the answer."""
    if not args.reward:
        return functools.partial(rewards.judged_right, countdown.reward) \
            if task_name(args.data) == "countdown" else None
    try:
        function, _ = launch.checked_reward_function(args.reward, records[0], args.data, args.reward_timeout)
    except ValueError as error:
        parser.error(f"argument {error}")
    return functools.partial(rewards.judged_right, function)


def resolve_device(parser, name):
    """--device -> a torch.device this project runs on (None: cuda when available, else cpu)."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        parser.error(f"argument --device: {error}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: {name}: this project runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {name}: CUDA is not available on this machine")
    return device


def main(argv=None):
    parser, args = parse_args(argv)
    with claim_out(parser, args):
        return run_evaluation(parser, args)


def run_evaluation(parser, args):
    """The evaluation eval.py's command line asks for: checks, model, samples, report."""
    keep_freed_memory()
    template = args.template or data.default_template(args.data)
    max_new_tokens = args.max_new_tokens or default_max_new_tokens(args.data)
    device = resolve_device(parser, args.device)
    dtype = resolve_dtype(args.dtype, device)
    records = load_eval_records(parser, args)  # first: a bad name or file fails in a second
    judge = reward_judge(parser, args, records)
    tool_names = config.tool_names(args)
    config.check_tools(args, parser)
    load_start = time.perf_counter()
    try:
        model, tokenizer = checkpoints.load_model(args.model, dtype=dtype, device=device)
    except (OSError, ValueError) as error:
        parser.error(f"argument --model: {error}")
    pack_linears(model)  # the sampler's products on packed weights, where faster (speed.py)
    load_seconds = time.perf_counter() - load_start
    if max_new_tokens >= model.config.max_seq_len:
        parser.error(f"argument --max-new-tokens: {max_new_tokens} leaves no room for a prompt in "
                     f"the model's context of {model.config.max_seq_len} tokens")
    memory = task_name(args.data) == "memory"
    try:  # every prompt must leave room for the response inside the model's context
        data.validate_records([episodes.next_turn(r, 0, tools=tool_names) for r in records], args.data,
                              tokenizer=tokenizer, template=template,
                              max_prompt_tokens=model.config.max_seq_len - max_new_tokens)
    except data.DataError as error:
        parser.error(f"argument --data: {error} (the model's context is {model.config.max_seq_len} "
                     f"tokens, {max_new_tokens} of them kept for the response by --max-new-tokens)")

    # The memory task's replies are one line each: its sampler stops at a line break (train.py's too).
    stop_ids = rollout.stop_token_ids(tokenizer) + (rollout.line_break_ids(tokenizer) if memory else [])
    try:
        summary, results = evaluate(
            model, tokenizer, records, k=args.k, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, max_new_tokens=max_new_tokens, template=template, stop_ids=stop_ids,
            batch_size=args.batch_size, seed=args.seed, progress=not args.quiet, judge=judge,
            tools=tool_names)
    except KeyboardInterrupt:  # (results are written whole or not at all: nothing half-written)
        print(f"\neval.py: interrupted (Ctrl-C); {args.out} not written", file=sys.stderr)
        raise SystemExit(130) from None
    return report(args, summary, results, dtype, device, load_seconds)


def report(args, summary, results, dtype, device, load_seconds):
    """The per-problem results into --out (written whole or not at all), the summary on stderr
    and, as the last line of stdout, as JSON; exit status 1 if --out could not be written.
    -> the summary line"""
    out, write_error = args.out, None
    try:
        write_jsonl_atomic(out, results)
    except OSError as error:  # the summary line below still comes out
        write_error = f"{out}: {error.strerror or error}"
        print(f"eval.py: could not write the per-problem results: {write_error}", file=sys.stderr)

    line = {"model": args.model or BUNDLED_NAME, "data": args.data, "split": args.split}
    line.update(summary)
    line.update(dtype=str(dtype).replace("torch.", ""), device=str(device),
                load_seconds=load_seconds, out=None if write_error else os.path.abspath(out))
    line = {key: round(value, 6) if isinstance(value, float) else value
            for key, value in line.items()}
    print(f"{line['n']} problems, k={line['k']}: pass@1 {line['pass@1']:.4f}  avg@k "
          f"{line['avg@k']:.4f}  pass@k {line['pass@k']:.4f}  maj@k {line['maj@k']:.4f}  "
          f"mean length {line['mean_length']:.1f}  truncated {line['truncated']:.1%}  "
          f"({line['seconds']:.1f} s) -> {out}", file=sys.stderr)
    sys.stdout.flush()
    print(json.dumps(line, allow_nan=False), flush=True)  # strict JSON: no NaN or Infinity
    if write_error:
        sys.exit(1)
    return line


if __name__ == "__main__":
    main()
