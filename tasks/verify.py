"""Answer checking for math rewards: is a response's final answer equivalent to the ground truth?

    python -m pytest tests/test_rewards.py -q   # every verdict of the judged table, hostile input
    python tests/bench_answers.py               # the same table against math-verify

Reads top to bottom (the README's "Answer checking" explains the choices):
  extraction     `extract_answer`: the answer the response commits to last ("Answer: X" anywhere,
                 or a \\boxed{} after it; then <answer>, \\boxed{}, "#### X", the last number);
  normalisation  `normalize_answer`: one canonical string (LaTeX spacing, \\text, units, "x =");
  equivalence    `answers_equal` / `is_correct`: equal strings, equal exact numbers, or our own
                 parser's trees (+ - * / ^, \\frac, \\sqrt, \\pi, e, i, variables, tuples, sets,
                 intervals, matrices) whose values agree at random points.

Safety, because the policy is optimised against this code: nothing evaluates text as code (no
eval, exec or sympy: our own arithmetic computes a tree of tuples), the public functions never
raise, and every step is bounded (text tail, answer length, tree size and depth, exponent and bit
sizes, node evaluations).
"""

from __future__ import annotations

import cmath
import math
import random
import re
from fractions import Fraction
from itertools import accumulate, repeat

__all__ = [
    "extract_answer", "normalize_answer", "answers_equal", "is_correct", "arithmetic_value",
]

MAX_SCAN_CHARS = 8192  # tail of a completion read for extraction (a few thousand tokens)
MAX_ANSWER_CHARS = 1000  # longer answers are compared exactly, never normalised
MAX_BOX_CANDIDATES = 16  # boxes looked at, from the last
MAX_DIGITS = 100  # numbers with more digits are compared as strings
MAX_EXPONENT = 100  # |e| bound for 1e5 and 3\times10^{5}
MAX_PARSE_CHARS = 400  # longer normalised answers are compared as strings
MAX_NODES = 200  # tree nodes per answer
MAX_DEPTH = 60  # parser nesting (about three per bracket or \frac level)
MAX_WORK = 3000  # node evaluations and matched pairs per comparison, all points and items
MAX_BITS = 2048  # an exact value with a longer numerator or denominator continues as a float
POINTS = 6  # random points at which answers with variables are compared
REL_TOL = 1e-12  # floats agree within their carried error bounds plus this (see _close)
ABS_TOL = 1e-12  # ... and count only if those bounds are this small near zero


# ---------------------------------------------------------------------------------------------
# Unicode clean-up (shared by extraction and normalisation)

_SYMBOLS = {
    "\u2212": "-", "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt ",
    "\u00d7": "\\times ",
    "\u22c5": "\\cdot ", "\u00b7": "\\cdot ", "\u00f7": "/", "\u2044": "/", "\u2264": "\\le ",
    "\u2265": "\\ge ", "\u2260": "\\ne ", "\u00b0": "^\\circ ", "\u00bd": "1/2", "\u2153": "1/3",
    "\u2154": "2/3", "\u00bc": "1/4", "\u00be": "3/4", "\r": "\n",
}
_UNICODE_MAP = {ord(k): v for k, v in _SYMBOLS.items()}
# C0/C1 controls except \t \n, zero-width and bidi marks, BOM: dropped.
for _c in [*range(0x00, 0x09), *range(0x0B, 0x0D), *range(0x0E, 0x20), *range(0x7F, 0xA0),
           *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x2065), 0xFEFF]:
    _UNICODE_MAP[_c] = None
for _c in [0x00A0, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000]:  # Unicode spaces
    _UNICODE_MAP[_c] = " "
for _c in range(0xFF01, 0xFF5F):  # full-width ASCII, as Chinese-trained models write it
    _UNICODE_MAP[_c] = chr(_c - 0xFEE0)
for _d, _c in enumerate("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"):
    _UNICODE_MAP[ord(_c)] = "^{%d}" % _d  # NFKC would turn x\u00b2 into x2
del _c, _d
_ASCII_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_MAPPED = re.compile("[" + re.escape("".join(map(chr, _UNICODE_MAP))) + "]")


def clean_text(s: str) -> str:
    """Unicode clean-up: a chosen subset of NFKC, never NFKC itself.

    NFKC lengthens some characters 18-fold and sorts runs of combining marks in quadratic time
    (measured: ~100 ms for 8,000 marks), so only the mappings that matter for answers are applied,
    in one linear `str.translate`: controls dropped, CR -> LF, Unicode spaces -> ' ', full-width
    ASCII (\uff11\uff12, \uff1a) -> ASCII, superscript digits -> ^{d} (x\u00b2 -> x^{2}), minus, pi,
    infinity, sqrt, times, <=, >=, degree and 1/2-style glyphs -> ASCII / LaTeX.
    """
    s = s.replace("\r\n", "\n")
    if s.isascii():  # the common case: a C-speed pass only
        return _ASCII_CONTROL.sub("", s).replace("\r", "\n")
    if not _MAPPED.search(s):  # other scripts, nothing to map: skip the slower translate
        return s
    return s.translate(_UNICODE_MAP)


# ---------------------------------------------------------------------------------------------
# Extraction

"""Extraction: the answer a response commits to last, as written. Only the last MAX_SCAN_CHARS
characters are read (the answer sits at the end, and a fixed-size tail makes a 100 kB string cost
what a 10 kB one does); boxes are matched by a running brace depth over a bounded window."""

# "Answer:" anywhere, as DAPO's own checker reads it (`Answer\s*:\s*([^\n]+)`, the last match):
# "**Answer:** 42", "Final Answer: 42" and a self-correction mid-sentence all count. Lower-case
# "answer:" counts where it opens a line only: mid-sentence it is prose ("we may check our
# answer: 17 * 44 = 748", as three MATH-500 solutions write after their box).
_ANSWER_RE = re.compile(
    r"(?:^[ \t*_#>]*(?i:(?:final[ \t]+)?answer)|(?<![A-Za-z])(?:Answer|ANSWER))[ \t*_]*:",
    re.MULTILINE,
)
# Any case, opening a line: the format term's "the last line is Answer: ..." (format_reward).
ANSWER_LINE_RE = re.compile(
    r"^[ \t*_#>]*(?:final[ \t]+)?answer[ \t*_]*:", re.IGNORECASE | re.MULTILINE
)
_NON_SPACE = re.compile(r"\S")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*")
_BARE_BOX_ARG = re.compile(r"[^\s${}]+")
_BRACE_ESCAPE = re.compile(r"\\[\\{}]")  # \{ \} \\ (two characters each)
_BRACE_DEPTH = {"{": 1, "}": -1}
_GSM8K_RE = re.compile(r"####[ \t]*([^\s#][^\n]*)")
# A number read right to left (see _last_number): "/b" of a/b, decimals, the integer part (1,000-style
# allowed), then a minus sign, but not the hyphen in "3-5".
_DIGIT = re.compile(r"[0-9]")
_INT_REVERSED = r"(?:[0-9]{3},)+[0-9]{1,3}(?![0-9])|[0-9]+"
_NUMBER_REVERSED = re.compile(
    rf"(?:[0-9]+/)?(?:[0-9]+\.(?:{_INT_REVERSED})?|(?:{_INT_REVERSED}))(?:-(?![0-9A-Za-z]))?"
)


def _box_content(masked: str, s: str, j: int) -> str | None:
    """Text inside the group opened by the '{' at s[j], or None if it does not close within
    MAX_ANSWER_CHARS. Depth is a running sum computed in C (accumulate), and the group closes where
    the depth first returns to 0: no Python loop over characters."""
    window = masked[j:j + MAX_ANSWER_CHARS + 2]
    depth = list(accumulate(map(_BRACE_DEPTH.get, window, repeat(0))))
    try:
        close = depth.index(0)
    except ValueError:
        return None
    return s[j + 1:j + close]


def _last_box(s: str) -> str | None:
    """Content of the last balanced, non-empty \\boxed{...} / \\fbox{...} in s (of the last
    MAX_BOX_CANDIDATES boxes, so a text of thousands of broken boxes costs no more than a few)."""
    ends = [m.end() for m in _BOX_RE.finditer(s)][-MAX_BOX_CANDIDATES:]
    masked = None
    for j in reversed(ends):
        if j < len(s) and s[j] == "{":
            if masked is None:  # \{ \} \\ blanked, same length: they do not group
                masked = _BRACE_ESCAPE.sub("  ", s)
            content = (_box_content(masked, s, j) or "").strip()
        else:
            m = _BARE_BOX_ARG.match(s, j)  # "\boxed 5"
            content = m.group() if m else ""
        if content:
            return content
    return None


def _answer_line(s: str) -> str | None:
    """The rest of the line after the last "Answer:" with something on it (DAPO's \\s* after the
    colon may cross a newline), a box on it unwrapped; but a box written after that line is the
    later commitment and wins."""
    starts = [m.end() for m in _ANSWER_RE.finditer(s)]
    for j in reversed(starts):
        first = _NON_SPACE.search(s, j)
        if first is None:
            continue
        end = s.find("\n", first.start())
        end = len(s) if end < 0 else end
        line = s[first.start():end].strip().strip("*").strip()  # **Answer:** 42
        if line:
            return _last_box(s[end:]) or _last_box(line) or line
    return None


def answer_tag(s: str) -> str | None:
    """Content of the last closed <answer>...</answer> (the XML format of common GRPO recipes)."""
    end = s.rfind("</answer>")
    start = s.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    content = s[start + len("<answer>"):end].strip()
    return (_last_box(content) or content) if content else None


def _gsm8k_line(s: str) -> str | None:
    found = _GSM8K_RE.findall(s)
    return found[-1].strip() if found else None


def _last_number(s: str) -> str | None:
    # Read the reversed text: its first digit starts the last number, found without scanning the
    # rest (a plain [0-9] search is the regex engine's fast path; the full pattern is not).
    rev = s[::-1]
    digit = _DIGIT.search(rev)
    return _NUMBER_REVERSED.match(rev, digit.start()).group()[::-1] if digit else None


def extract_answer(text: str) -> str | None:
    """The final answer written in `text`, or None. Never raises.

    First rule that yields an answer: "Answer: X" (the last, anywhere; a \\boxed{} after its line
    wins) > <answer>X</answer> (the last) > \\boxed{X} / \\fbox{X} (the last balanced one, or
    "\\boxed 5") > "#### X" (the last) > the last number (1,000-style, decimals, a/b).
    The answer is returned as written (after Unicode clean-up), not normalised.
    """
    try:
        if not isinstance(text, str):
            return None
        tail = clean_text(text[-MAX_SCAN_CHARS:])[-MAX_SCAN_CHARS:]  # clean-up may lengthen it
        for rule in (_answer_line, answer_tag, _last_box, _gsm8k_line, _last_number):
            ans = rule(tail)
            if ans:
                return ans
        return None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Normalisation

"""Normalisation: one canonical string per answer, the same rules on both sides. Delimiters,
\\left/\\right, LaTeX spacing and \\displaystyle go; \\dfrac/\\tfrac become \\frac; \\text{..},
\\mathrm{..}, \\mbox{..} ... are unwrapped; degrees, percent signs, a trailing period, units and
nouns after a number, an "x =" or "the answer is" prefix go; "or"/"and" between solutions become
commas; whitespace goes (but for one space after a command before a letter: \\pi r); \\frac12 ->
\\frac{1}{2}, \\sqrt3 -> \\sqrt{3}, x^{2} -> x^2, \\leq -> \\le, (C) -> C; words are lower-cased."""

_MATH_DELIMS = re.compile(r"\\[()\[\]]")  # \( \) \[ \]
_LEFT_RIGHT = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
_VERT = re.compile(r"\\[lr]?vert(?![A-Za-z])")  # \lvert x \rvert -> |x|
_FRAC_STYLE = re.compile(r"\\[dt]frac(?![A-Za-z])")
_BINOM_STYLE = re.compile(r"\\[dt]binom(?![A-Za-z])")
# LaTeX spacing; the row break \\ (first alternative) is kept, so "\\ 2" is not read as "\ " + 2.
_SPACING = re.compile(
    r"(\\\\)|\\(?:[!,;: ]|(?:quad|qquad|displaystyle|textstyle|scriptstyle)(?![A-Za-z]))"
)
_TEXT_WRAP = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|texttt|textsf|mathrm|mathbf|mathit|mathsf|mathtt"
    r"|mathbb|mbox|hbox|boldsymbol|operatorname)[ \t]*\{([^{}]*)\}"
)
_DEGREE = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\degree(?![A-Za-z])")  # not f \circ g
_PERCENT = re.compile(r"\\?%")
_LEAD_PHRASE = re.compile(r"(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is[ \t:]*", re.IGNORECASE)
_VAR_PREFIX = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*=")
_WHITESPACE = re.compile(r"\s+")
_CONNECTIVE = re.compile(r" ?,? (?:or|and) ", re.IGNORECASE)  # on single-spaced text: linear
_SPACE_AFTER = re.compile(r"(\\[A-Za-z]+)?\s+")  # a command, then the spaces that end it
_LOG_BASE = re.compile(r"\\log_([0-9A-Za-z]) ")  # \log_2 8: the space ends the base
_FRAC_SHORT1 = re.compile(r"\\frac([0-9A-Za-z])")  # \frac12 -> \frac{1}2
_FRAC_SHORT2 = re.compile(r"\\frac(\{[^{}]*\})([0-9A-Za-z])")  # \frac{1}2 -> \frac{1}{2}
_SQRT_SHORT = re.compile(r"\\sqrt([0-9A-Za-z])")  # \sqrt3 -> \sqrt{3}
_SCRIPT_BRACE = re.compile(r"([\^_])\{([0-9A-Za-z])\}(?![0-9A-Za-z])")  # x^{2} -> x^2; \log_{2}8
_RELATION = re.compile(r"\\(le|ge|ne)q(?![A-Za-z])")  # \leq -> \le
_CHOICE = re.compile(r"\(([A-Za-z])\)")  # (C) -> C
_WORDS = re.compile(r"[A-Za-z]{2,}(?:,[A-Za-z]{2,})*")  # "Sunday", "yes,no"
_POWER_SUFFIX = re.compile(r"\^\{?[0-9]\}?$")

_UNITS = frozenset("""
    cm mm km meter meters metre metres inch inches feet foot ft yard yards yd mile miles
    kg mg gram grams pound pounds lb lbs ounce ounces oz ton tons liter liters litre litres ml
    gallon gallons cup cups second seconds sec secs minute minutes min mins hour hours hr hrs
    day days week weeks month months year years mph kph dollar dollars cent cents euro euros
    degree degrees radian radians percent unit units sq square cubic
""".split())
_SHORT_UNITS = frozenset("m g s l h".split())  # only when separated by a space: "5 m", not "2m"
# Words after a number that are part of its value, not a noun to drop: "3 million" is not 3.
_NUMBER_WORDS = frozenset("""
    hundred hundreds thousand thousands million millions billion billions trillion dozen dozens
    score half halves third thirds quarter quarters
""".split())


def _strip_units(s: str) -> str:
    """Drop trailing units and nouns after a number or a closing bracket: '10 square feet' -> '10',
    '7 apples' -> '7', '5 cm^2' -> '5'. A noun is a word of 3+ letters after a space."""
    head = s.rstrip()
    for _ in range(4):  # "square feet", "cm^2", "red apples"
        t = head
        m = _POWER_SUFFIX.search(t[-5:])  # cm^2, units^{2}
        if m:
            t = t[:max(len(t) - 5, 0) + m.start()].rstrip()
        i = len(t)
        while i > 0 and t[i - 1].isascii() and t[i - 1].isalpha():
            i -= 1
        word, before = t[i:].lower(), t[:i]
        spaced = before[-1:].isspace()
        noun = spaced and len(word) >= 3 and word not in _NUMBER_WORDS
        if word not in _UNITS and not noun and not (word in _SHORT_UNITS and spaced):
            break
        if before.rstrip().endswith("\\"):  # \min, \deg: commands, not units
            break
        head = before.rstrip()
    if head != s.rstrip() and head and (head[-1].isdigit() or head[-1] in "})"):
        return head
    return s


def _strip_period(s: str) -> str:
    s = s.rstrip()
    return s[:-1].rstrip() if s.endswith(".") and not s.endswith("..") else s


def _keep_command_space(m: re.Match) -> str:
    # "\pi r" keeps its space ("\pir" is no command); every other run of blank space goes.
    command, follows = m.group(1) or "", m.string[m.end():m.end() + 1]
    return command + " " if command and follows.isascii() and follows.isalpha() else command


def _unwrap_latex(s: str) -> str:
    """Delimiters, \\left/\\right, spacing and style commands out; \\text{..} and kin unwrapped."""
    s = _MATH_DELIMS.sub("", s)
    s = _LEFT_RIGHT.sub("", s)
    s = _VERT.sub("|", s)
    s = _FRAC_STYLE.sub(r"\\frac", s)
    s = _BINOM_STYLE.sub(r"\\binom", s)
    s = _SPACING.sub(r"\1", s).replace("~", " ")
    for _ in range(4):  # innermost first; a few levels is all real answers use
        t = _TEXT_WRAP.sub(r" \1 ", s)
        if t == s:
            break
        s = t
    return _DEGREE.sub("", s)


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer (the section's docstring lists the rules)."""
    if not isinstance(answer, str):
        return ""
    s = answer.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return s
    s = clean_text(s)
    s = _last_box(s) or s
    s = s.strip().strip("*`\"").strip()
    m = _LEAD_PHRASE.match(s)  # "Answer: The answer is 12"
    if m:
        s = s[m.end():]
    s = s.replace("\\$", "").replace("$", "").replace("{,}", ",")  # 1{,}000
    latex = "\\" in s  # most answers are plain numbers: skip the LaTeX passes
    if latex:
        s = _unwrap_latex(s)
    s = _PERCENT.sub("", s)
    s = _CONNECTIVE.sub(",", _WHITESPACE.sub(" ", s))  # "x = 2 or x = 3" -> "x = 2,x = 3"
    s = _strip_period(s)
    if s.count("=") == 1:
        m = _VAR_PREFIX.match(s)
        if m:
            s = s[m.end():]
    s = _strip_period(_strip_units(s))
    s = _SPACE_AFTER.sub(_keep_command_space, _LOG_BASE.sub(r"\\log_{\1}", s.strip()))
    if latex:
        s = _FRAC_SHORT1.sub(r"\\frac{\1}", s)
        s = _FRAC_SHORT2.sub(r"\\frac\1{\2}", s)
        s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
        s = _RELATION.sub(r"\\\1", s)
    s = _SCRIPT_BRACE.sub(r"\1\2", s)
    m = _CHOICE.fullmatch(s)
    if m:
        s = m.group(1)
    if _WORDS.fullmatch(s):
        s = s.lower()
    return s


# ---------------------------------------------------------------------------------------------
# Equivalence

"""Equivalence: two normalised answers are equal if their strings are; else if both are plain
numbers, exactly (Fractions: 1,000 = 1000.0 = 1e3, 0.5 = 1/2); else if both parse (`_Parser`, our
own recursive descent) into trees that `_match`: scalars agree at shared random points (exactly
while the arithmetic stays rational, else as floats within their error bounds), tuples, points and
intervals item by item with the same brackets, sets and solution lists in any order, matrices
entry by entry, equations up to a constant factor. Anything unparsed, over a limit or undefined
is unequal; a plain number keeps MAX_DIGITS digits and |exponent| <= MAX_EXPONENT."""

# Plain numbers, exactly (the common case, before any parsing)

_NUM_PLAIN = re.compile(r"([+-]?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]+))?")
_NUM_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]*)\}\{([^{}]*)\}")
_NUM_SLASH = re.compile(r"([^/]+)/([^/]+)")
_NUM_TIMES_POW10 = re.compile(r"(.+?)(?:\\times|\\cdot)10\^\{?([+-]?[0-9]+)\}?")
_NUM_POW10 = re.compile(r"10\^\{?([+-]?[0-9]+)\}?")


def _exponent(text: str) -> int | None:
    if len(text.lstrip("+-")) > 4:
        return None
    e = int(text)
    return e if abs(e) <= MAX_EXPONENT else None


def _plain_number(s: str) -> Fraction | None:
    m = _NUM_PLAIN.fullmatch(s)
    if not m:
        return None
    sign, whole, frac, exp = m.groups()
    whole, frac = whole.replace(",", ""), frac or ""
    if not whole and not frac:
        return None
    if len(whole) + len(frac) > MAX_DIGITS:
        return None
    value = Fraction(int(whole + frac), 10 ** len(frac))
    if exp is not None:
        e = _exponent(exp)
        if e is None:
            return None
        value *= Fraction(10) ** e
    return -value if sign == "-" else value


def _ratio(sign: str, num: str, den: str) -> Fraction | None:
    n, d = _plain_number(num), _plain_number(den)
    if n is None or not d:  # d is None or 0
        return None
    return -n / d if sign == "-" else n / d


def _parse_number(s: str) -> Fraction | None:
    """A normalised answer as an exact rational, or None (not a number, or too big to trust)."""
    if len(s) > 3 * MAX_DIGITS:
        return None
    value = _plain_number(s)
    if value is not None:
        return value
    m = _NUM_FRAC.fullmatch(s)  # \frac{a}{b}, -\frac{a}{b}
    if m:
        return _ratio(*m.groups())
    m = _NUM_SLASH.fullmatch(s)  # a/b
    if m:
        return _ratio("", *m.groups())
    m = _NUM_TIMES_POW10.fullmatch(s)
    if m:
        mantissa, e = _plain_number(m.group(1)), _exponent(m.group(2))
        return None if mantissa is None or e is None else mantissa * Fraction(10) ** e
    m = _NUM_POW10.fullmatch(s)
    if m:
        e = _exponent(m.group(1))
        return None if e is None else Fraction(10) ** e
    return None


# Reading an answer: tokens, then a tree of tuples

class _Fail(Exception):
    """Outside the answer grammar, or over a limit: unequal answers (unless equal strings)."""


class _Undefined(ArithmeticError):
    """No value at this point (1/0, log 0, 0^-1, a tuple inside arithmetic)."""


_TOKEN = re.compile(
    r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"  # 12, 0.5, .5, 1e3
    r"|\\(?:begin|end)\{[A-Za-z]*\*?\}"  # \begin{pmatrix}
    r"|\\[A-Za-z]+|\\[{}|\\]"  # commands; \{ \} \| and the row break \\
    r"|[A-Za-z]+"  # letters, split below
    r"|\S"  # one symbol; blank space is skipped
)
_FUNCTION_WORDS = frozenset("sin cos tan cot sec csc ln log exp sqrt".split())  # "sin x" = "\sin x"
_GREEK = frozenset(
    r"\alpha \beta \gamma \delta \epsilon \varepsilon \zeta \eta \theta \vartheta \kappa \lambda"
    r" \mu \nu \xi \rho \sigma \tau \phi \varphi \chi \psi \omega \Gamma \Delta \Theta \Lambda"
    r" \Xi \Sigma \Phi \Psi \Omega".split()
)
_CONSTANTS = {"\\pi": ("c", "pi"), "e": ("c", "e"), "i": ("c", "i"), "\\infty": ("inf",)}
_FUNCTIONS = {  # name: (function, derivative), on complex floats
    "\\sin": (cmath.sin, cmath.cos), "\\cos": (cmath.cos, lambda z: -cmath.sin(z)),
    "\\tan": (cmath.tan, lambda z: cmath.cos(z) ** -2),
    "\\cot": (lambda z: 1 / cmath.tan(z), lambda z: -cmath.sin(z) ** -2),
    "\\sec": (lambda z: 1 / cmath.cos(z), lambda z: cmath.tan(z) / cmath.cos(z)),
    "\\csc": (lambda z: 1 / cmath.sin(z), lambda z: -1 / (cmath.tan(z) * cmath.sin(z))),
    "\\arcsin": (cmath.asin, lambda z: (1 - z * z) ** -0.5),
    "\\arccos": (cmath.acos, lambda z: -(1 - z * z) ** -0.5),
    "\\arctan": (cmath.atan, lambda z: 1 / (1 + z * z)),
    "\\sinh": (cmath.sinh, cmath.cosh), "\\cosh": (cmath.cosh, cmath.sinh),
    "\\tanh": (cmath.tanh, lambda z: cmath.cosh(z) ** -2),
    "\\ln": (cmath.log, lambda z: 1 / z), "\\log": (cmath.log, lambda z: 1 / z),
    "\\exp": (cmath.exp, cmath.exp),
}
_INVERSE = {"\\sin": "\\arcsin", "\\cos": "\\arccos", "\\tan": "\\arctan"}  # \sin^{-1} x
_TIMES = frozenset(["*", "\\cdot", "\\times"])
_DIVIDE = frozenset(["/", "\\div"])
_RELATIONS = {"<": "<", ">": ">", "\\lt": "<", "\\gt": ">", "\\le": "<=", "\\ge": ">="}
_ATOM_COMMANDS = frozenset(["\\pi", "\\frac", "\\sqrt", "\\binom", *_GREEK, *_FUNCTIONS])
_MATRICES = frozenset(["matrix", "pmatrix", "bmatrix", "Bmatrix", "array"])
_PLUS_MINUS = re.compile(r"\\(pm|mp)(?![A-Za-z])")


def _is_number(tok: str) -> bool:
    return tok[:1].isdigit() or (tok[:1] == "." and tok[1:2].isdigit())


def _tokens(text: str) -> list[str]:
    """Tokens; a run of letters is a function name ("sin"), "pi", or single-letter variables (two
    at most: "xy"); a longer word is not algebra."""
    out = []
    for tok in _TOKEN.findall(text):
        if len(tok) > 1 and tok.isalpha():
            if tok in _FUNCTION_WORDS or tok == "pi":
                tok = "\\" + tok
            elif len(tok) == 2:
                out.extend(tok)
                continue
            else:
                raise _Fail
        out.append(tok)
    return out


class _Parser:
    """Recursive descent over one normalised answer, into a tree of tuples:
    scalars  ("n", Fraction) ("v", name) ("c", "pi" | "e" | "i") ("inf",) ("neg", a) ("+", a, b)
             ("*", a, b) ("/", a, b) ("^", a, b) ("root", index, a) ("f", name, a)
             ("log", base, a) ("!", a) ("binom", n, k) ("abs", a)
    compound ("seq", opener, closer, items) ("set", items) ("list", items) ("mat", rows)
             ("eq", lhs, rhs) ("assign", name, value)
    Grammar, loosest first (implicit products: 2x, 2\\sqrt3, (x+1)(x-1); 2\\frac12 is 5/2):
        answer := item ("," item)*
        item   := union [("=" | "\\in") union | relation expr [relation expr]]
        union  := expr ("\\cup" expr)*
        expr   := term (("+" | "-") term)*
        term   := unary (("*" | "/") unary | power)*
        unary  := ("+" | "-") unary | power
        power  := atom "!"* ["^" script]
        atom   := number | letter["_" script] | \\pi | ( items ) | [ items ] | { items }
                  | \\{ items \\} | |expr| | \\frac arg arg | \\sqrt[expr] arg | \\binom arg arg
                  | function [^script] arg | \\begin{pmatrix} ... \\end{pmatrix}
    Anything else, or more than MAX_NODES nodes or MAX_DEPTH nesting, raises _Fail."""

    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.pos = self.nodes = self.depth = 0
        self.in_abs = False

    def peek(self) -> str:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ""

    def take(self, *expected: str) -> str:
        tok = self.peek()
        if not tok or (expected and tok not in expected):
            raise _Fail
        self.pos += 1
        return tok

    def node(self, *parts) -> tuple:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Fail
        return parts

    def nested(self, parse, *args):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Fail
        out = parse(*args)
        self.depth -= 1
        return out

    def answer(self) -> tuple:
        items = self.items()
        if self.pos != len(self.tokens):
            raise _Fail
        return items[0] if len(items) == 1 else self.node("list", items)

    def items(self) -> list:
        out = [self.item()]
        while self.peek() == ",":
            self.pos += 1
            out.append(self.item())
        return out

    def item(self) -> tuple:
        left = self.union()
        tok = self.peek()
        if tok == "=":
            self.pos += 1
            right = self.union()
            if left[0] == "v":
                return self.node("assign", left[1], right)
            return self.node("eq", left, right)
        if tok == "\\in" and left[0] == "v":  # x \in [1, 2]
            self.pos += 1
            return self.union()
        if tok in _RELATIONS:
            return self.inequality(left)
        return left

    def union(self) -> tuple:
        parts = [self.expr()]
        while self.peek() == "\\cup":
            self.pos += 1
            parts.append(self.expr())
        return parts[0] if len(parts) == 1 else self.node("set", parts)

    def inequality(self, first: tuple) -> tuple:
        """x > 2, 2 < x \\le 5 ... as the interval they describe: (2, \\infty), (2, 5]."""
        parts, relations = [first], []
        while self.peek() in _RELATIONS and len(relations) < 2:
            relations.append(_RELATIONS[self.take()])
            parts.append(self.expr())
        if all(r[0] == ">" for r in relations):  # 5 > x > 2 is 2 < x < 5
            parts.reverse()
            relations = ["<" + r[1:] for r in reversed(relations)]
        elif not all(r[0] == "<" for r in relations):
            raise _Fail
        is_var = [p[0] == "v" for p in parts]
        closed = [r == "<=" for r in relations]
        if is_var == [True, False]:
            low, high, opener, closer = ("neg", ("inf",)), parts[1], "(", "]" if closed[0] else ")"
        elif is_var == [False, True]:
            low, high, opener, closer = parts[0], ("inf",), "[" if closed[0] else "(", ")"
        elif is_var == [False, True, False]:
            low, high = parts[0], parts[2]
            opener, closer = "[" if closed[0] else "(", "]" if closed[1] else ")"
        else:
            raise _Fail
        return self.node("seq", opener, closer, [low, high])

    def expr(self) -> tuple:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Fail
        node = self.term()
        while self.peek() in ("+", "-"):
            sign = self.take()
            right = self.term()
            node = self.node("+", node, right if sign == "+" else self.node("neg", right))
        self.depth -= 1
        return node

    def starts_atom(self, tok: str) -> bool:
        return bool(tok) and (_is_number(tok) or tok.isalpha() or tok in ("(", "{")
                              or (tok == "|" and not self.in_abs) or tok in _ATOM_COMMANDS)

    def term(self) -> tuple:
        node = self.unary()
        while True:
            tok = self.peek()
            if tok in _TIMES or tok in _DIVIDE:
                self.pos += 1
                node = self.node("*" if tok in _TIMES else "/", node, self.unary())
            elif self.starts_atom(tok):
                right = self.power()
                mixed = _mixed_number(node, right) if tok == "\\frac" else None
                node = mixed or self.node("*", node, right)
            else:
                return node

    def unary(self) -> tuple:
        if self.peek() in ("+", "-"):
            sign = self.take()
            operand = self.nested(self.unary)
            return operand if sign == "+" else self.node("neg", operand)
        return self.power()

    def power(self) -> tuple:
        node = self.nested(self.atom)
        while self.peek() == "!":
            self.pos += 1
            node = self.node("!", node)
        if self.peek() == "^":
            self.pos += 1
            node = self.node("^", node, self.script())
        return node

    def script(self) -> tuple:
        """What ^ or _ applies to: {expr}, or one signed atom (x^2, e^x, 2^10, x^-1)."""
        if self.peek() in ("+", "-"):
            sign = self.take()
            inner = self.nested(self.script)
            return inner if sign == "+" else self.node("neg", inner)
        return self.argument()

    def argument(self) -> tuple:
        """The argument of \\frac, \\sqrt, \\binom, ^: a {group}, or one atom."""
        if self.peek() == "{":
            self.pos += 1
            inner = self.expr()
            self.take("}")
            return inner
        return self.nested(self.atom)

    def atom(self) -> tuple:
        tok = self.take()
        if _is_number(tok):
            value = _plain_number(tok)
            if value is None:
                raise _Fail
            return self.node("n", value)
        if tok.isalpha() or tok in _GREEK:
            return self.variable(tok)
        if tok in _CONSTANTS:
            return self.node(*_CONSTANTS[tok])
        if tok in ("(", "["):
            return self.bracket(tok)
        if tok in ("{", "\\{"):
            items = self.items()
            self.take("}" if tok == "{" else "\\}")
            if tok == "\\{":
                return self.node("set", items)
            return items[0] if len(items) == 1 else self.node("list", items)
        if tok == "|" and not self.in_abs:
            self.in_abs = True
            inner = self.expr()
            self.take("|")
            self.in_abs = False
            return self.node("abs", inner)
        if tok in ("\\frac", "\\binom"):
            top = self.argument()
            return self.node("/" if tok == "\\frac" else "binom", top, self.argument())
        if tok == "\\sqrt":
            index = self.node("n", Fraction(2))
            if self.peek() == "[":
                self.pos += 1
                index = self.expr()
                self.take("]")
            return self.node("root", index, self.argument())
        if tok in _FUNCTIONS:
            return self.function(tok)
        if tok.startswith("\\begin{") and tok[7:-1] in _MATRICES:
            return self.matrix(tok[7:-1])
        raise _Fail

    def variable(self, letter: str) -> tuple:
        if self.peek() != "_":
            return self.node(*_CONSTANTS.get(letter, ("v", letter)))
        self.pos += 1  # x_1, a_{10}: a variable of its own
        sub = [self.take()]
        if sub[0] == "{":
            while self.peek() not in ("}", "") and len(sub) < 8:
                sub.append(self.take())
            self.take("}")
            sub = sub[1:]
        if not all(t.isalnum() for t in sub):
            raise _Fail
        return self.node("v", letter + "_" + "".join(sub))

    def bracket(self, opener: str) -> tuple:
        """( items ) or [ items ]: a tuple, point or interval if two items or more, else a group."""
        items = self.items()
        closer = self.take(")", "]")
        if len(items) > 1:
            return self.node("seq", opener, closer, items)
        if opener + closer not in ("()", "[]"):
            raise _Fail
        return items[0]

    def function(self, name: str) -> tuple:
        """\\sin x, \\sin 2x (= \\sin(2x)), \\sin^2 x (= (\\sin x)^2), \\sin^{-1} x, \\log_2 8."""
        base = exponent = None
        if name == "\\log" and self.peek() == "_":
            self.pos += 1
            base = self.script()
        if self.peek() == "^":
            self.pos += 1
            exponent = self.script()
        if exponent == ("neg", ("n", 1)) and name in _INVERSE:
            name, exponent = _INVERSE[name], None
        if self.peek() in ("(", "{"):
            arg = self.nested(self.atom)
        else:  # the product of atoms that follows, up to the next function: \sin x \cos x
            arg = self.unary()
            while self.starts_atom(self.peek()) and self.peek() not in _FUNCTIONS:
                arg = self.node("*", arg, self.power())
        node = self.node("log", base, arg) if base is not None else self.node("f", name, arg)
        return node if exponent is None else self.node("^", node, exponent)

    def matrix(self, env: str) -> tuple:
        """Rows of entries separated by & and \\\\, up to \\end{env}; every row the same length."""
        if env == "array" and self.peek() == "{":  # the column spec {cc}
            while self.take() != "}":
                pass
        end, rows, row = "\\end{" + env + "}", [], []
        while True:
            row.append(self.expr())
            tok = self.take("&", "\\\\", end)
            if tok == "&":
                continue
            rows.append(row)
            row = []
            if tok != end and self.peek() == end:  # a trailing \\ before \end
                tok = self.take()
            if tok == end:
                break
        if len({len(r) for r in rows}) != 1:
            raise _Fail
        return self.node("mat", rows)


def _mixed_number(whole: tuple, fraction: tuple) -> tuple | None:
    """2\\frac{1}{2} written by a person is 5/2, not 1: an integer literal before a \\frac of two
    integer literals (a sign before the integer covers both: -2\\frac12 is -5/2)."""
    sign, w = (-1, whole[1]) if whole[0] == "neg" else (1, whole)
    if (w[0] != "n" or w[1].denominator != 1 or fraction[0] != "/"
            or fraction[1][0] != "n" or fraction[2][0] != "n"):
        return None
    p, q = fraction[1][1], fraction[2][1]
    if p.denominator != 1 or q.denominator != 1 or q == 0:
        return None
    return ("n", sign * (w[1] + p / q))


def _members(tree: tuple) -> list:
    return list(tree[1]) if tree[0] in ("list", "set") else [tree]


def _shape(tree: tuple) -> tuple:
    """One form per compound answer: "x = 1, y = 2" is the point (1, 2), "x = 2, x = 3" a list of
    solutions, a one-element set its element, "y = 5" and "(x, y) = (1, 2)" their values."""
    kind = tree[0]
    named = kind == "eq" and tree[1][0] == "seq" and all(t[0] == "v" for t in tree[1][3])
    if kind == "assign" or named:
        return _shape(tree[-1])  # "y = 5", "(x, y) = (1, 2)": the value
    if kind in ("list", "set"):
        names = [t[1] for t in tree[1] if t[0] == "assign"]
        items = [_shape(t) for t in tree[1]]
        if kind == "list" and len(names) == len(items) and len(set(names)) == len(names):
            return ("seq", "(", ")", items)
        return items[0] if len(items) == 1 else (kind, items)
    if kind == "seq":
        return ("seq", tree[1], tree[2], [_shape(t) for t in tree[3]])
    if kind == "mat":
        return ("mat", [[_shape(t) for t in row] for row in tree[1]])
    return tree


def _read(text: str) -> tuple:
    """The tree of a normalised answer (raises _Fail). A \\pm (or \\mp) gives both answers, as a
    set: 1 \\pm \\sqrt{2} is {1 + \\sqrt{2}, 1 - \\sqrt{2}} (all signs together, as written)."""
    if _PLUS_MINUS.search(text):
        plus = _PLUS_MINUS.sub(lambda m: "+" if m.group(1) == "pm" else "-", text)
        minus = _PLUS_MINUS.sub(lambda m: "-" if m.group(1) == "pm" else "+", text)
        return ("set", _members(_read(plus)) + _members(_read(minus)))
    number = _parse_number(text)  # 1,000 is a thousand here, not the list 1, 0
    if number is not None:
        return ("n", number)
    return _shape(_Parser(text).answer())


def _names(tree: tuple) -> set[str]:
    names, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple) and node[:1] == ("v",):
            names.add(node[1])
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
    return names


# Values of a tree at random points: our own arithmetic, Fractions first

"""A value is a Fraction (exact) or a pair (z, err): a complex float and a bound on its distance
from the true value, carried through every operation to first order (each operation adds a few
units of rounding, U, of its result; derivatives carry the inputs' errors). Comparing two floats
then needs no guessed tolerance: they agree if they differ by less than their errors, and the
errors are small (REL_TOL of the values, or ABS_TOL near zero); "10^{30}\\pi - 10^{30}\\pi + 7" is
7 give or take 10^15, equal to nothing. Where the result may be 0 (a divisor, a log), overflows or
underflows (below TINY), there is no value: _Undefined."""

U = 2.0 ** -52  # rounding of one float operation, twice double precision's unit for complex ones
TINY = 1e-280  # nonzero float results below this have lost their digits


def _small(x: Fraction):
    """x itself, or a float once it outgrows MAX_BITS (OverflowError, so undefined, if even a
    float cannot hold it)."""
    if max(x.numerator.bit_length(), x.denominator.bit_length()) > MAX_BITS:
        return _approx(x)
    return x


def _float(z: complex, err: float) -> tuple:
    if not (cmath.isfinite(z) and math.isfinite(err)) or 0 < abs(z) < TINY:
        raise _Undefined
    return z, err


def _approx(x) -> tuple:
    """Any value as (z, err); a Fraction is exact up to its rounding to a float."""
    if isinstance(x, tuple):
        return x
    z = complex(x)  # OverflowError beyond float range
    if x and not z:
        raise _Undefined  # underflow
    return _float(z, U * abs(z))


def _add(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return _small(a + b)
    (x, ex), (y, ey) = _approx(a), _approx(b)
    return _float(x + y, ex + ey + U * abs(x + y))


def _mul(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return _small(a * b)
    (x, ex), (y, ey) = _approx(a), _approx(b)
    z = x * y
    if x and y and not z:
        raise _Undefined  # underflow
    return _float(z, abs(x) * ey + abs(y) * ex + ex * ey + 4 * U * abs(z))


def _div(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return _small(a / b)  # ZeroDivisionError: undefined
    (x, ex), (y, ey) = _approx(a), _approx(b)
    if abs(y) <= ey:
        raise _Undefined  # the divisor may be 0
    z = x / y
    if x and not z:
        raise _Undefined
    return _float(z, (ex + abs(z) * ey) / (abs(y) - ey) + 4 * U * abs(z))


def _neg(a):
    return -a if isinstance(a, Fraction) else (-a[0], a[1])


def _abs(a):
    return abs(a) if isinstance(a, Fraction) else (complex(abs(a[0])), a[1])


def _negative_real(a) -> bool:
    return a < 0 if isinstance(a, Fraction) else (a[0].imag == 0 and a[0].real < 0)


def _int_root(n: int, q: int) -> int | None:
    """The integer q-th root of n >= 0 if n is a perfect q-th power, else None."""
    if q == 2:
        r = math.isqrt(n)
        return r if r * r == n else None
    if n.bit_length() > 1000:  # beyond a float's range: leave it to the float path
        return None
    r = round(n ** (1.0 / q))
    return next((c for c in (r - 1, r, r + 1) if c >= 0 and c ** q == n), None)


def _exact_power(base: Fraction, exponent: Fraction) -> Fraction | None:
    """base ** exponent as a Fraction when it is one and stays within MAX_BITS, else None."""
    p, q = exponent.numerator, exponent.denominator
    if q > 1:
        if q > 64 or (base < 0 and q % 2 == 0):
            return None
        num, den = _int_root(abs(base.numerator), q), _int_root(base.denominator, q)
        if num is None or den is None:
            return None
        base = Fraction(-num if base < 0 else num, den)
    if base == 0:
        if p < 0:
            raise _Undefined
        return Fraction(0 if p else 1)
    if abs(p) * max(base.numerator.bit_length(), base.denominator.bit_length()) > MAX_BITS:
        return None
    return base ** p


def _power(base, exponent):
    """base ** exponent: exact where possible; a rational exponent with an odd denominator takes
    the real root of a negative base ((-8)^{1/3} = \\sqrt[3]{-8} = -2); else the principal value,
    exp(exponent log base), whose error follows from the inputs' and from the exponent's size."""
    if isinstance(exponent, Fraction):
        if isinstance(base, Fraction):
            exact = _exact_power(base, exponent)
            if exact is not None:
                return exact
        if exponent.denominator % 2 and _negative_real(base):
            magnitude = _power(_neg(base), exponent)
            return _neg(magnitude) if exponent.numerator % 2 else magnitude
    if base == 0:  # an exact 0 to a float power
        if _approx(exponent)[0].real > 0:
            return Fraction(0)
        raise _Undefined
    (x, ex), (y, ey) = _approx(base), _approx(exponent)
    if abs(x) <= ex:
        raise _Undefined  # the base may be 0
    z = cmath.sqrt(x) if exponent == Fraction(1, 2) else x ** y  # sqrt: exactly 2i for -4
    if not z:
        raise _Undefined  # underflow
    log_x = cmath.log(x)
    relative = abs(y) * ex / (abs(x) - ex) + abs(log_x) * ey + U * (abs(y * log_x) + 4)
    return _float(z, abs(z) * relative)


def _root(index, radicand):
    if isinstance(index, Fraction) and index.denominator == 1 and index > 0:
        return _power(radicand, 1 / index)
    return _power(radicand, _div(Fraction(1), index))


def _apply(name: str, a):
    """A function of a float, its error carried by the derivative."""
    function, derivative = _FUNCTIONS[name]
    x, ex = _approx(a)
    if name in ("\\ln", "\\log") and abs(x) <= ex:
        raise _Undefined
    z, slope = function(x), abs(derivative(x))
    return _float(z, slope * ex + 4 * U * (abs(z) + abs(x) * slope))


def _factorial(n):
    if not isinstance(n, Fraction) or n.denominator != 1 or not 0 <= n <= 300:
        raise _Undefined
    return _small(Fraction(math.factorial(int(n))))


def _binomial(n, k):
    integers = all(isinstance(x, Fraction) and x.denominator == 1 for x in (n, k))
    if not integers or not 0 <= n <= 1000:
        raise _Undefined
    return _small(Fraction(math.comb(int(n), int(k)) if k >= 0 else 0))


_CONSTANT_VALUES = {
    "pi": (complex(math.pi), U * math.pi), "e": (complex(math.e), U * math.e), "i": (1j, 0.0),
}
_BINARY = {"+": _add, "*": _mul, "/": _div, "^": _power, "root": _root, "binom": _binomial}


def _random_rational(rng: random.Random) -> Fraction:
    """A point coordinate: a random p/q, |p| <= 2000, 2 <= q <= 200 (about 400,000 values), of
    either sign, so that |x| and x, or \\sqrt{x^2} and x, differ."""
    return Fraction(rng.choice((-1, 1)) * rng.randint(1, 2000), rng.randint(2, 200))


class _Values:
    """Values of scalar trees at POINTS shared random points (one point if there are no variables);
    None where undefined. MAX_WORK node evaluations and matched pairs in all, then _Fail. The
    points are seeded by the two answers: the same pair always gets the same verdict."""

    def __init__(self, names: set[str], seed: str):
        rng = random.Random(seed)
        count = POINTS if names else 1
        self.points = [{name: _random_rational(rng) for name in sorted(names)}
                       for _ in range(count)]
        self.work = 0
        self.cache = {}

    def spend(self) -> None:
        self.work += 1
        if self.work > MAX_WORK:
            raise _Fail

    def of(self, tree: tuple) -> list:
        if id(tree) not in self.cache:  # the tree is kept with its values: ids stay unique
            self.cache[id(tree)] = (tree, [self.at(tree, point) for point in self.points])
        return self.cache[id(tree)][1]

    def at(self, tree: tuple, point: dict):
        try:
            return self.value(tree, point)
        except (ArithmeticError, ValueError):  # _Undefined, ZeroDivisionError, OverflowError
            return None

    def value(self, node: tuple, point: dict):
        self.spend()
        kind = node[0]
        if kind == "n":
            return node[1]
        if kind == "v":
            return point[node[1]]
        if kind == "c":
            return _CONSTANT_VALUES[node[1]]
        if kind in _BINARY:
            return _BINARY[kind](self.value(node[1], point), self.value(node[2], point))
        if kind == "neg":
            return _neg(self.value(node[1], point))
        if kind == "abs":
            return _abs(self.value(node[1], point))
        if kind == "!":
            return _factorial(self.value(node[1], point))
        if kind == "f":
            return _apply(node[1], self.value(node[2], point))
        if kind == "log":
            argument, base = self.value(node[2], point), self.value(node[1], point)
            return _div(_apply("\\ln", argument), _apply("\\ln", base))
        raise _Undefined  # infinity, a tuple or a set inside arithmetic


# Matching two trees

def _close(a, b) -> bool:
    """Equal values: Fractions exactly; floats when they differ by less than their errors (plus
    REL_TOL, for errors first-order bounds miss) and those errors are small: REL_TOL of the
    values, or ABS_TOL near zero (\\cos\\frac{\\pi}{2} is 0, 10^{-13}\\pi is not)."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    try:
        (x, ex), (y, ey) = _approx(a), _approx(b)
    except (ArithmeticError, ValueError):  # an exact value beyond float range against a float
        return False
    err, size = ex + ey, max(abs(x), abs(y))
    return abs(x - y) <= err + REL_TOL * size and (err <= REL_TOL * size or err <= ABS_TOL)


def _same_values(xs: list, ys: list) -> bool:
    """Equal wherever both are defined, undefined at the same points, defined at half or more."""
    defined = 0
    for x, y in zip(xs, ys):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if not _close(x, y):
            return False
        defined += 1
    return defined > 0 and 2 * defined >= len(xs)


def _infinity(tree: tuple) -> int:
    return 1 if tree == ("inf",) else -1 if tree == ("neg", ("inf",)) else 0


def _proportional(a: tuple, b: tuple, values: _Values) -> bool:
    """Equations equal up to a nonzero constant factor: 2x + 2y = 2 is x + y = 1, y = 1 - x."""
    da = values.of(("+", a[1], ("neg", a[2])))
    db = values.of(("+", b[1], ("neg", b[2])))
    if None in da or None in db:
        return False
    try:
        ratio = next((_div(x, y) for x, y in zip(da, db) if not _close(y, Fraction(0))), None)
        if ratio is None or _close(ratio, Fraction(0)):
            return ratio is None and all(_close(x, Fraction(0)) for x in da)
        return all(_close(x, _mul(ratio, y)) for x, y in zip(da, db))
    except (ArithmeticError, ValueError):
        return False


def _vector(tree: tuple) -> list | None:
    """Entries of a vector written as a (..) tuple or as a one-column matrix. (A bare list is not
    one: "-2, 1" lists solutions, "(-2, 1)" is a point or an interval.)"""
    if tree[0] == "seq" and tree[1] + tree[2] == "()":
        return tree[3]
    if tree[0] == "mat" and all(len(row) == 1 for row in tree[1]):
        return [row[0] for row in tree[1]]
    return None


def _pairwise(xs: list, ys: list, values: _Values) -> bool:
    return len(xs) == len(ys) and all(_match(x, y, values) for x, y in zip(xs, ys))


def _exact_key(tree: tuple, values: _Values) -> tuple | None:
    """A scalar's values as a hashable key when all are exact, else None."""
    if tree[0] in _COMPOUND or _infinity(tree):
        return None
    key = tuple(values.of(tree))
    return key if all(type(v) is Fraction for v in key) else None


def _covers(xs: list, ys: list, values: _Values) -> bool:
    """Every x matches some y: exact scalars through a hash of their values (a set of a hundred
    numbers costs a hundred look-ups), the rest pairwise."""
    exact = {_exact_key(y, values) for y in ys} - {None}
    for x in xs:
        key = _exact_key(x, values)
        if (key is None or key not in exact) and not any(_match(x, y, values) for y in ys):
            return False
    return True


_UNORDERED = ("set", "list")
_COMPOUND = ("seq", "set", "list", "mat", "eq", "assign")


def _match(a: tuple, b: tuple, values: _Values) -> bool:
    """Whether two shaped trees are the same answer (see the section's docstring)."""
    values.spend()  # pairs of set members count as work too
    if a[0] not in _COMPOUND and b[0] not in _COMPOUND:
        if _infinity(a) or _infinity(b):
            return _infinity(a) == _infinity(b)
        return _same_values(values.of(a), values.of(b))
    if a[0] == b[0] == "seq":
        return a[1] == b[1] and a[2] == b[2] and _pairwise(a[3], b[3], values)
    if a[0] == b[0] == "mat":
        return (list(map(len, a[1])) == list(map(len, b[1]))
                and _pairwise(sum(a[1], []), sum(b[1], []), values))
    if a[0] in _UNORDERED and b[0] in _UNORDERED:
        return _covers(a[1], b[1], values) and _covers(b[1], a[1], values)
    if a[0] == b[0] == "eq":
        return _proportional(a, b, values)
    va, vb = _vector(a), _vector(b)  # a column vector and a tuple: entries in order
    return va is not None and vb is not None and a[0] != b[0] and _pairwise(va, vb, values)


def _equivalent(a: str, b: str) -> bool:
    """Whether two normalised answers are the same mathematics: parsed, shaped, then matched."""
    if max(len(a), len(b)) > MAX_PARSE_CHARS or _WORDS.fullmatch(a) or _WORDS.fullmatch(b):
        return False  # too long to parse, or words ("no" is not n * o)
    try:
        x, y = _read(a), _read(b)
        values = _Values(_names(x) | _names(y), seed="\0".join(sorted((a, b))))
        return _match(x, y, values)
    except _Fail:
        return False


def _equal(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = _parse_number(a), _parse_number(b)
    if x is not None and y is not None:  # the common case: two plain numbers
        return x == y
    return _equivalent(a, b)


def _truth_answer(truth) -> str | None:
    """The ground truth as an answer string; a GSM8K solution or a boxed one is reduced first."""
    if isinstance(truth, (int, float, Fraction)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str) or len(truth) > MAX_SCAN_CHARS:
        return None
    t = clean_text(truth).strip()
    if "\\boxed" in t or "\\fbox" in t:
        return _last_box(t) or t
    if "####" in t:
        return _gsm8k_line(t) or t
    return t


def answers_equal(pred: str | None, truth) -> bool:
    """Whether an answer already extracted equals `truth` (anything is_correct takes, or another
    extracted answer) as mathematics: "1,000" == "1000", "0.5" == "1/2", "\\sqrt{12}" ==
    "2\\sqrt{3}", "x = 2 or x = 3" == "\\{3, 2\\}". is_correct uses it, and majority voting pools
    equal answers with it. Never raises."""
    try:
        gold = _truth_answer(truth)
        if not pred or not gold or not isinstance(pred, str):
            return False
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return pred.strip() == gold.strip()
        a, b = normalize_answer(pred), normalize_answer(gold)
        return bool(a) and bool(b) and _equal(a, b)
    except Exception:  # RecursionError, MemoryError included: a reward never raises
        return False


def is_correct(response: str, truth) -> bool:
    """True if the answer extracted from `response` is equivalent to `truth` (answers_equal).

    Never evaluates text, never raises (anything unexpected is False), bounded time on any input.
    `truth` may be a str, an int, a float or a Fraction; a GSM8K "... #### 72" solution or a
    \\boxed{} one is reduced to its answer first.
    """
    try:
        return answers_equal(extract_answer(response), truth)
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# Arithmetic alone: a Countdown answer (countdown.py)

_ARITHMETIC_CHARS = re.compile(r"[0-9.\s+\-*/()]*")
_JUXTAPOSED = re.compile(r"[0-9.]\s+[0-9.]|[0-9.)]\s*\(|\)\s*[0-9.]")  # 12 34, 2(3), (1)(2)


def arithmetic_value(text: str):
    """An expression of numbers with + - * / and parentheses, read by our own parser (never
    eval): (its exact value, the numbers it uses in order), or None for anything else (letters,
    powers, a product written without *, a division by 0, over this file's size limits)."""
    try:
        text = clean_text(str(text)).replace("\\times", "*").replace("\\cdot", "*").strip()
        if not text or len(text) > MAX_PARSE_CHARS or not _ARITHMETIC_CHARS.fullmatch(text) \
                or _JUXTAPOSED.search(text):
            return None
        numbers = []

        def value(node):
            kind = node[0]
            if kind == "n":
                numbers.append(node[1])
                return node[1]
            if kind == "neg":
                return -value(node[1])
            if kind in ("+", "*", "/"):
                a, b = value(node[1]), value(node[2])
                return a + b if kind == "+" else a * b if kind == "*" else a / b  # b = 0: raises
            raise _Fail

        return value(_Parser(text).answer()), numbers
    except Exception:  # _Fail, ZeroDivisionError, RecursionError: not an arithmetic answer
        return None
