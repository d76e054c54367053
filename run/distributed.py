"""Ranks under torchrun, and the few collectives a step uses: named sums and maxima reduced in one
call, and any object gathered from every rank. In one process (`python train.py`) each is the
identity, so the step reads the same with one rank or many.

    torchrun --nproc_per_node 2 train.py ...     # gloo on CPUs, NCCL on GPUs
"""

import contextlib
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist

from run import sharding


def setup_distributed():
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; plain `python train.py` is one process."""
    if "RANK" not in os.environ:  # not under torchrun
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Under torchrun a process group even for one rank, so that `--nproc_per_node 1` runs the
    # same collectives and DDP wrapper as many ranks (the GPU check relies on it).
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    # Rank 0 alone evaluates and writes checkpoints while the others wait in a collective: allow
    # more than NCCL's default 10 minutes for that.
    timeout = datetime.timedelta(hours=2)
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=timeout)
    return rank, world, torch.device("cpu")


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """`tensor` summed (or `op`) over ranks, in place; a no-op in one process. NCCL reduces CUDA
    tensors only, so a CPU tensor goes through the GPU and back."""
    if not dist.is_initialized():
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_gpu = tensor.to(torch.cuda.current_device())
        dist.all_reduce(on_gpu, op=op)
        return tensor.copy_(on_gpu)
    dist.all_reduce(tensor, op=op)
    return tensor


def add(a, b):
    """Two dicts of named sums added name by name."""
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


def top(a, b):
    """Two dicts of named maxima, maxed name by name."""
    return {k: max(a.get(k, -math.inf), b.get(k, -math.inf)) for k in a.keys() | b.keys()}


def reduce_metrics(sums, maxima):
    """Named sums added over ranks and named maxima maxed over ranks, in one call (every rank
    passes the same names). -> one dict."""
    out = {}
    for values, op in ((sums, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
        names = sorted(values)
        reduced = all_reduce(torch.tensor([float(values[n]) for n in names], dtype=torch.float64), op)
        out.update(zip(names, reduced.tolist()))
    return out


def gather(obj, world):
    """[obj of rank 0, obj of rank 1, ...] on every rank (any picklable object)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def from_rank0(make, rank, world):
    """make()'s result on every rank, made on rank 0 alone (a hub dataset walked once, not once a
    rank); an exception make() raises is raised on every rank (else the others would wait)."""
    if world == 1:
        return make()
    box = [None]
    if rank == 0:
        try:
            box[0] = (make(), None)
        except Exception as error:
            box[0] = (None, error)
    dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise error
    return value


def shut_down(exit_status=0):
    """The process group's end, after every rank has written what it writes; then the process's
    with `exit_status` (0: return, in one process)."""
    if not dist.is_initialized():
        if exit_status:
            sys.exit(exit_status)
        return
    dist.barrier()
    dist.destroy_process_group()
    # The DDP wrapper still holds the backend; freed during the interpreter's shutdown, its
    # worker threads sometimes abort the process ("terminate called without an active
    # exception", seen here about once in 40 gloo runs). Everything is written: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)


# ---- the update's bookkeeping over ranks ---------------------------------------------------------

def mini_batches(units, mu):
    """This rank's `units` (rows or pairs) in mu mini-batches (none when mu is 0). Mini-batch m is
    the m-th mu-th of all ranks' units in rank order, as in one process (each rank splitting its
    own units would group other samples whenever ranks keep unequal numbers); sizes differ by one
    at most."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    counts = gather(len(units), world)
    offset, total = sum(counts[:rank]), sum(counts)
    return [units[max(0, m * total // mu - offset):max(0, (m + 1) * total // mu - offset)]
            for m in range(mu)]


def micro_batch_count(count):
    """The most micro-batches any rank has (at least 1): DDP all-reduces once per backward, so
    every rank runs that many (the short ones add zero-weight stand-ins)."""
    return max(1, int(all_reduce(torch.tensor(count), dist.ReduceOp.MAX)))


def accumulating(model, last):
    """Around one micro-batch's backward: DDP all-reduces the gradients on the last one only
    (FSDP reduce-scatters on each; one process has nothing to sync)."""
    if last or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def optimizer_step(optimizer, model, loss_sum, max_norm):
    """Clip the gradients' global norm to max_norm, then step; a non-finite loss (loss_sum, this
    rank's) or gradient on any rank leaves the weights and the optimizer state as they were, and
    is counted. -> named sums for the log"""
    grad_norm = sharding.full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    total = all_reduce(torch.tensor(loss_sum, dtype=torch.float64))
    finite = math.isfinite(float(total)) and math.isfinite(float(grad_norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return {"updates": 1, "skipped_updates": int(not finite),
            "grad_norm": float(grad_norm) if finite else 0.0}


def autocast(device, bf16):
    """The update's precision: bf16 autocast where bf16 is fast (fp32 weights), else fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
