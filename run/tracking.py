"""Experiment tracking: each step's metrics, each held-out evaluation, the run's flags and a few
completions, to tensorboard and/or wandb, under the names of metrics.jsonl and eval.jsonl
(evaluations as "eval/pass@1", ...). metrics.jsonl stays the record; these are views of it.

    python train.py --report-to tensorboard                 # then: tensorboard --logdir runs
    WANDB_MODE=offline python train.py --report-to wandb    # a local run; wandb sync it later
    python train.py --report-to tensorboard,wandb

Both libraries are optional: imported only when asked for (config.py refuses the flag, naming the
pip install, when one is missing). Rank 0 alone writes.
"""

import importlib.util
import netrc
import os
import urllib.parse
import uuid

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # backend -> the package it needs


def parse_report_to(text):
    """"none", or backends separated by commas -> list of backends. ValueError names a bad one."""
    names = [name.strip() for name in str(text).split(",") if name.strip()]
    if names == ["none"]:
        return []
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"{text!r}: use none, or one or more of {', '.join(BACKENDS)} "
                         "separated by commas")
    missing = [BACKENDS[name] for name in names if importlib.util.find_spec(BACKENDS[name]) is None]
    if missing:
        raise ValueError(f"{text!r} needs {' and '.join(missing)}, which is not installed: "
                         f"pip install {' '.join(missing)}")
    if "wandb" in names and wandb_online() and not wandb_login_found():  # before any work
        raise ValueError(f"{text!r}: wandb finds no login (WANDB_API_KEY, or `wandb login`'s entry "
                         "in ~/.netrc): log in, or log offline with WANDB_MODE=offline and "
                         "`wandb sync` the run later")
    return list(dict.fromkeys(names))  # each once, in the order given


WANDB_INIT_SECONDS = 60  # the most a wandb run waits to start (its own default: 90)


def wandb_online() -> bool:
    return os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun")


def wandb_login_found() -> bool:
    """An API key wandb would use: WANDB_API_KEY, or the entry `wandb login` writes in ~/.netrc
    (or $NETRC) for its host (WANDB_BASE_URL's, else api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def chart_values(row, prefix=""):
    """The entries of a log row that a chart can show: finite numbers (None, lists, text left out)."""
    return {prefix + key: float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
            and abs(value) != float("inf")}


class Tracker:
    """The backends of one run; with none, every call does nothing. `rerun_from`: on --resume,
    the first step that runs again (tensorboard hides what a killed run logged from there on;
    wandb keeps the first value of a step, see the README); None for a new run."""

    def __init__(self, backends, out, flags, rerun_from=None):
        self.tensorboard = self.wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(out, "tensorboard"),
                                             purge_step=rerun_from)
            self.tensorboard.add_text("config", "\n".join(f"    {key}: {value}"
                                                          for key, value in sorted(flags.items())))
        if "wandb" in backends:
            import wandb
            try:
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "dapo"), dir=out,
                                        name=os.path.basename(os.path.abspath(out)), config=flags,
                                        id=wandb_run_id(out), resume="allow",
                                        settings=wandb.Settings(init_timeout=WANDB_INIT_SECONDS))
            except BaseException:
                self.close()
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.close()

    def log(self, row, step, prefix=""):
        """A metrics.jsonl row (prefix "") or an eval.jsonl row (prefix "eval/") at `step`."""
        values = chart_values({k: v for k, v in row.items() if k != "step"}, prefix)
        if self.tensorboard:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()  # a run killed later keeps what was logged
        if self.wandb:
            self.wandb.log(values, step=step)

    def log_samples(self, lines, step):
        """samples.jsonl's lines of a step: a text table (tensorboard), a wandb.Table (wandb)."""
        if not lines:
            return
        columns = ["turn", "prompt", "answer", "completion", "reward", "advantage"]
        if self.tensorboard:  # a markdown table, which tensorboard's text tab renders
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(table_cell(line[c]) for c in columns) + " |" for line in lines]
            self.tensorboard.add_text("samples", "\n".join(table), step)
            self.tensorboard.flush()
        if self.wandb:
            import wandb
            self.wandb.log({"samples": wandb.Table(columns=columns, data=[  # a column, one type
                [str(line[c]) if c in ("prompt", "answer", "completion") else line[c]
                 for c in columns] for line in lines])}, step=step)

    def close(self):
        """Flushes and closes each backend (once: a second call does nothing)."""
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.tensorboard = self.wandb = None


def table_cell(value):
    return str(value).replace("|", "\\|").replace("\n", " ")


def wandb_run_id(out):
    """The run's wandb id, kept in the run directory so that --resume continues the same run."""
    path = os.path.join(out, "wandb-run-id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id
