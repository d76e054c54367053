"""Rewards for math RL: the rule reward, format terms, length and perplexity shaping.

    python -m pytest tests/test_rewards.py -q

A completion scores as in DAPO (arXiv 2503.14476): +1 if its final answer is equivalent to the
ground truth (verify.py decides), -1 otherwise (eq. 7, `rule_reward`), plus the soft overlong
punishment (eq. 13, `overlong_penalty`) when it ran long. `math_reward` adds this codebase's
optional terms and returns `(reward, components)`.
"""

from __future__ import annotations

import math
import re
import sys

from tasks.verify import (
    ANSWER_LINE_RE,
    MAX_SCAN_CHARS,
    answer_tag,
    answers_equal,
    clean_text,
    extract_answer,
    is_correct,
)

__all__ = ["rule_reward", "overlong_penalty", "perplexity_penalty", "shaping", "format_reward",
           "xml_terms", "math_reward", "FORMAT_STYLES", "user_score", "task_reward", "judged_right",
           "RewardInterrupt", "RewardTimeout", "RewardStopped", "REWARD_BOUND", "TIME_LIMIT"]

# ---------------------------------------------------------------------------------------------
# The rule reward (eq. 7)


def rule_reward(response: str, truth, correct: float = 1.0, wrong: float = -1.0) -> float:
    """DAPO's rule-based reward (eq. 7), with y_hat the answer extracted from `response`:

        R(y_hat, y) = 1   if is_equivalent(y_hat, y)
                    = -1  otherwise (a wrong answer, or none found)

    verify.is_correct extracts and compares; it never raises. `correct` and `wrong` replace 1
    and -1 (GSM8K's XML recipe pays 2 and 0).
    """
    return correct if is_correct(response, truth) else wrong


# ---------------------------------------------------------------------------------------------
# Shaping terms


def _finite(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment (eq. 13), with L = length, L_max = max_len, L_cache = cache_len:

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if L_max < |y|
    """
    L, L_max = _finite("length", length), _finite("max_len", max_len)
    L_cache = _finite("cache_len", cache_len)
    if L < 0:
        raise ValueError(f"length must be >= 0, got {length!r}")
    if L_max <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len!r}")
    if not 0 < L_cache <= L_max:
        raise ValueError(f"cache_len must be in (0, max_len={max_len!r}], got {cache_len!r}")
    if L <= L_max - L_cache:
        return 0.0
    if L <= L_max:
        return ((L_max - L_cache) - L) / L_cache
    return -1.0


def perplexity_penalty(mean_nll: float, threshold: float, window: float) -> float:
    """Soft perplexity penalty: this project's variant, not in the DAPO paper.

    Eq. 13's shape with log-perplexity in place of length. `mean_nll` is the completion's mean
    per-token negative log-likelihood under the policy (log of its perplexity); `threshold` and
    `window` are in the same units (threshold = log(perplexity threshold)):

        R_ppl(y) = 0                              if nll <= threshold
                 = (threshold - nll) / window     if threshold < nll <= threshold + window
                 = -1                             if threshold + window < nll

    A NaN `mean_nll` scores -1 (treated as beyond the window) so a bad value never turns into a
    NaN reward mid-run.
    """
    t, w = _finite("threshold", threshold), _finite("window", window)
    if w <= 0:
        raise ValueError(f"window must be > 0, got {window!r}")
    try:
        nll = float(mean_nll)
    except (TypeError, ValueError):
        raise ValueError(f"mean_nll must be a number, got {mean_nll!r}") from None
    if math.isnan(nll):
        return -1.0
    if nll <= t:
        return 0.0
    if nll <= t + w:
        return (t - nll) / w
    return -1.0


# ---------------------------------------------------------------------------------------------
# Format terms (as in common GRPO recipes)

FORMAT_STYLES = ("answer", "think", "think-strict", "think-soft", "xml")


def _format_style(style) -> str:
    s = str(style).replace("_", "-").lower()
    if s not in FORMAT_STYLES:
        raise ValueError(f"format_style must be one of {FORMAT_STYLES}, got {style!r}")
    return "think-strict" if s == "think" else s


def _two_tag_strict(s: str, first: str) -> bool:
    # The recipes' regex ^<first>\n.*?\n</first>\n<answer>\n.*?\n</answer>$ with each tag once,
    # checked with str.find / count (linear; the lazy regex backtracks quadratically).
    opening, separator = f"<{first}>\n", f"\n</{first}>\n<answer>\n"
    s = s.strip()
    if not (s.startswith(opening) and s.endswith("\n</answer>")):
        return False
    if any(s.count(tag) != 1 for tag in (f"<{first}>", f"</{first}>", "<answer>", "</answer>")):
        return False
    i = s.find(separator)
    return i >= len(opening) and i + len(separator) <= len(s) - len("\n</answer>")


def _think_soft(s: str) -> bool:
    i = s.find("<think>")
    j = s.find("</think>", i + 7) if i >= 0 else -1
    k = s.find("<answer>", j + 8) if j >= 0 else -1
    return k >= 0 and s.find("</answer>", k + 8) >= 0


def format_reward(response: str, style: str = "answer") -> float:
    """1.0 if `response` has the format, else 0.0. Never raises on the response.

    "answer": the last non-empty line is "Answer: ..." (DAPO's prompt asks for it; "**Answer:**"
      and "Final answer:" count). "think" / "think-strict": exactly
      "<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>", each tag once, surrounding blank space
      ignored. "think-soft": <think>, </think>, <answer>, </answer> present in that order. "xml":
      the same strict form with <reasoning> in place of <think> (data.py's "xml" template asks
      for it). An unknown style is a ValueError (a caller's bug, not hostile text).
    """
    style = _format_style(style)
    try:
        if not isinstance(response, str):
            return 0.0
        if style == "answer":
            tail = clean_text(response[-MAX_SCAN_CHARS:]).rstrip()
            line = tail[tail.rfind("\n") + 1:]
            m = ANSWER_LINE_RE.match(line)  # "Answer:" opening the last line
            ok = m is not None and line[m.end():].strip(" \t*") != ""
        elif style in ("think-strict", "xml"):
            ok = _two_tag_strict(response, "think" if style == "think-strict" else "reasoning")
        else:
            ok = _think_soft(response)
        return 1.0 if ok else 0.0
    except Exception:
        return 0.0


def xml_terms(response: str) -> dict[str, float]:
    """The two extra terms of the XML recipe for GSM8K (GRPO on "<reasoning>/<answer>"):

      integer:    1.0 when the last <answer>...</answer> holds an integer (GSM8K's answers are),
      xml_count:  0.125 for each of "<reasoning>\\n", "\\n</reasoning>\\n", "\\n<answer>\\n" and
                  "\\n</answer>" present exactly once, minus 0.001 per character written after the
                  closing answer tag (a model that keeps talking after its answer loses a little).

    Never raises on the response; the bounds of both are [0, 1] and [-inf, 0.5].
    """
    try:
        if not isinstance(response, str):
            return {"integer": 0.0, "xml_count": 0.0}
        answer = answer_tag(response[-MAX_SCAN_CHARS:]) or ""
        count = 0.125 * sum(response.count(tag) == 1 for tag in
                            ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>"))
        close = response.rfind("\n</answer>")
        if close >= 0:
            count -= 0.001 * len(response[close + len("\n</answer>"):].rstrip("\n"))
        return {"integer": 1.0 if re.fullmatch(r"-?[0-9]+", answer) else 0.0, "xml_count": count}
    except Exception:
        return {"integer": 0.0, "xml_count": 0.0}


# ---------------------------------------------------------------------------------------------
# The reward


def _term_on(term, **arguments):
    """A shaping term is on when any argument but the first is given; then all are needed."""
    on = any(value is not None for value in list(arguments.values())[1:])
    missing = [name for name, value in arguments.items() if value is None]
    if on and missing:
        raise ValueError(f"{term} needs {', '.join(missing)}")
    return on


def shaping(*, length=None, max_len=None, cache_len=None, mean_nll=None, ppl_threshold=None,
            ppl_window=None) -> dict[str, float]:
    """The terms a completion earns by its own length and perplexity, {"overlong", "ppl"} (0.0
    where off), as math_reward adds them: each earlier turn of an episode earns them too. The
    overlong term is on when max_len or cache_len is given, the perplexity term when
    ppl_threshold or ppl_window is; then all of that term's arguments are needed."""
    use_overlong = _term_on("the overlong penalty", length=length, max_len=max_len,
                            cache_len=cache_len)
    use_ppl = _term_on("the perplexity penalty", mean_nll=mean_nll, ppl_threshold=ppl_threshold,
                       ppl_window=ppl_window)
    return {"overlong": overlong_penalty(length, max_len, cache_len) if use_overlong else 0.0,
            "ppl": perplexity_penalty(mean_nll, ppl_threshold, ppl_window) if use_ppl else 0.0}


def math_reward(response: str, truth, *, correct: float = 1.0, wrong: float = -1.0,
                format_style: str | None = None, format_weight: float = 0.0,
                length: int | None = None, max_len: int | None = None, cache_len: int | None = None,
                mean_nll: float | None = None, ppl_threshold: float | None = None,
                ppl_window: float | None = None, score: tuple[float, bool] | None = None,
                ) -> tuple[float, dict[str, float]]:
    """Reward of one completion and its components, (correct + format + integer + xml_count +
    overlong + ppl, {component: value}); a term that is off is 0.0. "correct": `correct` or
    `wrong` (DAPO eq. 7), "accuracy" 1.0 / 0.0, "extracted" 1.0 if verify.extract_answer read an
    answer, "format" (format_weight * "format_ok"), with format_style "xml" also "integer"
    (format_weight * an integer answer) and "xml_count" (`xml_terms`; GSM8K's XML recipe: "xml",
    format_weight 0.5, correct 2.0, wrong 0.0), "overlong" and "ppl" (`shaping`: eq. 13 and the
    perplexity term). `score`: (value, right) from a reward function (`task_reward`) in eq. 7's
    place; `truth` is then not read. Bad arguments raise ValueError; the text never does."""
    style = _format_style(format_style) if format_style is not None else None
    r_correct, r_wrong = _finite("correct", correct), _finite("wrong", wrong)
    w_format = _finite("format_weight", format_weight)
    shaped = shaping(length=length, max_len=max_len, cache_len=cache_len, mean_nll=mean_nll,
                     ppl_threshold=ppl_threshold, ppl_window=ppl_window)

    answer = extract_answer(response)  # (never raises)
    ok = answers_equal(answer, truth) if score is None else score[1]  # rule_reward's check
    # DAPO eq. 7: R(y_hat, y) = 1 if is_equivalent(y_hat, y) else -1 (the answer extracted once)
    rule = (r_correct if ok else r_wrong) if score is None else _finite("score", score[0])
    c = {"correct": rule, "accuracy": 1.0 if ok else 0.0, "extracted": float(answer is not None),
         "format": 0.0, "format_ok": 0.0, "integer": 0.0, "xml_count": 0.0, "overlong": 0.0,
         "ppl": 0.0}
    if style is not None:
        c["format_ok"] = format_reward(response, style)
        c["format"] = w_format * c["format_ok"]
    if style == "xml":
        terms = xml_terms(response)
        c["integer"], c["xml_count"] = w_format * terms["integer"], terms["xml_count"]
    c.update(shaped)
    total = c["correct"] + c["format"] + c["integer"] + c["xml_count"] + c["overlong"] + c["ppl"]
    return total, c


# ---------------------------------------------------------------------------------------------
# Your own reward: --reward FILE.py:FUNCTION (launch.load_reward_function loads it)

# The parts this file's terms log; a reward function's own parts take other names.
RULE_PARTS = ("correct", "accuracy", "extracted", "format", "format_ok", "integer", "xml_count",
              "overlong", "ppl", "efficiency", "error")
# The largest reward (or part) a function may return, in absolute value: a million times eq. 7's
# scale, and far below where a step's rewards (float32 tensors, at most 3.4e38) and a group's sums
# and squares overflow into the inf and NaN that would skip every update.
REWARD_BOUND = 1e6
TIME_LIMIT = 60.0  # seconds a call, --reward-timeout's default: a slow judge's answer, not a hang


class RewardInterrupt(BaseException):
    """A reward call ended from outside (launch.UserReward): a BaseException, as KeyboardInterrupt
    is, so that the function's own `except Exception` (a retry loop around a judge) cannot keep it."""


class RewardTimeout(RewardInterrupt):
    """A reward call that ran past its time limit (--reward-timeout)."""


class RewardStopped(RewardInterrupt):
    """A reward call that a stop signal (Ctrl-C, SIGTERM) ended, or one not made after that."""


def _in_bound(value) -> bool:
    """A number (bools count) within +-REWARD_BOUND; NaN, the infinities and huge ints are not."""
    if not isinstance(value, (int, float)):
        return False
    try:
        return abs(float(value)) <= REWARD_BOUND  # (NaN compares False)
    except OverflowError:  # an int beyond any float
        return False


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def user_score(function, response: str, row: dict, correct: float = 1.0, wrong: float = -1.0):
    """`function(response, row)` checked: a float, or True / False (right or wrong: `correct` or
    `wrong`, as the rule reward scores), alone or with {name: float} parts logged as
    reward_<name>. -> (value, right, parts): right is the verdict, else a part named "accuracy"
    > 0, else value >= `correct`. ValueError for a return that is not that, or not a finite
    number within +-REWARD_BOUND; the function's own exceptions pass through."""
    out = function(response, row)
    value, parts = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if isinstance(value, bool):
        value, verdict = (correct if value else wrong), value
    elif _in_bound(value):
        verdict = None
    else:
        raise ValueError(f"returned {_shown(out)}: expected a finite number or a bool, alone or "
                         f"with {{name: number}}, each number within +-{REWARD_BOUND:,.0f}")
    if not isinstance(parts, dict) or not all(isinstance(k, str) and _in_bound(v) for k, v in parts.items()):
        raise ValueError(f"returned parts {_shown(parts)}: expected {{name: finite number}}, each "
                         f"within +-{REWARD_BOUND:,.0f}")
    right = verdict if verdict is not None else parts["accuracy"] > 0 if "accuracy" in parts \
        else value >= correct
    return float(value), right, {k: float(v) for k, v in parts.items() if k != "accuracy"}


def task_reward(response: str, record: dict, *, function=None, **options):
    """-> (reward, parts) of a reply: the rule reward on record["answer"] (`math_reward`), or, with
    a reward function (--reward, or a task's own), its score in eq. 7's place, the format and
    shaping terms on top; the function reads the data row with all its fields. One that raises
    (RewardInterrupt included) or returns a value out of bounds scores the reply as wrong
    (`wrong`) with parts["error"] = 1: counted in the log, never a crash."""
    if function is None:
        return math_reward(response, record["answer"], **options)
    try:
        value, right, named = user_score(function, response, record.get("fields", record),
                                         options.get("correct", 1.0), options.get("wrong", -1.0))
        named["error"] = 0.0
    except (Exception, RewardInterrupt) as error:  # the user's code: any exception, one line
        _report_once(function, error, "score as wrong, counted in metrics.jsonl's reward_error")
        value, right, named = options.get("wrong", -1.0), False, {"error": 1.0}
    total, parts = math_reward(response, None, score=(value, right), **options)
    return total, {**parts, **named}


def judged_right(function, response: str, record: dict, correct: float = 1.0) -> bool:
    """Held-out accuracy under a reward function: whether it counts the reply as right (one that
    raises or returns nonsense: not right, said once on stderr)."""
    try:
        return user_score(function, response, record.get("fields", record), correct)[1]
    except (Exception, RewardInterrupt) as error:
        _report_once(function, error, "are judged not right")
        return False


_REPORTED = set()  # (function, kind of failure) already said


def _report_once(function, error, scored):
    """A reward function's first failure of each kind in this process (its time limit, a stop
    signal, anything else), on stderr; later ones are counted in reward_error only."""
    key = (function, type(error) if isinstance(error, RewardInterrupt) else Exception)
    if key not in _REPORTED:
        _REPORTED.add(key)
        print(f"--reward {getattr(function, '__name__', function)} failed on a reply "
              f"({type(error).__name__}: {error}); such replies {scored}", file=sys.stderr, flush=True)
