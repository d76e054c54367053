"""FSDP2 for models that outgrow one device: `torchrun --nproc_per_node N train.py --fsdp ...`.

Every transformer block, then the whole model, goes through `fully_shard` (PyTorch's FSDP2): each
rank keeps 1/N of every weight, gradient and AdamW moment, gathers a block's weights just before
it runs and frees them after. Rollouts need whole weights, so each rank also holds a full copy
for sampling (bf16 where bf16 is fast), refreshed after every update by gathering the trainable
weights. Checkpoints are sharded (`torch.distributed.checkpoint`: every rank writes its own
shards); final/ is one full checkpoint that transformers loads. The README says what it costs.
"""

import copy
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard(model, bf16_on_cuda=False):
    """fully_shard on every block, then on the root (embeddings, final norm, output head).
    On CUDA with bf16: bf16 weights in forward and backward, gradients reduced in float32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16_on_cuda else MixedPrecisionPolicy()
    with torch.no_grad():  # rank 0's weights everywhere (ranks seed their RNGs apart: LoRA's
        for tensor in [*model.parameters(), *model.buffers()]:  # init differs), as DDP does
            torch.distributed.broadcast(tensor, src=0)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full(tensor):
    """The whole tensor on every rank (a collective for a sharded one)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def copy_trainable(sampler, policy):
    """The sampler's copy of every trainable weight from the (sharded) policy: one all-gather per
    weight; frozen weights (a LoRA base) never change, so they are not gathered."""
    for p_sampler, p in zip(sampler.parameters(), policy.parameters()):
        if p.requires_grad:
            p_sampler.copy_(full(p))


@torch.no_grad()
def gathered_model(policy, like):
    """A full float32 copy of the (sharded) policy, built from `like` (a full model of the same
    structure, e.g. the sampler): for final/. Every rank must call it (all-gathers)."""
    out = copy.deepcopy(like).float()
    for p_out, p in zip(out.parameters(), policy.parameters()):
        p_out.copy_(full(p.detach()))
    return out


SHARDS = "shards-{step}"  # the folder of one checkpoint's shards, beside its checkpoint.pt


def save_shards(run_dir, step, model, optimizer):
    """Model and AdamW state, each rank its own shards, into run_dir/shards-<step> (written whole
    under a temporary name first). -> the folder's name. Every rank must call it."""
    name = SHARDS.format(step=step)
    model_state, optim_state = get_state_dict(model, optimizer)
    path = os.path.join(run_dir, name)
    tmp = path + ".tmp"
    if torch.distributed.get_rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    torch.distributed.barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    torch.distributed.barrier()
    return name


def load_shards(run_dir, name, model, optimizer):
    """Model and AdamW state back from run_dir/<name>, each rank reading the shards it needs
    (also on another number of ranks). Every rank must call it."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(run_dir, name))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def drop_shards(run_dir, keep):
    """Removes the shard folders of run_dir that no checkpoint refers to (`keep`: the names the
    newest and previous checkpoints hold), and those a killed save left half written."""
    for entry in os.listdir(run_dir):
        if entry.startswith("shards-") and entry not in keep:
            shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
