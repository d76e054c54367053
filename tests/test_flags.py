"""Every numeric flag of train.py and eval.py with 0, -1, NaN and inf (and the out-of-range values
that once cost a run): each is either meaningful (the table below says what it means) or a usage
error that names the flag, exit code 2, before any model is loaded."""

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
                 "--gamma": ["--adv-estimator", "reinforce_pp"]}


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
