"""Rewards for math RL: answer extraction, verification, format terms, length and perplexity shaping.

A completion is scored as DAPO does (arXiv 2503.14476): +1 if its final answer equals the ground
truth and -1 otherwise (eq. 7), plus the soft overlong punishment (eq. 13) when it ran long.
`math_reward` adds the optional terms this codebase offers and returns `(reward, components)` with
every component present, so logging is uniform whatever is switched on.

Extraction (`extract_answer`), first rule that yields a non-empty answer wins:
  1. DAPO's "Answer: X": the last line that opens with "Answer:" (any case; "**Answer:**" and
     "Final answer:" too), rest of that line (as DAPO's `Answer\\s*:\\s*([^\\n]+)`: blank space
     after the colon may run onto the next line). DAPO's regex also matches mid-sentence; we do
     not, so prose like "check our answer: ..." is not taken. A box on that line is unwrapped
     ("Answer: $\\boxed{5}$" gives "5").
  2. The content of the last closed `<answer>...</answer>` (the XML format of GRPO recipes).
  3. The last balanced `\\boxed{...}` or `\\fbox{...}` (nested braces, `\\{` `\\}` escapes), or
     `\\boxed 5`; a box longer than MAX_ANSWER_CHARS is not an answer; the last
     MAX_BOX_CANDIDATES boxes are looked at.
  4. GSM8K's "#### X": the last one, rest of that line.
  5. The last number in the text (integers, 1,000-style, decimals, a/b).
Only the last MAX_SCAN_CHARS characters are read: the answer sits at the end of a completion, and
reading a fixed-size tail makes every later step cost the same on a 100 kB string as on a 10 kB
one. Answers longer than MAX_ANSWER_CHARS are not normalised, only compared exactly.

Normalisation (`normalize_answer`, both sides): Unicode clean-up (full-width digits and colons,
superscripts to ^, control characters dropped, U+2212 minus, pi/infinity/sqrt symbols to LaTeX);
`$`, `\\(`, `\\)`, `\\[`, `\\]`, `\\left`/`\\right`, spacing (`\\!`, `\\,`, `\\;`, `\\quad`),
`\\displaystyle` removed; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\text{..}`, `\\mathrm{..}`, `\\mbox{..}`,
... unwrapped; `^\\circ`, `^{\\circ}`, `%`, `\\%` removed; trailing units ("cm", "dollars",
"degrees", "square feet", ...) and a trailing period removed; an "x =" / "k=" prefix and a
"the answer is" prefix removed;
whitespace removed; `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` -> `\\sqrt{3}`, `x^{2}` -> `x^2`;
`\\leq` -> `\\le`; "(C)" -> "C"; purely alphabetic answers lower-cased.
Comparison: equal strings; else both sides as exact rationals (`fractions.Fraction`: 1,000 = 1000 =
1000.0 = 1e3, 1/2 = 0.5 = \\frac{1}{2}, 3\\times10^{2} = 300); else tuples, intervals and sets
element-wise ("(1, 2.0)" = "(1,2)"). A percentage equals its number (50% = 50, not 0.5).

Safety, because completions are adversarial by construction (the policy is optimised against this
code): nothing here evaluates text (no eval, exec, sympy): numbers are parsed by regular expressions
into Fractions, and only when they have at most MAX_DIGITS digits and |exponent| <= MAX_EXPONENT;
anything bigger ("1e999999999", "2**1000000", 10^1000 digits) is compared as a string. Inputs are
cut to fixed sizes first, every regular expression is linear (no nested or adjacent overlapping
quantifiers), brace depth is a running sum over a bounded window, Unicode clean-up is one
`str.translate` (not NFKC, which is quadratic on runs of combining marks), and the public
verification functions catch every exception and answer False / None / 0.0: a reward function
that raises kills a training run. Worst case measured on hostile inputs: a few milliseconds.

Run the tests: `python -m pytest tests/test_rewards.py -q`
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from itertools import accumulate, repeat

__all__ = [
    "extract_answer", "normalize_answer", "is_correct", "overlong_penalty", "perplexity_penalty",
    "format_reward", "xml_terms", "math_reward", "FORMAT_STYLES",
]

MAX_SCAN_CHARS = 8192  # tail of a completion read for extraction (a few thousand tokens)
MAX_ANSWER_CHARS = 1000  # longer answers are compared exactly, never normalised
MAX_BOX_CANDIDATES = 16  # boxes looked at, from the last
MAX_DIGITS = 100  # numbers with more digits are compared as strings
MAX_EXPONENT = 100  # |e| bound for 1e5 and 3\times10^{5}

# ---------------------------------------------------------------------------------------------
# Unicode clean-up (shared by extraction and normalisation)

_SYMBOLS = {
    "\u2212": "-", "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u00d7": "\\times ",
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


def _clean(s: str) -> str:
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

# "Answer:" opening a line (after markdown such as "**" or "### ", or "Final "): DAPO's own regex
# matches anywhere, which also catches prose like "check our answer: 17 * 44 = 748".
_ANSWER_RE = re.compile(r"^[ \t*_#>]*(?:final[ \t]+)?answer[ \t*_]*:", re.IGNORECASE | re.MULTILINE)
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
    starts = [m.end() for m in _ANSWER_RE.finditer(s)]
    for j in reversed(starts):
        rest = s[j:].lstrip()  # DAPO's \s*: "Answer:\n42" is 42
        end = rest.find("\n")
        line = (rest if end < 0 else rest[:end]).strip().strip("*").strip()  # **Answer:** 42
        if line:
            return _last_box(line) or line
    return None


def _answer_tag(s: str) -> str | None:
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

    Priority: "Answer: X" (last) > <answer>X</answer> (last) > \\boxed{X} / \\fbox{X} (last) >
    "#### X" (last) > last number.
    Only the last MAX_SCAN_CHARS characters are read. The answer is returned as written (after
    Unicode clean-up), not normalised: `normalize_answer` / `is_correct` do that.
    """
    try:
        if not isinstance(text, str):
            return None
        tail = _clean(text[-MAX_SCAN_CHARS:])[-MAX_SCAN_CHARS:]  # clean-up may lengthen it
        for rule in (_answer_line, _answer_tag, _last_box, _gsm8k_line, _last_number):
            ans = rule(tail)
            if ans:
                return ans
        return None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Normalisation

_MATH_DELIMS = re.compile(r"\\[()\[\]]")  # \( \) \[ \]
_LEFT_RIGHT = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
_FRAC_STYLE = re.compile(r"\\[dt]frac(?![A-Za-z])")
_BINOM_STYLE = re.compile(r"\\[dt]binom(?![A-Za-z])")
_SPACING = re.compile(r"\\(?:[!,;: ]|(?:quad|qquad|displaystyle|textstyle|scriptstyle)(?![A-Za-z]))")
_TEXT_WRAP = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|texttt|textsf|mathrm|mathbf|mathit|mathsf|mathtt"
    r"|mathbb|mbox|hbox|boldsymbol|operatorname)[ \t]*\{([^{}]*)\}"
)
_DEGREE = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\degree(?![A-Za-z])")  # not f \circ g
_PERCENT = re.compile(r"\\?%")
_LEAD_PHRASE = re.compile(r"(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is[ \t:]*", re.IGNORECASE)
_VAR_PREFIX = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*=")
_WHITESPACE = re.compile(r"\s+")
_FRAC_SHORT1 = re.compile(r"\\frac([0-9A-Za-z])")  # \frac12 -> \frac{1}2
_FRAC_SHORT2 = re.compile(r"\\frac(\{[^{}]*\})([0-9A-Za-z])")  # \frac{1}2 -> \frac{1}{2}
_SQRT_SHORT = re.compile(r"\\sqrt([0-9A-Za-z])")  # \sqrt3 -> \sqrt{3}
_SCRIPT_BRACE = re.compile(r"([\^_])\{([0-9A-Za-z])\}")  # x^{2} -> x^2
_RELATION = re.compile(r"\\(le|ge|ne)q(?![A-Za-z])")  # \leq -> \le
_CHOICE = re.compile(r"\(([A-Za-z])\)")  # (C) -> C
_WORD = re.compile(r"[A-Za-z]{2,}")
_POWER_SUFFIX = re.compile(r"\^\{?[0-9]\}?$")

_UNITS = frozenset("""
    cm mm km meter meters metre metres inch inches feet foot ft yard yards yd mile miles
    kg mg gram grams pound pounds lb lbs ounce ounces oz ton tons liter liters litre litres ml
    gallon gallons cup cups second seconds sec secs minute minutes min mins hour hours hr hrs
    day days week weeks month months year years mph kph dollar dollars cent cents euro euros
    degree degrees radian radians percent unit units sq square cubic
""".split())
_SHORT_UNITS = frozenset("m g s l h".split())  # only when separated by a space: "5 m", not "2m"


def _strip_units(s: str) -> str:
    """Drop trailing unit words after a number or a closing brace: '10 square feet' -> '10'."""
    head = s.rstrip()
    for _ in range(4):  # "square feet", "cm^2", "dollars"
        t = head
        m = _POWER_SUFFIX.search(t[-5:])  # cm^2, units^{2}
        if m:
            t = t[:max(len(t) - 5, 0) + m.start()]
        i = len(t)
        while i > 0 and t[i - 1].isascii() and t[i - 1].isalpha():
            i -= 1
        word, before = t[i:].lower(), t[:i]
        if word not in _UNITS and not (word in _SHORT_UNITS and before[-1:].isspace()):
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


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer (see the module docstring for every rule)."""
    if not isinstance(answer, str):
        return ""
    s = answer.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return s
    s = _clean(s)
    s = _last_box(s) or s
    s = s.strip().strip("*`\"").strip()
    m = _LEAD_PHRASE.match(s)  # "Answer: The answer is 12"
    if m:
        s = s[m.end():]
    s = s.replace("\\$", "").replace("$", "").replace("{,}", ",")  # 1{,}000
    latex = "\\" in s  # most answers are plain numbers: skip the LaTeX passes
    if latex:
        s = _MATH_DELIMS.sub("", s)
        s = _LEFT_RIGHT.sub("", s)
        s = _FRAC_STYLE.sub(r"\\frac", s)
        s = _BINOM_STYLE.sub(r"\\binom", s)
        s = _SPACING.sub("", s)
        for _ in range(4):  # innermost first; a few levels is all real answers use
            t = _TEXT_WRAP.sub(r" \1 ", s)
            if t == s:
                break
            s = t
        s = _DEGREE.sub("", s)
    s = _PERCENT.sub("", s)
    s = _strip_period(s)
    if s.count("=") == 1:
        m = _VAR_PREFIX.match(s)
        if m:
            s = s[m.end():]
    s = _strip_period(_strip_units(s))
    s = _WHITESPACE.sub("", s)
    if latex:
        s = _FRAC_SHORT1.sub(r"\\frac{\1}", s)
        s = _FRAC_SHORT2.sub(r"\\frac\1{\2}", s)
        s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
        s = _RELATION.sub(r"\\\1", s)
    s = _SCRIPT_BRACE.sub(r"\1\2", s)
    m = _CHOICE.fullmatch(s)
    if m:
        s = m.group(1)
    if _WORD.fullmatch(s):
        s = s.lower()
    return s


# ---------------------------------------------------------------------------------------------
# Exact numbers (Fraction), with bounded size

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


# ---------------------------------------------------------------------------------------------
# Verification

_OPEN_CLOSE = (("\\{", "\\}"), ("(", ")"), ("[", "]"), ("(", "]"), ("[", ")"))


def _split_sequence(s: str) -> tuple[str, list[str], str] | None:
    """'(1,2]' -> ('(', ['1', '2'], ']'); bare '1,2' -> ('', ['1', '2'], ''); else None."""
    opener = closer = ""
    for o, c in _OPEN_CLOSE:
        if len(s) >= len(o) + len(c) and s.startswith(o) and s.endswith(c):
            opener, closer = o, c
            break
    inner = s[len(opener):len(s) - len(closer)]
    items, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None  # "(1)+(2)" is not a sequence
        elif ch == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
    items.append(inner[start:])
    if len(items) < 2 and not opener:
        return None
    return opener, items, closer


def _equal(a: str, b: str, nested: bool = False) -> bool:
    if a == b:
        return True
    x, y = _parse_number(a), _parse_number(b)
    if x is not None or y is not None:
        return x == y
    if nested:
        return False
    sa, sb = _split_sequence(a), _split_sequence(b)
    if not sa or not sb or sa[0] != sb[0] or sa[2] != sb[2] or len(sa[1]) != len(sb[1]):
        return False
    if len(sa[1]) < 2:
        return False  # "(5)" vs "(5.0)": a bracketed scalar, not a sequence; leave it
    return all(_equal(p, q, nested=True) for p, q in zip(sa[1], sb[1]))


def _truth_answer(truth) -> str | None:
    """The ground truth as an answer string; a GSM8K solution or a boxed one is reduced first."""
    if isinstance(truth, (int, float, Fraction)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str) or len(truth) > MAX_SCAN_CHARS:
        return None
    t = _clean(truth).strip()
    if "\\boxed" in t or "\\fbox" in t:
        return _last_box(t) or t
    if "####" in t:
        return _gsm8k_line(t) or t
    return t


def is_correct(response: str, truth) -> bool:
    """True if the answer extracted from `response` equals `truth` after normalisation.

    Never evaluates text, never raises (anything unexpected is False), bounded time on any input.
    `truth` may be a str, an int, a float or a Fraction; a GSM8K "... #### 72" solution or a
    \\boxed{} one is reduced to its answer first.
    """
    try:
        return answers_equal(extract_answer(response), truth)
    except Exception:
        return False


def answers_equal(pred: str | None, truth) -> bool:
    """Whether an answer already extracted equals `truth` (anything is_correct takes, or another
    extracted answer) after normalisation: "1,000" == "1000", "0.5" == "1/2". is_correct uses it,
    and majority voting pools equal answers with it. Never raises."""
    try:
        gold = _truth_answer(truth)
        if not pred or not gold:
            return False
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return pred.strip() == gold.strip()
        a, b = normalize_answer(pred), normalize_answer(gold)
        return bool(a) and bool(b) and _equal(a, b)
    except Exception:
        return False


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
            tail = _clean(response[-MAX_SCAN_CHARS:]).rstrip()
            line = tail[tail.rfind("\n") + 1:]
            m = _ANSWER_RE.match(line)  # the same "Answer:" line that extraction reads
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
        answer = _answer_tag(response[-MAX_SCAN_CHARS:]) or ""
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


def math_reward(
    response: str,
    truth,
    *,
    correct: float = 1.0,
    wrong: float = -1.0,
    format_style: str | None = None,
    format_weight: float = 0.0,
    length: int | None = None,
    max_len: int | None = None,
    cache_len: int | None = None,
    mean_nll: float | None = None,
    ppl_threshold: float | None = None,
    ppl_window: float | None = None,
) -> tuple[float, dict[str, float]]:
    """Reward of one completion and its components; the reward is the sum of the terms
    correct + format + integer + xml_count + overlong + ppl.

    components: "correct" (`correct` or `wrong`, DAPO eq. 7), "accuracy" (1.0 / 0.0),
    "format" (format_weight * format_ok), "format_ok" (1.0 / 0.0), with format_style "xml" also
    "integer" (format_weight * an integer answer) and "xml_count" (see `xml_terms`), "overlong"
    (DAPO eq. 13), "ppl" (this project's perplexity penalty). Terms that are off are 0.0. The XML
    recipe for GSM8K is format_style "xml", format_weight 0.5, correct 2.0, wrong 0.0.
    The overlong term is on when max_len or cache_len is given (then length, max_len and cache_len
    are all required); the perplexity term when ppl_threshold or ppl_window is given (then
    mean_nll, ppl_threshold and ppl_window are required). Bad arguments raise ValueError; the
    response text never makes this raise.
    """
    style = _format_style(format_style) if format_style is not None else None
    r_correct, r_wrong = _finite("correct", correct), _finite("wrong", wrong)
    w_format = _finite("format_weight", format_weight)
    use_overlong = max_len is not None or cache_len is not None
    if use_overlong:
        missing = [n for n, v in (("length", length), ("max_len", max_len), ("cache_len", cache_len))
                   if v is None]
        if missing:
            raise ValueError(f"the overlong penalty needs {', '.join(missing)}")
    use_ppl = ppl_threshold is not None or ppl_window is not None
    if use_ppl:
        missing = [n for n, v in (("mean_nll", mean_nll), ("ppl_threshold", ppl_threshold),
                                  ("ppl_window", ppl_window)) if v is None]
        if missing:
            raise ValueError(f"the perplexity penalty needs {', '.join(missing)}")

    ok = is_correct(response, truth)
    # DAPO eq. 7: R(y_hat, y) = 1 if is_equivalent(y_hat, y) else -1
    c = {"correct": r_correct if ok else r_wrong, "accuracy": 1.0 if ok else 0.0,
         "format": 0.0, "format_ok": 0.0, "integer": 0.0, "xml_count": 0.0, "overlong": 0.0,
         "ppl": 0.0}
    if style is not None:
        c["format_ok"] = format_reward(response, style)
        c["format"] = w_format * c["format_ok"]
    if style == "xml":
        terms = xml_terms(response)
        c["integer"], c["xml_count"] = w_format * terms["integer"], terms["xml_count"]
    if use_overlong:
        c["overlong"] = overlong_penalty(length, max_len, cache_len)
    if use_ppl:
        c["ppl"] = perplexity_penalty(mean_nll, ppl_threshold, ppl_window)
    total = c["correct"] + c["format"] + c["integer"] + c["xml_count"] + c["overlong"] + c["ppl"]
    return total, c
