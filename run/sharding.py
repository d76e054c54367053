"""FSDP2 for models that outgrow one device: `torchrun --nproc_per_node N train.py --fsdp ...`.

Every transformer block, then the whole model, goes through `fully_shard` (PyTorch's FSDP2): each
rank keeps 1/N of every weight, gradient and AdamW moment, gathers a block's weights just before
it runs and frees them after. The model is built on the meta device and sharded before any
weight exists; rank 0 alone reads the checkpoint (on the host) and sends each rank its shards
(`load_sharded`). Rollouts need whole weights, so each rank also holds a full copy for sampling
(bf16 where bf16 is fast), built from the shards and refreshed after every update by gathering
the trainable weights. Checkpoints are sharded (`torch.distributed.checkpoint`: every rank
writes its own shards); final/ is one full checkpoint that transformers loads, gathered on rank 0
alone. The README says what it costs.
"""

import copy
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard(model, bf16_on_cuda=False):
    """fully_shard on every block, then on the root (embeddings, final norm, output head), in
    place; the model may be on the meta device. On CUDA with bf16: bf16 weights in forward and
    backward, gradients reduced in float32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16_on_cuda else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def load_sharded(skeleton, read_whole, device, bf16_on_cuda=False):
    """`skeleton` (a model on the meta device) sharded, materialised on `device` and loaded with
    the weights rank 0 reads: `read_whole()` runs on rank 0 only and returns the whole model on
    the host; each rank receives its own shards, one tensor at a time (no rank but 0 ever holds
    a whole weight set; the ranks' differing RNGs cannot make LoRA's init differ). -> the model"""
    shard(skeleton, bf16_on_cuda)
    skeleton.to_empty(device=device)  # (FSDP2 keeps tied weights tied; the rotary buffer is remade)
    whole = read_whole() if torch.distributed.get_rank() == 0 else None
    set_model_state_dict(skeleton, whole.state_dict() if whole is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return skeleton


def full(tensor):
    """The whole tensor on every rank (a collective for a sharded one)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def copy_trainable(sampler, policy, frozen_too=False):
    """The sampler's copy of every trainable weight from the (sharded) policy: one all-gather per
    weight; frozen weights (a LoRA base) never change, so they are gathered only when asked
    (frozen_too: the sampler's first fill)."""
    for p_sampler, p in zip(sampler.parameters(), policy.parameters()):
        if p.requires_grad or frozen_too:
            p_sampler.copy_(full(p))


@torch.no_grad()
def gathered_model(policy, like, keep=True):
    """A full float32 copy of the (sharded) policy, built from `like` (a full model of the same
    structure, e.g. the sampler): for final/. Every rank must call it (all-gathers); only where
    `keep` (the rank that writes) is the copy made, else None."""
    out = copy.deepcopy(like).float() if keep else None
    outs = list(out.parameters()) if keep else [None] * len(list(policy.parameters()))
    for p_out, p in zip(outs, policy.parameters()):
        whole = full(p.detach())
        if p_out is not None:
            p_out.copy_(whole)
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
