"""Evaluation of a model on any task train.py trains on: pass@1, avg@k, pass@k, maj@k, response
length. eval.py is its command line; train.py's held-out evaluation calls `evaluate` too, so a
checkpoint gets the same numbers from both.

How one evaluation runs (`evaluate`):
1. Each record is an episode (episodes.py): a math problem one turn, a memory diary a turn a page.
   Records are sorted by the length of their first prompt (less padding) and played in batches of
   `batch_size` records x k episodes with episodes.play (rollout.generate, turn by turn).
2. Each episode's last reply, where its answer is, is scored with verify.is_correct; a reply to
   a plain prompt (no chat template, or the plain-question template) is cut where the model
   starts inventing the next "Question:". Sampled episodes are seeded per record from `seed` and
   its batch's index: the same settings (batch size included) give the same samples.

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
- mean_length: generated tokens per turn (the stop token included); truncated: the fraction of
  turns that hit the token budget without a stop token. (One-turn tasks: per response.)
"""

import functools
import math
import re
import sys
import time

from tqdm import tqdm

import data
import rewards
import rollout
from engine.paged import EngineOptions
from engine.speedups import SpeedUps
from run import config, runs
from run.distributed import gather
from tasks import episodes, verify

DEFAULT_ROWS = 64  # records x samples per generate call when batch_size is not given


# ---- metrics -------------------------------------------------------------------------------------

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


# ---- playing and scoring -------------------------------------------------------------------------

def _cut_plain_continuation(text):
    """A base model prompted "Question: ...\\nAnswer:" often goes on to invent the next question;
    the response ends where that starts (else its "Answer:" line would be taken as the answer)."""
    match = re.search(r"\n\s*Question:", text)
    return text[:match.start()] if match else text


def evaluate(model, tokenizer, records, *, k=1, temperature=0.0, top_p=1.0, top_k=0,
             max_new_tokens=256, template="dapo", batch_size=None, seed=0, stop_ids=None,
             compile=None, progress=True, ids=None, judge=None, tools=()):
    """Plays k episodes of each record and scores each one's last reply -> (summary dict,
    per-problem list).

    model: a model.Transformer (a DDP wrapper is unwrapped), used as it is (never reloaded; its
    train/eval mode is restored afterwards). records: data.load_records records, or a task's
    held-out records (arithmetic, memory). max_new_tokens: per turn. batch_size: records per
    sampler call (default: DEFAULT_ROWS // k, at least 1). stop_ids: default
    `rollout.stop_token_ids(tokenizer)`. compile: SpeedUps' (engine/speedups.py). The summary holds n, k,
    pass@1, avg@k, pass@k, maj@k, mean_length, truncated, temperature, top_p, max_new_tokens,
    template, seconds, tokens_per_s; the per-problem list follows the order of `records`.
    ids: each record's index in the whole held-out list (default 0, 1, ...), its samples' seed:
    a problem's samples do not depend on the others beside it, so a rank's share of the records
    gives the rows one process would (train.py evaluates that way, evaluate_and_log).
    judge: judge(reply, record) -> bool in verify.is_correct's place (a run's --reward, a task's own).
    tools: the tools the model may call (episodes.play).
    """
    _check_settings(records, k, temperature)
    model = getattr(model, "module", model)
    sampling = rollout.Sampling(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_token_ids=rollout.stop_token_ids(tokenizer) if stop_ids is None else list(stop_ids))
    engine = EngineOptions(speed=SpeedUps(compile=compile))
    batch_size = batch_size or max(1, DEFAULT_ROWS // k)
    ids = list(range(len(records))) if ids is None else list(ids)
    plain = data.is_plain_prompt(tokenizer, template)
    first_prompts = [data.format_prompt(episodes.next_turn(record, 0, tools=tools), tokenizer, template)
                     for record in records]
    order = sorted(range(len(records)), key=lambda i: len(first_prompts[i]))  # similar lengths together
    results = [None] * len(records)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(records), desc="eval", unit="problem", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    solved, generated = 0, 0
    start = time.perf_counter()
    try:
        for at in range(0, len(order), batch_size):
            indices = order[at:at + batch_size]
            played = episodes.play(model, tokenizer, [records[i] for i in indices], k,
                                   [seed * 1_000_003 + ids[i] for i in indices], template=template,
                                   tools=tools, sampling=sampling, engine=engine)
            for j, i in enumerate(indices):  # prompt-major: record j's k episodes at j*k
                results[i] = _score(records[i], played[j * k:(j + 1) * k], tokenizer, plain, judge)
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


def _check_settings(records, k, temperature):
    """evaluate's arguments, a ValueError naming the bad one."""
    if not records:
        raise ValueError("evaluate: no records")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"evaluate: k must be an integer >= 1, got {k!r}")
    if temperature < 0:
        raise ValueError(f"evaluate: temperature must be >= 0, got {temperature}")
    if temperature == 0 and k > 1:
        raise ValueError(f"evaluate: k={k} greedy samples would all be the same; use a "
                         "temperature > 0 with k > 1")


def _score(record, played, tokenizer, plain, judge=None):
    """One record's k episodes (lists of episodes.Turn) -> its per-problem row. Lengths and
    finish reasons are per turn; `turns` counts each episode's; a task in turns adds every
    episode's replies (`transcripts`: the memory it wrote, page by page). A judge decides each
    reply, and the vote by the first reply that gave the voted answer."""
    responses = [episode[-1].text for episode in played]  # the last reply holds the answer
    if plain:
        responses = [_cut_plain_continuation(text) for text in responses]
    extracted = [verify.extract_answer(text) for text in responses]
    voted, votes = majority_vote(extracted)
    correct = [judge(text, record) if judge else verify.is_correct(text, record["answer"])
               for text in responses]
    voted_correct = verify.answers_equal(voted, record["answer"]) if not judge else \
        voted is not None and correct[extracted.index(voted)]
    row = {
        "id": record["id"],
        "problem": record["prompt"],
        "prompt": tokenizer.decode(played[0][0].prompt),  # the first turn's
        "answer": record["answer"],
        "responses": responses,
        "extracted": extracted,
        "correct": correct,
        "lengths": [len(turn.completion.tokens) for episode in played for turn in episode],
        "finish_reasons": [turn.completion.finish_reason for episode in played for turn in episode],
        "turns": [len(episode) for episode in played],
        "voted": voted,
        "votes": votes,
        "voted_correct": voted_correct,
    }
    if "pages" in record:
        row["transcripts"] = [[turn.text for turn in episode] for episode in played]
    return row


def evaluate_and_log(run, progress):
    """Held-out accuracy, greedy (and avg@k with --eval-samples), into eval.jsonl: eval.py's
    evaluation (evaluation.evaluate), on the sampler copy. Every rank calls it and plays its share
    of the problems (every world-th); rank 0 gathers the rows, and its summary is the one a single
    process would give (each problem's samples are seeded by its index). -> the summary"""
    args, started = run.args, time.perf_counter()
    settings = dict(max_new_tokens=args.max_new_tokens, template=args.template, stop_ids=run.stop_ids,
                    compile=config.compile_choice(args), progress=False, tools=config.tool_names(args),
                    judge=functools.partial(
                        rewards.judged_right, run.reward_function, correct=args.correct_reward)
                    if run.reward_function else None)
    mine = list(range(run.rank, len(run.heldout), run.world))
    greedy = held_out_rows(run, mine, settings)
    result = {key: summarize(greedy, 1)[key] for key in ("pass@1", "n", "mean_length", "truncated")}
    if args.eval_samples:
        sampled = held_out_rows(run, mine, dict(settings, k=args.eval_samples, temperature=args.eval_temperature,
                                                top_p=args.eval_top_p))
        result.update({"avg@k": summarize(sampled, args.eval_samples)["avg@k"], "k": args.eval_samples})
    if run.rank == 0:
        avg_text = f", avg@{args.eval_samples} {result['avg@k']:.3f}" if args.eval_samples else ""
        ranks = f" over {run.world} ranks" if run.world > 1 else ""
        print(f"step {progress.step}: held-out accuracy {result['pass@1']:.3f}{avg_text} on {result['n']} "
              f"problems{ranks} ({time.perf_counter() - started:.0f} s)", flush=True)
        row = {"step": progress.step, "train_seconds": progress.train_seconds, **result}
        runs.append_log(args.out, "eval.jsonl", row)
        run.tracker.log(row, progress.step, prefix="eval/")
    return result


def held_out_rows(run, mine, settings):
    """The per-problem rows of the held-out problems `mine` (indices), played on this rank, then
    every rank's gathered -> all rows in the held-out order."""
    records = [run.heldout[i] for i in mine]
    rows = evaluate(run.sampler, run.tokenizer, records, ids=mine, **settings)[1] if records else []
    ordered = [None] * len(run.heldout)
    for indices, part in zip(gather(mine, run.world), gather(rows, run.world)):
        for i, row in zip(indices, part):
            ordered[i] = row
    return ordered
