"""Tests for variants/distill.py, on-policy distillation: the per-token advantage by hand, a
teacher identical to the student giving zero advantage and no gradient, another teacher's term
reaching the update (and two gloo ranks updating as one process), a tokenizer mismatch refused
before any weight loads, the memory plan's teacher term against the allocated weights, and a
teacher path that is not a model refused in one line with nothing written."""

import json
import os

import pytest
import torch

from test_train import BASE, digit_checkpoint, digit_data, metrics, run_train, torchrun, weights

from run import config, launch
from run import memory_plan as mp
from variants import distill

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student, teacher: the same vocabulary, other weights, data)."""
    d = tmp_path_factory.mktemp("distill")
    return (digit_checkpoint(d / "student"), digit_checkpoint(d / "teacher", seed=1),
            digit_data(d / "train.jsonl"))


def test_the_advantage_by_hand():
    """A_t = c_v A + c_T (log pi_T - log pi_S): student (-1, -2, -0.5), teacher (-0.5, -2.5, -0.5)."""
    student, teacher = [-1.0, -2.0, -0.5], [-0.5, -2.5, -0.5]
    blend = distill.teacher_advantages(student, teacher, 0.8, teacher_coef=1.0, verifier_coef=1.0)
    assert blend.tolist() == pytest.approx([1.3, 0.3, 0.8])
    alone = distill.teacher_advantages(student, teacher, 0.8, teacher_coef=2.0, verifier_coef=0.0)
    assert alone.tolist() == pytest.approx([1.0, -1.0, 0.0])
    per_token = distill.teacher_advantages(student, teacher, [0.1, 0.2, 0.3], 1.0, 0.5)  # REINFORCE++'s
    assert per_token.tolist() == pytest.approx([0.55, -0.4, 0.15])


def opd_flags(student, teacher, data_file, *extra):
    return ["--preset", "opd", "--model", student, "--teacher", teacher, "--data", data_file,
            "--steps", "1", "--eval-limit", "4"] + BASE + ["--mini-batches", "2"] + list(extra)


@pytest.mark.slow
def test_a_teacher_identical_to_the_student_gives_no_advantage_and_no_gradient(models, tmp_path):
    """The student as its own teacher: every token's advantage and the logged KL exactly 0, the
    gradient's norm 0 at each update; another teacher: a KL above 0 and a gradient."""
    student, teacher, data_file = models
    same, other = tmp_path / "same", tmp_path / "other"
    run_train(opd_flags(student, student, data_file, "--out", str(same)))
    run_train(opd_flags(student, teacher, data_file, "--out", str(other)))
    (row,), (row_other,) = metrics(same), metrics(other)
    assert row["teacher_kl"] == 0.0 and row["grad_norm"] == 0.0 and row["updates"] == 2
    samples = [json.loads(line) for line in open(same / "samples.jsonl")]
    assert samples and all(s["advantage"] == 0.0 and s["teacher_kl"] == 0.0 for s in samples)
    assert row_other["teacher_kl"] > 0.01 and row_other["grad_norm"] > 1e-3


def test_with_teacher_gives_each_token_its_term(models, tmp_path):
    """with_teacher on a batch: the advantages per token, c_v A + c_T (log pi_T - log pi_S) from
    the two scoring passes, and each row's mean log pi_S - log pi_T as its reward part."""
    import train
    from test_train import rollouts
    student, teacher, data_file = models
    args, _ = config.parse_config(opd_flags(student, teacher, data_file, "--out", str(tmp_path / "r"),
                                            "--verifier-coef", "0.5", "--teacher-coef", "2"))
    run = launch.setup(args)
    batch = train.with_old_logprobs(run, rollouts())  # the student's pi_old: the teacher set reads it
    batch = train.with_advantages(run, batch)
    out = distill.with_teacher(run, batch, train.scored_logprobs)
    theirs = train.scored_logprobs(run, batch, range(4), model=run.teacher)
    for i in range(4):
        want = [0.5 * batch.advantages[i] + 2 * (t - s) for s, t in zip(batch.old_logprobs[i], theirs[i])]
        assert out.advantages[i] == pytest.approx(want, abs=1e-9)
        kl = sum(s - t for s, t in zip(batch.old_logprobs[i], theirs[i])) / len(theirs[i])
        assert out.reward_parts[i]["teacher_kl"] == pytest.approx(kl)
    assert batch.reward_parts[0] == {}  # the input is left as it was


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(models, tmp_path):
    student, teacher, data_file = models
    common = ["--model", student, "--teacher", teacher, "--teacher-coef", "0.5", "--data", data_file,
              "--steps", "1", "--dynamic-sampling", "--max-refills", "0", "--seed", "5", "--eval-limit", "4"] \
        + BASE + ["--prompts-per-step", "8", "--mini-batches", "2"]
    run_train(common + ["--out", str(tmp_path / "one")])
    run_train(common + ["--out", str(tmp_path / "two")], launcher=torchrun())
    (m1,), (m2,) = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("teacher_kl", "grad_norm", "approx_kl", "accuracy"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), name


def test_a_tokenizer_mismatch_is_refused_before_any_weight_loads(models, tmp_path, monkeypatch):
    student, _, data_file = models
    stranger = digit_checkpoint(tmp_path / "stranger", words=[str(d) for d in range(10)] + ["Answer:"])
    loads = []
    monkeypatch.setattr(launch, "load_model", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(distill.checkpoints, "load_model", lambda *a, **k: loads.append(a))
    args, _ = config.parse_config(["--model", student, "--teacher", stranger, "--data", data_file,
                                   "--out", str(tmp_path / "run")] + BASE)
    with pytest.raises(SystemExit) as refused:
        launch.setup(args)
    said = str(refused.value)
    assert said.startswith("train.py: --teacher: the teacher ") and stranger in said and student in said
    assert "tokenize differently" in said and not loads and not (tmp_path / "run").exists()


@pytest.mark.parametrize("teacher, says", [("missing", "no such directory"), ("empty", "no config.json"),
                                           ("file", "not")])
def test_a_teacher_that_is_not_a_model_is_one_line_and_writes_nothing(models, tmp_path, teacher, says):
    student, _, data_file = models
    paths = {"missing": tmp_path / "nowhere", "empty": tmp_path / "empty", "file": tmp_path / "a.txt"}
    (tmp_path / "empty").mkdir()
    (tmp_path / "a.txt").write_text("not a model")
    out = tmp_path / "run"
    proc = run_train(["--model", student, "--teacher", str(paths[teacher]), "--data", data_file,
                      "--out", str(out)] + BASE, check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("train.py: --teacher: ") and says in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not out.exists()


def test_the_memory_plan_counts_the_teacher_as_allocated(models, tmp_path, monkeypatch):
    """The plan's teacher term against the bytes of the teacher distill.load_teacher loads (fp32
    on a CPU), and its bf16 size on a GPU under bf16; a larger teacher than the student counted
    by its own config.json."""
    student, _, data_file = models
    big = digit_checkpoint(tmp_path / "big", hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    loaded = distill.load_teacher(big, "cpu", bf16_on_cuda=False)
    allocated = sum(p.nbytes for p in loaded.parameters())
    args, _ = config.parse_config(["--model", student, "--teacher", big, "--data", data_file] + BASE)
    cfg = distill.checkpoints.load_config(student)
    args.device = torch.device("cpu")
    terms = {t.name: t for t in mp.for_run(args, cfg, world=1, distributed=False, cuda=False,
                                           longest_prompt=8, capacity=None)[0]}
    assert abs(terms["teacher"].bytes / allocated - 1) < 0.10 and terms["teacher"].phase == "state"
    assert terms["teacher"].bytes == allocated  # (exactly: its parameters in fp32)
    args.dtype = "bfloat16"
    on_gpu = {t.name: t for t in mp.for_run(args, cfg, world=1, distributed=False, cuda=True,
                                            longest_prompt=8, capacity=None)[0]}
    assert on_gpu["teacher"].bytes == allocated / 2
    args.teacher = None
    assert "teacher" not in {t.name for t in mp.for_run(args, cfg, world=1, distributed=False, cuda=False,
                                                        longest_prompt=8, capacity=None)[0]}


def test_teacher_flags_are_checked(capsys):
    for argv, says in [(["--preset", "opd"], "give --teacher MODEL"),
                       (["--teacher-coef", "2"], "--teacher-coef acts only with --teacher"),
                       (["--teacher", "x", "--preset", "dpo"], "--algo dpo has none"),
                       (["--teacher", "x", "--objective", "gspo"], "--objective gspo takes one per sequence"),
                       (["--teacher", "x", "--teacher-coef", "-1"], "--teacher-coef must be >= 0")]:
        with pytest.raises(SystemExit):
            config.parse_config(argv)
        assert says in capsys.readouterr().err, argv
