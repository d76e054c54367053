"""Benchmark: verify.is_correct against math-verify on the judged table (tests/answer_cases.py).

    python tests/bench_answers.py            # needs `pip install math-verify` for its columns

For each verifier: false negatives (a right answer rejected), false positives (a wrong answer
accepted) and the mean time per call, overall and by form. math-verify runs twice: on the full
response (its own extraction) and on the answer our extraction found, so that its equivalence is
judged apart from its extraction. It is an optional extra for this script only: verify.py never
imports it. Not collected by pytest (the name does not start with test_).
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from answer_cases import GROUPS  # noqa: E402
from tasks import verify  # noqa: E402


def _math_verify():
    """math-verify's check as a function (response, truth) -> bool, or None if not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None, None

    def check(response: str, truth: str) -> bool:
        try:
            return bool(verify(parse(f"${truth}$"), parse(response)))
        except Exception:  # a verifier that raises counts as a rejection
            return False

    def check_extracted(response: str, truth: str) -> bool:
        answer = verify.extract_answer(response)
        return answer is not None and check(f"${answer}$", truth)

    return check, check_extracted


def _score(check, cases) -> tuple[int, int, float]:
    """(false negatives, false positives, seconds per call) of `check` on `cases`."""
    fn = fp = 0
    start = time.perf_counter()
    for response, truth, verdict, _ in cases:
        got = check(response, truth)
        fn += verdict and not got
        fp += got and not verdict
    return fn, fp, (time.perf_counter() - start) / len(cases)


def main() -> None:
    cases = [c for group in GROUPS.values() for c in group]
    verifiers = {"verify.is_correct": verify.is_correct}
    check, check_extracted = _math_verify()
    if check is None:
        print("math-verify is not installed (pip install math-verify): only verify.py is measured\n")
    else:
        check("Answer: $1$", "1")  # warm-up: math-verify imports sympy and builds its grammar lazily
        verifiers["math-verify (full response)"] = check
        verifiers["math-verify (our extraction)"] = check_extracted
    must_match = sum(c[2] for c in cases)
    print(f"{len(cases)} judged cases: {must_match} must match, {len(cases) - must_match} must not\n")
    print(f"{'verifier':32s} {'FN':>4s} {'FP':>4s} {'time per call':>14s}")
    for name, fn in verifiers.items():
        n_fn, n_fp, per_call = _score(fn, cases)
        print(f"{name:32s} {n_fn:4d} {n_fp:4d} {per_call * 1e3:11.3f} ms")
    print(f"\nby form (FN/FP): {'  '.join(f'{n[:12]:>12s}' for n in verifiers)}")
    for form, group in GROUPS.items():
        cells = []
        for fn in verifiers.values():
            n_fn, n_fp, _ = _score(fn, group)
            cells.append(f"{n_fn:>5d}/{n_fp:<6d}")
        print(f"{form:14s} ({len(group):3d}) " + "  ".join(cells))
    if check is not None:
        print("\nmath-verify's misses (verdict, response's answer, truth):")
        for response, truth, verdict, why in cases:
            if check(response, truth) != verdict:
                print(f"  {'FN' if verdict else 'FP'}  {verify.extract_answer(response)!r:40.40s} {truth!r:30.30s} {why}")


if __name__ == "__main__":
    main()
