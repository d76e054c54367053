"""Dynamic sampling's rounds (DAPO's change 2, eq. 11): a step samples a round of prompts, keeps
the groups with 0 < #correct < G, and samples another round while the batch is short, up to
--max-refills more. Each round's prompts and seeds are fixed by its place (`round_prompts`), so
whether the rounds run one after another (`rounds_in_turn`) or join one running queue as soon as
they are certainly needed (`rounds_in_one_queue`, one long tail a step instead of one a round),
a step samples the same completions. train.collect_rollouts calls them. Beside them, what a
round's prompts may add: harder (or hinted) variants of the prompts without a signal
(--adversarial) and a number of samples by each prompt's accuracy so far (--adaptive-budget).
"""

import random
from dataclasses import replace

import dapo
import data
import rollout
from run import config
from run.distributed import gather
from tasks import episodes


def with_signal(batch):
    """(groups,) whether each group carries a learning signal, 0 < #correct < G (eq. 11)."""
    return dapo.keep_groups(dapo.task_scores(batch.reward_parts, batch.correct),
                            batch.group_sizes).tolist()


def round_prompts(run, progress, round_index, requests, want):
    """A round's prompts: the adversarial variants asked (`requests`) first, then fresh ones
    from the stream. A seed per prompt from its place, unique over ranks: a fresh prompt's
    global position in the stream (so without refills the samples do not depend on the number
    of ranks; one batch on, as the runs in the README were seeded), a variant's rank and index.
    -> records, samples per record, seed per record"""
    args = run.args
    count = max(want - len(requests), 0)
    places = [f"v{run.rank}.{i}" for i in range(len(requests))] + [
        str(run.stream.position(i) + args.prompts_per_step) for i in range(count)]
    records = requests + run.stream.take(count)  # only what is asked: none skipped
    seeds = [random.Random(f"{args.seed}:{progress.step}:{round_index}:{place}").getrandbits(62)
             for place in places]
    counts = adaptive_budget(args, progress, records) if args.adaptive_budget \
        else [args.samples] * len(records)
    return records, counts, seeds


def adaptive_budget(args, progress, records):
    """--adaptive-budget: each prompt's number of samples from its accuracy so far (hard prompts
    more, easy ones fewer), the round's total unchanged."""
    return dapo.adaptive_num_samples([progress.prompt_accuracy.get(r["id"]) for r in records],
                                     total=len(records) * args.samples, min_samples=2,
                                     max_samples=2 * args.samples)


def harder_variants(run, batch):
    """--adversarial: harder (or hinted) variants of the round's signal-less prompts, asked first
    in the next round."""
    return data.adversarial_variants(
        batch.records, dapo.adversarial_requests(batch.correct, batch.group_sizes), run.variant_rng,
        run.tokenizer, run.args.template,
        max_prompt_tokens=run.policy.config.max_seq_len - run.args.max_new_tokens)


def shared_prompt_accuracy(run, progress, sampled):
    """Every rank's prompt accuracies of this step folded into one running table, the same on
    every rank (the adaptive budget reads it; prompts move between ranks each epoch)."""
    seen = []
    for batch in sampled:
        firsts = set(batch.episode_starts())
        for record, start, size in zip(batch.records, batch.group_starts(), batch.group_sizes):
            outcomes = [batch.correct[i] for i in range(start, start + size) if i in firsts]
            seen.append((record["id"], sum(outcomes) / len(outcomes)))
    table = dict(progress.prompt_accuracy)
    for rank_seen in gather(seen, run.world):
        for prompt_id, accuracy in rank_seen:
            dapo.update_accuracy(table, prompt_id, accuracy)
    return table


def rounds_in_turn(run, progress, want, have, rounds, sample_and_reward):
    """The rounds one after another, each sampled whole (`sample_and_reward`, train.py's step 1)
    before the next is asked for: for --adversarial, which makes round r+1 of round r's groups,
    and for tasks in turns. `have`: groups already kept (carried).
    -> every round's Rollouts, variants asked"""
    sampled, requests, asked = [], [], 0
    for round_index in range(rounds):
        if have >= want:
            break
        batch = sample_and_reward(run, *round_prompts(run, progress, round_index, requests, want))
        sampled.append(batch)
        have += sum(with_signal(batch))
        last_round = round_index + 1 == rounds or have >= want
        requests = [] if last_round or not run.args.adversarial \
            else harder_variants(run, batch)
        asked += len(requests)
    return sampled, asked


def rounds_in_one_queue(run, progress, want, have, rounds, rewarded):
    """The rounds in one rollout.generate call, each group rewarded (`rewarded`, train.py's) as
    its last sample ends. Round r+1's prompts join the running queue as soon as it is certain to
    be needed: when the groups with a signal so far, plus every group still running, cannot fill
    the batch. That is exactly when rounds one after another would sample it (the same prompts,
    seeds and samples), but the step waits for one long tail, not one per round. `have`: groups
    already kept (carried). -> each round's groups, a Rollouts each"""
    if have >= want:
        return []
    args, queued, firsts, groups = run.args, [], [], {}  # (record, prompt)s; round starts; Rollouts
    signal = running = 0  # groups ended with a signal; groups not yet ended

    def next_round():
        nonlocal running
        records, counts, seeds = round_prompts(run, progress, len(firsts), [], want)
        prompts = [data.format_prompt(record, run.tokenizer, args.template) for record in records]
        firsts.append(len(queued))
        queued.extend(zip(records, prompts))
        running += len(records)
        return prompts, counts, seeds

    def on_group(index, completions):  # prompt `index` has all its samples: reward them
        nonlocal signal, running
        record, prompt = queued[index]
        groups[index] = group = rewarded(run, [record], [len(completions)], [prompt],
                                         [replace(c, prompt_index=0) for c in completions])
        signal, running = signal + with_signal(group)[0], running - 1
        if len(firsts) < rounds and have + signal + running < want:
            return next_round()

    prompts, counts, seeds = next_round()
    rollout.generate(run.sampler.eval(), prompts, num_samples=counts, on_group=on_group,
                     **config.sampling_options(args, run.stop_ids, seeds))
    ends = firsts[1:] + [len(queued)]
    return [[groups[i] for i in range(first, end)] for first, end in zip(firsts, ends)]


def takes_turns(run):
    """Whether this run's episodes may take several turns (--tools, or a task in turns)."""
    source = run.source
    return bool(run.args.tools) or isinstance(source, episodes.MemoryTask) or (
        isinstance(source, list) and any(episodes.in_turns(record) for record in source))
