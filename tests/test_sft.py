"""Tests for variants/sft.py, the supervised warm start: its loss by hand on a 2-row batch, only
completion tokens carrying it, one batch's gradient from micro-batches and from two gloo ranks,
every data shape it reads through a 2-step run, resume bit-exact, and bad rows refused in one
line before anything is written."""

import json
import os

import pytest
import torch

from test_train import (BASE, assert_same_run, digit_checkpoint, digit_data, kill_then_resume, metrics,
                        run_train, torchrun, weights)

from run import config, launch
from variants import sft

pytestmark = pytest.mark.usefixtures("one_thread")

# test_train's flags less those an SFT step refuses (it samples nothing in training)
SFT_BASE = [value for k, value in enumerate(BASE) if not {BASE[k], BASE[k - 1]} &
            {"--samples", "--temperature", "--overlong-cache"}]

CHAT = ("{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> {% endif %}")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """The digit model of test_train.py with a chat template whose turns end in </s> (its EOS)."""
    from transformers import AutoTokenizer
    model = digit_checkpoint(tmp_path_factory.mktemp("chat") / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(model)
    return model


def sums(n=16):
    return [(i % 5, (3 * i) % 5) for i in range(n)]


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


SHAPES = {  # each data shape SFT reads: rows of the digit vocabulary
    "prompt-completion": lambda a, b: {"prompt": f"What is {a} + {b} ?", "completion": f"Answer: {a + b}"},
    "conversational": lambda a, b: {"prompt": [{"role": "user", "content": f"What is {a} + {b} ?"}],
                                    "completion": [{"role": "assistant", "content": f"Answer: {a + b}"}]},
    "messages": lambda a, b: {"messages": [{"role": "user", "content": f"What is {a} + {b} ?"},
                                           {"role": "assistant", "content": f"the sum is {a + b}"}]},
    "gsm8k": lambda a, b: {"question": f"What is {a} + {b} ?", "answer": f"the sum <<{a}+{b}={a + b}>> is "
                           f"{a + b}\n#### {a + b}"},
    "math": lambda a, b: {"problem": f"What is {a} + {b} ?", "solution": f"the sum is {a + b}",
                          "answer": str(a + b)},
}


# ---- the examples ------------------------------------------------------------------------------

def test_each_shape_gives_its_prompt_and_completion():
    rows = {name: make(3, 4) for name, make in SHAPES.items()}
    ex = {name: sft.example_from_row(row, "d.jsonl", 1, "dapo") for name, row in rows.items()}
    assert ex["prompt-completion"]["prompt"] == "What is 3 + 4 ?"
    assert ex["prompt-completion"]["completion"] == "Answer: 7"
    assert ex["conversational"]["messages"] == [{"role": "user", "content": "What is 3 + 4 ?"}]
    assert ex["conversational"]["completion"] == "Answer: 7"
    assert ex["messages"]["messages"] == [{"role": "user", "content": "What is 3 + 4 ?"}]
    assert ex["messages"]["completion"] == "the sum is 7"
    # GSM8K: the reasoning without its calculator annotations, then the template's answer line
    assert ex["gsm8k"]["completion"] == "the sum  is 7\nAnswer: 7"
    assert sft.example_from_row(rows["gsm8k"], "d", 1, "boxed")["completion"].endswith("$\\boxed{7}$.")
    assert ex["math"] == {"prompt": "What is 3 + 4 ?", "completion": "the sum is 7", "id": "d.jsonl:1",
                          "answer": "7"}


@pytest.mark.parametrize("row, says", [
    ({"prompt": "What is 1 + 2 ?", "answer": "3"}, "row 1: no completion to learn"),
    ({"prompt": "What is 1 + 2 ?", "completion": "  "}, "row 1: field 'completion': empty"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "the last message is the user's"),
    ({"completion": "Answer: 3"}, "row 1: field 'prompt': missing"),
    ({"prompt": "What is 1 + 2 ?", "completion": 3}, "field 'completion': expected str, got int"),
])
def test_a_row_without_a_completion_to_learn_is_named(row, says):
    with pytest.raises(sft.data.DataError, match=says):
        sft.example_from_row(row, "d.jsonl", 1, "dapo")


def test_a_chat_reply_ends_with_the_templates_end_of_turn(tiny_chat):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat)
    prompt, reply = sft.example_ids({"prompt": "What is 3 + 4 ?", "completion": "Answer: 7"},
                                    tokenizer, "none", [3])
    assert tokenizer.decode(prompt) == "<s> What is 3 + 4 ? </s> <s>"
    assert tokenizer.convert_ids_to_tokens(reply) == ["Answer:", "7", "</s>"]  # stops where it stopped


def test_a_plain_prompts_reply_goes_on_from_its_answer_and_each_template_is_taught(tmp_path):
    """A tokenizer without a chat template: the prompt ends "Answer:", so the synthetic task's
    reply is " 7" then the EOS, not "Answer: Answer: 7"; the xml and boxed templates' replies
    are in their own formats; no EOS at all leaves the reply unended rather than ending in None."""
    from types import SimpleNamespace
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(digit_checkpoint(tmp_path / "plain"))
    prompt, reply = sft.example_ids({"prompt": "What is 3 + 4 ?", "answer": "7"}, tokenizer, "none", [3])
    assert tokenizer.decode(prompt).endswith("Answer:")
    assert tokenizer.decode(reply[:-1]).strip() == "7" and reply[-1] == tokenizer.eos_token_id
    assert sft.written_reply("", "7", "xml") == "<reasoning>\n\n</reasoning>\n<answer>\n7\n</answer>"
    assert sft.written_reply("3 + 4", "7", "boxed") == "3 + 4\nThe final answer is $\\boxed{7}$."
    assert sft.end_of_turn(SimpleNamespace(eos_token_id=None, chat_template=None), "none", [3]) == []


# ---- the loss ----------------------------------------------------------------------------------

def test_the_loss_of_a_two_row_batch_by_hand():
    """Row 1: two completion tokens (one padding position), row 2: three; the mean of the five
    negative log-probs: (0.5 + 1.0 + 2.0 + 0.25 + 0.75) / 5 = 0.9. A mini-batch of 10 loss tokens
    over all its micro-batches divides by 10."""
    logp = torch.tensor([[-0.5, -1.0, -7.0], [-2.0, -0.25, -0.75]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert float(sft.sft_loss(logp, mask)) == pytest.approx(0.9)
    assert float(sft.sft_loss(logp, mask, torch.tensor(10.0))) == pytest.approx(0.45)


def test_the_loss_reads_the_completion_tokens_only(tiny_chat):
    """Through example_ids, pack and the model: the loss is the mean negative log-prob of the
    completion's tokens under a full forward's log-softmax, none of the prompt's; a prompt token
    changed moves the loss only as the completion's context (it equals the same mean again), while
    a mean that read the prompt's tokens too would differ."""
    from transformers import AutoTokenizer
    from model import token_logprobs
    from run.checkpoints import load_model
    model, tokenizer = load_model(tiny_chat, dtype=torch.float32, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat)
    losses = []
    for question in ("What is 3 + 4 ?", "What is 3 + 9 ?"):
        prompt, reply = sft.example_ids({"prompt": question, "completion": "Answer: 7"}, tokenizer, "none", [3])
        packed = sft.data.pack([prompt], [reply], "cpu")
        with torch.no_grad():
            loss = float(sft.sft_loss(token_logprobs(model, packed.ids, packed.attn, start=packed.start),
                                      packed.mask))
        ids = torch.tensor([prompt + reply])
        with torch.no_grad():
            every = torch.log_softmax(model(ids).float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        by_hand = -every[len(prompt) - 1:].mean()  # the reply's tokens, each predicted from before it
        assert loss == pytest.approx(float(by_hand), rel=1e-5)
        assert abs(loss - float(-every.mean())) > 1e-3  # (the prompt's would change it)
        losses.append(loss)
    assert losses[0] != losses[1]


def sft_run(tmp_path, model, *extra):
    data_file = write_rows(tmp_path / "sft.jsonl", [SHAPES["prompt-completion"](a, b) for a, b in sums()])
    args, _ = config.parse_config(["--preset", "sft", "--model", model, "--data", data_file,
                                   "--out", str(tmp_path / "run"), "--prompts-per-step", "8",
                                   "--max-new-tokens", "3", "--compile", "off", "--dtype", "float32"]
                                  + list(extra))
    return launch.setup(args)


def gradient(run, micro_batch_size, micro_batch_tokens=0, monkeypatch=None):
    """The gradient of one SFT update over the stream's first 8 examples (the optimizer step
    replaced by a copy of the gradients)."""
    run.args.micro_batch_size, run.args.micro_batch_tokens = micro_batch_size, micro_batch_tokens
    grads = {}

    def capture(optimizer, model, loss_sum, max_norm):
        grads.update({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        return {"updates": 1, "skipped_updates": 0, "grad_norm": 0.0}
    monkeypatch.setattr(sft.distributed, "optimizer_step", capture)
    examples = sft.data.PromptStream(run.source, 8).take(8)
    prompts, replies = zip(*(sft.example_ids(e, run.tokenizer, "none", run.stop_ids) for e in examples))
    sft.sft_update(run, list(prompts), list(replies))
    return grads


def test_micro_batches_give_the_one_batch_gradient(tiny_chat, tmp_path, monkeypatch):
    run = sft_run(tmp_path, tiny_chat, "--template", "none")
    whole = gradient(run, 8, monkeypatch=monkeypatch)
    for size, tokens in ((1, 0), (3, 0), (8, 24)):  # one row each, uneven, by a token budget
        split = gradient(run, size, tokens, monkeypatch=monkeypatch)
        assert whole.keys() == split.keys() and whole
        for name in whole:
            assert torch.allclose(whole[name], split[name], atol=1e-6, rtol=1e-5), (size, tokens, name)


@pytest.mark.slow
def test_two_gloo_ranks_give_one_process_update(tiny_chat, tmp_path):
    """The same 8 examples a step in one process and on two ranks: the same loss, gradient norm
    (before clipping: a wrong divisor scales it) and weights after two steps."""
    data_file = write_rows(tmp_path / "sft.jsonl", [SHAPES["gsm8k"](a, b) for a, b in sums()])
    common = ["--preset", "sft", "--model", tiny_chat, "--data", data_file, "--steps", "2",
              "--prompts-per-step", "8", "--micro-batch-size", "3", "--lr", "1e-3", "--warmup-steps", "0",
              "--compile", "off", "--dtype", "float32", "--eval-limit", "4", "--max-new-tokens", "3"]
    run_train(common + ["--out", str(tmp_path / "one")])
    run_train(common + ["--out", str(tmp_path / "two")], launcher=torchrun())
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
        for key in ("loss", "grad_norm", "loss_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-6, rtol=0), name


# ---- runs --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES) + ["arithmetic"])
def test_two_steps_on_each_data_shape(tiny_chat, tmp_path, shape):
    """Two steps and final/ on each shape (the synthetic task: its problems, "Answer: X"), the
    loss falling at a high rate, the held-out evaluation at steps 0 and 2."""
    data_file = "arithmetic:max=4" if shape == "arithmetic" else \
        write_rows(tmp_path / "sft.jsonl", [SHAPES[shape](a, b) for a, b in sums()])
    out = tmp_path / "run"
    run_train(["--preset", "sft", "--model", tiny_chat, "--data", data_file, "--steps", "2",
               "--prompts-per-step", "8", "--lr", "1e-2", "--warmup-steps", "0", "--out", str(out),
               "--eval-data", digit_data(tmp_path / "eval.jsonl", n=4), "--eval-limit", "4",
               "--max-new-tokens", "3", "--compile", "off", "--dtype", "float32"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] < rows[0]["loss"]
    assert all(r["loss_tokens"] > 0 and r["updates"] == r["step"] for r in rows)
    assert [json.loads(line)["step"] for line in open(out / "eval.jsonl")] == [0, 2]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(tiny_chat, tmp_path):
    data_file = write_rows(tmp_path / "sft.jsonl", [SHAPES["messages"](a, b) for a, b in sums(40)])
    common = ["--preset", "sft", "--model", tiny_chat, "--data", data_file, "--steps", "30",
              "--checkpoint-every", "1", "--prompts-per-step", "4", "--eval-limit", "4",
              "--eval-every", "10", "--max-new-tokens", "3"] + SFT_BASE
    run_train(common + ["--out", str(tmp_path / "straight")])
    kill_then_resume(common, tmp_path / "killed")
    assert_same_run(tmp_path / "straight", tmp_path / "killed")


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "What is 1 + 2 ?", "answer": "3"}], "row 1: no completion to learn"),
    ([{"prompt": "What is 1 + 2 ?", "completion": "Answer: 3"},
      {"prompt": "What is 1 + 2 ?", "completion": ""}], "row 2: field 'completion': empty"),
])
def test_bad_data_is_one_line_and_writes_nothing(tiny_chat, tmp_path, rows, says):
    out = tmp_path / "run"
    proc = run_train(["--preset", "sft", "--model", tiny_chat, "--data", write_rows(tmp_path / "d.jsonl", rows),
                      "--out", str(out), "--max-new-tokens", "3", "--compile", "off"], check=False)
    assert proc.returncode != 0 and says in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert not os.path.exists(out)


def test_sft_refuses_what_it_cannot_learn(capsys):
    for argv, says in [(["--preset", "sft", "--data", "countdown"], "learns given completions"),
                       (["--preset", "sft", "--teacher", "x"], "--algo sft has none"),
                       (["--preset", "sft", "--kl", "k3"], "--kl acts in a step that samples"),
                       (["--preset", "sft", "--samples", "4"], "--samples acts in a step that samples"),
                       (["--preset", "sft", "--router-aux-coef", "0.01"], "--router-aux-coef acts in"),
                       (["--preset", "sft", "--tis-mode", "mask"], "--tis-mode acts in a step that samples")]:
        with pytest.raises(SystemExit):
            config.parse_config(argv)
        assert says in capsys.readouterr().err
    args, _ = config.parse_config(["--preset", "sft", "--correct-reward", "0.5"])  # a --reward's
    assert args.correct_reward == 0.5  # held-out threshold: an SFT run's evaluation reads it


def test_an_sft_run_is_plotted_tabled_and_benched(tmp_path, capsys):
    """An SFT run's logs have no sampled replies: runs.py plots it alone and tables it beside an
    RL run (its rollout column "-"), and --bench's line names its update alone."""
    import shutil
    from pathlib import Path
    from run import runs
    assets = Path(__file__).resolve().parent.parent / "assets" / "sft-opd-cpu"
    for name in ("sft-s0", "dapo-s0"):
        shutil.copytree(assets / name, tmp_path / name)
    runs.plot([str(tmp_path / "sft-s0")])
    assert (tmp_path / "sft-s0" / "curve.png").exists()
    table = runs.summary_table([runs.load_run(str(tmp_path / n)) for n in ("sft-s0", "dapo-s0")])
    assert table.splitlines()[2].startswith("| sft | 1 | 70.0% | 70.0% |") and "| - | 90 |" in table
    row = json.loads((tmp_path / "sft-s0" / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()  # (the plot's path)
    launch.print_seconds(3, {**row, "seconds_update": 1.25})  # an SFT step's row, as logged
    assert capsys.readouterr().out.strip() == "step 3: update 1.2 s"
