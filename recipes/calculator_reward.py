"""A reward that teaches a model to reach for the calculator, for train.py --reward with --tools.

    python train.py --data arithmetic:digits=3,ops=* --tools calculator \
        --reward recipes/calculator_reward.py:reward

The rule reward scores the final answer alone. On products of 3-digit numbers a small model is
almost never right without the tool and rarely calls it, so nearly every group is all wrong and
carries no gradient (eq. 11). This reward pays a little for the steps towards a right answer: a
call the calculator can evaluate, and more for one with the problem's own operands, so the groups
where some replies make one have a signal, while a right answer still scores most. The reply it
reads is the whole episode, calls and results included (episodes.next_turn); the row is the
arithmetic task's, with its operands.
"""

import re

from tasks import verify

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
BONUS = 0.25  # each step: a call that evaluates, a call with the problem's operands


def reward(reply, row):
    """+1 right / -1 wrong (verify.is_correct, as the rule reward judges), plus BONUS for a call
    the calculator evaluates and BONUS more when a call holds exactly the problem's operands.
    Parts: accuracy (what counts as right), calc_call and operand_call (logged as reward_...)."""
    if not isinstance(row.get("operands"), list):
        raise ValueError("calculator_reward reads the arithmetic task's rows (their operands); "
                         "this row has none: --data arithmetic:...,ops=*")
    right = verify.is_correct(reply, row["answer"])
    calls = [verify.arithmetic_value(call) for call in CALL.findall(reply)]  # (value, numbers)
    evaluated = [value[1] for value in calls if value is not None]  # each call's numbers
    own = any(sorted(numbers) == sorted(row["operands"]) for numbers in evaluated)
    return (1.0 if right else -1.0) + BONUS * (bool(evaluated) + own), \
        {"accuracy": float(right), "calc_call": float(bool(evaluated)), "operand_call": float(own)}
