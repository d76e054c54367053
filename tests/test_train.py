"""train.py on a tiny random model: smoke run, every DAPO component changing the run, exact resume
after SIGKILL, DDP (gloo) equal to one process, bad data rejected before training, non-finite
updates skipped, and the pieces of a step (steps 3-5) on a Run built in-process."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port, needs_cpp_compiler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIGITS = [str(d) for d in range(10)]
WORDS = ["What", "is", "+", "?", "Question:", "Answer:", "the", "sum"]


def digit_checkpoint(directory, seed=0, context=64, moe=False, words=None, **sizes):
    """A random 2-layer Llama (moe: Qwen3-MoE, 4 experts, top-2) whose word-level vocabulary
    has the digits, so that a sampled answer is sometimes right and groups carry signal
    (`words`: another vocabulary; `sizes`: other widths or layers, e.g. hidden_size=256)."""
    import tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )
    special = ["<unk>", "<pad>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special + (words or DIGITS + WORDS))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    shape = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                 bos_token_id=2, eos_token_id=3, pad_token_id=1, tie_word_embeddings=True) | sizes
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, norm_topk_prob=True)) \
        if moe else LlamaForCausalLM(LlamaConfig(**shape))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def digit_data(path, n=16, extra=None):
    rows = [{"prompt": f"What is {a} + {b} ?", "answer": str((a + b) % 10), "id": f"q{i}"}
            for i, (a, b) in enumerate((i % 5, (3 * i) % 5) for i in range(n))]
    if extra:
        rows.append(extra)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return digit_checkpoint(d / "model"), digit_data(d / "train.jsonl")


BASE = ["--prompts-per-step", "4", "--samples", "4", "--max-new-tokens", "3", "--lr", "1e-3",
        "--warmup-steps", "1", "--temperature", "1.0", "--micro-batch-size", "3",
        "--dtype", "float32",  # tests that want the bf16 path say so; "auto" differs by CPU
        "--overlong-cache", "1", "--time-limit", "0",
        "--compile", "off"]  # compiled blocks cost a compile per run: their own tests say them


def flags(**changes):
    """BASE with some flags changed or added: flags(time_limit="0.05", prompts_per_step="8")."""
    out = list(BASE)
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def run_train(args, env_extra=None, check=True, launcher=None, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    cmd = (launcher or [sys.executable]) + [str(ROOT / "train.py")] + args
    # In a session of its own, so that a hung run (torchrun and its ranks) can be killed whole.
    popen = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.communicate()
        raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(l) for l in f]
    for r in rows:  # timings differ between runs; everything else must not
        for k in [k for k in r if k.startswith(("seconds", "tokens_per_second", "train_seconds",
                                                  "peak_memory"))]:
            del r[k]
    return rows


def weights(run_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(run_dir, "final", "model.safetensors"))


def in_process_run(tmp_path, tiny, *extra):
    """A launch.Run built in this process (no torchrun): for the pieces of a step."""
    from run import config, launch
    model_dir, data_file = tiny
    args, _ = config.parse_config(["--model", model_dir, "--data", data_file, "--out",
                                   str(tmp_path / "run"), "--mini-batches", "1"] + BASE + list(extra))
    return launch.setup(args)


def rollouts(**fields):
    """A train.Rollouts of two prompts x two completions, with these fields changed."""
    import train
    batch = dict(records=[{"id": "a", "answer": "1"}, {"id": "b", "answer": "2"}],
                 group_sizes=[2, 2], prompts=[[2, 4, 5], [2, 4, 5], [2, 6], [2, 6]],
                 tokens=[[7, 8], [9], [10, 11, 3], [12]],
                 sampler_logprobs=[[-1.0, -2.0], [-0.5], [-1.5, -0.1, -0.2], [-3.0]],
                 truncated=[False] * 4, rewards=[1.0, -1.0, -1.0, 1.0],
                 correct=[True, False, False, True], reward_parts=[{}] * 4, stale=[False] * 4)
    return train.Rollouts(**{**batch, **fields})


@pytest.mark.slow
def test_smoke_run_writes_everything(tiny, tmp_path):
    model_dir, data_file = tiny
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", data_file, "--steps", "3", "--out", str(out)]
                     + flags(mini_batches="2"))
    assert {"config.json", "metrics.jsonl", "checkpoint.pt", "final"} <= set(os.listdir(out))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "accuracy", "groups_kept", "clip_frac_high", "entropy", "grad_norm",
                "sampler_trainer_mismatch", "response_length", "updates", "ratio_max"):
        assert key in rows[0]
    # Two updates per step, counted apart from the steps.
    assert [r["updates"] for r in rows] == [2, 4, 6]
    # Peak memory each step, and a few completions a step with what they earned.
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_memory_mib"] > 100 for r in raw)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    assert {"prompt", "completion", "reward", "advantage", "correct", "overlong"} <= set(samples[0])
    # The sampler's log-probs are the trainer's (same fp32 weights, same temperature).
    assert all(r["sampler_trainer_mismatch"] < 1e-4 for r in rows)
    # A short summary opens the run, not the whole config (that is in config.json).
    assert "each step" in proc.stdout and max(len(line) for line in proc.stdout.splitlines()) < 200
    # The final model loads in transformers and differs from the start (it trained).
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(model_dir)
    diff = max((a - b).abs().max().item() for a, b in zip(final.parameters(), start.parameters()))
    assert diff > 0
    # An existing run directory is never overwritten.
    again = run_train(["--model", model_dir, "--data", data_file, "--out", str(out)] + BASE,
                      check=False)
    assert again.returncode != 0 and "already exists" in again.stderr


def test_every_preset_parses_and_flags_override():
    import dapo
    from run import config
    for name in dapo.PRESETS:
        teacher = ["--teacher", "x"] if dapo.PRESETS[name].get("verifier_coef") == 0 else []  # opd
        args, _ = config.parse_config(["--preset", name, "--model", "x"] + teacher)
        for key, value in dapo.PRESETS[name].items():
            assert getattr(args, key) == value, (name, key)
    args, explicit = config.parse_config(["--preset", "grpo", "--model", "x", "--kl-coef", "0.5"])
    assert args.kl == "k3" and args.kl_coef == 0.5 and explicit == {"preset", "model", "kl_coef"}
    default, _ = config.parse_config([])
    assert default.lr == config.CPU_DEFAULTS["lr"] and default.dynamic_sampling
    assert default.mini_batches > 1  # the default run's clip-higher acts


def test_abbreviated_flags_are_refused_not_overridden(capsys):
    """`--temperat 0.5` used to parse as --temperature, and the preset then overrode it."""
    from run import config
    with pytest.raises(SystemExit) as error:
        config.parse_config(["--temperat", "0.5"])
    assert error.value.code == 2 and "--temperat" in capsys.readouterr().err
    args, _ = config.parse_config(["--temperature=0.5"])
    assert args.temperature == 0.5


def test_dapo_ppl_replaces_the_overlong_punishment():
    from run import config
    args, _ = config.parse_config(["--preset", "dapo-ppl", "--model", "x"])
    assert args.ppl_penalty == "replace" and not args.overlong_penalty
    args, _ = config.parse_config(["--preset", "dapo-ppl", "--model", "x", "--ppl-penalty", "beside"])
    assert args.ppl_penalty == "beside" and args.overlong_penalty


def test_overlong_window_scales_with_the_budget():
    """DAPO's 4,096 of 20,480 is a fifth; a fraction keeps it a fifth at any budget (it used to
    jump from 20% to 100% of the budget at 4,097 tokens)."""
    import argparse

    from run.config import overlong_cache_tokens
    def cache(value, budget):
        return overlong_cache_tokens(argparse.Namespace(overlong_cache=value, max_new_tokens=budget))
    assert cache(0.2, 20480) == 4096 and cache(0.2, 4097) == 819 and cache(0.2, 64) == 13
    assert cache(16, 64) == 16 and cache(0.001, 64) == 1


def test_learning_rate_counts_training_steps():
    """Warm-up and cosine count training steps: all mu updates of a step share one rate, and at
    mu > 1 the schedule does not reach its floor early."""
    import argparse

    from train import lr_at
    args = argparse.Namespace(lr=1.0, warmup_steps=2, lr_schedule="cosine", steps=12)
    rates = [lr_at(step, args) for step in range(12)]
    assert rates[:2] == [0.5, 1.0] and rates[2] == pytest.approx(1.0)
    assert rates[7] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert rates[11] > 0.1 and lr_at(12, args) == pytest.approx(0.1)


@pytest.mark.slow
def test_schedule_and_steps_in_a_run(tiny, tmp_path):
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "4", "--out", str(out),
               "--lr-schedule", "cosine"] + flags(mini_batches="4", warmup_steps="2", lr="1e-3"))
    rows = metrics(out)
    expected = [1e-3 * f for f in (0.5, 1.0, 1.0, 0.55)]  # cosine over steps 2..4
    assert [r["lr"] for r in rows] == pytest.approx(expected)
    assert [r["updates"] for r in rows] == [4, 8, 12, 16]


@pytest.mark.slow
def test_each_ladder_rung_changes_the_run(tiny, tmp_path):
    """DAPO Table 1 on a tiny model, 2 steps a rung: every rung's weights differ from the rung
    before it (rung 2, clip-higher, was bit-equal to rung 1 at one update per step), and with
    mu > 1 the clip acts."""
    import dapo
    model_dir, _ = tiny
    # One answer for every prompt (what one sample learns moves the others' ratios), room to stop
    # before the budget (else overlong filtering leaves almost no loss token), and more samples
    # than updates (with one sample per mini-batch every aggregation is the same).
    data_file = learnable_data(tmp_path / "learnable.jsonl")
    previous, clipped, ratio_max = None, 0.0, 1.0
    for name, _ in dapo.LADDER:
        out = tmp_path / name
        run_train(["--preset", name, "--model", model_dir, "--data", data_file, "--steps", "2",
                   "--max-refills", "1", "--template", "none", "--out", str(out)]
                  + flags(lr="1e-2", max_new_tokens="24", prompts_per_step="8", seed="1"))  # 2 a mini-batch
        assert json.loads((out / "config.json").read_text())["mini_batches"] == 16  # the paper's
        if name == "ladder-0-naive-grpo":
            assert [r["updates"] for r in metrics(out)] == [16, 32]
        clipped = max([clipped] + [r["clip_frac_high"] for r in metrics(out)])
        ratio_max = max([ratio_max] + [r["ratio_max"] or 0.0 for r in metrics(out)])
        now = weights(out)
        if previous is not None:
            assert any(not torch.equal(now[k], previous[k]) for k in now), name
        previous = now
    assert clipped > 0 and ratio_max > 1.28


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    ["--mini-batches", "2"],
    # State beyond weights and data: carried surplus groups (one step stale), the RNG of the
    # harder variants, per-prompt accuracies.
    ["--adversarial", "--keep-surplus", "--adaptive-budget", "--lr", "3e-2", "--max-refills", "2"],
    # The GPU default: rollouts from a bf16 copy, which a resume must refresh from the checkpoint.
    ["--dtype", "bfloat16", "--tis-cap", "2"],
], ids=["dapo", "adversarial-surplus-adaptive", "bf16"])
def test_resume_after_sigkill_is_bit_identical(tiny, tmp_path, variant):
    model_dir, data_file = tiny
    if "--adversarial" in variant:
        data_file = learnable_data(tmp_path / "learnable.jsonl")
    common = ["--model", model_dir, "--data", data_file, "--steps", "5", "--dynamic-sampling",
              "--max-refills", "1", "--checkpoint-every", "1"] + BASE + variant
    straight = tmp_path / "straight"
    run_train(common + ["--out", str(straight)])
    if "--keep-surplus" in variant:  # the run must carry groups across the steps where it may be killed
        carried = [r["groups_carried"] for r in metrics(straight)]
        assert carried[1] + carried[2] > 0, carried

    killed = tmp_path / "killed"
    kill_then_resume(common, killed)
    assert_same_run(straight, killed)


@pytest.mark.slow
def test_checkpoints_by_time_keep_the_one_before(tiny, tmp_path):
    """By default a checkpoint every few minutes and one at the end (not one per step: the
    default run wrote 73 GB); the one before the newest is kept as a fallback."""
    model_dir, data_file = tiny
    by_time = tmp_path / "by-time"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "3", "--out", str(by_time)] + BASE)
    assert (by_time / "checkpoint.pt").exists() and not (by_time / "checkpoint-previous.pt").exists()
    every = tmp_path / "every"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "3", "--out", str(every),
               "--checkpoint-every", "1"] + BASE)
    steps = [torch.load(every / name, weights_only=True)["progress"]["step"]
             for name in ("checkpoint-previous.pt", "checkpoint.pt")]
    assert steps == [2, 3]


def learnable_data(path, n=16):
    """Every answer is 7 and every row has a hint: at a high learning rate the tiny model soon
    answers some groups all right, some all wrong, so dynamic sampling has surplus groups to
    carry and signal-less groups to turn into adversarial variants."""
    rows = [{"prompt": f"What is {i % 5} + {(3 * i) % 5} ?", "answer": "7", "id": f"q{i}",
             "hint": "7"} for i in range(n)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def kill_then_resume(common, killed, launcher=None):
    """Starts train.py, SIGKILLs it (all its processes) once it has checkpointed at least two
    steps, then runs --resume to the end."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen((launcher or [sys.executable]) + [str(ROOT / "train.py")] + common
                            + ["--out", str(killed)], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (killed / "checkpoint.pt").exists() and (killed / "metrics.jsonl").exists() and \
                len((killed / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "the run finished before it could be killed"
    run_train(["--resume", str(killed)], launcher=launcher)


def assert_same_run(straight, resumed):
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert metrics(straight) == metrics(resumed)


def assert_close_runs(a_dir, b_dir, atol, keys=None, rel=1e-3, metric_atol=None):
    """The same run within float tolerance: weights and the metrics `keys` (default every one),
    for runs whose sums are reduced in another order or whose kernels are not bitwise
    reproducible."""
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())
    for row_a, row_b in zip(metrics(a_dir), metrics(b_dir), strict=True):
        assert keys is not None or row_a.keys() == row_b.keys()
        for key in keys or row_a:
            value = row_a[key]
            close = isinstance(value, float) and value == pytest.approx(
                row_b[key], rel=rel, abs=atol if metric_atol is None else metric_atol)
            assert close or value == row_b[key], (key, value, row_b[key])


@pytest.mark.slow  # two runs, one compiling the tiny model's blocks: ~30 s
@needs_cpp_compiler
def test_compiled_update_equals_eager(tiny, tmp_path):
    """--compile auto (the update's blocks through torch.compile, sampling eager on a CPU) makes
    the run --compile off makes, within float tolerance (fp32: fused kernels sum in other orders)."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--steps", "2", "--mini-batches", "2",
              "--seed", "5"]
    eager = run_train(common + flags(compile="off") + ["--out", str(tmp_path / "eager")])
    compiled = run_train(common + flags(compile="auto") + ["--out", str(tmp_path / "compiled")])
    assert "blocks compiled" in compiled.stdout and "blocks compiled" not in eager.stdout
    assert_close_runs(tmp_path / "eager", tmp_path / "compiled", atol=1e-5, keys=UPDATE_METRICS,
                      rel=1e-4, metric_atol=1e-6)


def test_compiling_needs_a_cpp_compiler_on_a_cpu(tiny, tmp_path, monkeypatch, capsys):
    """No C++ compiler on the PATH: auto leaves the blocks eager, --compile on is refused by name
    before any work (torch.compile would fail at the first update). (With one: the test above.)"""
    from run import config
    monkeypatch.setattr(config.shutil, "which", lambda name: None)
    assert in_process_run(tmp_path / "a", tiny, "--compile", "auto").policy.compiled_layers is None
    with pytest.raises(SystemExit, match="--compile on: .* was not found"):
        in_process_run(tmp_path / "b", tiny, "--compile", "on")


def torchrun(nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port())]


@pytest.mark.slow
def test_ddp_resume_is_exact_per_rank(tiny, tmp_path):
    """Two gloo ranks: 3 steps, then --resume to 8, equals 8 straight. Refills make the ranks
    draw different numbers of batches, so each rank must get back its own data position (and
    RNGs, carried groups); the prompt accuracies are one table shared by the ranks."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--dynamic-sampling", "--max-refills",
              "2", "--keep-surplus", "--adaptive-budget", "--prompts-per-step", "4"] + BASE
    straight = tmp_path / "straight"
    run_train(common + ["--steps", "8", "--out", str(straight)], launcher=torchrun())
    resumed = tmp_path / "resumed"
    run_train(common + ["--steps", "3", "--out", str(resumed)], launcher=torchrun())
    state = torch.load(resumed / "checkpoint.pt", weights_only=True)
    positions = [s["data"]["taken"] for s in state["per_rank"]]
    assert positions[0] != positions[1], positions  # the ranks' data positions differ at step 3
    run_train(["--resume", str(resumed), "--steps", "8"], launcher=torchrun())
    assert_same_run(straight, resumed)


@pytest.mark.slow
def test_ddp_resume_reads_the_checkpoint_once_a_node(tmp_path):
    """Two gloo ranks resume from one checkpoint: each maps the file, whose pages the two share,
    so neither rank's load adds a private copy of it (each rank used to read its own: 8 copies
    on a node of 8 GPUs). recipes/resume-memory.py measures each rank's load."""
    model_dir = digit_checkpoint(tmp_path / "model", hidden_size=256, intermediate_size=1024,
                                 num_hidden_layers=8)
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", digit_data(tmp_path / "train.jsonl"), "--steps", "1",
               "--checkpoint-every", "1", "--out", str(out)] + BASE)
    proc = subprocess.run(torchrun() + [str(ROOT / "recipes" / "resume-memory.py"), "--resume", str(out)],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = re.findall(r"rank \d: checkpoint (\d+) MiB; .*; \+(-?\d+) MiB, .*\(\+(-?\d+) MiB private\)",
                       proc.stdout)
    assert len(ranks) == 2, proc.stdout
    for size, added, private in ranks:
        assert int(size) > 60  # far above what the ranks' own allocations may add
        assert int(private) < 0.25 * int(size) and int(added) < 0.5 * int(size), proc.stdout


UPDATE_METRICS = ("entropy", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean",
                  "grad_norm", "sampler_trainer_mismatch", "reward", "accuracy", "response_length")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    ["--mini-batches", "2"],
    ["--kl", "gkl", "--kl-coef", "1.0"],
    ["--adv-estimator", "reinforce_baseline"],  # whitened over both ranks as over one process
    # tokens chosen over both ranks' mini-batch, as over one process's
    ["--high-entropy-fraction", "0.3", "--objective", "kl-cov", "--cov-fraction", "0.1",
     "--mini-batches", "2"],
    # REINFORCE++'s token advantages normalised over both ranks' tokens
    ["--adv-estimator", "reinforce_pp", "--reward-kl-coef", "0.5"],
    # micro-batches by tokens (rows of 51-53 positions: two a micro-batch), per-prompt divisors
    ["--micro-batch-tokens", "110", "--micro-batch-size", "16", "--loss-agg", "group-token-mean"],
    # GPG's alpha counts both ranks' non-zero rewards; OPO's baseline weighs each reply's tokens
    ["--adv-estimator", "gpg", "--wrong-reward", "0"],
    ["--adv-estimator", "opo"],
], ids=["dapo", "gkl", "reinforce_baseline", "chosen-tokens", "reinforce_pp", "token-budget", "gpg", "opo"])
def test_ddp_two_ranks_equal_one_process(tiny, tmp_path, variant):
    """The same global batch in one process and on two gloo ranks: the same weights after the
    updates and the same metrics (summed over ranks, not rank 0's share)."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--steps", "1", "--dynamic-sampling",
              "--max-refills", "0", "--seed", "5"] + flags(prompts_per_step="8") + variant
    one = tmp_path / "one"
    run_train(common + ["--out", str(one)])
    two = tmp_path / "two"
    run_train(common + ["--out", str(two)], launcher=torchrun())
    m1, m2 = metrics(one)[0], metrics(two)[0]
    assert m1["groups_kept"] == m2["groups_kept"] > 0
    kept = m2["groups_kept_per_rank"]
    assert kept[0] != kept[1], f"want uneven kept groups per rank to test padding, got {kept}"
    for key in UPDATE_METRICS:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    a, b = weights(one), weights(two)
    start = weights_from(model_dir)
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # the update is not trivial
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, (a[k] - b[k]).abs().max())


@pytest.mark.slow
def test_ddp_prompt_accuracies_are_shared(tiny, tmp_path):
    """The adaptive budget's per-prompt accuracy table holds every rank's prompts, as the table
    of one process does (each rank used to keep its own, and prompts move between ranks)."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--steps", "2", "--seed", "5",
              "--adaptive-budget", "--no-dynamic-sampling"] + flags(prompts_per_step="8")
    tables = []
    for name, launcher in (("one", None), ("two", torchrun())):
        run_train(common + ["--out", str(tmp_path / name)], launcher=launcher)
        tables.append(torch.load(tmp_path / name / "checkpoint.pt",
                                 weights_only=True)["progress"]["prompt_accuracy"])
    assert len(tables[0]) > 8 and tables[0].keys() == tables[1].keys()


@pytest.mark.slow
def test_ddp_ranks_stop_together_at_the_time_limit(tiny, tmp_path):
    """Rank 0 alone evaluates between steps, so the ranks' clocks differ; they must still leave
    the loop at the same step (one rank leaving early leaves the other hung in a collective)."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", data_file, "--eval-data", data_file,
                      "--eval-limit", "16", "--eval-every", "1", "--steps", "100000",
                      "--out", str(out)] + flags(time_limit="0.05"),
                     launcher=torchrun(), timeout=240)
    assert "time limit of 0.05 minutes reached" in proc.stdout
    assert (out / "final" / "model.safetensors").exists() and len(metrics(out)) >= 2


def weights_from(model_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.parametrize("row, field", [
    ({"prompt": "What is 1 + 1 ?", "id": "x"}, "answer"),                 # missing field
    ({"prompt": "What is 1 + 1 ?", "answer": ["2"], "id": "x"}, "answer"),  # wrong type
    ({"prompt": "   ", "answer": "2", "id": "x"}, "prompt"),                # empty prompt
    ({"prompt": " ".join(["What"] * 200), "answer": "2", "id": "x"}, "prompt"),  # overlong
])
@pytest.mark.slow
def test_bad_data_fails_before_training(tiny, tmp_path, row, field):
    model_dir, _ = tiny
    bad = digit_data(tmp_path / "bad.jsonl", n=5, extra=row)
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", bad, "--out", str(out)] + BASE, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl" in proc.stderr and "row 6" in proc.stderr and field in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()


def test_advantages_and_old_logprobs(tiny, tmp_path):
    """Steps 3 and 4 return new batches (the input is left as it was). Carried groups keep their
    sampler's log-probs as the old ones: they were sampled by the last step's policy."""
    import train
    run = in_process_run(tmp_path, tiny, "--mini-batches", "2", "--prompts-per-step", "2")  # full
    batch = rollouts(stale=[True, True, False, False])
    scored = train.with_old_logprobs(run, train.with_advantages(run, batch))
    assert batch.advantages is None and batch.old_logprobs is None
    assert scored.advantages == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-4)
    assert scored.old_logprobs[:2] == batch.sampler_logprobs[:2]
    assert [len(lp) for lp in scored.old_logprobs[2:]] == [3, 1]
    assert scored.old_logprobs[2] != batch.sampler_logprobs[2]  # the trainer's own, recomputed
    # One update this step (mu 1, or a batch short enough for ceil(mu x 2/4) = 1): nothing to
    # recompute, the update's own log-probs are the old ones.
    for flag, value in (("prompts_per_step", 4), ("mini_batches", 1)):
        setattr(run.args, flag, value)
        on_policy = train.with_old_logprobs(run, scored)
        assert on_policy.old_logprobs[2:] == [None, None] and on_policy.old_logprobs[0] == [-1.0, -2.0]


def scripted_sampler(script):
    """A stand-in for train.sample_and_reward: each prompt's G correctness flags come from
    script(record, round's call number); everything else is filler."""
    import train
    calls = []

    def sample_and_reward(run, records, num_samples, seeds):
        calls.append([r["id"] for r in records])
        correct = [c for r in records for c in script(r, len(calls) - 1)]
        n = len(correct)
        return train.Rollouts(records=list(records), group_sizes=list(num_samples),
                              prompts=[[2]] * n, tokens=[[4]] * n, sampler_logprobs=[[-1.0]] * n,
                              truncated=[False] * n, rewards=[1.0 if c else -1.0 for c in correct],
                              correct=correct, reward_parts=[{}] * n, stale=[False] * n)
    return sample_and_reward, calls


def test_dynamic_sampling_never_hangs_on_signal_less_groups(tiny, tmp_path, monkeypatch):
    import train
    from run import launch
    from variants import refills
    run = in_process_run(tmp_path, tiny, "--dynamic-sampling", "--max-refills", "4")
    fake, calls = scripted_sampler(lambda record, call: [call % 2 == 0] * 4)  # all right / all wrong
    monkeypatch.setattr(train, "sample_and_reward", fake)
    monkeypatch.setattr(refills, "takes_turns", lambda run: True)  # rounds one after another, scripted
    kept, sampled, surplus, asked = train.collect_rollouts(run, launch.Progress())
    assert len(calls) == 5 and len(sampled) == 5 and kept.num_groups == 0 and surplus is None
    assert asked == 0 and kept.tokens == []


def test_dynamic_sampling_fills_exactly_and_carries_surplus(tiny, tmp_path, monkeypatch):
    """Informative groups are kept until the batch is full; with --keep-surplus the rest go to
    the next step, marked stale, and are used first there; without it they are dropped."""
    import dataclasses

    import train
    from run import launch
    from variants import refills
    run = in_process_run(tmp_path, tiny, "--dynamic-sampling", "--max-refills", "5", "--keep-surplus")
    # Round 0: groups 0 and 1 informative; round 1: all four.
    script = lambda record, call: [True, False] * 2 if call or int(record["id"][1:]) % 2 else [True] * 4
    fake, calls = scripted_sampler(script)
    monkeypatch.setattr(train, "sample_and_reward", fake)
    monkeypatch.setattr(refills, "takes_turns", lambda run: True)  # rounds one after another, scripted
    kept, sampled, surplus, _ = train.collect_rollouts(run, launch.Progress())
    informative_first = sum(int(i[1:]) % 2 for i in calls[0])
    assert len(calls) == 2 and kept.num_groups == 4 and not any(kept.stale)
    assert [r["id"] for r in kept.records] == [i for i in calls[0] if int(i[1:]) % 2] + \
        calls[1][:4 - informative_first]
    assert surplus.num_groups == informative_first and all(surplus.stale)
    # Carried groups come first, still stale; more carried in than wanted: no sampling at all.
    carry = dataclasses.replace(train.Rollouts.concat([kept, kept]), stale=[True] * 32)
    calls.clear()
    kept, sampled, surplus, _ = train.collect_rollouts(run, launch.Progress(carry=carry))
    assert calls == [] and kept.num_groups == 4 and all(kept.stale) and surplus is None
    # Without --keep-surplus there is nothing to carry.
    run.args.keep_surplus = False
    assert train.collect_rollouts(run, launch.Progress())[2] is None


REWARD_ONE_IN = """import zlib
def reward(text, record):
    return 1.0 if zlib.crc32(text.encode()) % {} == 0 else -1.0
"""


@pytest.mark.parametrize("extra", [[], ["--max-rows", "4", "--keep-surplus"], ["--adaptive-budget"],
                                   ["--reward-constant"]])
def test_refills_in_one_queue_sample_what_rounds_in_turn_do(tiny, tmp_path, monkeypatch, extra):
    """Dynamic sampling's rounds in one generate call (round r+1 queued as soon as round r
    cannot fill the batch) keep, sample, carry and draw from the stream exactly what rounds one
    after another do. With a row cap of one prompt's rows, round 1 is queued while round 0 still
    runs; a reward without variance runs every round."""
    import rollout
    import train
    from run import launch
    from variants import refills
    reward = tmp_path / "reward.py"
    constant = extra == ["--reward-constant"]
    reward.write_text("def reward(text, record):\n    return -1.0\n" if constant
                      else REWARD_ONE_IN.format(3 if "--keep-surplus" in extra else 6))
    results, real_generate = [], rollout.generate
    for one_queue in (True, False):
        (tmp_path / str(one_queue)).mkdir()
        run = in_process_run(tmp_path / str(one_queue), tiny, "--dynamic-sampling", "--max-refills",
                             "3", "--reward", f"{reward}:reward", "--max-new-tokens", "8",
                             *([] if constant else extra))
        monkeypatch.setattr(refills, "takes_turns", lambda run, q=one_queue: not q)
        events = []  # ("ended", prompt index) and ("queued", round) in order

        def generate(*args, on_group=None, events=events, **kw):
            def noted(index, completions):
                events.append(("ended", index))
                more = on_group(index, completions)
                events.append(("queued", None) if more else ("none", None))
                return more
            events.append(("call", None))
            return real_generate(*args, on_group=noted if on_group else None, **kw)
        monkeypatch.setattr(rollout, "generate", generate)
        collected = train.collect_rollouts(run, launch.Progress())
        steps = [collected]
        if collected.surplus:  # the next step starts from the carried groups
            steps.append(train.collect_rollouts(run, launch.Progress(step=1, carry=collected.surplus)))
            collected = collected._replace(sampled=collected.sampled + steps[1].sampled + [steps[1].kept])
        events.append(("steps that sampled", sum(bool(s.sampled) for s in steps)))
        results.append((collected, next(run.stream), events))
    (queue, queue_next, events), (turns, turns_next, turn_events) = results
    assert len(queue.sampled) == len(turns.sampled) == (4 if constant else len(queue.sampled)) > 1
    for a, b in zip(queue.sampled + [queue.kept], turns.sampled + [turns.kept], strict=True):
        assert [r["id"] for r in a.records] == [r["id"] for r in b.records]
        assert (a.group_sizes, a.tokens, a.rewards, a.correct) == (b.group_sizes, b.tokens, b.rewards, b.correct)
        assert [x for row in a.sampler_logprobs for x in row] == pytest.approx(
            [x for row in b.sampler_logprobs for x in row], abs=1e-5)
    assert (queue.surplus is None) == (turns.surplus is None) == ("--keep-surplus" not in extra)
    assert queue.surplus is None or queue.surplus.tokens == turns.surplus.tokens
    assert [r["id"] for r in queue_next] == [r["id"] for r in turns_next]  # the stream, in step
    sampling_steps = events[-1][1]  # one generate call a step, against one a round
    assert events.count(("call", None)) == sampling_steps < turn_events.count(("call", None))
    if "--max-rows" in extra:  # round 1 queued before round 0's last group (prompts 0-3) ended
        first_queued = events.index(("queued", None))
        assert any(event == ("ended", i) for event in events[first_queued:] for i in range(4))


def test_adversarial_variants_are_asked_in_the_next_round(tiny, tmp_path, monkeypatch):
    import train
    from run import launch
    run = in_process_run(tmp_path, tiny, "--dynamic-sampling", "--max-refills", "1", "--adversarial")
    # Round 0: every prompt all right; its harder variants (new ids) come back informative.
    fake, calls = scripted_sampler(lambda record, call: [True] * 4 if call == 0 else [True, False] * 2)
    monkeypatch.setattr(train, "sample_and_reward", fake)
    kept, sampled, _, asked = train.collect_rollouts(run, launch.Progress())
    assert asked == 4 and len(calls) == 2 and kept.num_groups == 4
    assert all(r.get("variant") == "harder" for r in kept.records)
    assert [r["id"] for r in kept.records] == calls[1]


def test_refills_with_variants_draw_only_the_fresh_prompts_they_need(tiny, tmp_path, monkeypatch):
    """Round 0 keeps 1 of 4 prompts and asks a variant of each of the 3 others: round 1 is those
    3 and 1 fresh prompt, round 2 four variants and none. The stream skips no prompt (it used to
    draw a whole batch for the 1 and drop the other 3 unseen)."""
    import data
    import train
    from run import launch
    run = in_process_run(tmp_path, tiny, "--dynamic-sampling", "--max-refills", "2", "--adversarial")
    order = data.PromptStream(run.stream.source, run.args.prompts_per_step, seed=run.args.seed)
    expected = [r["id"] for _ in range(3) for r in next(order)]  # the stream's order, 12 records
    # Round 0: the first prompt informative, the rest all right; variants and round 2: none.
    fake, calls = scripted_sampler(lambda record, call: [True, False] * 2
                                   if call == 0 and record["id"] == expected[0] else [True] * 4)
    monkeypatch.setattr(train, "sample_and_reward", fake)
    monkeypatch.setattr(data, "adversarial_variants", lambda records, requests, *a, **k: [
        dict(records[i], id=f"{records[i]['id']}-harder", variant="harder") for i, _ in requests])
    train.collect_rollouts(run, launch.Progress())
    assert calls[:2] == [expected[:4], [f"{i}-harder" for i in expected[1:4]] + [expected[4]]]
    assert all(i.endswith("-harder") for i in calls[2])
    assert [r["id"] for r in next(run.stream)] == expected[5:9]  # the next step goes on from there


def test_a_rank_with_no_groups_still_takes_part(tiny, tmp_path, monkeypatch):
    """Dynamic sampling can leave a rank with no informative group: steps 3-5 still run (under
    DDP its collectives must), with zero-weight stand-ins and no update of its own; when no rank
    kept a group, no update at all."""
    import train
    run = in_process_run(tmp_path, tiny, "--adv-estimator", "reinforce_baseline", "--mini-batches", "2")
    empty = rollouts().select([])
    batch = train.with_old_logprobs(run, train.with_advantages(run, empty))
    assert batch.advantages == [] and batch.old_logprobs == []
    assert train.update(run, batch) == ({}, {})  # no group kept anywhere: no update
    # Another rank kept 2 of the 4 groups: ceil(2 x 2/4) = 1 update, which this rank joins with
    # a stand-in of no loss token (alone here, so the whole mini-batch is empty).
    monkeypatch.setattr(train, "gather", lambda value, world: [value, 2])
    assert train.update(run, batch) == ({"empty_updates": 1}, {})


def test_nonfinite_update_is_skipped(tiny, tmp_path):
    import train
    run = in_process_run(tmp_path, tiny)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    batch = rollouts(advantages=[float("nan"), 1.0, 1.0, -1.0], old_logprobs=[None] * 4)
    sums, _ = train.update(run, batch)
    assert sums["skipped_updates"] == 1
    for k, v in run.policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not run.optimizer.state  # the optimizer never stepped
    # No loss token anywhere (every completion filtered): not an error, just no update.
    run.args.overlong_filter = True
    sums, _ = train.update(run, replace_field(batch, truncated=[True] * 4))
    assert sums == {"empty_updates": 1} and not run.optimizer.state
    run.args.overlong_filter = False
    sums, _ = train.update(run, replace_field(batch, advantages=[1.0, -1.0, -1.0, 1.0]))
    assert sums["skipped_updates"] == 0 and sums["updates"] == 1
    assert any(not torch.equal(v, before[k]) for k, v in run.policy.state_dict().items())


def replace_field(batch, **changes):
    import dataclasses
    return dataclasses.replace(batch, **changes)


def test_truncated_importance_sampling_reweights_tokens(tiny, tmp_path):
    """--tis-cap: each token's loss times min(pi_old / pi_sampler, C); with the sampler's
    log-probs far below the trainer's the weights hit the cap, and the update changes."""
    import train
    batch = rollouts(advantages=[1.0, -1.0, -1.0, 1.0], old_logprobs=[None] * 4,
                     sampler_logprobs=[[-9.0, -9.0], [-9.0], [-9.0, -9.0, -9.0], [-9.0]])
    results = []
    for cap in ("0", "2"):
        run = in_process_run(tmp_path / cap, tiny, "--tis-cap", cap)
        sums, _ = train.update(run, batch)
        results.append((sums, {k: v.clone() for k, v in run.policy.state_dict().items()}))
    (plain, plain_weights), (tis, tis_weights) = results
    assert "tis_weight" not in plain and tis["tis_weight"] == pytest.approx(2.0 * tis["loss_tokens"])
    assert any(not torch.equal(plain_weights[k], tis_weights[k]) for k in plain_weights)


def test_rollout_correction_over_the_step_does_not_depend_on_the_micro_batches(tiny, tmp_path):
    """--tis-normalize divides by the mean weight over the whole step, --tis-reject takes tokens
    out of the mask before the divisors: micro-batches of 1 row and of 4 give the same update.
    log rho per token: [-2, 1], [-3.5], [1, -5.9, -1.8], [2]; k2 = (log rho)^2 / 2 <= 0.6 keeps
    row 0's second token and row 2's first (2 of 7); the weights min(rho, 2) sum to
    e^-2 + 2 + e^-3.5 + 2 + e^-5.9 + e^-1.8 + 2 over 7 tokens, and the two kept weigh 2 each."""
    import train
    batch = rollouts(advantages=[1.0, -1.0, -1.0, 1.0],
                     old_logprobs=[[-3.0, -1.0], [-4.0], [-0.5, -6.0, -2.0], [-1.0]])
    results = []
    for size in ("1", "4"):
        run = in_process_run(tmp_path / size, tiny, "--micro-batch-size", size, "--tis-cap", "2",
                             "--tis-normalize", "--tis-reject", "token_k2", "--tis-reject-bound", "0.6")
        sums, _ = train.update(run, batch)
        results.append((sums, {k: v.clone() for k, v in run.policy.state_dict().items()}))
    (one, one_weights), (four, four_weights) = results
    mean = (math.exp(-2) + 2 + math.exp(-3.5) + 2 + math.exp(-5.9) + math.exp(-1.8) + 2) / 7
    for sums in (one, four):
        assert (sums["loss_tokens"], sums["tis_rejected"]) == (2, 5)
        assert sums["tis_weight"] == pytest.approx(2 * 2 / mean, rel=1e-6)
    assert one["grad_norm"] == pytest.approx(four["grad_norm"], rel=1e-6)
    for k in one_weights:
        assert torch.allclose(one_weights[k], four_weights[k], atol=1e-5, rtol=0), k


def test_a_sequence_weight_counts_the_tokens_rejection_takes_out(tiny, tmp_path):
    """--tis-level sequence with a per-token --tis-reject: a reply's rho is the product over all
    its tokens, as verl weighs it (rejection masks the loss afterwards). Row 0: rho_t = [1.5, 0.5];
    token_k1 with U = 1.6 rejects the second (0.5 < 1/1.6), and the kept token weighs
    min(1.5 x 0.5, 2) = 0.75 (over the kept token alone it would be 1.5); rows 1-3: rho = 1."""
    import train
    sampler = [[-1.0, -2.0], [-0.5], [-1.5, -0.1, -0.2], [-3.0]]
    old = [[-1.0 + math.log(1.5), -2.0 + math.log(0.5)]] + sampler[1:]
    run = in_process_run(tmp_path, tiny, "--tis-cap", "2", "--tis-level", "sequence",
                         "--tis-reject", "token_k1", "--tis-reject-bound", "1.6")
    sums, _ = train.update(run, rollouts(advantages=[1.0, -1.0, -1.0, 1.0], old_logprobs=old))
    assert (sums["loss_tokens"], sums["tis_rejected"]) == (6, 1)
    assert sums["tis_weight"] == pytest.approx(0.75 + 5 * 1.0, rel=1e-6)


def test_normalised_rollout_weights_average_one(tiny, tmp_path):
    """--tis-normalize alone: over the step's loss tokens the weights the loss sees average 1."""
    import train
    batch = rollouts(advantages=[1.0, -1.0, -1.0, 1.0],
                     old_logprobs=[[-3.0, -1.0], [-4.0], [-0.5, -6.0, -2.0], [-1.0]])
    run = in_process_run(tmp_path, tiny, "--tis-cap", "2", "--tis-normalize", "--micro-batch-size", "2")
    sums, _ = train.update(run, batch)
    assert sums["loss_tokens"] == 7 and sums["tis_weight"] == pytest.approx(7, rel=1e-6)


def _weight_scale_worker(rank, world_size, init_file, out_file):
    """Rank r of 2 holds its own rows of the step; the scale is over both."""
    import torch.distributed as dist

    from variants import token_choice
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    whole = _scale_batch()
    mine = whole.select([0] if rank == 0 else [1])
    scales = [token_choice.rollout_weight_scale(_scale_run(level, world_size), mine)
              for level in ("token", "sequence")]
    if rank == 0:
        Path(out_file).write_text(json.dumps(scales))
    dist.destroy_process_group()


def _scale_batch():
    return rollouts(old_logprobs=[[-3.0, -1.0], [-4.0], [-0.5, -6.0, -2.0], [-1.0]])


def _scale_run(level, world):
    import types
    args = types.SimpleNamespace(tis_normalize=True, tis_cap=2.0, tis_floor=0.0, tis_level=level,
                                 tis_mode="truncate", overlong_filter=True)
    return types.SimpleNamespace(args=args, world=world)


@pytest.mark.slow
def test_rollout_weight_scale_is_over_every_rank(tmp_path):
    """Two gloo ranks with a group each (3 and 4 tokens) get the scale one process gets for both."""
    import torch.multiprocessing as mp

    from variants import token_choice
    out = tmp_path / "scales.json"
    mp.spawn(_weight_scale_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    alone = [token_choice.rollout_weight_scale(_scale_run(level, 1), _scale_batch())
             for level in ("token", "sequence")]
    assert json.loads(out.read_text()) == pytest.approx(alone, rel=1e-12)
    assert alone[0] != pytest.approx(1.0) and alone[1] != pytest.approx(1.0)


@pytest.mark.parametrize("extra", [
    ["--high-entropy-fraction", "0.3", "--objective", "clip-cov", "--eps-low", "1.0", "--eps-high",
     "1.0", "--cov-fraction", "0.2", "--clip-cov-low", "-100", "--clip-cov-high", "100"],
    ["--objective", "kl-cov", "--cov-fraction", "0.3"],
], ids=["80-20-and-clip-cov", "kl-cov"])
def test_chosen_tokens_do_not_depend_on_the_micro_batches(tiny, tmp_path, extra):
    """The 80/20 rule and Clip-Cov / KL-Cov choose among the whole mini-batch's tokens (a
    forward before the first backward), so micro-batches of 1 row and of 4 give the same update;
    choosing within each micro-batch would not."""
    import train
    batch = rollouts(advantages=[1.0, -1.0, -1.0, 1.0],  # pi_old away from the policy: |log r| > 0
                     old_logprobs=[[-3.0, -1.0], [-4.0], [-0.5, -6.0, -2.0], [-1.0]])
    results = []
    for size in ("1", "4"):
        run = in_process_run(tmp_path / size, tiny, "--micro-batch-size", size, *extra)
        sums, _ = train.update(run, batch, step=3)
        results.append((sums, {k: v.clone() for k, v in run.policy.state_dict().items()}))
    (one, one_weights), (four, four_weights) = results
    assert one["cov_chosen_frac"] == four["cov_chosen_frac"] > 0
    assert one.get("high_entropy_frac") == four.get("high_entropy_frac")
    assert one["loss_tokens"] == four["loss_tokens"] == 7
    assert one["grad_norm"] == pytest.approx(four["grad_norm"], rel=1e-6)
    for k in one_weights:  # (AdamW's step makes float rounding of near-0 gradients ~1e-6)
        assert torch.allclose(one_weights[k], four_weights[k], atol=1e-5, rtol=0), k


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                 "group-token-mean"])
def test_micro_batches_by_tokens_give_the_one_batch_update(tiny, tmp_path, agg):
    """rollouts()' 4 rows are (prompt, reply) (3, 2), (3, 1), (2, 3), (2, 1): at 8 padded
    positions a micro-batch, longest first, they split [0], [2], [1, 3] (2 x (3 + 1) = 8). The
    scored log-probs come back in the rows' order, and the gradient is the one batch's, for every
    aggregation (the divisors are the whole mini-batch's)."""
    import train
    batch = rollouts(advantages=[1.0, -1.0, -0.5, 1.0],
                     old_logprobs=[[-3.0, -1.0], [-4.0], [-0.5, -6.0, -2.0], [-1.0]])
    grads, scored = {}, {}
    for budget in (0, 8):
        run = in_process_run(tmp_path / str(budget), tiny, "--loss-agg", agg, "--micro-batch-size", "4")
        run.args.micro_batch_tokens = budget  # (set after loading: the digit prompts are longer)
        parts = train.micro_batch_rows(run, batch, [0, 1, 2, 3])
        assert parts == ([[0, 1, 2, 3]] if budget == 0 else [[0], [2], [1, 3]])
        scored[budget] = train.scored_logprobs(run, batch, [0, 1, 2, 3])
        sums, _ = train.update(run, batch)
        assert sums["loss_tokens"] == 7
        grads[budget] = {name: p.grad.clone() for name, p in run.policy.named_parameters()}
    assert [len(row) for row in scored[8]] == [2, 1, 3, 1]
    for a, b in zip(scored[0], scored[8]):
        assert a == pytest.approx(b, abs=1e-6)
    assert max(g.abs().max() for g in grads[0].values()) > 1e-3  # not a trivial gradient
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[8][name], atol=1e-7, rtol=1e-5), name


def test_reinforce_baseline_whitens_over_the_loss_tokens(tiny, tmp_path):
    """rollouts()' replies are 2, 1, 3 and 1 tokens: REINFORCE++-baseline weighs each row's
    centred reward by them; with --overlong-filter a truncated reply reaches no loss and counts
    no token (it still gets an advantage, masked in the loss)."""
    import dapo
    import train
    batch = rollouts(truncated=[False, False, True, False])
    for extra, lengths in (([], [2, 1, 3, 1]), (["--overlong-filter"], [2, 1, 0, 1])):
        run = in_process_run(tmp_path / str(len(extra)), tiny, "--adv-estimator", "reinforce_baseline",
                             *extra)
        want = dapo.reinforce_baseline_advantages(batch.rewards, 2, lengths)
        assert train.with_advantages(run, batch).advantages == pytest.approx(want.tolist(), abs=1e-12)
    assert want[0] != -want[3]  # weighted by tokens: not the per-sample +-1 pattern


def test_a_prompt_too_long_for_the_micro_batch_budget_is_refused_at_load(tiny, tmp_path):
    """The digit prompts are 50 tokens: with --micro-batch-tokens 52 and --max-new-tokens 3 a row
    could not fit a micro-batch alone, so the data is refused before any step, naming both."""
    from transformers import AutoTokenizer

    import data
    from run import config, launch
    model_dir, data_file = tiny
    args, _ = config.parse_config(["--model", model_dir, "--data", data_file, "--out",
                                   str(tmp_path / "run")] + BASE + ["--micro-batch-tokens", "52",
                                                                    "--template", "dapo"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(data.DataError, match=r"row 1: .* longer than the limit of 49 "
                                             r"\(--micro-batch-tokens 52 less --max-new-tokens 3\)"):
        launch.load_data(args, tokenizer, context=64)
    args.micro_batch_tokens = 53
    assert len(launch.load_data(args, tokenizer, context=64)[0]) == 16


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tis", "seq-tis", "icepop", "seq-mis"])
def test_each_rollout_correction_acts_in_a_run(tiny, tmp_path, preset):
    """On the bf16 path the sampler (a bf16 copy) and the trainer differ a little: with bounds
    that tight, each correction cuts or masks some tokens and not all."""
    model_dir, data_file = tiny
    out = tmp_path / preset
    bounds = ["--tis-cap", "1.002"] + (["--tis-floor", "0.998"] if preset == "icepop" else [])
    run_train(["--preset", preset, "--model", model_dir, "--data", data_file, "--steps", "2",
               "--out", str(out)] + flags(dtype="bfloat16", max_new_tokens="8") + bounds)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["tis_level"], saved["tis_mode"]) == {
        "tis": ("token", "truncate"), "seq-tis": ("sequence", "truncate"),
        "icepop": ("token", "mask"), "seq-mis": ("sequence", "mask")}[preset]
    rows = metrics(out)
    assert all(r["skipped_updates"] == 0 for r in rows)
    assert 0 < max(r["tis_cut_frac"] for r in rows) and min(r["tis_cut_frac"] for r in rows) < 1


@pytest.mark.slow
def test_rollout_rejection_and_normalisation_act_in_a_run(tiny, tmp_path):
    """On the bf16 path, k3 of the sampler-trainer gap passes a bound that tight on some tokens
    and not all; the normalised weights average about 1 over what is kept."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out),
               "--tis-cap", "2", "--tis-normalize", "--tis-reject", "token_k3", "--tis-reject-bound", "1e-6"]
              + flags(dtype="bfloat16", max_new_tokens="8"))
    rows = metrics(out)
    assert all(r["skipped_updates"] == 0 for r in rows)
    assert 0 < max(r["tis_rejected_frac"] for r in rows) and min(r["tis_rejected_frac"] for r in rows) < 1
    assert all(0.9 < r["tis_weight"] < 1.1 for r in rows if r["tis_weight"] is not None)


def test_rollout_correction_and_choice_flags_are_checked(capsys):
    from run import config
    assert config.parse_config(["--preset", "icepop", "--model", "x"])[0].tis_floor == 0.5
    for argv, named in [(["--tis-level", "sequence"], "--tis-cap"),
                        (["--tis-cap", "2", "--tis-floor", "0.5"], "--tis-mode mask"),
                        (["--tis-cap", "2", "--tis-mode", "mask", "--tis-floor", "1.5"], "--tis-floor"),
                        (["--high-entropy-fraction", "0"], "--high-entropy-fraction"),
                        (["--cov-fraction", "0.01"], "--cov-fraction"),          # no Cov objective
                        (["--reward-kl-coef", "0.1"], "--reward-kl-coef"),       # no REINFORCE++
                        (["--objective", "kl-cov", "--clip-cov-low", "0"], "--clip-cov-low"),
                        (["--objective", "clip-cov", "--clip-cov-low", "5", "--clip-cov-high", "1"],
                         "--clip-cov-high"),
                        (["--tis-normalize"], "--tis-cap"),          # nothing to normalise
                        (["--tis-reject-bound", "0.5"], "--tis-reject"),
                        (["--tis-reject", "seq_max_k1", "--tis-reject-bound", "2"], "one side only"),
                        (["--tis-reject", "token_k4", "--tis-reject-bound", "2"], "token_k4"),
                        (["--tis-reject", "token_k1", "--tis-reject-bound", "1"], "[1/U, U]"),
                        (["--tis-reject", "seq_mean_k3"], "--tis-reject-bound > 0"),
                        (["--tis-reject", "token_k2", "--tis-reject-bound", "1", "--top-p", "0.9"], "--top-p"),
                        (["--algo", "dpo", "--tis-reject", "token_k2", "--tis-reject-bound", "1"], "dpo")]:
        with pytest.raises(SystemExit):
            config.parse_config(["--model", "x"] + argv)
        assert named in capsys.readouterr().err, argv


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_pp_advantages_hold_the_kl_to_the_reference(tiny, tmp_path, gamma):
    """--adv-estimator reinforce_pp: each token's return is the reward minus beta times the k1 KL
    (pi_old against the reference) from that token to the end (discounted by --gamma),
    normalised over every token of the batch; checked against log-probs made here from the two
    models' plain logits."""
    import dapo
    import train
    run = in_process_run(tmp_path, tiny, "--adv-estimator", "reinforce_pp", "--reward-kl-coef", "0.5",
                         "--gamma", str(gamma))
    torch.manual_seed(0)
    with torch.no_grad():  # a reference away from the policy, so the KL is not 0
        for weight in run.reference.parameters():
            weight.add_(0.3 * torch.randn_like(weight))
    batch = rollouts()  # one update a step: step 3 scores pi_old for REINFORCE++ all the same
    batch = train.with_advantages(run, train.with_old_logprobs(run, batch))

    def logprobs(model, i):
        ids = torch.tensor([batch.prompts[i] + batch.tokens[i]])
        with torch.no_grad():
            logits = model(ids).float()                                   # (1, P+C, V)
        start = len(batch.prompts[i])
        predicted = torch.log_softmax(logits[0, start - 1:-1], -1)        # (C, V)
        return predicted.gather(-1, torch.tensor(batch.tokens[i])[:, None])[:, 0].double()

    returns = [dapo.kl_penalised_returns(batch.rewards[i], logprobs(run.policy, i)
                                        - logprobs(run.reference, i), 0.5, gamma) for i in range(4)]
    expected = dapo.whiten(torch.cat(returns), center=True)
    got = torch.tensor([a for row in batch.advantages for a in row], dtype=torch.float64)
    assert [len(row) for row in batch.advantages] == [2, 1, 3, 1]
    assert torch.allclose(got, expected, atol=1e-5)
    assert abs(got.mean().item()) < 1e-9                                   # normalised
    assert got[0] != got[1]  # the KL of the first row's last token differs its two tokens
    sums, _ = train.update(run, batch)  # one advantage per token reaches the loss
    assert sums["updates"] == 1 and sums["skipped_updates"] == 0


@pytest.mark.slow
def test_reinforce_pp_preset_runs(tiny, tmp_path):
    """Two steps of the reinforce_pp preset: a frozen reference made, pi_old scored at one update
    a step, the samples' advantages logged as their tokens' mean."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--preset", "reinforce_pp", "--model", model_dir, "--data", data_file, "--steps", "2",
               "--out", str(out)] + flags(mini_batches="1", reward_kl_coef="0.5"))
    saved = json.loads((out / "config.json").read_text())
    assert (saved["adv_estimator"], saved["reward_kl_coef"], saved["kl"]) == ("reinforce_pp", 0.5, "none")
    rows = metrics(out)
    assert all(r["skipped_updates"] == 0 for r in rows) and rows[-1]["grad_norm"] > 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(s["advantage"], float) for s in samples)


@pytest.mark.slow
def test_reward_flags_reach_the_reward(tiny, tmp_path):
    """--format-reward (including the XML recipe), --overlong-penalty and --ppl-penalty all
    reach rewards.math_reward (the format terms used to be always 0)."""
    import rewards
    from rollout import Completion
    from run import config
    args, _ = config.parse_config(["--model", "x", "--format-reward", "xml", "--correct-reward", "2",
                                   "--wrong-reward", "0", "--ppl-penalty", "beside",
                                   "--overlong-penalty", "--max-new-tokens", "20"])
    text = "<reasoning>\nthree\n</reasoning>\n<answer>\n3\n</answer>"
    completion = Completion(0, list(range(18)), [-0.1] * 18, "stop")
    total, parts = rewards.math_reward(text, "3", **config.reward_options(args, completion))
    assert parts["correct"] == 2.0 and parts["format"] == 0.5 and parts["integer"] == 0.5
    assert parts["xml_count"] == 0.5 and parts["overlong"] == pytest.approx(-0.5)  # 18 of 20, cache 4
    assert total == pytest.approx(2.0 + 0.5 + 0.5 + 0.5 - 0.5)
    model_dir, data_file = tiny
    out = tmp_path / "xml"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "1", "--out", str(out),
               "--format-reward", "xml", "--template", "xml"] + BASE)
    assert "reward_xml_count" in metrics(out)[0]


def tolerance_data(path):
    """digit_data's rows with a field of their own, which the example reward reads."""
    rows = [{**json.loads(line), "tolerance": 1} for line in Path(digit_data(path)).read_text().splitlines()]
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_reward_function_that_fails_on_a_row_stops_the_run_before_any_weight(tiny, tmp_path):
    model_dir, _ = tiny
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(reply, row):\n    return row['reference'] == reply\n")
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", tolerance_data(tmp_path / "rows.jsonl"),
                      "--reward", f"{broken}:reward", "--out", str(out)] + BASE, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("train.py: --reward") and "KeyError" in last
    assert "on row 1 of" in last and not out.exists()  # stopped before the run directory, and weights


@pytest.mark.slow
def test_your_own_reward_trains_and_its_failures_are_counted(tiny, tmp_path):
    """--reward FILE.py:FUNCTION on a jsonl with a field of its own: 2 steps, its parts in
    metrics.jsonl; a function that raises or returns NaN on the model's replies (not on the
    row's answer, which it is checked with at load) scores them wrong, counted, never a crash."""
    model_dir, _ = tiny
    rows = tolerance_data(tmp_path / "rows.jsonl")
    out = tmp_path / "mine"
    run_train(["--model", model_dir, "--data", rows, "--steps", "2", "--out", str(out),
               "--reward", "recipes/tolerance_reward.py:reward"] + BASE)
    logged = metrics(out)
    assert len(logged) == 2 and all(0 <= r["reward_answered"] <= 1 and r["reward_error"] == 0 for r in logged)
    assert all(0 <= r["reward_correct"] <= 1 for r in logged)  # the function's score, eq. 7's place
    assert all(r["reward"] == pytest.approx(r["reward_correct"] + r["reward_overlong"]) for r in logged)
    flaky = tmp_path / "flaky.py"
    flaky.write_text("def raises(reply, row):\n    if not reply.startswith('Answer:'):\n"
                     "        raise ValueError('no Answer: line')\n    return 1.0\n\n"
                     "def nan(reply, row):\n    return 1.0 if reply.startswith('Answer:') else float('nan')\n")
    for name in ("raises", "nan"):
        out = tmp_path / name
        proc = run_train(["--model", model_dir, "--data", rows, "--steps", "1", "--out", str(out),
                          "--reward", f"{flaky}:{name}"] + BASE)
        row = metrics(out)[0]
        # (the tiny vocabulary has "Answer:": a few replies start with it and score 1)
        assert row["reward_error"] > 0.5 and row["accuracy"] == pytest.approx(1 - row["reward_error"])
        assert row["reward_correct"] == pytest.approx(row["accuracy"] - row["reward_error"])  # +1 / -1
        assert "failed on a reply" in proc.stderr


@pytest.mark.slow
def test_a_silent_run_is_warned_once_of_each_cause(tiny, tmp_path):
    """A model with no digit in its vocabulary, 2-token replies: most are cut, none gives an
    answer, no group has a signal. After 3 steps each warning comes once (console and the row),
    never again."""
    _, data_file = tiny
    model = digit_checkpoint(tmp_path / "words", words=["What", "is", "the", "sum", "of", "it"])
    out = tmp_path / "run"
    proc = run_train(["--model", model, "--data", data_file, "--steps", "4", "--out", str(out)]
                     + flags(max_new_tokens="2"))
    rows = metrics(out)
    assert [len(r.get("warnings", [])) for r in rows] == [0, 0, 3, 0]
    truncated, no_signal, no_answer = rows[2]["warnings"]
    assert "--max-new-tokens 2" in truncated and "median length 2" in truncated
    assert "no group had a learning signal" in no_signal and "template (dapo)" in no_signal
    assert "no reply gave an answer" in no_answer and '"Answer: X"' in no_answer
    assert proc.stderr.count("warning: ") == 3


def test_the_warnings_need_their_cause_three_steps_in_a_row():
    import types

    from run import metrics as step_metrics
    args = types.SimpleNamespace(reward="", max_new_tokens=64, template="none", temperature=1.0)
    watch = step_metrics.Watch(args, "an answer")
    quiet = {"truncated": 0.1, "groups_with_signal": 3, "reward_extracted": 0.9, "response_length_median": 9}
    cut = {**quiet, "truncated": 0.6, "response_length_median": 64}
    said = [watch.check(row, []) for row in (cut, cut, quiet, cut, cut, cut, cut)]
    assert [len(s) for s in said] == [0, 0, 0, 0, 0, 1, 0]  # 3 in a row, then never again
    assert "median length 64" in said[5][0]
    examples = [{"completion": "I do not know"}]
    mute = step_metrics.Watch(args, "an answer")
    said = [mute.check({**quiet, "reward_extracted": 0.0}, examples) for _ in range(3)]
    assert said[:2] == [[], []] and "it wants an answer; one reply: 'I do not know'" in said[2][0]
    mine = step_metrics.Watch(types.SimpleNamespace(**{**vars(args), "reward": "f.py:f"}), "f")
    assert not any(mine.check({**quiet, "reward_extracted": 0.0}, examples) for _ in range(4))


def test_no_warning_on_the_default_runs_logged(tmp_path):
    """The default preset's committed CPU runs (assets/grpo-vs-dpo-cpu, 3 seeds), through the
    watch: not one warning (their logs predate two of its fields: kept groups have a signal)."""
    import types

    from run import metrics as step_metrics
    for seed in range(3):
        folder = ROOT / "assets" / "grpo-vs-dpo-cpu" / f"dapo-s{seed}"
        args = types.SimpleNamespace(**json.loads((folder / "config.json").read_text()))
        watch = step_metrics.Watch(args, "an answer")
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert watch.check({"groups_with_signal": row["groups_kept"], "response_length_median": 0,
                                **row}, []) == [], (seed, row["step"])


def test_a_run_whose_every_update_is_skipped_is_warned():
    """Every update of a step skipped (some, and the count made did not move) 3 steps in a row:
    said once, resumed or not. A step that made one of its two updates learned: no warning."""
    import types

    from run import metrics as step_metrics
    args = types.SimpleNamespace(reward="", max_new_tokens=64, template="none", temperature=1.0,
                                 correct_reward=1e308, wrong_reward=-1.0, lr=1e-3, algo="pg")
    quiet = {"truncated": 0.1, "groups_with_signal": 3, "reward_extracted": 0.9, "response_length_median": 9}
    rows = [{**quiet, "updates": 1, "skipped_updates": 1}, {**quiet, "updates": 2, "skipped_updates": 1}]
    rows += [{**quiet, "updates": 2, "skipped_updates": 2}] * 4  # none made
    watch = step_metrics.Watch(args, "an answer")
    said = [watch.check(row, []) for row in rows]
    assert [len(s) for s in said] == [0, 0, 0, 0, 1, 0]
    assert said[4][0].startswith("every update was skipped for 3 steps in a row") and "1e+308" in said[4][0]
    resumed = step_metrics.Watch(args, "an answer", history=rows[:4])
    assert resumed.check(rows[4], []) == said[4]


def test_the_logs_are_strict_json(tmp_path):
    """NaN and the infinities, at any depth, are written as null: json.dumps wrote -Infinity and
    NaN, which jq and browsers refuse, the whole file with them."""
    from run import runs

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    row = {"step": 1, "reward": -math.inf, "loss": math.nan, "n": 3, "kept": [2, 2],
           "nested": {"x": [0.5, math.inf]}, "warnings": ["a"]}
    runs.append_log(str(tmp_path), "metrics.jsonl", row)
    assert json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse) == {
        "step": 1, "reward": None, "loss": None, "n": 3, "kept": [2, 2], "nested": {"x": [0.5, None]},
        "warnings": ["a"]}
    assert row["reward"] == -math.inf  # (its input unchanged)


def strict_json_rows(path):
    """The lines of a .jsonl log, refusing NaN and Infinity as JSON itself does."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines()]


MISBEHAVING = """import os, zlib
def reward(reply, row):
    os.chdir({elsewhere!r})  # moves the process
    row["seen"] = row.get("seen", 0) + 1  # writes into the row the other replies read
    if not reply.startswith("Answer:") and zlib.crc32(reply.encode()) % 2:
        return 1e308  # finite, but the group's sum is not
    return (1.0 if reply.strip().endswith(row["answer"]) else 0.0), {{"seen": row["seen"]}}
"""


@pytest.mark.slow
def test_a_reward_that_misbehaves_cannot_corrupt_the_run(tiny, tmp_path):
    """A reward that calls os.chdir, writes into its row, and returns 1e308 on some replies: the
    run writes its relative --out where it said (the directory is put back after each call),
    each reply reads the row as loaded (its own copy: "seen" is 1), the huge values score as
    errors (beyond 1e6, said once), no update is skipped, metrics.jsonl is strict JSON."""
    model_dir, _ = tiny
    (tmp_path / "elsewhere").mkdir()
    mine = tmp_path / "mine.py"
    mine.write_text(MISBEHAVING.format(elsewhere=str(tmp_path / "elsewhere")))
    out = os.path.relpath(tmp_path / "run", ROOT)  # relative, as `--out runs/mine` is
    proc = run_train(["--model", model_dir, "--data", tolerance_data(tmp_path / "rows.jsonl"), "--steps", "1",
                      "--out", out, "--reward", f"{mine}:reward"] + BASE)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == out
    assert not list((tmp_path / "elsewhere").iterdir())
    row, = strict_json_rows(tmp_path / "run" / "metrics.jsonl")
    assert 0 < row["reward_error"] < 1 and row["reward_seen"] == pytest.approx(1 - row["reward_error"])
    assert row["skipped_updates"] == 0 and row["updates"] > 0
    assert proc.stderr.count("returned 1e+308: expected a finite number") == 1


HANGS = """import time
calls = []
def reward(reply, row):
    calls.append(reply)
    if len(calls) > 1:  # (the first call is the check at load, on the row's own answer)
        open({mark!r}, "w").close()
        time.sleep(1000)  # a judge that never answers
    return 1.0
"""


def hanging_reward(tmp_path):
    """A --reward whose every call after the check at load hangs, having made tmp_path/hung."""
    path = tmp_path / "hangs.py"
    path.write_text(HANGS.format(mark=str(tmp_path / "hung")))
    return f"{path}:reward"


@pytest.mark.slow
def test_a_reward_that_hangs_is_cut_by_its_time_limit(tiny, tmp_path):
    """--reward-timeout 1: each of the step's 4 replies (one round) ends after 1 s as an error,
    said once on stderr; the run finishes (it used to hang for ever, silent)."""
    model_dir, _ = tiny
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", tolerance_data(tmp_path / "rows.jsonl"), "--steps", "1",
                      "--out", str(out), "--reward", hanging_reward(tmp_path), "--reward-timeout", "1",
                      "--mini-batches", "1", "--max-refills", "0"] + flags(prompts_per_step="2", samples="2"),
                     timeout=300)
    row, = strict_json_rows(out / "metrics.jsonl")
    assert row["reward_error"] == 1.0 and row["accuracy"] == 0.0
    assert proc.stderr.count("RewardTimeout") == 1 and "no result within --reward-timeout 1 s" in proc.stderr


@pytest.mark.slow
def test_ctrl_c_during_a_reward_that_hangs_still_checkpoints(tiny, tmp_path):
    """Ctrl-C while the reward hangs, with no time limit: the call under way ends after
    UserReward.STOP_GRACE seconds, the step's later ones are not made (errors, counted), and the
    checkpoint promised is written at the end of the step (the call used to go on, and the step,
    for ever)."""
    model_dir, _ = tiny
    out = tmp_path / "run"
    argv = ["--model", model_dir, "--data", tolerance_data(tmp_path / "rows.jsonl"), "--steps", "3",
            "--out", str(out), "--reward", hanging_reward(tmp_path), "--reward-timeout", "0",
            "--mini-batches", "1"] + flags(prompts_per_step="2", samples="2")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py")] + argv, cwd=ROOT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (tmp_path / "hung").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in stderr, stderr[-2000:]
    assert "stopped after step 1, checkpointed" in stdout and (out / "checkpoint.pt").exists()
    row, = strict_json_rows(out / "metrics.jsonl")
    assert row["reward_error"] == 1.0 and stderr.count("RewardStopped") == 1


@pytest.mark.slow
def test_a_run_whose_every_update_is_skipped_says_so_in_strict_json(tiny, tmp_path):
    """Rewards of +-1e308 (--correct-reward and --wrong-reward, which the bound on --reward's
    values does not cover): a group's sum overflows, every update is skipped. metrics.jsonl
    stays strict JSON (null where the means are not finite) and the third such step warns."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", data_file, "--steps", "3", "--out", str(out),
                      "--correct-reward", "1e308", "--wrong-reward=-1e308"] + BASE)
    rows = strict_json_rows(out / "metrics.jsonl")
    assert all(r["skipped_updates"] > 0 and r["updates"] == 0 for r in rows)
    said = [[w for w in r.get("warnings", []) if w.startswith("every update was skipped")] for r in rows]
    assert [len(s) for s in said] == [0, 0, 1] and proc.stderr.count("warning: every update was skipped") == 1


@pytest.mark.slow
def test_bf16_path_runs(tiny, tmp_path):
    """--dtype bfloat16 (the GPU default): rollouts from a bf16 copy of the policy, updates under
    autocast with fp32 master weights, GKL, TIS and old log-probs included. The sampler's bf16
    log-probs then differ a little from the trainer's, which shows the bf16 copy did the sampling."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out),
               "--dtype", "bfloat16", "--kl", "gkl", "--kl-coef", "1.0", "--mini-batches", "2",
               "--tis-cap", "2"] + BASE)
    rows = metrics(out)
    assert len(rows) == 2 and all(r["skipped_updates"] == 0 for r in rows)
    assert all(0 < r["sampler_trainer_mismatch"] < 0.05 for r in rows)
    assert all(0.5 < r["tis_weight"] <= 2 for r in rows)
    from safetensors.torch import load_file
    saved = load_file(out / "final" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())  # fp32 master weights


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_chunked_gkl_term_equals_gkl_loss_on_whole_logits(tiny, tmp_path, agg):
    """reference.kl_term makes GKL's logits a few positions at a time from the body's output it is
    handed (recomputed in backward); loss and gradient equal objectives.gkl_loss on whole logits."""
    import types

    import data
    from variants import objectives, reference
    run = in_process_run(tmp_path, tiny, "--kl", "gkl", "--kl-coef", "1.0", "--loss-agg", agg,
                         "--gkl-beta", "2.0", "--gkl-gamma", "0.5", "--gkl-temperature", "1.5",
                         "--gkl-weight-temperature", "2.0")
    model, ref = run.policy, run.reference
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids, attn, mask, start = data.pack([[2, 4, 5], [2, 6]], [[7, 8, 9, 3, 10], [9, 11]], "cpu")
    div = {"num_tokens": mask.sum(), "num_seqs": 2}
    mb = types.SimpleNamespace(ids=ids, attn=attn, start=start, mask=mask)

    hidden = model(ids, attn, return_hidden=True)
    loss, _ = reference.kl_term(run, mb, div, hidden, None, positions=2)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    C = mask.shape[1]
    logits = model(ids, attn)[:, start - 1:start - 1 + C]
    with torch.no_grad():
        ref_logits = ref(ids, attn)[:, start - 1:start - 1 + C]
    want, _ = objectives.gkl_loss(logits, ref_logits, mask, alpha=1.0, beta=2.0, gamma=0.5,
                                  temperature=1.5, weight_temperature=2.0, agg=agg, **div)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    assert loss.item() > 0 and torch.allclose(loss, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "rloo", "reinforce_baseline", "grpo_passk",
                                    "opo", "gpg", "dpo",
                                    "step-dpo", "dapo-gkl", "dapo-adversarial", "dapo-ppl",
                                    "dapo-adaptive-budget", "dapo-balanced",
                                    "ladder-1-overlong-filtering"])
def test_every_variant_runs_end_to_end(tiny, tmp_path, preset):
    """Each preset's flags reach working code: two steps, finite metrics, a saved model."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--preset", preset, "--model", model_dir, "--data", data_file, "--steps", "2",
               "--max-refills", "1", "--out", str(out)] + BASE)
    rows = metrics(out)
    assert len(rows) == 2 and (out / "final" / "model.safetensors").exists()
    assert all(r["skipped_updates"] == 0 for r in rows)
    if preset == "dapo-ppl":  # in place of the overlong punishment, not beside it
        assert all(r["reward_overlong"] == 0 for r in rows) and any(r["reward_ppl"] for r in rows)
    if preset.endswith("dpo"):  # no policy-gradient tokens: no entropy or clip figures, not zeros
        assert sum(r["pairs"] for r in rows) > 0
        assert all(r["entropy"] is None and r["clip_frac_high"] is None for r in rows)
        raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(r["tokens_per_second_scoring"] is None for r in raw)  # no old log-probs
    else:  # None only in a step without a loss token (every group dropped, every reply truncated)
        assert all(r["entropy"] is None or r["entropy"] > 0 for r in rows)


@pytest.mark.slow
def test_heldout_avg_at_k_beside_greedy(tiny, tmp_path):
    """--eval-samples K: avg@K at --eval-temperature / --eval-top-p beside the greedy pass@1, as
    DAPO reports avg@32 at temperature 1 and top-p 0.7."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--eval-data", data_file, "--eval-limit",
               "4", "--eval-samples", "3", "--steps", "1", "--out", str(out)] + BASE)
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["k"] for e in evals] == [3, 3] and all(0 <= e["avg@k"] <= 1 for e in evals)


@pytest.mark.slow
def test_resume_before_the_first_checkpoint_starts_over(tiny, tmp_path):
    """A run killed before its first checkpoint: --resume starts it over, and its logs hold each
    step once (the step-0 held-out evaluation is not written twice)."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--eval-data", data_file,
               "--eval-limit", "4", "--steps", "1", "--out", str(out)] + BASE)

    def evals():
        rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]

    first = evals()
    for name in ("checkpoint.pt", "metrics.jsonl"):  # as if killed during step 1
        (out / name).unlink()
    import shutil
    shutil.rmtree(out / "final")
    run_train(["--resume", str(out)])
    assert [r["step"] for r in evals()] == [0, 1] and evals() == first
    assert [r["step"] for r in metrics(out)] == [1]


def test_a_resume_that_changes_the_model_is_refused_by_name(tmp_path, capsys):
    """A checkpoint holds the weights of one model, adapters and quantisation: a --resume with
    another is refused naming the flag; the same value again, or another flag, is fine."""
    from run import config, runs
    args, _ = config.parse_config(["--model", "some/model", "--lora-rank", "4"])
    runs.write_config(str(tmp_path), {k: v for k, v in vars(args).items() if k != "resume"})
    for flag, value in [("--model", "other/model"), ("--lora-rank", "8"), ("--quantize", "nf4")]:
        with pytest.raises(SystemExit):
            config.parse_config(["--resume", str(tmp_path), flag, value])
        said = capsys.readouterr().err
        assert f"{flag} {value} on --resume: the run's checkpoint holds {flag} " in said, said
    args, _ = config.parse_config(["--resume", str(tmp_path), "--model", "some/model", "--steps", "5"])
    assert args.steps == 5 and args.lora_rank == 4


@pytest.mark.slow
def test_resume_of_a_missing_run_is_a_clear_error(tmp_path):
    proc = run_train(["--resume", str(tmp_path / "nope")], check=False)
    assert proc.returncode != 0 and "--resume" in proc.stderr and "Traceback" not in proc.stderr


def test_no_module_imports_train_or_eval_and_none_cites_the_design_notes():
    for path in ROOT.glob("*.py"):
        text = path.read_text()
        assert not any(line.split()[:2] in (["import", "train"], ["import", "eval"], ["from", "train"],
                                            ["from", "eval"]) for line in text.splitlines()), path.name
    for path in [*ROOT.glob("*.py"), *ROOT.glob("tests/*.py"), ROOT / "README.md"]:
        assert "DESIGN" + ".md" not in path.read_text(), path.name


# ---------------------------------------------------------------------------------------------
# Bad input never costs a run, a result or a file


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                 "group-token-mean"])
def test_entropy_bonus_trains_under_every_aggregation(tiny, tmp_path, agg):
    """--entropy-coef used to crash at the first update with loss tokens (a tensor unpacked as
    a pair), after the step-0 evaluation."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out),
               "--entropy-coef", "0.01", "--loss-agg", agg] + BASE)
    assert [r["skipped_updates"] for r in metrics(out)] == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_checkpoint_resumes_from_the_one_before(tiny, tmp_path, damage):
    """The newest checkpoint is damaged (a disk filled up, a copy cut short): --resume warns and
    goes on from the one before, and the run still ends as a run never stopped."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--checkpoint-every", "1"] + \
        flags(mini_batches="2")
    straight = tmp_path / "straight"
    run_train(common + ["--steps", "4", "--out", str(straight)])
    damaged = tmp_path / "damaged"
    run_train(common + ["--steps", "3", "--out", str(damaged)])
    newest = damaged / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 3] if damage == "truncated" else b"")
    proc = run_train(["--resume", str(damaged), "--steps", "4"])
    assert "checkpoint.pt is damaged" in proc.stderr and "resuming from checkpoint-previous.pt" in proc.stderr
    assert_same_run(straight, damaged)
    # The damaged file was set aside: the saves after the resume did not keep it as a fallback.
    assert (damaged / "checkpoint.pt.damaged").exists()
    assert torch.load(damaged / "checkpoint-previous.pt", weights_only=True)["progress"]["step"] == 3
    # Both damaged: a clear error, and nothing is started over by surprise.
    for name in ("checkpoint.pt", "checkpoint-previous.pt"):
        (damaged / name).write_bytes(b"")
    proc = run_train(["--resume", str(damaged), "--steps", "5"], check=False)
    assert proc.returncode != 0 and "no readable checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_damaged_config_is_a_clear_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"lr": 1e-5, "steps"')
    proc = run_train(["--resume", str(run_dir)], check=False)
    assert proc.returncode == 2 and "config.json: damaged" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_second_writer_is_refused(tiny, tmp_path):
    """A --resume started while the run still goes (or a second run with the same --out) is
    refused before it touches anything; it used to crash the first run at its checkpoint."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--model", model_dir,
                              "--data", data_file, "--steps", "100000", "--out", str(out)] + BASE,
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.1)
        before = (out / "metrics.jsonl").read_text().count("\n")
        second = run_train(["--resume", str(out)], check=False, timeout=120)
        assert second.returncode != 0 and "is being written by train.py, pid" in second.stderr
        again = run_train(["--model", model_dir, "--data", data_file, "--out", str(out)] + BASE,
                          check=False, timeout=120)
        assert again.returncode != 0 and "already exists" in again.stderr
        assert first.poll() is None  # the first run goes on
        time.sleep(1)
        assert (out / "metrics.jsonl").read_text().count("\n") >= before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # Its lock went with it: the run can now be resumed.
    from run import runs
    runs.lock(str(out)).close()


def test_lock_and_unreadable_log_lines(tmp_path, capsys):
    from run import runs
    held = runs.lock(str(tmp_path))
    with pytest.raises(runs.RunError, match="is being written by train.py, pid"):
        runs.lock(str(tmp_path))
    held.close()
    runs.lock(str(tmp_path)).close()
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, garbage\n{"step": 3}\n{"step": 4')
    runs.trim_log(str(log), 3)
    assert log.read_text() == '{"step": 1}\n{"step": 3}\n'
    assert (tmp_path / "metrics.jsonl.unreadable").read_text() == '{"step": 2, garbage\n{"step": 4\n'
    assert "2 unreadable line(s)" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_keeps_the_flags_it_was_given(tiny, tmp_path, capsys):
    """`--resume R --steps N` is written back to config.json (a later plain --resume used to
    fall back to the first run's --steps and write final/ early); --preset with --resume and a
    damaged value in config.json are refused, before any work."""
    from run import config
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "1", "--out", str(out)] + BASE)
    run_train(["--resume", str(out), "--steps", "2"])
    assert json.loads((out / "config.json").read_text())["steps"] == 2
    assert [r["step"] for r in metrics(out)] == [1, 2]
    with pytest.raises(SystemExit):
        config.parse_config(["--resume", str(out), "--preset", "grpo"])
    assert "--preset with --resume" in capsys.readouterr().err
    for key, value in (("adv_estimator", "foo"), ("samples", "8"), ("dynamic_sampling", "yes")):
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**saved, key: value}))
        with pytest.raises(SystemExit) as error:
            config.parse_config(["--resume", str(out)])
        assert error.value.code == 2 and "--" + key.replace("_", "-") in capsys.readouterr().err
        (out / "config.json").write_text(json.dumps(saved))


@pytest.mark.slow
def test_a_bad_out_or_an_inert_flag_fails_before_any_work(tiny, tmp_path, capsys):
    from run import config
    model_dir, data_file = tiny
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = run_train(["--model", model_dir, "--data", data_file, "--out", str(a_file / "run")]
                     + BASE, check=False)
    assert proc.returncode != 0 and "cannot make it" in proc.stderr and "Traceback" not in proc.stderr
    # Adversarial variants and surplus groups live in refill rounds: without them the flag
    # would change nothing (as --adversarial did under the CPU defaults, which have no refill).
    for argv in (["--adversarial"], ["--keep-surplus"], ["--model", "x", "--adversarial",
                                                         "--no-dynamic-sampling"]):
        with pytest.raises(SystemExit):
            config.parse_config(argv)
        assert "acts in refill rounds" in capsys.readouterr().err
    config.parse_config(["--adversarial", "--max-refills", "2"])
    for argv in (["--cuda-graphs", "--routing-replay"], ["--cuda-graphs", "--compile", "on"],
                 ["--cuda-graphs", "--lora-rank", "8", "--quantize", "nf4"]):
        with pytest.raises(SystemExit):
            config.parse_config(argv)
        assert "--cuda-graphs replays the eager decode step" in capsys.readouterr().err
    # default (auto): on a GPU only, and not where the step must stay eager
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for argv, device, on in [([], cuda, True), ([], cpu, False), (["--routing-replay"], cuda, False),
                             (["--compile", "on"], cuda, False), (["--no-cuda-graphs"], cuda, False),
                             (["--compile", "off"], cuda, True),
                             (["--lora-rank", "8", "--quantize", "nf4"], cuda, False)]:
        args, _ = config.parse_config(argv)
        config.on_device(args, device)
        assert config.sampling_options(args, [])["engine"].speed.cuda_graphs is on, (argv, device)
    if not torch.cuda.is_available():
        proc = run_train(["--model", model_dir, "--data", data_file, "--out", str(tmp_path / "g"),
                          "--cuda-graphs"] + BASE, check=False)
        assert proc.returncode != 0 and "--cuda-graphs replays decode steps on a GPU" in proc.stderr


def test_variants_that_outgrow_the_prompt_budget_are_dropped(tiny, tmp_path):
    import dapo
    import data
    run = in_process_run(tmp_path, tiny, "--template", "none", "--max-new-tokens", "40",
                         "--dynamic-sampling", "--max-refills", "1", "--adversarial")
    hints = ["t " * 3, "t " * 40]  # the second makes the hinted prompt longer than 64 - 40
    batch = rollouts(records=[{"id": "a", "prompt": "What is 1 + 1 ?", "answer": "2", "hint": h}
                              for h in hints], correct=[False] * 4)
    variants = data.adversarial_variants(batch.records, dapo.adversarial_requests(
        batch.correct, batch.group_sizes), run.variant_rng, run.tokenizer, run.args.template,
        max_prompt_tokens=run.policy.config.max_seq_len - run.args.max_new_tokens)
    assert [v["variant"] for v in variants] == ["hint"] and variants[0]["prompt"].endswith("t t t ")


@pytest.mark.parametrize("prompts_per_step, updates", [("2", 3), ("4", 2), ("8", 1), ("6", 1)])
def test_mini_batches_are_a_full_batchs_share(tiny, tmp_path, prompts_per_step, updates):
    """Mini-batches hold 1/mu of a full batch, in samples (DAPO, verl): the 2 groups of 2 samples
    kept make mu = 3 updates when 2 groups are a full batch (1 + 1 + 2 samples: sizes differ by
    one, no empty update), and ceil(3 x 2/4) = 2, ceil(3 x 2/8) = 1, ceil(3 x 2/6) = 1 updates when
    dynamic sampling kept 2 of 4, 8 or 6 groups; never more updates of fewer samples."""
    import train
    run = in_process_run(tmp_path, tiny, "--mini-batches", "3", "--prompts-per-step", prompts_per_step)
    batch = rollouts(advantages=[1.0, -1.0, -1.0, 1.0], old_logprobs=[None] * 4)
    sums, _ = train.update(run, batch)
    assert sums["updates"] == updates and "empty_updates" not in sums


def test_a_step_that_keeps_no_group_is_logged_not_scheduled(tiny, tmp_path, monkeypatch):
    """A step whose dynamic sampling kept nothing makes no update: it counts as a step (the log,
    --steps) but not on the learning-rate schedule's clock (warm-up, cosine), as in verl."""
    import train
    from run import launch
    run = in_process_run(tmp_path, tiny, "--warmup-steps", "4", "--adv-estimator", "reinforce_baseline",
                         "--log-samples", "0")
    sampled = rollouts(advantages=None)
    nothing = train.Collected(kept=sampled.select([]), sampled=[sampled], surplus=None, asked=0)
    monkeypatch.setattr(train, "collect_rollouts", lambda run, progress: nothing)
    progress, row, _ = train.train_step(run, launch.Progress(step=5, trained_steps=2))
    assert (progress.step, progress.trained_steps, row["trained_steps"]) == (6, 2, 2)
    assert row["lr"] == pytest.approx(train.lr_at(2, run.args)) == pytest.approx(1e-3 * 3 / 4)
    assert row["updates"] == 0 and row["groups_kept"] == 0


def test_plot_reads_a_torn_log_and_names_a_missing_run(tmp_path):
    pytest.importorskip("matplotlib")
    from run import runs
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train_seconds": 6, "accuracy": 0.5}\n{"step": 2, "tr')
    runs.plot([str(run_dir)])
    assert (run_dir / "curve.png").exists()
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        runs.plot([str(tmp_path / "nope")])
    log = tmp_path / "run.log"  # a shell glob that caught the runs' logs beside them
    log.write_text("step 1\n")
    (run_dir / "config.json").write_text('{"preset": "dapo"}')
    with pytest.raises(SystemExit, match="run.log: no config.json there"):
        runs.plot([str(run_dir), str(log)])


def test_a_run_on_a_read_only_file_system_is_named_not_a_traceback(tmp_path, monkeypatch, capsys):
    """--resume's lock and runs.py's plot where nothing can be written (a read-only file system,
    stood in for by open and savefig raising EROFS there): a RunError saying what to do, and the
    plot written to a temporary folder instead, said on stderr."""
    import builtins
    import errno
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.figure  # (an attribute of matplotlib only once imported)

    from run import runs
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train_seconds": 6, "accuracy": 0.5}\n')

    def read_only(path, *args, **kwargs):
        mode = (args[:1] or [kwargs.get("mode", "r")])[0]
        if str(path).startswith(str(run_dir)) and set(mode) & set("wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return builtins.open(path, *args, **kwargs)
    monkeypatch.setattr(runs, "open", read_only, raising=False)
    with pytest.raises(runs.RunError, match="cannot write there \\(Read-only file system\\); a run resumes"):
        runs.lock(str(run_dir))
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: read_only(path, "wb")
                        and real_savefig(fig, path, **kw))
    runs.plot([str(run_dir)])
    err = capsys.readouterr().err
    assert f"cannot write {run_dir}/curve.png (Read-only file system); written to" in err
    assert os.path.exists(err.strip().split("written to ")[1]) and not (run_dir / "curve.png").exists()


def test_comparison_table_means_spreads_and_convergence():
    """runs.summary_table: one row per label, mean +- sd over seeds, the first step at 90% of
    the best label's final accuracy (here 0.9 * 0.8 = 72%)."""
    from run import runs

    def run(label, accuracies, memory):
        return {"label": label, "eval": [{"step": 10 * i, "pass@1": a} for i, a in enumerate(accuracies)],
                "metrics": [{"tokens_per_second_rollout": 100.0, "tokens_per_second_update": 50.0,
                             "peak_memory_mib": memory}]}
    table = runs.summary_table([run("a", [0.2, 0.6, 0.8], 900), run("a", [0.2, 0.75, 0.8], 1100),
                                run("b", [0.2, 0.5, 0.6], 800)])
    lines = table.splitlines()
    assert "first step >= 72.0%" in lines[0] and len(lines) == 4
    assert lines[2] == "| a | 2 | 80.0% +- 0.0% | 80.0% +- 0.0% | 15 +- 7 | 100 +- 0 | 50 +- 0 | 1000 +- 141 |"
    assert lines[3] == "| b | 1 | 60.0% | 60.0% | - | 100 | 50 | 800 |"


# ---- model families (issue 11) ------------------------------------------------------------------

def family_checkpoint(directory, family):
    """conftest's tiny `family` model on the digit vocabulary of digit_checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import randomise_, tiny_config
    digits = digit_checkpoint(Path(directory) / "digits")
    cfg = tiny_config(family)
    getattr(cfg, "text_config", cfg).vocab_size = len(AutoTokenizer.from_pretrained(digits))
    torch.manual_seed(0)
    model = randomise_(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(digits).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("family", ["gemma3", "gemma3_mm", "gemma2", "mistral"])
def test_two_steps_on_each_family(tiny, tmp_path, family):
    """2 steps of train.py's loop on each new family (in this process: no interpreter start),
    and final/ loads in transformers (the MoE runs the whole CLI below)."""
    from transformers import AutoModelForCausalLM

    import train
    from run import checkpoints, launch
    model_dir = family_checkpoint(tmp_path / "model", family)
    # Every group trains and the entropy bonus gives a gradient even when no answer is right.
    run = in_process_run(tmp_path, (model_dir, tiny[1]), "--max-new-tokens", "20",
                         "--no-dynamic-sampling", "--entropy-coef", "0.01")
    progress, rows, threads = launch.Progress(), [], torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess runs have it (OMP_NUM_THREADS=1)
    try:
        for _ in range(2):
            progress, row, _ = train.train_step(run, progress)
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["grad_norm"] > 0
    assert all(r["sampler_trainer_mismatch"] < 1e-4 for r in rows)
    assert "router_aux_loss" not in rows[0]  # dense
    checkpoints.save_model(run.policy, run.tokenizer, str(tmp_path / "final"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "final")


@pytest.mark.slow
def test_two_steps_of_an_moe_with_lora_router_loss_and_replay(tiny, tmp_path):
    """train.py end to end on Qwen3-MoE: LoRA on attention and experts, the router loss logged,
    and with routing replay (two updates a step, so step 3 recomputes) the trainer's log-probs
    equal the sampler's."""
    model_dir = family_checkpoint(tmp_path / "model", "qwen3_moe")
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", tiny[1], "--steps", "2", "--out", str(out)]
              + flags(max_new_tokens="20") + ["--lora-rank", "4", "--router-aux-coef", "0.01",
                                               "--routing-replay", "--mini-batches", "2",
                                               "--no-dynamic-sampling", "--entropy-coef", "0.01"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sampler_trainer_mismatch"] < 1e-4 for r in rows)
    assert all(r["router_aux_loss"] > 1.0 and r["grad_norm"] > 0 for r in rows)  # k = 2 balanced
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "final")


@pytest.mark.parametrize("extra, message", [
    (["--router-aux-coef", "0.01"], "has no experts"),
    (["--routing-replay"], "has no experts"),
    (["--routing-replay", "--algo", "dpo"], "not on DPO")])
def test_moe_flags_that_would_do_nothing_fail_before_training(tiny, tmp_path, capsys, extra,
                                                              message):
    model_dir = tiny[0] if "dpo" not in extra else family_checkpoint(tmp_path / "m", "qwen3_moe")
    with pytest.raises(SystemExit) as error:
        in_process_run(tmp_path, (model_dir, tiny[1]), *extra)
    assert message in str(error.value) and not (tmp_path / "run").exists()


def test_replayed_routing_lines_up_with_the_packed_batch(tiny, tmp_path):
    """moe.replay_rows places each completion's recorded experts where data.pack puts its
    tokens: with unchanged weights, a free forward over the packed batch routes exactly as
    replayed."""
    import data
    import train
    from variants import moe
    from variants.moe import Routing
    model_dir = family_checkpoint(tmp_path / "model", "qwen3_moe")
    run = in_process_run(tmp_path, (model_dir, tiny[1]), "--routing-replay")
    records = next(run.stream)[:3]
    batch = train.sample_and_reward(run, records, [2, 1, 2], seeds=[1, 2, 3])
    rows = list(range(len(batch.tokens)))
    ids, attn, mask, start = data.pack(batch.prompts, batch.tokens, run.args.device)
    replay = moe.replay_rows(batch.routing, batch.prompts, batch.tokens, rows, mask.shape[1],
                             run.policy.config, run.args.device)  # (b, P+C, L, k)
    free = Routing()
    with torch.no_grad():
        run.policy(ids, attn, routing=free)
    fed = replay[..., 0, 0] >= 0  # (b, P+C) positions the sampler routed
    assert fed.sum() > 20 and not (fed & ~attn.bool()).any()
    assert torch.equal(replay[fed], free.stacked(run.policy.config)[fed])


# Clip-Cov's covariance window, widened for the tiny model's small covariances.
PRESET_FLAGS = {"clip-cov": ["--clip-cov-low", "-100", "--clip-cov-high", "100"]}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gspo", "cispo", "gmpo", "sapo", "clip-cov", "kl-cov",
                                    "dapo-high-entropy"])
def test_each_objective_acts_in_a_run(tiny, tmp_path, preset):
    """Each objective's preset reaches its loss: two steps of four updates (so the ratio leaves 1),
    finite updates, and the objective's own figure moving where it has one (GSPO's narrow
    sequence clip, CISPO's cut weights, the tokens the 80/20 rule and Clip-Cov / KL-Cov choose)."""
    import losses
    from variants import objectives
    model_dir, _ = tiny
    data_file = learnable_data(tmp_path / "learnable.jsonl")
    out = tmp_path / preset
    run_train(["--preset", preset, "--model", model_dir, "--data", data_file, "--steps", "2",
               "--max-refills", "1", "--template", "none", "--out", str(out)]
              + flags(lr="1e-2", max_new_tokens="24", prompts_per_step="8", seed="1",
                      mini_batches="4") + PRESET_FLAGS.get(preset, []))
    saved = json.loads((out / "config.json").read_text())
    rows = metrics(out)
    if preset == "dapo-high-entropy":  # the top 20% of each mini-batch's tokens (ties: a few more)
        assert saved["high_entropy_fraction"] == 0.2
        assert all(0.2 <= r["high_entropy_frac"] < 0.3 for r in rows)
        return
    assert saved["objective"] == preset and objectives.OBJECTIVES[preset] is not losses.policy_loss
    if preset in objectives.CHOOSING:  # 2e-4 / 2e-3 of a mini-batch's tokens: at least one
        assert all(0 < r["cov_chosen_frac"] < 0.05 for r in rows)
    assert all(r["skipped_updates"] == 0 and math.isfinite(r["grad_norm"]) for r in rows)
    assert max(r["ratio_max"] or 0.0 for r in rows) > 1.0  # later updates see a moved policy
    clipped = max(r["clip_frac_high"] + r["clip_frac_low"] for r in rows if r["clip_frac_high"] is not None)
    if preset in ("gspo", "cispo"):
        assert clipped > 0
    if preset == "sapo":  # a gate, no clip
        assert clipped == 0


def test_objective_flags_are_checked(capsys):
    from run import config
    args, _ = config.parse_config(["--model", "x", "--objective", "gspo"])
    assert args.clip_c is None  # the dapo preset's dual-clip belongs to the clipped ratio it replaces
    assert config.objective_settings(args) == {"eps_low": 0.2, "eps_high": 0.28}
    args, _ = config.parse_config(["--preset", "sapo", "--model", "x", "--sapo-tau-neg", "2"])
    assert config.objective_settings(args) == {"tau_pos": 1.0, "tau_neg": 2.0}
    chosen = torch.ones(2, 3, dtype=torch.bool)  # the covariance objectives take the chosen tokens
    args, _ = config.parse_config(["--model", "x", "--objective", "clip-cov"])
    assert config.objective_settings(args, chosen) == {"eps_low": 0.2, "eps_high": 0.28,
                                                       "chosen": chosen}
    args, _ = config.parse_config(["--model", "x", "--objective", "kl-cov", "--kl-cov-coef", "2"])
    assert config.objective_settings(args, chosen) == {"kl_coef": 2.0, "chosen": chosen}
    assert config.parse_config(["--preset", "cispo", "--model", "x"])[0].eps_low == 1.0  # no bound
    assert config.parse_config(["--preset", "gmpo", "--model", "x", "--eps-low", "1.5"])[0].eps_low == 1.5
    for argv, named in [(["--objective", "gspo", "--clip-c", "3"], "--objective gspo"),
                        (["--preset", "dpo", "--objective", "sapo"], "--objective sapo"),
                        (["--eps-low", "1.0"], "--eps-low"),           # the clipped ratio: [0, 1)
                        (["--objective", "cispo", "--eps-low", "1.5"], "--eps-low")]:
        with pytest.raises(SystemExit):
            config.parse_config(["--model", "x"] + argv)
        assert named in capsys.readouterr().err, argv


@pytest.mark.slow
def test_sampler_and_trainer_agree_below_temperature_one(tiny, tmp_path):
    """The CPU default samples at 0.8: at a temperature other than 1 the trainer's log-probs (of
    the logits divided by it) must still be the sampler's, on the fp32 path (BASE pins fp32)."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out)]
              + flags(temperature="0.7", mini_batches="2"))
    rows = metrics(out)
    assert all(r["sampler_trainer_mismatch"] < 1e-4 for r in rows)


def test_dpo_reads_untempered_log_probs(tiny, tmp_path):
    """DPO's implicit reward is beta * log(pi / pi_ref) of the policies themselves: the sampling
    temperature (0.5 here) must not divide the logits, or it changes the effective beta."""
    import data
    from model import token_logprobs
    from variants import objectives, reference
    run = in_process_run(tmp_path, tiny, "--preset", "dpo", "--temperature", "0.5")
    with torch.no_grad():  # a reference apart from the policy, so the margins are not all 0
        for p in run.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    packed = data.pack([[2, 4, 5], [2, 4, 5]], [[7, 8, 9], [10, 3]], "cpu")
    mb = reference.PairBatch(ids=packed.ids, attn=packed.attn, start=packed.start, mask=packed.mask,
                             pairs=1, num_pairs=torch.tensor(1.0))
    loss, _ = reference.dpo_loss(run, mb)
    with torch.no_grad():
        seq = (token_logprobs(run.policy, packed.ids, packed.attn, start=packed.start) * packed.mask).sum(-1)
        ref = (token_logprobs(run.reference, packed.ids, packed.attn, start=packed.start)
               * packed.mask).sum(-1)
    want, _ = objectives.dpo_loss(seq[:1], seq[1:], ref[:1], ref[1:], 0.1, num_pairs=1.0)
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)


def test_truncated_sampling_with_a_rollout_correction_is_refused(capsys):
    """With --top-p < 1 the tokens come from the truncated distribution while the sampler's
    log-probs are of the whole one (the ratio to pi_old would be of the wrong behaviour policy):
    the corrections that read those log-probs are refused with it, by name."""
    from run import config
    for extra in (["--tis-cap", "2"], ["--keep-surplus", "--max-refills", "1"]):
        with pytest.raises(SystemExit):
            config.parse_config(["--model", "x", "--top-p", "0.9"] + extra)
        assert "--top-p" in capsys.readouterr().err
    assert config.parse_config(["--model", "x", "--top-p", "0.9"])[0].top_p == 0.9


def test_every_turn_earns_its_perplexity_penalty(tiny, tmp_path, monkeypatch):
    """The perplexity penalty, like the overlong punishment, scores every turn of an episode (it
    used to read the last turn only): a confused first turn costs its episode."""
    import train
    from rollout import Completion
    from tasks import episodes
    run = in_process_run(tmp_path, tiny, "--ppl-penalty", "beside", "--ppl-threshold", "0.5",
                         "--ppl-window", "1.0", "--overlong-penalty", "--max-new-tokens", "4")
    turns = [episodes.Turn([2, 3], Completion(0, [5, 6], [-3.0, -3.0], "stop"), "Memory: 1"),  # nll 3
             episodes.Turn([2, 4], Completion(0, [7, 8, 9, 10], [-1.0] * 4, "length"), "Answer: 7")]
    monkeypatch.setattr(episodes, "play", lambda *a, **k: [turns])
    batch = train.Rollouts(**episodes.play_and_reward(
        run.sampler, run.tokenizer, [{"id": "q", "prompt": "x", "answer": "7"}], [1], [0], run.args,
        run.stop_ids))
    parts = batch.reward_parts[0]
    assert parts["ppl"] == pytest.approx(-1.0 + -0.5)         # turn 1: beyond the window; turn 2: half
    assert parts["overlong"] == pytest.approx(0.0 + -1.0)      # 2 of 4 tokens, then the whole budget
    assert batch.rewards == [pytest.approx(1.0 - 1.5 - 1.0)] * 2  # right, less both turns' terms


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_a_signal_stops_at_a_step_with_a_checkpoint(tiny, tmp_path, signum):
    """A scheduler's SIGTERM or a Ctrl-C: the step under way ends, a checkpoint is written (the
    run checkpoints by time only here, so it would have none), one line says how to go on, no
    traceback, exit status 128 + the signal's number; --resume then equals never stopping."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--steps", "8"] + BASE
    straight = tmp_path / "straight"
    run_train(common + ["--out", str(straight)])
    stopped = tmp_path / "stopped"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py")] + common + ["--out", str(stopped)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            (stopped / "metrics.jsonl").exists() and (stopped / "metrics.jsonl").read_text().strip()):
        time.sleep(0.02)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum and "Traceback" not in stderr, stderr[-2000:]
    steps = [r["step"] for r in metrics(stopped)]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) < 8
    assert f"stopped after step {len(steps)}, checkpointed: python train.py --resume" in stdout
    assert (stopped / "checkpoint.pt").exists() and not (stopped / "final").exists()
    run_train(["--resume", str(stopped)])
    assert_same_run(straight, stopped)


def test_a_repeated_signal_within_two_seconds_is_the_same_request(monkeypatch, capsys):
    """A scheduler signalling every process of a torchrun job reaches each rank twice (directly
    and forwarded by torchrun): one request. A signal again later stops the process at once."""
    from run import launch
    killed = []
    with launch.StopRequest() as stop:
        monkeypatch.setattr(os, "kill", lambda pid, signum: killed.append(signum))
        stop.ask(signal.SIGTERM, None)
        stop.ask(signal.SIGTERM, None)
        assert stop.signum == signal.SIGTERM and killed == []
        stop.asked_at -= launch.StopRequest.REPEAT_SECONDS
        stop.ask(signal.SIGTERM, None)
        assert killed == [signal.SIGTERM]
    assert capsys.readouterr().err.count("SIGTERM: stopping at the end of this step") == 1


def descendants(pid):
    """The processes below `pid` (children, theirs, ...), from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


@pytest.mark.slow
def test_sigterm_to_a_torchrun_job_stops_every_rank_at_one_step_with_a_checkpoint(tiny, tmp_path):
    """A scheduler's SIGTERM to every process of a torchrun job (torchrun and its two ranks, as
    SLURM does): each rank gets it twice, directly and forwarded by torchrun, and that is one
    request; both ranks end the same step, rank 0 checkpoints and says so, and a torchrun --resume
    then equals the run never stopped."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--steps", "8"] + BASE
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    launcher = torchrun() + ["--shutdown-timeout", "120"]  # the ranks' time to end their step
    run_train(common + ["--out", str(straight)], launcher=launcher)
    proc = subprocess.Popen(launcher + [str(ROOT / "train.py")] + common + ["--out", str(stopped)],
                            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            (stopped / "metrics.jsonl").exists() and (stopped / "metrics.jsonl").read_text().strip()):
        time.sleep(0.02)
    for pid in [proc.pid] + descendants(proc.pid):  # every process of the job, as schedulers do
        os.kill(pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    steps = [r["step"] for r in metrics(stopped)]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) < 8, stderr[-3000:]
    assert f"stopped after step {len(steps)}, checkpointed" in stdout, stdout[-2000:] + stderr[-3000:]
    assert (stopped / "checkpoint.pt").exists() and not (stopped / "final").exists()
    run_train(["--resume", str(stopped)], launcher=torchrun())
    assert_same_run(straight, stopped)


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_one_before_stays(tiny, tmp_path, monkeypatch):
    """A full disk while a checkpoint is written: torch raises its own RuntimeError halfway
    through the file, which does not say ENOSPC. The run says the disk is full in one line (an
    exit, no traceback), leaves no half file, and the checkpoint before it loads."""
    import train
    from run import runs
    model_dir, data_file = tiny
    out = tmp_path / "run"
    real_save, calls = torch.save, []

    def save_until_the_disk_is_full(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint: a few bytes, then no space
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter "
                               "failed writing file data/12: file write failed")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    real_usage = runs.shutil.disk_usage
    monkeypatch.setattr(runs.shutil, "disk_usage",  # the disk as full as the write found it
                        lambda path: real_usage(path)._replace(free=4096) if len(calls) == 2 else real_usage(path))
    with pytest.raises(SystemExit) as stopped:
        train.main(["--model", model_dir, "--data", data_file, "--steps", "3", "--checkpoint-every",
                    "1", "--out", str(out)] + BASE)
    message = str(stopped.value.code)
    assert message.startswith("train.py: ") and "\n" not in message
    assert "could not write the checkpoint (the disk is full: 0 MiB free where" in message
    assert "the one before is kept" in message and "enforce fail" not in message
    assert not (out / "checkpoint.pt.tmp").exists()
    assert runs.load_checkpoint(str(out))["progress"]["step"] == 1


@pytest.mark.slow
def test_a_full_disk_at_a_log_line_is_one_line_and_resume_holds_each_step_once(tiny, tmp_path,
                                                                                monkeypatch):
    """The disk fills while step 3's metrics line is written (half of it got out): one line
    says so; --resume goes on from the checkpoint, the torn line set aside, each step once."""
    import errno
    import gc

    import train
    from run import runs
    model_dir, data_file = tiny
    out = tmp_path / "run"
    real_append = runs.append_line

    def append_until_the_disk_is_full(path, row):
        if path.endswith("metrics.jsonl") and row["step"] == 3:
            with open(path, "a") as f:
                f.write('{"step": 3, "upd')
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_append(path, row)

    monkeypatch.setattr(runs, "append_line", append_until_the_disk_is_full)
    with pytest.raises(SystemExit) as stopped:
        train.main(["--model", model_dir, "--data", data_file, "--steps", "4", "--checkpoint-every",
                    "2", "--out", str(out)] + BASE)
    message = str(stopped.value.code)
    assert message == (f"train.py: {out}/metrics.jsonl: could not write (No space left on device); the "
                       f"last checkpoint is whole: free some space and run python train.py --resume {out}")
    del stopped
    gc.collect()  # the run's lock on its directory goes with the run
    monkeypatch.undo()
    proc = run_train(["--resume", str(out)])
    assert "1 unreadable line(s)" in proc.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_full_disk_at_final_is_one_line_and_resume_writes_it(tiny, tmp_path, monkeypatch):
    import errno
    import gc

    import train
    from run import launch
    model_dir, data_file = tiny
    out = tmp_path / "run"

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(launch, "save_model", no_space)
    with pytest.raises(SystemExit) as stopped:
        train.main(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out)] + BASE)
    message = str(stopped.value.code)
    assert "final: could not write the model (No space left on device)" in message
    assert f"python train.py --resume {out}" in message and "\n" not in message
    assert (out / "checkpoint.pt").exists() and not (out / "final").exists()
    del stopped
    gc.collect()  # the run's lock on its directory goes with the run (the system frees it)
    monkeypatch.undo()
    run_train(["--resume", str(out)])
    assert (out / "final" / "model.safetensors").exists()
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_the_device_defaults_time_limit_checkpoints_and_activation_checkpointing(tiny, tmp_path):
    """No --time-limit: 20 minutes on a CPU (the offline default run), none on CUDA; checkpoints
    every 5 minutes on a CPU, every 10 steps on CUDA (resolved at setup and saved; given flags
    win). --activation-checkpointing auto: off on a CPU; bare, on."""
    from run import config, launch
    model_dir, data_file = tiny
    argv = ["--model", model_dir, "--data", data_file, "--out", str(tmp_path / "run"), "--steps", "1",
            "--dtype", "float32", "--compile", "off", "--max-new-tokens", "3"]
    args, _ = config.parse_config(argv)
    assert args.time_limit is None and args.activation_checkpointing == "auto"
    run = launch.setup(args)
    assert run.args.time_limit == 20.0 and not run.policy.gradient_checkpointing
    assert run.args.checkpoint_minutes == 5.0 and run.args.checkpoint_every == 0
    on_cuda = config.parse_config(argv)[0]
    config.on_device(on_cuda, torch.device("cuda"))  # (sets the defaults; touches no GPU)
    assert (on_cuda.time_limit, on_cuda.checkpoint_minutes, on_cuda.checkpoint_every) == (0.0, 0.0, 10)
    given = config.parse_config(argv + ["--checkpoint-minutes", "30", "--checkpoint-every", "0"])[0]
    config.on_device(given, torch.device("cuda"))
    assert (given.checkpoint_minutes, given.checkpoint_every) == (30.0, 0)
    args, _ = config.parse_config(argv + ["--activation-checkpointing", "--time-limit", "0"])
    assert args.activation_checkpointing == "on" and args.time_limit == 0.0


def test_activation_checkpointing_auto_is_on_for_a_billion_parameters_on_cuda():
    from types import SimpleNamespace

    from run import config
    big, small = 1_000_000_000, 100
    for cuda, parameters, want in ((True, big, True), (True, small, False), (False, big, False)):
        args = SimpleNamespace(activation_checkpointing="auto")
        assert config.checkpoints_activations(args, parameters, cuda) == want, (cuda, want)
    for choice, want in (("on", True), ("off", False), (True, True), (False, False)):  # (old runs)
        args = SimpleNamespace(activation_checkpointing=choice)
        assert config.checkpoints_activations(args, small, True) == want


def test_ctrl_c_during_the_step_0_evaluation_is_one_line_and_the_run_goes_on(tiny, tmp_path,
                                                                             capsys, monkeypatch):
    """SIGINT's handler for the steps starts after the step-0 held-out evaluation: Ctrl-C there
    (a KeyboardInterrupt) ends in one line with exit status 130, and --resume goes on."""
    import gc

    import train
    from run import evaluation
    model_dir, data_file = tiny
    out = tmp_path / "run"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(evaluation, "evaluate_and_log", interrupted)
    with pytest.raises(SystemExit) as stopped:
        train.main(["--model", model_dir, "--data", data_file, "--steps", "1", "--out", str(out),
                    "--eval-data", data_file, "--eval-limit", "2"] + BASE)
    err = capsys.readouterr().err
    assert stopped.value.code == 130 and "Traceback" not in err
    assert "interrupted (Ctrl-C) before the training steps" in err and f"--resume {out}` goes on" in err
    del stopped
    gc.collect()  # the run's lock on its directory goes with the run
    monkeypatch.undo()
    run_train(["--resume", str(out)])
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_run_with_the_calculator(tiny, tmp_path):
    """--tools calculator: two steps and a held-out evaluation with the tool on (an episode of
    one turn unless the model calls it: this one's vocabulary cannot write a call)."""
    _, data_file = tiny
    model_dir = digit_checkpoint(tmp_path / "model", context=128)  # room for the word on the tool
    out = tmp_path / "run"
    done = run_train(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out),
                      "--tools", "calculator", "--eval-every", "1", "--eval-data", data_file,
                      "--eval-limit", "4"] + BASE)
    assert "held-out: 4, tools: calculator" in done.stdout  # the header says the tool is on
    short = run_train(["--model", tiny[0], "--data", data_file, "--steps", "1", "--out", str(tmp_path / "no"),
                       "--tools", "calculator"] + BASE, check=False)  # a context of 64: no room
    assert short.returncode != 0 and "with --tools calculator" in short.stderr.strip().splitlines()[-1]
    rows = metrics(out)
    assert len(rows) == 2 and all(r["turns_per_episode"] == 1.0 and r["skipped_updates"] == 0 for r in rows)
    assert json.loads((out / "config.json").read_text())["tools"] == "calculator"
