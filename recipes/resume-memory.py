"""Each rank's host memory while train.py resumes (`launch.load_checkpoint`), before its first
step: at its peak, and what reading the checkpoint added.

    python train.py --steps 1 --checkpoint-every 1 --out runs/r ...     # a checkpoint to resume
    torchrun --nproc_per_node 2 recipes/resume-memory.py --resume runs/r

Takes train.py's flags; prints one line a rank. A rank's memory is its Pss: its private pages
plus its share of the pages it maps with other processes (a memory-mapped checkpoint's page
cache is split between the ranks that read it), so the ranks' figures add up to what they hold
together; RssAnon is its private part. The peak is sampled every millisecond, and taken at the
moment the whole state is read, before any of it is copied into the model.
"""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402

from run import (  # noqa: E402
    config,
    launch,
    runs,
)


def memory():
    """This process's (Pss, RssAnon), in MiB."""
    found = {}
    for path in ("/proc/self/smaps_rollup", "/proc/self/status"):
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Pss", "RssAnon"):
                    found[key] = int(value.split()[0]) / 1024  # kB
    return found["Pss"], found["RssAnon"]


def sample(seen, stop):
    while not stop.wait(0.001):
        seen.append(memory())  # (list.append is atomic: the main thread appends too)


def resume_measured(run):
    """launch.load_checkpoint(run) -> (memory() before it, [memory() seen during it])."""
    seen, stop, read = [], threading.Event(), runs.load_checkpoint

    def read_noted(run_dir):
        # The moment the whole state is in memory and nothing is copied yet: loading that copies
        # the file into private memory peaks here, whatever the sampling thread catches.
        state = read(run_dir)
        seen.append(memory())
        return state
    runs.load_checkpoint = read_noted
    thread = threading.Thread(target=sample, args=(seen, stop))
    before = memory()
    thread.start()
    try:
        launch.load_checkpoint(run)
        seen.append(memory())
    finally:
        stop.set()
        thread.join()
        runs.load_checkpoint = read
    return before, seen


if __name__ == "__main__":
    args, _ = config.parse_config(sys.argv[1:])
    run = launch.setup(args)
    size = os.path.getsize(os.path.join(args.out, runs.CHECKPOINT)) / 2**20
    before, seen = resume_measured(run)
    pss, anon = max(m[0] for m in seen), max(m[1] for m in seen)
    added, private = pss - before[0], anon - before[1]
    print(f"rank {run.rank}: checkpoint {size:.0f} MiB; Pss {before[0]:.0f} MiB before the resume, "
          f"{pss:.0f} MiB at its peak ({pss / size:.2f}x the checkpoint; +{added:.0f} MiB, "
          f"{added / size:.2f}x); RssAnon {before[1]:.0f} -> {anon:.0f} MiB (+{private:.0f} MiB "
          "private)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
