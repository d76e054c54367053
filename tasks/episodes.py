"""Episodes: what the model is shown turn by turn, and when it is done.

    python train.py --preset dapo-memory           # recall over a 3-page diary, on a CPU
    python train.py --preset dapo-memory --data memory:pages=3,max=9,filler=2,ask=first,memory=off

One function is the whole interface: `next_turn(record, turn, last_text)` gives the record that
data.format_prompt turns into turn `turn`'s prompt (`last_text`: what the model wrote at turn - 1),
or None when the episode is over; the episode's reward scores the last text against
record["answer"] (rewards.math_reward), and that one outcome is every turn's reward. A plain
math record is an episode of one turn, so train.py has one loop for both.

The memory task (MemoryTask) is a long task in turns, as in the agents that read a document too
long for one context in pieces and keep notes: a shop's diary of several pages, one page a turn,
and a question on the whole diary: how many apples were sold in all (`ask=total`), or on day 1
(`ask=first`, the default preset's). Every page holds one sale among filler sentences. A turn's
prompt holds the instructions, the memory the model wrote at the turn before (its reply opens
with "Memory:"; the last such line counts) and the next page, never an earlier page: what the
answer needs must travel in the memory. The reply to the last page opens with "Answer:", and
the episode ends there (or earlier, at a reply with an "Answer:" line). With `memory=off` the
memory line is left out of the next prompt (the model still writes one): the control that shows
the memory is what is learned, since the last page alone holds neither answer.
"""

import random
import re
from dataclasses import dataclass, replace

import dapo
import data
import rewards
from rollout import Completion, Sampling, generate
from run import config
from tasks import tools as tool_calls

# What each question asks (MemoryTask's `ask`): the total over every page, or the first page's
# sale (recall: the memory must be written at page 1 and kept past the pages after it).
QUESTIONS = {
    "total": "How many apples did the shop sell in all?",
    "first": "How many apples did the shop sell on day 1?",
}
ONE_PAGE_AT_A_TIME = "You read a shop's diary one page at a time and never see a page again."
INSTRUCTIONS = {
    "total": f"{ONE_PAGE_AT_A_TIME} Keep the running total of apples sold in your memory.",
    "first": f"{ONE_PAGE_AT_A_TIME} Keep what you need in your memory.",
}
ASK_MEMORY = {
    "total": "Add this page's apples to the total in your memory. Reply with one line: Memory: <new total>",
    "first": "Reply with one line: Memory: <what you need to remember>",
}
ASK_ANSWER = {
    "total": "This was the last page. Reply with one line: Answer: <total apples sold>",
    "first": "This was the last page. Reply with one line: Answer: <apples sold on day 1>",
}
FILLER = ["It rained in the morning.", "The baker came by for coffee.", "A cat slept on the step.",
          "The shelves were dusted.", "Two children asked for the way.", "The radio played old songs.",
          "A delivery van was late.", "The window was cleaned.", "The owner wrote a letter.",
          "The street was quiet after lunch.", "A dog barked at the door.", "The lights flickered."]
MEMORY_LINE = re.compile(r"^[ \t]*\**memory\**[ \t]*:[ \t]*(.*?)[ \t]*$", re.IGNORECASE | re.MULTILINE)
ANSWER_LINE = re.compile(r"^[ \t]*\**answer\**[ \t]*:", re.IGNORECASE | re.MULTILINE)


def in_turns(record):
    """Whether `record` is a task in turns (its episodes go through `play`); else one turn."""
    return "pages" in record


def next_turn(record, turn, last_text=None, tools=()):
    """The record whose prompt the model sees at turn `turn` (0-based) of `record`'s episode, or
    None when the episode has ended: a one-turn record after its turn, unless that turn ended in
    a call of one of `tools` (tools.py): then the same record again, the transcript so far and
    the tool's output opening the reply (at most tools.MAX_CALLS calls); a memory record after
    its last page, or as soon as a turn writes an "Answer:" line (it answered early)."""
    if not in_turns(record):
        if turn == 0 or not tools:
            return with_tools(record, tools) if turn == 0 else None
        call = tool_calls.last_call(last_text, tools) if turn <= tool_calls.MAX_CALLS else None
        return None if call is None else {**with_tools(record, tools), "reply_prefix":
                                          f"{last_text}\n<result>{tool_calls.run_tool(*call)}</result>\n"}
    if turn == len(record["pages"]) or (turn > 0 and ANSWER_LINE.search(last_text)):
        return None
    memory = (read_memory(last_text) or "") if turn > 0 and record["memory"] else None
    last = turn == len(record["pages"]) - 1
    return {"id": f"{record['id']}:turn{turn}", "answer": record["answer"],
            "prompt": page_prompt(record, turn, memory),
            "reply_prefix": "Answer:" if last else "Memory:"}


def with_tools(record, tools):
    """`record` with a word on how to call each of `tools` after its question."""
    if not tools:
        return record
    note = "\n\n" + " ".join(tool_calls.INSTRUCTIONS[name] for name in tools)
    if "messages" not in record:
        return {**record, "prompt": record["prompt"] + note}
    messages = [dict(m) for m in record["messages"]]
    [m for m in messages if m["role"] == "user"][-1]["content"] += note
    return {**record, "messages": messages}


@dataclass(frozen=True)
class Turn:
    """One turn of an episode: the prompt it was shown and what the model wrote."""
    prompt: list             # token ids
    completion: Completion   # tokens, the sampler's log-probs, finish_reason
    text: str                # the completion decoded


def play(model, tokenizer, records, num_samples, seeds, *, template, tools=(), sampling=Sampling(),
         **options):
    """num_samples[i] episodes of records[i] (prompt-major), turn by turn: one rollout.generate
    call per turn over the episodes still going (an episode that ends leaves the batch); with
    `tools`, a reply is cut after its first call (tools.cut_at_call). seeds: an int or one per
    record (in sampling's place); `sampling`: generate's (max_new_tokens is per turn); `options`:
    generate's other keywords (engine, record_routing).
    -> per episode, its list of Turn"""
    counts = [num_samples] * len(records) if isinstance(num_samples, int) else list(num_samples)
    if isinstance(seeds, int):  # as generate reads an int seed
        seeds = [seeds * 1_000_003 + r for r in range(len(records))]
    owner = [r for r, n in enumerate(counts) for _ in range(n)]  # (N,) the record of each episode
    sample = [k for n in counts for k in range(n)]                 # (N,) which of its G it is
    turns = [[] for _ in owner]
    # Turn 0 shows each record's first prompt to its G episodes: one prefill per record.
    shown = {i: next_turn(records[r], 0, tools=tools) for i, r in enumerate(owner)}  # episode i's
    first = [data.format_prompt(next_turn(r, 0, tools=tools), tokenizer, template) for r in records]
    completions = generate(model, first, replace(sampling, seed=seeds), num_samples=counts,
                           **options)
    turn, going, prompts = 0, list(range(len(owner))), [first[r] for r in owner]
    context = getattr(getattr(model, "config", None), "max_seq_len", float("inf"))
    while True:
        for i, prompt, completion in zip(going, prompts, completions):
            completion = tool_calls.cut_at_call(completion, tokenizer, tools) if tools else completion
            text = shown[i].get("reply_prefix", "") + \
                tokenizer.decode(completion.tokens, skip_special_tokens=True)
            turns[i].append(Turn(prompt, completion, text))
        turn += 1
        shown = {i: next_turn(records[owner[i]], turn, turns[i][-1].text, tools) for i in going}
        prompts = {i: data.format_prompt(shown[i], tokenizer, template) for i in going if shown[i]}
        # A next turn that would not leave room for its reply ends the episode where it is.
        going = [i for i in prompts if len(prompts[i]) + sampling.max_new_tokens <= context]
        if not going:
            return turns
        prompts = [prompts[i] for i in going]
        # A seed per episode and turn: its samples do not depend on which others still run.
        turn_seeds = [random.Random(f"{seeds[owner[i]]}:{sample[i]}:{turn}").getrandbits(62)
                      for i in going]
        completions = generate(model, prompts, replace(sampling, seed=turn_seeds), **options)


def play_and_reward(model, tokenizer, records, num_samples, seeds, args, stop_ids, reward_function=None):
    """Step 1 of a training step for a task in turns: num_samples[i] episodes of records[i],
    each rewarded by its last turn's answer; that outcome, with every turn's length and
    perplexity terms (change 4 applies per turn), is the reward of all its turns.
    -> train.Rollouts' fields, a row per turn (episode-major)"""
    played = play(model, tokenizer, records, num_samples, seeds, template=args.template,
                  tools=config.tool_names(args), **config.sampling_options(args, stop_ids))
    group = [g for g, n in enumerate(num_samples) for _ in range(n)]  # (E,) prompt of each episode
    scored = [rewards.task_reward(turns[-1].text, records[g], function=reward_function,
                                  **config.reward_options(args, turns[-1].completion))
              for turns, g in zip(played, group)]
    per_turn = [[rewards.shaping(**config.shaping_options(args, t.completion)) for t in turns[:-1]]
                for turns in played]  # the earlier turns' own terms (the last turn's are scored)
    earlier = [{name: sum(terms[name] for terms in turns) for name in ("overlong", "ppl")}
               for turns in per_turn]  # (E,)
    correct = [parts["accuracy"] > 0 for _, parts in scored]
    bonus = [0.0] * len(played)
    if args.efficiency_weight:  # balanced reasoning: short right answers score a little more
        lengths = [sum(len(t.completion.tokens) for t in turns) for turns in played]
        bonus = dapo.efficiency_bonus(correct, lengths, num_samples, args.efficiency_weight).tolist()
    episode_rewards = [r + e["overlong"] + e["ppl"] + b for (r, _), e, b in zip(scored, earlier, bonus)]
    parts = [{**p, "overlong": p["overlong"] + e["overlong"], "ppl": p["ppl"] + e["ppl"],
              "efficiency": b} for (_, p), e, b in zip(scored, earlier, bonus)]
    rows = [(e, turn) for e, turns in enumerate(played) for turn in turns]  # (N,) episode-major
    rows_per_group = [0] * len(records)
    for g, turns in zip(group, played):
        rows_per_group[g] += len(turns)
    return dict(records=list(records), group_sizes=rows_per_group,
                prompts=[turn.prompt for _, turn in rows],
                tokens=[turn.completion.tokens for _, turn in rows],
                sampler_logprobs=[turn.completion.logprobs for _, turn in rows],
                truncated=[turn.completion.finish_reason == "length" for _, turn in rows],
                rewards=[episode_rewards[e] for e, _ in rows], correct=[correct[e] for e, _ in rows],
                reward_parts=[parts[e] for e, _ in rows], stale=[False] * len(rows),
                turn=[t for turns in played for t in range(len(turns))],
                routing=[turn.completion.routing for _, turn in rows] if args.routing_replay else None)


def read_memory(text):
    """The content of the last "Memory: ..." line of `text`, or None if it has none."""
    found = MEMORY_LINE.findall(text or "")
    return found[-1] if found else None


def page_prompt(record, turn, memory):
    """Instructions, the memory (unless None: the first page, or the no-memory control), page
    `turn` and what to write."""
    pages, ask = record["pages"], record["ask"]
    lines = [record["prompt"], INSTRUCTIONS[ask]]
    if turn > 0 and memory is not None:
        lines.append(f"Memory: {memory}")
    lines += [f"Page {turn + 1} of {len(pages)}: {pages[turn]}",
              ASK_ANSWER[ask] if turn == len(pages) - 1 else ASK_MEMORY[ask]]
    return "\n".join(lines)


class MemoryTask:
    """Seeded diaries of `pages` pages, `filler` sentences and one sale of min..max apples on
    each, with a fixed held-out quarter (by the sales, as the arithmetic task's split).
    Spec: `memory` or `memory:pages=4,min=1,max=9,filler=2,memory=off,ask=first`."""

    SPEC_KEYS = ("pages", "min", "max", "filler", "memory", "ask")

    def __init__(self, pages=3, min_value=1, max_value=9, filler=2, memory=True, ask="total"):
        if pages < 2:
            raise data.DataError(f"memory: pages must be at least 2, got {pages}")
        if not 0 <= min_value <= max_value:
            raise data.DataError(f"memory: need 0 <= min <= max, got min={min_value} max={max_value}")
        if not 0 <= filler <= len(FILLER):
            raise data.DataError(f"memory: filler must be in 0..{len(FILLER)}, got {filler}")
        if ask not in QUESTIONS:
            raise data.DataError(f"memory: ask must be one of {', '.join(QUESTIONS)}, got {ask!r}")
        self.pages, self.min_value, self.max_value = pages, min_value, max_value
        self.filler, self.memory, self.ask = filler, memory, ask

    @classmethod
    def from_spec(cls, spec):
        head, _, options = spec.partition(":")
        if head != "memory":
            raise data.DataError(f"{spec!r}: a memory spec starts with 'memory'")
        kwargs = {}
        for item in filter(None, options.split(",")):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or key not in cls.SPEC_KEYS:
                raise data.DataError(f"{spec!r}: bad option {item!r}; use key=value with keys "
                                     f"{', '.join(cls.SPEC_KEYS)}")
            if key == "memory":
                if value not in ("on", "off"):
                    raise data.DataError(f"{spec!r}: memory must be on or off, got {value!r}")
                kwargs["memory"] = value == "on"
                continue
            if key == "ask":
                kwargs["ask"] = value
                continue
            kwargs[{"min": "min_value", "max": "max_value"}.get(key, key)] = data.spec_number(spec, key, value)
        return cls(**kwargs)

    def record(self, sales, rng):
        """The diary with these sales (one per page); rng places the filler."""
        pages = []
        for day, sold in enumerate(sales, start=1):
            sentences = rng.sample(FILLER, self.filler)
            sentences.insert(rng.randint(0, self.filler), f"On day {day} the shop sold {sold} apples.")
            pages.append(" ".join(sentences))
        key = "+".join(map(str, sales))
        answer = sum(sales) if self.ask == "total" else sales[0]
        return {"id": f"memory:{self.ask}:{key}", "prompt": QUESTIONS[self.ask], "answer": str(answer),
                "pages": pages, "memory": self.memory, "ask": self.ask}

    def _draw(self, rng):
        return [rng.randint(self.min_value, self.max_value) for _ in range(self.pages)]

    @staticmethod
    def is_heldout(sales):
        return data.is_heldout(sales, ["+"] * (len(sales) - 1))

    def sample(self, n, rng):
        """n training diaries (never held out); `rng` is a random.Random."""
        records = []
        for _ in range(1000 * n):
            sales = self._draw(rng)
            if not self.is_heldout(sales):
                records.append(self.record(sales, rng))
                if len(records) == n:
                    return records
        raise data.DataError("memory: every diary is held out; widen min..max")

    def heldout(self, n):
        """The first n distinct held-out diaries: the same list every call."""
        rng, records, seen = random.Random("heldout"), [], set()
        for _ in range(1000 * n):
            sales = self._draw(rng)
            if tuple(sales) not in seen and self.is_heldout(sales):
                seen.add(tuple(sales))
                records.append(self.record(sales, rng))
                if len(records) == n:
                    return records
        raise data.DataError(f"memory: could not find {n} distinct held-out diaries; widen min..max")
