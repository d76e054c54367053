"""Tests of the repo's layout: what sits where, which way the imports point, and which functions
can be copied out alone.

    python -m pytest tests/test_layout.py -q

The root holds the eight card files a reader copies from; the rest sits in packages that say in
their __init__.py what they hold. Imports form no cycle, and of the card files only the entry
points (train.py, eval.py) reach into run/. The card's core functions are run from a copy of
their files alone, away from the repo. (That losses.py and dapo.py import only torch and the
standard library is tests/test_losses.py's test_modules_import_only_torch_and_the_standard_library.)
"""

import ast
import functools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CARDS = {"train", "dapo", "losses", "rewards", "rollout", "model", "data", "eval"}
ENTRY_POINTS = {"train", "eval"}  # the card files that may import run/
PACKAGES = ("engine", "variants", "tasks", "run")

# ---------------------------------------------------------------------------------------------
# What sits where


def test_root_holds_the_eight_card_files():
    """A new module at the root would blur the card; it belongs in a package."""
    assert {p.stem for p in ROOT.glob("*.py")} == CARDS


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_says_what_it_holds(package):
    """Each package opens with a docstring: the reader's map of the folder."""
    init = ROOT / package / "__init__.py"
    assert init.is_file(), f"{package}/ has no __init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{package}/__init__.py has no docstring"


# ---------------------------------------------------------------------------------------------
# The import graph of the repo's own modules


def own_modules() -> dict[str, Path]:
    """{dotted name: file} of every .py at the root and in the packages ("engine" for
    engine/__init__.py)."""
    files = [*ROOT.glob("*.py"), *(f for p in PACKAGES for f in (ROOT / p).glob("*.py"))]
    return {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
            for f in files}


def _own(dotted: str, modules) -> str | None:
    """The longest prefix of `dotted` that is one of our modules, or None (torch, math, ...):
    "tasks.verify.extract_answer" -> "tasks.verify", "run.launch" -> "run.launch"."""
    parts = dotted.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                 if ".".join(parts[:n]) in modules), None)


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """{module: {own module it imports: line of the first such import}}. Imports at any depth
    count: a lazy one inside a function still closes a cycle when it runs."""
    modules = own_modules()
    graph = {}
    for name, path in modules.items():
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from .x import y: relative to this module's package
                    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    base = ".".join(filter(None, [package, base]))
                # from pkg import mod is the module pkg.mod when pkg/mod.py exists
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in filter(None, (_own(t, modules) for t in targets)):
                if target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return graph


def _cycle_back(graph, start: str) -> list[str] | None:
    """The shortest chain of imports from `start` back to itself, [start, ..., start], or None
    (breadth-first)."""
    paths, queue = {}, [start]
    for module in queue:
        for target in sorted(graph[module]):
            if target == start:
                return [start, *paths.get(module, []), start]
            if target not in paths:
                paths[target] = [*paths.get(module, []), target]
                queue.append(target)
    return None


def import_cycles(graph) -> list[list[str]]:
    """Each import cycle once, as [a, b, ..., a]: for every module, the shortest chain of imports
    back to it; chains over the same modules count once."""
    cycles = {}
    for module in sorted(graph):
        cycle = _cycle_back(graph, module)
        if cycle:
            cycles.setdefault(frozenset(cycle), cycle)
    return list(cycles.values())


def _describe(cycle: list[str], graph) -> str:
    """ "a -> b -> a (a.py:12, b.py:40)": the chain and where each import is written."""
    files = own_modules()
    where = [f"{files[a].relative_to(ROOT)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return f"{' -> '.join(cycle)} ({', '.join(where)})"


def test_the_cycle_finder_on_a_made_up_graph():
    """The finder itself: two cycles found and named once each, a chain without one left alone."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"f": 1},
             "f": {"e": 1}, "g": {"a": 1}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    """No chain of imports, lazy ones included, leads a module back to itself: a cycle makes the
    files impossible to read (or copy) in order, and breaks at import time when the order
    changes."""
    graph = import_graph()
    cycles = [_describe(cycle, graph) for cycle in import_cycles(graph)]
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_card_files_import_run_only_from_the_entry_points():
    """The card's library files (dapo, losses, rewards, rollout, model, data) stand without a
    run's machinery; only train.py and eval.py, which start runs, import run/."""
    graph = import_graph()
    files = own_modules()
    offending = [f"{files[card].name}:{line} imports {target}"
                 for card in sorted(CARDS - ENTRY_POINTS)
                 for target, line in graph[card].items()
                 if target == "run" or target.startswith("run.")]
    assert not offending, "card files importing run/:\n  " + "\n  ".join(offending)


# ---------------------------------------------------------------------------------------------
# Copy-ability: each function run from a copy of only the files it names, away from the repo

COPIES = {  # what is copied: (its files, checks of its functions on hand-computed vectors)
    "dapo.py": (["dapo.py"], r"""
        import dapo
        # group_advantages, rewards 1, -1, -1, -1: mean -0.5, unbiased std sqrt(3 / 3) = 1: A = r + 0.5
        A = dapo.group_advantages([1.0, -1.0, -1.0, -1.0], group_size=4).tolist()
        assert all(abs(a - e) < 1e-5 for a, e in zip(A, [1.5, -0.5, -0.5, -0.5])), A
    """),
    "losses.py": (["losses.py"], r"""
        import torch, losses
        # policy_loss: loss_t = -min(r A, clip(r, 1 - 0.2, 1 + 0.28) A); with A = +1 the clip binds
        # above 1.28 only
        ratio = torch.tensor([[0.5, 0.9, 1.0, 1.2, 1.5, 5.0]], dtype=torch.float64)
        old, mask, A = torch.zeros_like(ratio), torch.ones_like(ratio), torch.ones(1, dtype=torch.float64)
        expected = [-0.5, -0.9, -1.0, -1.2, -1.28, -1.28]
        per_token, _ = losses.policy_loss(ratio.log(), old, A, mask, eps_low=0.2, eps_high=0.28, agg="none")
        assert all(abs(a - e) < 1e-12 for a, e in zip(per_token[0].tolist(), expected)), per_token
        mean, _ = losses.policy_loss(ratio.log(), old, A, mask, eps_low=0.2, eps_high=0.28)
        assert abs(mean.item() - (-6.16 / 6)) < 1e-12, mean  # token-mean: the sum over 6 tokens

        # micro_batch_divisors: the counts of the whole mini-batch, in each micro-batch's divisors
        a = torch.tensor([[1, 1, 0], [1, 0, 0]])  # 3 tokens in 2 rows
        b = torch.tensor([[1, 1, 1, 1]])          # 4 tokens in 1 row
        divisors = losses.micro_batch_divisors([a, b])
        assert [int(d["num_tokens"]) for d in divisors] == [7, 7], divisors
        assert [int(d["num_seqs"]) for d in divisors] == [3, 3], divisors
        # a loss of 1 per token: each micro-batch's token-mean over 7, summing to the mean, 1
        total = sum(losses.aggregate(torch.ones(m.shape), m, **d) for m, d in zip([a, b], divisors))
        assert abs(total.item() - 1.0) < 1e-6, total
    """),
    "rewards.py": (["rewards.py", "tasks/__init__.py", "tasks/verify.py"], r"""
        import rewards
        # overlong_penalty, L_max 20, L_cache 5: 0 up to 15 tokens, then (15 - L) / 5, -1 from 20 on
        got = [rewards.overlong_penalty(L, 20, 5) for L in (15, 16, 18, 20)]
        assert all(abs(g - e) < 1e-12 for g, e in zip(got, [0.0, -0.2, -0.6, -1.0])), got
        # rule_reward: eq. 7
        assert rewards.rule_reward("6 * 7 = 42.\nAnswer: 42", "42") == 1.0
        assert rewards.rule_reward("6 * 7 = 41.\nAnswer: 41", "42") == -1.0
    """),
}

# Run in the copy under -I (no PYTHON* variables, no user site, not even the script's folder on
# sys.path), then with the copy's folder put first by hand.
_PRELUDE = """
import os, sys
here = os.getcwd()
sys.path.insert(0, here)
"""
_AFTERWARDS = """
repo = {root!r}
assert not any(os.path.realpath(p or ".") in (repo, os.path.join(repo, "recipes")) for p in sys.path), sys.path
for name in {names!r}:
    assert sys.modules[name].__file__.startswith(here + os.sep), (name, sys.modules[name].__file__)
"""


@pytest.mark.parametrize("copied", COPIES)
def test_copied_alone_it_runs(copied, tmp_path):
    """The card's functions dapo.group_advantages, losses.policy_loss,
    losses.micro_batch_divisors, rewards.overlong_penalty and rewards.rule_reward copy out with
    only the files named here (a new import of anything else breaks the copy) and give the
    hand-computed values there."""
    files, check = COPIES[copied]
    for name in files:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    modules = [".".join(Path(f).with_suffix("").parts).removesuffix(".__init__") for f in files]
    code = _PRELUDE + textwrap.dedent(check) + _AFTERWARDS.format(root=str(ROOT), names=modules)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"a copy of {files}:\n{proc.stderr[-3000:]}"


# ---------------------------------------------------------------------------------------------
# The README's map


def test_the_readme_map_names_what_is_there():
    """The README teaches in at most 450 lines, none over 120 characters and no table cell over
    200, and its annotated tree names only files and folders that exist, every module among
    them (a file moved or added without the map following fails here)."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 450, len(lines)
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    cells = [cell for line in lines if line.startswith("|") for cell in line.split("|")]
    assert max(map(len, cells)) <= 200, max(cells, key=len)
    tree = text.split("```text\n", 1)[1].split("```", 1)[0]
    named, folder = set(), ""
    for line in tree.splitlines():
        if line.startswith(" " * 6) or not line.strip():
            continue  # a comment's second line
        names = line.strip().split("  ")[0].replace(",", " ").split()  # before the comment
        if not line.startswith(" "):  # a root entry, or a folder whose files follow indented
            folder = names[0] if names[0].endswith("/") else ""
            named |= {n for n in names if n.endswith(".py")}
        else:
            named |= {folder + n for n in names if n.endswith(".py")}
    assert all((ROOT / name).exists() for name in named), sorted(n for n in named if not (ROOT / n).exists())
    modules = {str(f.relative_to(ROOT)) for p in PACKAGES for f in (ROOT / p).glob("*.py")
               if f.name != "__init__.py"} | {f"{c}.py" for c in CARDS}
    assert modules <= named, sorted(modules - named)
