"""Mixture-of-Experts MLPs (Qwen3-MoE, Mixtral): the router and its experts, the record of which
experts each token went to (routing replay, for RL), and the load-balancing loss.

    routing = Routing()                              # the sampler records
    model(ids, routing=routing)
    model(ids, routing=Routing(replay=routing.stacked(cfg)))   # the update replays
    aux = load_balancing_loss(routing, cfg.num_experts, cfg.experts_per_token, attention_mask)

model.py's Block builds an MoE in place of its MLP on the layers cfg.moe_layers marks.
Tests: `python -m pytest tests/test_model.py -k moe`.
"""

import torch
import torch.nn as nn


class Routing:
    """The experts each token was routed to, per MoE layer, recorded by a forward pass; or given
    to a forward pass to replay (RL routing replay: the update recomputes the sampler's network,
    not a differently-routed one, so the importance ratio compares like with like).

        routing = Routing()                  # record
        model(ids, routing=routing)          # routing.experts: {layer: (B, T, k)}, .logits
        model(ids, routing=Routing(replay=routing.stacked(cfg)))   # the same experts again

    replay: (B, T, L, k) expert ids per token and layer; -1 entries route freely (top-k), e.g.
    padding, or a token the sampler never fed. `logits` keeps each MoE layer's router logits
    (B*T, E) with their graph, for the load-balancing loss.
    """

    def __init__(self, replay: torch.Tensor | None = None):
        self.replay = replay
        self.experts = {}  # layer -> (B, T, k) long
        self.logits = {}  # layer -> (B*T, E)

    def reordered(self, order):
        """A Routing for these tokens reordered within each row, as Transformer.forward packs
        padded rows: token t of row b is token order[b, t] here (order (B, T)); the replay alike."""
        if self.replay is None:
            return Routing()
        index = order.to(self.replay.device)[:, :, None, None].expand_as(self.replay)
        return Routing(self.replay.gather(1, index))  # (B, T, L, k)

    def record_back(self, inner, order):
        """Records what `inner` (this routing `reordered` by order) recorded, in the rows' own
        token order: experts (B, T, k) and router logits (B*T, E), whose graph stays."""
        back = torch.argsort(order, dim=1)  # (B, T): where each token went
        B, T = back.shape
        flat = (back + T * torch.arange(B, device=back.device)[:, None]).reshape(-1)  # (B*T,)
        for layer, experts in inner.experts.items():
            self.experts[layer] = experts.gather(1, back[:, :, None].expand_as(experts))
        for layer, logits in inner.logits.items():
            self.logits[layer] = logits[flat]

    def stacked(self, cfg) -> torch.Tensor:
        """-> (B, T, L, k) long: the recorded experts, -1 for dense layers."""
        some = next(iter(self.experts.values()))  # (B, T, k)
        out = torch.full((*some.shape[:2], cfg.num_layers, some.shape[2]), -1,
                         dtype=torch.long, device=some.device)
        for layer, experts in self.experts.items():
            out[:, :, layer] = experts
        return out


class MoE(nn.Module):
    """Sparse MLP (Qwen3-MoE, Mixtral): a router picks k of E expert MLPs per token,

        p = softmax(x W_r^T),  S = top-k(p),  y = sum_{e in S} w_e * MLP_e(x)
        w_e = p_e (or p_e / sum_{S} p, with norm_topk_prob)

    Tokens are grouped by expert (one sort), so each expert runs one matrix product on all of
    its tokens: a loop over E experts, never over tokens.
    """

    def __init__(self, cfg, experts: list[nn.Module]):
        """cfg: the model's ModelConfig; experts: its E expert MLPs (model.py's MLP)."""
        super().__init__()
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk_prob
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(experts)

    def forward(self, x, routing: Routing | None = None, layer: int = 0):
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        logits = self.router(flat)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        chosen = probs.topk(self.top_k, dim=-1).indices  # (N, k)
        if routing is not None and routing.replay is not None:
            replay = routing.replay[:, :, layer].reshape(B * T, self.top_k).to(chosen.device)
            chosen = torch.where(replay >= 0, replay, chosen)  # (N, k)
        weights = probs.gather(-1, chosen)  # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if routing is not None:
            routing.experts[layer] = chosen.view(B, T, self.top_k)
            routing.logits[layer] = logits
        return self.mix(flat, chosen, weights.to(x.dtype)).view(B, T, C)

    def mix(self, flat, chosen, weights):
        """sum over each token's k experts of weight * expert(token); flat (N, C)."""
        pair_expert = chosen.reshape(-1)  # (N*k,) the expert of each (token, slot) pair
        order = pair_expert.argsort(stable=True)  # (N*k,) pairs grouped by expert
        pair_token = order // self.top_k  # (N*k,) the token of each grouped pair
        counts = torch.bincount(pair_expert, minlength=len(self.experts)).tolist()  # (E,)
        grouped = flat.index_select(0, pair_token)  # (N*k, C)
        outs = [expert(part) for expert, part in zip(self.experts, grouped.split(counts))]
        y = torch.cat(outs) * weights.reshape(-1)[order, None]  # (N*k, C)
        return torch.zeros_like(flat).index_add(0, pair_token, y)  # (N, C)


def load_balancing_loss(routing: Routing, num_experts: int, top_k: int, attention_mask=None):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6), as transformers'
    load_balancing_loss_func computes it over all MoE layers at once:

        f_e = (top-k assignments to e) / (tokens), P_e = mean router probability of e,
        aux = E * sum_e f_e P_e      (1 * k when perfectly balanced)

    counting only real tokens (attention_mask (B, T)) over every layer's rows together.
    """
    logits = torch.cat([routing.logits[i] for i in sorted(routing.logits)])  # (L*N, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (L*N, E)
    layers = len(routing.logits)
    real = (torch.ones(probs.shape[0], device=probs.device) if attention_mask is None
            else attention_mask.reshape(-1).float().repeat(layers))  # (L*N,)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, k)
    counts = torch.zeros(num_experts, device=probs.device).index_add(
        0, chosen.reshape(-1), real.repeat_interleave(top_k))  # (E,)
    f = counts / real.sum()
    P = (probs * real[:, None]).sum(0) / real.sum()
    return num_experts * (f * P).sum()


def replay_layout(routes, prompts, tokens, width, num_layers, top_k):
    """The sampler's experts (routes[i]: (len(prompts[i]) + len(tokens[i]), L, k)) laid out as
    data.pack lays out the tokens -> (b, P + width, L, k), -1 (route freely) on padding and on
    tokens the sampler never fed."""
    P = max(len(p) for p in prompts)
    replay = torch.full((len(routes), P + width, num_layers, top_k), -1, dtype=torch.long)
    for j, (route, p, t) in enumerate(zip(routes, prompts, tokens)):
        replay[j, P - len(p):P + len(t)] = route.long()  # prompt left-padded
    return replay


def router_loss(routing: Routing, cfg, attention_mask, weight: float):
    """One forward's load-balancing loss -> (loss, named sums for the log: the loss counted once
    per forward that carries weight, i.e. not for a stand-in)."""
    aux = load_balancing_loss(routing, cfg.num_experts, cfg.experts_per_token, attention_mask)
    counted = float(weight > 0)
    return aux, {"router_aux_loss": float(aux) * counted, "router_aux_batches": counted}



def replay_rows(routes, prompts, tokens, rows, width, cfg, device):
    """--routing-replay: the sampler's experts of `rows` (routes[i] per row of a batch) laid out
    as data.pack lays out their tokens (`replay_layout`), on `device`; None where the batch
    recorded none (a stand-in micro-batch)."""
    if routes is None:
        return None
    return replay_layout([routes[i] for i in rows], [prompts[i] for i in rows],
                         [tokens[i] for i in rows], width, cfg.num_layers,
                         cfg.experts_per_token).to(device)
