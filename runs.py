"""The run directory: what train.py writes, how a run resumes from it, and its learning curve.

    runs/NAME/config.json              every flag (what --resume reads back)
    runs/NAME/metrics.jsonl            one JSON line per training step
    runs/NAME/eval.jsonl               held-out accuracy at step 0, every --eval-every steps, the end
    runs/NAME/checkpoint.pt            the latest checkpoint; checkpoint-previous.pt, the one before
    runs/NAME/final/                   the trained model (model.save_model)

    python train.py --plot runs/NAME   # runs/NAME/curve.png

A checkpoint is written whole to a temporary file and only then renamed over the last one, which
is kept as checkpoint-previous.pt: a crash at any moment leaves a complete checkpoint behind. On
resume, the log lines written after the checkpoint are dropped (those steps run again), so a
resumed run's logs equal a run never stopped. Imports only torch and the standard library.
"""

import json
import os
import random
import sys

import torch

CHECKPOINT, PREVIOUS_CHECKPOINT = "checkpoint.pt", "checkpoint-previous.pt"


def write_config(run_dir, config):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def read_config(run_dir):
    with open(os.path.join(run_dir, "config.json")) as f:
        return json.load(f)


def append_line(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_lines(path):
    """The JSON objects of a .jsonl log, [] when it does not exist."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trim_log(path, step):
    """Keeps the JSON lines of `path` whose "step" is <= step; a torn last line goes too."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                pass
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)  # a crash here leaves the old file whole


def save_checkpoint(run_dir, state):
    """`state` (tensors, numbers, strings, lists, dicts) to run_dir/checkpoint.pt, atomically;
    the checkpoint it replaces stays as checkpoint-previous.pt."""
    path = os.path.join(run_dir, CHECKPOINT)
    torch.save(state, path + ".tmp")
    if os.path.exists(path):
        os.replace(path, os.path.join(run_dir, PREVIOUS_CHECKPOINT))
    os.replace(path + ".tmp", path)


def load_checkpoint(run_dir):
    """The state of run_dir/checkpoint.pt, or None when the run has none yet. Loaded on the CPU
    (random states must stay there) with weights_only=True: nothing in it is run as code."""
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


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


def plot(run_dir):
    """Learning curve of a run directory -> run_dir/curve.png (needs matplotlib, optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("train.py: --plot needs matplotlib (pip install matplotlib)")
    rows = read_lines(os.path.join(run_dir, "metrics.jsonl"))
    evals = read_lines(os.path.join(run_dir, "eval.jsonl"))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["train_seconds"] / 60 for r in rows], [r["accuracy"] for r in rows], ".", alpha=0.5,
            label="training samples")
    ax.plot([e["train_seconds"] / 60 for e in evals], [e["pass@1"] for e in evals], "o-",
            label=f"held-out, greedy ({evals[0]['n']} problems)" if evals else "held-out")
    ax.set_xlabel("training minutes (evaluation excluded)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    out = os.path.join(run_dir, "curve.png")
    fig.savefig(out, dpi=100)
    print(out)
