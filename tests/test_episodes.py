"""episodes.py and multi-turn training: turn prompts carry exactly the instructions, the last
memory and the next page; episodes that end leave the batch; every turn gets its episode's
advantage; the token-level loss over turns is exact under uneven micro-batches (2-rank gloo DDP:
tests/test_train.py's DDP test, memory variant). A scripted mock model plays the turns."""

import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout import Completion  # noqa: E402
from tasks import episodes  # noqa: E402


class CharTokenizer:
    """One token per character, no chat template: format_prompt's plain "Question: ..." form."""
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def scripted_model(reply):
    """A stand-in for rollout.generate: reply(prompt text) -> the completion text, for each
    prompt and sample; every call's prompts are recorded."""
    calls = []

    def generate(model, prompts, sampling=None, *, num_samples=1, **options):
        counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else num_samples
        texts = ["".join(map(chr, p)) for p in prompts]
        calls.append(texts)
        out = []
        for index, (text, count) in enumerate(zip(texts, counts)):
            for sample in range(count):
                tokens = [ord(c) for c in reply(text, sample)]
                out.append(Completion(index, tokens, [-0.5] * len(tokens), "stop"))
        return out
    return generate, calls


def running_total_reply(text, sample):
    """The memory shown plus this page's sale; sample 1 of each record writes a useless memory
    at the first page (later turns are one sample each), so it ends with a wrong total."""
    memory = re.search(r"^Memory: (.*)$", text, re.MULTILINE)
    if memory is None and sample == 1:
        return " lost"
    sold = int(re.search(r"the shop sold (\d+) apples", text).group(1))
    known = memory.group(1) if memory else "0"
    return f" {(int(known) if known.isdigit() else 0) + sold}"


def test_turn_prompts_hold_the_instructions_the_memory_and_only_the_next_page(monkeypatch):
    task = episodes.MemoryTask(pages=4, filler=2)
    records = task.sample(2, random.Random(0))
    fake, calls = scripted_model(running_total_reply)
    monkeypatch.setattr(episodes, "generate", fake)
    played = episodes.play(None, CharTokenizer(), records, 2, [1, 2], template="none")
    assert [len(call) for call in calls] == [2, 4, 4, 4]  # turn 0: one prompt per record
    assert [len(turns) for turns in played] == [4] * 4
    for e, turns in enumerate(played):
        record = records[e // 2]
        sales = [int(s) for s in record["id"].split(":")[-1].split("+")]
        for t, turn in enumerate(turns):
            prompt = "".join(map(chr, turn.prompt))
            assert episodes.INSTRUCTIONS["total"] in prompt and record["pages"][t] in prompt
            assert not any(page in prompt for k, page in enumerate(record["pages"]) if k != t)
            memories = re.findall(r"^Memory: (.*)$", prompt, re.MULTILINE)
            # The memory shown is what the model wrote at the turn before, nothing else.
            assert memories == ([] if t == 0 else [turns[t - 1].text.split(":", 1)[1].strip()])
            assert prompt.endswith("Answer:" if t == 3 else "Memory:")  # the reply's prefix
            if e % 2 == 0:  # the sample that keeps its memory
                assert turn.text == f"{'Answer' if t == 3 else 'Memory'}: {sum(sales[:t + 1])}"
        assert (turns[-1].text == f"Answer: {record['answer']}") == (e % 2 == 0)


def test_the_no_memory_control_shows_no_memory(monkeypatch):
    task = episodes.MemoryTask.from_spec("memory:pages=3,memory=off")
    record = task.sample(1, random.Random(1))[0]
    fake, _ = scripted_model(running_total_reply)
    monkeypatch.setattr(episodes, "generate", fake)
    turns = episodes.play(None, CharTokenizer(), [record], 1, 0, template="none")[0]
    assert len(turns) == 3
    assert all("\nMemory: " not in "".join(map(chr, t.prompt)) for t in turns)
    last_page_sale = int(re.search(r"sold (\d+) apples", record["pages"][-1]).group(1))
    assert turns[-1].text == f"Answer: {last_page_sale}" != f"Answer: {record['answer']}"


def test_episodes_that_end_leave_the_batch(monkeypatch):
    """A math record is one turn; a memory episode ends at its last page, or early when a turn
    writes no memory line. Each generate call holds only the episodes still going."""
    task = episodes.MemoryTask(pages=3, filler=0)
    diary = task.sample(1, random.Random(2))[0]
    math = {"id": "m", "prompt": "What is 2 + 2?", "answer": "4"}

    def reply(text, sample):  # the diary's sample 1 remembers 7, and answers at the next page
        if "What is 2 + 2?" in text:
            return " 4"
        if "Page 1 of 3" in text:
            return f" {5 + 2 * sample}"
        return " 3\nAnswer: 3" if "\nMemory: 7\n" in text else " 5"
    fake, calls = scripted_model(reply)
    monkeypatch.setattr(episodes, "generate", fake)
    played = episodes.play(None, CharTokenizer(), [math, diary], [2, 2], [0, 1], template="none")
    assert [len(turns) for turns in played] == [1, 1, 3, 2]
    assert [len(call) for call in calls] == [2, 2, 1]
    assert all("Page 3 of 3" in text for text in calls[2])
    assert episodes.next_turn(math, 0) is math and episodes.next_turn(math, 1, "4") is None
    assert played[3][-1].text == "Memory: 3\nAnswer: 3"
    assert episodes.read_memory("Memory: 12\nMemory: 15 apples") == "15 apples"
    assert episodes.read_memory("Memory:\nAnswer: 3") == "" and episodes.read_memory("no") is None


def test_memory_task_split_spec_and_errors():
    task = episodes.MemoryTask.from_spec("memory:pages=3,min=1,max=12,filler=1")
    heldout = task.heldout(20)
    assert heldout == task.heldout(20) and len({r["id"] for r in heldout}) == 20
    train_ids = {r["id"] for r in task.sample(500, random.Random(0))}
    assert not train_ids & {r["id"] for r in heldout}
    record = heldout[0]
    sales = [int(s) for s in record["id"].split(":")[-1].split("+")]
    assert record["answer"] == str(sum(sales)) and len(record["pages"]) == 3
    for page, sold in zip(record["pages"], sales):
        assert f"sold {sold} apples" in page and len(re.findall(r"\d+ apples", page)) == 1
    for spec in ("memory:pages=1", "memory:memory=maybe", "memory:colour=red", "memory:max=x",
                 "memory:filler=99", "memory:ask=last", "mem", "memory:max=\u0669"):
        with pytest.raises(episodes.data.DataError):
            episodes.MemoryTask.from_spec(spec)


def test_the_recall_question_needs_the_first_page_kept_past_the_others(monkeypatch):
    """ask=first: the answer is day 1's sale, shown on page 1 only; a memory that keeps it is
    right, one overwritten by the next page's sale is not."""
    task = episodes.MemoryTask.from_spec("memory:pages=3,max=9,filler=0,ask=first")
    records = [r for r in task.sample(50, random.Random(3))
               if len(set(r["id"].split(":")[-1].split("+"))) == 3][:2]  # three different sales
    sales = [[int(s) for s in r["id"].split(":")[-1].split("+")] for r in records]
    assert [r["answer"] for r in records] == [str(s[0]) for s in sales]

    # Keeps a remembered number, else writes the page's sale; each diary's second episode
    # forgets at page 1, so its memory becomes page 2's sale.
    def reply(text, sample):
        memory = re.search(r"^Memory: (\d+)$", text, re.MULTILINE)
        sold = re.search(r"the shop sold (\d+) apples", text).group(1)
        if "Page 1 of" in text:
            return " forgot" if sample == 1 else f" {sold}"
        return f" {memory.group(1) if memory else sold}"
    fake, _ = scripted_model(reply)
    monkeypatch.setattr(episodes, "generate", fake)
    played = episodes.play(None, CharTokenizer(), records, 2, 0, template="none")
    for e, turns in enumerate(played):
        prompts = ["".join(map(chr, t.prompt)) for t in turns]
        assert all(episodes.QUESTIONS["first"] in p and episodes.INSTRUCTIONS["first"] in p
                   for p in prompts)
        assert episodes.ASK_ANSWER["first"] in prompts[-1] and prompts[-1].endswith("Answer:")
        assert (turns[-1].text == f"Answer: {records[e // 2]['answer']}") == (e % 2 == 0)


def multi_turn_rollouts():
    """Two prompts x two episodes: episodes of 3, 1, 2 and 2 turns, rows episode-major."""
    import train
    turn = [0, 1, 2, 0, 0, 1, 0, 1]
    correct = [True] * 3 + [False] + [False] * 2 + [True] * 2
    return train.Rollouts(
        records=[{"id": "a", "answer": "1"}, {"id": "b", "answer": "2"}], group_sizes=[4, 4],
        prompts=[[2, 4, 5], [2, 6], [2, 7, 8, 9], [2, 4, 5], [2, 5], [2, 6, 6], [2, 5], [2, 7]],
        tokens=[[7, 8], [9], [10, 11, 3], [12], [5, 6, 7], [8], [9, 9], [4, 5, 6, 7]],
        sampler_logprobs=[[-1.0] * n for n in (2, 1, 3, 1, 3, 1, 2, 4)], truncated=[False] * 8,
        rewards=[1.0 if c else -1.0 for c in correct], correct=correct,
        reward_parts=[{}] * 8, stale=[False] * 8, turn=turn)


def test_every_turn_gets_its_episode_advantage():
    import train
    batch = multi_turn_rollouts()
    assert batch.episode_starts() == [0, 3, 4, 6] and batch.episodes_per_group() == [2, 2]
    assert batch.episode_index() == [0, 0, 0, 1, 2, 2, 3, 3]
    run = SimpleNamespace(args=SimpleNamespace(adv_estimator="grpo"))
    advantages = train.with_advantages(run, batch).advantages
    # Per group, one advantage per episode from the two outcomes (+-1/sqrt(2)), on every turn:
    # a 3-turn episode does not weigh three times in the group's mean and std.
    a = 0.5 ** 0.5
    assert advantages == pytest.approx([a, a, a, -a, -a, -a, a, a], abs=1e-5)
    # Dynamic sampling reads episodes: a group is informative when its episodes disagree.
    assert train.dapo.keep_groups(batch.correct, batch.group_sizes).tolist() == [True, True]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_train import digit_checkpoint, digit_data
    d = tmp_path_factory.mktemp("tiny")
    return digit_checkpoint(d / "model"), digit_data(d / "train.jsonl")


@pytest.mark.parametrize("micro", ["1", "3"])
def test_the_loss_over_turns_equals_one_batch_under_uneven_micro_batches(tiny, tmp_path, micro):
    """Turns of one episode fall into different micro-batches (sizes 1 and 3 split 8 rows
    unevenly); the token counts of the whole batch divide every one, so the gradient equals
    the gradient of the whole batch at once."""
    import train
    from test_train import in_process_run
    updated = {}
    for size in ("8", micro):
        run = in_process_run(tmp_path / size, tiny, "--micro-batch-size", size)
        batch = train.with_old_logprobs(run, train.with_advantages(run, multi_turn_rollouts()))
        sums, _ = train.update(run, batch)
        assert sums["loss_tokens"] == 17 and sums["updates"] == 1
        updated[size] = {name: p.grad.clone() for name, p in run.policy.named_parameters()}
    assert max(g.abs().max() for g in updated["8"].values()) > 1e-3  # not a trivial gradient
    for name, grad in updated["8"].items():
        assert torch.allclose(grad, updated[micro][name], atol=1e-7, rtol=1e-5), name


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tiny digit model with room for a diary page's prompt (its words are <unk> to it)."""
    from test_train import digit_checkpoint
    return digit_checkpoint(tmp_path_factory.mktemp("tiny_long") / "model", context=160)


MEMORY_RUN = ["--data", "memory:pages=2,min=0,max=4,filler=0", "--eval-limit", "4",
              "--samples", "4", "--max-new-tokens", "3", "--lr", "1e-3", "--warmup-steps", "1",
              "--micro-batch-size", "3", "--dtype", "float32", "--overlong-cache", "1",
              "--time-limit", "0", "--seed", "13", "--mini-batches", "2", "--dynamic-sampling",
              "--max-refills", "0", "--compile", "off"]


@pytest.mark.slow
def test_memory_run_on_two_ranks_equals_one_process(tiny_long, tmp_path):
    """A multi-turn run on two gloo ranks: the same weights and metrics as one process (the
    turns of an episode spread over micro-batches and ranks' token counts), and the turn
    metrics logged."""
    from test_train import UPDATE_METRICS, metrics, run_train, torchrun, weights
    common = ["--model", tiny_long, "--steps", "1", "--prompts-per-step", "8"] + MEMORY_RUN
    run_train(common + ["--out", str(tmp_path / "one")])
    run_train(common + ["--out", str(tmp_path / "two")], launcher=torchrun())
    m1, m2 = metrics(tmp_path / "one")[0], metrics(tmp_path / "two")[0]
    assert m1["groups_kept"] == m2["groups_kept"] > 0
    assert m1["turns_per_episode"] == m2["turns_per_episode"] == 2.0
    assert m1["memory_length"] > 0 and m1["context_max"] > 60
    for key in UPDATE_METRICS:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, (a[k] - b[k]).abs().max())


def test_where_episodes_do_not_fit_the_answer_is_clear(capsys):
    """DPO pairs single completions and eval.py scores single turns: both refuse the memory
    task, naming why; a held-out split too small for --eval-limit names the spec."""
    from run import config
    with pytest.raises(SystemExit):
        config.parse_config(["--preset", "dapo-memory", "--algo", "dpo"])
    assert "--algo dpo" in capsys.readouterr().err
    with pytest.raises(episodes.data.DataError, match="train.py evaluates them"):
        episodes.data.load_records("memory:pages=2")
    with pytest.raises(episodes.data.DataError, match="widen min..max"):
        episodes.MemoryTask.from_spec("memory:pages=2,max=3").heldout(50)


def test_a_memory_reply_stops_at_a_line_break():
    """Every reply is one line: the tokens holding a line break are the memory task's extra stops."""
    from rollout import line_break_ids

    class Tokenizer(CharTokenizer):
        def __len__(self):
            return 128
    assert line_break_ids(Tokenizer()) == [10]
