"""Every numeric flag of train.py and eval.py with 0, -1, NaN and inf (and the out-of-range values
that once cost a run): each is either meaningful (the table below says what it means) or a usage
error that names the flag, exit code 2, before any model is loaded."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import eval as ev  # noqa: E402
from run import config  # noqa: E402

VALUES = ["0", "-1", "nan", "inf"]

# (flag, value) pairs that mean something, and what. Every other pair must be refused.
TRAIN_MEANINGFUL = {
    ("--seed", "0"): "seed 0",
    ("--time-limit", "0"): "no time limit",
    ("--checkpoint-every", "0"): "checkpoints by time only",
    ("--checkpoint-minutes", "0"): "checkpoints by steps only",
    ("--lora-rank", "0"): "full fine-tuning",
    ("--eval-every", "0"): "held-out accuracy before and after only",
    ("--curriculum", "0"): "no curriculum",
    ("--max-refills", "0"): "no refill rounds",
    ("--correct-reward", "0"): "right answers score 0 (above the default -1 of wrong ones)",
    ("--wrong-reward", "0"): "wrong answers score 0 (the 1/0 reward)",
    ("--wrong-reward", "-1"): "DAPO's -1",
    ("--format-weight", "0"): "format terms logged, not added",
    ("--ppl-threshold", "0"): "any perplexity above 1 is penalised",
    ("--efficiency-weight", "0"): "no efficiency bonus",
    ("--eps-low", "0"): "no room below ratio 1",
    ("--eps-high", "0"): "no room above ratio 1",
    ("--tis-cap", "0"): "no truncated importance sampling",
    ("--tis-floor", "0"): "no lower bound on the kept ratios",
    ("--tis-reject-bound", "0"): "no bound: --tis-reject is off",
    ("--clip-cov-low", "0"): "Clip-Cov draws among covariances above 0",
    ("--clip-cov-low", "-1"): "Clip-Cov draws among covariances above -1",
    ("--kl-cov-coef", "0"): "KL-Cov without its penalty (the unclipped ratio)",
    ("--reward-kl-coef", "0"): "REINFORCE++ without the KL in the reward",
    ("--entropy-coef", "0"): "no entropy bonus",
    ("--kl-coef", "0"): "no KL term",
    ("--gkl-alpha", "0"): "GKL without its KL part",
    ("--gkl-beta", "0"): "GKL without its wMSE part",
    ("--warmup-steps", "0"): "no warm-up",
    ("--eval-samples", "0"): "held-out accuracy greedy only",
    ("--log-samples", "0"): "no samples.jsonl lines",
    ("--weight-decay", "0"): "no weight decay",
    ("--router-aux-coef", "0"): "no load-balancing loss (still logged for an MoE)",
    ("--kv-budget", "0"): "the sampler's KV pool holds every row at its longest",
    ("--max-rows", "0"): "the sampler runs all of a rank's rows at once",
    ("--micro-batch-tokens", "0"): "micro-batches are sized by rows alone",
    ("--plan-only", "0"): "the plan for this machine's GPU, if any",
    ("--reward-timeout", "0"): "no time limit on --reward's calls",
}
# Values once accepted that cost a run or a result (the list), beyond 0 / -1 / nan / inf.
TRAIN_EXTRA = [("--eps-low", "2"), ("--clip-c", "0.5"), ("--curriculum", "1.5"),
               ("--top-p", "1.5"), ("--tis-cap", "0.5"), ("--overlong-cache", "2.5"),
               ("--overlong-cache", "65"), ("--mini-batches", "17"), ("--samples", "1"),
               ("--correct-reward", "-2")]

EVAL_MEANINGFUL = {
    ("--temperature", "0"): "greedy",
    ("--top-k", "0"): "every token",
    ("--seed", "0"): "seed 0",
}


def numeric_flags(parser):
    """Flags whose value is a number: type int or float, or eval.py's checking parsers."""
    return [a.option_strings[0] for a in parser._actions if a.option_strings and
            (a.type in (int, float) or getattr(a.type, "__name__", "") == "parse")]


def train_cases():
    flags = numeric_flags(config.build_parser())
    assert {"--grad-clip", "--lr", "--steps", "--tis-cap", "--overlong-cache"} <= set(flags)
    return [(flag, value) for flag in flags for value in VALUES] + TRAIN_EXTRA


# The flags that act only beside another: given with it.
TRAIN_CONTEXT = {"--cov-fraction": ["--objective", "kl-cov"], "--kl-cov-coef": ["--objective", "kl-cov"],
                 "--clip-cov-low": ["--objective", "clip-cov"], "--clip-cov-high": ["--objective", "clip-cov"],
                 "--sapo-tau-pos": ["--objective", "sapo"], "--sapo-tau-neg": ["--objective", "sapo"],
                 "--reward-kl-coef": ["--adv-estimator", "reinforce_pp"],
                 "--gamma": ["--adv-estimator", "reinforce_pp"],
                 "--reward-timeout": ["--reward", "mine.py:f"]}


@pytest.mark.parametrize("flag, value", train_cases())
def test_train_numeric_flags(flag, value, capsys):
    argv = ["--model", "x", "--prompts-per-step", "2", "--samples", "8", flag, value] + \
        TRAIN_CONTEXT.get(flag, [])
    if (flag, value) in TRAIN_MEANINGFUL:
        args, _ = config.parse_config(argv)
        assert getattr(args, flag[2:].replace("-", "_")) == float(value)
        return
    with pytest.raises(SystemExit) as error:
        config.parse_config(argv)
    err = capsys.readouterr().err
    assert error.value.code == 2 and flag in err, err
    assert len(err.strip().splitlines()) == 2  # the short usage line, then the error


def test_the_reward_time_limit_acts_only_on_a_reward_function(capsys):
    """--reward-timeout: 60 s a call by default; given without --reward (the rule reward, or a
    task's own, is ours and never hangs) it is refused by name."""
    assert config.parse_config(["--model", "x", "--reward", "mine.py:f"])[0].reward_timeout == 60.0
    assert config.parse_config(["--model", "x", "--reward", "mine.py:f", "--reward-timeout", "1.5"])[0] \
        .reward_timeout == 1.5
    with pytest.raises(SystemExit):
        config.parse_config(["--model", "x", "--reward-timeout", "5"])
    assert "--reward-timeout acts only with --reward" in capsys.readouterr().err


def eval_cases():
    flags = numeric_flags(ev.build_parser())
    assert {"--temperature", "--top-p", "--k", "--limit", "--seed"} <= set(flags)
    return [(flag, value) for flag in flags for value in VALUES]


@pytest.mark.parametrize("flag, value", eval_cases())
def test_eval_numeric_flags(flag, value, capsys, tmp_path):
    argv = ["--data", "arithmetic", "--out", str(tmp_path / "out.jsonl"), flag, value]
    if (flag, value) in EVAL_MEANINGFUL:
        _, args = ev.parse_args(argv)
        assert getattr(args, flag[2:].replace("-", "_")) == float(value)
        return
    with pytest.raises(SystemExit) as error:
        ev.parse_args(argv)
    err = capsys.readouterr().err
    assert error.value.code == 2 and flag in err, err


@pytest.mark.parametrize("script, argv", [
    ("train.py", ["--grad-clip", "nan"]),
    ("train.py", ["--lr", "inf"]),
    ("train.py", ["--temperat", "0.5"]),
    ("eval.py", ["--temperature", "inf"]),
])
@pytest.mark.slow
def test_a_bad_flag_is_one_clear_line_before_any_work(script, argv):
    proc = subprocess.run([sys.executable, str(ROOT / script)] + argv, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert argv[0] in proc.stderr and len(proc.stderr.strip().splitlines()) == 2, proc.stderr


def readme_commands():
    """Every train.py and eval.py command in the README's shell blocks, continuations joined;
    placeholders (runs/NAME, `...`) and --resume (which reads a run) left out."""
    text = (ROOT / "README.md").read_text()
    blocks = "\n".join(b.split("```")[0] for b in text.split("```bash")[1:])
    out = []
    for line in blocks.replace("\\\n", " ").split("\n"):
        line = line.split("#")[0].strip()
        for part in line.split("&&"):
            words = part.split()
            for script in ("train.py", "eval.py"):
                if script in words and "..." not in words and "--resume" not in words:
                    out.append((script, words[words.index(script) + 1:]))
    return out


def test_every_readme_command_parses(tmp_path, capsys):
    """The README's training and evaluation commands are valid as written (flags, values and
    their combinations; nothing loaded)."""
    commands = readme_commands()
    assert sum(s == "train.py" for s, _ in commands) >= 5 and any(s == "eval.py" for s, _ in commands)
    for script, argv in commands:
        argv = [str(tmp_path / "out") if a == "runs/NAME/final" else a for a in argv]
        if script == "train.py":
            config.parse_config(argv)
        else:
            ev.parse_args(argv + ["--out", str(tmp_path / "eval.jsonl")])


# ---- a --kv-budget under one row: refused by name, before any weight, leaving nothing ------------

def kv_budget_argv(model, out, budget):
    """train.py on the tiny digit model: float32, so a block of 16 positions is 16 x 2 layers x
    (keys, values) x 2 KV heads x 8 dims x 4 bytes = 4096 bytes."""
    return ["--model", model, "--out", str(out), "--steps", "1", "--compile", "off", "--dtype", "float32",
            "--max-new-tokens", "16", "--kv-budget", budget]


def check_kv_refusal(message):
    """'--kv-budget 1e-06 GiB: a row of P prompt + 16 new tokens needs ceil((P + 16) / 16) blocks
    of 16 positions (4096 bytes each ...) ... holds 0 blocks' (1e-6 GiB is 1073 bytes)."""
    found = re.search(r"train\.py: --kv-budget 1e-06 GiB: a row of (\d+) prompt \+ 16 new tokens needs "
                      r"(\d+) blocks of 16 positions \(4096 bytes each, .*holds 0 blocks", message)
    assert found, message
    assert int(found[2]) == -(-(int(found[1]) + 16) // 16) and "raise --kv-budget" in message


def test_a_kv_budget_under_one_row_is_refused_before_any_weight_and_leaves_no_run(tmp_path, monkeypatch):
    """train.py's setup stops naming --kv-budget with the arithmetic: no weight read, no run
    directory, so the same command with a budget that holds a row then starts cleanly."""
    from run import launch
    from test_train import digit_checkpoint
    model, out, loads, load = digit_checkpoint(tmp_path / "model"), tmp_path / "run", [], launch.load_model
    monkeypatch.setattr(launch, "load_model", lambda *a, **k: loads.append(a) or load(*a, **k))
    with pytest.raises(SystemExit) as refused:
        launch.setup(config.parse_config(kv_budget_argv(model, out, "0.000001"))[0])
    check_kv_refusal(str(refused.value))
    assert not loads and not out.exists()
    run = launch.setup(config.parse_config(kv_budget_argv(model, out, "0.001"))[0])  # 262 blocks
    run.run_lock.close()
    assert loads and (out / "run.lock").is_file()


@pytest.mark.parametrize("gib", [[], ["80"]])
def test_plan_only_refuses_a_kv_budget_under_one_row_by_name(tmp_path, gib):
    """train.py --plan-only [GIB] (memory_plan.plan_only, as train.py calls it) with the same
    budget: the same refusal as the run's, naming --kv-budget, not a plan that quietly holds 0 of
    its rows (or says the rollout needs more than the GPU it fits)."""
    from run import launch, memory_plan
    from test_train import digit_checkpoint
    argv = kv_budget_argv(digit_checkpoint(tmp_path / "model"), tmp_path / "run", "0.000001")
    with pytest.raises(SystemExit) as refused:
        memory_plan.plan_only(config.parse_config(argv + ["--plan-only"] + gib)[0], launch.load_data)
    check_kv_refusal(str(refused.value))
    assert not (tmp_path / "run").exists()
