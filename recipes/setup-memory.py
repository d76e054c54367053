"""Each rank's peak resident memory once train.py's setup is done (model, copies, optimizer,
data): how much a way of loading costs a rank's host.

    torchrun --nproc_per_node 2 recipes/setup-memory.py --fsdp --bench --compile off

Takes train.py's flags; prints one line a rank.
"""
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402

from run import (
    config,  # noqa: E402
    launch,  # noqa: E402
)

if __name__ == "__main__":
    args, _ = config.parse_config(sys.argv[1:])
    run = launch.setup(args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"rank {run.rank}: peak RSS after setup {peak:.0f} MiB", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
