"""Countdown, a built-in task: reach a target from a few numbers with + - * / and parentheses,
each number used once (the task of TinyZero, GRPO-Zero and nano-aha-moment).

    python train.py --data countdown                    3 numbers in 1..20 (a CPU size)
    python train.py --data countdown:numbers=4,max=99   TinyZero's size (README: a GPU run)

Every problem can be solved: its target is the value of an expression drawn over its numbers. The
reply ends with "Answer: <expression>"; `reward` reads that expression with verify.py's own
parser (never eval) and checks it uses each number once, in any order, and reaches the target
exactly (8 / 3 * 3 is 8). A quarter of the problems, chosen by a hash of the numbers and the
target, are held out, as the arithmetic task's are (data.in_heldout_split).
"""

import random
from collections import Counter
from fractions import Fraction

from data import HELDOUT_EVERY, DataError, in_heldout_split, spec_number
from tasks.verify import arithmetic_value, extract_answer


def reward(reply, row):
    """Countdown's verdict on one reply: (solved, {"uses_numbers": 1 if the expression is
    arithmetic on exactly the row's numbers, each once, else 0}). The trainer scores a verdict as
    the rule reward scores right and wrong (--correct-reward, --wrong-reward)."""
    answer = extract_answer(reply)
    read = arithmetic_value(answer.split("=")[0]) if answer else None  # "(7 + 3) * 2 = 20": the left
    if read is None:
        return False, {"uses_numbers": 0.0}
    value, used = read
    uses_numbers = Counter(used) == Counter(Fraction(n) for n in row["numbers"])
    return uses_numbers and value == row["target"], {"uses_numbers": float(uses_numbers)}


def countdown_record(numbers, target):
    """The record of one problem: its prompt, the target as the answer, the numbers."""
    listed = ", ".join(map(str, numbers))
    return {"prompt": f"Using the numbers {listed}, each exactly once, and + - * / with parentheses, "
                      f"make {target}. End with a line of the form Answer: <expression>.",
            "answer": str(target), "id": f"countdown:{listed}->{target}",
            "numbers": list(numbers), "target": target}


def is_heldout(numbers, target):
    """Whether a problem is in the fixed held-out split (the numbers' order does not matter)."""
    return in_heldout_split(f"countdown:{sorted(numbers)}->{target}")


class CountdownTask:
    """Seeded Countdown problems: `count` numbers in [1, max_value], a positive whole target."""

    SPEC_KEYS = ("numbers", "max")
    reward_function = staticmethod(reward)  # launch.task_reward_function: the task's own reward

    def __init__(self, count=3, max_value=20):
        if not 2 <= count <= 6:
            raise DataError(f"countdown: numbers must be in 2..6, got {count}")
        if not 2 <= max_value <= 10_000:
            raise DataError(f"countdown: max must be in 2..10000, got {max_value}")
        self.count, self.max_value = count, max_value

    @classmethod
    def from_spec(cls, spec):
        """`countdown` or `countdown:numbers=4,max=99` (keys: SPEC_KEYS)."""
        head, _, options = spec.partition(":")
        if head != "countdown":
            raise DataError(f"{spec!r}: a countdown spec starts with 'countdown'")
        kwargs = {}
        for item in filter(None, options.split(",")):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or key not in cls.SPEC_KEYS:
                raise DataError(f"{spec!r}: bad option {item!r}; use key=integer with keys "
                                f"{', '.join(cls.SPEC_KEYS)}")
            kwargs[{"numbers": "count", "max": "max_value"}[key]] = spec_number(spec, key, value)
        return cls(**kwargs)

    def spec(self):
        return f"countdown:numbers={self.count},max={self.max_value}"

    def _draw(self, rng):
        """Numbers, and a target reached by combining them in a random order with random
        operations (each step on two values, every value a positive whole number: a division
        only when exact), or None when the target is out of range (then draw again)."""
        numbers = [rng.randint(1, self.max_value) for _ in range(self.count)]
        values = [Fraction(n) for n in numbers]
        while len(values) > 1:
            a, b = (values.pop(rng.randrange(len(values))) for _ in range(2))
            op = rng.choice("+-*/")
            if (op == "-" and a == b) or (op == "/" and (a % b or a == b)):  # no 0, no wasted 1
                op = "+"
            if op == "-" and a < b:
                a, b = b, a
            values.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)
        target = values[0]  # a whole number: every step above keeps one
        return (numbers, int(target)) if 0 < target <= 10 * self.max_value else None

    def sample(self, n, rng):
        """n training problems (repeats possible), never held out; `rng` is a random.Random."""
        records = []
        while len(records) < n:
            drawn = self._draw(rng)
            if drawn and not is_heldout(*drawn):
                records.append(countdown_record(*drawn))
        return records

    def heldout(self, n):
        """The first n distinct held-out problems: the same list every call and every run."""
        rng, records, seen = random.Random("countdown-heldout"), [], set()
        for _ in range(n * HELDOUT_EVERY * 100):
            drawn = self._draw(rng)
            if drawn and is_heldout(*drawn) and (tuple(sorted(drawn[0])), drawn[1]) not in seen:
                seen.add((tuple(sorted(drawn[0])), drawn[1]))
                records.append(countdown_record(*drawn))
                if len(records) == n:
                    return records
        raise DataError(f"{self.spec()}: could not find {n} distinct held-out problems")
