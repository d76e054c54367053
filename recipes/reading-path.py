"""The reading path of one training step: every function and method that one step of the
default run calls, in the files a reader follows (the model core, the sampler, the rewards, the
losses, dapo.py and refills.py, train.py), with its lines; the files beside them (the sampler's
engine, the chunked log-prob kernel, data, answer checking, ...) are listed apart.

    python recipes/reading-path.py            # one step of `python train.py`, traced
    python recipes/reading-path.py --list     # and every function, with its lines

A function counts whole (decorators and docstring included) once, however often it runs; a
class counts its lines outside its methods (fields, docstring) once any of it runs.
"""

import ast
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PATH_FILES = ("train.py", "model.py", "rollout.py", "rewards.py", "losses.py", "dapo.py",
              "variants/refills.py")


def definitions(path):
    """-> {(first line, last line): (name, kind)} for the file's functions, methods and classes."""
    tree = ast.parse(open(path).read())
    spans = {}
    for node in tree.body:
        nodes = [node] + (node.body if isinstance(node, ast.ClassDef) else [])
        for inner in nodes:
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([inner.lineno] + [d.lineno for d in inner.decorator_list])
                spans[(first, inner.end_lineno)] = (inner.name, type(inner).__name__)
    return spans


def own_lines(span, spans):
    """A class's lines outside its methods; a function's lines."""
    first, last = span
    inside = [s for s in spans if s != span and first <= s[0] and s[1] <= last]
    return last - first + 1 - sum(s[1] - s[0] + 1 for s in inside)


def ours(filename):
    return filename.startswith(ROOT + os.sep) and not any(
        part in filename for part in ("/tests/", "/.venv/", "site-packages"))


def trace_one_step():
    """The (file, first line of the code) of every call made inside one train_step."""
    import train
    seen, step = set(), train.train_step

    def profile(frame, event, _):
        if event == "call":
            code = frame.f_code
            if ours(code.co_filename):
                seen.add((os.path.relpath(code.co_filename, ROOT), code.co_firstlineno))
            elif code.co_name == "__init__" and "self" in frame.f_locals:  # a dataclass made
                cls = type(frame.f_locals["self"])
                module = sys.modules.get(cls.__module__)
                if ours(getattr(module, "__file__", None) or ""):
                    seen.add((os.path.relpath(module.__file__, ROOT), cls.__qualname__))

    def traced(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return step(*args, **kwargs)
        finally:
            sys.setprofile(None)

    train.train_step = traced
    with tempfile.TemporaryDirectory() as out:
        # (one held-out problem: the evaluations around the step are not traced)
        train.main(["--steps", "1", "--eval-every", "0", "--eval-limit", "1",
                    "--out", os.path.join(out, "run")])
    return seen


def main():
    seen = trace_one_step()
    used = defaultdict(dict)  # file -> {span: (name, kind)}
    for file in sorted({f for f, _ in seen}):
        spans = definitions(os.path.join(ROOT, file))
        for target in (t for f, t in seen if f == file):
            for span, (name, kind) in spans.items():
                hit = span[0] <= target <= span[1] if isinstance(target, int) else \
                    (kind == "ClassDef" and name == target.split(".")[-1])
                if hit:
                    used[file][span] = (name, kind)
    rows = []
    for file, found in used.items():
        spans = definitions(os.path.join(ROOT, file))
        # the innermost definitions only: a method counts, not its class's whole body
        lines = sum(own_lines(span, spans) if kind == "ClassDef" else span[1] - span[0] + 1
                    for span, (name, kind) in found.items()
                    if kind == "ClassDef" or not any(s != span and s[0] <= span[0] and span[1] <= s[1]
                                                     and found.get(s, ("", ""))[1] != "ClassDef"
                                                     for s in found))
        rows.append((file in PATH_FILES, file, len(found), lines))
        if "--list" in sys.argv:
            for span, (name, kind) in sorted(found.items()):
                print(f"    {file}:{span[0]}-{span[1]} {name}")
    for on_path in (True, False):
        part = [r for r in rows if r[0] == on_path]
        print("the reading path" if on_path else "beside it (called, not on the path)")
        for _, file, count, lines in sorted(part, key=lambda r: -r[3]):
            print(f"  {file:<20} {count:>4} definitions {lines:>6} lines")
        print(f"  {'total':<20} {sum(r[2] for r in part):>4} definitions "
              f"{sum(r[3] for r in part):>6} lines in {len(part)} files")


if __name__ == "__main__":
    main()
