"""The README's two figures, drawn from the code and from a run's logs (needs matplotlib).

    python recipes/figures.py step              # assets/step.png: one training step, read from train.py
    python recipes/figures.py step --print      # the same call tree as text, nothing drawn
    python recipes/figures.py curve RUN_DIR     # assets/default-run.png: a run's learning curve

`step` parses train.py with `ast`: the calls in `train_step` whose line carries a step number in
a comment (`# 1-2`, `# 3`, ...), what each of those functions calls among the project's own
functions (followed through train.py, variants/refills.py and the card's dapo.py, rewards.py and
losses.py; bookkeeping helpers left out), and the `if` (or `x if c else y`) above each call.
Every such condition is evaluated under the `dapo` preset's flags (train.py's defaults, then
dapo.PRESETS["dapo"]), a single-turn task assumed: a call whose condition is false there branches
off DAPO's path and is drawn in grey beside its step, with its condition written as flags; a
condition that depends on the batch keeps the call on the path. The equation beside a function
is the one of the DAPO paper (arXiv 2503.14476) that its own docstring names (in the files read
inside). Run it again when train.py changes and the picture follows.

`curve` reads RUN_DIR/metrics.jsonl (each step's training accuracy at the sampling temperature)
and RUN_DIR/eval.jsonl (held-out pass@1 at step 0, every --eval-every steps and at the end) and
draws both against training minutes (evaluation excluded) and against steps.
"""

import argparse
import ast
import io
import os
import re
import sys
import tokenize
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from run import runs  # noqa: E402 (the run directory's logs, its plotting)

STEP_FILE, STEP_FUNCTION = "train.py", "train_step"
CARD = ("train.py", "dapo.py", "losses.py", "rewards.py", "rollout.py", "model.py", "data.py", "eval.py")
PACKAGES = ("engine", "variants", "tasks", "run")
FOLLOWED = ("train.py", "variants/refills.py", "dapo.py", "rewards.py", "losses.py")  # read inside
DEPTH = 6          # how many calls deep below a numbered call
STEP_MARK = re.compile(r"#\s*(\d+(?:-\d+)?)\s*$")
DAPO_EQUATION = re.compile(r"\beq\. ?(7|9|10|11|12|13)\b")

# Calls that are bookkeeping rather than a concept of the step: left out of the picture (a name
# here that the code no longer has matches nothing).
PLUMBING = {
    "add", "top", "gather", "all_reduce", "reduce_metrics", "replace", "concat", "select",
    "pad_rows", "pack", "accumulating", "autocast", "micro_batch_count", "mini_batches",
    "sampling_options", "reward_options", "shaping_options", "objective_settings",
    "reads_old_logprobs", "token_choices", "update_count", "micro_batch_rows",
    "episode_loss_tokens", "format_prompt", "round_prompts", "peak_memory_mib", "takes_turns",
    "in_turns", "rollout_weight_scale", "user_score", "perplexity_penalty", "format_reward",
    "xml_terms", "whiten", "moments", "sample_sums", "reward_terms", "update_means", "kl_estimate",
    "adaptive_budget", "next_round", "on_group", "extract_answer",
}


# ---- reading the code ---------------------------------------------------------------------------

def module_path(dotted):
    """The project file of a dotted module name, or None (torch, the standard library...)."""
    path = dotted.replace(".", "/") + ".py"
    if path in CARD or (path.split("/")[0] in PACKAGES and os.path.exists(os.path.join(ROOT, path))):
        return path
    return None


class Module:
    """One parsed file: its functions, its tables, and where its imported names come from."""

    def __init__(self, path):
        self.path = path
        with open(os.path.join(ROOT, path)) as f:
            self.source = f.read()
        self.tree = ast.parse(self.source)
        self.functions, self.classes, self.tables = {}, {}, {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.functions[f"{node.name}.{item.name}"] = item
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                    and isinstance(node.targets[0], ast.Name):
                self.tables[node.targets[0].id] = node.value
        self.imports = {}  # local name -> (file, None) for a module, (file, name) for a function
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if module_path(alias.name):
                        self.imports[alias.asname or alias.name] = (module_path(alias.name), None)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if module_path(f"{node.module}.{alias.name}"):
                        self.imports[local] = (module_path(f"{node.module}.{alias.name}"), None)
                    elif module_path(node.module):
                        self.imports[local] = (module_path(node.module), alias.name)


_parsed = {}


def parsed(path):
    if path not in _parsed:
        _parsed[path] = Module(path)
    return _parsed[path]


def resolve(module, func, guards=None):
    """(file, function) that a call's callee names in `module`, or None. A local bound to an
    entry of a module's table of functions (objectives.OBJECTIVES[args.objective]) resolves to
    the entry the preset's flag picks."""
    if isinstance(func, ast.Name):
        if func.id in module.functions:
            return module.path, func.id
        if func.id in module.imports and module.imports[func.id][1]:
            return module.imports[func.id]
        bound = guards.locals.get(func.id) if guards else None
        if isinstance(bound, ast.Subscript) and isinstance(bound.value, ast.Attribute) \
                and isinstance(bound.value.value, ast.Name) and bound.value.value.id in module.imports:
            owner = parsed(module.imports[bound.value.value.id][0])
            table, key = owner.tables.get(bound.value.attr), guards.value(bound.slice)
            for k, v in zip(table.keys, table.values) if table is not None else ():
                if isinstance(k, ast.Constant) and k.value == key:
                    return resolve(owner, v)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = func.value.id
        if owner in module.imports and module.imports[owner][1] is None:
            return module.imports[owner][0], func.attr
        if owner in module.classes:
            return module.path, f"{owner}.{func.attr}"
    return None


def docstring_equation(node):
    """The DAPO equation that a function's docstring names ("eq. 10"), or ""."""
    found = DAPO_EQUATION.search(ast.get_docstring(node) or "") if node is not None else None
    return f"eq. {found.group(1)}" if found else ""


# ---- conditions, under the dapo preset ----------------------------------------------------------

UNKNOWN = object()
# Conditions on the data or the model rather than on a flag: their value on DAPO's own setting
# (a one-turn math task, a dense model), and how the picture names them.
PREDICATES = {"in_turns": (False, "a task in turns"), "takes_turns": (False, "a task in turns"),
              "num_experts": (0, "an MoE model")}


def preset_flags():
    """train.py's flags under --preset dapo: argparse's defaults, then the preset."""
    from run import config
    import dapo
    flags = vars(config.build_parser().parse_args([]))
    flags.update(dapo.PRESETS["dapo"])
    return flags


def truth(value):
    return value if value is UNKNOWN else bool(value)


def is_args(node):
    return isinstance(node, ast.Name) and node.id == "args" or \
        isinstance(node, ast.Attribute) and node.attr == "args"


class Guards:
    """`if` tests in three values (True, False, UNKNOWN) under the preset's flags: `args.X` and
    `run.args.X` read a flag; a function of `args` alone (config.reads_old_logprobs(args)) is
    called; a local name reads its first assignment in the function, a parameter what the caller
    passed (when known) or its default; a predicate of the data or model its value in
    PREDICATES. Anything else is UNKNOWN: it depends on the batch."""

    def __init__(self, flags, module, function, bound=None):
        self.flags, self.module, self.locals = flags, module, {}
        self.bound = dict(bound or {})  # parameter -> (value, as words)
        positional = function.args.args
        for parameter, default in zip(positional[len(positional) - len(function.args.defaults):],
                                      function.args.defaults):
            if isinstance(default, ast.Constant) and parameter.arg not in self.bound:
                self.bound[parameter.arg] = (default.value, parameter.arg, False)
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                pairs = [(target, value)] if isinstance(target, ast.Name) else \
                    zip(target.elts, value.elts) if isinstance(target, ast.Tuple) \
                    and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts) else []
                for t, v in pairs:
                    if isinstance(t, ast.Name):
                        self.locals.setdefault(t.id, v)

    @staticmethod
    def flag(node):
        """The flag that `args.X` or `run.args.X` reads, else None."""
        return node.attr if isinstance(node, ast.Attribute) and is_args(node.value) else None

    def value(self, node, seen=()):
        if self.flag(node) is not None:
            return self.flags.get(self.flag(node), UNKNOWN)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute) and node.attr in PREDICATES:
            return PREDICATES[node.attr][0]
        if isinstance(node, ast.Name):
            if node.id in self.bound:
                return self.bound[node.id][0]
            if node.id in self.locals and node.id not in seen:
                return self.value(self.locals[node.id], seen + (node.id,))
            return UNKNOWN
        if isinstance(node, ast.IfExp):
            test = truth(self.value(node.test, seen))
            return UNKNOWN if test is UNKNOWN else self.value(node.body if test else node.orelse, seen)
        if isinstance(node, ast.Call):
            return self.called(node, seen)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = truth(self.value(node.operand, seen))
            return value if value is UNKNOWN else not value
        if isinstance(node, ast.BoolOp):
            values = [truth(self.value(v, seen)) for v in node.values]
            decisive = isinstance(node.op, ast.Or)  # the value that settles it
            if decisive in values:
                return decisive
            return UNKNOWN if UNKNOWN in values else not decisive
        operations = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                      ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
                      ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
                      ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
                      ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
                      ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
        if isinstance(node, ast.BinOp) or isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right, op = (node.left, node.right, node.op) if isinstance(node, ast.BinOp) \
                else (node.left, node.comparators[0], node.ops[0])
            left, right = self.value(left, seen), self.value(right, seen)
            if left is UNKNOWN or right is UNKNOWN or type(op) not in operations:
                return UNKNOWN
            try:
                return operations[type(op)](left, right)
            except TypeError:
                return UNKNOWN
        return UNKNOWN

    def decide(self, test):
        """A test's value; an `or` of flags that are all off, with the rest unknown, counts as
        false: what runs under it runs for a flag (or for what a flag chose earlier)."""
        value = truth(self.value(test))
        if value is UNKNOWN and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
            parts = [(self.reads_flag(v), truth(self.value(v))) for v in test.values]
            if any(flagged for flagged, _ in parts) and all(v is False for flagged, v in parts if flagged):
                return False
        return value

    def reads_flag(self, node):
        return any(self.flag(n) is not None or isinstance(n, ast.Attribute) and n.attr in PREDICATES
                   for n in ast.walk(node))

    def called(self, node, seen):
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        if name in PREDICATES:
            return PREDICATES[name][0]
        if name in ("any", "all", "bool") and len(node.args) == 1:
            inner = node.args[0].elt if isinstance(node.args[0], ast.GeneratorExp) else node.args[0]
            return truth(self.value(inner, seen))
        target = resolve(self.module, node.func)
        if target and node.args and all(is_args(a) for a in node.args) and not node.keywords:
            try:  # a function of the flags alone: ask it
                import importlib
                module = importlib.import_module(target[0][:-3].replace("/", "."))
                return getattr(module, target[1])(argparse.Namespace(**self.flags))
            except Exception:
                return UNKNOWN
        return UNKNOWN

    # -- a condition as a reader types it: --flags, not args.flags --

    def words(self, node, negate=False):
        flag = self.flag(node)
        if flag is not None:
            typed = "--" + flag.replace("_", "-")
            if not negate:
                return typed
            return "--no-" + typed[2:] if isinstance(self.flags.get(flag), bool) else f"no {typed}"
        if isinstance(node, ast.Attribute) and node.attr in PREDICATES:
            return ("not " if negate else "") + PREDICATES[node.attr][1]
        if isinstance(node, ast.Name) and node.id in self.bound:
            shown = self.bound[node.id][1]
            return f"not {shown}" if negate else shown
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return self.words(node.operand, not negate)
        if isinstance(node, ast.BoolOp):
            joiner = " or " if isinstance(node.op, ast.And) == negate else " and "
            return joiner.join(self.words(v, negate) for v in node.values)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            shown = self.comparison(node, negate)
            if shown:
                return shown
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            inner = node.args[0].elt if node.args and isinstance(node.args[0], ast.GeneratorExp) else None
            shown = PREDICATES[name][1] if name in PREDICATES else self.words(inner) if inner is not None \
                else ast.unparse(node.func) + ("(args)" if node.args and all(is_args(a) for a in node.args)
                                               else "(...)" if node.args else "()")
            return f"not {shown}" if negate else shown
        shown = re.sub(r"\b(?:run\.)?args\.([a-z_]+)", lambda m: "--" + m.group(1).replace("_", "-"),
                       ast.unparse(node))
        return f"not {shown}" if negate else shown

    def comparison(self, node, negate):
        ops = {ast.Eq: "==", ast.NotEq: "!=", ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=",
               ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
        flips = {"==": "!=", "!=": "==", ">": "<=", "<=": ">", "<": ">=", ">=": "<", "is": "is not",
                 "is not": "is", "in": "not in", "not in": "in"}
        op = ops.get(type(node.ops[0]))
        if op is None:
            return ""
        op = flips[op] if negate else op
        left, right = node.left, node.comparators[0]
        if isinstance(left, ast.Name) and left.id in self.bound and self.bound[left.id][2] \
                and isinstance(right, ast.Constant) and right.value is None:
            return self.bound[left.id][1] if (op == "is not") else f"not {self.bound[left.id][1]}"
        bound = self.locals.get(left.id) if isinstance(left, ast.Name) and left.id not in self.bound else None
        # `routing is not None`, routing = X(...) if PREDICATE else None: the predicate itself
        if isinstance(bound, ast.IfExp) and isinstance(bound.orelse, ast.Constant) \
                and bound.orelse.value is None and isinstance(right, ast.Constant) and right.value is None:
            return self.words(bound.test, negate=(op == "is"))
        # a local counted from a flag, rounds = 1 + args.max_refills: the flag itself
        if isinstance(bound, ast.BinOp) and isinstance(bound.op, ast.Add) \
                and isinstance(bound.left, ast.Constant) and self.flag(bound.right) \
                and isinstance(right, ast.Constant) and isinstance(right.value, (int, float)):
            left, right = bound.right, ast.Constant(right.value - bound.left.value)
        named = self.flag(left) or (left.id if isinstance(left, ast.Name) and left.id in self.bound else None)
        if named and isinstance(right, ast.Constant) and op in ("==", "!="):
            return f"{self.words(left)} {'' if op == '==' else 'not '}{right.value}"
        return f"{self.words(left)} {op} {self.words(right)}"


# ---- the call tree ------------------------------------------------------------------------------

@dataclass
class Call:
    module: str               # its file, from the root: "train.py", "variants/refills.py"
    name: str                 # the function (Class.method for a method)
    condition: str = ""       # when it runs, in flags ("" always; what is false, if off the path)
    off_path: bool = False    # its condition is false under the dapo preset
    equation: str = ""        # "eq. 10": the DAPO equation its docstring names
    calls: list = field(default_factory=list)


@dataclass
class Step:
    number: str               # "1-2", "3", ...
    call: Call
    assigned: str             # what the step's line assigns ("collected", "batch", ...)
    argument: str             # what it is handed ("collected.kept", "batch", ...)
    adds: list                # the batch fields its return sets (replace(batch, old_logprobs=...))


def ends_in_exit(statements):
    return bool(statements) and isinstance(statements[-1], (ast.Return, ast.Raise))


def calls_in(function, guards):
    """Every call in `function`, in source order: [(callee node, call node or None, conditions
    above it as [(words, value)], the call it is handed to or None)]. An `else`, and whatever
    follows an `if` that returns, reads as the negated test; a function handed to a call as an
    argument counts as called by that call; nested functions count as inline."""
    out = []

    def block(statements, above):
        for statement in statements:
            visit(statement, above)
            if isinstance(statement, ast.If) and not statement.orelse and ends_in_exit(statement.body):
                value = guards.decide(statement.test)
                above = above + [(guards.words(statement.test, negate=True),
                                  value if value is UNKNOWN else not value)]

    def visit(node, above):
        if isinstance(node, (ast.If, ast.IfExp)):
            visit(node.test, above)
            value = guards.decide(node.test)
            yes = above + [(guards.words(node.test), value)]
            no = above + [(guards.words(node.test, negate=True), value if value is UNKNOWN else not value)]
            if isinstance(node, ast.If):
                block(node.body, yes)
                block(node.orelse, no)
            else:
                visit(node.body, yes)
                visit(node.orelse, no)
            return
        if isinstance(node, ast.Call):
            out.append((node.func, node, above, None))
            out.extend((a, None, above, node.func) for a in list(node.args) + [k.value for k in node.keywords]
                       if isinstance(a, ast.Name))
        for name in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(getattr(node, name, None), list) and not isinstance(node, ast.If):
                block([n for n in getattr(node, name) if isinstance(n, ast.AST)], above)
        for child in ast.iter_child_nodes(node):
            if not (isinstance(child, ast.stmt) or isinstance(child, ast.excepthandler)):
                visit(child, above)

    block(function.body, [])
    return out


def bindings(callee, call, guards):
    """What the call passes for each of the callee's parameters, as the callee's Guards read it:
    {name: (value or UNKNOWN, words, optional)}; `optional`: the value is X-or-None on a
    condition (routing = Routing(...) if an MoE model else None), whose words are then those of
    the condition."""
    if callee is None or call is None:
        return {}
    out = {}
    names = [a.arg for a in callee.args.args]
    for name, node in list(zip(names, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]:
        value = guards.value(node)
        local = guards.locals.get(node.id) if isinstance(node, ast.Name) and node.id not in guards.bound else None
        if isinstance(local, ast.IfExp) and isinstance(local.orelse, ast.Constant) and local.orelse.value is None:
            out[name] = (value, guards.words(local.test), True)
        elif guards.flag(node) or isinstance(node, ast.Constant):
            out[name] = (value, guards.words(node), False)
        elif isinstance(node, ast.Name) and node.id in guards.bound:
            out[name] = guards.bound[node.id]
        else:
            out[name] = (value, name, False)
    return out


def follow(path, name, flags, depth, seen=frozenset(), bound=None):
    """`path`:`name` as a Call, with what it calls `depth` levels down."""
    module = parsed(path)
    node = module.functions.get(name)
    call = Call(path, name, equation=docstring_equation(node) if path in FOLLOWED else "")
    if node is None or depth == 0 or (path, name) in seen:
        return call
    guards, listed = Guards(flags, module, node, bound), {}
    for func, site, above, receiver in calls_in(node, guards):
        if isinstance(func, ast.Name) and func.id not in module.functions \
                and func.id not in module.imports and func.id not in guards.locals:
            continue
        target = resolve(module, func, guards)
        if target is None or target == (path, name):
            continue
        short = target[1].split(".")[-1]
        if short in PLUMBING or short.startswith("_") or target[1] not in parsed(target[0]).functions:
            continue
        handed_to = resolve(module, receiver, guards) if receiver is not None else None
        parent = listed.get(handed_to, call) if handed_to else call
        if target in listed and parent is call or any(c.name == target[1] and c.module == target[0]
                                                      for c in parent.calls):
            continue
        child = follow(*target, flags, depth - 1 if target[0] in FOLLOWED else 0, seen | {(path, name)},
                       bindings(parsed(target[0]).functions.get(target[1]), site, guards))
        if parent is not call:  # handed to `parent`: runs when and where it does
            above = []
        child.off_path = any(value is False for _, value in above)
        # off the path: what is false under the preset; on it: what depends on the batch
        child.condition = " and ".join(text for text, value in above
                                       if value is (False if child.off_path else UNKNOWN))
        if parent is call:
            listed[target] = child
        parent.calls.append(child)
    return call


def names_a_condition(text):
    """Whether an off-path condition is a flag's or a predicate's (else it only says that a
    parameter's default is off, as in a helper called for another purpose)."""
    return "--" in text or "(args)" in text or any(label in text for _, label in PREDICATES.values())


def step_tree(flags):
    """train_step's numbered calls, each followed down."""
    module = parsed(STEP_FILE)
    function = module.functions[STEP_FUNCTION]
    marks = {token.start[0]: STEP_MARK.search(token.string).group(1)
             for token in tokenize.generate_tokens(io.StringIO(module.source).readline)
             if token.type == tokenize.COMMENT and STEP_MARK.search(token.string)}
    steps = []
    for statement in ast.walk(function):
        if not isinstance(statement, (ast.Assign, ast.Expr)) or not isinstance(statement.value, ast.Call):
            continue
        node = statement.value
        number = next((marks[line] for line in range(node.lineno, node.end_lineno + 1) if line in marks), None)
        target = resolve(module, node.func)
        if number is None or target is None:
            continue
        assigned = ast.unparse(statement.targets[0]) if isinstance(statement, ast.Assign) else ""
        argument = ", ".join(ast.unparse(a) for a in node.args
                             if not (isinstance(a, ast.Name) and a.id in ("run", "progress")))
        steps.append(Step(number, follow(*target, flags, DEPTH), assigned, argument,
                          replaced_fields(parsed(target[0]).functions.get(target[1]))))
    return sorted(steps, key=lambda s: int(s.number.split("-")[0]))


def replaced_fields(function):
    """The fields a function's `return replace(batch, FIELD=...)` sets."""
    fields = []
    for node in ast.walk(function) if function is not None else ():
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "replace":
            fields += [k.arg for k in node.value.keywords if k.arg not in fields]
    return fields


def batch_type(path, name="Rollouts"):
    """The step's batch class, if `path` (train.py) still defines it."""
    return name if name in parsed(path).classes else "the batch"


def print_tree(steps):
    def show(call, indent):
        note = f"  [off the path: {call.condition}]" if call.off_path else \
            f"  [if {call.condition}]" if call.condition else ""
        print(f"{' ' * indent}{call.module}:{call.name}  {call.equation}{note}".rstrip())
        for child in call.calls:
            show(child, indent + 4)
    for step in steps:
        print(f"{step.number}: {step.assigned or '-'} = ({step.argument}); sets {step.adds or '-'}")
        show(step.call, 4)


# ---- drawing the step ---------------------------------------------------------------------------

def path_lines(call, depth=0, shown=None):
    """The on-path calls below `call` as [(depth, Call)], each function once a step."""
    shown = set() if shown is None else shown
    out = []
    for child in call.calls:
        if child.off_path or (child.module, child.name) in shown:
            continue
        shown.add((child.module, child.name))
        out.append((depth, child))
        out += path_lines(child, depth + 1, shown)
    return out


def off_calls(call):
    """The calls below `call` whose own condition is false (not looking inside them)."""
    out = []
    for child in call.calls:
        if child.off_path:
            out.append(child)
        else:
            out += off_calls(child)
    return out


def branches(call):
    """Where the step leaves the path: [(depth, Call)], a branch off the path at depth 0 and,
    at depth 1, the branches inside it; each function once, a condition that names no flag
    (a helper's parameter left at its default) left out."""
    top = [c for c in off_calls(call) if names_a_condition(c.condition)]
    shown, out = set(), []
    for c in top:
        shown.add((c.module, c.name))
    for c in top:
        if (c.module, c.name, 0) in shown:
            continue
        shown.add((c.module, c.name, 0))
        out.append((0, c))
        for inner in off_calls(c):
            key = (inner.module, inner.name)
            if key not in shown and names_a_condition(inner.condition):
                shown.add(key)
                out.append((1, inner))
    return out


# The step picture's layout, in inches unless named otherwise.
MONO = "DejaVu Sans Mono"
SIZE = 10.5                                  # points: the calls' monospaced text
LINE, PAD, INDENT = 0.32, 0.18, 0.28         # a text line, a box's margin, one level
CHAR = SIZE / 72 * 0.602                     # a monospaced character
MAIN_X, MAIN_W = 0.25, 5.6                   # the blue boxes: a step's path
SIDE_X, SIDE_W = MAIN_X + MAIN_W + 0.6, 6.4  # the grey boxes: its branches off the path
GAP = 0.55                                   # between two steps: the arrow and its label
HEADER, FOOTER = 1.25, 0.45
BLUE, INK, GREY, GREY_INK, GREY_FILL = "#2f5f98", "#15212e", "#8c8c8c", "#5c5c5c", "#f2f2f2"
DASHED = (0, (4, 3))


@dataclass(frozen=True)
class Band:
    """One step's strip of the picture: its blue box's lines, its grey box's rows, their heights."""
    step: object
    lines: list      # [(depth, Call)]: the on-path calls
    entries: list    # [(depth, name, condition, together)]: the branches off it
    height: float    # the taller of the two boxes
    main_h: float
    side_h: float    # 0 without branches


def side_entries(call):
    """The grey box's rows for `call`: (depth, name, condition, whether both fit on one line)."""
    entries = []
    for depth, inner in branches(call):
        name = f"{inner.module}:{inner.name}"
        condition = f"if {inner.condition}"
        room = (SIDE_W - 2 * PAD - depth * INDENT) / CHAR
        # the condition in italic sans: a character about 0.55 of its size wide
        together = (len(name) + 2) * CHAR + len(condition) * (SIZE - 0.5) / 72 * 0.55 <= room * CHAR
        entries.append((depth, name, condition if together else shorten(condition, int(room - 2)),
                        together))
    return entries


def measure_band(step):
    """The step's band: what its two boxes hold and how tall each is."""
    lines = path_lines(step.call)
    entries = side_entries(step.call)
    main_h = (1 + len(lines)) * LINE + 2 * PAD
    side_h = sum(1 if together else 2 for *_, together in entries) * LINE + 2 * PAD if entries else 0
    return Band(step, lines, entries, max(main_h, side_h), main_h, side_h)


def draw_header(ax, steps, batch):
    """The title and the two lines saying what blue and grey mean."""
    ax.text(MAIN_X, 0.36, f"One training step: {STEP_FILE}'s {STEP_FUNCTION}, its {len(steps)} numbered "
            f"calls, one {batch} batch", fontsize=14, weight="bold", va="center", color=INK)
    ax.text(MAIN_X, 0.7, "blue: the path of --preset dapo, each function once; eq. N: the DAPO paper's "
            "equation (arXiv 2503.14476) that the function's docstring names", fontsize=10,
            va="center", color=BLUE)
    ax.text(MAIN_X, 0.98, "grey: where a flag, a task in turns or an MoE model leaves that path, "
            "with the condition the code tests", fontsize=10, va="center", color=GREY_INK, style="italic")


def draw_main_box(ax, step, lines, top, height):
    """The step's blue box at `top`: its number, its call and the on-path calls below it."""
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((MAIN_X, top), MAIN_W, height,
                                boxstyle="round,pad=0,rounding_size=0.1", facecolor="#e8f0fa",
                                edgecolor=BLUE, linewidth=1.5))
    first = top + PAD + LINE / 2
    ax.text(MAIN_X + PAD, first, step.number, fontsize=13, weight="bold", color=BLUE, va="center")
    text_x = MAIN_X + PAD + 0.5
    ax.text(text_x, first, f"{step.call.module}:{step.call.name}", fontsize=SIZE + 1, weight="bold",
            family=MONO, color=INK, va="center")
    if step.call.equation:
        ax.text(MAIN_X + MAIN_W - PAD, first, step.call.equation, fontsize=SIZE, color=BLUE,
                weight="bold", va="center", ha="right")
    for k, (depth, call) in enumerate(lines):
        row_y = first + (k + 1) * LINE
        ax.text(text_x + INDENT * depth, row_y, f"\u2192 {call.module}:{call.name}", fontsize=SIZE,
                family=MONO, color=INK, va="center")
        if call.equation:
            ax.text(MAIN_X + MAIN_W - PAD, row_y, call.equation, fontsize=SIZE, color=BLUE,
                    weight="bold", va="center", ha="right")


def draw_side_box(ax, entries, top, height, main_middle):
    """The step's grey box of branches at `top`, dashed, an arrow to it from `main_middle`."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    ax.add_patch(FancyBboxPatch((SIDE_X, top), SIDE_W, height,
                                boxstyle="round,pad=0,rounding_size=0.1", facecolor=GREY_FILL,
                                edgecolor=GREY, linewidth=1.0, linestyle=DASHED))
    ax.add_patch(FancyArrowPatch(main_middle, (SIDE_X, top + height / 2), arrowstyle="-|>",
                                 mutation_scale=12, color=GREY, lw=1.0, linestyle=DASHED))
    row_y = top + PAD + LINE / 2
    for depth, name, condition, together in entries:
        x = SIDE_X + PAD + depth * INDENT
        shown = ("\u2192 " if depth else "") + name
        ax.text(x, row_y, shown, fontsize=SIZE, family=MONO, color=GREY_INK, va="center")
        if together:
            ax.text(x + (len(shown) + 2) * CHAR, row_y, condition, fontsize=SIZE - 0.5, color=GREY,
                    style="italic", va="center")
        else:
            row_y += LINE
            ax.text(x + 0.3, row_y, condition, fontsize=SIZE - 0.5, color=GREY, style="italic",
                    va="center")
        row_y += LINE


def draw_band(ax, band, y):
    """Draws the band at `y`: its blue box and any grey box, each centred; returns the blue box's top."""
    top = y + (band.height - band.main_h) / 2
    draw_main_box(ax, band.step, band.lines, top, band.main_h)
    if band.entries:
        draw_side_box(ax, band.entries, y + (band.height - band.side_h) / 2, band.side_h,
                      (MAIN_X + MAIN_W, top + band.main_h / 2))
    return top


def draw_flow_arrow(ax, start, end, label):
    """The blue arrow down from one step's box to the next's, with what it carries."""
    from matplotlib.patches import FancyArrowPatch
    x = MAIN_X + 0.9
    ax.add_patch(FancyArrowPatch((x, start), (x, end), arrowstyle="-|>", mutation_scale=16,
                                 color=BLUE, lw=1.8))
    ax.text(x + 0.18, (start + end) / 2, label, fontsize=SIZE + 0.5, color=BLUE, style="italic",
            va="center")


def draw_step(steps, out):
    """The picture of one training step: a band a numbered call, arrows between them, to `out`."""
    pyplot = runs._pyplot()
    batch = batch_type(STEP_FILE)
    bands = [measure_band(step) for step in steps]
    height = HEADER + FOOTER + sum(b.height for b in bands) + GAP * (len(bands) - 1)
    width = SIDE_X + SIDE_W + 0.25
    fig = pyplot.figure(figsize=(width, height))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    draw_header(ax, steps, batch)
    y = HEADER
    for band, following in zip(bands, bands[1:] + [None]):
        top = draw_band(ax, band, y)
        y += band.height
        if following is not None:
            draw_flow_arrow(ax, top + band.main_h, y + GAP + (following.height - following.main_h) / 2,
                            flow_label(band.step, following.step, batch))
            y += GAP
    ax.text(MAIN_X, height - FOOTER / 2, f"python recipes/figures.py step: read from {STEP_FILE} "
            f"(a numbered call: a '# N' comment in {STEP_FUNCTION}) and the files it calls, under "
            "dapo.PRESETS['dapo']", fontsize=9, color="#6a6a6a", va="center")
    fig.savefig(out, dpi=130)
    pyplot.close(fig)
    print(out)


def flow_label(step, following, batch):
    """What the arrow from `step` to `following` carries."""
    handed = following.argument.split(",")[0].strip() if following.argument else step.assigned
    if step.adds:
        return f"{handed}: {batch} + {', '.join(step.adds)}"
    if handed.endswith(".kept"):
        return f"{handed}: {batch}, the groups kept"
    return step.assigned.strip("()")


def shorten(text, width):
    return text if len(text) <= width else text[:width - 1] + "\u2026"


# ---- the learning curve -------------------------------------------------------------------------

def draw_curve(run_dir, out):
    metrics = runs.read_lines(os.path.join(run_dir, "metrics.jsonl"))
    evals = runs.read_lines(os.path.join(run_dir, "eval.jsonl"))
    if not metrics or not evals:
        sys.exit(f"figures.py: {run_dir} needs metrics.jsonl and eval.jsonl, each with a readable line")
    pyplot = runs._pyplot()
    evals = sorted(evals, key=lambda e: e["step"])
    fig, axes = pyplot.subplots(1, 2, figsize=(12, 4.3), sharey=True)
    problems = evals[-1].get("n")
    held_out = f"held-out pass@1 ({problems} problems)" if problems else "held-out pass@1"
    for ax, (x_key, x_label, scale) in zip(axes, [("train_seconds", "training minutes (evaluation excluded)", 60),
                                                  ("step", "training step", 1)]):
        ax.plot([m[x_key] / scale for m in metrics], [m["accuracy"] for m in metrics], ".",
                color="#6b9bd1", alpha=0.75, label="training accuracy (the step's samples)")
        ax.plot([e[x_key] / scale for e in evals], [e["pass@1"] for e in evals], "o-",
                color="#e07b00", lw=2, label=held_out)
        levels = [(m[x_key] / scale, m["level"]) for m in metrics if m.get("level") is not None]
        for (_, before), (x, after) in zip(levels, levels[1:]):
            if after != before:  # the arithmetic task's curriculum doubled its operands
                ax.axvline(x, color="#999999", lw=0.8, ls=":")
                ax.text(x, 1.0, f"curriculum level {after} ", fontsize=8, color="#777777", rotation=90,
                        va="top", ha="right")
        for e in (evals[0], evals[-1]):
            ax.annotate(f"{e['pass@1']:.1%}", (e[x_key] / scale, e["pass@1"]), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize=9, color="#b35f00")
        ax.set_xlabel(x_label)
        ax.set_ylim(0, 1.02)
        right = max([m[x_key] / scale for m in metrics] + [e[x_key] / scale for e in evals])
        ax.set_xlim(-0.03 * right, 1.04 * right)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="lower right", fontsize=9)
    first, last = evals[0], evals[-1]
    fig.suptitle(f"{os.path.basename(os.path.normpath(run_dir))}: held-out pass@1 "
                 f"{first['pass@1']:.1%} \u2192 {last['pass@1']:.1%} in {last['train_seconds'] / 60:.1f} "
                 f"training minutes, {last['step']} steps", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="figures.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="figure", required=True)
    step = sub.add_parser("step", help="assets/step.png: one training step, from train.py")
    step.add_argument("--out", default=os.path.join(ROOT, "assets", "step.png"))
    step.add_argument("--print", action="store_true", help="the call tree as text, nothing drawn")
    curve = sub.add_parser("curve", help="assets/default-run.png: a run's learning curve")
    curve.add_argument("run_dir")
    curve.add_argument("--out", default=os.path.join(ROOT, "assets", "default-run.png"))
    args = parser.parse_args(argv)
    if args.figure == "step":
        steps = step_tree(preset_flags())
        return print_tree(steps) if args.print else draw_step(steps, args.out)
    return draw_curve(args.run_dir, args.out)


if __name__ == "__main__":
    main()
