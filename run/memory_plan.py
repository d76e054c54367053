"""A run's memory per rank, planned from the model's config.json and the flags before any weight
loads: train.py prints it in its header, refuses a run that cannot fit its GPU (naming each term),
and `--plan-only` prints it alone. The arithmetic, P parameters (P_t of them trained):

  state     fp32 weights 4P, gradients 4P_t, AdamW's two moments 8P_t, and under DDP its gradient
            buckets 4P_t (the copy it all-reduces); under FSDP (FSDP2) these are split over the
            ranks; the sampler's bf16 copy 2P (whole on every rank); a frozen reference 4P;
            --teacher's model, P_T of its own parameters, whole on every rank: 2P_T in bf16 on
            a GPU under bf16, else 4P_T (its scoring pass keeps nothing for backward: its
            working set, a block's and the head's chunk, is below the update's)
  update    autocast's bf16 copies of the weights, held from the forward to the backward, 2P
            (under FSDP the gathered weights instead: the root's and two blocks');
            the largest micro-batch's activations kept for backward, N tokens x a, where a block
            keeps a token's (bf16 autocast; C hidden, C_kv key/value width, I the MLP's):
                2 RMSNorms x 8C (fp32 input and normalised), the inputs of q/k/v cast 3 x 2C, q and
                k after RoPE 2C + 2C_kv, v 2C_kv, the attention output 2C and its copy for the
                output projection 2C, the MLP's two casts 2 x 2C, gate, act(gate), up and
                their product 4 x 2I:  a = 32C + 4C_kv + 8I   (Qwen2.5-1.5B: 119 KiB a block)
            (float32: 36C + 8C_kv + 16I); with activation checkpointing a block keeps only its
            fp32 input 4C, and one block's full set exists again while it is recomputed;
            the final norm and the hidden states the log-probs keep 12C; the log-probs' head
            (chunked_logprobs.py) in chunks of n = 64 positions of each of a micro-batch's rows
            (--micro-batch-size of them: short rows pack as many), at its peak in backward: the
            hidden states' gradient 4C a token, the head's fp32 gradient 4VC, and under autocast
                max(10nV, 6nV + 2VC, 4nV + 6VC)
            a chunk's fp32 logits z beside the next chunk's bf16 product and its fp32 copy, or
            beside the weight gradient's products dz^T h, bf16 then fp32 (float32: max(8nV,
            4nV + 4VC); Gemma 2's cap: + 4nV); the head's bf16 copy is autocast's, one of its 2P
  rollout   the KV cache, 2 (keys, values) x layers x C_kv x 2 bytes (bf16) a position, every row at
            its longest at once if the memory allows (the pool holds at most 90% of what is free,
            and needs one row at its longest); the decode step, R rows at once (--max-rows, else
            all), S the widest row's positions in whole blocks, w the sampler's bytes a weight,
            H query heads, the larger of one layer's attention and the draw, never at once:
                attention = R x S x (2 C_kv w + H (w + 8))   (float32: H x 8, Gemma 2's cap H x 12)
                draw      = R x V x 16   (temperature != 1: 20; top-p: + 17; paged.draw_bytes)
            the attention gathers each row's keys and values through its table (2 C_kv w) and
            holds its scores masked, in fp32 and their softmax (w + 8); the draw holds fp32
            logits, shifted, their exp and inverse_cdf's padded copy. A CPU's eager steps keep
            every layer's rows gathered through the draw too, L x R x S x 2 C_kv w; CUDA graphs
            pad R and S's blocks to powers of two, and hold the step again in their pool
  (under FSDP rank 0 reads the whole model on the host, 4P there, and sends each rank its shards:
  no phase holds more of a GPU than the two above)

The longest row is the prompt's bound (--micro-batch-tokens, else the model's context, less
--max-new-tokens) plus --max-new-tokens: the plan reads no data. tests/test_memory_plan.py
checks each term against what the CPU allocates for tiny models.
"""
import math
import os
import sys
from dataclasses import dataclass

import torch

from engine.paged import (EngineOptions, decode_attention_bytes, decode_working_bytes, draw_bytes,
                          gathered_bytes, padded, unfit)
from model import ModelConfig, PagedKVCache, Transformer
from run import config

GIB = 2 ** 30
BLOCK = EngineOptions.block_size  # positions a KV block holds (train.py's engine: the default)


def size(n: float) -> str:
    """Bytes for a reader: '12.34 GiB', '512.0 MiB', '3.0 KiB'."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale or unit == "KiB":
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"


def millions(n: int) -> str:
    return f"{n / 1e6:,.0f}M" if n >= 1e6 else f"{n:,}"


@dataclass(frozen=True)
class Term:
    phase: str  # "state" (all the time), "update" or "rollout"
    name: str
    bytes: float
    arithmetic: str  # how it was counted, for the header and the refusal


def meta_model(cfg: ModelConfig, lora_rank: int = 0) -> Transformer:
    """The model `cfg` describes on the meta device (shapes, no memory), with LoRA's adapters
    where --lora-rank asks."""
    with torch.device("meta"):
        model = Transformer(cfg)
        if lora_rank:
            from variants.lora import add_lora
            add_lora(model, rank=lora_rank)
    return model


def parameter_counts(cfg: ModelConfig, lora_rank: int = 0) -> tuple[int, int]:
    """(all parameters, trained ones): tied embeddings once."""
    params = list(meta_model(cfg, lora_rank).parameters())  # (parameters() yields a tied one once)
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def gathered_parameters(cfg: ModelConfig) -> int:
    """What FSDP holds whole at once in a forward or backward: the root's weights (embeddings,
    final norm, head) and two blocks (the one running, the next one prefetched)."""
    model = meta_model(cfg)
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    return sum(p.numel() for p in model.parameters()) - sum(blocks) + 2 * max(blocks)


def block_activation_bytes(cfg: ModelConfig, layer: int, bf16: bool) -> int:
    """Bytes a token block `layer` keeps for backward: the module docstring's count, tensor by
    tensor (bf16 autocast: the norms' fp32 input and normalised copies, each linear's bf16 input,
    the attention's q, k, v and output; float32: no casts, one input shared by q/k/v)."""
    C, kv, q = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim
    norms = (4 if cfg.gemma else 2) * 8 * C  # input and input / rms, fp32 (Gemma: four norms)
    if bf16:
        attention = 6 * C + 2 * q + 4 * kv + 2 * q  # 3 input casts; q, k, v; the output
    else:
        attention = 4 * C + 4 * q + 8 * kv + 4 * q  # the normed input; q, k, v; the output
    if cfg.qk_norm:  # Qwen3, Gemma 3: a norm on every head of q and k
        attention += (6 if bf16 else 8) * (q + kv)
    width = 2 if bf16 else 4
    if cfg.num_experts and cfg.moe_layers[layer]:  # the router, then k experts a token
        k, inner = cfg.experts_per_token, cfg.moe_intermediate_size
        mlp = (2 * C if bf16 else 0) + 4 * cfg.num_experts + k * ((10 if bf16 else 12) * C + 4 * width * inner)
    else:  # the input (two casts under autocast); gate, act(gate), up, their product
        mlp = 4 * C + 4 * width * cfg.intermediate_size
    return norms + attention + mlp


def kept_bytes(cfg: ModelConfig, row_length: int, bf16: bool, checkpointing: bool) -> int:
    """Bytes a token the update's forward keeps for backward, in rows of `row_length`: every
    block's (with checkpointing each block's fp32 input only), then the final norm's and the
    hidden states the log-probs keep, 12C."""
    C, L = cfg.hidden_size, cfg.num_layers
    if checkpointing:
        return L * 4 * C + 12 * C
    kept = sum(block_activation_bytes(cfg, i, bf16) for i in range(L)) + 12 * C
    if cfg.attn_softcap:  # Gemma 2's capped scores: (heads, row) a token in every layer
        kept += L * cfg.num_heads * row_length * 8
    return kept


def activation_bytes(cfg: ModelConfig, tokens: int, row_length: int, bf16: bool,
                     checkpointing: bool) -> float:
    """The update's peak above the state for `tokens` positions in rows of at most `row_length`,
    the head aside (`head_bytes`): what the forward keeps, and one block's insides again while it
    is recomputed (checkpointing)."""
    per_token = kept_bytes(cfg, row_length, bf16, checkpointing)
    if checkpointing:
        per_token += max(block_activation_bytes(cfg, i, bf16) for i in range(cfg.num_layers)) \
            + (cfg.num_heads * row_length * 8 if cfg.attn_softcap else 0)
    return tokens * per_token


def head_bytes(cfg: ModelConfig, chunk: int, tokens: int, bf16: bool) -> float:
    """The log-probs' head beside what the forward keeps (engine/chunked_logprobs.py), n = `chunk`
    rows a chunk of `tokens` positions: the hidden states' float32 gradient 4 x tokens x C, the
    head's float32 gradient 4VC, and the larger of a chunk's float32 logits z beside the next
    chunk's, made under autocast as a bf16 product and its float32 copy (10nV; float32 8nV), and
    the chunk's weight gradient dz^T h: under autocast z, dz cast to bf16 and the bf16 product
    (6nV + 2VC), then z, the product and its float32 copy (4nV + 6VC); float32 4nV + 4VC. Gemma
    2's capped logits keep tanh(z / cap) beside z through the chunk, 4nV more. The head's bf16
    copy is autocast's, cached with the body's ("autocast copies")."""
    C, V, n = cfg.hidden_size, cfg.vocab_size, chunk
    if bf16:
        chunks = max(10 * n * V, 6 * n * V + 2 * V * C, 4 * n * V + 6 * V * C)
    else:
        chunks = max(8 * n * V, 4 * n * V + 4 * V * C)
    cap = 4 * n * V if cfg.final_softcap else 0
    return 4 * tokens * C + 4 * V * C + chunks + cap


def kv_bytes_per_position(cfg: ModelConfig, bf16: bool) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if bf16 else 4)


def plan(cfg: ModelConfig, *, world: int, distributed: bool, fsdp: bool, bf16: bool,
         lora_rank: int, reference: bool, rows: int, longest_row: int, micro_batch_size: int,
         micro_batch_tokens: int, checkpointing: bool, kv_budget: float = 0.0,
         capacity: float | None = None, cuda_graphs: bool = False, kept_rows: bool = False,
         max_rows: int = 0, draw: int = 16, teacher: tuple = (0, 4)) -> list[Term]:
    """The terms of one rank's memory: `rows` its rollout rows a step (`max_rows` of them
    decoding at once where given), `capacity` the device's bytes where known (the KV pool then
    holds what is left, as paged.pool_blocks sizes it), `cuda_graphs` whether the decode steps
    replay as CUDA graphs (their pool is memory apart), `kept_rows` whether they keep the rows
    gathered (a CPU's eager steps: speed.KeptRowsKVCache), `draw` the draw's bytes a row a
    vocabulary entry (paged.draw_bytes of the sampling flags), `teacher` the --teacher's
    (parameters, bytes a parameter): (0, _) for none."""
    P, trained = parameter_counts(cfg, lora_rank)
    split = world if fsdp else 1  # FSDP2 shards weights, gradients and optimizer state
    over = f" / {world} ranks" if fsdp else ""
    terms = [Term("state", "weights", 4 * P / split, f"4 B x {millions(P)} fp32{over}"),
             Term("state", "gradients", 4 * trained / split, f"4 B x {millions(trained)}{over}"),
             Term("state", "AdamW moments", 8 * trained / split, f"8 B x {millions(trained)}{over}")]
    if distributed and not fsdp:
        terms.append(Term("state", "DDP buckets", 4 * trained, f"4 B x {millions(trained)}"))
    if (bf16 and not lora_rank) or fsdp:
        width = 2 if bf16 else 4
        terms.append(Term("state", "sampler copy", width * P, f"{width} B x {millions(P)}"))
    if reference:
        terms.append(Term("state", "reference", 4 * P / split, f"4 B x {millions(P)}{over}"))
    if teacher[0]:
        terms.append(Term("state", "teacher", teacher[1] * teacher[0], f"{teacher[1]} B x {millions(teacher[0])}"))
    if fsdp:  # gathered in the compute dtype (bf16 on CUDA with bf16: sharding.shard's policy)
        whole, width = gathered_parameters(cfg), 2 if bf16 else 4
        terms.append(Term("update", "gathered weights", width * whole,
                          f"{width} B x {millions(whole)}: the root and 2 blocks"))
    elif bf16:
        terms.append(Term("update", "autocast copies", 2 * P, f"2 B x {millions(P)}"))
    tokens = min(micro_batch_size * longest_row, micro_batch_tokens or math.inf)
    how = "checkpointed" if checkpointing else \
        f"{size(block_activation_bytes(cfg, 0, bf16))} a token a block"
    terms.append(Term("update", "activations",
                      activation_bytes(cfg, tokens, longest_row, bf16, checkpointing),
                      f"{tokens:,} tokens, {how}"))
    # The plan reads no data: a micro-batch may hold --micro-batch-size rows however short they
    # are (--micro-batch-tokens packs short rows as many), and the head's chunk is 64 positions
    # of each row, within the micro-batch's tokens.
    chunk = min(tokens, micro_batch_size * 64)
    terms.append(Term("update", "log-prob head", head_bytes(cfg, chunk, tokens, bf16),
                      f"chunks of n = {chunk:,} positions: "
                      + ("max(10nV, 6nV + 2VC, 4nV + 6VC) + 4VC" if bf16 else
                         "max(8nV, 4nV + 4VC) + 4VC") + (" + 4nV" if cfg.final_softcap else "")
                      + " + 4C a token"))
    width = 2 if bf16 and (fsdp or not lora_rank) else 4  # the sampler's weights (launch.py)
    rollout = decode_terms(cfg, min(rows, max_rows or rows), -(-longest_row // BLOCK) * BLOCK,
                           width, cuda_graphs, kept_rows, draw)
    return terms + [kv_pool(cfg, terms + rollout, rows, longest_row, bf16, kv_budget, capacity)] + rollout


def decode_terms(cfg, rows, positions, width, cuda_graphs, kept_rows, draw) -> list[Term]:
    """The decode step's terms, `rows` at once, the widest table `positions` long: what
    paged.decode_working_bytes counts (and paged.pool_blocks leaves free), said term by term;
    under CUDA graphs the step padded to its bucket, and again in the graphs' own pool."""
    r, S = padded(rows, positions, BLOCK) if cuda_graphs else (rows, positions)
    step = decode_working_bytes(cfg, r, positions=S, block_size=BLOCK, width=width,
                                kept_rows=kept_rows, draw=draw)
    attention, gathered = decode_attention_bytes(cfg, r, S, width), gathered_bytes(cfg, r, S, width)
    drawn = size(r * cfg.vocab_size * draw)
    at = f"{r:,} rows{' (a bucket)' if cuda_graphs else ''} at {S:,} positions"
    if kept_rows:
        how = (f"{at}: {cfg.num_layers} layers' keys and values kept gathered, "
               f"{size(cfg.num_layers * gathered)}, and the larger of a layer's scores, "
               f"{size(attention - gathered)}, and the draw, V x {draw} B a row, {drawn}")
    else:
        how = (f"{at}: the larger of a layer's gathered keys, values and scores, "
               f"{size(attention)}, and the draw, V x {draw} B a row, {drawn}")
    terms = [Term("rollout", "decode step", step, how)]
    if cuda_graphs:
        terms.append(Term("rollout", "CUDA graphs", step, "the decode step again, in their pool"))
    return terms


def kv_pool(cfg, terms, rows, longest_row, bf16, kv_budget, capacity) -> Term:
    """The KV cache's term: every row at its longest at once, or the pool the budget (--kv-budget,
    or on a GPU 90% of what the other rollout terms leave) holds; rows beyond it wait."""
    per_row = longest_row * kv_bytes_per_position(cfg, bf16)
    need, limit = rows * per_row, kv_budget * GIB if kv_budget else math.inf
    if capacity:
        others = sum(t.bytes for t in terms if t.phase in ("state", "rollout"))
        limit = min(limit, 0.9 * max(0.0, capacity - others))
    pool = min(need, limit)
    at_once = f"{int(pool // per_row)} of {rows} rows" if pool < need else f"all {rows} rows"
    return Term("rollout", "KV cache", pool, f"{at_once} at {longest_row:,} positions x "
                f"{size(kv_bytes_per_position(cfg, bf16))} (all: {size(need)})")


def phase_peaks(terms: list[Term]) -> dict[str, float]:
    """Bytes at each phase's peak: the state plus that phase's own terms."""
    state = sum(t.bytes for t in terms if t.phase == "state")
    return {phase: state + sum(t.bytes for t in terms if t.phase == phase)
            for phase in ("rollout", "update")}


def describe(terms: list[Term]) -> str:
    """The plan as lines: each term with its arithmetic, then each phase's peak."""
    lines = [f"  {t.phase:8} {t.name:16} {size(t.bytes):>11}   {t.arithmetic}" for t in terms]
    return "\n".join(lines + ["  peak     " + ", ".join(
        f"{phase} {size(b)}" for phase, b in phase_peaks(terms).items())])


def refusal(terms: list[Term], longest_row: int, cfg: ModelConfig, bf16: bool,
            capacity: float) -> str | None:
    """Why the run cannot fit `capacity` bytes a rank, or None: a phase over it, or a KV pool
    that cannot hold one row at its longest."""
    over = {phase: b for phase, b in phase_peaks(terms).items() if b > capacity}
    pool = next(t.bytes for t in terms if t.name == "KV cache")
    if pool < longest_row * kv_bytes_per_position(cfg, bf16):
        over["rollout"] = phase_peaks(terms)["rollout"] - pool + longest_row * kv_bytes_per_position(cfg, bf16)
    if not over:
        return None
    worst = ", ".join(f"the {phase} needs {size(b)}" for phase, b in over.items())
    return (f"the memory plan does not fit {size(capacity)} a rank: {worst} (the plan's "
            f"terms are printed above); lower --micro-batch-tokens or --max-new-tokens, turn "
            f"--activation-checkpointing on, use --fsdp, more ranks or --lora-rank; or "
            f"--no-memory-check to run anyway")


def for_run(args, cfg: ModelConfig, *, world: int, distributed: bool, cuda: bool,
            longest_prompt: int | None, capacity: float | None) -> tuple[list[Term], int, bool]:
    """train.py's plan: its flags `args`, the model `cfg`, `world` ranks (DDP's buckets where
    `distributed`), planned for CUDA or not, the data's longest prompt (None: the most the flags
    allow) -> (terms, the longest row, bf16)."""
    room = min(cfg.max_seq_len, args.micro_batch_tokens or cfg.max_seq_len)
    longest_row = room if longest_prompt is None else min(room, longest_prompt + args.max_new_tokens)
    parameters, _ = parameter_counts(cfg)
    bf16 = config.uses_bf16(args, cuda)
    graphs = config.graphs_choice(args, cuda) and not cfg.num_experts  # an MoE's step: eager
    # speedups.step_function's plain step, which SpeedUps.choose runs on kept rows on a CPU
    eager = cfg.num_experts or not graphs and config.compile_choice(args) is not True
    terms = plan(cfg, world=world, distributed=distributed, fsdp=args.fsdp, bf16=bf16,
                 lora_rank=args.lora_rank, rows=args.prompts_per_step // world * args.samples,
                 reference=config.needs_reference(args) and args.ref == "frozen",
                 longest_row=longest_row, micro_batch_size=args.micro_batch_size,
                 micro_batch_tokens=args.micro_batch_tokens, kv_budget=args.kv_budget,
                 checkpointing=config.checkpoints_activations(args, parameters, cuda),
                 capacity=capacity, cuda_graphs=graphs, max_rows=args.max_rows,
                 # (kept where every row fits half the host's memory: paged.default_kv_budget)
                 kept_rows=bool(not cuda and not args.kv_budget and eager),
                 draw=draw_bytes(args.temperature, args.top_p), teacher=teacher_size(args, cuda))
    return terms, longest_row, bf16


def teacher_size(args, cuda: bool) -> tuple:
    """--teacher's (parameters, bytes a parameter) from its config.json (distill.load_teacher's
    dtype); (0, 4) without one."""
    if not getattr(args, "teacher", None):
        return 0, 4
    from run import checkpoints
    parameters, _ = parameter_counts(checkpoints.load_config(args.teacher))
    return parameters, 2 if config.uses_bf16(args, cuda) and cuda else 4


def device_capacity(device) -> float | None:
    """A CUDA device's bytes (None on a CPU: no refusal there, the system pages)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def check_before_loading(args, cfg: ModelConfig, longest_prompt: int | None, world: int,
                         capacity: float, rank: int):
    """train.py's setup on a GPU of `capacity` bytes, before the weights load: the plan, printed
    (rank 0), and a run that cannot fit refused with the arithmetic (unless --no-memory-check)."""
    terms, longest_row, bf16 = for_run(args, cfg, world=world, distributed=torch.distributed.is_initialized(),
                                       cuda=True, longest_prompt=longest_prompt, capacity=capacity)
    if rank == 0:
        print(heading(world, capacity, longest_row) + "\n" + describe(terms), flush=True)
    why = refusal(terms, longest_row, cfg, bf16, capacity)
    if why and not args.no_memory_check:
        raise SystemExit(f"train.py: {why}")


def plan_only(args, load_data) -> int:
    """train.py --plan-only [GIB]: the plan for WORLD_SIZE ranks, printed; nothing loads but
    config.json, the tokenizer and the data (where they can be read, by train.py's
    `load_data(args, tokenizer, context)`). -> exit status: 1 when a GPU's size is known and the
    plan does not fit it."""
    import data
    from run import checkpoints, runs
    world, rank = os.environ.get("WORLD_SIZE", "1"), int(os.environ.get("RANK", "0"))
    if not (world.isascii() and world.isdigit()) or int(world) < 1:
        raise SystemExit(f"train.py: --plan-only plans for WORLD_SIZE ranks: a whole number >= 1, "
                         f"got {world!r}")
    world = int(world)
    try:
        cfg = checkpoints.load_config(args.model)
    except (OSError, ValueError) as e:
        raise SystemExit(f"train.py: --model: {e}")
    try:
        teacher_size(args, True)
    except (OSError, ValueError) as e:  # (a traceback's text in one line)
        raise SystemExit(f"train.py: --teacher: {runs.first_line(e)}")
    local = str(args.data).startswith(("arithmetic", "memory", "countdown")) or \
        os.path.exists(str(args.data))  # (the tasks made here, or a file)
    try:  # the data's longest prompt, where the tokenizer and the data are here (a hub dataset is
        # not walked for a plan)
        if not local:
            raise FileNotFoundError(f"{args.data} is read from the hub when training")
        tokenizer = checkpoints.load_tokenizer(args.model)
        args.template = args.template or data.default_template(args.data)
        longest, note = data.longest_prompt(load_data(args, tokenizer, cfg.max_seq_len)[0], tokenizer,
                                            args.template), ""
        if longest == 0:  # (transformers makes a tokenizer of a config.json alone: no vocabulary)
            raise ValueError(f"{args.model}'s tokenizer made no token of a prompt")
    except (OSError, ValueError, data.DataError) as e:
        longest, note = None, f"; the prompts at their bound: {str(e).splitlines()[0]}"
    cuda = bool(args.plan_only) or torch.cuda.is_available()
    capacity = args.plan_only * GIB if args.plan_only else \
        device_capacity(torch.device("cuda")) if cuda else None
    terms, longest_row, bf16 = for_run(args, cfg, world=world, distributed="RANK" in os.environ or world > 1,
                                       cuda=cuda, longest_prompt=longest, capacity=capacity)
    refuse_small_kv_budget(args, cfg, longest, bf16)  # as the run itself refuses it, by name
    why = refusal(terms, longest_row, cfg, bf16, capacity) if capacity else None
    if rank == 0:
        print(heading(world, capacity, longest_row, note) + "\n" + describe(terms) + "\n"
              + (why or ("fits" if capacity else "")), flush=True)
    return 1 if why else 0


def refuse_small_kv_budget(args, cfg, longest_prompt, bf16):
    """A --kv-budget that cannot hold one row at its longest (the data's longest prompt as
    data.longest_prompt estimates it, and --max-new-tokens, in the sampler's dtype) stops the run
    here, before any weight loads, with the arithmetic: every rollout would refuse it. (A longer
    prompt than the estimate is still refused by the rollout that meets it.)"""
    if not args.kv_budget or longest_prompt is None:
        return
    block_size = EngineOptions.block_size
    sampler_dtype = torch.bfloat16 if bf16 and (args.fsdp or not args.lora_rank) else torch.float32
    block_bytes = PagedKVCache.bytes_per_block(cfg, block_size, sampler_dtype)
    why = unfit(longest_prompt, args.max_new_tokens, block_size, block_bytes,
                      int(args.kv_budget * 2**30 // block_bytes))
    if why:
        sys.exit(f"train.py: --kv-budget {args.kv_budget:g} GiB: {why}: raise --kv-budget, or "
                 f"lower --max-new-tokens")


def heading(world, capacity, longest_row, note="") -> str:
    """The plan's first line: for how many ranks, what GPU, how long a row."""
    gpus = f", GPUs of {size(capacity)}" if capacity else ""
    return f"memory plan a rank ({world} rank(s){gpus}; rows up to {longest_row:,} positions{note}):"
