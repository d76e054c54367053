"""The run directory: what train.py writes, how a run resumes from it, and its learning curve.

    runs/NAME/config.json              every flag (what --resume reads back)
    runs/NAME/metrics.jsonl            one JSON line per training step
    runs/NAME/eval.jsonl               held-out accuracy at step 0, every --eval-every steps, the end
    runs/NAME/checkpoint.pt            the latest checkpoint; checkpoint-previous.pt, the one before
    runs/NAME/final/                   the trained model (checkpoints.save_model)
    runs/NAME/run.lock                 who writes this run now (pid, host, since when)

    python run/runs.py runs/NAME           # its learning curve, runs/NAME/curve.png
    python run/runs.py runs/A runs/B ...   # compared: comparison.png, comparison.md

A checkpoint is written whole to a temporary file, read back, and only then renamed over the last
one, which is kept as checkpoint-previous.pt: a crash at any moment leaves a complete checkpoint,
and a damaged newest one is passed over for the one before, with a warning. On resume, the log
lines written after the checkpoint are dropped (those steps run again), so a resumed run's logs
equal a run never stopped; a line that cannot be read is kept in LOG.unreadable, never deleted.
One process writes a run at a time: `lock` refuses a second one (eval.py's --out, `hold_lock`).
Imports only torch and the standard library.
"""

import errno
import fcntl
import json
import math
import os
import random
import shutil
import socket
import sys
import tempfile
import time

if __name__ == "__main__":  # `python run/runs.py`: the repository's root on the path, not run/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

CHECKPOINT, PREVIOUS_CHECKPOINT = "checkpoint.pt", "checkpoint-previous.pt"


class RunError(ValueError):
    """A run directory that cannot be used as asked; the message says which file and why."""


def check_new(run_dir):
    """RunError now, before any work, if run_dir exists or could not be made."""
    if os.path.exists(run_dir):
        raise RunError(f"--out {run_dir} already exists; use --resume {run_dir} or a new --out")
    parent = os.path.dirname(os.path.abspath(run_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as error:
        raise RunError(f"--out {run_dir}: cannot make it in {parent}: {error.strerror or error}") \
            from None


def create(run_dir):
    """A new, empty run directory; RunError if it exists (the check and the creation are one
    step, so two runs started with the same --out cannot both get it)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(run_dir)), exist_ok=True)
        os.mkdir(run_dir)
    except FileExistsError:
        raise RunError(f"--out {run_dir} already exists; use --resume {run_dir} or a new --out") \
            from None
    except OSError as error:
        raise RunError(f"--out {run_dir}: cannot make it: {error.strerror or error}") from None


def hold_lock(path, program):
    """An exclusive lock on the file `path` (made if missing), held while the returned file stays
    open or the process lives (the system releases it when the process ends, killed or not: a
    stale file never blocks), with who holds it written there. -> (the open file, None), or
    (None, who holds it) when another process does; OSError when the file cannot be opened."""
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            return None, holder
        try:  # still the file at `path`? Not when its last holder removed it on release: again
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(f"{program}, pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle, None


def lock(run_dir):
    """Takes run_dir/run.lock (hold_lock) for as long as this process lives. -> the open file:
    keep a reference. RunError naming the holder when another process writes this run."""
    try:
        handle, holder = hold_lock(os.path.join(run_dir, "run.lock"), "train.py")
    except OSError as error:  # a read-only file system, another user's run
        raise RunError(f"{run_dir}: cannot write there ({error.strerror or error}); a run resumes "
                       "where it can write: copy it (cp -r) to a writable place and resume the "
                       "copy") from None
    if handle is None:
        raise RunError(f"{run_dir} is being written by {holder}: wait for it to finish (or stop "
                       "it) before resuming; two writers would corrupt the run")
    return handle


def write_config(run_dir, config):
    """config.json, atomically (a resumed run rewrites it with the flags it was given)."""
    path = os.path.join(run_dir, "config.json")
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(path + ".tmp", path)


def read_config(run_dir):
    """The flags of a run, from its config.json; RunError if it is missing or damaged."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise RunError(f"{run_dir}: no config.json there (not a run directory)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as error:  # truncated, not JSON, not UTF-8
        raise RunError(f"{path}: damaged ({error}); it cannot be resumed as it is") from None
    if not isinstance(config, dict):
        raise RunError(f"{path}: expected a JSON object of flags, got a {type(config).__name__}")
    return config


def strict_json(value):
    """`value` with every non-finite float (NaN, +-inf) as None, in dicts and lists at any depth:
    a line of strict JSON. json.dumps writes NaN and -Infinity, which are not JSON: jq, browsers
    and most readers other than Python's refuse the whole file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def append_line(path, row):
    """`row` as one line of strict JSON at the end of the .jsonl file `path`."""
    with open(path, "a") as f:
        f.write(json.dumps(strict_json(row), allow_nan=False) + "\n")


def append_log(out, name, row):
    """A line into one of the run's logs; a full disk ends the run in one line (on --resume the
    steps after the last checkpoint run again, and a torn line is set aside: trim_log)."""
    try:
        append_line(os.path.join(out, name), row)
    except OSError as error:
        sys.exit(f"train.py: {out}/{name}: could not write ({error.strerror or error}); the last "
                 f"checkpoint is whole: free some space and run python train.py --resume {out}")


def read_lines(path):
    """The JSON objects of a .jsonl log ([] when it does not exist); unreadable lines are skipped
    (trim_log keeps them aside on resume)."""
    rows = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            for raw in f:
                try:
                    rows.append(json.loads(raw.decode("utf-8")))
                except ValueError:
                    pass
    return rows


def trim_log(path, step):
    """Keeps the JSON lines of `path` whose "step" is <= step. Lines that cannot be read (a line
    torn by a crash, a line damaged by hand) move to PATH.unreadable, with a warning."""
    if not os.path.exists(path):
        return
    kept, unreadable = [], []
    with open(path, "rb") as f:
        for raw in f:
            try:
                if json.loads(raw.decode("utf-8"))["step"] <= step:
                    kept.append(raw)
            except (ValueError, KeyError, TypeError):
                unreadable.append(raw if raw.endswith(b"\n") else raw + b"\n")
    if unreadable:
        with open(path + ".unreadable", "ab") as f:
            f.writelines(unreadable)
        print(f"train.py: warning: {len(unreadable)} unreadable line(s) of {path} kept in "
              f"{path}.unreadable", file=sys.stderr)
    with open(path + ".tmp", "wb") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)  # a crash here leaves the old file whole


def save_checkpoint(run_dir, state):
    """`state` (tensors, numbers, strings, lists, dicts) to run_dir/checkpoint.pt, atomically and
    read back before it replaces anything; the checkpoint it replaces stays as
    checkpoint-previous.pt."""
    path = os.path.join(run_dir, CHECKPOINT)
    try:
        torch.save(state, path + ".tmp")
        torch.load(path + ".tmp", map_location="cpu", weights_only=True, mmap=True)  # whole?
    except (OSError, RuntimeError) as error:  # a full disk: torch says "file write failed"
        reason = _write_failure(error, run_dir)  # (before the half file goes, freeing its space)
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        kept = "the one before is kept" if os.path.exists(path) else "there is none before it"
        raise RunError(f"{path}: could not write the checkpoint ({reason}); {kept}") from None
    if os.path.exists(path):
        os.replace(path, os.path.join(run_dir, PREVIOUS_CHECKPOINT))
    os.replace(path + ".tmp", path)


def first_line(error):
    """An error's first line, for a one-line message (its class name when it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


FULL_BELOW = 64 * 2 ** 20  # bytes free under which a failed write is taken for a full disk


def _write_failure(error, directory):
    """Why a write failed, in words. torch's serializer reports a full disk as its own error
    ("file write failed", "unexpected pos ..."), so the free space says it: a full disk is named."""
    free = shutil.disk_usage(directory).free
    if getattr(error, "errno", None) == errno.ENOSPC or free < FULL_BELOW:
        return f"the disk is full: {free / 2 ** 20:.0f} MiB free where {directory} is"
    return first_line(error)


def load_checkpoint(run_dir):
    """The state of the newest readable checkpoint of run_dir (checkpoint.pt, else
    checkpoint-previous.pt, with a warning), or None when the run has none yet. RunError when
    every one there is damaged. Loaded on the CPU (random states must stay there) with
    weights_only=True: nothing in a checkpoint is run as code.

    Memory-mapped: the tensors are views of the file, whose pages the ranks of a node share in
    the page cache, so a resume reads it once a node, not once a rank (8 x 18.5 GB of host memory
    for a 1.5B model on 8 GPUs). The weights are copied into the model, and on a GPU AdamW's
    moments onto it; on a CPU AdamW keeps its moments as views until the first update writes them
    (copy on write: a save renames a new file, never writes into this one), so a replaced file's
    disk space is freed only when the run ends."""
    problems = []
    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # truncated, empty, not a checkpoint
            problems.append(f"{name} is damaged ({type(error).__name__}: {str(error)[:200]})")
            continue
        if problems:  # the damaged newest is set aside, so that the next save cannot keep it
            os.replace(os.path.join(run_dir, CHECKPOINT), os.path.join(run_dir, CHECKPOINT + ".damaged"))
            print(f"train.py: warning: {'; '.join(problems)} (kept as {CHECKPOINT}.damaged); "
                  f"resuming from {name} instead", file=sys.stderr)
        return state
    if problems:
        raise RunError(f"{run_dir}: no readable checkpoint: {'; '.join(problems)}")
    return None


def checkpoint_values(run_dir, key):
    """{state[key] of each checkpoint in run_dir that has it} (the newest and the previous)."""
    values = set()
    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
            if key in state:
                values.add(state[key])
    return values


def rng_state():
    """This process's random states (CUDA: this rank's own device only, since a resume may see
    a different number of GPUs)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(as_random_state(state["python"]))
    if torch.cuda.is_available() and torch.is_tensor(state.get("cuda")):
        torch.cuda.set_rng_state(state["cuda"])


def as_random_state(state):
    """random.getstate() after a torch.save round trip (its inner tuple may come back a list)."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in state)


def plot(run_dirs):
    """One run: its learning curve, RUN_DIR/curve.png. Several: `compare`."""
    if len(run_dirs) > 1:
        return compare(run_dirs)
    pyplot = _pyplot()
    run_dir = run_dirs[0]
    rows = read_lines(os.path.join(run_dir, "metrics.jsonl"))
    evals = read_lines(os.path.join(run_dir, "eval.jsonl"))
    if not rows:
        sys.exit(f"runs.py: {run_dir}: no metrics.jsonl with a readable line there")
    fig, ax = pyplot.subplots(figsize=(7, 4))
    sampled = [r for r in rows if "accuracy" in r]  # (an SFT run's steps sample nothing)
    if sampled:
        ax.plot([r["train_seconds"] / 60 for r in sampled], [r["accuracy"] for r in sampled], ".",
                alpha=0.5, label="training samples")
    ax.plot([e["train_seconds"] / 60 for e in evals], [e["pass@1"] for e in evals], "o-",
            label=f"held-out, greedy ({evals[0]['n']} problems)" if evals else "held-out")
    ax.set_xlabel("training minutes (evaluation excluded)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    print(saved(lambda path: fig.savefig(path, dpi=100), os.path.join(run_dir, "curve.png")))


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        sys.exit("runs.py: plotting needs matplotlib (pip install matplotlib)")
    return pyplot


# What the comparison draws: (log, key, title); each against steps and against training minutes.
PANELS = [("eval", "pass@1", "held-out accuracy (greedy)"), ("metrics", "reward", "training reward"),
          ("metrics", "entropy", "entropy (nats per token)"),
          ("metrics", "response_length", "response length (tokens)"),
          ("metrics", "clip_frac_high", "clip fraction, upper (eps_high)")]


def load_run(run_dir):
    """A run directory's label (--label, else its preset), config and logs."""
    config = read_config(run_dir)
    return {"dir": run_dir, "label": config.get("label") or config.get("preset", "?"),
            "metrics": read_lines(os.path.join(run_dir, "metrics.jsonl")),
            "eval": read_lines(os.path.join(run_dir, "eval.jsonl"))}


def compare(run_dirs):
    """Several runs overlaid, one colour per label, each seed a line -> comparison.png beside the
    runs; and the summary table (`summary_table`) -> comparison.md, printed too."""
    pyplot = _pyplot()
    try:
        loaded = [load_run(d) for d in run_dirs]
    except RunError as error:  # a log file or a missing folder among the arguments
        sys.exit(f"runs.py: {error}")
    labels = list(dict.fromkeys(run["label"] for run in loaded))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, axes = pyplot.subplots(2, len(PANELS), figsize=(4 * len(PANELS), 7), squeeze=False)
    for column, (log, key, title) in enumerate(PANELS):
        for row, (x_key, x_scale, x_name) in enumerate((("step", 1, "step"),
                                                        ("train_seconds", 60, "training minutes"))):
            ax = axes[row][column]
            for run in loaded:
                points = [(r[x_key] / x_scale, r[key]) for r in run[log]
                          if r.get(key) is not None and x_key in r]
                ax.plot(*zip(*points) if points else ([], []), color=colours[run["label"]],
                        alpha=0.7, lw=1, marker="o" if log == "eval" else None, ms=3)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(x_name, fontsize=8)
            ax.grid(alpha=0.3)
    handles = [pyplot.Line2D([], [], color=colours[label], label=label) for label in labels]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(labels), 6), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    folder = os.path.commonpath([os.path.abspath(d) for d in run_dirs])
    figure = saved(lambda path: fig.savefig(path, dpi=90), os.path.join(folder, "comparison.png"))
    table = summary_table(loaded)
    saved(lambda path: write_text(path, table + "\n"), os.path.join(folder, "comparison.md"))
    print(table)
    print(figure)


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def saved(write, path):
    """write(path); where that folder cannot be written (a read-only file system, another user's
    runs), write(the same name in a new temporary folder) and say so -> the path written."""
    try:
        write(path)
        return path
    except OSError as error:
        elsewhere = os.path.join(tempfile.mkdtemp(prefix="runs-"), os.path.basename(path))
        print(f"runs.py: cannot write {path} ({error.strerror or error}); written to {elsewhere}",
              file=sys.stderr)
        write(elsewhere)
        return elsewhere


def summary_table(loaded):
    """A markdown table, one row per label: held-out accuracy at the end and at its best, the
    first step that reaches 90% of the best label's final accuracy (convergence), throughput and
    peak memory; mean +- standard deviation over the label's runs (seeds)."""
    by_label = {}
    for run in loaded:
        by_label.setdefault(run["label"], []).append(run)
    finals = {label: _mean([run["eval"][-1]["pass@1"] for run in group if run["eval"]])
              for label, group in by_label.items()}
    target = 0.9 * max([f for f in finals.values() if f is not None] or [0.0])
    lines = [f"| arm | runs | held-out at the end | best held-out | first step >= {target:.1%} | "
             "rollout tok/s | update tok/s | peak memory (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for label, group in by_label.items():
        columns = [
            [run["eval"][-1]["pass@1"] for run in group if run["eval"]],
            [max(e["pass@1"] for e in run["eval"]) for run in group if run["eval"]],
            [next((e["step"] for e in run["eval"] if e["pass@1"] >= target), math.nan) for run in group],
            [_mean([r.get("tokens_per_second_rollout") for r in run["metrics"]]) for run in group],
            [_mean([r.get("tokens_per_second_update") for r in run["metrics"]]) for run in group],
            [max((r["peak_memory_mib"] for r in run["metrics"] if r.get("peak_memory_mib")),
                 default=None) for run in group]]  # a run stopped before its first step: none
        formats = ["{:.1%}", "{:.1%}", "{:.0f}", "{:.0f}", "{:.0f}", "{:.0f}"]
        cells = [_mean_and_spread(values, fmt) for values, fmt in zip(columns, formats)]
        lines.append(f"| {label} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _mean_and_spread(values, fmt):
    """"mean +- sd" over the finite values (sd over seeds), "-" when there is none."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt.format(mean)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{fmt.format(mean)} +- {fmt.format(spread)}"


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(prog="runs.py", description="Draw a run's learning curve, or "
                                     "compare several runs (needs matplotlib).")
    parser.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                        help="one: RUN_DIR/curve.png; several: comparison.png and comparison.md "
                             "beside them, one colour per --label")
    plot(parser.parse_args().run_dirs)
