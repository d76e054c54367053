"""A frozen base in 4-bit NormalFloat under LoRA adapters (QLoRA: Dettmers et al. 2023,
arXiv 2305.14314): `python train.py --lora-rank 16 --quantize nf4`.

Each base projection's weight is cut into blocks of 64 values; a block keeps its absolute maximum
(float32) and, for every value, the index of the nearest of 16 levels (NF4: quantiles of a
standard normal, scaled to [-1, 1], with an exact zero), two indices to a byte. The forward
dequantises the weight into the compute dtype just for its product, and so does the backward:
nothing full-size is kept. 0.5625 bytes a weight against bf16's 2. The adapters stay in full
precision; the sampler reads the same quantised weights; save_model merges the adapters into the
dequantised weights. (The paper's double quantisation of the block maxima would save another
0.06 bytes a weight; left out.)
"""

import torch
import torch.nn as nn

BLOCK = 64
# The 16 NF4 levels as the paper's appendix lists them (bitsandbytes' table); the test rebuilds
# them from the normal quantiles (nf4_levels) and checks the two agree.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def nf4_levels(offset=0.9677083):
    """The levels from their definition: 8 positive quantiles of N(0, 1) between 1/2 and
    `offset`, 7 negative ones, and 0 (asymmetric, so that 0 is exact), divided by the largest."""
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (levels / levels.max()).float()


def quantize(weight):
    """weight (out, in), in*out a multiple of 64 -> codes (out*in/2,) uint8 (two 4-bit indices a
    byte, the first in the high half), absmax (out*in/64,) float32."""
    blocks = weight.detach().float().reshape(-1, BLOCK)  # (n, 64)
    absmax = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)  # (n,)
    normalised = blocks / absmax[:, None]  # in [-1, 1]
    levels = NF4.to(weight.device)
    middles = (levels[1:] + levels[:-1]) / 2  # the boundaries between neighbouring levels
    index = torch.bucketize(normalised, middles).to(torch.uint8).reshape(-1, 2)  # nearest level
    return (index[:, 0] << 4) | index[:, 1], absmax


def dequantize(codes, absmax, shape, dtype):
    """The weight back from quantize's output, in `dtype`: level * the block's absmax."""
    index = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1, BLOCK).long()  # (n, 64)
    levels = NF4.to(device=codes.device)
    return (levels[index] * absmax[:, None]).reshape(shape).to(dtype)


class NF4Linear(nn.Module):
    """A frozen nn.Linear stored in NF4 (its bias, if any, kept as it was)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.numel() % BLOCK:
            raise ValueError(f"--quantize nf4: a {tuple(linear.weight.shape)} weight does not "
                             f"split into blocks of {BLOCK}")
        self.shape = tuple(linear.weight.shape)
        codes, absmax = quantize(linear.weight)
        self.register_buffer("codes", codes)
        self.register_buffer("absmax", absmax)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @property
    def weight(self):
        """The dequantised weight, float32 (for merging adapters into it)."""
        return dequantize(self.codes, self.absmax, self.shape, torch.float32)

    def forward(self, x):
        dtype = torch.get_autocast_dtype(x.device.type) \
            if torch.is_autocast_enabled(x.device.type) else x.dtype
        if torch.is_grad_enabled():  # the backward dequantises again rather than keep the weight
            y = DequantisedProduct.apply(x, self.codes, self.absmax, self.shape, dtype)
        else:
            y = x.to(dtype) @ dequantize(self.codes, self.absmax, self.shape, dtype).T
        return y if self.bias is None else y + self.bias.to(y.dtype)


class DequantisedProduct(torch.autograd.Function):
    """y = x W^T with W dequantised in forward and again in backward (only x gets a gradient)."""

    @staticmethod
    def forward(ctx, x, codes, absmax, shape, dtype):
        ctx.save_for_backward(codes, absmax)
        ctx.shape, ctx.dtype, ctx.input_dtype = shape, dtype, x.dtype
        return x.to(dtype) @ dequantize(codes, absmax, shape, dtype).T

    @staticmethod
    def backward(ctx, grad):
        codes, absmax = ctx.saved_tensors
        weight = dequantize(codes, absmax, ctx.shape, ctx.dtype)
        return (grad.to(ctx.dtype) @ weight).to(ctx.input_dtype), None, None, None, None


def quantize_lora_bases(model):
    """Every LoRA adapter's frozen base projection to NF4, in place (after lora.add_lora)."""
    from variants.lora import LoRALinear
    for module in list(model.modules()):
        if isinstance(module, LoRALinear):
            module.base = NF4Linear(module.base)
    return model


def weight_bytes(model):
    """Bytes of the model's parameters and buffers, as stored."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
