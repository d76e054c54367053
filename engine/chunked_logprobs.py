"""Log-probs of given tokens without ever holding the (N, V) logits: the vocabulary projection in
chunks of rows, recomputed in backward. `model.token_logprobs` calls it for the trainer's
forwards: at a 152k vocabulary (Qwen2.5) and 8k completion tokens the fp32 logits alone are 5 GB.

    logp, entropy = chunked_logprobs(hidden (N, C), weight (V, C), targets (N,), temperature,
                                     chunk_rows, with_entropy, entropy_grad, softcap)

    python -m pytest tests/test_model.py -k token_logprobs   # against log_softmax of full logits
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class ChunkedLogprobs(torch.autograd.Function):
    """log p(target) = z[target] - logsumexp(z), z = cap(h W^T) / temperature, in row chunks;
    cap(u) = c * tanh(u / c) where the family soft-caps its logits (Gemma 2), else u.

    Forward keeps only the log-normaliser per row; backward recomputes each chunk's logits and
    writes the gradient dlogp/dz = onehot(target) - softmax(z) in place (times the cap's
    derivative 1 - tanh^2), so neither pass ever holds more than one (rows, V) chunk. Three
    vocabulary matrix products per chunk in all (one forward, two backward) plus one recompute:
    the price of never storing (N, V). Entropy, when asked for, is a value only (no gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_rows, with_entropy, softcap):
        # hidden (N, C), weight (V, C), targets (N,)
        compute = hidden.dtype  # under autocast the body's output dtype (e.g. bf16)
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
        ent = torch.zeros(N if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk_rows):
            z = F.linear(hidden[s:s + chunk_rows], weight.to(compute)).float()  # (n, V)
            if softcap:
                z = z.div_(softcap).tanh_().mul_(softcap)
            if temperature != 1.0:
                z.div_(temperature)
            lse[s:s + chunk_rows] = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk_rows] = z.gather(-1, targets[s:s + chunk_rows, None]).squeeze(-1) \
                - lse[s:s + chunk_rows]
            if with_entropy:  # H = log Z - E_p[z]
                p = torch.exp(z - lse[s:s + chunk_rows, None])
                ent[s:s + chunk_rows] = lse[s:s + chunk_rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_rows, ctx.softcap = temperature, chunk_rows, softcap
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        compute, cap = hidden.dtype, ctx.softcap
        w = weight.to(compute)
        grad_hidden = torch.empty_like(hidden)  # (N, C)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], ctx.chunk_rows):
            h = hidden[s:s + ctx.chunk_rows]
            g = grad_logp[s:s + ctx.chunk_rows].float()  # (n,)
            z = F.linear(h, w).float()  # (n, V) recomputed
            if cap:
                tanh = z.div_(cap).tanh_()  # (n, V), in z's memory
                z = tanh * cap
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            dz = z.sub_(lse[s:s + ctx.chunk_rows, None]).exp_().mul_(-g[:, None])  # -g p
            dz.scatter_add_(-1, targets[s:s + ctx.chunk_rows, None], g[:, None])  # + g onehot
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if cap:  # d cap(u) / du = 1 - tanh(u / c)^2
                dz.mul_(1 - tanh.square_())
            dz = dz.to(compute)
            grad_hidden[s:s + ctx.chunk_rows] = dz @ w  # (n, C)
            grad_weight += (dz.t() @ h).float()  # (V, C)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def _chunk_logprobs(hidden, head_weight, targets, temperature, softcap=None):
    """One chunk of ChunkedLogprobs' forward by autograd, differentiable in the entropy too."""
    logits = F.linear(hidden, head_weight.to(hidden.dtype)).float()  # (n, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (n,)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz  # (n,)
    probs = torch.softmax(logits, dim=-1)
    return logp, logz - (probs * logits).sum(-1)  # H = log Z - E_p[logit]


def chunked_logprobs(hidden, weight, targets, temperature, chunk_rows, with_entropy, entropy_grad,
                     softcap=None):
    """hidden (N, C), weight (V, C), targets (N,) -> log p(target) (N,) float32 and the entropy of
    each row's distribution ((N,) with with_entropy or entropy_grad, else empty), chunk_rows rows
    at a time.
    With entropy_grad the entropy carries a gradient (an entropy bonus): each chunk by autograd
    under activation checkpointing, which recomputes it in backward as ChunkedLogprobs does."""
    if not entropy_grad:
        return ChunkedLogprobs.apply(hidden, weight, targets, temperature, chunk_rows,
                                     with_entropy, softcap)
    parts = [checkpoint(_chunk_logprobs, hidden[s:s + chunk_rows], weight,
                        targets[s:s + chunk_rows], temperature, softcap, use_reentrant=False)
             for s in range(0, hidden.shape[0], chunk_rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
