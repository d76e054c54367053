"""Step 6 of a training step: its metrics, summed by name over the ranks in one call, as the
row train.py writes into metrics.jsonl (launch.log_step) and the trackers read.

Sums, not means, cross the ranks: a rank's accuracy over its own samples averaged with another's
would weight a rank with fewer samples as much. The row divides them once, by the global counts
(samples, turns, loss tokens, updates).
"""

import statistics

import dapo
from run import config
from run.distributed import gather, reduce_metrics
from variants import token_choice

REWARD_TERMS = ("correct", "extracted", "format", "format_ok", "integer", "xml_count", "overlong", "ppl",
                "efficiency")  # rewards.math_reward's components, and the efficiency bonus


def reward_terms(run):
    """The reward's parts logged as reward_<name>: the rule reward's terms, and with a reward
    function its failures (error) and its own parts."""
    return REWARD_TERMS + (("error", *run.reward_parts) if run.reward_function else ())


def sample_sums(run, done, lengths):
    """This rank's sums over every round's rollouts: outcomes once per episode, lengths per turn,
    the memory carried between turns, each reward part."""
    firsts = done.episode_starts()  # an episode's outcome, once
    # Turns followed by another turn of their episode: what they wrote is carried as memory.
    memories = [lengths[i] for i, turn in enumerate(done.turn or []) if i + 1 < len(lengths)
                and done.turn[i + 1] > 0]
    return {"samples": len(firsts), "correct": sum(done.correct[i] for i in firsts),
            "reward": sum(done.rewards[i] for i in firsts), "length": sum(lengths),
            "turns": len(lengths), "memory_tokens": sum(memories), "memories": len(memories),
            "truncated": sum(done.truncated),
            **{f"reward_{name}": sum(done.reward_parts[i].get(name, 0.0) for i in firsts)
               for name in reward_terms(run)}}


def update_means(args):
    """The policy-gradient metrics logged as means per loss token."""
    return ["clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean",
            "entropy"] + ["kl"] * (args.kl != "none") + ["tis_weight", "tis_cut_frac"] * bool(args.tis_cap) \
        + [token_choice.CHOICE_METRICS[name] for name in token_choice.token_choices(args)]


def step_metrics(run, progress, collected, done, update_sums, update_maxima, seconds):
    """Step 6: the step's metrics as named sums (and maxima) over all ranks; `done`: every
    round's rollouts together. -> the log row"""
    args, (kept, sampled, surplus, asked) = run.args, collected
    lengths = [len(t) for t in done.tokens]  # (N,) per turn
    sums = {**sample_sums(run, done, lengths), "ranks": 1, "adversarial_prompts": asked,
            "groups_sampled": sum(b.num_groups for b in sampled), "groups_kept": kept.num_groups,
            "groups_missing": args.prompts_per_step // run.world - kept.num_groups,
            "groups_carried": surplus.num_groups if surplus else 0,
            "groups_with_signal": int(dapo.keep_groups(dapo.task_scores(kept.reward_parts, kept.correct),
                                                    kept.group_sizes).sum()),
            "update_tokens": sum(len(p) + len(t) for p, t in zip(kept.prompts, kept.tokens)),
            **update_sums}
    # The largest context of a turn, prompt and completion: what a turn's budget must hold.
    context = max((len(p) + len(t) for p, t in zip(done.prompts, done.tokens)), default=0)
    total = reduce_metrics(sums, {"rounds": len(sampled), "context_max": context, **update_maxima})
    ranks, n, turns = total["ranks"], max(1.0, total["samples"]), max(1.0, total["turns"])
    updates = total.get("updates", 0.0) / ranks
    applied = updates - total.get("skipped_updates", 0.0) / ranks
    tokens = total.get("loss_tokens", 0.0)  # policy-gradient loss tokens (none under DPO)
    row = {"step": progress.step + 1, "updates": progress.updates + int(applied),
           "lr": run.optimizer.param_groups[0]["lr"], "level": getattr(run.source, "level", None),
           "reward": total["reward"] / n, "accuracy": total["correct"] / n,
           **{f"reward_{name}": total[f"reward_{name}"] / n for name in reward_terms(run)},
           "response_length": total["length"] / turns, "truncated": total["truncated"] / turns,
           "response_length_median": statistics.median(sum(gather(lengths, run.world), []) or [0]),
           "turns_per_episode": total["turns"] / n,
           "memory_length": total["memory_tokens"] / max(1.0, total["memories"]),
           "context_max": int(total["context_max"]),
           **{name: int(total[name]) for name in ("groups_sampled", "groups_kept", "groups_missing",
                                                   "groups_carried", "groups_with_signal",
                                                   "adversarial_prompts")},
           "groups_kept_per_rank": gather(kept.num_groups, run.world), "rounds": int(total["rounds"]),
           # None when no update had a policy-gradient loss token (DPO, or every group dropped)
           **{name: total.get(name, 0.0) / tokens if tokens else None for name in update_means(args)},
           "ratio_max": total.get("ratio_max"),
           "peak_memory_mib": total["peak_memory_mib"],  # the largest over ranks
           "sampler_trainer_mismatch": total.get("mismatch", 0.0) / max(1.0, total.get("mismatch_tokens", 0.0)),
           "grad_norm": total.get("grad_norm", 0.0) / max(1.0, applied * ranks),
           "skipped_updates": int(updates - applied), "empty_updates": int(total.get("empty_updates", 0) / ranks),
           "skipped_updates_total": progress.skipped_updates + int(updates - applied)}
    if args.tis_reject:  # the share of would-be loss tokens the rejection rule took out
        rejected = total.get("tis_rejected", 0.0)
        row["tis_rejected_frac"] = rejected / max(1.0, tokens + rejected)
    if "router_aux_batches" in total:  # an MoE policy
        row["router_aux_loss"] = total["router_aux_loss"] / max(1.0, total["router_aux_batches"])
    if args.algo == "dpo":
        row.update(pairs=int(total.get("pairs", 0)), **{name: total[name] / max(1.0, total["pairs"])
                                                       for name in total if name.startswith("dpo_")})
    for stage in ("rollout", "scoring", "update", "refresh"):
        row[f"seconds_{stage}"] = seconds[stage]
    row["tokens_per_second_rollout"] = total["length"] / ranks / max(seconds["rollout"], 1e-9)
    # DPO reads its pairs only, not every kept sample, and scores no old log-probs.
    trained = total.get("pair_tokens", 0.0) if args.algo == "dpo" else total["update_tokens"]
    row["tokens_per_second_update"] = trained / ranks / max(seconds["update"], 1e-9)
    scored = (total.get("updates", 0.0) + total.get("empty_updates", 0.0)) / ranks > 1 or config.reads_old_logprobs(args)
    row["tokens_per_second_scoring"] = (total["update_tokens"] / ranks / max(seconds["scoring"], 1e-9)
                                        if scored and args.algo != "dpo" else None)  # step 3 ran
    return row


class Watch:
    """Warnings that save a silent run (the failure users report most: a run that learns nothing
    while its numbers are logged all the same). Each is said once, on the console and in that
    step's metrics.jsonl row ("warnings"), when its condition holds STEPS steps in a row."""
    STEPS = 3

    def __init__(self, args, expects, history=()):
        """history: the rows logged before a --resume, replayed in silence, so that a resumed run
        warns where the run straight through would."""
        self.args, self.expects = args, expects  # expects: the answer the reward reads, in words
        self.streaks, self.said, self.updates = {}, set(), 0  # updates: made by the last row
        for row in history:
            self.check(row, [])

    def check(self, row, examples):
        """The warnings this step's row (and its sample lines) completes. -> list of str"""
        holds = {"truncated": row.get("truncated", 0) > 0.5,  # (an SFT step samples nothing)
                 "no_signal": row.get("groups_with_signal") == 0,
                 "no_answer": row.get("reward_extracted", 1.0) == 0 and not self.args.reward,
                 # every update of the step skipped: some, and the count made did not move
                 "skipped": row.get("skipped_updates", 0) > 0 and row.get("updates") == self.updates}
        self.updates = row.get("updates", self.updates)
        out = []
        for name, now in holds.items():
            self.streaks[name] = self.streaks.get(name, 0) + 1 if now else 0
            if self.streaks[name] >= self.STEPS and name not in self.said:
                self.said.add(name)
                out.append(self.text(name, row, examples))
        return out

    def text(self, name, row, examples):
        args, steps = self.args, f"for {self.STEPS} steps in a row"
        if name == "truncated":
            return (f"more than half the replies ran out of --max-new-tokens {args.max_new_tokens} "
                    f"{steps} (median length {row['response_length_median']:g}): a cut reply has no "
                    "answer to reward; raise --max-new-tokens")
        if name == "no_signal":
            cold = f"the temperature ({args.temperature:g}) is too low for replies to differ; " \
                if args.temperature < 1 else ""
            return (f"no group had a learning signal {steps} (every reply to a prompt scored the "
                    f"same, so every advantage is 0). Likely causes: the template ({args.template}) "
                    f"is not the model's chat format; the replies do not give {self.expects}; "
                    f"{cold}the task is too hard or too easy for the model")
        if name == "skipped":
            rewards = "" if args.algo == "sft" else (  # (an SFT step has no rewards)
                f"rewards too large to add up (see reward in metrics.jsonl; --correct-reward "
                f"{args.correct_reward:g} and --wrong-reward {args.wrong_reward:g} set the rule "
                f"reward's), or ")
            return (f"every update was skipped {steps} (a non-finite loss or gradient): the model "
                    f"has not changed since. Likely causes: {rewards}--lr {args.lr:g} too high")
        one = next((line["completion"] for line in examples), None)
        return (f"no reply gave an answer the reward can read {steps}: it wants {self.expects}"
                + (f"; one reply: {one[:200]!r}" if one is not None else ""))
