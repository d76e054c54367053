"""Tools a model can call inside an episode (episodes.py): a calculator, and Python in a sandbox.

    python train.py --data arithmetic:digits=3,ops=* --tools calculator

A reply that writes a call, <calc>123 * 456</calc> or <python>print(2 ** 10)</python>, is cut
right after it (`cut_at_call`); the tool's output follows as <result>56088</result>, and the
model goes on in the next turn from the whole transcript. The output sits in that turn's prompt,
so the loss never sees it: only the model's own tokens are trained on, and every turn of the
episode gets its outcome's reward. A tool that fails answers with text ("error: ..."), never an
exception.

The calculator is verify.py's own arithmetic (numbers, + - * / and parentheses; never eval). The
Python sandbox runs the code in a fresh interpreter (`python -I`) in a temporary folder, with
limits: CPU seconds and wall seconds, memory (address space), file size, output characters, and
an audit hook (PEP 578) that refuses sockets, new processes, native code (ctypes) and any file
written outside that folder. It guards against a model's mistakes, not against an adversary (a
container is the tool for that); a platform without those limits (no `resource` module) refuses
`--tools python` by name.
"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

from tasks.verify import arithmetic_value

TAGS = {"calculator": "calc", "python": "python"}   # --tools name: the tag a call is written in
INSTRUCTIONS = {
    "calculator": "You have a calculator: write an expression between <calc> and </calc>, and "
                  "its result follows. For example <calc>12 * 34</calc> gives <result>408</result>.",
    "python": "You can run Python: write code between <python> and </python>, and what it "
              "prints follows. For example <python>print(2 ** 10)</python> gives "
              "<result>1024</result>.",
}
MAX_CALLS = 4            # tool calls in one episode; then the episode ends
SECONDS = 5              # the sandbox's CPU seconds (and wall seconds, plus one)
MEMORY_BYTES = 512 << 20  # its address space
FILE_BYTES = 1 << 20     # the largest file it may write
OUTPUT_CHARS = 1000      # what comes back of its output


def call_pattern(tools, at_end=False):
    """A call of one of `tools`: <tag>body</tag>, the body holding no tag (group 1 the tag,
    group 2 the body); `at_end`: the call that ends a text."""
    tags = "|".join(TAGS[name] for name in tools)
    body = rf"((?:(?!</?(?:{tags})>).)*?)"
    return re.compile(rf"<({tags})>{body}</\1>" + (r"\s*$" if at_end else ""), re.DOTALL)


def cut_at_call(completion, tokenizer, tools):
    """A rollout.Completion cut after the first tool call it writes (what the model would have
    written after it is its guess at the tool's output), finish_reason "tool"; else as it is.
    The fewest tokens whose text holds the call, by bisection (a call, once written, stays)."""
    pattern, tokens = call_pattern(tools), completion.tokens
    holds = lambda k: pattern.search(tokenizer.decode(tokens[:k], skip_special_tokens=True))  # noqa: E731
    if not tokens or not holds(len(tokens)):
        return completion
    low, high = 1, len(tokens)  # holds(high), and the answer is in [low, high]
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    routing = None if completion.routing is None else \
        completion.routing[:len(completion.routing) - len(tokens) + high]  # (prompt + kept, L, k)
    return replace(completion, tokens=tokens[:high], logprobs=completion.logprobs[:high],
                   finish_reason="tool", routing=routing)


def last_call(text, tools):
    """(tool name, body) of the call that ends `text`, or None."""
    match = call_pattern(tools, at_end=True).search(text)
    return None if match is None else ({tag: name for name, tag in TAGS.items()}[match[1]], match[2])


def run_tool(name, body):
    """The tool's output as text (its failure too)."""
    return calculator(body) if name == "calculator" else sandboxed_python(body)


def calculator(expression):
    """verify.arithmetic_value of the expression: a whole number, or a decimal of 12 digits."""
    read = arithmetic_value(expression)
    if read is None:
        return "error: not arithmetic (numbers, + - * / and parentheses), or a division by 0"
    value = read[0]
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.12g}"


# What the sandbox's interpreter runs first: the audit hook, then the model's code from stdin.
GUARD = r"""
import os, sys
def make_guard(root, realpath=os.path.realpath, fsdecode=os.fsdecode):
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    two_paths = {"os.rename", "os.link", "os.symlink", "shutil.move"}
    changes = two_paths | {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                           "os.truncate", "os.utime", "shutil.rmtree"}
    refused = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
               "os.fork", "os.system", "os.kill", "os.startfile", "pty.", "sys.addaudithook")
    def guard(event, args):
        if event.startswith(refused):
            raise PermissionError(f"the sandbox refuses {event}: no network, processes or native code")
        writes = event == "open" and (set(args[1] or "") & set("wax+") or (args[2] or 0) & writing)
        if writes or event in changes:
            for path in args[:2] if event in two_paths else args[:1]:
                if isinstance(path, (str, bytes)) and not realpath(fsdecode(path)).startswith(root):
                    raise PermissionError(f"the sandbox writes only in its own folder, not {fsdecode(path)!r}")
    return guard
sys.addaudithook(make_guard(os.path.realpath(os.getcwd()) + os.sep))
del make_guard
code = sys.stdin.read()
exec(compile(code, "<python>", "exec"), {"__name__": "__main__"})
"""


def can_sandbox():
    """Whether this platform has the sandbox's limits (POSIX resource limits)."""
    return importlib.util.find_spec("resource") is not None


def _limits():
    """In the sandbox's process, before it starts: CPU seconds, memory, file size, no core file."""
    import resource
    for kind, value in ((resource.RLIMIT_CPU, SECONDS), (resource.RLIMIT_AS, MEMORY_BYTES),
                        (resource.RLIMIT_FSIZE, FILE_BYTES), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))


def sandboxed_python(code):
    """What `code` prints (stdout, then stderr: a traceback's last lines), at most OUTPUT_CHARS,
    run in the sandbox; a limit it passes is said in words."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as folder:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": folder, "TMPDIR": folder}
        try:
            done = subprocess.run([sys.executable, "-I", "-B", "-c", GUARD], input=code, text=True,
                                  capture_output=True, cwd=folder, env=env, timeout=SECONDS + 1,
                                  preexec_fn=_limits)
        except subprocess.TimeoutExpired:
            return f"error: the time limit ({SECONDS} s) was reached"
    output = "\n".join(part for part in (done.stdout.rstrip("\n"), _last_lines(done.stderr)) if part)
    if done.returncode < 0:  # a signal: SIGXCPU (or SIGKILL) at the CPU limit
        output += ("\n" if output else "") + f"error: stopped by signal {-done.returncode} (the " \
            f"limit is {SECONDS} s of CPU)"
    return output[:OUTPUT_CHARS] + (" ... (cut)" if len(output) > OUTPUT_CHARS else "")


def _last_lines(text):
    """Of a traceback, where the code failed (its last line of the model's code) and why."""
    lines = text.strip().splitlines()
    if not lines or not lines[0].startswith("Traceback"):
        return "\n".join(lines)
    own = [line.strip() for line in lines if line.strip().startswith('File "<python>"')]
    return "\n".join(own[-1:] + lines[-1:])
