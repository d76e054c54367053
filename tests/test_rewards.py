"""Tests for verify.py and rewards.py: extraction, verification, shaping terms, format terms,
hostile input.

Run: python -m pytest tests/test_rewards.py -q
"""

import ast
import math
import os
import pathlib
import random
import re
import signal
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import data  # noqa: E402
import rewards  # noqa: E402
from rewards import (  # noqa: E402
    format_reward,
    math_reward,
    overlong_penalty,
    perplexity_penalty,
    rule_reward,
    xml_terms,
)
from run import launch  # noqa: E402
from tasks import verify  # noqa: E402
from tasks.verify import answers_equal, extract_answer, is_correct, normalize_answer  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Hand-computed vectors


@pytest.mark.parametrize("length, expected", [(15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0), (21, -1.0)])
def test_overlong_penalty_design_vector(length, expected):
    # L_max 20, L_cache 5: L = 16, 18, 20 -> -0.2, -0.6, -1 (15 -> 0, 21 -> -1).
    assert overlong_penalty(length, 20, 5) == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_edges():
    assert overlong_penalty(0, 20, 5) == 0.0
    assert overlong_penalty(10_000, 20, 5) == -1.0
    assert overlong_penalty(0, 20, 20) == 0.0  # the window may span the whole budget
    assert overlong_penalty(10, 20, 20) == pytest.approx(-0.5)
    # DAPO's run: L_max 20,480, L_cache 4,096.
    assert overlong_penalty(16_384, 20_480, 4_096) == 0.0
    assert overlong_penalty(18_432, 20_480, 4_096) == pytest.approx(-0.5)
    assert overlong_penalty(20_481, 20_480, 4_096) == -1.0


@pytest.mark.parametrize("args, name", [
    ((10, 20, 0), "cache_len"), ((10, 20, -1), "cache_len"), ((10, 20, 21), "cache_len"),
    ((10, 0, 0), "max_len"), ((10, -5, 1), "max_len"), ((-1, 20, 5), "length"),
    ((float("nan"), 20, 5), "length"), ((10, float("inf"), 5), "max_len"), ((10, 20, "5x"), "cache_len"),
])
def test_overlong_penalty_validation(args, name):
    with pytest.raises(ValueError, match=name):
        overlong_penalty(*args)


# ---------------------------------------------------------------------------------------------
# Perplexity penalty (this project's variant): eq. 13's shape in log-perplexity


@pytest.mark.parametrize("nll, expected", [
    (0.0, 0.0), (1.9, 0.0), (2.0, 0.0),  # at or below the threshold: no penalty
    (2.1, -0.2), (2.25, -0.5), (2.4, -0.8),  # (2.0 - nll) / 0.5 inside the window
    (2.5, -1.0), (3.0, -1.0), (float("inf"), -1.0), (float("nan"), -1.0),  # beyond: -1
])
def test_perplexity_penalty_values(nll, expected):
    assert perplexity_penalty(nll, 2.0, 0.5) == pytest.approx(expected, abs=1e-12)


def test_perplexity_penalty_matches_overlong_shape():
    # Same function as eq. 13 with threshold = L_max - L_cache, window = L_cache.
    for length in range(0, 30):
        assert perplexity_penalty(length, 15, 5) == pytest.approx(overlong_penalty(length, 20, 5))


@pytest.mark.parametrize("args, name", [
    ((2.5, 2.0, 0.0), "window"), ((2.5, 2.0, -1.0), "window"), ((2.5, 2.0, float("inf")), "window"),
    ((2.5, float("nan"), 1.0), "threshold"), (("x", 2.0, 1.0), "mean_nll"),
])
def test_perplexity_penalty_validation(args, name):
    with pytest.raises(ValueError, match=name):
        perplexity_penalty(*args)


# ---------------------------------------------------------------------------------------------
# Verification table: (response, truth, expected)

CASES = [
    # "Answer: X" (DAPO), last match, rest of the line
    ("Answer: 42", "42", True),
    ("Let me think.\n2 + 40 = 42\nAnswer: 42", "42", True),
    ("answer: 42", "42", True),
    ("**Answer:** 42", "42", True),
    ("Final Answer: 42", "42", True),
    ("Answer: 41\nwait, recheck\nAnswer: 42", "42", True),
    ("Answer: 42\nAnswer: 41", "42", False),
    ("Answer:\n42", "42", True),
    ("Answer: $\\boxed{42}$", "42", True),
    ("\\boxed{42}\nAnswer: 41", "42", False),  # "Answer:" outranks a box
    ("Check our answer: 17 * 2 = 34 fits\nso \\boxed{42}", "42", True),  # prose is not an Answer line
    ("\uff21\uff4e\uff53\uff57\uff45\uff52\uff1a\uff14\uff12", "42", True),  # full width
    # \boxed{...} / \fbox{...}, last balanced one
    ("so the result is \\boxed{42}", "42", True),
    ("\\boxed{1} then \\boxed{2}", "2", True),
    ("\\boxed{1} then \\boxed{2}", "1", False),
    ("$\\boxed{\\frac{1}{2}}$", "0.5", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
    ("\\fbox{7}", "7", True),
    ("$\\boxed{ 7 }$.", "7", True),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", True),
    ("\\boxed{5} and then a cut-off \\boxed{\\frac{1}{", "5", True),  # unbalanced last box skipped
    ("\\boxed 5", "5", True),
    ("\\boxed{\\text{(C)}}", "C", True),
    ("\\boxed{x^{2}}", "x^2", True),
    ("\\boxed{{{7}}}", "7", True),  # redundant braces group nothing (issue 10: was False)
    # GSM8K "#### X"
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", True),
    ("#### 1,000", "1000", True),
    ("#### 12\nno wait\n#### 13", "13", True),
    ("#### $18.90", "18.9", True),
    ("#### 12", "#### 12", True),
    ("The answer is 72.", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", True),  # a GSM8K solution as truth
    ("Answer: 5", "\\boxed{5}", True),  # a boxed truth
    # last number fallback
    ("The answer is 42.", "42", True),
    ("So she has 5 apples left", "5", True),
    ("we get -3", "-3", True),
    ("in total 1,000", "1000", True),
    ("about 3.50", "3.5", True),
    ("read pages 3-5", "-5", False),  # a hyphen, not a minus
    ("x = 10 and then 12", "10", False),
    # numeric equivalence
    ("Answer: 1,000", "1000", True),
    ("Answer: 1000.0", "1,000", True),
    ("Answer: 1000.00", "1000", True),
    ("Answer: 1/2", "0.5", True),
    ("Answer: 0.5", "\\frac{1}{2}", True),
    ("Answer: \\dfrac12", "1/2", True),
    ("Answer: \\tfrac{1}{2}", "0.5", True),
    ("Answer: \\frac12", "\\frac{1}{2}", True),
    ("Answer: .5", "0.5", True),
    ("Answer: -\\frac{1}{2}", "-0.5", True),
    ("Answer: \\frac{-1}{2}", "-1/2", True),
    ("Answer: 2/4", "1/2", True),
    ("Answer: 50\\%", "50", True),
    ("Answer: 50%", "50\\%", True),
    ("Answer: 50 percent", "50", True),
    ("Answer: 10 cm", "10", True),
    ("Answer: 10\\text{ cm}", "10", True),
    ("Answer: 12 dollars", "\\$12", True),
    ("Answer: \\$12.00", "12", True),
    ("Answer: 30 degrees", "30^\\circ", True),
    ("Answer: 30^{\\circ}", "30", True),
    ("Answer: 30\u00b0", "30", True),
    ("Answer: x = 5", "5", True),
    ("Answer: k=5", "5", True),
    ("Answer: The final answer is 5", "5", True),
    ("Answer: 5.", "5", True),
    ("Answer: 1e3", "1000", True),
    ("Answer: 3 \\times 10^{2}", "300", True),
    ("Answer: 10 square feet", "10", True),
    ("Answer: 5 m", "5", True),
    ("Answer: 1\\,000", "1000", True),
    ("Answer: 10,\\!080", "10080", True),
    ("Answer: +5", "5", True),
    ("Answer: 5", 5, True),  # int truth
    ("Answer: 0.25", 0.25, True),  # float truth
    ("Answer: \u22125", "-5", True),  # U+2212 minus
    ("Answer: \u00bd", "1/2", True),
    # LaTeX normalisation (MATH-style answers)
    ("Answer: \\left( 1, 2 \\right)", "(1,2)", True),
    ("Answer: (1, 2.0)", "(1,2)", True),
    ("Answer: [0, \\frac{1}{2})", "[0,0.5)", True),
    ("Answer: \\text{Sunday}", "Sunday", True),
    ("Answer: \\mathrm{Sunday}", "sunday", True),
    ("Answer: \\sqrt{2}", "\\sqrt2", True),
    ("Answer: 2\\sqrt{3}", "2 \\sqrt 3", True),
    ("Answer: \\pi", "\u03c0", True),
    ("Answer: 2\u03c0", "2\\pi", True),
    ("Answer: x \\leq 5", "x\\le5", True),
    ("Answer: \\displaystyle\\frac{3}{4}", "0.75", True),
    ("Answer: \\infty", "\u221e", True),
    ("Answer: x^{2}+1", "x^2 + 1", True),
    ("Answer: x\u00b2 + 1", "x^2+1", True),
    ("Answer: \\dbinom{5}{2}", "\\binom{5}{2}", True),
    ("Answer: (C)", "C", True),
    ("Answer: \\frac{1}{0}", "\\frac{1}{0}", True),  # equal strings; no division by zero
    # things that must NOT match
    ("Answer: 1/2", "2", False),
    ("Answer: 100", "10", False),
    ("Answer: 3", "3.5", False),
    ("Answer: \\frac{1}{3}", "0.33", False),
    ("Answer: 0.1", "1/3", False),
    ("Answer: -5", "5", False),
    ("Answer: \\sqrt{3}", "\\sqrt{2}", False),
    ("Answer: (1, 2)", "(2,1)", False),
    ("Answer: (1, 2)", "[1,2]", False),
    ("Answer: 1,2", "12", False),
    ("Answer: 50\\%", "0.5", False),  # a percentage equals its number, not its fraction
    ("Answer: 2m", "2", False),  # one-letter units only after a space: 2m may be a product
    ("Answer: 3i", "3", False),
    ("", "5", False),
    ("I don't know", "5", False),
    ("Answer: 5", "", False),
    ("Answer: 5", None, False),
    (None, "5", False),
    # hostile values: compared as strings, never evaluated
    ("Answer: 2**10", "1024", False),
    ("Answer: 1e999999999", "1e999999998", False),
    ("Answer: 1e999999999", "1e999999999", True),
    ("Answer: " + "9" * 150, "9" * 150, True),
    ("Answer: " + "9" * 150, "9" * 149 + "8", False),
    ("Answer: \\frac{10^{9999}}{3}", "3", False),
]


def test_table_is_large_enough():
    assert len(CASES) >= 80


@pytest.mark.parametrize("response, truth, expected", CASES)
def test_is_correct_table(response, truth, expected):
    got = is_correct(response, truth)
    assert type(got) is bool
    assert got == expected, (response, truth, extract_answer(response))


# ---------------------------------------------------------------------------------------------
# Equivalence: the judged table (tests/answer_cases.py) and the parts behind it

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from answer_cases import CASES as JUDGED  # noqa: E402


def test_judged_table_size():
    assert len(JUDGED) >= 300
    assert sum(not verdict for _, _, verdict, _ in JUDGED) >= len(JUDGED) / 3


@pytest.mark.parametrize("response, truth, verdict, reason", JUDGED,
                         ids=[f"{i}:{case[3]}" for i, case in enumerate(JUDGED)])
def test_judged_table(response, truth, verdict, reason):
    assert is_correct(response, truth) is verdict, (reason, extract_answer(response))


def test_equivalence_is_symmetric_and_repeatable():
    for response, truth, verdict, _ in JUDGED[::3]:
        answer = extract_answer(response)
        if answer:
            assert answers_equal(answer, truth) == answers_equal(truth, answer) == answers_equal(answer, truth)


F = verify.Fraction


@pytest.mark.parametrize("text, tree", [
    ("2x+1", ("+", ("*", ("n", 2), ("v", "x")), ("n", 1))),
    ("-x^2", ("neg", ("^", ("v", "x"), ("n", 2)))),
    ("2^10", ("^", ("n", 2), ("n", 10))),  # a whole number after ^, as plain text means
    ("2\\frac{1}{2}", ("n", F(5, 2))),  # a mixed number
    ("1/2x", ("*", ("/", ("n", 1), ("n", 2)), ("v", "x"))),  # left to right
    ("\\sin^2x", ("^", ("f", "\\sin", ("v", "x")), ("n", 2))),
    ("\\sqrt[3]{x}", ("root", ("n", 3), ("v", "x"))),
    ("x_{10}y", ("*", ("v", "x_10"), ("v", "y"))),
    ("(1,2]", ("seq", "(", "]", [("n", 1), ("n", 2)])),
    ("x\\ge2", ("seq", "[", ")", [("n", 2), ("inf",)])),
    ("x=2,x=3", ("list", [("n", 2), ("n", 3)])),
    ("x=1,y=2", ("seq", "(", ")", [("n", 1), ("n", 2)])),
    ("1\\pm2", ("set", [("+", ("n", 1), ("n", 2)), ("+", ("n", 1), ("neg", ("n", 2)))])),
    ("\\{3\\}", ("n", 3)),  # a one-element set is its element
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", ("mat", [[("n", 1), ("n", 2)], [("n", 3), ("n", 4)]])),
    ("1,000", ("n", 1000)),  # a thousand, not the list 1, 0
])
def test_parser_trees(text, tree):
    assert verify._read(text) == tree


@pytest.mark.parametrize("text", [
    "abc", "2**3", "(1,2", "\\frac{1}", "x==2", "1+", "\\unknown", "(5]", "\\begin{pmatrix}1&2\\\\3\\end{pmatrix}",
    "(" * 100 + "1" + ")" * 100, "+".join(["x"] * 300), "1" + "0" * 200,
])
def test_parser_refuses(text):
    with pytest.raises(verify._Fail):
        verify._read(text)


def test_exact_values():
    assert verify._power(F(-8), F(1, 3)) == F(-2)  # a real odd root
    assert verify._power(F(4, 9), F(3, 2)) == F(8, 27)
    assert verify._power(F(2), F(-3)) == F(1, 8)
    z, err = verify._power(F(2), F(1, 2))  # irrational: a float and its error bound
    assert abs(z - math.sqrt(2)) < 1e-15 and 0 < err < 1e-14  # a few units of rounding
    assert verify._power(F(-4), F(1, 2)) == (2j, verify._power(F(-4), F(1, 2))[1])
    with pytest.raises(ArithmeticError):
        verify._power(F(0), F(-1))
    with pytest.raises(ArithmeticError):  # 2^(2^100) is no float
        verify._power(F(2), F(2) ** 100)
    with pytest.raises(ArithmeticError):  # the divisor may be 0
        pi = verify._CONSTANT_VALUES["pi"]
        verify._div(F(1), verify._add(pi, verify._neg(pi)))


@pytest.mark.parametrize("a, b, equal", [
    ("\\cos\\frac{\\pi}{2}", "0", True),  # 6e-17 within its error bound of 0
    ("e^{i\\pi}+1", "0", True),
    ("10^{-13}\\pi", "0", False),  # tiny, but certainly not 0
    ("10^{30}\\pi-10^{30}\\pi+7", "7", False),  # 7 give or take 10^15: equal to nothing
    ("10^{30}\\pi-10^{30}\\pi+7", "8", False),
    ("2^{-3000}", "0", False),  # underflow is no value
    ("\\tan\\frac{\\pi}{2}", "10^{16}", False),  # a pole
    ("1.41421356237", "\\sqrt{2}", False),  # 11 digits
    ("(x-1)(x-2)(x-3)(x-4)(x-5)(x-6)+x", "x", False),  # agree at six integers, not at random points
    ("\\frac{x^2-1}{x-1}", "x+1", True),  # undefined at one point only
])
def test_float_agreement(a, b, equal):
    assert answers_equal(a, b) is equal


def test_work_is_counted_and_bounded(monkeypatch):
    """Count work, not seconds (robust on a loaded CI machine): no comparison evaluates more than
    MAX_WORK nodes and pairs; a comparison that would is unequal, never an error."""
    most = [0]
    spend = verify._Values.spend

    def counting(self):
        most[0] = max(most[0], self.work + 1)
        spend(self)

    monkeypatch.setattr(verify._Values, "spend", counting)
    members = [f"\\sqrt{{{k}}}x^2" for k in range(2, 30)]  # 28 float members, 6 points, matched pairwise
    heavy = ["\\{" + ",".join(members) + "\\}", "\\{" + ",".join(reversed(members)) + "\\}"]
    assert answers_equal(*heavy) is False  # equal sets, but past the budget: unequal
    assert most[0] == verify.MAX_WORK + 1
    most[0] = 0
    assert answers_equal(heavy[0].replace(",\\sqrt{29}x^2", ""), heavy[1].replace("\\sqrt{29}x^2,", ""))
    assert most[0] < verify.MAX_WORK  # one member fewer fits
    most[0] = 0
    assert answers_equal("(x+1)^2", "x^2+2x+1")
    assert most[0] == 6 * (5 + 9) + 1  # 6 points x (5 + 9 nodes), and one pair


# ---------------------------------------------------------------------------------------------
# Extraction details


def test_extraction_priority_order():
    both = "#### 3\n\\boxed{2}\nAnswer: 1\nand 4"
    assert extract_answer(both) == "1"
    assert extract_answer(both.replace("Answer: 1\n", "")) == "2"
    assert extract_answer("#### 3\nand 4") == "3"
    assert extract_answer("and 4 then 5") == "5"
    assert extract_answer("no digits here") is None
    assert extract_answer("") is None
    assert extract_answer(None) is None


def test_extraction_forms():
    assert extract_answer("\\boxed{\\frac{a}{\\sqrt{b}}}") == "\\frac{a}{\\sqrt{b}}"
    assert extract_answer("\\boxed{\\{1\\}}") == "\\{1\\}"  # escaped braces do not group
    assert extract_answer("\\boxed{a\\\\}b}") == "a\\\\"  # \\ is a line break, then } closes
    assert extract_answer("\\boxed{}") is None
    assert extract_answer("Answer: 7\n\n") == "7"
    assert extract_answer("so 1/2 of it") == "1/2"
    assert extract_answer("it was -0.25 today") == "-0.25"


def test_extraction_last_answer_anywhere():
    """The answer a response commits to last (issue 10): "Answer:" anywhere, as DAPO's checker reads
    it (the old rule took only an "Answer:" opening a line, so a self-correction mid-sentence lost to
    the first answer); a box after the answer's line is a later commitment; a lower-case "answer:"
    mid-sentence is prose."""
    assert extract_answer("Answer: 7\nWait, I made an error. Answer: 9") == "9"
    assert extract_answer("Answer: 7 and so the Final Answer: 8") == "8"
    assert extract_answer("ANSWER: 4") == "4"
    assert extract_answer("Answer: 7\nOn reflection $\\boxed{9}$") == "9"
    assert extract_answer("$\\boxed{9}$. Answer: 7") == "7"
    assert extract_answer("Answer: $\\boxed{5}$ cm") == "5"
    assert extract_answer("\\boxed{44}.\nWe may check our answer: 17 * 44 = 748") == "44"
    assert extract_answer("final answer: 3\nthen 4") == "3"  # lower case opening a line counts
    assert extract_answer("my answer: 3\nthen 4") == "4"  # mid-sentence it does not
    assert extract_answer("Answer:   \n  12") == "12"  # DAPO's \\s* after the colon


def test_extraction_reads_only_the_tail():
    # The answer sits at the end; only the last MAX_SCAN_CHARS characters are read.
    filler = "word " * (verify.MAX_SCAN_CHARS // 2)
    assert extract_answer(filler + "\nAnswer: 5") == "5"
    assert extract_answer("Answer: 5\n" + filler) is None


def test_normalize_answer():
    assert normalize_answer("\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("$10\\text{ cm}$.") == "10"
    assert normalize_answer("x = \\frac12") == "\\frac{1}{2}"
    assert normalize_answer("\\tfrac{\\sqrt3}{2}") == "\\frac{\\sqrt{3}}{2}"
    assert normalize_answer("90^\\circ") == "90"
    assert normalize_answer("\\text{Yes}") == "yes"
    assert normalize_answer(None) == ""


# ---------------------------------------------------------------------------------------------
# Format terms


def test_format_answer_line():
    assert format_reward("work\nAnswer: 5", "answer") == 1.0
    assert format_reward("work\n**Answer:** 5\n\n", "answer") == 1.0
    assert format_reward("Answer: 5\nmore text", "answer") == 0.0  # not the final line
    assert format_reward("work\nAnswer:", "answer") == 0.0  # nothing after the colon
    assert format_reward("the answer is 5", "answer") == 0.0
    assert format_reward("", "answer") == 0.0
    assert format_reward(None, "answer") == 0.0


STRICT_OK = "<think>\nreasoning\n</think>\n<answer>\n5\n</answer>"


@pytest.mark.parametrize("text, strict, soft", [
    (STRICT_OK, 1.0, 1.0),
    (STRICT_OK + "\n", 1.0, 1.0),  # surrounding blank space ignored
    ("<think>\n\n</think>\n<answer>\n\n</answer>", 1.0, 1.0),  # empty bodies, as the recipe regex
    ("<think>\na\nb\n</think>\n<answer>\n5\n</answer>", 1.0, 1.0),
    ("<think>reasoning</think><answer>5</answer>", 0.0, 1.0),  # no newlines
    ("<think>\nr\n</think>\n\n<answer>\n5\n</answer>", 0.0, 1.0),  # extra blank line
    ("Sure! " + STRICT_OK, 0.0, 1.0),  # text before
    (STRICT_OK + " done", 0.0, 1.0),  # text after
    (STRICT_OK.replace("reasoning", "<think>"), 0.0, 1.0),  # a tag twice
    ("<answer>\n5\n</answer>\n<think>\nr\n</think>", 0.0, 0.0),  # wrong order
    ("<think>\nr\n</think>\n5", 0.0, 0.0),  # no answer tags
    ("<think>\n</think>\n<answer>\n5\n</answer>", 0.0, 1.0),  # one newline cannot serve twice
    ("", 0.0, 0.0),
])
def test_format_think(text, strict, soft):
    assert format_reward(text, "think") == strict
    assert format_reward(text, "think-strict") == strict
    assert format_reward(text, "think_strict") == strict
    assert format_reward(text, "think-soft") == soft
    # Agrees with the common recipe's regex whenever each tag occurs once.
    if all(text.count(t) == 1 for t in ("<think>", "</think>", "<answer>", "</answer>")):
        pattern = r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>"
        assert (re.fullmatch(pattern, text.strip(), re.DOTALL) is not None) == (strict == 1.0)


def test_format_unknown_style():
    with pytest.raises(ValueError, match="format_style"):
        format_reward("Answer: 5", "yaml")


# ---------------------------------------------------------------------------------------------
# rule_reward: eq. 7 alone


@pytest.mark.parametrize("response, truth, expected", [
    ("2 + 40 = 42\nAnswer: 42", "42", 1.0),  # right
    ("Answer: 41", "42", -1.0),  # wrong
    ("I am not sure.", "42", -1.0),  # no answer: scored as wrong
    ("so the result is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),  # a boxed answer, equivalent
    ("\\boxed{3}", "4", -1.0),
])
def test_rule_reward_vectors(response, truth, expected):
    assert rule_reward(response, truth) == expected


def test_rule_reward_custom_values():
    assert rule_reward("Answer: 7", "7", correct=2.0, wrong=0.0) == 2.0  # GSM8K's XML recipe
    assert rule_reward("Answer: 8", "7", correct=2.0, wrong=0.0) == 0.0
    assert rule_reward("Answer: 8", "7", 0.5, -0.5) == -0.5


@pytest.mark.parametrize("correct, wrong", [(1.0, -1.0), (2.0, 0.0), (0.5, 0.5)])
def test_math_reward_correctness_is_rule_reward(correct, wrong):
    """math_reward's "correct" term is rule_reward's value and its "accuracy" is eq. 7's verdict,
    also when correct == wrong (the value then says nothing)."""
    for response, truth in [("Answer: 5", "5"), ("Answer: 6", "5"), ("no idea", "5"),
                            ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"), ("#### 1,000", "1000"),
                            (None, "5"), ("Answer: 5", 5)]:
        _, c = math_reward(response, truth, correct=correct, wrong=wrong)
        assert c["correct"] == rule_reward(response, truth, correct, wrong)
        assert c["accuracy"] == rule_reward(response, truth, 1.0, 0.0) == float(is_correct(response, truth))


# ---------------------------------------------------------------------------------------------
# math_reward

KEYS = {"correct", "accuracy", "extracted", "format", "format_ok", "integer", "xml_count", "overlong", "ppl"}


def test_math_reward_plain():
    r, c = math_reward("Answer: 5", "5")
    assert r == 1.0 and c == {"correct": 1.0, "accuracy": 1.0, "extracted": 1.0, "format": 0.0,
                              "format_ok": 0.0, "integer": 0.0, "xml_count": 0.0, "overlong": 0.0, "ppl": 0.0}
    assert math_reward("no idea", "5")[1]["extracted"] == 0.0  # (the warnings of a silent run read it)
    r, c = math_reward("Answer: 6", "5")
    assert r == -1.0 and c["correct"] == -1.0 and c["accuracy"] == 0.0  # DAPO eq. 7
    r, c = math_reward("Answer: 6", "5", correct=1.0, wrong=0.0)
    assert r == 0.0 and c["correct"] == 0.0


def test_math_reward_all_terms():
    r, c = math_reward("work\nAnswer: 5", "5", format_style="answer", format_weight=0.1,
                       length=18, max_len=20, cache_len=5, mean_nll=2.25, ppl_threshold=2.0, ppl_window=0.5)
    assert set(c) == KEYS
    assert c["correct"] == 1.0 and c["accuracy"] == 1.0
    assert c["format_ok"] == 1.0 and c["format"] == pytest.approx(0.1)
    assert c["overlong"] == pytest.approx(-0.6) and c["ppl"] == pytest.approx(-0.5)
    assert r == pytest.approx(1.0 + 0.1 - 0.6 - 0.5)
    assert r == pytest.approx(c["correct"] + c["format"] + c["overlong"] + c["ppl"])


def test_math_reward_terms_off_are_zero():
    # length / mean_nll alone switch nothing on: the config arguments do.
    r, c = math_reward("Answer: 5", "4", length=10_000, mean_nll=99.0)
    assert set(c) == KEYS and r == -1.0
    assert c["overlong"] == 0.0 and c["ppl"] == 0.0 and c["format"] == 0.0
    _, c = math_reward("<think>\nx\n</think>\n<answer>\n5\n</answer>", "5", format_style="think")
    assert c["format_ok"] == 1.0 and c["format"] == 0.0  # weight 0: logged, not added


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_len=20, cache_len=5), "length"),
    (dict(length=10, max_len=20), "cache_len"),
    (dict(length=10, cache_len=5), "max_len"),
    (dict(length=10, max_len=20, cache_len=30), "cache_len"),
    (dict(ppl_threshold=2.0, ppl_window=1.0), "mean_nll"),
    (dict(mean_nll=2.0, ppl_threshold=2.0), "ppl_window"),
    (dict(mean_nll=2.0, ppl_threshold=2.0, ppl_window=0.0), "window"),
    (dict(format_style="yaml"), "format_style"),
    (dict(format_weight=float("nan")), "format_weight"),
])
def test_math_reward_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        math_reward("Answer: 5", "5", **kwargs)


def test_math_reward_hostile_response():
    for response in [None, 12, b"Answer: 5", "{" * 5000, "\x00" * 100, "Answer: " + "9" * 10_000]:
        r, c = math_reward(response, "5", format_style="think-soft", format_weight=0.5)
        assert r == -1.0 and set(c) == KEYS


# ---------------------------------------------------------------------------------------------
# Safety: no code evaluation, standard library only


@pytest.mark.parametrize("module", [verify, rewards], ids=["verify", "rewards"])
def test_source_never_evaluates_text(module):
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"eval", "exec", "compile", "__import__"}
    imported = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            imported |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            imported.add(n.module)  # whole: of tasks/, rewards.py may take verify only
    assert imported <= {"__future__", "cmath", "math", "random", "re", "fractions", "decimal", "itertools",
                        "unicodedata", "sys", "tasks.verify"}


# ---------------------------------------------------------------------------------------------
# Real reference answers (../shared/data, when present: the project never depends on it)

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.skipif(not (DATA / "math500" / "test.jsonl").exists(), reason="no ../shared/data/math500")
def test_math500_reference_solutions_verify():
    import json
    rows = [json.loads(line) for line in (DATA / "math500" / "test.jsonl").open()]
    wrong = [r["answer"] for r in rows if not is_correct(r["solution"], r["answer"])]
    assert not wrong, wrong[:10]
    # Neighbouring answers that differ must not match.
    answers = [r["answer"] for r in rows]
    clashes = [(a, b) for a, b in zip(answers, answers[1:])
               if normalize_answer(a) != normalize_answer(b) and is_correct("Answer: " + a, b)]
    assert not clashes, clashes[:10]


@pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").exists(), reason="no ../shared/data/gsm8k")
def test_gsm8k_reference_solutions_verify():
    import json
    rows = [json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").open()]
    final = [r["answer"].split("####")[-1].strip() for r in rows]
    assert all(is_correct(r["answer"], f) for r, f in zip(rows, final))
    assert all(is_correct(f"So the total is ${f}.\nAnswer: {f}", r["answer"]) for r, f in zip(rows, final))


# ---------------------------------------------------------------------------------------------
# Fuzz: 10,000 random and hostile strings, no exception, no slow call

CALL_BUDGET_S = 0.020  # acceptance: no single call over 20 ms (the code takes a few ms at worst)
TRUTHS = ["5", "-3", "1000", "\\frac{1}{2}", "(1,2)", "\\sqrt{3}", "x^2+1", "Sunday", "#### 7", 12, 0.5,
          "(x+1)^2", "\\{1,2,3\\}", "[0,1)", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "2\\sqrt{3}",
          "\\frac{\\pi}{2}", "1\\pm\\sqrt{2}", "e^{i\\pi}", "x+y=1", "(-\\infty,1)\\cup(2,\\infty)"]
PIECES = ["Answer:", "answer: ", "\\boxed{", "\\fbox{", "}", "{", "\\{", "\\}", "\\\\", "####", "\n",
          "\\frac{", "\\dfrac", "\\sqrt", "\\text{", "\\left(", "\\right)", "^\\circ", "\\%", "$",
          "1,000", "0.5", "-", "/", "e", "10^{", "x =", " cm", "<think>\n", "</think>", "<answer>",
          "</answer>", "\u00b2", "\uff11", "\u0301", "\ufdfa", "\u03c0", "\u2212", "\x00", "\r"]


def _hostile(rng: random.Random, blob: str) -> str:
    kind = rng.randrange(20)
    n = rng.choice([10, 100, 1_000, 5_000, 20_000])
    if kind == 0:  # random printable + control characters
        codes = [rng.choice([rng.randrange(32), rng.randrange(32, 127), rng.randrange(0x10000)])
                 for _ in range(rng.randrange(300))]
        return "".join(map(chr, codes))
    if kind == 1:  # nested braces, thousands deep, balanced or not
        return "\\boxed" + "{" * n + rng.choice(["1", ""]) + "}" * rng.choice([n, n // 2, 0])
    if kind == 2:  # unbalanced braces
        braces = "".join(rng.choice("{}\\") for _ in range(rng.randrange(2_000)))
        return braces + "\\boxed{" * rng.randrange(50)
    if kind == 3:  # 100 kB strings
        return blob[rng.randrange(100):][:100_000] + rng.choice(["", "\nAnswer: 5", "\\boxed{5}"])
    if kind == 4:  # numbers with 1,000+ digits (10^1000 and beyond)
        zeros = "0" * rng.choice([1_000, 10_000, 100_000])
        return rng.choice(["Answer: 1", "\\boxed{1", "#### 1", "x 1"]) + zeros
    if kind == 5:
        return rng.choice(["Answer: 2**1000000", "\\boxed{2**1000000}", "2**1000000", "2^{1000000}"])
    if kind == 6:
        return rng.choice(["Answer: 1e999999999", "1e999999999", "Answer: 1e-999999999", "1.5e99999"])
    if kind == 7:  # huge fractions
        return rng.choice(["Answer: \\frac{10^{9999}}{3}", "\\boxed{\\frac{" + "9" * 5_000 + "}{3}}",
                           "Answer: " + "7" * 3_000 + "/" + "3" * 3_000])
    if kind == 8:  # repeated Answer lines
        return rng.choice(["Answer: 5\n", "Answer:\n", "Answer: Answer: ", "**Answer:** \\boxed{"]) * (n // 4)
    if kind == 9:  # combining marks, 18x-expanding ligatures, superscripts, full width
        full_width_answer = "\uff21\uff4e\uff53\uff57\uff45\uff52\uff1a"
        return rng.choice(["a\u0316\u0301" * n, "\ufdfa" * n, "\u00b2a" * n, full_width_answer * (n // 7)])
    if kind == 10:  # repeated markers that make naive regexes backtrack
        return rng.choice(["#", " ", "\\", "^ ", "1,", ",000", "x_{", "\\text{", "=", "."]) * n
    if kind == 11:  # deep \text{} and long unit tails inside an answer
        deep = rng.choice(["\\text{" * 300 + "a" + "}" * 300, "5" + " cm" * 300, "(" * 400 + "," * 400])
        return "Answer: " + deep
    if kind == 12:
        return "<think>\n" * (n // 8) + "\n</think>\n<answer>\n" * (n // 20) + "\n</answer>"
    if kind in (13, 14, 15):  # answers the equivalence parser reads: nested, huge, long, random
        return rng.choice(["Answer: $", "\\boxed{", ""]) + _hostile_math(rng) + rng.choice(["$", "}", ""])
    # random soup of the pieces the parsers look for
    return "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 400)))


MATH_ATOMS = ["x", "y", "a_1", "\\pi", "e", "i", "2", "1999", "0.5", "\\theta", "1e50", "0", "\\infty"]
MATH_FORMS = ["{}+{}", "{}-{}", "{}{}", "{}\\cdot {}", "\\frac{{{}}}{{{}}}", "({})^{{{}}}", "\\sqrt{{{}}}{}",
              "\\sqrt[{}]{{{}}}", "\\sin({})+{}", "\\ln({}){}", "({})!{}", "|{}|{}", "\\binom{{{}}}{{{}}}",
              "({}, {})", "\\{{{}, {}\\}}", "[{}, {})", "{}={}", "{}\\pm {}", "{} < {}"]


def _expression(rng: random.Random, depth: int) -> str:
    """A random answer in the equivalence parser's grammar (and slightly outside it)."""
    if depth <= 0 or rng.random() < 0.2:
        return rng.choice(MATH_ATOMS)
    return rng.choice(MATH_FORMS).format(_expression(rng, depth - 1), _expression(rng, depth - 1))


def _hostile_math(rng: random.Random) -> str:
    """Hostile answers for the parser and the evaluator: deep nesting, huge exponents, thousands of
    terms or members, big matrices, many signs, and random expressions."""
    n = rng.choice([5, 30, 60, 200, 1_000, 5_000])
    kind = rng.randrange(6)
    if kind == 0:  # deep nesting
        return rng.choice(["\\frac{1}{" * n + "x" + "}" * n, "(" * n + "1" + ")" * n, "\\sqrt{" * n + "2" + "}" * n,
                           "{" * n + "7" + "}" * n, "-" * n + "1", "x^{" * n + "2" + "}" * n, "|" * n,
                           "\\sin(" * n + "x" + ")" * n, "\\{" * n + "1" + "\\}" * n])
    if kind == 1:  # huge exponents and values
        return rng.choice(["2^{2^{100}}", "(x+1)^{10^{9}}", "10^{10^{10}}", "x^{99999999999}", "2^{-3000}",
                           "\\sqrt[10^{9}]{2}", "e^{e^{e^{e^{99}}}}", "300!", "99999!", "\\binom{10^{9}}{5}",
                           "(\\frac{1999}{1997}x)^{90}\\cdot(\\frac{1997}{1993}y)^{90}", "\\pi^{-700}",
                           "10^{30}\\pi-10^{30}\\pi+7", "(1+i)^{10^{6}}", "\\tan(\\frac{\\pi}{2})",
                           "+".join(["(1999x)^{90}"] * 30)])  # the slowest we found: big exact powers
    if kind == 2:  # thousands of terms, members, factors
        sep = rng.choice(["+", ",", "\\cdot ", "", "\\pm ", "\\cup "])
        return sep.join(rng.choice(["x", "\\sqrt{2}", "(x+1)", "[0,1]", "2", "\\frac{1}{3}"]) for _ in range(n))
    if kind == 3:  # matrices, wide and tall
        rows = "\\\\".join("&".join(_expression(rng, 1) for _ in range(rng.choice([1, 3, 20]))) for _ in range(n // 5 + 1))
        return "\\begin{pmatrix}" + rows + "\\end{pmatrix}"
    if kind == 4:  # sets of many random members, as written and shuffled
        members = [_expression(rng, 2) for _ in range(min(n, 80))]
        return "\\{" + ",".join(members) + "\\}"
    return _expression(rng, rng.randrange(1, 10))


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


@pytest.mark.slow
def test_fuzz_hostile_inputs():
    """10,000 seeded random and hostile strings through extract_answer, is_correct, math_reward,
    normalize_answer and answers_equal (two hostile answers the parser reads): nothing raises, results have the right types, and the slowest call is under
    20 ms. A call over 2 ms is timed three more times and its fastest time kept, so a busy machine
    (a context switch, a GC pause) cannot fail the test but a slow algorithm still does."""
    rng = random.Random(1234)
    blob = "".join(rng.choices("ab{}\\$ 0123456789.,\n^_#:Answerboxed", k=100_200))
    worst = (0.0, "", "")
    for i in range(10_000):
        text = _hostile(rng, blob)
        truth = rng.choice(TRUTHS) if i % 10 else _hostile(rng, blob)
        calls = [
            (extract_answer, (text,), {}),
            (is_correct, (text, truth), {}),
            (math_reward, (text, truth), dict(format_style=rng.choice(["answer", "think", "think-soft"]),
                                              format_weight=0.5, length=18, max_len=20, cache_len=5,
                                              mean_nll=2.2, ppl_threshold=2.0, ppl_window=0.5)),
            (normalize_answer, (text[:verify.MAX_ANSWER_CHARS],), {}),
            (answers_equal, (_hostile_math(rng), _hostile_math(rng)), {}),
        ]
        for fn, args, kwargs in calls:
            dt, out = _timed(fn, *args, **kwargs)
            if dt > CALL_BUDGET_S / 10:  # re-time slow calls: keep algorithmic cost, drop machine noise
                dt = min([dt] + [_timed(fn, *args, **kwargs)[0] for _ in range(3)])
            if dt > worst[0]:
                worst = (dt, fn.__name__, repr(args[0])[:60])
            if fn is extract_answer:
                assert out is None or isinstance(out, str)
            elif fn in (is_correct, answers_equal):
                assert type(out) is bool
            elif fn is math_reward:
                reward, comps = out
                assert math.isfinite(reward) and set(comps) == KEYS
    print(f"\nfuzz: slowest call {worst[0] * 1e3:.2f} ms ({worst[1]} on {worst[2]})")
    assert worst[0] < CALL_BUDGET_S, f"slowest call {worst[0] * 1e3:.2f} ms: {worst[1]} on {worst[2]}"


# ---------------------------------------------------------------------------------------------
# The XML recipe (GRPO on GSM8K with <reasoning>/<answer>)

XML_GOOD = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>\n"


def test_answer_tag_is_extracted():
    assert extract_answer(XML_GOOD) == "7"
    assert extract_answer("<answer>1</answer> then <answer> \\boxed{12} </answer> 99") == "12"
    assert extract_answer("<answer>5") == "5"               # unclosed: the last number rule
    assert extract_answer("Answer: 3\n<answer>4</answer>") == "3"  # "Answer:" keeps priority


def test_xml_recipe_terms():
    r, c = math_reward(XML_GOOD, "7", format_style="xml", format_weight=0.5, correct=2.0, wrong=0.0)
    assert c["format_ok"] == 1.0 and c["format"] == 0.5 and c["integer"] == 0.5
    assert c["xml_count"] == 0.5 and r == pytest.approx(2.0 + 0.5 + 0.5 + 0.5)
    # wrong, badly formatted, a non-integer answer and 20 characters of chatter after the answer
    sloppy = "<reasoning>x</reasoning><answer>7.5</answer>\n</answer>" + "z" * 20
    r, c = math_reward(sloppy, "7", format_style="xml", format_weight=0.5, correct=2.0, wrong=0.0)
    assert c["correct"] == 0.0 and c["format_ok"] == 0.0 and c["integer"] == 0.0
    assert c["xml_count"] == pytest.approx(0.125 - 0.020)  # only "\n</answer>" once, minus chatter
    assert format_reward(XML_GOOD, "xml") == 1.0 and format_reward(XML_GOOD, "think") == 0.0
    assert xml_terms(None) == {"integer": 0.0, "xml_count": 0.0}


# ---------------------------------------------------------------------------------------------
# Your own reward (--reward FILE.py:FUNCTION)

EXAMPLE = str(pathlib.Path(__file__).resolve().parents[1] / "recipes" / "tolerance_reward.py")


def _reward_file(tmp_path, body, name="mine.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_the_worked_example_reads_the_rows_own_fields():
    function = launch.load_reward_function(f"{EXAMPLE}:reward")
    row = {"prompt": "Boiling point of water in K?", "answer": "373.15", "tolerance": 0.5}
    assert function("About 373.4 K.", row) == (1.0, {"answered": 1.0})
    assert function("373.7", row) == (0.0, {"answered": 1.0})
    assert function("hot", row) == (0.0, {"answered": 0.0})
    assert function("373.15", {**row, "tolerance": 0}) == (1.0, {"answered": 1.0})


def test_the_calculator_reward_pays_for_the_steps_to_a_right_answer():
    """recipes/calculator_reward.py on an arithmetic record: the whole episode's text, calls and
    results included, as episodes.next_turn builds it."""
    function = launch.load_reward_function(
        str(pathlib.Path(EXAMPLE).with_name("calculator_reward.py")) + ":reward")
    row = data.arithmetic_record([123, 456], ["*"])
    called = "<calc>456 * 123</calc>\n<result>56088</result>\n"
    parts = lambda right, call, own: {"accuracy": right, "calc_call": call, "operand_call": own}
    assert function(called + "Answer: 56088", row) == (1.5, parts(1.0, 1.0, 1.0))
    assert function(called + "Answer: 56000", row) == (-0.5, parts(0.0, 1.0, 1.0))
    assert function("<calc>12 * 34</calc>\n<result>408</result>\nAnswer: 408", row) == \
        (-0.75, parts(0.0, 1.0, 0.0))  # the prompt's example, not the problem
    assert function("Answer: 56088", row) == (1.0, parts(1.0, 0.0, 0.0))
    assert function("<calc>123 * 456 + 0</calc><calc>as</calc>", row) == (-0.75, parts(0.0, 1.0, 0.0))
    assert function("<calc>123 times 456</calc>", row) == (-1.0, parts(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="arithmetic task's rows"):  # a row of another task
        function("Answer: 3", {"prompt": "What is 1 + 2?", "answer": "3"})


def test_loading_a_reward_function_says_what_is_wrong(tmp_path):
    assert launch.load_reward_function("os.path:join") is __import__("os").path.join  # MODULE:FUNCTION
    broken = _reward_file(tmp_path, "x = 1 / 0\n", "broken.py")
    empty = _reward_file(tmp_path, "def other(reply, row):\n    return 0.0\n", "empty.py")
    for spec, said in [("no_colon", "FILE.py:FUNCTION"), (f"{tmp_path}/missing.py:f", "no such file"),
                       (f"{broken}:reward", "ZeroDivisionError"), (f"{empty}:reward", "no function 'reward'"),
                       ("not_a_module_here:f", "ModuleNotFoundError")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            launch.load_reward_function(spec)


@pytest.mark.parametrize("body,said", [
    ("def reward(reply, row):\n    return row['missing']\n", "KeyError"),
    ("def reward(reply, row):\n    return float('nan')\n", "expected a finite number"),
    ("def reward(reply, row):\n    return 'high'\n", "expected a finite number or a bool"),
    ("def reward(reply, row):\n    return 1.0, {'n': None}\n", "expected {name: finite number}"),
    ("def reward(reply, row):\n    return 1.0, {'format': 1.0}\n", "share names"),
])
def test_a_broken_reward_function_is_one_line_at_load(tmp_path, body, said):
    spec = _reward_file(tmp_path, body) + ":reward"
    record = {"prompt": "p", "answer": "4", "row": 7, "fields": {"prompt": "p", "answer": 4}}
    with pytest.raises(ValueError) as caught:
        launch.checked_reward_function(spec, record, "data.jsonl")
    message = str(caught.value)
    assert said in message and "row 7 of data.jsonl" in message and "\n" not in message


def test_a_reward_function_takes_the_rule_rewards_place():
    """Its value replaces eq. 7's term; the shaping terms still add on top; its parts are kept;
    right: its "accuracy" part when it gives one, else value >= --correct-reward."""
    def graded(reply, row):
        return (0.5, {"steps": 2.0}) if "half" in reply else (row["full"], {"steps": 3.0})

    record = {"prompt": "p", "answer": "x", "fields": {"full": 2.0}}
    overlong = dict(length=18, max_len=20, cache_len=5)  # eq. 13: -0.6
    total, parts = rewards.task_reward("half", record, function=graded, correct=1.0, wrong=-1.0, **overlong)
    assert total == pytest.approx(0.5 - 0.6) and parts["correct"] == 0.5 and parts["accuracy"] == 0.0
    assert (parts["steps"], parts["error"], parts["overlong"]) == (2.0, 0.0, pytest.approx(-0.6))
    total, parts = rewards.task_reward("all", record, function=graded, correct=1.0, wrong=-1.0)
    assert total == 2.0 and parts["accuracy"] == 1.0
    assert rewards.user_score(lambda reply, row: (0.2, {"accuracy": 1.0}), "", {}) == (0.2, True, {})
    # a verdict: scored as the rule reward scores right and wrong
    assert rewards.user_score(lambda reply, row: (False, {"tried": 1.0}), "", {}, 2.0, 0.0) == (0.0, False, {"tried": 1.0})
    assert rewards.task_reward("x", record, function=lambda reply, row: True, correct=2.0, wrong=0.0)[0] == 2.0
    assert rewards.judged_right(graded, "all", record) and not rewards.judged_right(graded, "half", record)


def test_a_reward_function_that_fails_mid_run_scores_wrong_and_is_counted(capsys):
    calls = []

    def flaky(reply, row):
        calls.append(reply)
        if reply == "boom":
            raise RuntimeError("no parse")
        return float("nan") if reply == "nan" else 1.0

    record = {"prompt": "p", "answer": "x"}
    for reply in ("boom", "nan", "boom"):
        total, parts = rewards.task_reward(reply, record, function=flaky, correct=1.0, wrong=-1.0)
        assert (total, parts["error"], parts["accuracy"]) == (-1.0, 1.0, 0.0)
    assert rewards.task_reward("fine", record, function=flaky, correct=1.0, wrong=-1.0)[1]["error"] == 0.0
    said = capsys.readouterr().err
    assert said.count("failed on a reply") == 1 and "RuntimeError: no parse" in said  # the first, once
    assert not rewards.judged_right(flaky, "boom", record)


def test_a_reward_function_gets_its_own_row_and_cannot_move_the_run(tmp_path, monkeypatch):
    """Each call reads its own deep copy of the row (the replies of a prompt share one record: a
    function that wrote into it changed the next reply's score), and the working directory it
    moves to, at import or in a call, is put back (it moved the run's relative --out)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    spec = _reward_file(tmp_path, "import os\nos.chdir('elsewhere')\n\n"
                        "def reward(reply, row):\n    os.chdir('/')\n    row['tries'].append(reply)\n"
                        "    return float(len(row['tries']))\n")
    record = {"prompt": "p", "answer": "x", "fields": {"tries": []}}
    function, _ = launch.checked_reward_function(spec + ":reward", record, "rows.jsonl", 0)  # a call
    assert pathlib.Path.cwd() == tmp_path  # put back after the import and the check
    scores = [rewards.task_reward(reply, record, function=function)[1]["correct"] for reply in "abc"]
    assert scores == [1.0, 1.0, 1.0] and record["fields"] == {"tries": []}  # (a shared row: 1, 2, 3)
    assert pathlib.Path.cwd() == tmp_path and rewards.judged_right(function, "d", record)


@pytest.mark.parametrize("returned", [1e308, -1e308, 1e6 + 1, (1.0, {"steps": 2e6})])
def test_a_reward_beyond_the_bound_scores_as_an_error(returned):
    """A value or part beyond +-REWARD_BOUND (1e6) is an error, as NaN is: 1e308 passed as finite,
    and a group's sum overflowed to inf, its advantages to NaN, and every update was skipped."""
    record = {"prompt": "p", "answer": "x"}
    total, parts = rewards.task_reward("r", record, function=lambda reply, row: returned)
    assert (total, parts["error"], parts["accuracy"]) == (-1.0, 1.0, 0.0)
    total, parts = rewards.task_reward("r", record, function=lambda reply, row: (-1e6, {"steps": 1e6}))
    assert (total, parts["error"], parts["steps"]) == (-1e6, 0.0, 1e6)  # the bound itself is in


def test_a_reward_call_past_its_time_limit_scores_wrong_said_once(capsys):
    """--reward-timeout: SIGALRM ends a call that sleeps, or loops catching every Exception (a
    judge's retry loop), as RewardTimeout: the reply scores as wrong, the first on stderr. The
    alarm's handler and timer are the ones from before afterwards."""
    def sleeps(reply, row):
        time.sleep(100)

    def retries(reply, row):
        while True:
            try:
                time.sleep(100)
            except Exception:
                pass

    record, limited = {"prompt": "p", "answer": "x"}, [launch.UserReward(f, 0.2) for f in (sleeps, retries)]
    for function in (limited[0], limited[0], limited[1]):
        started = time.monotonic()
        total, parts = rewards.task_reward("r", record, function=function, correct=1.0, wrong=-1.0)
        assert (total, parts["error"]) == (-1.0, 1.0) and time.monotonic() - started < 5
    said = capsys.readouterr().err
    assert said.count("RewardTimeout: no result within --reward-timeout 0.2 s") == 2  # once a function
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    quick = launch.UserReward(lambda reply, row: 0.5, 0.2)
    assert rewards.task_reward("r", record, function=quick)[1]["correct"] == 0.5


def test_off_the_main_thread_a_reward_call_has_no_time_limit_and_says_so(capsys):
    import threading
    limited, out = launch.UserReward(lambda reply, row: 0.5, 0.2), []
    worker = threading.Thread(target=lambda: out.append(rewards.user_score(limited, "r", {})[0]))
    worker.start()
    worker.join()
    assert out == [0.5] and "off the main thread" in capsys.readouterr().err


def test_a_stop_signal_ends_a_hung_reward_call_and_the_later_ones_not_a_healthy_one(capsys, monkeypatch):
    """Ctrl-C during a reward call (no time limit) used to leave a hung call running, and the step,
    and the checkpoint launch.StopRequest promised, never came: a call under way now has
    STOP_GRACE seconds left; one that finishes in them scores as it would have (a healthy judge's
    step is untouched), one that hangs past them ends as an error, and the later calls are not made."""
    monkeypatch.setattr(launch.UserReward, "STOP_GRACE", 0.3)
    calls = []

    def judge(reply, row):  # "a" answers 0.1 s after the signal; "b" hangs
        calls.append(reply)
        if reply in "ab":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, reaching the handler inside this call
        time.sleep(100 if reply == "b" else 0.1)
        return 1.0

    for reply, expected in (("a", 0.0), ("b", 1.0), ("c", 1.0)):
        limited, record = launch.UserReward(judge, 0), {"prompt": "p", "answer": "x"}
        with launch.StopRequest(on_stop=limited.stop) as stop:
            scored = [rewards.task_reward(r, record, function=limited)[1]["error"] for r in reply + "d"]
        assert stop.signum == (signal.SIGINT if reply in "ab" else None)
        if reply == "c":  # (no signal: the plain path)
            assert scored == [0.0, 0.0]
        else:  # the next call ("d") is made after a call that finished, not after one that hung
            assert scored == [expected, expected], reply
    assert calls == ["a", "d", "b", "c", "d"]
    said = capsys.readouterr().err
    assert said.count("RewardStopped") == 1 and "no result within 0.3 s of a stop signal" in said
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    # A stop asked between calls leaves a healthy reward alone; one that then hangs past the grace
    # (or its own time limit, if sooner) ends the rest.
    calls = []
    later = launch.UserReward(lambda reply, row: calls.append(reply) or time.sleep(100 * (reply == "b")) or 1.0, 0.2)
    later.stop()
    scored = [rewards.task_reward(reply, record, function=later)[1]["error"] for reply in "abc"]
    assert scored == [0.0, 1.0, 1.0] and calls == ["a", "b"]
