"""Countdown (countdown.py): the verifier's cases, the task's problems and split, a 2-step run.

Run: python -m pytest tests/test_countdown.py -q
"""

import itertools
import random
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data  # noqa: E402
from tasks import (
    countdown,  # noqa: E402
    verify,  # noqa: E402
)

ROW = {"numbers": [25, 5, 3], "target": 60}


@pytest.mark.parametrize("reply,solved,uses", [
    ("Answer: (25 - 5) * 3", True, True),
    ("(25-5)*3 = 60, so\nAnswer: 3 * (25 - 5)", True, True),     # another order
    ("Answer: (25 - 5) * 3 = 60", True, True),                   # the equation written out
    ("Answer: \\boxed{(25-5) \\times 3}", True, True),            # LaTeX's times, in a box
    ("Answer: 25 * 3 - 5 * 3", False, False),                    # 60, but 5 and 3 twice
    ("Answer: 25 * 3 - 15", False, False),                       # 60, but 15 is not given
    ("Answer: 25 + 5 + 3", False, True),                         # each number once, 33
    ("Answer: 25 * 5", False, False),                            # 3 unused
    ("Answer: (25 - 5) 3", False, False),                        # a product without *
    ("Answer: (25 - 5) ** 3", False, False),                     # bad syntax
    ("Answer: 25 / (5 - 5) * 3", False, False),                  # 1/0
    ("Answer: sixty", False, False),
    ("", False, False),
])
def test_the_verifier(reply, solved, uses):
    assert countdown.reward(reply, ROW) == (solved, {"uses_numbers": float(uses)})


def test_division_is_exact_and_numbers_count_with_repeats():
    assert countdown.reward("Answer: 8 / 3 * 3", {"numbers": [8, 3, 3], "target": 8})[0]  # not 7.999
    assert countdown.reward("Answer: 7 / 2 + 1 / 2", {"numbers": [7, 2, 1, 2], "target": 4})[0]
    assert not countdown.reward("Answer: 8 / 3 * 3", {"numbers": [8, 3], "target": 8})[0]
    assert verify.arithmetic_value("1 - -2") == (Fraction(3), [Fraction(1), Fraction(2)])
    assert verify.arithmetic_value("2 ^ 3") is None and verify.arithmetic_value("x + 1") is None


def solvable(numbers, target):
    """An independent check: some order and operations reach the target exactly."""
    values = [Fraction(n) for n in numbers]
    if len(values) == 1:
        return values[0] == target
    for i, j in itertools.permutations(range(len(values)), 2):
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        a, b = values[i], values[j]
        for result in [a + b, a - b, a * b] + ([a / b] if b else []):
            if solvable(rest + [result], target):
                return True
    return False


def test_every_problem_can_be_solved_and_the_split_holds():
    task = countdown.CountdownTask.from_spec("countdown:numbers=3,max=20")
    train = task.sample(200, random.Random(0))
    assert all(not countdown.is_heldout(r["numbers"], r["target"]) for r in train)
    assert all(len(r["numbers"]) == 3 and 1 <= min(r["numbers"]) <= max(r["numbers"]) <= 20 for r in train)
    assert all(solvable(r["numbers"], r["target"]) for r in train[:60])
    held = task.heldout(100)
    assert held == task.heldout(100) and len({r["id"] for r in held}) == 100  # fixed and distinct
    assert all(countdown.is_heldout(r["numbers"], r["target"]) for r in held)
    assert countdown.is_heldout([5, 3, 25], 60) == countdown.is_heldout([25, 5, 3], 60)  # any order
    assert not {r["id"] for r in held} & {r["id"] for r in train}
    assert len(countdown.CountdownTask.from_spec("countdown:numbers=4,max=99").sample(3, random.Random(1))[0]["numbers"]) == 4


@pytest.mark.parametrize("spec", ["countdown:numbers=1", "countdown:max=1", "countdown:size=3",
                                  "countdown:numbers=x", "countdowns"])
def test_a_bad_spec_names_itself(spec):
    with pytest.raises(data.DataError, match="countdown"):
        countdown.CountdownTask.from_spec(spec)


@pytest.mark.parametrize("spec, key, value", [("countdown:numbers=\u00b2", "numbers", "\u00b2"),
                                             ("countdown:numbers=\u0663", "numbers", "\u0663"),
                                             ("countdown:max=\uff19\uff19", "max", "\uff19\uff19")])
def test_digits_other_than_0_to_9_are_refused_by_name(spec, key, value):
    """str.isdigit takes a superscript two (int() then raises), an Arabic-Indic three and
    full-width nines (int() reads them): each is a DataError naming the key and its value."""
    with pytest.raises(data.DataError) as error:
        countdown.CountdownTask.from_spec(spec)
    assert f"{key} must be a whole number written in the digits 0-9, got {value!r}" in str(error.value)


@pytest.mark.slow
def test_two_steps_of_countdown_and_its_held_out_accuracy(tmp_path):
    """train.py --data countdown: the task's own reward (uses_numbers logged) and its held-out
    problems judged by it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_train import BASE, digit_checkpoint, metrics, run_train
    model = digit_checkpoint(tmp_path / "model", context=128)
    out = tmp_path / "run"
    run_train(["--model", model, "--data", "countdown", "--steps", "2", "--out", str(out),
               "--eval-limit", "8", "--eval-every", "1"] + BASE)
    rows = metrics(out)
    assert len(rows) == 2 and all(0 <= r["reward_uses_numbers"] <= 1 for r in rows)
    assert all(r["reward_error"] == 0 for r in rows)
    evals = [line for line in (out / "eval.jsonl").read_text().splitlines()]
    assert len(evals) >= 2
