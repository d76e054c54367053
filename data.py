"""Prompt data for DAPO: hub datasets, local files, a synthetic arithmetic task, prompt templates.

Everything the trainer reads is a *record*, a plain dict:

    {"prompt": "What is 12 + 7?",   # the problem text, without any instruction
     "answer": "19",                # the ground truth, as a string
     "id": "arith:12+7",            # a stable name for the problem
     ...}                           # optional extras, see below

Optional extras: "hint" (the first step of a worked solution, when the source has one),
"messages" (chat messages to use as they are, when the source already holds them, e.g. the
DAPO-Math-17k user message that already contains the DAPO instruction), "row" (where the record
came from in its file, for error messages), and for synthetic problems "operands" and "ops".

Where records come from (`load_records(name_or_path)`):

    gsm8k            openai/gsm8k, config "main"      answer = text after "#### ", commas removed
    math500          HuggingFaceH4/MATH-500           (its only split, "test")
    aime24           Maxwell-Jia/AIME_2024            (its only split, "train")
    dapo-math-17k    BytedTsinghua-SIA/DAPO-Math-17k  verl layout, exact duplicates dropped
    arithmetic[:k=v,...]   the synthetic task below (split "test" = its fixed held-out problems)
    a local file     .jsonl (one object a line), .json (a list of objects, or JSON lines), .parquet

The hub names need a network; local files with the hub's field names work offline. The layout of
a file is read from the fields of its first row (field names are matched case-insensitively):

    question + answer containing "#### <final>"   GSM8K (hint = first line of the reasoning)
    problem + answer [+ solution]                  MATH-500 / AIME (hint = first sentence)
    prompt (list of {role, content}) + reward_model.ground_truth [+ extra_info.index]
                                                   verl / DAPO-Math-17k
    prompt (or question) + answer [+ hint, id]     anything else

Answers may be strings or integers (AIME on the hub stores integers); both become strings.

Every row is checked before training starts (`validate_records`): a missing or wrong-typed field,
an empty prompt or answer, malformed JSON, an empty file, or a prompt longer than the context
raises `DataError` naming the file, the row (the 1-based line number for .jsonl, the 1-based
position otherwise) and the field.

The synthetic arithmetic task (the default, it runs offline) is spelled `arithmetic` or
`arithmetic:key=value,key=value` with keys

    min=1, max=30   operand range (inclusive)      digits=2   same as min=10,max=99 (digits=1: 1..9)
    terms=2         number of operands             ops=+      operations drawn from, e.g. ops=+-*
    level=0         curriculum level: each level doubles the largest operand

so `arithmetic` is "What is a + b?" for a, b in 1..30 (SmolLM2-135M-Instruct gets ~25% right
greedily) and `arithmetic:digits=2,terms=3,ops=+-` is harder. A fixed quarter of all problems is
held out (chosen by a hash of the problem, so the same for every seed and every difficulty);
training never samples them.

Prompt templates (`format_prompt(record, tokenizer, template)`): "dapo" (the DAPO paper's
instruction), "boxed" (step by step, answer in \\boxed{}), "xml" (a system prompt asking for
<reasoning>...</reasoning> then <answer>...</answer>), "none" (the bare problem), all through
the tokenizer's chat template; "plain-question" is the plain text "Question: ...\\nAnswer:", which
is also what any template becomes for a tokenizer without a chat template (a base model).

`PromptStream` yields each rank its slice of every global batch, forever, and saves its position
as a few integers for checkpoints.

Tests: python -m pytest tests/test_data.py -q
"""

import copy
import hashlib
import itertools
import json
import os
import random
import re
from typing import NamedTuple

import torch

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_REMINDER = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# The system prompt of the XML recipe for GSM8K (rewards.xml_terms grades the format).
XML_FORMAT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
TEMPLATES = ("dapo", "boxed", "xml", "plain-question", "none", "no-system")

# name -> (hub id, config, split or None when the split argument picks it)
HUB_DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", None),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("Maxwell-Jia/AIME_2024", None, "train"),
    "dapo-math-17k": ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
}
FILE_EXTENSIONS = (".jsonl", ".json", ".parquet")

# Neutral sentences for harder text variants: no numbers, nothing a solver could use.
DISTRACTORS = (
    "Interesting fact: cats sleep for most of their lives.",
    "The weather that day was pleasant and mild.",
    "A small bird was singing outside the window.",
    "Many people enjoy a cup of tea in the afternoon.",
    "The old bridge in town was painted green last spring.",
    "Someone in the next room was humming a familiar tune.",
)


class DataError(ValueError):
    """Bad input data; the message names the file (or source), the row and the field."""


def spec_number(spec, key, value) -> int:
    """A task spec's whole number (`arithmetic:max=99`), in the digits 0-9 only: int() also reads
    "٣" and "1_0", and str.isdigit takes "²", which int() then refuses."""
    if not re.fullmatch(r"-?[0-9]+", value.strip()):
        raise DataError(f"{spec!r}: {key} must be a whole number written in the digits 0-9, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------------------------
# Loading


def load_records(name_or_path, *, split="train", limit=None, tokenizer=None,
                 max_prompt_tokens=None, template="dapo", limit_from=""):
    """Records from a known name, an `arithmetic:...` spec or a local file, checked row by row.

    `limit` keeps the first `limit` records. With a tokenizer and `max_prompt_tokens`, every prompt
    is also formatted with `template` and checked against that length (`limit_from`: where that
    length comes from, for the message).
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit must be a positive integer, got {limit!r}")
    name = str(name_or_path)
    if os.path.isfile(name):
        source, records = name, _records_from_rows(_read_file(name), name, limit)
    elif name in HUB_DATASETS:
        source, records = _load_hub(name, split, limit)
    elif name.split(":", 1)[0] == "memory":
        raise DataError(f"{name}: the memory task's episodes have several turns; train.py "
                        "evaluates them (eval.jsonl), this loader reads single-turn problems")
    elif name.split(":", 1)[0] == "arithmetic":
        task = ArithmeticTask.from_spec(name)
        source = task.spec()
        if split in ("test", "heldout"):
            records = task.heldout(limit or 200)
        elif split != "train":
            raise DataError(f"{name}: split must be 'train' or 'test' (the held-out problems)")
        elif limit is None:
            raise DataError(f"{name}: the training split of a synthetic task never ends: pass a "
                            "limit, or give the ArithmeticTask itself to PromptStream")
        else:
            records = task.sample(limit, random.Random(0))
    elif os.path.exists(name):
        raise DataError(f"{name}: not a file (expected one of {', '.join(FILE_EXTENSIONS)})")
    else:
        raise DataError(
            f"unknown data {name!r}: not an existing file, and not a known name: "
            f"{', '.join(HUB_DATASETS)}, arithmetic (or arithmetic:key=value,...; keys: "
            f"{', '.join(ArithmeticTask.SPEC_KEYS)}); local files: {', '.join(FILE_EXTENSIONS)}")
    validate_records(records, source, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens,
                     template=template, limit_from=limit_from)
    return records


def _load_hub(name, split, limit):
    source, rows = read_rows(name, split)
    return source, _records_from_rows(rows, source, limit)


def read_rows(name, split="train"):
    """A local file's or a known hub set's rows as they are -> (source, (row number, row dict)
    pairs); variants/sft.py reads its examples from them."""
    if os.path.isfile(name):
        return name, _read_file(name)
    if name not in HUB_DATASETS:
        raise DataError(f"{name}: not a local {'/'.join(FILE_EXTENSIONS)} file, nor one of "
                        f"{', '.join(HUB_DATASETS)}")
    hub_id, config, fixed_split = HUB_DATASETS[name]
    split = fixed_split or split
    try:
        import datasets  # only here: the offline paths never need it
        rows = datasets.load_dataset(hub_id, config, split=split)
    except Exception as error:  # no network, no such split, ...: say what was tried
        raise DataError(f"could not load {hub_id} (split {split!r}) from the hub: {error}; "
                        "a local .jsonl/.json/.parquet copy works offline") from error
    return f"{hub_id}:{split}", enumerate(rows, start=1)


def _read_file(path):
    """Yields (row number, row dict). Row number: the line for .jsonl, the position otherwise."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        yield from _read_json_lines(path)
    elif ext == ".json":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            line = raw[:error.start].count(b"\n") + 1
            raise DataError(f"{path}: line {line}: not UTF-8 text (byte {error.start})") from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            if error.msg == "Extra data":  # `Dataset.to_json` writes JSON lines under .json
                yield from _read_json_lines(path)
                return
            raise DataError(f"{path}: line {error.lineno}: malformed JSON: {error.msg}") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a list of objects, got a {type(rows).__name__}")
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {number}: expected an object, got {type(row).__name__}")
            yield number, row
    elif ext == ".parquet":
        import pyarrow.parquet as pq  # comes with `datasets`
        try:
            parquet = pq.ParquetFile(path)
        except Exception as error:
            raise DataError(f"{path}: not a readable parquet file: {error}") from error
        number, batches = 0, parquet.iter_batches(batch_size=4096)  # streamed: `limit` stops early
        while True:
            try:
                batch = next(batches, None)
            except Exception as error:  # corrupt data pages: pyarrow raises OSError / ArrowInvalid
                raise DataError(f"{path}: rows after {number}: cannot read (corrupt parquet "
                                f"data: {error})") from error
            if batch is None:
                return
            for row in batch.to_pylist():
                number += 1
                yield number, row
    else:
        raise DataError(f"{path}: unknown file type {ext!r} (expected {', '.join(FILE_EXTENSIONS)})")


def _read_json_lines(path):
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}: row {number} (line {number}): not UTF-8 text (byte "
                                f"{error.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: row {number} (line {number}): malformed JSON: "
                                f"{error.msg} at column {error.colno}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {number} (line {number}): expected a JSON object, "
                                f"got {type(row).__name__}")
            yield number, row


def _records_from_rows(numbered_rows, source, limit):
    """Reads the layout off the first row, then turns every row into a record (or fails)."""
    records, layout, seen = [], None, set()
    for number, row in numbered_rows:
        fields = dict(row)  # the row as the file has it: what a --reward function reads
        lowered = {str(key).lower(): value for key, value in row.items()}
        if len(lowered) < len(row):  # "Answer" and "answer": which one is meant?
            clash = sorted(k for k in row if sum(str(o).lower() == str(k).lower() for o in row) > 1)
            raise DataError(f"{source}: row {number}: fields {clash} differ only in case "
                            "(fields are matched case-insensitively)")
        row = lowered
        if layout is None:
            layout = _detect_layout(row, source, number)
        record = {**_record_from_row(row, layout, source, number), "fields": fields}
        if layout == "verl":
            # The hub file repeats each of its ~17k prompts about 100 times; keep one of each.
            key = (record["prompt"], record["answer"])
            if key in seen:
                continue
            seen.add(key)
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise DataError(f"{source}: empty: no rows")
    return records


def _detect_layout(row, source, number):
    if isinstance(row.get("prompt"), list):
        return "verl"
    if "problem" in row:
        return "math"
    if "question" in row and "####" in str(row.get("answer", "")):
        return "gsm8k"
    if "question" in row or "prompt" in row:
        return "plain"
    raise DataError(f"{source}: row {number}: field 'prompt': missing (no 'prompt', 'problem' or "
                    f"'question' field; the row has {sorted(row)})")


def _field(row, name, source, number, types=(str,), label=None):
    """row[name] as a non-empty string (integers allowed when `types` has int), or DataError."""
    name_in_message = label or name
    if name not in row or row[name] is None:
        raise DataError(f"{source}: row {number}: field '{name_in_message}': missing")
    value = row[name]
    # bool is an int in Python, never a valid answer or text
    if isinstance(value, bool) or not isinstance(value, types):
        wanted = " or ".join(t.__name__ for t in types)
        raise DataError(f"{source}: row {number}: field '{name_in_message}': expected {wanted}, "
                        f"got {type(value).__name__}")
    if isinstance(value, int):
        value = str(value)
    if not value.strip():
        raise DataError(f"{source}: row {number}: field '{name_in_message}': empty")
    return value


def _record_from_row(row, layout, source, number):
    record = {"row": number}
    if layout == "gsm8k":
        record["prompt"] = _field(row, "question", source, number)
        full = _field(row, "answer", source, number)
        if "####" not in full:
            raise DataError(f"{source}: row {number}: field 'answer': no '#### <final answer>'")
        reasoning, final = full.rsplit("####", 1)
        record["answer"] = final.strip().replace(",", "")
        if not record["answer"]:
            raise DataError(f"{source}: row {number}: field 'answer': empty after '####'")
        hint = _first_step(re.sub(r"<<[^>]*>>", "", reasoning))  # drop calculator annotations
    elif layout == "math":
        record["prompt"] = _field(row, "problem", source, number)
        record["answer"] = _field(row, "answer", source, number, (str, int)).strip()
        solution = row.get("solution")
        hint = _first_step(solution) if isinstance(solution, str) else None
    elif layout == "verl":
        messages = checked_messages(row.get("prompt"), source, number, "prompt")
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict):
            field_state = "missing" if reward_model is None else \
                f"expected a dict, got {type(reward_model).__name__}"
            raise DataError(f"{source}: row {number}: field 'reward_model': {field_state}")
        record["answer"] = _field(reward_model, "ground_truth", source, number, (str, int),
                                  label="reward_model.ground_truth").strip()
        record["messages"] = messages
        user = [m["content"] for m in messages if m["role"] == "user"][-1]
        record["prompt"] = _strip_dapo_instruction(user)
        extra = row.get("extra_info")
        if isinstance(extra, dict) and extra.get("index") is not None:
            record["id"] = str(extra["index"])
        hint = None
    else:
        text_field = "prompt" if "prompt" in row else "question"
        record["prompt"] = _field(row, text_field, source, number)
        record["answer"] = _field(row, "answer", source, number, (str, int)).strip()
        hint = _field(row, "hint", source, number) if row.get("hint") is not None else None
    for id_field in ("id", "unique_id"):
        if "id" not in record and row.get(id_field) is not None:
            record["id"] = str(row[id_field])
    record.setdefault("id", f"{os.path.basename(source)}:{number}")  # e.g. "test.jsonl:12"
    if hint:
        record["hint"] = hint
    return record


def checked_messages(messages, source, number, field):
    """A checked copy of a chat message list: [{"role": str, "content": str}, ...] with a user turn."""
    where = f"{source}: row {number}: field '{field}'"
    if messages is None:
        raise DataError(f"{where}: missing")
    if not isinstance(messages, list):
        raise DataError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: each message must be {{'role': str, 'content': str}}")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise DataError(f"{where}: no non-empty user message")
    return messages


def _strip_dapo_instruction(text):
    """The bare problem inside a DAPO-Math-17k user message (the message as is when it differs)."""
    if text.startswith(DAPO_INSTRUCTION) and text.endswith(DAPO_REMINDER):
        return text[len(DAPO_INSTRUCTION):-len(DAPO_REMINDER)]
    return text


def _first_step(solution):
    """The first line / sentence of a worked solution, or None if it would be the whole of it."""
    lines = [line.strip() for line in solution.strip().splitlines() if line.strip()]
    if not lines:
        return None
    first = lines[0]
    # a sentence ends at . ! or ? (possibly closing inline math, "3.$") before a capital letter
    end = re.search(r"[.!?]\$?(?=\s+[A-Z])", first)
    if end:
        first = first[:end.end()]
    if (len(lines) == 1 and not end) or "box" in first:  # \boxed, \fbox, \framebox
        return None  # a one-step solution (or one that states the final answer) is no hint
    return first


def validate_records(records, source, tokenizer=None, max_prompt_tokens=None, template="dapo",
                     limit_from=""):
    """Checks every record (types, empty fields, prompt length); raises DataError at the first bad one.

    `source` names the file or dataset in messages. Rows are named by record["row"] when present
    (where it was in its file), else by 1-based position.
    """
    if not records:
        raise DataError(f"{source}: empty: no rows")
    for position, record in enumerate(records, start=1):
        number = record.get("row", position) if isinstance(record, dict) else position
        if not isinstance(record, dict):
            raise DataError(f"{source}: row {number}: expected a dict record, "
                            f"got {type(record).__name__}")
        for name in ("prompt", "answer", "id"):
            _field(record, name, source, number)
        if "hint" in record:
            _field(record, "hint", source, number)
        if "messages" in record:
            checked_messages(record["messages"], source, number, "messages")
    if tokenizer is not None and max_prompt_tokens is not None:
        for position, record in enumerate(records, start=1):
            length = len(format_prompt(record, tokenizer, template))
            if length > max_prompt_tokens:
                raise DataError(f"{source}: row {record.get('row', position)}: field 'prompt': "
                                f"{length} tokens with the {template!r} template, longer than the "
                                f"limit of {max_prompt_tokens}"
                                + (f" ({limit_from})" if limit_from else ""))


# ----------------------------------------------------------------------------------------------
# The synthetic arithmetic task

HELDOUT_EVERY = 4  # a problem is held out when hash(problem) % 4 == 0: a quarter of every space
ENUMERATE_LIMIT = 200_000  # spaces up to this size are listed in full for `heldout`


def _evaluate(operands, ops):
    """The value of `a op b op c ...` with * before + and -, computed without eval."""
    values, pending = [operands[0]], []
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            values[-1] *= value
        else:
            pending.append(op)
            values.append(value)
    total = values[0]
    for op, value in zip(pending, values[1:]):
        total = total + value if op == "+" else total - value
    return total


def _expression(operands, ops, spaced=True):
    joiner = " {} " if spaced else "{}"
    parts = [str(operands[0])]
    for op, value in zip(ops, operands[1:]):
        parts.append(joiner.format(op) + str(value))
    return "".join(parts)


def _heldout_key(operands, ops):
    # 12+7 and 7+12 are one problem to a learner: sort the operands when the order cannot
    # matter, so both land on the same side of the split.
    if len(set(ops)) == 1 and ops[0] in "+*":
        operands = sorted(operands)
    return _expression(operands, ops, spaced=False)


def _stable_hash(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def is_heldout(operands, ops):
    """Whether the problem `operands[0] ops[0] operands[1] ...` belongs to the fixed held-out split."""
    return in_heldout_split(_heldout_key(operands, ops))


def in_heldout_split(key):
    """Whether the problem named `key` is held out: a quarter of any task's problems, by hash."""
    return _stable_hash(key) % HELDOUT_EVERY == 0


def _arithmetic_hint(operands, ops):
    """A first partial step that does not give the answer away, or None."""
    if len(operands) > 2:  # do the first operation (a product first), leave the rest
        i = ops.index("*") if "*" in ops else 0
        done = _evaluate(operands[i:i + 2], ops[i:i + 1])
        rest = _expression(operands[:i] + [done] + operands[i + 2:], ops[:i] + ops[i + 1:])
        return f"{_expression(operands, ops)} = {rest}"
    (a, b), op = operands, ops[0]
    for i, value in enumerate((a, b)):
        if value < 10 or value % 10 == 0:
            continue
        tens, ones = value - value % 10, value % 10
        if op == "*":  # distribute over tens and ones
            other = b if i == 0 else a
            split = f"{tens} * {other} + {ones} * {other}" if i == 0 else \
                f"{other} * {tens} + {other} * {ones}"
        elif i == 0:
            split = f"{tens} + {ones} {op} {b}"
        else:  # a - 12 = a - 10 - 2, a + 12 = a + 10 + 2
            split = f"{a} {op} {tens} {op} {ones}"
        return f"{a} {op} {b} = {split}"
    return None  # two one-digit numbers: nothing smaller to break them into


def arithmetic_record(operands, ops):
    """The record for `operands[0] ops[0] operands[1] ...`, e.g. ([12, 7], ["+"]) -> 'What is 12 + 7?'."""
    record = {"prompt": f"What is {_expression(operands, ops)}?",
              "answer": str(_evaluate(operands, ops)),
              "id": "arith:" + _expression(operands, ops, spaced=False),
              "operands": list(operands), "ops": list(ops)}
    hint = _arithmetic_hint(list(operands), list(ops))
    if hint:
        record["hint"] = hint
    return record


class ArithmeticTask:
    """Seeded "What is a + b?" problems with difficulty knobs and a fixed held-out split.

    Knobs: operands in [min_value, max_value * 2**level], `terms` operands, operations drawn from
    `ops` (any of "+-*"). `harder()` raises the level in place (a curriculum: call it when the
    model masters the current level). Training samples (`sample`) never include a held-out problem
    (`is_heldout`), at any level.
    """

    SPEC_KEYS = ("min", "max", "digits", "terms", "ops", "level")

    def __init__(self, min_value=1, max_value=30, terms=2, ops="+", level=0):
        if not 0 <= min_value <= max_value:
            raise DataError(f"arithmetic: need 0 <= min <= max, got min={min_value} max={max_value}")
        if terms < 2:
            raise DataError(f"arithmetic: terms must be at least 2, got {terms}")
        if not ops or set(ops) - set("+-*"):
            raise DataError(f"arithmetic: ops must be made of + - *, got {ops!r}")
        if level < 0:
            raise DataError(f"arithmetic: level must be >= 0, got {level}")
        self.min_value, self.max_value, self.terms, self.level = min_value, max_value, terms, level
        self.ops = "".join(dict.fromkeys(ops))  # keep order, drop repeats: "++-" -> "+-"

    @classmethod
    def from_spec(cls, spec):
        """`arithmetic` or `arithmetic:digits=2,terms=3,ops=+-,level=1` (keys: SPEC_KEYS)."""
        head, _, options = spec.partition(":")
        if head != "arithmetic":
            raise DataError(f"{spec!r}: an arithmetic spec starts with 'arithmetic'")
        kwargs = {}
        for item in filter(None, options.split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in cls.SPEC_KEYS:
                raise DataError(f"{spec!r}: bad option {item!r}; use key=value with keys "
                                f"{', '.join(cls.SPEC_KEYS)}")
            if key == "ops":
                kwargs["ops"] = value.strip()
                continue
            number = spec_number(spec, key, value)
            if key == "digits":
                if number < 1:
                    raise DataError(f"{spec!r}: digits must be at least 1")
                kwargs["min_value"], kwargs["max_value"] = max(1, 10 ** (number - 1)), 10 ** number - 1
            else:
                kwargs[{"min": "min_value", "max": "max_value"}.get(key, key)] = number
        return cls(**kwargs)

    def spec(self):
        """The spec string that rebuilds this task (for config logs)."""
        return (f"arithmetic:min={self.min_value},max={self.max_value},terms={self.terms},"
                f"ops={self.ops},level={self.level}")

    @property
    def high(self):
        """The largest operand at the current level."""
        return self.max_value * 2 ** self.level

    def harder(self):
        self.level += 1
        return self

    def at_level(self, level):
        task = copy.copy(self)
        task.level = level
        return task

    def space_size(self):
        return (self.high - self.min_value + 1) ** self.terms * len(self.ops) ** (self.terms - 1)

    def _draw(self, rng):
        operands = [rng.randint(self.min_value, self.high) for _ in range(self.terms)]
        return operands, [rng.choice(self.ops) for _ in range(self.terms - 1)]

    def sample(self, n, rng):
        """n training problems (repeats possible), never held out; `rng` is a random.Random."""
        records, rejected_in_a_row = [], 0
        while len(records) < n:
            operands, ops = self._draw(rng)
            if is_heldout(operands, ops):
                rejected_in_a_row += 1
                if rejected_in_a_row > 1000:  # only possible in a tiny space
                    raise DataError(f"{self.spec()}: every problem is held out; widen the range")
                continue
            rejected_in_a_row = 0
            records.append(arithmetic_record(operands, ops))
        return records

    def heldout(self, n):
        """The first n distinct held-out problems at the current level: same list every call."""
        if self.space_size() <= ENUMERATE_LIMIT:
            values = range(self.min_value, self.high + 1)
            problems = [(list(o), list(p)) for o in itertools.product(values, repeat=self.terms)
                        for p in itertools.product(self.ops, repeat=self.terms - 1)]
            problems = [problem for problem in problems if is_heldout(*problem)]
            if len(problems) < n:
                raise DataError(f"{self.spec()}: only {len(problems)} held-out problems exist, "
                                f"{n} asked; widen the range or add terms")
            # a fixed, well-mixed order (not smallest operands first)
            problems.sort(key=lambda problem: _stable_hash(_expression(*problem, spaced=False)))
            return [arithmetic_record(*problem) for problem in problems[:n]]
        rng = random.Random("heldout")  # fixed: the held-out list never depends on a run's seed
        records, seen = [], set()
        for _ in range(n * HELDOUT_EVERY * 100):
            operands, ops = self._draw(rng)
            key = _expression(operands, ops, spaced=False)
            if key not in seen and is_heldout(operands, ops):
                seen.add(key)
                records.append(arithmetic_record(operands, ops))
                if len(records) == n:
                    return records
        raise DataError(f"{self.spec()}: could not find {n} distinct held-out problems")

    def state_dict(self):
        return {"level": self.level}

    def load_state_dict(self, state):
        self.level = int(state["level"])


def curriculum_step(source, accuracy_ema, accuracy, threshold):
    """The training accuracy's moving average after a step; past `threshold` (--curriculum, 0:
    off) the arithmetic task gets harder and the average restarts at half of it."""
    ema = accuracy if accuracy_ema is None else 0.8 * accuracy_ema + 0.2 * accuracy
    if threshold and isinstance(source, ArithmeticTask) and ema > threshold:
        source.harder()  # the task never runs out of headroom
        ema = 0.5 * threshold
    return ema


# ----------------------------------------------------------------------------------------------
# Variants for adversarial dynamic sampling


def harder_variant(record, rng):
    """A harder problem with a known answer, or the same problem with a distractor sentence.

    Synthetic records get one more term or one more digit on every operand (never a held-out
    problem); text records get a neutral sentence from DISTRACTORS, so the answer is unchanged.
    `rng` is a random.Random.
    """
    if "operands" in record:
        operands, ops = list(record["operands"]), list(record["ops"])
        for _ in range(100):
            if rng.random() < 0.5:
                new_operands = operands + [rng.randint(1, max(9, max(operands)))]
                new_ops = ops + [rng.choice(ops)]
            else:
                new_operands, new_ops = [10 * value + rng.randint(0, 9) for value in operands], ops
            if not is_heldout(new_operands, new_ops):
                variant = arithmetic_record(new_operands, new_ops)
                variant["variant"] = "harder"
                return variant
        raise DataError(f"{record['id']}: no harder variant outside the held-out split")
    index = rng.randrange(len(DISTRACTORS))
    new_prompt = _insert_sentence(record["prompt"], DISTRACTORS[index])
    return _with_prompt(record, new_prompt, f"{record['id']}+distractor{index}", "harder",
                        " " + DISTRACTORS[index])


def hint_variant(record):
    """The problem with the first step of its solution appended, or None when there is no hint."""
    hint = record.get("hint")
    if not hint:
        return None
    variant = _with_prompt(record, f"{record['prompt']}\nHint: {hint}", f"{record['id']}+hint", "hint",
                           f"\nHint: {hint}")
    del variant["hint"]  # a hinted problem is not hinted twice
    return variant


def _insert_sentence(text, sentence):
    """Insert before the last sentence (the question), or append when no safe boundary exists."""
    boundaries = [m for m in re.finditer(r"(?<=[.!?])\s+(?=[A-Z])", text)
                  if text[:m.start()].count("$") % 2 == 0]  # never inside $...$ math
    if not boundaries:
        return f"{text.rstrip()} {sentence}"
    at = boundaries[-1].start()
    return f"{text[:at]} {sentence}{text[at:]}"


def _with_prompt(record, new_prompt, new_id, kind, added_text):
    """A copy of `record` with a new prompt; chat messages get the change in their user turn."""
    variant = copy.deepcopy(record)
    if "messages" in variant:
        user = [m for m in variant["messages"] if m["role"] == "user"][-1]
        if record["prompt"] in user["content"]:
            user["content"] = user["content"].replace(record["prompt"], new_prompt, 1)
        else:  # the problem is not found verbatim in the message: add the text at its end
            user["content"] += added_text
    variant.update(prompt=new_prompt, id=new_id, variant=kind)
    return variant


# ----------------------------------------------------------------------------------------------
# Prompt templates


def default_template(data_name):
    """"none" (the bare question) for the synthetic tasks, arithmetic, memory and countdown (whose
    prompt says how to answer), as their figures were measured; "dapo" (DAPO's "Answer:"
    instruction) for everything else."""
    return "none" if str(data_name).split(":", 1)[0] in ("arithmetic", "memory", "countdown") else "dapo"


def is_plain_prompt(tokenizer, template):
    """Whether format_prompt writes "Question: ...\nAnswer:" as plain text (no chat template)."""
    return template == "plain-question" or getattr(tokenizer, "chat_template", None) is None


def longest_prompt(source, tokenizer, template) -> int | None:
    """The most tokens a training prompt of `source` takes (memory_plan.py sizes by it): records'
    longest; an arithmetic task's longest of 64 problems eight curriculum levels up (operands
    256x larger), another task's of 64; None for a task in turns (its prompts grow with the
    episode)."""
    if isinstance(source, ArithmeticTask):
        source = source.at_level(source.level + 8).sample(64, random.Random(0))
    elif hasattr(source, "sample"):
        source = source.sample(64, random.Random(0))
    if any("pages" in record for record in source):  # (episodes.in_turns)
        return None
    return max((len(format_prompt(record, tokenizer, template)) for record in source), default=0)


def format_prompt(record, tokenizer, template="dapo"):
    """Token ids of the prompt for `record`, ready for generation.

    Chat models: [user message] through the tokenizer's chat template with the assistant turn
    opened; records with "messages" use those as they are (the template argument is ignored).
    Template "no-system": the bare question after an empty system turn, so a chat template's
    default system prompt (SmolLM2's and Qwen2.5's, ~16-35 tokens) is not in every prompt.
    Tokenizers without a chat template, and template "plain-question":
    "Question: {user message}\\nAnswer:" as plain text (with the tokenizer's own BOS, if any).
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose from {', '.join(TEMPLATES)}")
    if "messages" in record:
        messages = record["messages"]
    elif template == "dapo":
        messages = [{"role": "user", "content": DAPO_INSTRUCTION + record["prompt"] + DAPO_REMINDER}]
    elif template == "boxed":
        messages = [{"role": "user", "content": record["prompt"] + BOXED_INSTRUCTION}]
    elif template == "xml":
        messages = [{"role": "system", "content": XML_FORMAT},
                    {"role": "user", "content": record["prompt"]}]
    else:
        messages = [{"role": "user", "content": record["prompt"]}]
        if template == "no-system":  # an empty system turn: the chat template's default one left out
            messages = [{"role": "system", "content": ""}] + messages
    if is_plain_prompt(tokenizer, template):
        question = "\n\n".join(m["content"] for m in messages if m["role"] != "assistant" and m["content"])
        text = f"Question: {question}\nAnswer:"
        if record.get("reply_prefix"):  # the reply is written after it
            text = f"Question: {question}\n{record['reply_prefix']}"
        if any(marker in text for marker in control_markers(tokenizer)):  # the user's: spelled out
            return list(tokenizer(text, split_special_tokens=True)["input_ids"])
        return list(tokenizer(text)["input_ids"])
    # A reply prefix (episodes.py: "Memory:") opens the assistant's turn; the model goes on from it.
    suffix = record.get("reply_prefix", "")  # (an episode's transcript and a tool's output too)
    if any(marker in text for text in [m["content"] for m in messages] + [suffix]
           for marker in control_markers(tokenizer)):
        return chat_ids_with_text_content(tokenizer, messages, suffix)
    # Render to text, then tokenize: apply_chat_template(tokenize=True) returns a list in some
    # transformers versions and a BatchEncoding in others. The template already holds any BOS.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text + suffix, add_special_tokens=False)["input_ids"])


def control_markers(tokenizer) -> list[str]:
    """The strings this tokenizer reads as control tokens (BOS, EOS, a chat template's turn
    markers such as `<|im_start|>`)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})  # (a stand-in tokenizer may have none)
    return [token.content for token in added.values() if token.special]


def chat_ids_with_text_content(tokenizer, messages, suffix=""):
    """The chat template's ids for `messages` whose content holds control markers: the template's
    own markers are control tokens, the content's are spelled out as ordinary text, so that data
    or a demo visitor cannot write `<|im_end|>\n<|im_start|>system ...` and open a turn of its own.
    The template is rendered around placeholders, and each content tokenized alone; `suffix`, the
    reply's opening (an episode's transcript, a tool's output), is content too."""
    holes = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use characters
    text = tokenizer.apply_chat_template([dict(m, content=hole) for m, hole in zip(messages, holes)],
                                         add_generation_prompt=True, tokenize=False)
    ids = []
    for message, hole in zip(messages, holes):
        if hole in text:  # (a template may leave a message out)
            before, _, text = text.partition(hole)
            ids += tokenizer(before, add_special_tokens=False)["input_ids"]
            ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids += tokenizer(text, add_special_tokens=False)["input_ids"]  # the template's tail: its markers
    return ids + list(tokenizer(suffix, add_special_tokens=False, split_special_tokens=True)["input_ids"])


# ----------------------------------------------------------------------------------------------
# Batches for training, sharded by rank, with a resumable position


class PromptStream:
    """Endless batches of records; each rank gets its slice of every global batch.

    `source` is a list of records (shuffled anew each epoch with a generator seeded by
    (seed, epoch)) or a task with `sample(n, rng)`, ArithmeticTask or episodes.MemoryTask
    (each global batch drawn with a generator seeded by
    (seed, step)). The global batch at a step does not depend on world_size; rank r gets
    positions [r * B/W, (r + 1) * B/W) of it. A rank reads its slices in order, as many records
    at a time as it asks for (`take`; a refill round may want fewer than a batch), so no record
    is skipped; its position is the count it has taken (plus the task's level), and restoring
    that continues exactly.
    """

    def __init__(self, source, batch_size, seed=0, rank=0, world_size=1):
        if batch_size < 1 or batch_size % world_size != 0:
            raise ValueError(f"batch_size {batch_size} must be a positive multiple of world_size "
                             f"{world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if not hasattr(source, "sample") and not source:
            raise DataError("PromptStream: no records")
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.per_rank = batch_size // world_size
        self.taken = 0   # records this rank has read
        self._epoch, self._order = None, None

    def __iter__(self):
        return self

    def __next__(self):
        return self.take(self.per_rank)

    def take(self, count):
        """This rank's next `count` records, continuing where the last call stopped."""
        records = []
        while len(records) < count:
            step, index = divmod(self.taken, self.per_rank)
            first = self.rank * self.per_rank + index
            end = first + min(self.per_rank - index, count - len(records))
            records += self.global_batch(step)[first:end]
            self.taken += end - first
        return records

    def position(self, ahead=0):
        """The global position of the record this rank reads `ahead` records from now (unique
        over ranks)."""
        step, index = divmod(self.taken + ahead, self.per_rank)
        return step * self.batch_size + self.rank * self.per_rank + index

    def global_batch(self, step):
        """All ranks' records for `step` (a pure function of seed, step and the task's level at the
        call: a slice read in two calls around a level change holds both levels)."""
        if hasattr(self.source, "sample"):  # a task (arithmetic, episodes.MemoryTask)
            return self.source.sample(self.batch_size, random.Random(f"{self.seed}:{step}"))
        records = []
        for position in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, index = divmod(position, len(self.source))  # a batch may straddle two epochs
            records.append(dict(self.source[self._epoch_order(epoch)[index]]))
        return records

    def _epoch_order(self, epoch):
        if epoch != self._epoch:
            order = list(range(len(self.source)))
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def state_dict(self):
        state = {"taken": self.taken, "per_rank": self.per_rank}
        if isinstance(self.source, ArithmeticTask):
            state["level"] = self.source.level
        return state

    def load_state_dict(self, state):
        # Checkpoints before `take` counted whole batches ("step"). Resumed on another number of
        # ranks (another slice size), a rank goes on at the first batch its old slice had not
        # finished.
        if "taken" not in state:
            self.taken = int(state["step"]) * self.per_rank
        elif int(state["per_rank"]) == self.per_rank:
            self.taken = int(state["taken"])
        else:
            step, index = divmod(int(state["taken"]), int(state["per_rank"]))
            self.taken = (step + (index > 0)) * self.per_rank
        if "level" in state:
            self.source.load_state_dict({"level": state["level"]})


def adversarial_variants(records, requests, rng, tokenizer, template, max_prompt_tokens):
    """The harder (all right) or hinted (all wrong) variants of a round's signal-less prompts,
    requests = dapo.adversarial_requests(...), those that still fit max_prompt_tokens (a hint or
    a distractor makes a prompt longer)."""
    variants = []
    for group, how in requests:
        variant = harder_variant(records[group], rng) if how == "harder" else hint_variant(records[group])
        if variant is not None and len(format_prompt(variant, tokenizer, template)) <= max_prompt_tokens:
            variants.append(variant)
    return variants


# ---- token batches ------------------------------------------------------------------------------

class Packed(NamedTuple):
    ids: torch.Tensor   # (B, P+C) prompts left-padded, completions right-padded
    attn: torch.Tensor  # (B, P+C) 1 on real tokens
    mask: torch.Tensor  # (B, C) 1 on completion tokens
    start: int          # P: where the completions start


def pack(prompts, completions, device) -> Packed:
    """Prompts (token-id lists) left-padded and completions right-padded, in one batch."""
    P = max(len(p) for p in prompts)
    C = max(1, max(len(c) for c in completions))
    ids = torch.zeros(len(prompts), P + C, dtype=torch.long)
    attn = torch.zeros(len(prompts), P + C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p):P + len(c)] = 1
    return Packed(ids.to(device), attn.to(device), attn[:, P:].to(device), P)


def micro_batches(rows, sizes, max_rows, max_tokens=0):
    """rows (ids of a batch's rows), sizes ((prompt, reply) lengths, one pair per row) -> lists
    of rows, each a micro-batch of at most max_rows. With max_tokens > 0 each also holds at most
    max_tokens padded positions, rows x (longest prompt + longest reply): `pack`'s tensor. Rows go
    longest first, so rows of like length share one and little is padding (verl's
    use_dynamic_bsz: micro-batches by tokens). Without it, rows in order (as ever)."""
    if not max_tokens:
        return [rows[k:k + max_rows] for k in range(0, len(rows), max_rows)]
    order = sorted(range(len(rows)), key=lambda j: -sum(sizes[j]))  # (stable: ties in order)
    parts, P, C = [], 0, 0
    for j in order:
        p, c = sizes[j]
        if p + max(c, 1) > max_tokens:  # (pack gives every row at least one reply position)
            raise ValueError(f"--micro-batch-tokens {max_tokens}: a row of {p} prompt and {c} reply "
                             f"tokens does not fit alone")
        if parts and len(parts[-1]) < max_rows and \
                (len(parts[-1]) + 1) * (max(P, p) + max(C, c, 1)) <= max_tokens:
            parts[-1].append(rows[j])
            P, C = max(P, p), max(C, c)
        else:
            parts.append([rows[j]])
            P, C = p, c
    return parts


def pad_rows(rows, width, device):
    """Float lists (log-probs) right-padded with 0 to `width` -> (B, width)."""
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r[:width])
    return out.to(device)

