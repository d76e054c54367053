"""LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen base projection plus a trainable low-rank
update, y = W x + (alpha / r) B A x, with B = 0 at the start so training starts at the base.

    add_lora(model, rank=16, alpha=32)       # wraps the projections; only A and B train
    with lora_disabled(model): ...           # the base model: the reference policy at no memory
    merge_lora(model)                        # W + (alpha / r) B A, for saving

quantize.py stores the frozen base in NF4 (QLoRA). Tests: `python -m pytest tests/test_model.py -k lora`.
"""

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A dropout(x) (Hu et al. 2021, eq. 3); W frozen, B starts at 0."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype,
                                               device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype,
                                               device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def forward(self, x):
        y = self.base(x)
        if self.enabled:
            y = y + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale
        return y

    def merged_weight(self):
        return self.base.weight + (self.lora_b @ self.lora_a) * self.scale


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def lora_parents(block) -> list:
    """The modules whose projections LoRA may wrap: attention, and the MLP or every expert."""
    return [block.attn, *(block.mlp.experts if block.is_moe else [block.mlp])]


def add_lora(model, rank=8, alpha=16.0, dropout=0.0, targets=LORA_TARGETS):
    """Wraps the named projections in LoRA adapters and freezes every other weight."""
    unknown = set(targets) - set(LORA_TARGETS)
    if unknown:
        raise ValueError(f"--lora-targets: unknown {sorted(unknown)}; choose from {LORA_TARGETS}")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.layers:
        for parent in lora_parents(block):
            for name in targets:
                if hasattr(parent, name):
                    setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha, dropout))
    return model


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Inside, the model is its base: the reference policy without a second copy of the weights."""
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in adapters:
        m.enabled = False
    try:
        yield model
    finally:
        for m in adapters:
            m.enabled = True


def merge_lora(model):
    """Folds every adapter into its base weight and removes the adapters (in place)."""
    for block in model.layers:
        for parent in lora_parents(block):
            for name, child in list(parent.named_children()):
                if isinstance(child, LoRALinear):
                    if not isinstance(child.base, nn.Linear):  # (quantize.NF4Linear)
                        raise ValueError("merge_lora: a quantised base has no weight to merge "
                                         "into; save_model merges into its dequantised weight")
                    with torch.no_grad():
                        child.base.weight.copy_(child.merged_weight())
                    setattr(parent, name, child.base)
    return model
