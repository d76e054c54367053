"""A reward function of your own, for train.py --reward recipes/tolerance_reward.py:reward.

The rule reward (rewards.math_reward) asks for an answer equal to the data's. A measured or
estimated quantity needs a tolerance instead, and it can differ by problem, so each data row
carries its own: {"prompt": "...", "answer": "373.15", "tolerance": 0.5}. The function gets the
reply's text and that row with all its fields, and returns the score, with parts to log
(metrics.jsonl: reward_answered).

    python train.py --data my_rows.jsonl --reward recipes/tolerance_reward.py:reward
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(reply, row):
    """1 if the reply's last number is within row["tolerance"] (default 0) of row["answer"],
    else 0; the part "answered": whether it gave a number at all."""
    numbers = NUMBER.findall(reply.replace(",", ""))
    if not numbers:
        return 0.0, {"answered": 0.0}
    error = abs(float(numbers[-1]) - float(row["answer"]))
    return float(error <= float(row.get("tolerance", 0))), {"answered": 1.0}
