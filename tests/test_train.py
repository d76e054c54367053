"""train.py end to end on a tiny random model: smoke run, exact resume after SIGKILL, DDP (gloo)
equal to one process, bad data rejected before training, non-finite updates skipped, --help."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIGITS = [str(d) for d in range(10)]
WORDS = ["What", "is", "+", "?", "Question:", "Answer:", "the", "sum"]


def digit_checkpoint(directory, seed=0):
    """A random 2-layer Llama whose word-level vocabulary has the digits, so that a sampled
    answer is sometimes right and groups carry signal."""
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    special = ["<unk>", "<pad>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special + DIGITS + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=2, eos_token_id=3, pad_token_id=1,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
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
        "--overlong-cache", "1", "--time-limit", "0"]


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
        for k in [k for k in r if k.startswith(("seconds", "tokens_per_second", "train_seconds"))]:
            del r[k]
    return rows


def weights(run_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(run_dir, "final", "model.safetensors"))


def test_smoke_run_writes_everything(tiny, tmp_path):
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "3", "--out", str(out)] + BASE)
    assert {"config.json", "metrics.jsonl", "checkpoint.pt", "final"} <= set(os.listdir(out))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "accuracy", "groups_kept", "clip_frac_high", "entropy", "grad_norm",
                "sampler_trainer_mismatch", "response_length"):
        assert key in rows[0]
    # The sampler's log-probs are the trainer's (same weights, same temperature): tiny mismatch.
    assert all(r["sampler_trainer_mismatch"] < 1e-4 for r in rows)
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
    import train
    for name in dapo.PRESETS:
        args, _ = train.parse_config(["--preset", name, "--model", "x"])
        for key, value in dapo.PRESETS[name].items():
            assert getattr(args, key) == value, (name, key)
    args, explicit = train.parse_config(["--preset", "grpo", "--model", "x", "--kl-coef", "0.5"])
    assert args.kl == "k3" and args.kl_coef == 0.5 and explicit == {"preset", "model", "kl_coef"}
    default, _ = train.parse_config([])
    assert default.lr == train.CPU_DEFAULTS["lr"] and default.dynamic_sampling


def test_help_documents_every_flag():
    import train
    for action in train.build_parser()._actions:
        assert action.help, action.option_strings
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "--dynamic-sampling" in out.stdout


def learnable_data(path, n=16):
    """Every answer is 7 and every row has a hint: at a high learning rate the tiny model soon
    answers some groups all right, some all wrong, so dynamic sampling has surplus groups to
    carry and signal-less groups to turn into adversarial variants."""
    rows = [{"prompt": f"What is {i % 5} + {(3 * i) % 5} ?", "answer": "7", "id": f"q{i}",
             "hint": "7"} for i in range(n)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    [],
    # State beyond weights and data: carried surplus groups (one step stale), the RNG of the
    # harder variants, per-prompt accuracies.
    ["--adversarial", "--keep-surplus", "--adaptive-budget", "--lr", "3e-2", "--max-refills", "2"],
    # The GPU default: rollouts from a bf16 copy, which a resume must refresh from the checkpoint.
    ["--dtype", "bfloat16"],
], ids=["dapo", "adversarial-surplus-adaptive", "bf16"])
def test_resume_after_sigkill_is_bit_identical(tiny, tmp_path, variant):
    model_dir, data_file = tiny
    if "--adversarial" in variant:
        data_file = learnable_data(tmp_path / "learnable.jsonl")
    common = ["--model", model_dir, "--data", data_file, "--steps", "5", "--dynamic-sampling",
              "--max-refills", "1"] + BASE + variant
    straight = tmp_path / "straight"
    run_train(common + ["--out", str(straight)])
    if "--keep-surplus" in variant:  # the run must carry groups across the steps where it may be killed
        carried = [r["groups_carried"] for r in metrics(straight)]
        assert carried[1] + carried[2] > 0, carried

    killed = tmp_path / "killed"
    kill_then_resume(common, killed)
    assert_same_run(straight, killed)


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


def torchrun(nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(29500 + (os.getpid() + int(time.time() * 1000)) % 2000)]


@pytest.mark.slow
def test_ddp_resume_is_exact_per_rank(tiny, tmp_path):
    """Two gloo ranks: 3 steps, then --resume to 8, equals 8 straight. Refills make the ranks
    draw different numbers of batches, so each rank must get back its own data position (and
    RNGs, prompt accuracies, carried groups). (SIGKILL itself: the single-process test above.)"""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--dynamic-sampling", "--max-refills",
              "2", "--keep-surplus", "--prompts-per-step", "4"] + BASE
    straight = tmp_path / "straight"
    run_train(common + ["--steps", "8", "--out", str(straight)], launcher=torchrun())
    resumed = tmp_path / "resumed"
    run_train(common + ["--steps", "3", "--out", str(resumed)], launcher=torchrun())
    positions = [s["data"]["step"] for s in torch.load(resumed / "checkpoint.pt")["per_rank"]]
    assert positions[0] != positions[1], positions  # the ranks' data positions differ at step 3
    run_train(["--resume", str(resumed), "--steps", "8"], launcher=torchrun())
    assert_same_run(straight, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [[], ["--kl", "gkl", "--kl-coef", "1.0"]], ids=["dapo", "gkl"])
def test_ddp_two_ranks_equal_one_process(tiny, tmp_path, variant):
    """One update on the same global batch: torchrun with 2 gloo ranks vs 1 process."""
    model_dir, data_file = tiny
    common = ["--model", model_dir, "--data", data_file, "--steps", "1", "--dynamic-sampling",
              "--max-refills", "0", "--prompts-per-step", "8", "--seed", "3",
              ] + BASE[2:] + variant
    one = tmp_path / "one"
    run_train(common + ["--out", str(one)])
    two = tmp_path / "two"
    run_train(common + ["--out", str(two)],
              launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29500 + os.getpid() % 1000)])
    m1, m2 = metrics(one)[0], metrics(two)[0]
    assert m1["groups_kept"] == m2["groups_kept"] > 0
    kept = m2["groups_kept_per_rank"]
    assert kept[0] != kept[1], f"want uneven kept groups per rank to test padding, got {kept}"
    a, b = weights(one), weights(two)
    start = weights_from(model_dir)
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # the update is not trivial
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, (a[k] - b[k]).abs().max())


@pytest.mark.slow
def test_ddp_ranks_stop_together_at_the_time_limit(tiny, tmp_path):
    """Rank 0 alone evaluates between steps, so the ranks' clocks differ; they must still leave
    the loop at the same step (one rank leaving early leaves the other hung in a collective)."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", data_file, "--eval-data", data_file,
                      "--eval-limit", "16", "--eval-every", "1", "--steps", "100000",
                      "--out", str(out)] + BASE[:-2] + ["--time-limit", "0.05"],
                     launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(29600 + os.getpid() % 1000)], timeout=240)
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
def test_bad_data_fails_before_training(tiny, tmp_path, row, field):
    model_dir, _ = tiny
    bad = digit_data(tmp_path / "bad.jsonl", n=5, extra=row)
    out = tmp_path / "run"
    proc = run_train(["--model", model_dir, "--data", bad, "--out", str(out)] + BASE, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl" in proc.stderr and "row 6" in proc.stderr and field in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()


def test_nonfinite_update_is_skipped(tiny):
    import argparse
    import train
    from model import load_model
    model_dir, _ = tiny
    model, _ = load_model(model_dir)
    model.train()
    args = argparse.Namespace(device=torch.device("cpu"), mini_batches=1, micro_batch_size=4,
                              overlong_filter=False, max_new_tokens=3, eps_low=0.2, eps_high=0.28,
                              clip_c=None, loss_agg="token-mean", entropy_coef=0.0, kl="none",
                              temperature=1.0, grad_clip=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    samples = {"prompt": [[2, 4, 5], [2, 6]], "tokens": [[7, 8], [9]],
               "advantage": [float("nan"), 1.0], "group_id": [0, 0], "truncated": [False, False],
               "sampler_logp": [[0.0, 0.0], [0.0]], "old_logp": [None, None]}
    out = train.pg_update(model, None, opt, sched, samples, args, 1, lambda: torch.autocast("cpu", enabled=False))
    assert out["skipped_updates"] == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state  # the optimizer never stepped
    # No loss token anywhere (every completion filtered): not an error, just no update.
    args.overlong_filter, samples["truncated"] = True, [True, True]
    out = train.pg_update(model, None, opt, sched, samples, args, 1, lambda: torch.autocast("cpu", enabled=False))
    assert out["skipped_updates"] == 0 and out["empty_updates"] == 1 and not opt.state
    args.overlong_filter, samples["truncated"] = False, [False, False]
    samples["advantage"] = [1.0, -1.0]
    out = train.pg_update(model, None, opt, sched, samples, args, 1, lambda: torch.autocast("cpu", enabled=False))
    assert out["skipped_updates"] == 0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_bf16_path_runs(tiny, tmp_path):
    """--dtype bfloat16 (the GPU default): rollouts from a bf16 copy of the policy, updates under
    autocast with fp32 master weights, GKL and old log-probs included. The sampler's bf16 log-probs
    then differ a little from the trainer's, which shows the bf16 copy did the sampling."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--steps", "2", "--out", str(out),
               "--dtype", "bfloat16", "--kl", "gkl", "--kl-coef", "1.0", "--mini-batches", "2"]
              + BASE)
    rows = metrics(out)
    assert len(rows) == 2 and all(r["skipped_updates"] == 0 for r in rows)
    assert all(0 < r["sampler_trainer_mismatch"] < 0.05 for r in rows)
    from safetensors.torch import load_file
    saved = load_file(out / "final" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())  # fp32 master weights


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_chunked_gkl_term_equals_gkl_loss_on_whole_logits(tiny, agg):
    """train.kl_term makes GKL's logits a few positions at a time from the body's output it is
    handed (recomputed in backward); loss and gradient equal losses.gkl_loss on whole logits."""
    import argparse
    import copy
    import losses
    import train
    from model import load_model
    model_dir, _ = tiny
    model, _ = load_model(model_dir)
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    args = argparse.Namespace(kl="gkl", loss_agg=agg, gkl_alpha=1.0, gkl_beta=2.0, gkl_gamma=0.5,
                              gkl_temperature=1.5, gkl_weight_temperature=2.0, temperature=1.0)
    ids, attn, mask, P = train.pack([[2, 4, 5], [2, 6]], [[7, 8, 9, 3, 10], [9, 11]], "cpu")
    div = {"num_tokens": mask.sum(), "num_seqs": 2}

    hidden = model(ids, attn, return_hidden=True)
    loss = train.kl_term(model, lambda fn: fn(ref), hidden, ids, attn, P, None, mask, div, None,
                         args, positions=2)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    C = mask.shape[1]
    logits = model(ids, attn)[:, P - 1:P - 1 + C]
    with torch.no_grad():
        ref_logits = ref(ids, attn)[:, P - 1:P - 1 + C]
    want, _ = losses.gkl_loss(logits, ref_logits, mask, alpha=1.0, beta=2.0, gamma=0.5,
                              temperature=1.5, weight_temperature=2.0, agg=agg, **div)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    assert loss.item() > 0 and torch.allclose(loss, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "rloo", "reinforce_baseline", "dpo",
                                    "dapo-gkl", "dapo-adversarial", "dapo-ppl",
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


def test_resume_before_the_first_checkpoint_starts_over(tiny, tmp_path):
    """A run killed before its first checkpoint: --resume starts it over, and its logs hold each
    step once (the step-0 held-out evaluation is not written twice)."""
    model_dir, data_file = tiny
    out = tmp_path / "run"
    run_train(["--model", model_dir, "--data", data_file, "--eval-data", data_file,
               "--eval-limit", "4", "--steps", "1", "--out", str(out)] + BASE)

    def evals():
        rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if "seconds" not in k and k != "tokens_per_s"}
                for r in rows]

    first = evals()
    for name in ("checkpoint.pt", "metrics.jsonl"):  # as if killed during step 1
        (out / name).unlink()
    import shutil
    shutil.rmtree(out / "final")
    run_train(["--resume", str(out)])
    assert [r["step"] for r in evals()] == [0, 1] and evals() == first
    assert [r["step"] for r in metrics(out)] == [1]


def test_resume_of_a_missing_run_is_a_clear_error(tmp_path):
    proc = run_train(["--resume", str(tmp_path / "nope")], check=False)
    assert proc.returncode != 0 and "--resume" in proc.stderr and "Traceback" not in proc.stderr
