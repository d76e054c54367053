"""Tools a model can call inside an episode (episodes.py): a calculator, and Python in a sandbox.

    python train.py --data arithmetic:digits=3,ops=* --tools calculator

A reply that writes a call, <calc>123 * 456</calc> or <python>print(2 ** 10)</python>, is cut
right after it (`cut_at_call`); the tool's output follows as <result>56088</result>, and the
model goes on in the next turn from the whole transcript. The output sits in that turn's prompt,
so the loss never sees it: only the model's own tokens are trained on, and every turn of the
episode gets its outcome's reward. A tool that fails answers with text ("error: ..."), never an
exception.

The calculator is verify.py's own arithmetic (numbers, + - * / and parentheses; never eval),
answering any input in bounded time. The Python tool runs the code in a fresh interpreter
inside bubblewrap (`bwrap`, Flatpak's sandbox): new user, process, network and mount namespaces,
so the call sees the system's programs read-only and a folder of its own, never the trainer's
environment, files or processes, nor a network. Limits: CPU and wall seconds, memory (address
space), file size, output read in bounded chunks; every process it starts ends with the call. A
machine without bubblewrap (or whose kernel refuses it namespaces) has only an audit hook
(PEP 578), a guard that code can undo: `--tools python` refuses there unless
`--unsandboxed-python` accepts the risk. The data path spells out control tokens in the output.
"""

import decimal
import functools
import importlib.util
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
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
READ_BYTES = 4 * OUTPUT_CHARS  # stdout read at most (UTF-8: 4 bytes a character at most)
ERROR_BYTES = 4096       # the end of stderr kept (a traceback's last lines)
SANDBOX_FOLDER = "/sandbox"  # the call's own folder, as its code sees it under bubblewrap
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_FOLDER, "TMPDIR": SANDBOX_FOLDER}  # all of it


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
    """verify.arithmetic_value of the expression: a whole number, or a decimal of 12 digits. Text
    in bounded time for any input: the parser reads at most verify.MAX_PARSE_CHARS characters,
    so a value has at most that many digits; a decimal, not a float, prints it (10**400 / 3)."""
    read = arithmetic_value(expression)
    if read is None:
        return "error: not arithmetic (numbers, + - * / and parentheses), or a division by 0"
    value = read[0]
    if value.denominator == 1:
        return str(value.numerator)
    quotient = decimal.Context(prec=12).divide(decimal.Decimal(value.numerator), value.denominator)
    return f"{quotient.normalize():g}"


# ----------------------------------------------------------------------------------------------
# The Python tool: a fresh interpreter in bubblewrap's namespaces, an audit hook inside

# What the sandbox's interpreter runs first: the audit hook, then the model's code from its file.
# Inside bubblewrap the hook only turns refusals into words the model can read (the namespaces
# are the wall); without bubblewrap it is all there is, and code can undo it.
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
with open("program.py", encoding="utf-8") as program:
    code = program.read()
sys.addaudithook(make_guard(os.path.realpath(os.getcwd()) + os.sep))
del make_guard, program
exec(compile(code, "<python>", "exec"), {"__name__": "__main__"})
"""


def can_sandbox():
    """Whether this platform has the sandbox's limits (POSIX resource limits)."""
    return importlib.util.find_spec("resource") is not None


def interpreter():
    """The Python the tool runs: this one's base interpreter (a virtual environment's packages
    and files stay out of the sandbox)."""
    return os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)


def bwrap_command(folder):
    """bubblewrap's command line for a tool call in `folder`: every namespace new (user, process,
    network, IPC, mounts), so the call sees no network, no process of the trainer's and no file
    but the system's programs and libraries and the interpreter's own, read-only, and `folder` as
    SANDBOX_FOLDER; it dies with the trainer. (The environment is the one bwrap is given: SANDBOX_ENV.)"""
    command = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
               "--proc", "/proc", "--dev", "/dev"]
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache"):
        if os.path.islink(path):  # a merged /usr: /lib -> usr/lib
            command += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            command += ["--ro-bind", path, path]
    for path in interpreter_paths():
        command += ["--ro-bind", path, path]
    return command + ["--bind", folder, SANDBOX_FOLDER, "--chdir", SANDBOX_FOLDER]


def interpreter_paths():
    """What an interpreter installed outside /usr (pyenv, conda, a build of one's own) needs in the
    sandbox: its program, its standard library, its shared library's folder; never a folder above
    them, which could be a home folder."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}  # not a virtual environment's
    paths = sysconfig.get_paths(vars={**base, "installed_base": sys.base_prefix,
                                      "installed_platbase": sys.base_exec_prefix})
    needed = {interpreter(), paths["stdlib"], paths["platstdlib"], sysconfig.get_config_var("LIBDIR")}
    return sorted(path for path in {os.path.realpath(p) for p in needed if p and os.path.exists(p)}
                  if not path.startswith("/usr/"))


@functools.cache
def isolation_problem():
    """Why bubblewrap cannot isolate a call on this machine (not installed, a version without
    these options, a kernel or AppArmor that refuses it namespaces), in its own words; or None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt install bubblewrap)"
    if any(path in ("/", os.path.expanduser("~")) for path in interpreter_paths()):
        return f"the interpreter's files ({', '.join(interpreter_paths())}) would show a home or the root"
    with tempfile.TemporaryDirectory(prefix="sandbox-") as folder:
        try:
            probe = subprocess.run(bwrap_command(folder) + [interpreter(), "-I", "-c", "pass"],
                                   capture_output=True, text=True, errors="replace", timeout=30,
                                   env=SANDBOX_ENV)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"bwrap did not run: {error}"
    return None if probe.returncode == 0 else f"bwrap failed: {probe.stderr.strip()[-300:]}"


def isolation():
    """"bwrap" where bubblewrap isolates a call on this machine, else None (isolation_problem)."""
    return "bwrap" if isolation_problem() is None else None


def _limits():
    """In the sandbox's process, before it starts: CPU seconds, memory, file size, no core file."""
    import resource
    for kind, value in ((resource.RLIMIT_CPU, SECONDS), (resource.RLIMIT_AS, MEMORY_BYTES),
                        (resource.RLIMIT_FSIZE, FILE_BYTES), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))


def sandboxed_python(code):
    """What `code` prints (stdout, then stderr: a traceback's last lines), at most OUTPUT_CHARS,
    run in bubblewrap where `isolation()` finds it (else under the audit hook alone); a limit it
    passes is said in words. Every process the call starts is ended before it returns."""
    isolated = isolation() is not None
    with tempfile.TemporaryDirectory(prefix="sandbox-") as folder:
        with open(os.path.join(folder, "program.py"), "w", encoding="utf-8", errors="replace") as file:
            file.write(code)
        command = [interpreter(), "-I", "-B", "-c", GUARD]
        process = subprocess.Popen(bwrap_command(folder) + command if isolated else command,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   cwd=folder, env=SANDBOX_ENV if isolated else
                                   {"PATH": os.environ.get("PATH", ""), "HOME": folder, "TMPDIR": folder},
                                   preexec_fn=_limits, start_new_session=True)
        try:
            stdout, stderr, stopped = _read_bounded(process, time.monotonic() + SECONDS + 1)
        finally:
            _end(process)
    output = "\n".join(part for part in (stdout.rstrip("\n"), _last_lines(stderr)) if part)
    signal_number = -process.returncode if process.returncode < 0 else \
        process.returncode - 128 if isolated and process.returncode > 128 else 0  # bwrap: 128 + signal
    if stopped == "time":
        output += ("\n" if output else "") + f"error: the time limit ({SECONDS} s) was reached"
    elif signal_number and stopped is None:  # SIGXCPU (or SIGKILL) at the CPU limit
        output += ("\n" if output else "") + f"error: stopped by signal {signal_number} (the " \
            f"limit is {SECONDS} s of CPU)"
    cut = stopped == "output" or len(output) > OUTPUT_CHARS
    return output[:OUTPUT_CHARS] + (" ... (cut)" if cut else "")


def _read_bounded(process, deadline):
    """Read the process's output until it ends, in chunks, keeping stdout's first READ_BYTES and
    stderr's last ERROR_BYTES (an endless print costs no memory here), decoded with replacement
    (output need not be UTF-8). -> (stdout, stderr, None | "time" | "output": why it was stopped)"""
    kept = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    stopped = None
    with selectors.DefaultSelector() as selector:
        for stream in (process.stdout, process.stderr):
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and stopped is None:
            ready = selector.select(max(0.0, deadline - time.monotonic()))
            stopped = "time" if not ready else None
            for key, _ in ready:
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                kept[key.fd] += chunk
                if key.fd == process.stderr.fileno():
                    del kept[key.fd][:-ERROR_BYTES]
                elif len(kept[key.fd]) > READ_BYTES:
                    stopped = "output"
    if stopped is None:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # its streams closed, the process still running
            stopped = "time"
    stdout, stderr = (bytes(kept[s.fileno()]).decode("utf-8", "replace") for s in (process.stdout, process.stderr))
    return stdout[:READ_BYTES], stderr, stopped


def _end(process):
    """Kill the call's process group (a child it started ends with it; under bubblewrap its whole
    process namespace ends with bwrap), and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    process.stdout.close()
    process.stderr.close()


def _last_lines(text):
    """Of a traceback, where the code failed (its last line of the model's code) and why; also of
    a traceback's tail (a deep one is kept from its end: ERROR_BYTES)."""
    lines = text.strip().splitlines()
    if not lines or not any(line.startswith(("Traceback", '  File "')) for line in lines):
        return "\n".join(lines)
    own = [line.strip() for line in lines if line.strip().startswith('File "<python>"')]
    return "\n".join(own[-1:] + lines[-1:])
