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
--limit says otherwise), or a local .jsonl/.json/.parquet file with the hub's field names.

How one evaluation runs (`evaluate`):
1. Each problem is formatted with data.format_prompt. The template defaults by data: the bare
   question ("none") for the synthetic `arithmetic` task, which is how its numbers were measured
   and how train.py prompts it; the DAPO "Answer:" instruction ("dapo") for everything else.
2. Prompts are sorted by length (less padding) and sampled in batches of --batch-size prompts x k
   samples with rollout.generate, stopping at the tokenizer's end tokens
   (`rollout.stop_token_ids`).
3. Every response is decoded and scored with verify.is_correct against the ground truth.

Metrics (per problem i with c_i correct of n = k samples, then averaged over the N problems):
- pass@1: the probability that one sample is right. Greedy (temperature 0, k 1): the greedy
  answer's correctness. Sampled: the unbiased estimate c_i / n (Chen et al. 2021, "Evaluating
  Large Language Models Trained on Code", arXiv 2107.03374, eq. 1 with k = 1), so with sampling
  pass@1 equals avg@k.
- avg@k: mean accuracy of the k samples, mean_i c_i / k. The DAPO paper (arXiv 2503.14476) reports
  avg@32 on AIME 2024, at temperature 1.0 and top-p 0.7.
- pass@k: the chance that at least one of k samples is right, with Chen et al.'s unbiased
  estimator 1 - C(n - c, k) / C(n, k), computed as the product 1 - prod_{j=n-c+1}^{n} (1 - k / j)
  (their numerically stable form, which never builds the huge binomials). Here n = k, so it is
  "any sample correct"; `pass_at_k(n, c, k)` is the general function.
- maj@k: majority vote (self-consistency, Wang et al. 2022, arXiv 2203.11171; "maj1@k" in Lewkowycz
  et al. 2022, Minerva, arXiv 2206.14858). The extracted answers vote; two answers vote together
  when verify.is_correct deems them equal (so "1,000", "1000" and "1000.0" are one vote);
  responses with no answer do not vote; a tie goes to the answer seen first. The problem counts
  as solved when the winning answer is correct.
- mean_length: generated tokens per response (the stop token included); truncated: the fraction of
  responses that hit --max-new-tokens without a stop token.

Outputs: a tqdm progress bar on stderr; one JSON line per problem (id, problem, the rendered
prompt, answer, responses, extracted answers, correct flags, lengths, finish reasons, the voted
answer) written atomically (temporary file, then rename) to --out, by default
`eval-<data>-<YYYYmmdd-HHMMSS>.jsonl` in the current directory; and stdout ends with exactly one
JSON line: model, data, n, k, pass@1, avg@k, pass@k, maj@k, temperature, mean_length, truncated,
seconds, out, and the other settings. --out is checked before any work: never the --data file,
an existing file only with --overwrite, a folder that can be written. If the results still cannot
be written at the end, the summary line comes out all the same (with "out": null), exit code 1.

Tests: python -m pytest tests/test_eval.py -q   (add `-m "not slow"` to skip the bundled-model run)
"""

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time

import torch
from tqdm import tqdm

import checkpoints
import data
import rollout
import verify

DEFAULT_ROWS = 64  # prompts x samples per generate call when --batch-size is not given
BUNDLED_NAME = "bundled:SmolLM2-135M-Instruct"


# ----------------------------------------------------------------------------- metrics

def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv 2107.03374).

    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{j = n-c+1}^{n} (1 - k / j), which is the same
    number without the huge binomial coefficients.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def majority_vote(answers):
    """The most frequent answer among `answers` (None entries do not vote) -> (answer, votes).

    Equal answers (`verify.answers_equal`) vote together under the first one's spelling; a tie
    goes to the answer seen first. (None, 0) when nobody voted.
    """
    clusters = []  # [representative, votes], in order of first appearance
    for answer in answers:
        if answer is None:
            continue
        for cluster in clusters:
            if cluster[0] == answer or verify.answers_equal(answer, cluster[0]):
                cluster[1] += 1
                break
        else:
            clusters.append([answer, 1])
    if not clusters:
        return None, 0
    return tuple(max(clusters, key=lambda cluster: cluster[1]))  # max keeps the first of equals


def summarize(results, k):
    """Per-problem results (as `evaluate` makes them) -> the metrics dict."""
    if not results:
        raise ValueError("summarize: no results")
    n = len(results)
    counts = [sum(r["correct"]) for r in results]
    lengths = [length for r in results for length in r["lengths"]]
    finishes = [reason for r in results for reason in r["finish_reasons"]]
    return {
        "n": n,
        "k": k,
        "pass@1": sum(pass_at_k(k, c, 1) for c in counts) / n,
        "avg@k": sum(c / k for c in counts) / n,
        "pass@k": sum(pass_at_k(k, c, k) for c in counts) / n,
        "maj@k": sum(bool(r["voted_correct"]) for r in results) / n,
        "mean_length": sum(lengths) / len(lengths),
        "truncated": finishes.count("length") / len(finishes),
    }


# ----------------------------------------------------------------------------- generation

def _uses_plain_prompt(tokenizer, template):
    return template == "plain-question" or getattr(tokenizer, "chat_template", None) is None


def _cut_plain_continuation(text):
    """A base model prompted "Question: ...\\nAnswer:" often goes on to invent the next question;
    the response ends where that starts (else its "Answer:" line would be taken as the answer)."""
    match = re.search(r"\n\s*Question:", text)
    return text[:match.start()] if match else text


def evaluate(model, tokenizer, records, *, k=1, temperature=0.0, top_p=1.0, top_k=0,
             max_new_tokens=256, template="dapo", batch_size=None, seed=0, stop_ids=None,
             progress=True):
    """Samples k responses per record and scores them -> (summary dict, per-problem list).

    model: a model.Transformer (a DDP wrapper is unwrapped), used as it is (never reloaded; its
    train/eval mode is restored afterwards). records: data.load_records records. batch_size:
    prompts per generate call (default: DEFAULT_ROWS // k, at least 1). stop_ids: default
    `rollout.stop_token_ids(tokenizer)`. The summary holds n, k, pass@1, avg@k, pass@k, maj@k,
    mean_length, truncated, temperature, top_p, max_new_tokens, template, seconds, tokens_per_s;
    the per-problem list follows the order of `records`.
    """
    if not records:
        raise ValueError("evaluate: no records")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"evaluate: k must be an integer >= 1, got {k!r}")
    if temperature < 0:
        raise ValueError(f"evaluate: temperature must be >= 0, got {temperature}")
    if temperature == 0 and k > 1:
        raise ValueError(f"evaluate: k={k} greedy samples would all be the same; use a "
                         "temperature > 0 with k > 1")
    model = getattr(model, "module", model)
    stop_ids = rollout.stop_token_ids(tokenizer) if stop_ids is None else list(stop_ids)
    batch_size = batch_size or max(1, DEFAULT_ROWS // k)
    plain = _uses_plain_prompt(tokenizer, template)
    prompts = [data.format_prompt(record, tokenizer, template) for record in records]
    order = sorted(range(len(records)), key=lambda i: len(prompts[i]))  # similar lengths together
    results = [None] * len(records)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(records), desc="eval", unit="problem", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    solved, generated = 0, 0
    start = time.perf_counter()
    try:
        for batch_index, at in enumerate(range(0, len(order), batch_size)):
            indices = order[at:at + batch_size]
            completions = rollout.generate(
                model, [prompts[i] for i in indices], num_samples=k, max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_ids,
                seed=seed * 1_000_003 + batch_index)  # prompt-major: prompt j's k samples at j*k
            for j, i in enumerate(indices):
                samples = completions[j * k:(j + 1) * k]
                results[i] = _score(records[i], prompts[i], samples, tokenizer, plain)
                solved += sum(results[i]["correct"])
                generated += sum(results[i]["lengths"])
            bar.update(len(indices))
            bar.set_postfix(avg=f"{solved / (k * (at + len(indices))):.3f}")
    finally:
        bar.close()
        model.train(was_training)
    seconds = time.perf_counter() - start
    summary = summarize(results, k)
    summary.update(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                   template=template, seed=seed, seconds=seconds,
                   tokens_per_s=generated / seconds if seconds > 0 else None)
    return summary, results


def _score(record, prompt_ids, samples, tokenizer, plain):
    responses = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in samples]
    if plain:
        responses = [_cut_plain_continuation(text) for text in responses]
    extracted = [verify.extract_answer(text) for text in responses]
    voted, votes = majority_vote(extracted)
    return {
        "id": record["id"],
        "problem": record["prompt"],
        "prompt": tokenizer.decode(prompt_ids),
        "answer": record["answer"],
        "responses": responses,
        "extracted": extracted,
        "correct": [verify.is_correct(text, record["answer"]) for text in responses],
        "lengths": [len(c.tokens) for c in samples],
        "finish_reasons": [c.finish_reason for c in samples],
        "voted": voted,
        "votes": votes,
        "voted_correct": verify.answers_equal(voted, record["answer"]),
    }


# ----------------------------------------------------------------------------- command line

def default_template(data_name):
    """"none" (the bare question) for the synthetic arithmetic task, "dapo" for everything else."""
    return "none" if str(data_name).split(":", 1)[0] == "arithmetic" else "dapo"


def default_max_new_tokens(data_name):
    """256 for the synthetic task (the untrained model's answers run up to ~100 tokens), 1024 for
    real benchmarks."""
    return 256 if str(data_name).split(":", 1)[0] == "arithmetic" else 1024


def default_out_path(data_name):
    """eval-<data>-<YYYYmmdd-HHMMSS>.jsonl in the current directory (a file's folder and stem name it)."""
    name = str(data_name)
    if os.path.isfile(name):
        folder = os.path.basename(os.path.dirname(os.path.abspath(name)))
        name = f"{folder}-{os.path.splitext(os.path.basename(name))[0]}"
    name = re.sub(r"[^A-Za-z0-9._=-]+", "-", name).strip("-") or "data"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, number = f"eval-{name}-{stamp}.jsonl", 1
    while os.path.exists(path):
        path, number = f"eval-{name}-{stamp}-{number}.jsonl", number + 1
    return path


def write_jsonl_atomic(path, rows):
    """One JSON object per line, to a temporary file in the same folder, then renamed onto `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".eval-", suffix=".tmp", dir=folder)
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
                      help="gsm8k, math500, aime24, dapo-math-17k, arithmetic[:key=value,...] or a "
                           "local .jsonl/.json/.parquet file (default: arithmetic)")
    what.add_argument("--split", default="test",
                      help="dataset split; for arithmetic, 'test' is the fixed held-out set "
                           "(default: test; math500 and aime24 have one split and ignore it)")
    what.add_argument("--limit", type=_int_at_least(1), default=None,
                      help="evaluate the first N problems (default: all; arithmetic: 200)")
    what.add_argument("--template", choices=data.TEMPLATES, default=None,
                      help="prompt template (default: 'none', the bare question, for arithmetic; "
                           "'dapo' otherwise)")
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
                          help="response budget in tokens (default: 256 for arithmetic, 1024 "
                               "otherwise)")
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
                          "eval-<data>-<YYYYmmdd-HHMMSS>.jsonl in the current directory); never "
                          "the --data file, and an existing file only with --overwrite")
    run.add_argument("--overwrite", action="store_true", help="let --out replace an existing file")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


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
    args.out = args.out or default_out_path(args.data)
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


def load_eval_records(parser, args):
    """--data's records, before the model loads; a bad name or file is a usage error."""
    looks_like_path = os.sep in args.data or args.data.endswith(data.FILE_EXTENSIONS)
    if looks_like_path and not os.path.exists(args.data):
        parser.error(f"argument --data: no such file: {args.data}")
    try:
        records = data.load_records(args.data, split=args.split, limit=args.limit)
    except data.DataError as error:
        parser.error(f"argument --data: {error}")
    if args.limit is not None and len(records) < args.limit:
        print(f"eval.py: note: {args.data} has only {len(records)} problems (--limit {args.limit})",
              file=sys.stderr)
    return records


def main(argv=None):
    parser, args = parse_args(argv)
    template = args.template or default_template(args.data)
    max_new_tokens = args.max_new_tokens or default_max_new_tokens(args.data)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        parser.error(f"argument --device: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device}: CUDA is not available on this machine")
    dtype = resolve_dtype(args.dtype, device)

    records = load_eval_records(parser, args)  # first: a bad name or file fails in a second

    load_start = time.perf_counter()
    try:
        model, tokenizer = checkpoints.load_model(args.model, dtype=dtype, device=device)
    except (OSError, ValueError) as error:
        parser.error(f"argument --model: {error}")
    load_seconds = time.perf_counter() - load_start
    if max_new_tokens >= model.config.max_seq_len:
        parser.error(f"argument --max-new-tokens: {max_new_tokens} leaves no room for a prompt in "
                     f"the model's context of {model.config.max_seq_len} tokens")
    try:  # every prompt must leave room for the response inside the model's context
        data.validate_records(records, args.data, tokenizer=tokenizer, template=template,
                              max_prompt_tokens=model.config.max_seq_len - max_new_tokens)
    except data.DataError as error:
        parser.error(f"argument --data: {error} (the model's context is {model.config.max_seq_len} "
                     f"tokens, {max_new_tokens} of them kept for the response by --max-new-tokens)")

    summary, results = evaluate(
        model, tokenizer, records, k=args.k, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, max_new_tokens=max_new_tokens, template=template,
        batch_size=args.batch_size, seed=args.seed, progress=not args.quiet)
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
