"""Supervised fine-tuning (SFT): a warm start that teaches the answer's format before RL, for a
model whose replies the reward cannot yet read (a reward that stays at zero). train.py runs it
as a step of its own kind in the same loop, so the run directory, resume, held-out evaluation,
tracking and final/ are a training run's; `--model runs/NAME/final` then starts RL from it.

    python train.py --preset sft                                   # the bundled model, arithmetic
    python train.py --preset sft --model Qwen/Qwen2.5-0.5B-Instruct --data gsm8k --eval-data gsm8k
    python train.py --model runs/NAME/final                        # then DAPO from the SFT model

The loss is the mean negative log-likelihood of the completion tokens only (the prompt's carry
none), over the whole mini-batch on every rank (the divisor of DAPO's eq. 12), so micro-batches
and ranks give one batch's gradient, as in the RL update:

    L(theta) = -1 / sum_i |y_i| * sum_i sum_t log pi_theta(y_i,t | x_i, y_i,<t)

The data's shapes (a row of a .jsonl/.json/.parquet file or a hub set): `prompt` + `completion`
(text, or TRL's conversational lists of messages), `messages` ending in the assistant's reply,
GSM8K's `question` + `answer` (its reasoning, then the answer in the template's format), MATH's
`problem` + `solution`, and the synthetic tasks' problems. The replies this file writes (GSM8K's,
the synthetic tasks') are in the template's format: "Answer: X" (after a plain prompt's "Answer:",
" X"), a \\boxed{} sentence, or the xml recipe's tags; a given completion or solution is taught as
it is written.
"""

import re
import time
from dataclasses import replace

import torch

import data
import losses
from model import token_logprobs
from run import distributed, sharding
from run.distributed import add

# ---- the examples ---------------------------------------------------------------------------------

SHAPES = ("prompt + completion", "messages ending in an assistant reply", "GSM8K's question + "
          "answer", "MATH's problem + solution")


def written_reply(reasoning, answer, template):
    """A reply in the format the template asks for (and the reward reads): the reasoning, then
    the answer's line ("Answer: X", a \\boxed{} sentence, or the xml recipe's two tags)."""
    if template == "xml":
        return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"
    last = f"The final answer is $\\boxed{{{answer}}}$." if template == "boxed" else f"Answer: {answer}"
    return f"{reasoning}\n{last}" if reasoning else last


def example_from_row(row, source, number, template):
    """One data row -> {"prompt" or "messages": what precedes the reply, "completion": the reply,
    "id"}; DataError naming the row when it has no reply or an empty one."""
    where = f"{source}: row {number}"
    row = {str(key).lower(): value for key, value in row.items()}
    if "completion" in row:
        prompt, completion = row.get("prompt"), row["completion"]
        if isinstance(completion, list):  # TRL's conversational shape: [{"role": "assistant", ...}]
            completion = "".join(m.get("content", "") for m in completion if isinstance(m, dict))
        context = {"messages": data.checked_messages(prompt, source, number, "prompt")} \
            if isinstance(prompt, list) else {"prompt": text_field(row, "prompt", where)}
    elif isinstance(row.get("messages"), list):
        messages = data.checked_messages(row["messages"], source, number, "messages")
        if messages[-1]["role"] != "assistant":
            raise data.DataError(f"{where}: field 'messages': the last message is the "
                                 f"{messages[-1]['role']}'s; SFT learns the assistant's reply")
        context, completion = {"messages": messages[:-1]}, messages[-1]["content"]
    elif "question" in row and "####" in str(row.get("answer", "")):  # GSM8K
        reasoning, final = str(row["answer"]).rsplit("####", 1)
        reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()  # its calculator annotations
        context = {"prompt": text_field(row, "question", where)}
        completion = written_reply(reasoning, final.strip().replace(",", ""), template)
    elif "problem" in row and "solution" in row:  # MATH: the solution ends in its \boxed{}
        context, completion = {"prompt": text_field(row, "problem", where)}, row["solution"]
    else:
        raise data.DataError(f"{where}: no completion to learn: SFT reads {', '.join(SHAPES)} "
                             f"(the row has {sorted(row)})")
    if not isinstance(completion, str):
        raise data.DataError(f"{where}: field 'completion': expected str, got {type(completion).__name__}")
    if not completion.strip():
        raise data.DataError(f"{where}: field 'completion': empty")
    return {**context, "completion": completion, "id": str(row.get("id", f"{source}:{number}")),
            "answer": str(row.get("answer", ""))}


def text_field(row, name, where):
    """row[name], a non-empty string, or DataError naming the row and the field."""
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        state = "missing" if value is None else "empty" if isinstance(value, str) else \
            f"expected str, got {type(value).__name__}"
        raise data.DataError(f"{where}: field '{name}': {state}")
    return value


def load_examples(name, template, tokenizer, stop_ids, room):
    """The SFT examples of a file or a hub set, each checked to fit `room` positions whole
    (prompt and completion). -> list of examples"""
    source, rows = data.read_rows(name, "train")
    examples = []
    for number, row in rows:
        example = example_from_row(row, source, number, template)
        prompt, reply = example_ids(example, tokenizer, template, stop_ids)
        if len(prompt) + len(reply) > room:
            raise data.DataError(f"{source}: row {number}: {len(prompt)} prompt and {len(reply)} "
                                 f"completion tokens, more than the {room} positions a row may take")
        examples.append(example)
    if not examples:
        raise data.DataError(f"{source}: empty: no rows")
    return examples


def example_ids(example, tokenizer, template, stop_ids):
    """(prompt ids, completion ids) of an example (or a synthetic task's record, whose reply
    written_reply gives): the prompt as RL formats it; the completion as the model would write it,
    the chat template's end of turn included (so the model learns to stop)."""
    completion = example.get("completion") or written_reply("", example["answer"], template)
    prompt = data.format_prompt(example, tokenizer, template)
    if data.is_plain_prompt(tokenizer, template):  # the prompt ends "Answer:": the reply goes on
        completion = " " + completion.lstrip().removeprefix("Answer:").lstrip()
    reply = tokenizer(completion, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return prompt, list(reply) + end_of_turn(tokenizer, template, stop_ids)


def end_of_turn(tokenizer, template, stop_ids):
    """The ids the chat template writes after an assistant's reply, through its first stop token
    (SmolLM2's and Qwen's `<|im_end|>`); a plain prompt's: the EOS."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]  # (none: to the budget)
    if data.is_plain_prompt(tokenizer, template):
        return eos
    hole = "\ue000reply\ue001"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": hole}], tokenize=False)
    tail = tokenizer(text.split(hole, 1)[1], add_special_tokens=False)["input_ids"]
    stops = [k for k, token in enumerate(tail) if token in stop_ids]
    return tail[:stops[0] + 1] if stops else eos


# ---- the loss and the update ----------------------------------------------------------------------

def sft_loss(logp, mask, num_tokens=None):
    """L = -1 / sum_i |y_i| * sum_i sum_t log pi(y_i,t | x_i, y_i,<t): logp (b, C) the completion
    tokens' log-probs, mask (b, C) 1 on them, num_tokens the whole mini-batch's count over
    micro-batches and ranks (default this call's own)."""
    divisors = {} if num_tokens is None else {"num_tokens": num_tokens}
    return losses.aggregate(-logp, mask, "token-mean", **divisors)


def packed_micro_batches(run, prompts, replies, rows):
    """`rows` as packed micro-batches (data.pack), as many on every rank (empty stand-ins carry
    no loss token)."""
    args = run.args
    sizes = [(len(prompts[i]), len(replies[i])) for i in rows]
    parts = data.micro_batches(rows, sizes, args.micro_batch_size, args.micro_batch_tokens)
    parts += [[]] * (distributed.micro_batch_count(len(parts)) - len(parts))
    out = []
    for part in parts:
        packed = data.pack([prompts[i] for i in part] or [[0]], [replies[i] for i in part] or [[0]],
                           args.device)
        out.append(packed if part else packed._replace(mask=torch.zeros_like(packed.mask)))
    return out


def sft_update(run, prompts, replies):
    """--mini-batches optimizer updates on this rank's examples, each mini-batch's loss divided by
    its completion tokens over every micro-batch and rank. -> named sums for the log"""
    sums = {}
    for rows in distributed.mini_batches(list(range(len(prompts))), run.args.mini_batches):
        micro = packed_micro_batches(run, prompts, replies, rows)
        divisors = losses.micro_batch_divisors([mb.mask for mb in micro], distributed=run.world > 1)
        if int(divisors[0]["num_tokens"]) == 0:
            sums = add(sums, {"empty_updates": 1})
            continue
        run.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for k, (mb, divisor) in enumerate(zip(micro, divisors)):
            with distributed.accumulating(run.model, last=k == len(micro) - 1), \
                    distributed.autocast(run.args.device, run.bf16):
                hidden = run.model(mb.ids, mb.attn, return_hidden=True)  # (b, P+C, H)
                logp = token_logprobs(run.policy, mb.ids, mb.attn, start=mb.start, hidden=hidden)  # (b, C)
                loss = sft_loss(logp, mb.mask, divisor["num_tokens"])
                (loss * run.world).backward()  # DDP averages over ranks: the divisor is global
            loss_sum += float(loss.detach())
            sums = add(sums, {"nll": float(-(logp.detach() * mb.mask).sum()),
                              "loss_tokens": float(mb.mask.sum()), "update_tokens": float(mb.attn.sum()) * bool(mb.mask.any())})
        sums = add(sums, distributed.optimizer_step(run.optimizer, run.policy, loss_sum, run.args.grad_clip))
    return sums


# ---- one step -------------------------------------------------------------------------------------

def sft_step(run, progress, lr):
    """One SFT step at learning rate `lr`: this rank's share of --prompts-per-step examples, its
    updates, the sampler refreshed (the held-out evaluation samples from it).
    -> (progress, its line of metrics.jsonl, samples: none)"""
    args = run.args
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    start = time.perf_counter()
    examples = run.stream.take(args.prompts_per_step // run.world)
    prompts, replies = zip(*(example_ids(e, run.tokenizer, args.template, run.stop_ids)
                             for e in examples))
    run.policy.train()
    sums = sft_update(run, list(prompts), list(replies))
    if run.sampler is not run.policy:
        sharding.copy_trainable(run.sampler, run.policy)
    seconds = time.perf_counter() - start
    total = distributed.reduce_metrics({**sums, "ranks": 1}, {})
    ranks, tokens = total["ranks"], max(1.0, total.get("loss_tokens", 0.0))
    updates = total.get("updates", 0.0) / ranks
    applied = int(updates - total.get("skipped_updates", 0.0) / ranks)
    progress = replace(progress, step=progress.step + 1, updates=progress.updates + applied,
                       trained_steps=progress.trained_steps + bool(updates),
                       train_seconds=progress.train_seconds + seconds,
                       skipped_updates=progress.skipped_updates + int(updates) - applied)
    row = {"step": progress.step, "updates": progress.updates, "lr": lr,
           "loss": total.get("nll", 0.0) / tokens, "loss_tokens": int(total.get("loss_tokens", 0)),
           "examples": len(examples) * run.world, "grad_norm": total.get("grad_norm", 0.0) / max(1.0, applied * ranks),
           "skipped_updates": int(updates) - applied, "skipped_updates_total": progress.skipped_updates,
           "empty_updates": int(total.get("empty_updates", 0) / ranks), "seconds_update": seconds,
           "tokens_per_second_update": total.get("update_tokens", 0.0) / ranks / max(seconds, 1e-9),
           "train_seconds": progress.train_seconds, "trained_steps": progress.trained_steps}
    return progress, row, []
